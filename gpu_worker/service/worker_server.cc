#include "gpu_worker/service/worker_server.h"

#include "gpu_worker/service/worker_state.h"

#include "common/random.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"

#include "common/etcd/etcd_client.h"
#include "common/fingerprint.h"
#include "common/metrics/http_server.h"
#include "common/metrics/metrics.h"
#include "common/utf8.h"
#include "model/model.h"
#include "model/model_info.h"
#include "model/prompt.h"
#include "gpu_worker/service/api_convert.h"
#include "gpu_worker/service/event_log.h"
#include "proto/grpc_health.h"
#include "proto/grpc_status.h"
#include "proto/grpc_tls.h"
#include "proto/worker.grpc.pb.h"

namespace sparsex::service {

using internal::Clock;
using internal::LogLine;
namespace wpb = sparsex::worker::v1;


WorkerServer::WorkerServer() : s_(std::make_unique<State>()) {}

WorkerServer::~WorkerServer() { Shutdown(); }

namespace internal {

absl::StatusOr<std::string> ResolveReuseBudget(const std::string& model_fingerprint,
                                               bool auto_budget, ReuseOptions& reuse) {
  // The calibration known without a file: stories260K's, measured by `sparsex fidelity
  // --calibration-out` (docs/quality_calibration.stories260K.json).
  static const QualityCalibration kBuiltin{.selector = "sparsex",
                                           .model_fingerprint = "8fa7d654353b45a8f6cacbc13e2d9a46",
                                           .drop_per_uncovered = {-1.0f, 0.07981f, 0.05282f}};
  QualityCalibration& calib = reuse.calibration;
  if (calib.drop_per_uncovered.empty() && model_fingerprint == kBuiltin.model_fingerprint) {
    calib = kBuiltin;
  }
  const bool calibrated = !calib.drop_per_uncovered.empty();
  BudgetOptions& b = reuse.budget;
  if (!auto_budget) {
    if (b.mode == BudgetOptions::Mode::kQuality && !calibrated) {
      return absl::InvalidArgumentError(
          "worker: --budget quality needs a calibration of this model (--quality_calibration "
          "FILE from `sparsex fidelity --calibration-out`), or use --budget fixed");
    }
    return std::string();
  }
  b.mode = calibrated ? BudgetOptions::Mode::kQuality : BudgetOptions::Mode::kFixed;
  if (calibrated) return absl::StrCat("reuse budget: quality (target drop ", b.target_drop, ")");
  return absl::StrCat("reuse budget: fixed r = ", b.ratio,
                      " (no quality calibration of this model: `sparsex fidelity "
                      "--calibration-out`, then --quality_calibration)");
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(const WorkerOptions& options) {
  std::unique_ptr<WorkerServer> w(new WorkerServer());
  State& s = *w->s_;
  s.opts = options;
  if (options.model_path.empty()) return absl::InvalidArgumentError("worker: --model is required");
  RETURN_IF_ERROR(CheckTlsFiles(options.tls));
  if (!options.tls.enabled()) {
    RETURN_IF_ERROR(CheckPlaintextAllowed(options.insecure_loopback, "insecure_loopback",
                                          {absl::StrCat(options.address, ":0")}));
  }
  // One certificate for both sides: the router verifies it, and so do the cache servers.
  if (!s.opts.cluster.tls.enabled()) s.opts.cluster.tls = options.tls;
  if (options.device != "cpu" && options.device != "cuda") {
    return absl::InvalidArgumentError("worker: --device must be cpu or cuda");
  }
  s.opts.scheduler.engine.backend.kind = options.device;
  s.opts.scheduler.engine.backend.device = options.cuda_device;
  const int tp = options.scheduler.engine.tp.size;
  if (tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("worker: --tp must be >= 1, got ", tp));
  }
  // Quantized GGUF tensors are dequantized at load into the backend's compute dtype: bf16 on
  // the GPU (half the host memory of fp32), fp32 on the CPU (exact).
  LoadOptions lo;
  lo.dequantize_to = options.device == "cuda" ? DType::kBF16 : DType::kF32;
  lo.tokenizer_path = options.tokenizer_path;
  ASSIGN_OR_RETURN(s.model, LoadModel(options.model_path, lo));
  {
    // The chat template decides which tokens a conversation becomes: in the identity, so that a
    // template change never meets KV keyed under the old one.
    ASSIGN_OR_RETURN(ModelInfo info, LoadModelInfo(options.model_path));
    KvIdentityFields id;
    id.model_fp = s.model->fingerprint();
    id.tokenizer_fp = TokenizerFingerprint(s.model->tokenizer());
    id.chat_template = info.chat_template;
    id.kv_dtype = options.device == "cuda" ? "bf16" : "f32";
    s.kv_identity = KvIdentity(id);
    s.opts.scheduler.engine.kv_identity = s.kv_identity;
  }
  // A quality calibration measured on another model would set every request's budget from
  // the wrong slope: refused.
  const std::string& calib_fp = options.scheduler.reuse.calibration.model_fingerprint;
  if (!calib_fp.empty() && calib_fp != s.model->fingerprint().Hex()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker: --quality_calibration was measured on model ", calib_fp, ", this worker serves ",
        s.model->fingerprint().Hex(), " (recalibrate with `sparsex fidelity --calibration-out`)"));
  }
  ASSIGN_OR_RETURN(const std::string budget_note,
                   internal::ResolveReuseBudget(s.model->fingerprint().Hex(),
                                                options.auto_budget, s.opts.scheduler.reuse));
  if (absl::Status v = ValidateTensorParallel(s.model->config(), tp); !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker: ", v.message()));
  }
  s.model_name = options.model_name;
  if (s.model_name.empty()) s.model_name = std::filesystem::path(options.model_path).stem().string();
  s.instance_id = RandomHex(16);
  s.m = std::make_unique<WorkerMetrics>(s.registry);
  // Each tensor-parallel rank keeps its KV heads' share of every segment in its own store; the
  // host budget is split evenly, so the stores (same shapes, same capacity) evict alike.
  const SegmentStoreOptions store_opts{options.host_store_bytes / static_cast<size_t>(tp)};
  s.store = std::make_unique<SegmentStore>(store_opts);
  std::vector<SegmentStore*> stores{s.store.get()};
  for (int r = 1; r < tp; ++r) {
    s.rank_stores.push_back(std::make_unique<SegmentStore>(store_opts));
    stores.push_back(s.rank_stores.back().get());
  }
  s.events = std::make_unique<CacheEventLog>(s.instance_id, options.event_buffer);
  const ModelConfig& mc = s.model->config();
  // With tensor parallelism each rank fetches and writes back its own KV-head share (kv_tier.h).
  if (!options.cluster.servers.empty()) {
    // A bf16 backend's KV is bf16-exact: bf16 on the wire halves the bytes and loses nothing.
    ClusterTierOptions cluster = s.opts.cluster;
    if (cluster.wire_dtype.empty()) cluster.wire_dtype = options.device == "cuda" ? "bf16" : "f32";
    auto tier = ClusterKvTier::Connect(cluster, s.kv_identity, mc.n_layers,
                                       mc.n_kv_heads * mc.head_dim);
    if (!tier.ok()) {
      return absl::Status(tier.status().code(),
                          absl::StrCat("worker: cache cluster: ", tier.status().message()));
    }
    s.tier = std::move(*tier);
  }

