#include "gpu_worker/reuse/reuse_prefill.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <iostream>
#include <sstream>
#include <tuple>
#include <utility>

#include "common/fingerprint.h"
#include "common/huge_pages.h"
#include "gpu_worker/reuse/planner.h"

namespace sparsex {
namespace {

// Tokens a segment is encoded after, for its encoding context.
absl::StatusOr<std::vector<int32_t>> EncodingContext(const std::string& enc, int32_t bos) {
  if (enc == "none") return std::vector<int32_t>{};
  if (enc == "bos") {
    if (bos < 0) return absl::InvalidArgumentError("encoding 'bos' needs a model with a BOS token");
    return std::vector<int32_t>{bos};
  }
  if (enc.rfind("prefix:", 0) == 0) {
    std::vector<int32_t> out;
    std::istringstream in(enc.substr(7));
    int32_t t;
    while (in >> t) out.push_back(t);
    if (out.empty()) return absl::InvalidArgumentError("encoding prefix has no token ids");
    return out;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown encoding '", enc,
                                                 "' (expected none, bos or prefix:<ids>)"));
}

// Appends one layer of backend-resident segment KV (k and v, [n_tokens, kv_dim]) to a host
// SegmentKv in fp32: the spill of a device-tier segment and a capture too large for the tier.
absl::Status DownloadLayer(Backend& be, const Tensor& k, const Tensor& v, SegmentKv& kv) {
  const size_t n = static_cast<size_t>(kv.n_tokens) * kv.kv_dim;
  kv.k.emplace_back();
  kv.v.emplace_back();
  ResizeHuge(kv.k.back(), n);  // ~1 GiB per 8B-model segment: fewer first-touch faults
  ResizeHuge(kv.v.back(), n);
  RETURN_IF_ERROR(be.Download(k, kv.k.back()));
  return be.Download(v, kv.v.back());
}

// Frees a backend tensor at scope exit.
struct TensorGuard {
  Backend* be;
  Tensor t;
  ~TensorGuard() { be->Free(t); }
};

}  // namespace

absl::Status ValidateReuseOptions(const ReuseOptions& o, int n_layers) {
  if (o.full_layers < 0 || o.full_layers > n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("full_layers must be in [0, ", n_layers, "]"));
  }
  if (o.budget.ratio < 0 || o.budget.ratio > 1 || o.budget.max_ratio < 0 ||
      o.budget.max_ratio > 1 || o.budget.target_mass < 0 || o.budget.target_mass > 1 ||
      !(o.budget.target_drop >= 0) || !(o.budget.drop_per_uncovered > 0)) {
    return absl::InvalidArgumentError("budget ratios must be in [0, 1]");
  }
  for (size_t i = 0; i < o.layer_ratios.size(); ++i) {
    if (o.layer_ratios[i] < 0 || o.layer_ratios[i] > 1 ||
        (i > 0 && o.layer_ratios[i] > o.layer_ratios[i - 1])) {
      return absl::InvalidArgumentError("layer_ratios must be in [0, 1] and non-increasing");
    }
  }
  ASSIGN_OR_RETURN(auto unused, CreateSelector(o.selector));
  (void)unused;
  return EncodingContext(o.encoding, 0).status();
}

Hash128 ReuseEngine::Fingerprint(const std::vector<int32_t>& tokens, const std::string& encoding,
                                 const Hash128& scope) const {
  return SegmentFingerprint(ScopedModelFingerprint(engine_->kv_identity(), scope), tokens,
                            encoding);
}

absl::Status ReuseEngine::BeginEncoding(const Hash128& fp, const std::vector<int32_t>& tokens,
                                        const std::string& encoding) {
  EndEncoding();
  ASSIGN_OR_RETURN(std::vector<int32_t> ctx,
                   EncodingContext(encoding, engine_->model().tokenizer().bos_id()));
  std::vector<int32_t> all = ctx;
  all.insert(all.end(), tokens.begin(), tokens.end());
  if (static_cast<int>(all.size()) > engine_->model().config().max_seq_len) {
    return absl::InvalidArgumentError("segment longer than the context length");
  }
  auto j = std::make_unique<EncodeJob>();
  j->fp = fp;
  j->n_tokens = static_cast<int>(tokens.size());
  j->ctx = static_cast<int>(ctx.size());
  // With a device tier the K/V stay in backend memory (the compute dtype): no host round trip.
  j->cap.on_backend = tier_.capacity() > 0;
  // Fresh blocks, no prefix matching: every row must pass through every layer to be captured.
  j->seq.tokens = all;
  const int n = static_cast<int>(all.size());
  RETURN_IF_ERROR(engine_->EnsureCapacity(j->seq, n));
  job_ = std::move(j);
  job_->pos.resize(n);
  for (int i = 0; i < n; ++i) job_->pos[i] = i;
  job_->slots = engine_->CtxSlots(job_->seq, n);
  auto x = engine_->runner().Embed(all);
  if (!x.ok()) {
    EndEncoding();
    return x.status();
  }
  job_->x = *x;
  job_->has_x = true;
  return absl::OkStatus();
}

absl::Status ReuseEngine::StepEncoding(int max_layers) {
  ModelRunner& r = engine_->runner();
  EncodeJob& j = *job_;
  LayerRows rows{j.pos, j.slots, j.slots};
  for (int k = 0; k < max_layers && j.next_layer < r.config().n_layers; ++k, ++j.next_layer) {
    absl::Status st = r.Layer(j.next_layer, j.x, rows, nullptr, &j.cap);
    if (!st.ok()) {
      EndEncoding();
      return st;
    }
  }
  return absl::OkStatus();
}

void ReuseEngine::EndEncoding() {
  if (!job_) return;
  Backend& be = engine_->runner().backend();
  if (job_->has_x) be.Free(job_->x);
  engine_->Release(job_->seq);
  for (Tensor& t : job_->cap.dk) be.Free(t);
  for (Tensor& t : job_->cap.dv) be.Free(t);
  job_.reset();
}

