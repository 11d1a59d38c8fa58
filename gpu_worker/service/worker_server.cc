#include "gpu_worker/service/worker_server.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

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
#include "model/prompt.h"
#include "gpu_worker/service/api_convert.h"
#include "gpu_worker/service/event_log.h"
#include "proto/grpc_status.h"
#include "proto/worker.grpc.pb.h"

namespace sparsex::service {
namespace {

using Clock = std::chrono::steady_clock;
namespace wpb = sparsex::worker::v1;

std::string RandomHex(int n) {
  std::random_device rd;
  std::mt19937_64 g((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                    static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += kHex[g() % 16];
  return s;
}

wpb::CacheTier ToProtoTier(EventTier t) {
  switch (t) {
    case EventTier::kGpu: return wpb::TIER_GPU;
    case EventTier::kHost: return wpb::TIER_HOST;
    case EventTier::kCluster: return wpb::TIER_CLUSTER;
  }
  return wpb::TIER_UNSPECIFIED;
}

void LogLine(const std::string& id, const std::string& msg) {
  std::cerr << "[" << id << "] " << msg << std::endl;
}

}  // namespace

// Metric handles (children resolved once).
struct WorkerMetrics {
  explicit WorkerMetrics(metrics::Registry& r) {
    const auto lat = metrics::ExponentialBuckets(0.0005, 2, 16);  // 0.5 ms .. 16 s
    ttft = &r.AddHistogram("sparsex_worker_ttft_seconds",
                           "Time from request arrival at the worker to its first token.", {}, lat)
                .Get();
    inter_token = &r.AddHistogram("sparsex_worker_inter_token_seconds",
                                  "Time between consecutive tokens of a request.", {},
                                  metrics::ExponentialBuckets(0.0001, 2, 16))
                       .Get();
    e2e = &r.AddHistogram("sparsex_worker_e2e_seconds",
                          "Time from request arrival to its last token.", {}, lat)
               .Get();
    queue = &r.AddHistogram("sparsex_worker_queue_seconds",
                            "Time a request waited for admission.", {}, lat)
                 .Get();
    fetch = &r.AddHistogram("sparsex_worker_fetch_seconds",
                            "Time of the cache-cluster lookup and fetch before a prefill.", {},
                            metrics::ExponentialBuckets(0.0001, 2, 16))
                 .Get();
    requests = &r.AddCounter("sparsex_worker_requests_total", "Requests finished, by outcome.",
                             {"outcome"});
    auto tok = [&r](const char* name, const char* help) {
      return &r.AddCounter(name, help).Get();
    };
    prompt_tokens = tok("sparsex_worker_prompt_tokens_total", "Prompt tokens of finished prefills.");
    prefix_tokens = tok("sparsex_worker_prefix_tokens_total",
                        "Prompt tokens served from the exact prefix cache.");
    reused_tokens = tok("sparsex_worker_reused_tokens_total",
                        "Prompt tokens whose KV was reused from the segment caches.");
    recomputed_tokens = tok("sparsex_worker_recomputed_tokens_total",
                            "Reused tokens recomputed by sparse recompute.");
    new_tokens = tok("sparsex_worker_new_tokens_total", "Prompt tokens computed from scratch.");
    generated_tokens = tok("sparsex_worker_generated_tokens_total", "Tokens generated.");
    segments = &r.AddCounter("sparsex_worker_segments_total",
                             "Cacheable segments looked up, by result (hit, miss).", {"result"});
    fetched = tok("sparsex_worker_fetched_segments_total",
                  "Segments fetched from the cache cluster into the host store.");
    fetch_bytes = tok("sparsex_worker_fetch_bytes_total",
                      "Bytes of segment KV transferred from the cache cluster.");
    fetch_failures = &r.AddCounter(
        "sparsex_worker_fetch_failures_total",
        "Cluster fetches that could not be used (recomputed instead), by reason.", {"reason"});
    writeback = &r.AddCounter("sparsex_worker_writeback_total",
                              "Segments written back to the cache cluster, by result.",
                              {"result"});
    queue_depth = &r.AddGauge("sparsex_worker_queue_depth", "Requests waiting for admission.").Get();
    running = &r.AddGauge("sparsex_worker_running", "Sequences admitted (prefill or decode).").Get();
    running_tokens =
        &r.AddGauge("sparsex_worker_running_tokens", "Tokens held by running sequences.").Get();
    kv_usage = &r.AddGauge("sparsex_worker_kv_usage_ratio",
                           "Used share of each KV tier (gpu: paged KV pool, host: segment store).",
                           {"tier"});
    kv_bytes = &r.AddGauge("sparsex_worker_kv_bytes", "Bytes held by each KV tier.", {"tier"});
    kv_blocks = &r.AddGauge("sparsex_worker_kv_blocks", "Paged KV blocks (total, free).",
                            {"state"});
    host_entries = &r.AddGauge("sparsex_worker_host_segments", "Segments in the host store.").Get();
    draining = &r.AddGauge("sparsex_worker_draining", "1 while draining.").Get();
    iterations = &r.AddGauge("sparsex_worker_iterations", "Engine iterations run.").Get();
    pending_stores =
        &r.AddGauge("sparsex_worker_pending_stores", "Deferred segment stores waiting.").Get();
    waiting_remote = &r.AddGauge("sparsex_worker_waiting_remote",
                                 "Requests waiting for their cache-cluster fetch.")
                          .Get();
    stores_dropped = &r.AddGauge("sparsex_worker_stores_dropped",
                                 "Deferred segment stores dropped (backlog full while busy).")
                          .Get();
    info = &r.AddGauge("sparsex_worker_info", "Static worker information (value 1).",
                       {"worker", "model", "device", "instance"});
    // Series exist from the start (dashboards and rate() see zeros, not gaps).
    for (const char* o : {"ok", "cancelled", "invalid_argument", "resource_exhausted", "unavailable"}) {
      requests->Get({o});
    }
    for (const char* why : {"transport", "corrupt", "incomplete"}) fetch_failures->Get({why});
    for (const char* res : {"ok", "error", "evicted"}) writeback->Get({res});
    segments->Get({"hit"});
  }
  metrics::Histogram *ttft, *inter_token, *e2e, *queue, *fetch;
  metrics::Family<metrics::Counter>* requests;
  metrics::Counter *prompt_tokens, *prefix_tokens, *reused_tokens, *recomputed_tokens,
      *new_tokens, *generated_tokens, *fetched, *fetch_bytes;
  metrics::Family<metrics::Counter>*segments, *fetch_failures, *writeback;
  metrics::Gauge *queue_depth, *running, *running_tokens, *host_entries, *draining, *iterations,
      *pending_stores, *stores_dropped, *waiting_remote;
  metrics::Family<metrics::Gauge>*kv_usage, *kv_bytes, *kv_blocks, *info;
};

struct WorkerServer::State {
  WorkerOptions opts;
  std::string worker_id, instance_id, model_name;
  std::unique_ptr<Model> model;
  std::unique_ptr<SegmentStore> store;  // rank 0's share (all of it without TP)
  std::vector<std::unique_ptr<SegmentStore>> rank_stores;  // ranks 1..tp-1
  std::unique_ptr<CacheEventLog> events;
  std::unique_ptr<ClusterKvTier> tier;
  std::unique_ptr<BatchScheduler> scheduler;
  metrics::Registry registry;
  std::unique_ptr<WorkerMetrics> m;
  std::unique_ptr<metrics::HttpServer> http;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<etcd::EtcdClient> etcd;
  std::unique_ptr<etcd::EtcdRegistration> registration;

  std::atomic<bool> draining{false}, stopping{false};
  std::atomic<int> inflight{0};

  // Write-back queue (engine thread -> writer thread).
  std::mutex wb_mu;
  std::condition_variable wb_cv;
  std::deque<Hash128> wb_queue;
  bool wb_stop = false;
  std::thread wb_thread;

  std::mutex done_mu;
  std::condition_variable done_cv;
  bool done = false;

  wpb::LoadReport Load() const {
    SchedulerLoad l = scheduler->load();
    wpb::LoadReport r;
    r.set_queue_depth(l.queue_depth);
    r.set_running(l.running);
    r.set_running_tokens(l.running_tokens);
    r.set_kv_blocks_total(l.kv_blocks_total);
    r.set_kv_blocks_free(l.kv_blocks_free);
    r.set_draining(draining.load());
    r.set_max_running(opts.scheduler.max_running);
    r.set_max_queue(opts.scheduler.max_queue);
    return r;
  }

  wpb::ReplayResponse Snapshot() const {
    wpb::ReplayResponse r;
    uint64_t seq = 0;
    std::vector<CacheEntryRecord> entries = events->Snapshot(&seq);
    r.set_instance_id(instance_id);
    r.set_seq(seq);
    for (const auto& e : entries) {
      wpb::CacheEntry* c = r.add_entries();
      c->set_fingerprint(FingerprintToBytes(e.fp));
      c->set_num_tokens(e.num_tokens);
      c->set_tier(ToProtoTier(e.tier));
    }
    return r;
  }

  void WriteBackLoop() {
    std::unique_lock<std::mutex> l(wb_mu);
    for (;;) {
      wb_cv.wait(l, [this] { return wb_stop || !wb_queue.empty(); });
      if (wb_queue.empty() && wb_stop) return;
      Hash128 fp = wb_queue.front();
      wb_queue.pop_front();
      l.unlock();
      // Every tensor-parallel rank writes its own share (one share without TP).
      const int tp = static_cast<int>(rank_stores.size()) + 1;
      for (int r = 0; r < tp; ++r) {
        SegmentStore* st = r == 0 ? store.get() : rank_stores[r - 1].get();
        std::shared_ptr<const SegmentKv> kv = st->Get(fp);
        if (kv) {
          absl::Status s = tier->Put(fp, *kv, r, tp);
          m->writeback->Get({s.ok() ? "ok" : "error"}).Inc();
          if (!s.ok()) LogLine(worker_id, absl::StrCat("write-back failed: ", s.ToString()));
        } else {
          m->writeback->Get({"evicted"}).Inc();
        }
      }
      l.lock();
    }
  }
};

namespace {

// The cluster fetch of a request's missing segments (WorkItem::remote_fetch, on a scheduler
// fetch thread): every rank's share, metrics, events, and a rate-limited log line on failure.
void FetchRemote(WorkerServer::State& st, const std::vector<SegmentRef>& refs, WorkItem& item) {
  const Clock::time_point t0 = Clock::now();
  // Tensor parallelism: every rank fetches its own share; a segment counts as fetched only
  // when every rank has it (a partial one is dropped before the prefill).
  const int tp = static_cast<int>(st.rank_stores.size()) + 1;
  FetchOutcome f = st.tier->FetchMissing(refs, st.store.get(), 0, tp);
  for (size_t r = 0; r < st.rank_stores.size(); ++r) {
    FetchOutcome fr = st.tier->FetchMissing(refs, st.rank_stores[r].get(),
                                             static_cast<int>(r) + 1, tp);
    f.failures += fr.failures;
    f.failure_reasons.insert(f.failure_reasons.end(), fr.failure_reasons.begin(),
                             fr.failure_reasons.end());
    std::erase_if(f.stored, [&](const SegmentRef& sr) {
      return !st.rank_stores[r]->Contains(sr.fp);
    });
  }
  if (!st.rank_stores.empty()) f.fetched = static_cast<int>(f.stored.size());
  if (f.fetched + f.failures > 0) {
    st.m->fetch->Observe(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  for (const SegmentRef& r : f.stored) st.events->Stored(r.fp, r.num_tokens);
  if (!f.stored.empty()) st.events->Reconcile(*st.store);
  st.m->fetched->Inc(f.fetched);
  for (const std::string& why : f.failure_reasons) st.m->fetch_failures->Get({why}).Inc();
  st.m->fetch_bytes->Inc(static_cast<double>(f.bytes));
  if (f.failures > 0) {
    // Say why at once (rate-limited): a fetch that cannot succeed is recomputed, and only
    // this line and the metric tell the operator.
    static std::atomic<int64_t> last_log_s{0};
    const int64_t now_s = std::chrono::duration_cast<std::chrono::seconds>(
                              Clock::now().time_since_epoch()).count();
    int64_t prev = last_log_s.load();
    if (now_s - prev >= 5 && last_log_s.compare_exchange_strong(prev, now_s)) {
      std::map<std::string, int> by;
      for (const std::string& why : f.failure_reasons) ++by[why];
      std::string reasons;
      for (const auto& [why, n] : by) absl::StrAppend(&reasons, reasons.empty() ? "" : ", ", n, " ", why);
      LogLine(st.worker_id, absl::StrCat("cache cluster: ", f.failures, " of ", refs.size(),
                                          " segments not fetched (", reasons,
                                          "); recomputed. 'incomplete': the server holds only "
                                          "some layers (evicted: its memory/disk capacity is "
                                          "too small for this model's segments)"));
    }
  }
  item.segments_fetched = f.fetched;
  item.fetch_failures = f.failures;
}

class WorkerServiceImpl final : public wpb::Worker::Service {
 public:
  explicit WorkerServiceImpl(WorkerServer::State* s) : s_(s) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const wpb::WorkerGenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    struct Inflight {
      std::atomic<int>& n;
      explicit Inflight(std::atomic<int>& c) : n(c) { ++n; }
      ~Inflight() { --n; }
    } inflight(s_->inflight);
    if (s_->draining || s_->stopping) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is draining");
    }
    WorkItem w;
    w.arrival = Clock::now();
    w.id = req->request_id();
    w.add_bos = req->add_bos();
    for (const auto& seg : req->segments()) {
      w.segments.push_back({std::vector<int32_t>(seg.tokens().begin(), seg.tokens().end()),
                            seg.cacheable()});
    }
    auto sampling = SamplingFromProto(req->sampling(), s_->model->config().vocab_size);
    if (!sampling.ok()) return ToGrpcStatus(sampling.status());
    w.sampling = *sampling;
    auto reuse = ReuseFromProto(req->reuse(), s_->opts.scheduler.reuse,
                                s_->model->config().n_layers);
    if (!reuse.ok()) return ToGrpcStatus(reuse.status());
    w.reuse = *reuse;
    if (absl::Status v = s_->scheduler->Validate(w); !v.ok()) return ToGrpcStatus(v);

    // Segments this worker lacks: looked up in the cache cluster and fetched before admission,
    // on a scheduler fetch thread (the request waits in "waiting for remote KV"), never here.
    if (s_->tier && w.reuse.enable_reuse) {
      const RequestFingerprints fps = FingerprintRequest(
          s_->model->fingerprint(), w.segments, -1,
          {.block_size = s_->opts.scheduler.engine.kv.block_size, .encoding = w.reuse.encoding});
      std::vector<SegmentRef> refs;
      bool missing = false;
      for (size_t i = 0; i < w.segments.size(); ++i) {
        if (!fps.segments[i].has_value()) continue;
        refs.push_back({*fps.segments[i], static_cast<int>(w.segments[i].tokens.size())});
        missing = missing || !s_->store->Contains(*fps.segments[i]);
      }
      if (missing) {
        WorkerServer::State* st = s_;
        w.remote_fetch = [st, refs = std::move(refs)](WorkItem& item) {
          FetchRemote(*st, refs, item);
        };
      }
    }

    auto handle = s_->scheduler->Submit(std::move(w));
    if (!handle.ok()) return ToGrpcStatus(handle.status());
    std::shared_ptr<RequestHandle> h = *handle;
    const bool ids = req->return_token_ids();
    std::vector<StreamChunk> chunks;
    for (;;) {
      chunks.clear();
      h->Wait(&chunks, std::chrono::milliseconds(20));
      if (ctx->IsCancelled()) {
        h->Cancel();  // the engine thread frees the sequence's KV blocks
        return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
      }
      if (chunks.empty()) continue;
      // Coalesce the token chunks that piled up into one message.
      v1::GenerateResponse msg;
      msg.set_request_id(req->request_id());
      bool have = false;
      for (StreamChunk& c : chunks) {
        if (c.final && !c.status.ok()) return ToGrpcStatus(c.status);
        msg.mutable_text()->append(c.text);
        if (ids) {
          for (int32_t t : c.ids) msg.add_token_ids(t);
        }
        have = have || !c.text.empty() || !c.ids.empty();
        if (c.final) {
          msg.set_finished(true);
          msg.set_finish_reason(c.finish_reason);
          msg.set_worker(s_->worker_id);
          msg.set_model(s_->model_name);
          v1::Usage* u = msg.mutable_usage();
          const RequestUsage& ru = c.usage;
          u->set_prompt_tokens(ru.prompt_tokens);
          u->set_completion_tokens(ru.completion_tokens);
          u->set_prefix_tokens(ru.prefix_tokens);
          u->set_reused_tokens(ru.reused_tokens);
          u->set_recomputed_tokens(ru.recomputed_tokens);
          u->set_new_tokens(ru.new_tokens);
          u->set_segments_hit(ru.segments_hit);
          u->set_segments_fetched(ru.segments_fetched);
          u->set_fetch_failures(ru.fetch_failures);
          u->set_ttft_ms(ru.ttft_ms);
          u->set_total_ms(ru.total_ms);
          u->set_queue_ms(ru.queue_ms);
          u->set_compute_share(ru.compute_share);
          if (!IsValidUtf8(msg.text())) msg.set_text(SanitizeUtf8(msg.text()));
          if (!writer->Write(msg)) {
            return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
          }
          return grpc::Status::OK;
        }
      }
      if (!IsValidUtf8(msg.text())) msg.set_text(SanitizeUtf8(msg.text()));
      if (have && !writer->Write(msg)) {
        h->Cancel();
        return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
    }
  }

  grpc::Status Subscribe(grpc::ServerContext* ctx, const wpb::SubscribeRequest* req,
                         grpc::ServerWriter<wpb::WorkerEvent>* writer) override {
    uint64_t after = req->after_seq();
    bool need_snapshot = req->instance_id() != s_->instance_id;
    Clock::time_point last_load = Clock::now() - std::chrono::hours(1);
    std::vector<CacheEventRecord> ev;
    while (!ctx->IsCancelled() && !s_->stopping) {
      if (need_snapshot) {
        wpb::WorkerEvent e;
        e.set_instance_id(s_->instance_id);
        *e.mutable_snapshot() = s_->Snapshot();
        after = e.snapshot().seq();
        if (!writer->Write(e)) break;
        need_snapshot = false;
      }
      ev.clear();
      if (!s_->events->WaitAfter(after, std::chrono::milliseconds(s_->opts.load_report_ms), &ev)) {
        need_snapshot = true;
        continue;
      }
      for (const CacheEventRecord& r : ev) {
        wpb::WorkerEvent e;
        e.set_instance_id(s_->instance_id);
        wpb::CacheEvent* c = e.mutable_cache();
        c->set_seq(r.seq);
        const bool block = r.tier == EventTier::kGpu;  // exact-prefix block of the paged KV
        c->set_kind(r.kind == EventKind::kStored
                        ? (block ? wpb::CacheEvent::BLOCK_STORED : wpb::CacheEvent::SEGMENT_STORED)
                    : r.kind == EventKind::kRemoved
                        ? (block ? wpb::CacheEvent::BLOCK_REMOVED : wpb::CacheEvent::SEGMENT_REMOVED)
                        : wpb::CacheEvent::ALL_CLEARED);
        if (r.kind != EventKind::kCleared) c->set_fingerprint(FingerprintToBytes(r.fp));
        c->set_num_tokens(r.num_tokens);
        c->set_tier(ToProtoTier(r.tier));
        if (!writer->Write(e)) return grpc::Status::OK;
        after = r.seq;
      }
      if (Clock::now() - last_load >= std::chrono::milliseconds(s_->opts.load_report_ms)) {
        wpb::WorkerEvent e;
        e.set_instance_id(s_->instance_id);
        *e.mutable_load() = s_->Load();
        if (!writer->Write(e)) break;
        last_load = Clock::now();
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status Replay(grpc::ServerContext*, const wpb::ReplayRequest*,
                      wpb::ReplayResponse* resp) override {
    *resp = s_->Snapshot();
    return grpc::Status::OK;
  }

  grpc::Status GetLoad(grpc::ServerContext*, const wpb::InfoRequest*,
                       wpb::LoadReport* resp) override {
    *resp = s_->Load();
    return grpc::Status::OK;
  }

  grpc::Status Info(grpc::ServerContext*, const wpb::InfoRequest*,
                    wpb::WorkerInfo* resp) override {
    const ModelConfig& c = s_->model->config();
    resp->set_worker_id(s_->worker_id);
    resp->set_instance_id(s_->instance_id);
    resp->set_model(s_->model_name);
    resp->set_model_fingerprint(s_->model->fingerprint().Hex());
    resp->set_context_length(c.max_seq_len);
    resp->set_vocab_size(c.vocab_size);
    resp->set_segment_encoding(s_->opts.scheduler.reuse.encoding);
    resp->set_kv_block_size(s_->opts.scheduler.engine.kv.block_size);
    resp->set_device(s_->opts.device);
    *resp->mutable_load() = s_->Load();
    return grpc::Status::OK;
  }

 private:
  WorkerServer::State* s_;
};

}  // namespace

WorkerServer::WorkerServer() : s_(std::make_unique<State>()) {}

WorkerServer::~WorkerServer() { Shutdown(); }

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(const WorkerOptions& options) {
  std::unique_ptr<WorkerServer> w(new WorkerServer());
  State& s = *w->s_;
  s.opts = options;
  if (options.model_path.empty()) return absl::InvalidArgumentError("worker: --model is required");
  if (options.device != "cpu" && options.device != "cuda") {
    return absl::InvalidArgumentError("worker: --device must be cpu or cuda");
  }
  s.opts.scheduler.engine.backend.kind = options.device;
  s.opts.scheduler.engine.backend.device = options.cuda_device;
  const int tp = options.scheduler.engine.tp.size;
  if (tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("worker: --tp must be >= 1, got ", tp));
  }
  ASSIGN_OR_RETURN(s.model, LoadModel(options.model_path));
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
    auto tier = ClusterKvTier::Connect(options.cluster, s.model->fingerprint(), mc.n_layers,
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
        for (const auto& [fp, n] : stored) sp->wb_queue.push_back(fp);
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
    sp->m->generated_tokens->Inc(u.completion_tokens);
    sp->m->segments->Get({"hit"}).Inc(u.segments_hit);
  };
  ASSIGN_OR_RETURN(s.scheduler,
                   BatchScheduler::Start(*s.model, stores, s.opts.scheduler, hooks));
  if (s.tier && options.write_back) s.wb_thread = std::thread([sp] { sp->WriteBackLoop(); });

  // gRPC.
  s.service = std::make_unique<WorkerServiceImpl>(&s);
  grpc::ServerBuilder b;
  b.AddListeningPort(absl::StrCat(options.address, ":", options.port),
                     grpc::InsecureServerCredentials(), &s.port);
  b.RegisterService(s.service.get());
  b.SetMaxReceiveMessageSize(64 << 20);
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
    sp->m->host_entries->Set(static_cast<double>(st.entries));
    sp->m->draining->Set(sp->draining ? 1 : 0);
    sp->m->iterations->Set(static_cast<double>(l.iterations));
    sp->m->pending_stores->Set(l.pending_stores);
    sp->m->waiting_remote->Set(l.waiting_remote);
    sp->m->stores_dropped->Set(static_cast<double>(l.stores_dropped));
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
  return w;
}

void WorkerServer::Drain() {
  State& s = *s_;
  if (s.stopping) return;
  s.draining = true;
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

}  // namespace sparsex::service
