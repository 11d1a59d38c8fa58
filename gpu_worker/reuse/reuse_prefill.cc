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

absl::StatusOr<SegmentKv> ReuseEngine::Encode(const std::vector<int32_t>& tokens,
                                              const std::string& encoding) {
  ASSIGN_OR_RETURN(std::vector<int32_t> ctx,
                   EncodingContext(encoding, engine_->model().tokenizer().bos_id()));
  const int c = static_cast<int>(ctx.size());
  std::vector<int32_t> all = ctx;
  all.insert(all.end(), tokens.begin(), tokens.end());
  if (static_cast<int>(all.size()) > engine_->model().config().max_seq_len) {
    return absl::InvalidArgumentError("segment longer than the context length");
  }
  // Fresh blocks, no prefix matching: every row must pass through every layer to be captured.
  Sequence seq;
  seq.tokens = all;
  RETURN_IF_ERROR(engine_->EnsureCapacity(seq, static_cast<int>(all.size())));
  ModelRunner& r = engine_->runner();
  const int n = static_cast<int>(all.size());
  std::vector<int32_t> pos(n);
  for (int i = 0; i < n; ++i) pos[i] = i;
  const std::vector<int32_t> slots = engine_->CtxSlots(seq, n);
  KvCapture cap;
  absl::Status st;
  auto x = r.Embed(all);
  if (!x.ok()) st = x.status();
  if (st.ok()) {
    TensorGuard g{&r.backend(), *x};
    LayerRows rows{pos, slots, slots};
    for (int l = 0; l < r.config().n_layers && st.ok(); ++l) st = r.Layer(l, g.t, rows, nullptr, &cap);
  }
  engine_->Release(seq);
  RETURN_IF_ERROR(st);
  SegmentKv kv;
  kv.n_tokens = static_cast<int>(tokens.size());
  kv.n_layers = r.config().n_layers;
  kv.kv_dim = r.kv_dim();
  const size_t kd = kv.kv_dim;
  for (int l = 0; l < kv.n_layers; ++l) {
    if (c == 0) {  // no encoding context: the captured rows are the segment's (no copy)
      kv.k.push_back(std::move(cap.k[l]));
      kv.v.push_back(std::move(cap.v[l]));
    } else {
      kv.k.emplace_back(cap.k[l].begin() + c * kd, cap.k[l].end());
      kv.v.emplace_back(cap.v[l].begin() + c * kd, cap.v[l].end());
    }
  }
  return kv;
}

absl::Status ReuseEngine::EnsureStored(const std::vector<int32_t>& tokens,
                                       const ReuseOptions* override_opts) {
  const ReuseOptions& o = override_opts ? *override_opts : opts_;
  if (tokens.empty()) return absl::OkStatus();
  const Hash128 fp = Fingerprint(tokens, o.encoding);
  if (store_->Contains(fp)) return absl::OkStatus();
  ASSIGN_OR_RETURN(SegmentKv kv, Encode(tokens, o.encoding));
  return store_->Put(fp, std::move(kv));
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
  ASSIGN_OR_RETURN(Sequence seq, engine_->Admit(PromptTokens(segs, bos)));
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
    if (store_->Contains(sp.fp)) continue;
    const int n = sp.end - sp.begin;
    if (o.enable_reuse && o.store_new_segments) {
      ASSIGN_OR_RETURN(SegmentKv kv, Encode(segs[s].tokens, o.encoding));
      RETURN_IF_ERROR(store_->Put(sp.fp, std::move(kv)));
      if (store_->Contains(sp.fp)) res.stored.emplace_back(sp.fp, n);
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
  if (o.register_prefix) {
    engine_->RegisterPrefix(seq, o.register_approximate_prefix ? -1 : st.exact_tokens);
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