absl::StatusOr<bool> ReuseEngine::FinishEncoding() {
  Backend& be = engine_->runner().backend();
  EncodeJob& j = *job_;
  // The pass's activations and KV blocks go first; only the captured K/V remain.
  be.Free(j.x);
  j.has_x = false;
  engine_->Release(j.seq);
  const int n = j.n_tokens, c = j.ctx, L = engine_->model().config().n_layers;
  const int kd = engine_->runner().kv_dim();
  const Hash128 fp = j.fp;
  SegmentKv kv;
  kv.n_tokens = n;
  kv.n_layers = L;
  kv.kv_dim = kd;
  if (j.cap.on_backend) {
    if (c > 0) {  // drop the encoding context's rows
      for (std::vector<Tensor>* side : {&j.cap.dk, &j.cap.dv}) {
        for (Tensor& t : *side) {
          auto part = be.Alloc(n, t.cols);
          absl::Status st = part.ok() ? be.CopyRows(t, c, *part, 0, n) : part.status();
          be.Free(t);
          if (part.ok()) t = *part;
          if (!st.ok()) {
            EndEncoding();
            return st;
          }
        }
      }
    }
    size_t bytes = 0;
    for (const Tensor& t : j.cap.dk) bytes += t.bytes();
    for (const Tensor& t : j.cap.dv) bytes += t.bytes();
    if (bytes <= tier_.capacity()) {
      tier_.Adopt(fp, n, std::move(j.cap.dk), std::move(j.cap.dv));
      j.cap.dk.clear();
      j.cap.dv.clear();
      EndEncoding();
      unspilled_.emplace_back(fp, n);
      return false;
    }
    // Larger than the whole tier: to the host store from the captured tensors.
    for (int l = 0; l < L; ++l) {
      absl::Status st = DownloadLayer(be, j.cap.dk[l], j.cap.dv[l], kv);
      if (!st.ok()) {
        EndEncoding();
        return st;
      }
    }
  } else {
    for (int l = 0; l < L; ++l) {
      if (c == 0) {  // no encoding context: the captured rows are the segment's (no copy)
        kv.k.push_back(std::move(j.cap.k[l]));
        kv.v.push_back(std::move(j.cap.v[l]));
      } else {
        kv.k.emplace_back(j.cap.k[l].begin() + static_cast<size_t>(c) * kd, j.cap.k[l].end());
        kv.v.emplace_back(j.cap.v[l].begin() + static_cast<size_t>(c) * kd, j.cap.v[l].end());
      }
    }
  }
  EndEncoding();
  RETURN_IF_ERROR(store_->Put(fp, std::move(kv)));
  return store_->Contains(fp);
}

absl::StatusOr<bool> ReuseEngine::StoreSegment(const Hash128& fp,
                                               const std::vector<int32_t>& tokens,
                                               const std::string& encoding) {
  RETURN_IF_ERROR(BeginEncoding(fp, tokens, encoding));
  RETURN_IF_ERROR(StepEncoding(engine_->model().config().n_layers));
  return FinishEncoding();
}

absl::StatusOr<StoreProgress> ReuseEngine::StoreStep(const std::vector<int32_t>& tokens,
                                                     const ReuseOptions* override_opts,
                                                     int max_layers) {
  const ReuseOptions& o = override_opts ? *override_opts : opts_;
  if (tokens.empty()) return StoreProgress::kHeld;
  const Hash128 fp = Fingerprint(tokens, o.encoding, o.scope);
  if (!job_ || job_->fp != fp) {
    if (Holds(fp)) {
      EndEncoding();
      return StoreProgress::kHeld;
    }
    RETURN_IF_ERROR(BeginEncoding(fp, tokens, o.encoding));
  }
  RETURN_IF_ERROR(StepEncoding(max_layers));
  if (job_->next_layer < engine_->model().config().n_layers) {
    // A slice ends when its GPU work has (see PrefillStep).
    RETURN_IF_ERROR(engine_->runner().backend().Synchronize());
    return StoreProgress::kRunning;
  }
  ASSIGN_OR_RETURN(const bool in_store, FinishEncoding());
  return in_store ? StoreProgress::kInStore : StoreProgress::kInTier;
}

bool ReuseEngine::Holds(const Hash128& fp) const {
  if (tier_.Resident(fp) || host_tier_.Resident(fp) || store_->Contains(fp)) return true;
  std::lock_guard<std::mutex> l(fetched_mu_);
  for (const auto& [f, kv] : fetched_) {
    if (f == fp) return true;
  }
  for (const Hash128& f : adopting_) {
    if (f == fp) return true;
  }
  for (const auto& [f, s] : streamed_) {
    if (f == fp && !s.seg->Failed()) return true;
  }
  return false;
}

void ReuseEngine::OfferStreamed(const Hash128& fp, std::shared_ptr<StreamedSegment> seg) {
  std::lock_guard<std::mutex> l(fetched_mu_);
  for (const auto& [f, s] : streamed_) {
    if (f == fp) return;  // another fetch streams it already
  }
  streamed_.push_back({fp, Streamed{std::move(seg), false}});
}

std::shared_ptr<StreamedSegment> ReuseEngine::ClaimStreamed(const Hash128& fp, int n) {
  const int L = engine_->model().config().n_layers, kd = engine_->runner().kv_dim();
  std::lock_guard<std::mutex> l(fetched_mu_);
  for (auto& [f, s] : streamed_) {
    if (f != fp || s.claimed || s.seg->Failed()) continue;
    const StreamedSegment& g = *s.seg;
    if (g.n_tokens() != n || g.n_layers() != L || g.kv_dim() != kd) return nullptr;
    s.claimed = true;
    return s.seg;
  }
  return nullptr;
}

void ReuseEngine::UnclaimStreamed(const std::vector<Hash128>& fps) {
  std::lock_guard<std::mutex> l(fetched_mu_);
  for (auto& [f, s] : streamed_) {
    if (std::find(fps.begin(), fps.end(), f) != fps.end()) s.claimed = false;
  }
}

void ReuseEngine::OfferFetched(const Hash128& fp, SegmentKvBf16 kv) {
  std::lock_guard<std::mutex> l(fetched_mu_);
  fetched_.emplace_back(fp, std::move(kv));
}

bool ReuseEngine::HasFetched() const {
  std::lock_guard<std::mutex> l(fetched_mu_);
  if (!fetched_.empty()) return true;
  for (const auto& [f, s] : streamed_) {
    if (!s.claimed && (s.seg->Complete() || s.seg->Failed())) return true;
  }
  return false;
}

