#include "router/router.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "common/etcd/etcd_client.h"
#include "common/fingerprint.h"
#include "common/metrics/metrics.h"
#include "common/utf8.h"
#include "model/model_info.h"
#include "model/prompt.h"
#include "proto/grpc_status.h"
#include "proto/request_check.h"
#include "proto/worker.grpc.pb.h"

namespace sparsex::router {
namespace {

using Clock = std::chrono::steady_clock;
namespace wpb = sparsex::worker::v1;

std::string RandomHex(int n) {
  static std::mutex mu;
  static std::mt19937_64 g(std::random_device{}() ^
                           static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  std::lock_guard<std::mutex> l(mu);
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += kHex[g() % 16];
  return s;
}

void Log(const std::string& msg) { std::cerr << "[router] " << msg << std::endl; }

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool Retryable(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         c == grpc::StatusCode::ABORTED;
}

// One worker: channel, stub and the subscription thread that feeds the index.
struct WorkerConn {
  std::string address;  // also its key in the index
  std::string name;     // worker_id from Info (address until known)
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<wpb::Worker::Stub> stub;
  std::atomic<bool> healthy{false};
  std::atomic<bool> model_ok{false};
  std::atomic<int> inflight{0};
  std::atomic<int64_t> inflight_tokens{0};
  std::atomic<bool> stop{false};
  std::mutex mu;  // guards sub_ctx, name
  grpc::ClientContext* sub_ctx = nullptr;
  std::thread thread;

  std::string Name() {
    std::lock_guard<std::mutex> l(mu);
    return name;
  }
};

struct RouterMetrics {
  explicit RouterMetrics(metrics::Registry& r) {
    const auto lat = metrics::ExponentialBuckets(0.0005, 2, 16);
    requests = &r.AddCounter("sparsex_router_requests_total", "Generate requests, by API and outcome.",
                             {"api", "outcome"});
    ttft = &r.AddHistogram("sparsex_router_ttft_seconds",
                           "Time from request arrival at the router to the first token.", {}, lat)
                .Get();
    inter_token = &r.AddHistogram("sparsex_router_inter_token_seconds",
                                  "Time between consecutive streamed chunks.", {},
                                  metrics::ExponentialBuckets(0.0001, 2, 16))
                       .Get();
    e2e = &r.AddHistogram("sparsex_router_e2e_seconds", "Time from arrival to the final chunk.",
                          {}, lat)
               .Get();
    decisions = &r.AddCounter("sparsex_router_routing_decisions_total",
                              "Routing decisions, by worker and reason (reuse, load, only).",
                              {"worker", "reason"});
    predicted_reuse = &r.AddCounter("sparsex_router_predicted_reusable_tokens_total",
                                    "Reusable tokens the index predicted at the chosen worker.")
                           .Get();
    retries = &r.AddCounter("sparsex_router_retries_total",
                            "Requests retried on another worker before the first token, by code.",
                            {"code"});
    shed = &r.AddCounter("sparsex_router_shed_total",
                         "Requests refused with RESOURCE_EXHAUSTED (every worker saturated).")
                .Get();
    auto c = [&r](const char* n, const char* h) { return &r.AddCounter(n, h).Get(); };
    prompt_tokens = c("sparsex_router_prompt_tokens_total", "Prompt tokens of completed requests.");
    prefix_tokens = c("sparsex_router_prefix_tokens_total", "Prompt tokens hit in the exact prefix cache.");
    reused_tokens = c("sparsex_router_reused_tokens_total", "Prompt tokens whose KV was reused.");
    recomputed_tokens =
        c("sparsex_router_recomputed_tokens_total", "Reused tokens recomputed (sparse recompute).");
    new_tokens = c("sparsex_router_new_tokens_total", "Prompt tokens computed from scratch.");
    generated_tokens = c("sparsex_router_generated_tokens_total", "Tokens generated.");
    fetch_failures = c("sparsex_router_fetch_failures_total",
                       "Cache-cluster fetch failures reported by workers (recomputed).");
    workers = &r.AddGauge("sparsex_router_workers", "Known workers, by state.", {"state"});
    w_inflight = &r.AddGauge("sparsex_router_worker_inflight",
                             "Requests in flight from this router, per worker.", {"worker"});
    w_queue = &r.AddGauge("sparsex_router_worker_queue_depth",
                          "Queue depth reported by each worker.", {"worker"});
    w_running = &r.AddGauge("sparsex_router_worker_running_tokens",
                            "Tokens held by running sequences, per worker.", {"worker"});
    w_kv = &r.AddGauge("sparsex_router_worker_kv_usage_ratio",
                       "Paged-KV usage reported by each worker.", {"worker"});
    w_segments = &r.AddGauge("sparsex_router_index_segments",
                             "Segments the cluster index holds for each worker.", {"worker"});
    // Series exist from the start (dashboards and rate() see zeros, not gaps).
    for (const char* api : {"grpc", "http"}) {
      for (const char* o : {"ok", "cancelled", "invalid_argument", "resource_exhausted",
                            "unavailable", "deadline_exceeded"}) {
        requests->Get({api, o});
      }
    }
    for (const char* c : {"unavailable", "resource_exhausted"}) retries->Get({c});
  }
  metrics::Family<metrics::Counter>*requests, *decisions, *retries;
  metrics::Histogram *ttft, *inter_token, *e2e;
  metrics::Counter *predicted_reuse, *shed, *prompt_tokens, *prefix_tokens, *reused_tokens,
      *recomputed_tokens, *new_tokens, *generated_tokens, *fetch_failures;
  metrics::Family<metrics::Gauge>*workers, *w_inflight, *w_queue, *w_running, *w_kv, *w_segments;
};

}  // namespace

// What the router hashes with, learned from the first worker that serves the router's model:
// the model fingerprint (it hashes samples of the weights, which the router never reads), the
// segment encoding and the KV block size. Workers that disagree are not routed to.
struct ServedIdentity {
  bool known = false;
  Hash128 fingerprint;
  std::string fingerprint_hex;
  std::string encoding;
  int block_size = 0;
};

struct Router::Impl {
  RouterOptions opts;
  ModelInfo model;
  std::string model_name;
  mutable std::mutex id_mu;
  ServedIdentity id;  // guarded by id_mu

