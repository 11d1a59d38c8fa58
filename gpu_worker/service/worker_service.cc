// The gRPC adapter of the worker (worker.proto): requests in, token streams out, cache events
// and load reports to the router. Conversion and validation at this process boundary
// (api_convert.h); the work itself is the scheduler's.
#include "common/fingerprint.h"
#include "common/usage.h"
#include "common/utf8.h"
#include "gpu_worker/service/api_convert.h"
#include "gpu_worker/service/worker_state.h"
#include "model/prompt.h"
#include "proto/grpc_status.h"
#include "proto/request_check.h"

namespace sparsex::service {
namespace internal {
namespace {

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
      PromptSegment ps;
      ps.tokens.assign(seg.tokens().begin(), seg.tokens().end());
      ps.cacheable = seg.cacheable();
      if (!seg.scope().empty()) {
        auto sc = FingerprintFromBytes(seg.scope());
        if (!sc.ok()) return ToGrpcStatus(absl::InvalidArgumentError("segment scope: 16 bytes"));
        ps.scope = *sc;
      }
      w.segments.push_back(std::move(ps));
    }
    Hash128 prefix_scope;
    if (!req->prefix_scope().empty()) {
      auto sc = FingerprintFromBytes(req->prefix_scope());
      if (!sc.ok()) return ToGrpcStatus(absl::InvalidArgumentError("prefix_scope: 16 bytes"));
      prefix_scope = *sc;
    }
    auto sampling = SamplingFromProto(req->sampling(), s_->model->config().vocab_size);
    if (!sampling.ok()) return ToGrpcStatus(sampling.status());
    w.sampling = *sampling;
    auto reuse =
        ReuseFromProto(req->reuse(), s_->opts.scheduler.reuse, s_->model->config().n_layers);
    if (!reuse.ok()) return ToGrpcStatus(reuse.status());
    w.reuse = *reuse;
    w.reuse.scope = prefix_scope;
    if (req->reuse().has_store_after_misses()) {
      w.store_after_misses = req->reuse().store_after_misses();
    }
    if (absl::Status v = CheckLogprobsRequest(req->logprobs(), req->top_logprobs()); !v.ok()) {
      return ToGrpcStatus(v);
    }
    if (req->logprobs()) w.logprobs = req->top_logprobs();
    if (absl::Status v = s_->scheduler->Validate(w); !v.ok()) return ToGrpcStatus(v);

    // Segments this worker lacks: looked up in the cache cluster and fetched before admission,
    // on a scheduler fetch thread (the request waits in "waiting for remote KV"), never here.
    if (s_->tier && w.reuse.enable_reuse) {
      const RequestFingerprints fps = FingerprintRequest(
          s_->kv_identity, w.segments, -1,
          {.block_size = s_->opts.scheduler.engine.kv.block_size, .encoding = w.reuse.encoding});
      // Local means any tier (device, pinned host, host store): a segment stored in the device
      // tier and not yet copied to the host store is not fetched again.
      std::vector<SegmentRef> refs;
      for (size_t i = 0; i < w.segments.size(); ++i) {
        if (!fps.segments[i].has_value() || s_->scheduler->HoldsLocally(*fps.segments[i])) {
          continue;
        }
        refs.push_back({*fps.segments[i], static_cast<int>(w.segments[i].tokens.size())});
      }
      if (!refs.empty()) {
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
        for (const TokenLogprobs& lp : c.logprobs) AddLogprobs(lp, msg.add_logprobs());
        have = have || !c.text.empty() || !c.ids.empty();
        if (c.final) {
          msg.set_finished(true);
          msg.set_finish_reason(c.finish_reason);
          msg.set_worker(s_->worker_id);
          msg.set_model(s_->model_name);
          v1::Usage* u = msg.mutable_usage();
          const RequestUsage& ru = c.usage;
#define SPX_USAGE_FIELD(name, type, def) u->set_##name(ru.name);
          SPARSEX_USAGE_FIELDS(SPX_USAGE_FIELD)
#undef SPX_USAGE_FIELD
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

  // A token's text for the logprobs: its raw bytes (a special token's name), and the same
  // as a string with invalid UTF-8 shown as U+FFFD.
  template <typename M>
  void SetToken(int32_t id, M* m) const {
    const Tokenizer& tok = s_->model->tokenizer();
    std::string bytes = tok.TokenPiece(id);
    if (bytes.empty()) bytes = tok.SpecialText(id);
    m->set_token_id(id);
    m->set_token(SanitizeUtf8(bytes));
    m->set_token_bytes(std::move(bytes));
  }
  void AddLogprobs(const TokenLogprobs& lp, v1::TokenLogprob* out) const {
    SetToken(lp.token, out);
    out->set_logprob(lp.logprob);
    for (const auto& [id, v] : lp.top) {
      v1::TopLogprob* t = out->add_top_logprobs();
      SetToken(id, t);
      t->set_logprob(v);
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
                    : r.kind == EventKind::kRemoved ? (block ? wpb::CacheEvent::BLOCK_REMOVED
                                                             : wpb::CacheEvent::SEGMENT_REMOVED)
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

  grpc::Status Info(grpc::ServerContext*, const wpb::InfoRequest*, wpb::WorkerInfo* resp) override {
    const ModelConfig& c = s_->model->config();
    resp->set_worker_id(s_->worker_id);
    resp->set_instance_id(s_->instance_id);
    resp->set_model(s_->model_name);
    resp->set_model_fingerprint(s_->model->fingerprint().Hex());
    resp->set_kv_fingerprint(s_->kv_identity.Hex());
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

std::unique_ptr<grpc::Service> NewWorkerService(WorkerServer::State* s) {
  return std::make_unique<WorkerServiceImpl>(s);
}

}  // namespace internal
}  // namespace sparsex::service