int ReuseEngine::AdoptFetched(int max_segments) {
  std::vector<std::pair<Hash128, SegmentKvBf16>> in;
  std::vector<std::pair<Hash128, std::shared_ptr<StreamedSegment>>> in_streamed;
  {
    std::lock_guard<std::mutex> l(fetched_mu_);
    if (static_cast<int>(fetched_.size()) <= max_segments) {
      in.swap(fetched_);
    } else {
      std::move(fetched_.begin(), fetched_.begin() + max_segments, std::back_inserter(in));
      fetched_.erase(fetched_.begin(), fetched_.begin() + max_segments);
    }
    // Streamed segments no prefill reads: complete ones are uploaded from their own memory
    // (a pinned block copies without staging), failed ones go.
    for (auto it = streamed_.begin(); it != streamed_.end();) {
      Streamed& s = it->second;
      if (s.claimed || !(s.seg->Failed() || s.seg->Complete()) ||
          (!s.seg->Failed() &&
           static_cast<int>(in.size() + in_streamed.size()) >= max_segments)) {
        ++it;
        continue;
      }
      if (!s.seg->Failed()) in_streamed.emplace_back(it->first, std::move(s.seg));
      it = streamed_.erase(it);
    }
    for (const auto& [fp, kv] : in) adopting_.push_back(fp);
    for (const auto& [fp, seg] : in_streamed) adopting_.push_back(fp);
  }
  const int L = engine_->model().config().n_layers, kd = engine_->runner().kv_dim();
  // A segment that cannot be uploaded (memory) is dropped: the planner then misses it and the
  // prefill recomputes it, as for any miss. One in the device tier reaches the host store (and
  // from there the router's index) through SpillOne, like an encoded one.
  auto adopt = [&](const Hash128& fp, int n_tokens, int n_layers, int kv_dim, auto&& upload) {
    if (n_layers != L || kv_dim != kd || n_tokens <= 0) return;  // not this model's
    DeviceSegmentTier& t = tier_.capacity() > 0 ? tier_ : host_tier_;
    if (t.capacity() == 0 || t.Peek(fp) != nullptr) return;
    if (upload(t).ok() && &t == &tier_ && t.Peek(fp) != nullptr) {
      unspilled_.emplace_back(fp, n_tokens);
    }
  };
  for (auto& [fp, kv] : in) {
    adopt(fp, kv.n_tokens, kv.n_layers, kv.kv_dim,
          [&](DeviceSegmentTier& t) { return t.UploadBf16(fp, kv).status(); });
  }
  for (auto& [fp, seg] : in_streamed) {
    adopt(fp, seg->n_tokens(), seg->n_layers(), seg->kv_dim(),
          [&](DeviceSegmentTier& t) { return t.UploadBf16(fp, *seg).status(); });
  }
  if (!in.empty() || !in_streamed.empty()) {
    std::lock_guard<std::mutex> l(fetched_mu_);
    adopting_.clear();  // only this (engine) thread adopts
  }
  return static_cast<int>(in.size() + in_streamed.size());
}

absl::Status ReuseEngine::EnsureStored(const std::vector<int32_t>& tokens,
                                       const ReuseOptions* override_opts) {
  const ReuseOptions& o = override_opts ? *override_opts : opts_;
  if (tokens.empty()) return absl::OkStatus();
  const Hash128 fp = Fingerprint(tokens, o.encoding, o.scope);
  if (Holds(fp)) return absl::OkStatus();
  return StoreSegment(fp, tokens, o.encoding).status();
}

absl::StatusOr<std::optional<std::pair<Hash128, int>>> ReuseEngine::SpillOne(int max_layers) {
  using Done = std::optional<std::pair<Hash128, int>>;
  Backend& be = engine_->runner().backend();
  const int L = engine_->model().config().n_layers;
  const int kd = engine_->runner().kv_dim();
  while (!spill_ && !unspilled_.empty()) {
    const auto [fp, n] = unspilled_.front();
    unspilled_.pop_front();
    std::shared_ptr<const DeviceSegment> seg = tier_.Peek(fp);
    if (seg == nullptr || store_->Contains(fp)) continue;  // evicted meanwhile, or stored
    spill_.emplace();
    spill_->fp = fp;
    spill_->seg = std::move(seg);
    spill_->kv.n_tokens = spill_->seg->n_tokens;
    spill_->kv.n_layers = L;
    spill_->kv.kv_dim = kd;
  }
  if (!spill_) return Done();
  SpillJob& j = *spill_;
  // The job holds the segment (shared ownership), so a tier eviction meanwhile is harmless.
  for (int done = 0; done < max_layers && j.next_layer < L; ++done, ++j.next_layer) {
    const int l = j.next_layer;
    absl::Status st = DownloadLayer(be, j.seg->k[l], j.seg->v[l], j.kv);
    if (!st.ok()) {
      spill_.reset();
      return st;
    }
  }
  if (j.next_layer < L) return Done();
  const Hash128 fp = j.fp;
  const int n = j.kv.n_tokens;
  absl::Status st = store_->Put(fp, std::move(j.kv));
  spill_.reset();
  RETURN_IF_ERROR(st);
  if (!store_->Contains(fp)) return Done();
  return Done({fp, n});
}

// A reuse prefill between its slices: everything the pass keeps from one layer to the next.
struct ReuseEngine::PrefillJob {
  ReuseOptions o;
  std::vector<PromptSegment> segs;
  std::unique_ptr<Selector> selector;
  Engine* engine = nullptr;
  Backend* be = nullptr;
  Sequence seq;
  bool own_seq = true;  // released with the job unless handed to the result
  ReusePrefillResult res;
  int P = 0, N = 0, n_rows = 0, F = 0, L = 0, next_layer = 0;
  int next_row = 0;  // a full layer run in row chunks: its first row not yet computed
  ReusePlan plan;
  std::vector<std::shared_ptr<const DeviceSegment>> found;
  std::vector<char> from_host;  // found in the pinned host tier
  bool add_bos = false;
  // Segments read from a cluster fetch in progress (ReuseEngine::OfferStreamed): the fetch's
  // buffers, and the tier memory found[s] points at, filled layer by layer.
  std::vector<std::shared_ptr<StreamedSegment>> streamed;  // [segment] or null
  std::vector<std::shared_ptr<DeviceSegment>> streamed_dst;
  std::vector<size_t> streamed_ids;
  std::optional<std::chrono::steady_clock::time_point> stream_wait_since;  // a layer missing
  std::function<void()> on_end;  // gives the streamed segments back (the job ends)
  // Layer l of streamed segment s from the fetch's buffer into its tier memory, copied off the
  // compute stream (BeginPrefill synchronised after reserving that memory): the engine thread
  // stages layer l + 1 while layer l computes (from a pinned block the GPU reads it directly);
  // work enqueued from here on sees the layer.
  absl::Status UploadStreamed(size_t s, int l) {
    ASSIGN_OR_RETURN(const int64_t tk,
                     be->UploadBf16Async(streamed[s]->k(l), streamed_dst[s]->k[l]));
    ASSIGN_OR_RETURN(const int64_t tv,
                     be->UploadBf16Async(streamed[s]->v(l), streamed_dst[s]->v[l]));
    RETURN_IF_ERROR(be->Await(tk));
    return be->Await(tv);
  }
  struct Placement {
    std::vector<int32_t> pos, slots;
    int64_t row0 = 0;  // first reused row of the segment (reused rows are contiguous)
  };
  std::vector<Placement> place;
  struct Staged {
    Tensor k, v;
    int64_t tk = 0, tv = 0;
  };
  std::vector<std::vector<Staged>> staged;  // [segment][layer - F]
  std::vector<int32_t> ctx, pos_all, slot_all, qgroup;
  std::vector<float> recv_w, cross, recv;
  bool want_attn = false;
  int stats_from = 0, stats_layers = 0;
  Tensor x;   // residual stream of every non-prefix row (the full layers)
  Tensor xs;  // of the rows in `cur` once the sparse layers dropped some
  bool has_xs = false;
  std::vector<int32_t> reused_rows;  // row index (position - P) of every reused token
  std::vector<int32_t> ranked;       // into reused_rows, most important first
  std::vector<int32_t> cur;          // rows (index into the full row set) currently in xs
  // Layer F's K/V of every row were written from their exact input at the selection
  // (ReuseOptions::refresh_first_sparse_kv): the stored KV is not assembled at layer F.
  bool refreshed = false;
  // [segment]: its KV of every sparse layer was queued at the selection (Select).
  std::vector<char> assembled_ahead;
  std::chrono::steady_clock::time_point mark;

