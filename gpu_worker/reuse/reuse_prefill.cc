#include "gpu_worker/reuse/reuse_prefill.h"

#include "gpu_worker/reuse/planner.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include "common/fingerprint.h"

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
  kv.k.emplace_back(n);
  kv.v.emplace_back(n);
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
      o.budget.max_ratio > 1 || o.budget.target_mass < 0 || o.budget.target_mass > 1) {
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

Hash128 ReuseEngine::Fingerprint(const std::vector<int32_t>& tokens,
                                 const std::string& encoding) const {
  return SegmentFingerprint(engine_->model().fingerprint(), tokens, encoding);
}

ReuseEngine::~ReuseEngine() { EndEncoding(); }

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
  const Hash128 fp = Fingerprint(tokens, o.encoding);
  if (!job_ || job_->fp != fp) {
    if (Holds(fp)) {
      EndEncoding();
      return StoreProgress::kHeld;
    }
    RETURN_IF_ERROR(BeginEncoding(fp, tokens, o.encoding));
  }
  RETURN_IF_ERROR(StepEncoding(max_layers));
  if (job_->next_layer < engine_->model().config().n_layers) return StoreProgress::kRunning;
  ASSIGN_OR_RETURN(const bool in_store, FinishEncoding());
  return in_store ? StoreProgress::kInStore : StoreProgress::kInTier;
}

bool ReuseEngine::Holds(const Hash128& fp) const {
  return tier_.Peek(fp) != nullptr || host_tier_.Peek(fp) != nullptr || store_->Contains(fp);
}