  State* sp = &s;
  SchedulerHooks hooks;
  hooks.on_segments_stored = [sp](const std::vector<std::pair<Hash128, int>>& stored) {
    for (const auto& [fp, n] : stored) sp->events->Stored(fp, n);
    sp->events->Reconcile(*sp->store);
    if (sp->tier && sp->opts.write_back) {
      {
        std::lock_guard<std::mutex> l(sp->wb_mu);
        for (const auto& [fp, n] : stored) {
          auto it = std::find(sp->fetched_to_tier.begin(), sp->fetched_to_tier.end(), fp);
          if (it != sp->fetched_to_tier.end()) {  // came from the cluster: nothing to write
            sp->fetched_to_tier.erase(it);
            sp->m->writeback->Get({"fetched"}).Inc();
            continue;
          }
          sp->wb_queue.push_back(fp);
        }
      }
      sp->wb_cv.notify_all();
    }
  };
  hooks.on_block_event = [sp](const Hash128& h, int n, bool stored) {
    if (stored) {
      sp->events->Stored(h, n, EventTier::kGpu);
    } else {
      sp->events->Removed(h);
    }
  };
  hooks.on_first_token = [sp](double s) { sp->m->ttft->Observe(s); };
  hooks.on_token = [sp](double s) { sp->m->inter_token->Observe(s); };
  hooks.on_finished = [sp](const RequestUsage& u, const std::string& reason,
                           const absl::Status& st) {
    std::string outcome = st.ok() ? (reason == "cancelled" ? "cancelled" : "ok")
                                  : absl::AsciiStrToLower(absl::StatusCodeToString(st.code()));
    sp->m->requests->Get({outcome}).Inc();
    if (!st.ok()) return;
    sp->m->e2e->Observe(u.total_ms / 1000.0);
    sp->m->queue->Observe(u.queue_ms / 1000.0);
    sp->m->prompt_tokens->Inc(u.prompt_tokens);
    sp->m->prefix_tokens->Inc(u.prefix_tokens);
    sp->m->reused_tokens->Inc(u.reused_tokens);
    sp->m->recomputed_tokens->Inc(u.recomputed_tokens);
    sp->m->new_tokens->Inc(u.new_tokens);
    sp->m->streamed->Inc(u.segments_streamed);
    sp->m->stream_restarts->Inc(u.stream_restarts);
    if (u.segments_streamed > 0) {
      sp->m->stream_seconds->Get({"wait"}).Inc(u.stream_wait_ms / 1000.0);
      sp->m->stream_seconds->Get({"upload"}).Inc(u.stream_upload_ms / 1000.0);
    }
    sp->m->generated_tokens->Inc(u.completion_tokens);
    sp->m->segments->Get({"hit"}).Inc(u.segments_hit);
  };
  hooks.on_gate_replay = [sp](double kl, bool agree) {
    sp->m->gate_kl->Observe(kl);
    sp->m->gate_replays->Get({agree ? "agree" : "disagree"}).Inc();
  };
  hooks.on_gate_event = [sp](const std::string& line, const QualityGateState&) {
    internal::LogLine(sp->worker_id, absl::StrCat("model ", sp->model_name, ": ", line));
  };
  ASSIGN_OR_RETURN(s.scheduler,
                   BatchScheduler::Start(*s.model, stores, s.opts.scheduler, hooks));
  if (s.tier && options.write_back) s.wb_thread = std::thread([sp] { sp->WriteBackLoop(); });