  ~PrefillJob() {
    // Copies out of a streamed segment's pinned block read it until they ran: the block goes
    // back to the arena (and the next fetch) with the last reference, so they finish first.
    if (!streamed_ids.empty()) (void)be->Synchronize();
    if (on_end) on_end();
    for (auto& layers : staged) {
      for (Staged& s : layers) {
        // A copy may still be writing: order the frees after it.
        (void)be->Await(s.tk);
        (void)be->Await(s.tv);
        be->Free(s.k);
        be->Free(s.v);
      }
    }
    be->Free(x);
    if (has_xs) be->Free(xs);
    if (own_seq) engine->Release(seq);
  }
  Tensor& rows_x() { return has_xs ? xs : x; }
  // Phase times (ReuseOptions::profile): wait for the device, charge the time since the mark.
  absl::Status Phase(double* ms) {
    if (!o.profile) return absl::OkStatus();
    RETURN_IF_ERROR(be->Synchronize());
    const auto now = std::chrono::steady_clock::now();
    *ms += std::chrono::duration<double, std::milli>(now - mark).count();
    mark = now;
    return absl::OkStatus();
  }
};

ReuseEngine::ReuseEngine(Engine* engine, SegmentStore* store, ReuseOptions opts,
                         size_t device_tier_bytes, size_t host_tier_bytes)
    : engine_(engine),
      store_(store),
      opts_(std::move(opts)),
      tier_(&engine->runner().backend(), device_tier_bytes),
      host_tier_(&engine->runner().backend(), host_tier_bytes, /*host_memory=*/true) {
  if (opts_.stream_pinned_bytes > 0) {
    Backend& be = engine->runner().backend();
    const int64_t cols = 1 << 16;  // the block as one tensor of 64K-element rows
    const int64_t esize = static_cast<int64_t>(DTypeSize(be.compute_dtype()));
    const int64_t rows =
        (static_cast<int64_t>(opts_.stream_pinned_bytes) + cols * esize - 1) / (cols * esize);
    absl::StatusOr<Tensor> t = be.AllocHost(rows, cols);
    if (t.ok()) {
      arena_mem_ = *t;
      arena_ = std::make_shared<HostArena>(static_cast<uint8_t*>(t->data),
                                           std::min(t->bytes(), opts_.stream_pinned_bytes));
    } else {
      // Not fatal: streamed segments then take pageable memory (slower uploads, same result).
      std::cerr << "warning: no pinned memory for streamed fetches (" << t.status()
                << "); they use pageable memory\n";
    }
  }
}

ReuseEngine::~ReuseEngine() {
  prefill_.reset();  // before the tiers its segments come from
  EndEncoding();
  {
    std::lock_guard<std::mutex> l(fetched_mu_);
    streamed_.clear();  // the engine's references to streamed segments
  }
  // A segment still held (a fetch in flight at shutdown) keeps writing into the block: then it
  // is left to the process's exit rather than freed under it.
  if (arena_ && arena_->used() == 0) engine_->runner().backend().Free(arena_mem_);
}

std::shared_ptr<StreamedSegment> ReuseEngine::NewStreamedSegment(int n_tokens) {
  const int L = engine_->model().config().n_layers, kd = engine_->runner().kv_dim();
  const size_t bytes = StreamedSegment::Bytes(n_tokens, L, kd);
  if (arena_ && n_tokens > 0) {
    if (uint8_t* p = arena_->Allocate(bytes)) {
      return std::make_shared<StreamedSegment>(
          n_tokens, L, kd, reinterpret_cast<uint16_t*>(p),
          [arena = arena_, p] { arena->Free(p); });
    }
  }
  return std::make_shared<StreamedSegment>(n_tokens, L, kd);
}

absl::StatusOr<ReusePrefillResult> ReuseEngine::Prefill(const std::vector<PromptSegment>& segs,
                                                        bool add_bos,
                                                        const ReuseOptions* override_opts) {
  RETURN_IF_ERROR(BeginPrefill(segs, add_bos, override_opts));
  for (;;) {
    ASSIGN_OR_RETURN(std::optional<ReusePrefillResult> r, PrefillStep(INT64_MAX));
    if (r) return std::move(*r);
  }
}

void ReuseEngine::AbortPrefill() { prefill_.reset(); }

int64_t ReuseEngine::prefill_row_layers() const {
  return prefill_ ? prefill_->res.stats.computed_token_layers : 0;
}