  ServedIdentity Identity() const {
    std::lock_guard<std::mutex> l(id_mu);
    return id;
  }

  // "" when the worker may serve this router's requests, else why not. The first acceptable
  // worker fixes the identity.
  std::string Accept(const wpb::WorkerInfo& info) {
    const ModelConfig& c = model.config;
    if (info.vocab_size() != c.vocab_size || info.context_length() != c.max_seq_len) {
      return absl::StrCat("its model has vocabulary ", info.vocab_size(), " and context ",
                          info.context_length(), ", this router's ", c.vocab_size, " and ",
                          c.max_seq_len);
    }
    const int bs = info.kv_block_size() > 0 ? info.kv_block_size() : 16;  // older workers: 16
    if (!opts.segment_encoding.empty() && info.segment_encoding() != opts.segment_encoding) {
      return absl::StrCat("its segment encoding is ", info.segment_encoding(), ", --segment_encoding ",
                          opts.segment_encoding);
    }
    if (opts.kv_block_size > 0 && bs != opts.kv_block_size) {
      return absl::StrCat("its KV block size is ", bs, ", --kv_block_size ", opts.kv_block_size);
    }
    std::lock_guard<std::mutex> l(id_mu);
    if (!id.known) {
      auto fp = Hash128::FromHex(info.model_fingerprint());
      if (!fp.has_value()) return "its model fingerprint is malformed";
      id.known = true;
      id.fingerprint = *fp;
      id.fingerprint_hex = info.model_fingerprint();
      id.encoding = info.segment_encoding();
      id.block_size = bs;
      Log(absl::StrCat("serving model ", model_name, " fingerprint ", id.fingerprint_hex,
                       ", segment encoding ", id.encoding, ", KV block size ", bs, " (from worker ",
                       info.worker_id(), ")"));
      return "";
    }
    if (info.model_fingerprint() != id.fingerprint_hex) {
      return absl::StrCat("it serves model fingerprint ", info.model_fingerprint(), ", the cluster ",
                          id.fingerprint_hex);
    }
    if (info.segment_encoding() != id.encoding || bs != id.block_size) {
      return absl::StrCat("its segment encoding / block size are ", info.segment_encoding(), " / ",
                          bs, ", the cluster's ", id.encoding, " / ", id.block_size);
    }
    return "";
  }
  ClusterIndex index;
  metrics::Registry registry;
  std::unique_ptr<RouterMetrics> m;