  // gRPC.
  s.service = internal::NewWorkerService(&s);
  EnableGrpcStandardServices();
  ASSIGN_OR_RETURN(auto creds, ServerCredentials(options.tls, /*require_client_cert=*/true));
  grpc::ServerBuilder b;
  b.AddListeningPort(absl::StrCat(options.address, ":", options.port), creds, &s.port);
  b.RegisterService(s.service.get());
  b.SetMaxReceiveMessageSize(64 << 20);
  // The router pings every worker often (its keepalive finds a frozen worker within about a
  // second, router/worker_pool.cc): accept frequent pings, with or without calls, rather than
  // answering them with GOAWAY "too_many_pings".
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 50);
  b.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  s.server = b.BuildAndStart();
  if (!s.server || s.port == 0) {
    return absl::UnavailableError(
        absl::StrCat("worker: cannot listen on ", options.address, ":", options.port));
  }
  s.worker_id = options.worker_id.empty() ? absl::StrCat("worker-", s.port) : options.worker_id;

  // Metrics.
  s.m->info->Get({s.worker_id, s.model_name, options.device, s.instance_id}).Set(1);
  s.registry.AddCollector([sp] {
    SchedulerLoad l = sp->scheduler->load();
    sp->m->queue_depth->Set(l.queue_depth);
    sp->m->running->Set(l.running);
    sp->m->running_tokens->Set(static_cast<double>(l.running_tokens));
    sp->m->kv_blocks->Get({"total"}).Set(l.kv_blocks_total);
    sp->m->kv_blocks->Get({"free"}).Set(l.kv_blocks_free);
    const double used = l.kv_blocks_total > 0
                            ? 1.0 - static_cast<double>(l.kv_blocks_free) / l.kv_blocks_total
                            : 0.0;
    sp->m->kv_usage->Get({"gpu"}).Set(used);
    SegmentStoreStats st = sp->store->stats();
    size_t host_bytes = st.bytes;  // summed over the tensor-parallel ranks' shares
    for (const auto& rs : sp->rank_stores) host_bytes += rs->stats().bytes;
    sp->m->kv_usage->Get({"host"}).Set(static_cast<double>(host_bytes) /
                                       static_cast<double>(sp->opts.host_store_bytes));
    sp->m->kv_bytes->Get({"host"}).Set(static_cast<double>(host_bytes));
    sp->m->kv_bytes->Get({"device"}).Set(static_cast<double>(l.device_tier_bytes));
    sp->m->host_entries->Set(static_cast<double>(st.entries));
    sp->m->draining->Set(sp->draining ? 1 : 0);
    sp->m->iterations->Set(static_cast<double>(l.iterations));
    sp->m->pending_stores->Set(l.pending_stores);
    sp->m->unspilled_segments->Set(l.unspilled_segments);
    sp->m->fetch_timeouts->Set(static_cast<double>(l.fetch_timeouts));
    for (auto [part, ms] : {std::pair{"decode_step", l.cost_decode_ms},
                            std::pair{"prefill_token", l.cost_token_ms},
                            std::pair{"reuse_row_layer", l.cost_row_layer_ms}}) {
      sp->m->iteration_cost->Get({part}).Set(ms < 0 ? -1.0 : ms / 1e3);
    }
    for (int p = 0; p < kEnginePhases; ++p) {
      sp->m->engine_seconds->Get({kEnginePhaseNames[p]}).Set(l.phase_seconds[p]);
      sp->m->engine_longest->Get({kEnginePhaseNames[p]}).Set(l.phase_longest_s[p]);
    }
    sp->m->waiting_remote->Set(l.waiting_remote);
    sp->m->stores_dropped->Set(static_cast<double>(l.stores_dropped));
    sp->m->gate_rolling_top1->Set(l.gate.rolling_top1);
    sp->m->gate_rolling_kl->Set(l.gate.rolling_kl);
    sp->m->gate_rolling_median_kl->Set(l.gate.rolling_median_kl);
    sp->m->gate_level->Set(l.gate.level);
    sp->m->reuse_disabled->Set(l.gate.reuse_disabled ? 1 : 0);
    sp->m->gate_dropped->Set(static_cast<double>(l.gate.dropped));
    sp->m->gate_preempted->Set(static_cast<double>(l.gate.preempted));
    sp->m->gate_breaches->Set(static_cast<double>(l.gate.breaches));
  });
  if (options.metrics_port >= 0) {
    metrics::HttpServerOptions ho;
    ho.address = options.address;
    ho.port = options.metrics_port;
    ASSIGN_OR_RETURN(s.http, metrics::HttpServer::Start(ho, &s.registry, [sp] {
                       return !sp->draining && !sp->stopping;
                     }));
  }

  // Registration.
  const std::string advertise = options.advertise_address.empty()
                                    ? absl::StrCat(options.address, ":", s.port)
                                    : options.advertise_address;
  if (!options.etcd_endpoints.empty()) {
    s.etcd = std::make_unique<etcd::EtcdClient>(etcd::EtcdOptions{options.etcd_endpoints, 3000});
    nlohmann::json v{{"id", s.worker_id},
                     {"address", advertise},
                     {"instance", s.instance_id},
                     {"model", s.model_name},
                     {"model_fingerprint", s.model->fingerprint().Hex()},
                     {"device", options.device},
                     {"metrics_port", s.http ? s.http->port() : -1}};
    s.registration = std::make_unique<etcd::EtcdRegistration>(
        s.etcd.get(), absl::StrCat(options.etcd_prefix, "/workers/", s.worker_id), v.dump(),
        options.etcd_ttl_s);
    RETURN_IF_ERROR(s.registration->Start());
  }
  if (!options.ready_file.empty()) {
    nlohmann::json r{{"grpc_port", s.port},
                     {"metrics_port", s.http ? s.http->port() : -1},
                     {"pid", static_cast<int>(getpid())},
                     {"worker_id", s.worker_id},
                     {"instance_id", s.instance_id}};
    const std::string tmp = options.ready_file + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << r.dump() << "\n";
    }
    std::filesystem::rename(tmp, options.ready_file);
  }
  LogLine(s.worker_id, absl::StrCat("serving ", s.model_name, " (", options.device,
                                    tp > 1 ? absl::StrCat(", tp ", tp) : "", ") on ", advertise,
                                    ", metrics port ", s.http ? s.http->port() : -1,
                                    s.tier ? ", cache cluster on" : ", no cache cluster"));
  if (!budget_note.empty()) LogLine(s.worker_id, budget_note);
  return w;
}