absl::Status ReuseEngine::BeginPrefill(const std::vector<PromptSegment>& segs, bool add_bos,
                                       const ReuseOptions* override_opts) {
  prefill_.reset();
  AdoptFetched();
  auto j = std::make_unique<PrefillJob>();
  j->engine = engine_;
  j->be = &engine_->runner().backend();
  j->o = override_opts ? *override_opts : opts_;
  const ReuseOptions& o = j->o;
  const ModelConfig& cfg = engine_->model().config();
  const int L = cfg.n_layers;
  RETURN_IF_ERROR(ValidateReuseOptions(o, L));
  ASSIGN_OR_RETURN(j->selector, CreateSelector(o.selector, o.sparsex_weights));
  Backend& be = *j->be;
  j->mark = std::chrono::steady_clock::now();
  j->segs = segs;
  j->add_bos = add_bos;
  const int32_t bos = add_bos ? engine_->model().tokenizer().bos_id() : -1;
  // From here on an error destroys the job, which releases the sequence's blocks.
  ASSIGN_OR_RETURN(j->seq, engine_->Admit(PromptTokens(segs, bos), o.register_approximate_prefix,
                                          o.scope));
  ReuseStats& st = j->res.stats;
  const int P = j->P = j->seq.cached_prefix;

  // ---- plan (planner.h): layout, tier lookups in order (device, pinned host, host store; a
  // store hit is uploaded into a tier; checksums verified on Get, a corrupt entry is a miss) ----
  j->found.resize(segs.size());
  j->from_host.assign(segs.size(), 0);
  j->assembled_ahead.assign(segs.size(), 0);
  j->streamed.resize(segs.size());
  j->streamed_dst.resize(segs.size());
  auto& found = j->found;
  auto& from_host = j->from_host;
  const int kd = engine_->runner().kv_dim();
  const int64_t corrupt0 = store_->stats().corrupt;
  absl::Status lookup_error;
  j->plan = PlanReuse(
      segs, bos, P, engine_->blocks().block_size(), o, engine_->kv_identity(),
      [&](size_t s, const Hash128& fp, int n) -> SegmentTier {
        if ((found[s] = tier_.Get(fp))) {
          ++st.segments_device_hit;
          return SegmentTier::kDevice;
        }
        if ((found[s] = host_tier_.Get(fp))) {
          ++st.segments_host_hit;
          from_host[s] = 1;
          return SegmentTier::kPinnedHost;
        }
        if (std::shared_ptr<StreamedSegment> in = ClaimStreamed(fp, n)) {
          auto dst = tier_.Reserve(n, L, kd);
          if (!dst.ok()) {  // no memory for it now: a miss (recomputed)
            UnclaimStreamed({fp});
            return SegmentTier::kNone;
          }
          j->streamed[s] = std::move(in);
          j->streamed_dst[s] = *dst;
          j->streamed_ids.push_back(s);
          found[s] = *dst;
          ++st.segments_streamed;
          return SegmentTier::kDevice;
        }
        auto kv = store_->Get(fp);
        if (!kv || kv->n_tokens != n || kv->n_layers != L || kv->kv_dim != kd) {
          return SegmentTier::kNone;
        }
        const bool to_host = tier_.capacity() == 0 && host_tier_.capacity() > 0;
        auto up = (to_host ? host_tier_ : tier_).Upload(fp, *kv);
        if (!up.ok()) {
          if (lookup_error.ok()) lookup_error = up.status();
          return SegmentTier::kNone;
        }
        found[s] = *up;
        from_host[s] = to_host;
        return SegmentTier::kHostStore;
      });
  if (!j->streamed_ids.empty()) {
    std::vector<Hash128> fps;
    for (size_t s : j->streamed_ids) fps.push_back(j->plan.segments[s].fp);
    j->on_end = [this, fps] { UnclaimStreamed(fps); };
    // UploadStreamed copies off the compute stream, unordered with it: the tier memory just
    // reserved (stream-ordered allocation, perhaps reusing memory queued work still frees) must
    // be settled first. Once per request with a fetch in flight.
    RETURN_IF_ERROR(j->be->Synchronize());
  }
  RETURN_IF_ERROR(lookup_error);
  const ReusePlan& plan = j->plan;
  st.segments_corrupt = static_cast<int>(store_->stats().corrupt - corrupt0);
  const std::vector<int32_t>& tokens = plan.tokens;
  const std::vector<int32_t>& group = plan.group;
  const std::vector<char>& reused = plan.reused;
  const int N = j->N = static_cast<int>(tokens.size());
  st.prompt_tokens = N;
  st.prefix_tokens = P;
  st.segments_hit = plan.segments_hit;
  st.segments_missed = plan.segments_missed;
  st.reused_tokens = plan.reused_tokens;
  st.new_tokens = plan.new_tokens;
  const int n_rows = j->n_rows = N - P;

  // ---- where each reused segment's rows go (assembled layer by layer before the sparse
  // layers: the full layers [0, F) recompute every row and never read them) ----
  const int F = j->F = o.enable_reuse ? o.full_layers : L;
  j->L = L;
  ModelRunner& r = engine_->runner();
  const int bs = engine_->blocks().block_size();
  j->place.resize(segs.size());
  for (size_t s = 0; s < segs.size(); ++s) {
    const SegmentPlan& sp = plan.segments[s];
    if (!Reused(sp.tier)) continue;
    for (int p = sp.reuse_begin; p < sp.end; ++p) {
      if (!reused[p]) continue;
      j->place[s].pos.push_back(p);
      j->place[s].slots.push_back(j->seq.Slot(p, bs));
    }
    j->place[s].row0 = sp.reuse_begin - sp.begin;
  }
  // Host-tier segments: every sparse layer's K/V copied to the device on the backend's copy
  // stream, enqueued now so the copies run beside the full layers; awaited layer by layer.
  j->staged.resize(segs.size());
  for (int l = F; l < L; ++l) {
    for (size_t s = 0; s < segs.size(); ++s) {
      if (!from_host[s] || j->place[s].pos.empty()) continue;
      PrefillJob::Staged& x = j->staged[s].emplace_back();
      ASSIGN_OR_RETURN(x.k, be.Alloc(found[s]->k[l].rows, kd));
      ASSIGN_OR_RETURN(x.v, be.Alloc(found[s]->v[l].rows, kd));
      ASSIGN_OR_RETURN(x.tk, be.Prefetch(found[s]->k[l], x.k));
      ASSIGN_OR_RETURN(x.tv, be.Prefetch(found[s]->v[l], x.v));
    }
  }

  // ---- inputs of the full layers [0, F): every non-prefix row, with the selection signal ----
  j->ctx = engine_->CtxSlots(j->seq, N);
  j->pos_all.resize(n_rows);
  j->slot_all.resize(n_rows);
  j->qgroup.resize(n_rows);
  j->recv_w.resize(n_rows);
  j->cross.assign(n_rows, 0.0f);
  j->recv.assign(N, 0.0f);
  for (int i = 0; i < n_rows; ++i) {
    j->pos_all[i] = P + i;
    j->slot_all[i] = j->ctx[P + i];
    j->qgroup[i] = group[P + i];
    j->recv_w[i] = reused[P + i] ? 0.0f : 1.0f;
  }
  RETURN_IF_ERROR(j->Phase(&st.lookup_ms));
  ASSIGN_OR_RETURN(j->x, r.Embed(std::span<const int32_t>(tokens.data() + P, n_rows)));
  j->want_attn = j->selector->needs_attention_stats() && st.reused_tokens > 0;
  j->stats_from = o.stats_all_full_layers ? 0 : F - 1;
  j->stats_layers = F - std::max(0, j->stats_from);
  for (int i = 0; i < n_rows; ++i) j->cur.push_back(i);
  prefill_ = std::move(j);
  return absl::OkStatus();
}

namespace {
// RunPrefillLayers' status when a streamed segment will not arrive (PrefillStep starts over).
constexpr absl::string_view kStreamFailed = "reuse prefill: a streamed segment did not arrive";
}  // namespace