absl::Status ReuseEngine::EnsureStored(const std::vector<int32_t>& tokens,
                                       const ReuseOptions* override_opts) {
  const ReuseOptions& o = override_opts ? *override_opts : opts_;
  if (tokens.empty()) return absl::OkStatus();
  const Hash128 fp = Fingerprint(tokens, o.encoding);
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

absl::StatusOr<ReusePrefillResult> ReuseEngine::Prefill(const std::vector<PromptSegment>& segs,
                                                        bool add_bos,
                                                        const ReuseOptions* override_opts) {
  const ReuseOptions& o = override_opts ? *override_opts : opts_;
  const ModelConfig& cfg = engine_->model().config();
  const int L = cfg.n_layers;
  RETURN_IF_ERROR(ValidateReuseOptions(o, L));
  ASSIGN_OR_RETURN(std::unique_ptr<Selector> selector,
                   CreateSelector(o.selector, o.sparsex_weights));

  // Phase times (ReuseOptions::profile): wait for the device, charge the time since the last mark.
  Backend& be = engine_->runner().backend();
  auto mark = std::chrono::steady_clock::now();
  auto phase = [&](double* ms) -> absl::Status {
    if (!o.profile) return absl::OkStatus();
    RETURN_IF_ERROR(be.Synchronize());
    const auto now = std::chrono::steady_clock::now();
    *ms += std::chrono::duration<double, std::milli>(now - mark).count();
    mark = now;
    return absl::OkStatus();
  };
  const int32_t bos = add_bos ? engine_->model().tokenizer().bos_id() : -1;
  ASSIGN_OR_RETURN(Sequence seq,
                   engine_->Admit(PromptTokens(segs, bos), o.register_approximate_prefix));
  ReusePrefillResult res;
  ReuseStats& st = res.stats;
  const int P = seq.cached_prefix;

  // On any error below the sequence's blocks go back to the pool.
  struct SeqGuard {
    Engine* e;
    Sequence* s;
    bool armed = true;
    ~SeqGuard() {
      if (armed) e->Release(*s);
    }
  } guard{engine_, &seq};

  // ---- plan (planner.h): layout, tier lookups in order (device, pinned host, host store; a
  // store hit is uploaded into a tier; checksums verified on Get, a corrupt entry is a miss) ----
  std::vector<std::shared_ptr<const DeviceSegment>> found(segs.size());
  std::vector<char> from_host(segs.size(), 0);  // found in the pinned host tier
  const int kd = engine_->runner().kv_dim();
  const int64_t corrupt0 = store_->stats().corrupt;
  absl::Status lookup_error;
  const ReusePlan plan = PlanReuse(
      segs, bos, P, engine_->blocks().block_size(), o, engine_->model().fingerprint(),
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
  RETURN_IF_ERROR(lookup_error);
  st.segments_corrupt = static_cast<int>(store_->stats().corrupt - corrupt0);
  const std::vector<int32_t>& tokens = plan.tokens;
  const std::vector<int32_t>& group = plan.group;
  const std::vector<char>& reused = plan.reused;
  const int N = static_cast<int>(tokens.size());
  st.prompt_tokens = N;
  st.prefix_tokens = P;
  st.segments_hit = plan.segments_hit;
  st.segments_missed = plan.segments_missed;
  st.reused_tokens = plan.reused_tokens;
  st.new_tokens = plan.new_tokens;
  const int n_rows = N - P;

  // ---- where each reused segment's rows go (assembled layer by layer before the sparse
  // layers: the full layers [0, F) recompute every row and never read them) ----
  const int F = o.enable_reuse ? o.full_layers : L;
  ModelRunner& r = engine_->runner();
  const int bs = engine_->blocks().block_size();
  struct Placement {
    std::vector<int32_t> pos, slots;
    int64_t row0 = 0;  // first reused row of the segment (reused rows are contiguous)
  };
  std::vector<Placement> place(segs.size());
  for (size_t s = 0; s < segs.size(); ++s) {
    const SegmentPlan& sp = plan.segments[s];
    if (!Reused(sp.tier)) continue;
    for (int p = sp.reuse_begin; p < sp.end; ++p) {
      if (!reused[p]) continue;
      place[s].pos.push_back(p);
      place[s].slots.push_back(seq.Slot(p, bs));
    }
    place[s].row0 = sp.reuse_begin - sp.begin;
  }
  // Host-tier segments: every sparse layer's K/V copied to the device on the backend's copy
  // stream, enqueued now so the copies run beside the full layers; awaited layer by layer.
  struct Staged {
    Tensor k, v;
    int64_t tk = 0, tv = 0;
  };
  std::vector<std::vector<Staged>> staged(segs.size());  // [segment][layer - F]
  struct StagedGuard {
    Backend* be;
    std::vector<std::vector<Staged>>* st;
    ~StagedGuard() {
      for (auto& layers : *st) {
        for (Staged& x : layers) {
          // A copy may still be writing: order the frees after it.
          (void)be->Await(x.tk);
          (void)be->Await(x.tv);
          be->Free(x.k);
          be->Free(x.v);
        }
      }
    }
  } staged_guard{&be, &staged};
  for (int l = F; l < L; ++l) {
    for (size_t s = 0; s < segs.size(); ++s) {
      if (!from_host[s] || place[s].pos.empty()) continue;
      Staged& x = staged[s].emplace_back();
      ASSIGN_OR_RETURN(x.k, be.Alloc(found[s]->k[l].rows, kd));
      ASSIGN_OR_RETURN(x.v, be.Alloc(found[s]->v[l].rows, kd));
      ASSIGN_OR_RETURN(x.tk, be.Prefetch(found[s]->k[l], x.k));
      ASSIGN_OR_RETURN(x.tv, be.Prefetch(found[s]->v[l], x.v));
    }
  }

  // ---- full layers [0, F): every non-prefix row, with the selection signal ----
  const std::vector<int32_t> ctx = engine_->CtxSlots(seq, N);
  std::vector<int32_t> pos_all(n_rows), slot_all(n_rows), qgroup(n_rows);
  std::vector<float> recv_w(n_rows), cross(n_rows, 0.0f), recv(N, 0.0f);
  for (int i = 0; i < n_rows; ++i) {
    pos_all[i] = P + i;
    slot_all[i] = ctx[P + i];
    qgroup[i] = group[P + i];
    recv_w[i] = reused[P + i] ? 0.0f : 1.0f;
  }
  RETURN_IF_ERROR(phase(&st.lookup_ms));
  ASSIGN_OR_RETURN(Tensor x0, r.Embed(std::span<const int32_t>(tokens.data() + P, n_rows)));
  TensorGuard xg{&r.backend(), x0};
  const bool want_attn = selector->needs_attention_stats() && st.reused_tokens > 0;
  const int stats_from = o.stats_all_full_layers ? 0 : F - 1;
  const int stats_layers = F - std::max(0, stats_from);
  for (int l = 0; l < F; ++l) {
    LayerRows rows{pos_all, slot_all, ctx};
    AttentionArgs stats;
    const bool measure = want_attn && l >= stats_from;
    if (measure) {
      stats.key_group = group;
      stats.q_group = qgroup;
      stats.out_cross = cross.data();
      stats.recv_weight = recv_w;
      stats.out_recv = recv.data();
    }
    RETURN_IF_ERROR(r.Layer(l, xg.t, rows, measure ? &stats : nullptr));
  }
  st.computed_token_layers = static_cast<int64_t>(F) * n_rows;
  RETURN_IF_ERROR(phase(&st.full_ms));

  // ---- switch: rank the reused tokens ----
  std::vector<int32_t> reused_rows;  // row index (position - P) of every reused token
  for (int i = 0; i < n_rows; ++i) {
    if (reused[P + i]) reused_rows.push_back(i);
  }
  std::vector<int32_t> ranked;  // into reused_rows, most important first
  if (F < L && !reused_rows.empty()) {
    SelectionInput in;
    in.seed = o.seed;
    for (int32_t i : reused_rows) {
      const int p = P + i;
      in.segment.push_back(group[p]);
      in.offset.push_back(p - plan.segments[group[p]].begin);
      in.cross_mass.push_back(stats_layers > 0 ? cross[i] / stats_layers : 0.0f);
      in.new_recv.push_back(stats_layers > 0 ? recv[p] / stats_layers : 0.0f);
    }
    if (selector->needs_kv_deviation()) {
      // Deviation of what layer F would compute from what the store holds (pre-RoPE K and V),
      // on the backend: only one float per reused row comes back.
      const int64_t nr = static_cast<int64_t>(reused_rows.size());
      const int64_t qd = static_cast<int64_t>(r.config().n_heads) * r.config().head_dim;
      ASSIGN_OR_RETURN(Tensor qkv_all, r.ProjectQkv(F, xg.t));
      TensorGuard qg{&be, qkv_all};
      ASSIGN_OR_RETURN(Tensor qkv_r, be.Alloc(nr, qkv_all.cols));
      TensorGuard rg{&be, qkv_r};
      ASSIGN_OR_RETURN(Tensor ref_k, be.Alloc(nr, kd));
      TensorGuard kg{&be, ref_k};
      ASSIGN_OR_RETURN(Tensor ref_v, be.Alloc(nr, kd));
      TensorGuard vg{&be, ref_v};
      RETURN_IF_ERROR(be.GatherRows(qkv_all, reused_rows, rg.t));
      int64_t row = 0;  // reused rows are in position order, segment by segment
      for (size_t s = 0; s < segs.size(); ++s) {
        if (!found[s]) continue;
        const SegmentPlan& sp = plan.segments[s];
        int cnt = 0;
        for (int p = sp.reuse_begin; p < sp.end; ++p) cnt += reused[p];
        RETURN_IF_ERROR(be.CopyRows(found[s]->k[F], sp.reuse_begin - sp.begin, kg.t, row, cnt));
        RETURN_IF_ERROR(be.CopyRows(found[s]->v[F], sp.reuse_begin - sp.begin, vg.t, row, cnt));
        row += cnt;
      }
      in.kv_deviation.assign(nr, 0.0f);
      RETURN_IF_ERROR(be.RowSqDist(rg.t, qd, kg.t, 0, kd, in.kv_deviation));
      RETURN_IF_ERROR(be.RowSqDist(rg.t, qd + kd, vg.t, 0, kd, in.kv_deviation));
      // Each tensor-parallel rank holds only its KV heads: sum so all ranks rank identically.
      RETURN_IF_ERROR(r.SumAcrossRanks(in.kv_deviation));
    }
    // The kept tokens, best first: per-layer ratios take prefixes of this ranking.
    ranked = selector->Rank(in, o.budget);
  }
  RETURN_IF_ERROR(phase(&st.select_ms));

  // ---- sparse layers [F, L): selected reused rows + every new row + the last row ----
  auto rows_for_layer = [&](int l) {
    int keep = static_cast<int>(ranked.size());
    const int li = l - F;
    if (li < static_cast<int>(o.layer_ratios.size())) {
      keep = std::min(keep, static_cast<int>(std::lround(o.layer_ratios[li] *
                                                         static_cast<double>(reused_rows.size()))));
    }
    std::vector<int32_t> rows;
    for (int i = 0; i < keep; ++i) rows.push_back(reused_rows[ranked[i]]);
    for (int i = 0; i < n_rows; ++i) {
      if (!reused[P + i]) rows.push_back(i);
    }
    std::sort(rows.begin(), rows.end());
    return rows;
  };
  std::vector<int32_t> cur;  // rows (index into the full row set) currently in xs
  for (int i = 0; i < n_rows; ++i) cur.push_back(i);
  Tensor* xs = &xg.t;
  TensorGuard sg{&r.backend(), Tensor{}};
  for (int l = F; l < L; ++l) {
    std::vector<int32_t> want = rows_for_layer(l);
    if (l == F) st.selected_tokens = static_cast<int>(want.size()) - st.new_tokens;
    if (want != cur) {
      // want is a subset of cur (budgets are non-increasing): gather its rows.
      std::vector<int32_t> idx;
      size_t j = 0;
      for (int32_t w : want) {
        while (j < cur.size() && cur[j] < w) ++j;
        idx.push_back(static_cast<int32_t>(j));
      }
      ASSIGN_OR_RETURN(Tensor nx, r.backend().Alloc(static_cast<int64_t>(want.size()), cfg.dim));
      absl::Status gs = r.backend().GatherRows(*xs, idx, nx);
      if (!gs.ok()) {
        r.backend().Free(nx);
        return gs;
      }
      r.backend().Free(sg.t);
      sg.t = nx;
      xs = &sg.t;
      cur = std::move(want);
    }
    std::vector<int32_t> pos(cur.size()), slots(cur.size());
    for (size_t i = 0; i < cur.size(); ++i) {
      pos[i] = P + cur[i];
      slots[i] = ctx[P + cur[i]];
    }
    // The reused KV of this layer goes in first; the rows recomputed below overwrite theirs.
    for (size_t s = 0; s < segs.size(); ++s) {
      const Placement& pl = place[s];
      if (pl.pos.empty()) continue;
      if (from_host[s]) {
        Staged& x = staged[s][l - F];
        RETURN_IF_ERROR(be.Await(x.tk));
        RETURN_IF_ERROR(be.Await(x.tv));
        RETURN_IF_ERROR(r.AssembleKvFrom(l, x.k, x.v, pl.row0, pl.pos, pl.slots));
        be.Free(x.k);  // stream-ordered: after the assembly that reads it
        be.Free(x.v);
      } else {
        RETURN_IF_ERROR(r.AssembleKvFrom(l, found[s]->k[l], found[s]->v[l], pl.row0, pl.pos,
                                         pl.slots));
      }
    }
    LayerRows rows{pos, slots, ctx};
    RETURN_IF_ERROR(r.Layer(l, *xs, rows));
    st.computed_token_layers += static_cast<int64_t>(cur.size());
  }
  RETURN_IF_ERROR(phase(&st.sparse_ms));
  if (F >= L) st.selected_tokens = st.reused_tokens;
  // The last row is always present and last in position order.
  const int32_t last = static_cast<int32_t>(cur.size()) - 1;
  ASSIGN_OR_RETURN(res.logits, r.Logits(*xs, std::span<const int32_t>(&last, 1)));
  RETURN_IF_ERROR(phase(&st.logits_ms));
  seq.computed = N;
  st.compute_share = n_rows > 0 ? static_cast<double>(st.computed_token_layers) /
                                      (static_cast<double>(L) * n_rows)
                                : 0.0;

  // ---- after the pass: store what was missing (or report it: a caller that defers stores
  // turns store_new_segments off), register blocks for prefix reuse ----
  for (int s : plan.missing) {
    const SegmentPlan& sp = plan.segments[s];
    if (Holds(sp.fp)) continue;
    const int n = sp.end - sp.begin;
    if (o.enable_reuse && o.store_new_segments) {
      // In the device tier the segment is reported once SpillOne copied it to the host store.
      ASSIGN_OR_RETURN(const bool in_store, StoreSegment(sp.fp, segs[s].tokens, o.encoding));
      if (in_store) res.stored.emplace_back(sp.fp, n);
    } else if (o.enable_reuse) {
      res.missing.emplace_back(s, sp.fp);
    }
  }
  // Exact up to the first reused token that some sparse layer did not recompute.
  st.exact_tokens = N;
  if (!reused_rows.empty() && F < L) {
    std::vector<char> everywhere(n_rows, 0);
    for (int32_t i : cur) everywhere[i] = 1;  // rows of the last (smallest) sparse layer
    for (int32_t i : reused_rows) {
      if (!everywhere[i]) {
        st.exact_tokens = P + i;
        break;
      }
    }
  }
  // A prefix matched in the approximate namespace ends the exact KV where it starts.
  if (seq.exact_prefix < P) st.exact_tokens = std::min(st.exact_tokens, seq.exact_prefix);
  if (o.register_prefix) {
    engine_->RegisterPrefix(seq, st.exact_tokens, o.register_approximate_prefix);
  }
  guard.armed = false;
  res.seq = std::move(seq);
  return res;
}

absl::StatusOr<GenerateResult> ReuseEngine::Generate(const std::vector<PromptSegment>& segments,
                                                     const SamplingParams& sampling,
                                                     const TokenCallback& cb, ReuseStats* stats) {
  RETURN_IF_ERROR(ValidateSampling(sampling));
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(ReusePrefillResult pr, Prefill(segments));
  if (stats != nullptr) *stats = pr.stats;
  GenerateResult res;
  res.prompt_tokens = pr.stats.prompt_tokens;
  res.cached_tokens = pr.stats.prefix_tokens + pr.stats.reused_tokens;
  // Prefill already registered the exact blocks for prefix reuse.
  absl::Status st = engine_->Decode(pr.seq, std::move(pr.logits), sampling, cb, t0, &res);
  engine_->Release(pr.seq);
  RETURN_IF_ERROR(st);
  return res;
}

}  // namespace sparsex