  std::mutex mu;  // conns
  std::map<std::string, std::shared_ptr<WorkerConn>> conns;  // by address

  std::unique_ptr<etcd::EtcdClient> etcd;
  std::thread membership;
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopping = false;

  ~Impl() { Stop(); }

  void Stop() {
    {
      std::lock_guard<std::mutex> l(stop_mu);
      if (stopping) return;
      stopping = true;
    }
    stop_cv.notify_all();
    if (membership.joinable()) membership.join();
    std::map<std::string, std::shared_ptr<WorkerConn>> all;
    {
      std::lock_guard<std::mutex> l(mu);
      all.swap(conns);
    }
    for (auto& [a, c] : all) StopConn(*c);
  }

  // ---- membership ----

  void SetMembers(const std::map<std::string, std::string>& members /* address -> name */) {
    std::vector<std::shared_ptr<WorkerConn>> removed;
    {
      std::lock_guard<std::mutex> l(mu);
      for (auto it = conns.begin(); it != conns.end();) {
        if (!members.contains(it->first)) {
          removed.push_back(it->second);
          it = conns.erase(it);
        } else {
          ++it;
        }
      }
      for (const auto& [addr, name] : members) {
        if (conns.contains(addr)) continue;
        auto c = std::make_shared<WorkerConn>();
        c->address = addr;
        c->name = name.empty() ? addr : name;
        grpc::ChannelArguments args;
        args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
        args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
        args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
        args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
        args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
        args.SetMaxReceiveMessageSize(64 << 20);
        c->channel = grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
        c->stub = wpb::Worker::NewStub(c->channel);
        WorkerConn* raw = c.get();
        c->thread = std::thread([this, raw] { Subscribe(*raw); });
        conns[addr] = c;
        Log(absl::StrCat("worker added: ", c->name, " at ", addr));
      }
    }
    for (auto& c : removed) {
      Log(absl::StrCat("worker removed: ", c->Name(), " at ", c->address));
      StopConn(*c);
      index.RemoveWorker(c->address);
    }
  }

  void StopConn(WorkerConn& c) {
    c.stop = true;
    {
      std::lock_guard<std::mutex> l(c.mu);
      if (c.sub_ctx) c.sub_ctx->TryCancel();
    }
    if (c.thread.joinable()) c.thread.join();
    c.healthy = false;
  }

  bool WaitStop(std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> l(stop_mu);
    return stop_cv.wait_for(l, d, [this] { return stopping; });
  }

  void PollMembers() {
    std::map<std::string, std::string> members;
    for (const std::string& a : opts.workers) members[a] = "";
    if (etcd) {
      auto kvs = etcd->RangePrefix(opts.etcd_prefix + "/workers/");
      if (!kvs.ok()) return;  // etcd unreachable: keep what we had
      for (const auto& kv : *kvs) {
        nlohmann::json j = nlohmann::json::parse(kv.value, nullptr, false);
        if (j.is_discarded() || !j.is_object() || !j.contains("address")) continue;
        members[j.value("address", "")] = j.value("id", "");
      }
    }
    SetMembers(members);
  }

  void MembershipLoop() {
    while (!WaitStop(std::chrono::milliseconds(opts.membership_poll_ms))) PollMembers();
  }

  // ---- subscription: the worker's events feed the index ----