absl::StatusOr<bool> ReuseEngine::StreamedLayer(PrefillJob& j, int l, bool wait) {
  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  for (size_t s : j.streamed_ids) {
    StreamedSegment& in = *j.streamed[s];
    if (in.Ready(l)) continue;
    if (!j.stream_wait_since) j.stream_wait_since = Clock::now();
    // A short wait: other sequences' decode steps share the iteration it holds.
    if (!in.Failed() && wait) in.Wait(l, std::chrono::milliseconds(5));
    if (in.Failed()) return absl::AbortedError(kStreamFailed);
    if (!in.Ready(l)) return false;  // the iteration goes back to the scheduler meanwhile
  }
  ReuseStats& st = j.res.stats;
  if (j.stream_wait_since) {
    st.stream_wait_ms += ms_since(*j.stream_wait_since);
    j.stream_wait_since.reset();
  }
  const Clock::time_point t = Clock::now();
  for (size_t s : j.streamed_ids) RETURN_IF_ERROR(j.UploadStreamed(s, l));
  st.stream_upload_ms += ms_since(t);
  return true;
}

void ReuseEngine::KeepStreamed(PrefillJob& j) {
  // Without a sparse layer nothing was uploaded: AdoptFetched takes the segments once complete.
  if (j.F >= j.L) return;
  std::vector<Hash128> kept;
  for (size_t s : j.streamed_ids) {
    StreamedSegment& in = *j.streamed[s];
    // The sparse layers uploaded [F, L) as they arrived; the full layers' [0, F) now.
    bool ok = true;
    for (int l = 0; l < j.F && ok; ++l) ok = in.Ready(l) && j.UploadStreamed(s, l).ok();
    if (!ok) continue;  // left to AdoptFetched once complete
    const Hash128 fp = j.plan.segments[s].fp;
    if (tier_.Insert(fp, j.streamed_dst[s]) && tier_.Peek(fp) != nullptr) {
      unspilled_.emplace_back(fp, in.n_tokens());
    }
    kept.push_back(fp);
  }
  if (kept.empty()) return;
  std::lock_guard<std::mutex> l(fetched_mu_);
  std::erase_if(streamed_, [&](const auto& e) {
    return std::find(kept.begin(), kept.end(), e.first) != kept.end();
  });
}

absl::StatusOr<std::optional<ReusePrefillResult>> ReuseEngine::PrefillStep(
    int64_t max_row_layers) {
  if (!prefill_) return absl::FailedPreconditionError("PrefillStep: no reuse prefill in progress");
  // Any error ends the job: its blocks go back to the pool.
  absl::StatusOr<bool> done = RunPrefillLayers(max_row_layers);
  if (!done.ok() && done.status().code() == absl::StatusCode::kAborted &&
      done.status().message() == kStreamFailed) {
    // A streamed segment failed mid-pass (its later layers will not come): the pass starts
    // over, and the planner no longer finds it, so its tokens are computed.
    const std::vector<PromptSegment> segs = prefill_->segs;
    const bool add_bos = prefill_->add_bos;
    const ReuseOptions o = prefill_->o;
    const int restarts = prefill_->res.stats.stream_restarts + 1;
    prefill_.reset();
    RETURN_IF_ERROR(BeginPrefill(segs, add_bos, &o));
    prefill_->res.stats.stream_restarts = restarts;
    return std::optional<ReusePrefillResult>();
  }
  if (!done.ok()) {
    prefill_.reset();
    return done.status();
  }
  if (!*done) {
    // The slice ends when its GPU work has: kernels are queued asynchronously, and a slice
    // that returned at once let the scheduler queue the whole pass before a newly arrived
    // request's work (on the H200 a correctness-gate replay of a 32K prompt, sliced by
    // layers, still held every request that arrived during it for 1.1 s).
    RETURN_IF_ERROR(prefill_->be->Synchronize());
    return std::optional<ReusePrefillResult>();
  }
  absl::StatusOr<ReusePrefillResult> r = FinishPrefill();
  if (r.ok()) KeepStreamed(*prefill_);
  prefill_.reset();
  if (!r.ok()) return r.status();
  return std::optional<ReusePrefillResult>(std::move(*r));
}

absl::StatusOr<bool> ReuseEngine::RunPrefillLayers(int64_t max_row_layers) {
  PrefillJob& j = *prefill_;
  const ReuseOptions& o = j.o;
  ReuseStats& st = j.res.stats;
  ModelRunner& r = engine_->runner();
  Backend& be = *j.be;
  const int P = j.P, F = j.F, L = j.L, n_rows = j.n_rows;
  const ReusePlan& plan = j.plan;
  const std::vector<char>& reused = plan.reused;
  int64_t spent = 0;
  // Whole layers until the slice's rows are spent (at least one layer per call).
  while (j.next_layer < L && (spent == 0 || spent < max_row_layers)) {
    const int l = j.next_layer;
    if (l < F) {
      // ---- full layers [0, F): every non-prefix row, with the selection signal; in row
      // chunks when the rest of the layer exceeds what is left of the slice ----
      const int64_t r0 = j.next_row;
      int64_t take = n_rows - r0;
      if (j.o.split_full_layers && (spent > 0 || take > max_row_layers)) {
        take = std::min(take, std::max(max_row_layers - spent, kMinFullLayerRows));
      }
      const std::span<const int32_t> pos = std::span<const int32_t>(j.pos_all).subspan(r0, take);
      const std::span<const int32_t> slots =
          std::span<const int32_t>(j.slot_all).subspan(r0, take);
      LayerRows rows{pos, slots, j.ctx};
      AttentionArgs stats;
      const bool measure = j.want_attn && l >= j.stats_from;
      if (measure) {
        stats.key_group = plan.group;
        stats.q_group = std::span<const int32_t>(j.qgroup).subspan(r0, take);
        stats.out_cross = j.cross.data() + r0;
        stats.recv_weight = std::span<const float>(j.recv_w).subspan(r0, take);
        stats.out_recv = j.recv.data();
      }
      Tensor x = take == n_rows ? j.x : RowView(j.x, r0, take);
      RETURN_IF_ERROR(r.Layer(l, x, rows, measure ? &stats : nullptr));
      st.computed_token_layers += take;
      spent += take;
      j.next_row = static_cast<int>(r0 + take);
      if (j.next_row < n_rows) continue;  // the slice is spent: the rest of the layer next
      j.next_row = 0;
      ++j.next_layer;
      if (j.next_layer == F) RETURN_IF_ERROR(j.Phase(&st.full_ms));
      continue;
    }
    // ---- streamed segments: this layer must have arrived (before any of the layer's work, so
    // that a slice can end here and the next resume at the same layer) ----
    if (!j.streamed_ids.empty()) {
      ASSIGN_OR_RETURN(const bool here, StreamedLayer(j, l, /*wait=*/spent == 0));
      if (!here) return false;
    }
    if (l == F) RETURN_IF_ERROR(Select(j));
    // ---- sparse layers [F, L): selected reused rows + every new row + the last row ----
    std::vector<int32_t> want;
    {
      int keep = static_cast<int>(j.ranked.size());
      const int li = l - F;
      if (li < static_cast<int>(o.layer_ratios.size())) {
        keep = std::min(keep, static_cast<int>(std::lround(
                                  o.layer_ratios[li] * static_cast<double>(j.reused_rows.size()))));
      }
      for (int i = 0; i < keep; ++i) want.push_back(j.reused_rows[j.ranked[i]]);
      for (int i = 0; i < n_rows; ++i) {
        if (!reused[P + i]) want.push_back(i);
      }
      std::sort(want.begin(), want.end());
    }
    if (l == F) st.selected_tokens = static_cast<int>(want.size()) - st.new_tokens;
    if (want != j.cur) {
      // want is a subset of cur (budgets are non-increasing): gather its rows.
      std::vector<int32_t> idx;
      size_t k = 0;
      for (int32_t w : want) {
        while (k < j.cur.size() && j.cur[k] < w) ++k;
        idx.push_back(static_cast<int32_t>(k));
      }
      ASSIGN_OR_RETURN(Tensor nx, be.Alloc(static_cast<int64_t>(want.size()), r.config().dim));
      absl::Status gs = be.GatherRows(j.rows_x(), idx, nx);
      if (!gs.ok()) {
        be.Free(nx);
        return gs;
      }
      if (j.has_xs) be.Free(j.xs);
      j.xs = nx;
      j.has_xs = true;
      j.cur = std::move(want);
    }
    std::vector<int32_t> pos(j.cur.size()), slots(j.cur.size());
    for (size_t i = 0; i < j.cur.size(); ++i) {
      pos[i] = P + j.cur[i];
      slots[i] = j.ctx[P + j.cur[i]];
      st.sparse_attended_keys += pos[i] + 1;
    }
    // The reused KV of this layer goes in first; the rows recomputed below overwrite theirs.
    // Layer F's was written fresh at the selection (refresh_first_sparse_kv).
    const bool assemble = !(l == F && j.refreshed);
    for (size_t s = 0; s < j.segs.size(); ++s) {
      const PrefillJob::Placement& pl = j.place[s];
      if (pl.pos.empty()) continue;
      if (j.from_host[s]) {
        PrefillJob::Staged& x = j.staged[s][l - F];
        RETURN_IF_ERROR(be.Await(x.tk));
        RETURN_IF_ERROR(be.Await(x.tv));
        if (assemble) RETURN_IF_ERROR(r.AssembleKvFrom(l, x.k, x.v, pl.row0, pl.pos, pl.slots));
        be.Free(x.k);  // stream-ordered: after the assembly that reads it
        be.Free(x.v);
        x.k = x.v = Tensor{};
      } else if (assemble && !j.assembled_ahead[s]) {
        RETURN_IF_ERROR(r.AssembleKvFrom(l, j.found[s]->k[l], j.found[s]->v[l], pl.row0, pl.pos,
                                         pl.slots));
      }
    }
    LayerRows rows{pos, slots, j.ctx};
    RETURN_IF_ERROR(r.Layer(l, j.rows_x(), rows));
    st.computed_token_layers += static_cast<int64_t>(j.cur.size());
    spent += static_cast<int64_t>(j.cur.size());
    ++j.next_layer;
  }
  return j.next_layer >= L;
}