void WorkerServer::Drain() {
  State& s = *s_;
  if (s.stopping) return;
  s.draining = true;
  SetGrpcServing(s.server.get(), false);  // grpc.health.v1 answers NOT_SERVING from now on
  LogLine(s.worker_id, "draining");
  if (s.registration) s.registration->Stop();
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(s.opts.drain_timeout_ms);
  while (Clock::now() < deadline) {
    SchedulerLoad l = s.scheduler->load();
    if (l.queue_depth == 0 && l.running == 0 && s.inflight.load() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Shutdown();
}

void WorkerServer::Shutdown() {
  State& s = *s_;
  if (s.stopping.exchange(true)) return;
  if (s.registration) s.registration->Stop();
  if (s.events) s.events->NotifyAll();  // null when Start failed early
  if (s.scheduler) s.scheduler->Stop();  // fails what is left: handlers return at once
  if (s.server) s.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  {
    std::lock_guard<std::mutex> l(s.wb_mu);
    s.wb_stop = true;
  }
  s.wb_cv.notify_all();
  if (s.wb_thread.joinable()) s.wb_thread.join();
  s.http.reset();
  {
    std::lock_guard<std::mutex> l(s.done_mu);
    s.done = true;
  }
  s.done_cv.notify_all();
  if (s.server) LogLine(s.worker_id, "stopped");
}

void WorkerServer::Wait() {
  std::unique_lock<std::mutex> l(s_->done_mu);
  s_->done_cv.wait(l, [this] { return s_->done; });
}

int WorkerServer::port() const { return s_->port; }
int WorkerServer::metrics_port() const { return s_->http ? s_->http->port() : -1; }
const std::string& WorkerServer::worker_id() const { return s_->worker_id; }
const std::string& WorkerServer::instance_id() const { return s_->instance_id; }
const Hash128& WorkerServer::kv_identity() const { return s_->kv_identity; }

}  // namespace sparsex::service