  void Subscribe(WorkerConn& c) {
    int backoff_ms = 100;
    bool force_snapshot = true;
    bool warned_model = false;
    while (!c.stop) {
      wpb::WorkerInfo info;
      {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        grpc::Status s = c.stub->Info(&ctx, wpb::InfoRequest(), &info);
        if (!s.ok()) {
          c.healthy = false;
          std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
          backoff_ms = std::min(1000, backoff_ms * 2);
          continue;
        }
      }
      {
        std::lock_guard<std::mutex> l(c.mu);
        c.name = info.worker_id();
      }
      if (const std::string why = Accept(info); !why.empty()) {
        c.model_ok = false;
        if (!warned_model) {
          Log(absl::StrCat("worker ", info.worker_id(), " (model ", info.model(), "): ", why,
                           ": not routing to it"));
          warned_model = true;
        }
        for (int i = 0; i < 20 && !c.stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      c.model_ok = true;
      backoff_ms = 100;

      grpc::ClientContext ctx;
      {
        std::lock_guard<std::mutex> l(c.mu);
        if (c.stop) break;
        c.sub_ctx = &ctx;
      }
      wpb::SubscribeRequest req;
      if (!force_snapshot) {
        req.set_instance_id(index.Instance(c.address));
        req.set_after_seq(index.LastSeq(c.address));
      }
      force_snapshot = false;
      auto reader = c.stub->Subscribe(&ctx, req);
      wpb::WorkerEvent ev;
      while (reader->Read(&ev)) {
        if (ev.has_snapshot()) {
          std::vector<IndexEntry> entries;
          for (const auto& e : ev.snapshot().entries()) {
            auto fp = FingerprintFromBytes(e.fingerprint());
            if (fp.ok()) entries.push_back({*fp, e.num_tokens(), e.tier() == wpb::TIER_GPU});
          }
          index.ApplySnapshot(c.address, ev.instance_id(), ev.snapshot().seq(), entries);
          c.healthy = true;
        } else if (ev.has_cache()) {
          const wpb::CacheEvent& ce = ev.cache();
          ClusterIndex::EventKind k = ce.kind() == wpb::CacheEvent::SEGMENT_REMOVED ||
                                              ce.kind() == wpb::CacheEvent::BLOCK_REMOVED
                                          ? ClusterIndex::EventKind::kRemoved
                                      : ce.kind() == wpb::CacheEvent::ALL_CLEARED
                                          ? ClusterIndex::EventKind::kCleared
                                          : ClusterIndex::EventKind::kStored;
          Hash128 fp;
          if (k != ClusterIndex::EventKind::kCleared) {
            auto d = FingerprintFromBytes(ce.fingerprint());
            if (!d.ok()) continue;
            fp = *d;
          }
          const bool block = ce.kind() == wpb::CacheEvent::BLOCK_STORED ||
                             ce.kind() == wpb::CacheEvent::BLOCK_REMOVED;
          if (!index.ApplyEvent(c.address, ev.instance_id(), ce.seq(), k, fp, ce.num_tokens(),
                                block)) {
            force_snapshot = true;  // gap or restart: start over from a snapshot
            ctx.TryCancel();
            break;
          }
        } else if (ev.has_load()) {
          const wpb::LoadReport& lr = ev.load();
          WorkerLoadInfo li;
          li.queue_depth = lr.queue_depth();
          li.running = lr.running();
          li.running_tokens = lr.running_tokens();
          li.kv_blocks_total = lr.kv_blocks_total();
          li.kv_blocks_free = lr.kv_blocks_free();
          li.draining = lr.draining();
          li.max_queue = lr.max_queue();
          index.UpdateLoad(c.address, li);
          c.healthy = !lr.draining();
        }
      }
      reader->Finish();
      {
        std::lock_guard<std::mutex> l(c.mu);
        c.sub_ctx = nullptr;
      }
      c.healthy = false;
      if (!c.stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  std::vector<std::shared_ptr<WorkerConn>> Conns() {
    std::lock_guard<std::mutex> l(mu);
    std::vector<std::shared_ptr<WorkerConn>> out;
    for (auto& [a, c] : conns) out.push_back(c);
    return out;
  }

  // ---- request preparation ----

  struct Prepared {
    wpb::WorkerGenerateRequest wreq;
    std::vector<IndexEntry> fps;
    int prompt_tokens = 0;
  };

  absl::StatusOr<Prepared> Prepare(const v1::GenerateRequest& req) {
    Prepared p;
    const Tokenizer& tok = *model.tokenizer;
    const ModelConfig& cfg = model.config;
    // The worker API is proto3: an invalid UTF-8 request_id would fail there with an empty
    // INTERNAL error, so it is refused here, naming the field.
    if (!IsValidUtf8(req.request_id())) {
      return absl::InvalidArgumentError("request_id: invalid UTF-8");
    }
    const bool has_prompt = !req.prompt().empty() || req.prompt_ids_size() > 0;
    if (req.segments_size() > 0 && has_prompt) {
      return absl::InvalidArgumentError("set either segments or prompt/prompt_ids, not both");
    }
    if (!req.prompt().empty() && req.prompt_ids_size() > 0) {
      return absl::InvalidArgumentError("set either prompt or prompt_ids, not both");
    }
    std::vector<PromptSegment> segs;
    if (req.segments_size() > 0) {
      for (int i = 0; i < req.segments_size(); ++i) {
        const v1::Segment& s = req.segments(i);
        PromptSegment ps;
        ps.cacheable = s.has_cacheable() ? s.cacheable() : true;
        if (s.has_ids()) {
          ps.tokens.assign(s.ids().ids().begin(), s.ids().ids().end());
        } else {
          if (!IsValidUtf8(s.text())) {
            return absl::InvalidArgumentError(absl::StrCat("segment ", i, ": invalid UTF-8"));
          }
          ps.tokens = tok.Encode(s.text(), /*add_bos=*/false);
        }
        segs.push_back(std::move(ps));
      }
    } else if (has_prompt) {
      std::vector<int32_t> ids;
      if (!req.prompt().empty()) {
        if (!IsValidUtf8(req.prompt())) return absl::InvalidArgumentError("prompt: invalid UTF-8");
        ids = tok.Encode(req.prompt(), /*add_bos=*/false);
      } else {
        ids.assign(req.prompt_ids().begin(), req.prompt_ids().end());
      }
      segs = ChunkPrompt(ids, opts.chunking);
    } else {
      return absl::InvalidArgumentError("empty request: set segments, prompt or prompt_ids");
    }
    const bool add_bos = req.has_add_bos() ? req.add_bos() : true;
    int n = (add_bos && tok.bos_id() >= 0) ? 1 : 0;
    for (const auto& s : segs) {
      for (int32_t t : s.tokens) {
        if (t < 0 || t >= cfg.vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("token id ", t, " outside the vocabulary of ", cfg.vocab_size));
        }
      }
      n += static_cast<int>(s.tokens.size());
    }
    if (n == 0) return absl::InvalidArgumentError("empty prompt");
    if (n > cfg.max_seq_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt of ", n, " tokens exceeds the context length of ", cfg.max_seq_len));
    }
    RETURN_IF_ERROR(CheckSamplingRequest(req.sampling(), cfg.vocab_size));
    RETURN_IF_ERROR(CheckReuseRequest(req.reuse(), cfg.n_layers));
    p.prompt_tokens = n;
    p.wreq.set_request_id(req.request_id().empty() ? "req-" + RandomHex(16) : req.request_id());
    p.wreq.set_add_bos(add_bos);
    *p.wreq.mutable_sampling() = req.sampling();
    *p.wreq.mutable_reuse() = req.reuse();
    p.wreq.set_return_token_ids(req.return_token_ids());
    const bool reuse_on = !req.reuse().has_enable() || req.reuse().enable();
    for (const auto& s : segs) {
      wpb::TokenSegment* ts = p.wreq.add_segments();
      ts->mutable_tokens()->Add(s.tokens.begin(), s.tokens.end());
      ts->set_cacheable(s.cacheable);
    }
    // Routing hints: exact-prefix blocks (their tokens add to a worker's score on top of any
    // segment hit covering them: an exact hit needs no recompute) and segment fingerprints,
    // hashed as the workers hash them. Unknown until a worker has reported its identity.
    const ServedIdentity ident = Identity();
    if (ident.known) {
      const RequestFingerprints f = FingerprintRequest(
          ident.fingerprint, segs, add_bos ? tok.bos_id() : -1,
          {.block_size = ident.block_size, .encoding = ident.encoding, .segments = reuse_on});
      for (const Hash128& h : f.prefix_blocks) {
        p.fps.push_back({h, ident.block_size, /*block=*/true});
      }
      for (size_t i = 0; i < segs.size(); ++i) {
        if (f.segments[i].has_value()) {
          p.fps.push_back({*f.segments[i], static_cast<int>(segs[i].tokens.size())});
        }
      }
    }
    return p;
  }

  // ---- routing ----

  struct Pick {
    std::shared_ptr<WorkerConn> conn;
    int reusable = 0;
    std::string reason;
    bool all_saturated = false;
  };

  Pick Route(const Prepared& p, const std::vector<std::string>& excluded) {
    std::vector<std::shared_ptr<WorkerConn>> all = Conns();
    std::vector<std::shared_ptr<WorkerConn>> cands;
    std::vector<RouteCandidate> rc;
    for (auto& c : all) {
      if (!c->healthy || !c->model_ok) continue;
      if (std::find(excluded.begin(), excluded.end(), c->address) != excluded.end()) continue;
      RouteCandidate x;
      x.id = c->address;
      x.reusable_tokens = index.ReusableTokens(c->address, p.fps);
      x.inflight = c->inflight.load();
      x.inflight_tokens = c->inflight_tokens.load();
      x.load = index.Load(c->address);
      cands.push_back(c);
      rc.push_back(x);
    }
    Pick pick;
    RouteDecision d = ChooseWorker(rc, p.prompt_tokens, opts.weights);
    pick.all_saturated = d.all_saturated;
    if (d.index >= 0) {
      pick.conn = cands[d.index];
      pick.reusable = rc[d.index].reusable_tokens;
      pick.reason = d.reason;
    }
    return pick;
  }

  absl::Status Generate(const v1::GenerateRequest& req, const GenerateSink& sink,
                        const CallControl& ctl) {
    const Clock::time_point t0 = Clock::now();
    absl::Status st = GenerateImpl(req, sink, ctl, t0);
    std::string outcome =
        st.ok() ? "ok" : absl::AsciiStrToLower(absl::StatusCodeToString(st.code()));
    m->requests->Get({ctl.api, outcome}).Inc();
    return st;
  }

  absl::Status GenerateImpl(const v1::GenerateRequest& req, const GenerateSink& sink,
                            const CallControl& ctl, Clock::time_point t0) {
    RETURN_IF_ERROR(CheckModel(req.model()));
    ASSIGN_OR_RETURN(Prepared p, Prepare(req));
    std::chrono::system_clock::time_point deadline = ctl.deadline;
    if (opts.request_timeout_ms > 0) {
      deadline = std::min(deadline, std::chrono::system_clock::now() +
                                        std::chrono::milliseconds(opts.request_timeout_ms));
    }
    std::vector<std::string> excluded;
    absl::Status last = absl::UnavailableError("no worker is serving " + model_name);
    bool saw_saturated = false;
    for (int attempt = 0; attempt < std::max(1, opts.max_attempts); ++attempt) {
      Pick pick = Route(p, excluded);
      if (!pick.conn) {
        if (pick.all_saturated || saw_saturated) {
          m->shed->Inc();
          return absl::ResourceExhaustedError(
              absl::StrCat("every worker is saturated; retry later (", last.message(), ")"));
        }
        if (attempt == 0) return absl::UnavailableError("no healthy worker is serving " + model_name);
        return last;
      }
      WorkerConn& c = *pick.conn;
      m->decisions->Get({c.Name(), pick.reason}).Inc();
      m->predicted_reuse->Inc(pick.reusable);

      std::unique_ptr<grpc::ClientContext> ctx;
      if (ctl.grpc_parent != nullptr) {
        ctx = grpc::ClientContext::FromServerContext(*ctl.grpc_parent);
      } else {
        ctx = std::make_unique<grpc::ClientContext>();
      }
      if (deadline != std::chrono::system_clock::time_point::max()) ctx->set_deadline(deadline);
      c.inflight++;
      c.inflight_tokens += p.prompt_tokens;
      struct Release {
        WorkerConn& c;
        int64_t n;
        ~Release() {
          c.inflight--;
          c.inflight_tokens -= n;
        }
      } release{c, p.prompt_tokens};

      auto reader = c.stub->Generate(ctx.get(), p.wreq);
      v1::GenerateResponse msg;
      bool sent_any = false, client_gone = false;
      int chunks = 0;
      Clock::time_point t_last = t0;
      while (reader->Read(&msg)) {
        const Clock::time_point now = Clock::now();
        if (!sent_any) m->ttft->Observe(std::chrono::duration<double>(now - t0).count());
        else m->inter_token->Observe(std::chrono::duration<double>(now - t_last).count());
        t_last = now;
        sent_any = true;
        ++chunks;
        msg.set_request_id(p.wreq.request_id());
        if (msg.finished()) {
          msg.set_model(model_name);
          const v1::Usage& u = msg.usage();
          m->prompt_tokens->Inc(u.prompt_tokens());
          m->prefix_tokens->Inc(u.prefix_tokens());
          m->reused_tokens->Inc(u.reused_tokens());
          m->recomputed_tokens->Inc(u.recomputed_tokens());
          m->new_tokens->Inc(u.new_tokens());
          m->generated_tokens->Inc(u.completion_tokens());
          m->fetch_failures->Inc(u.fetch_failures());
          m->e2e->Observe(SecondsSince(t0));
        }
        if (!sink(msg)) {
          client_gone = true;
          ctx->TryCancel();  // the worker sees the cancellation and frees the KV
          break;
        }
      }
      grpc::Status gs = reader->Finish();
      if (client_gone) return absl::CancelledError("client went away");
      if (gs.ok()) return absl::OkStatus();
      if (gs.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        return absl::DeadlineExceededError("request deadline exceeded");
      }
      if (gs.error_code() == grpc::StatusCode::CANCELLED) {
        return absl::CancelledError(absl::StrCat("cancelled: ", gs.error_message()));
      }
      if (sent_any) {
        c.healthy = gs.error_code() != grpc::StatusCode::UNAVAILABLE ? c.healthy.load() : false;
        return absl::Status(
            gs.error_code() == grpc::StatusCode::UNAVAILABLE ? absl::StatusCode::kUnavailable
                                                             : FromGrpcStatus(gs).code(),
            absl::StrCat("worker ", c.Name(), " (", c.address, ") failed after streaming ",
                         chunks, " chunk(s): ", gs.error_message(),
                         "; the partial output is incomplete, retry the request"));
      }
      if (!Retryable(gs.error_code())) return FromGrpcStatus(gs);
      // Before the first token: try another worker.
      if (gs.error_code() == grpc::StatusCode::UNAVAILABLE) c.healthy = false;
      if (gs.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) saw_saturated = true;
      m->retries->Get({absl::AsciiStrToLower(absl::StatusCodeToString(
                          static_cast<absl::StatusCode>(gs.error_code())))})
          .Inc();
      last = absl::Status(static_cast<absl::StatusCode>(gs.error_code()),
                          absl::StrCat("worker ", c.Name(), ": ", gs.error_message()));
      excluded.push_back(c.address);
    }
    if (saw_saturated && last.code() == absl::StatusCode::kResourceExhausted) m->shed->Inc();
    return last;
  }

  absl::Status CheckModel(const std::string& name) const {
    if (name.empty() || name == model_name || (Identity().known && name == Identity().fingerprint_hex)) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat("unknown model '", SanitizeUtf8(name),
                                                   "'; this router serves '", model_name, "'"));
  }

  void Collect() {
    int healthy = 0, unhealthy = 0;
    for (auto& c : Conns()) {
      (c->healthy && c->model_ok ? healthy : unhealthy)++;
      const std::string n = c->Name();
      for (const char* reason : {"reuse", "load", "only"}) m->decisions->Get({n, reason});
      WorkerLoadInfo l = index.Load(c->address);
      m->w_inflight->Get({n}).Set(c->inflight.load());
      m->w_queue->Get({n}).Set(l.queue_depth);
      m->w_running->Get({n}).Set(static_cast<double>(l.running_tokens));
      m->w_kv->Get({n}).Set(l.kv_usage());
      m->w_segments->Get({n}).Set(static_cast<double>(index.Segments(c->address)));
    }
    m->workers->Get({"healthy"}).Set(healthy);
    m->workers->Get({"unhealthy"}).Set(unhealthy);
  }
};

Router::Router() : impl_(std::make_unique<Impl>()) {}
Router::~Router() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Router>> Router::Create(const RouterOptions& options) {
  std::unique_ptr<Router> r(new Router());
  Impl& s = *r->impl_;
  s.opts = options;
  if (options.model_path.empty()) return absl::InvalidArgumentError("router: --model is required");
  // Config and tokenizer only: the router never maps weight files.
  ASSIGN_OR_RETURN(s.model, LoadModelInfo(options.model_path));
  s.model_name = options.model_name.empty()
                     ? std::filesystem::path(options.model_path).stem().string()
                     : options.model_name;
  s.m = std::make_unique<RouterMetrics>(s.registry);
  Impl* sp = &s;
  s.registry.AddCollector([sp] { sp->Collect(); });
  if (options.workers.empty() && options.etcd_endpoints.empty()) {
    return absl::InvalidArgumentError("router: no workers: set --workers and/or --etcd");
  }
  if (!options.etcd_endpoints.empty()) {
    s.etcd = std::make_unique<etcd::EtcdClient>(etcd::EtcdOptions{options.etcd_endpoints, 2000});
  }
  s.PollMembers();  // once synchronously, then polled
  if (s.etcd) s.membership = std::thread([sp] { sp->MembershipLoop(); });
  return r;
}

absl::Status Router::Generate(const v1::GenerateRequest& req, const GenerateSink& sink,
                              const CallControl& ctl) {
  return impl_->Generate(req, sink, ctl);
}

absl::StatusOr<v1::TokenizeResponse> Router::Tokenize(const v1::TokenizeRequest& req) {
  RETURN_IF_ERROR(CheckModel(req.model()));
  if (!IsValidUtf8(req.text())) return absl::InvalidArgumentError("text: invalid UTF-8");
  const Tokenizer& tok = *impl_->model.tokenizer;
  std::vector<int32_t> ids = tok.Encode(req.text(), req.has_add_bos() && req.add_bos());
  v1::TokenizeResponse resp;
  for (int32_t id : ids) {
    resp.add_ids(id);
    resp.add_pieces(SanitizeUtf8(tok.TokenPiece(id)));
  }
  return resp;
}

v1::ListModelsResponse Router::ListModels() {
  v1::ListModelsResponse resp;
  v1::ModelInfo* mi = resp.add_models();
  const ModelConfig& c = impl_->model.config;
  mi->set_id(impl_->model_name);
  mi->set_context_length(c.max_seq_len);
  mi->set_vocab_size(c.vocab_size);
  mi->set_fingerprint(impl_->Identity().fingerprint_hex);  // "" until a worker reported it
  int n = 0;
  for (auto& w : impl_->Conns()) n += (w->healthy && w->model_ok) ? 1 : 0;
  mi->set_workers(n);
  return resp;
}

v1::HealthResponse Router::Health() {
  v1::HealthResponse resp;
  bool any = false;
  for (auto& c : impl_->Conns()) {
    v1::WorkerHealth* h = resp.add_workers();
    const bool ok = c->healthy && c->model_ok;
    any = any || ok;
    WorkerLoadInfo l = impl_->index.Load(c->address);
    h->set_id(c->Name());
    h->set_address(c->address);
    h->set_healthy(ok);
    h->set_queue_depth(l.queue_depth);
    h->set_running(l.running);
    h->set_kv_usage(l.kv_usage());
    h->set_indexed_segments(static_cast<int>(impl_->index.Segments(c->address)));
  }
  resp.set_serving(any);
  return resp;
}

absl::Status Router::CheckModel(const std::string& model) const {
  return impl_->CheckModel(model);
}

const std::string& Router::model_name() const { return impl_->model_name; }
metrics::Registry& Router::registry() { return impl_->registry; }
const RouterOptions& Router::options() const { return impl_->opts; }
void Router::Shutdown() { impl_->Stop(); }

}  // namespace sparsex::router