absl::Status ReuseEngine::KvDeviation(PrefillJob& j, const Tensor& qkv_r,
                                      std::vector<float>* out) {
  ModelRunner& r = engine_->runner();
  Backend& be = *j.be;
  const int F = j.F, kd = r.kv_dim();
  const int64_t nr = static_cast<int64_t>(j.reused_rows.size());
  const int64_t qd = static_cast<int64_t>(r.config().n_heads) * r.config().head_dim;
  ASSIGN_OR_RETURN(Tensor ref_k, be.Alloc(nr, kd));
  TensorGuard kg{&be, ref_k};
  ASSIGN_OR_RETURN(Tensor ref_v, be.Alloc(nr, kd));
  TensorGuard vg{&be, ref_v};
  int64_t row = 0;  // reused rows are in position order, segment by segment
  for (size_t s = 0; s < j.segs.size(); ++s) {
    if (!j.found[s]) continue;
    const SegmentPlan& sp = j.plan.segments[s];
    int cnt = 0;
    for (int p = sp.reuse_begin; p < sp.end; ++p) cnt += j.plan.reused[p];
    RETURN_IF_ERROR(be.CopyRows(j.found[s]->k[F], sp.reuse_begin - sp.begin, kg.t, row, cnt));
    RETURN_IF_ERROR(be.CopyRows(j.found[s]->v[F], sp.reuse_begin - sp.begin, vg.t, row, cnt));
    row += cnt;
  }
  out->assign(nr, 0.0f);
  RETURN_IF_ERROR(be.RowSqDist(qkv_r, qd, kg.t, 0, kd, *out));
  RETURN_IF_ERROR(be.RowSqDist(qkv_r, qd + kd, vg.t, 0, kd, *out));
  // Each tensor-parallel rank holds only its KV heads: sum so all ranks rank identically.
  return r.SumAcrossRanks(*out);
}

// ---- switch: rank the reused tokens ----
absl::Status ReuseEngine::Select(PrefillJob& j) {
  ModelRunner& r = engine_->runner();
  Backend& be = *j.be;
  const int P = j.P, F = j.F, L = j.L;
  const ReusePlan& plan = j.plan;
  for (int i = 0; i < j.n_rows; ++i) {
    if (plan.reused[P + i]) j.reused_rows.push_back(i);
  }
  if (F < L && !j.reused_rows.empty()) {
    SelectionInput in;
    in.seed = j.o.seed;
    for (int32_t i : j.reused_rows) {
      const int p = P + i;
      in.segment.push_back(plan.group[p]);
      in.offset.push_back(p - plan.segments[plan.group[p]].begin);
      in.cross_mass.push_back(j.stats_layers > 0 ? j.cross[i] / j.stats_layers : 0.0f);
      in.new_recv.push_back(j.stats_layers > 0 ? j.recv[p] / j.stats_layers : 0.0f);
    }
    // A fixed budget that keeps every reused row in every sparse layer recomputes them all:
    // neither the ranking nor layer F's stale KV matters then.
    const BudgetOptions& ob = j.o.budget;
    bool keeps_all = ob.mode == BudgetOptions::Mode::kFixed && ob.ratio >= 1.0f;
    for (float lr : j.o.layer_ratios) keeps_all = keeps_all && lr >= 1.0f;
    const bool wants_deviation = j.selector->needs_kv_deviation();
    if (wants_deviation) in.kv_deviation.assign(j.reused_rows.size(), 0.0f);
    const bool deviation = wants_deviation && !keeps_all;
    const bool refresh = j.o.refresh_first_sparse_kv && !keeps_all;
    if (deviation || refresh) {
      // Layer F's projection of every row from its exact input (the full layers computed them
      // all): the deviation of the reused rows' K and V from what the store holds (pre-RoPE,
      // on the backend: one float per row comes back), and their fresh K/V at layer F.
      ASSIGN_OR_RETURN(Tensor qkv_all, r.ProjectQkv(F, j.x));
      TensorGuard qg{&be, qkv_all};
      j.res.stats.projected_token_layers += static_cast<double>(j.x.rows) * r.ProjectionCost();
      if (deviation) {
        ASSIGN_OR_RETURN(Tensor qkv_r, be.Alloc(static_cast<int64_t>(j.reused_rows.size()),
                                                qkv_all.cols));
        TensorGuard rg{&be, qkv_r};
        RETURN_IF_ERROR(be.GatherRows(qkv_all, j.reused_rows, rg.t));
        RETURN_IF_ERROR(KvDeviation(j, rg.t, &in.kv_deviation));
      }
      if (refresh) {
        RETURN_IF_ERROR(r.WriteProjectedKv(F, qg.t, j.pos_all, j.slot_all));
        j.refreshed = true;
      }
    }
    // The kept tokens, best first: per-layer ratios take prefixes of this ranking.
    BudgetOptions b = j.o.budget;
    const float slope = j.o.calibration.SlopeFor(F, b.drop_per_uncovered);
    if (b.mode == BudgetOptions::Mode::kQuality) {
      // Capped where recompute would cost more than full prefill: the pass computes F layers
      // of every non-prefix row, L - F layers of the new rows and k reused ones, plus the
      // selection's layer-F projection of every row (ProjectionCost of a layer each).
      const double n = j.n_rows, reused = static_cast<double>(j.reused_rows.size());
      const double k_max = reused - std::ceil(r.ProjectionCost() * n / (L - F));
      b.drop_per_uncovered = slope;
      b.max_ratio = static_cast<float>(std::clamp(k_max / reused, 0.0, 1.0));
    }
    // The ranking (host only, ~1-2 ms at 32K) runs beside the KV assembly's launches below
    // (one per segment and layer, ~4 ms of launching at 8 segments x 30 layers), so the GPU
    // does not wait for both one after the other (a traced 32K prefill's idle time 7.5 -> 1.4
    // ms; its wall time on a power-capped H100 did not change, docs/perf-notes.md).
    // The task only reads `in` and the selector; the future is waited for on every path out of
    // this scope.
    // The ranking and its uncovered share.
    std::future<std::pair<std::vector<int32_t>, double>> ranking =
        std::async(std::launch::async, [&j, &in, &b] {
          std::vector<int32_t> ranked = j.selector->Rank(in, b);
          const double uncovered = UncoveredShare(j.selector->Score(in), ranked);
          return std::make_pair(std::move(ranked), uncovered);
        });
    // The KV assembly of every sparse layer depends neither on the ranking nor on the
    // activations: queued now, the device runs it while the host ranks (the deviation's
    // download above left it idle), and the sparse layers need not stage it layer by layer.
    // Device-tier segments only: host-tier ones arrive layer by layer on the copy stream,
    // streamed ones as the cluster delivers them.
    absl::Status queued = absl::OkStatus();
    for (size_t s = 0; s < j.segs.size() && j.o.assemble_kv_ahead && queued.ok(); ++s) {
      const PrefillJob::Placement& pl = j.place[s];
      if (pl.pos.empty() || !j.found[s] || j.from_host[s] || j.streamed[s]) continue;
      for (int l = j.refreshed ? F + 1 : F; l < L && queued.ok(); ++l) {
        queued = r.AssembleKvFrom(l, j.found[s]->k[l], j.found[s]->v[l], pl.row0, pl.pos,
                                  pl.slots);
      }
      if (queued.ok()) j.assembled_ahead[s] = 1;
    }
    std::tie(j.ranked, j.res.stats.uncovered_share) = ranking.get();
    RETURN_IF_ERROR(queued);
    j.res.stats.predicted_drop = slope * j.res.stats.uncovered_share;
  }
  return j.Phase(&j.res.stats.select_ms);
}

// ---- after the pass: logits, store what was missing (or report it: a caller that defers
// stores turns store_new_segments off), register blocks for prefix reuse ----
absl::StatusOr<ReusePrefillResult> ReuseEngine::FinishPrefill() {
  PrefillJob& j = *prefill_;
  const ReuseOptions& o = j.o;
  ReuseStats& st = j.res.stats;
  ReusePrefillResult& res = j.res;
  ModelRunner& r = engine_->runner();
  const int P = j.P, F = j.F, L = j.L, N = j.N, n_rows = j.n_rows;
  const ReusePlan& plan = j.plan;
  if (F >= L) {
    // No sparse layer ran (the selection with it): every reused token was recomputed. The
    // full layers' time was charged after the last of them.
    st.selected_tokens = st.reused_tokens;
  } else {
    RETURN_IF_ERROR(j.Phase(&st.sparse_ms));
  }
  // The last row is always present and last in position order.
  const int32_t last = static_cast<int32_t>(j.cur.size()) - 1;
  ASSIGN_OR_RETURN(res.logits, r.Logits(j.rows_x(), std::span<const int32_t>(&last, 1)));
  RETURN_IF_ERROR(j.Phase(&st.logits_ms));
  j.seq.computed = N;
  st.compute_share =
      n_rows > 0 ? (static_cast<double>(st.computed_token_layers) + st.projected_token_layers) /
                       (static_cast<double>(L) * n_rows)
                 : 0.0;
  for (int s : plan.missing) {
    const SegmentPlan& sp = plan.segments[s];
    if (Holds(sp.fp)) continue;
    const int n = sp.end - sp.begin;
    if (o.enable_reuse && o.store_new_segments) {
      // In the device tier the segment is reported once SpillOne copied it to the host store.
      ASSIGN_OR_RETURN(const bool in_store, StoreSegment(sp.fp, j.segs[s].tokens, o.encoding));
      if (in_store) res.stored.emplace_back(sp.fp, n);
    } else if (o.enable_reuse) {
      res.missing.emplace_back(s, sp.fp);
    }
  }
  // Exact up to the first reused token that some sparse layer did not recompute.
  st.exact_tokens = N;
  if (!j.reused_rows.empty() && F < L) {
    std::vector<char> everywhere(n_rows, 0);
    for (int32_t i : j.cur) everywhere[i] = 1;  // rows of the last (smallest) sparse layer
    for (int32_t i : j.reused_rows) {
      if (!everywhere[i]) {
        st.exact_tokens = P + i;
        break;
      }
    }
  }
  // A prefix matched in the approximate namespace ends the exact KV where it starts.
  if (j.seq.exact_prefix < P) st.exact_tokens = std::min(st.exact_tokens, j.seq.exact_prefix);
  if (o.register_prefix) {
    engine_->RegisterPrefix(j.seq, st.exact_tokens, o.register_approximate_prefix);
  }
  res.seq = std::move(j.seq);
  j.own_seq = false;
  return std::move(res);
}

}  // namespace sparsex
