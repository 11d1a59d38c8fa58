// The CUDA backend's attention: which kernel serves a call, and when cuDNN does.
//   - Selection statistics (out_cross, out_recv): our kernel with the fused cross mass, the
//     received attention in a second pass; waits for the device. With
//     CudaBackendOptions::cudnn_statistics, dense calls whose rows' own segments are a small
//     share of their keys run on cuDNN instead (its softmax normaliser out) and the second pass
//     takes the cross mass by complement over those segments (CudnnStatistics).
//   - Dense causal prefill (DenseForCudnn) outside a recorded scope: cuDNN's fused engine when
//     CudaBackendOptions::cudnn_attention allows and libcudnn loads, else our kernel.
//   - Otherwise kernels::PagedAttention, which splits the key axis (split-K, mma.sync) when the
//     query tiles alone would leave SMs idle, and else runs unsplit: wgmma or mma.sync as
//     CudaBackendOptions::attn_impl picks (mma.sync block: attn_warps).
//   - Several sequences (AttentionArgs::seqs, batched decode): one batched launch, or one call
//     per sequence where the batched kernel does not apply.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu_worker/backend/attention_stats_plan.h"
#include "gpu_worker/backend/cuda/cuda_backend_internal.h"
#include "kernels/attention.h"
#include "kernels/ops.h"

namespace sparsex::cuda_internal {
namespace {

// The kernel parameters of an attention call over q's rows, whose positions and slot table were
// staged to q_pos and ctx_slots (device).
kernels::PagedAttentionParams Params(const Tensor& q, const KvPool& pool, int layer,
                                     const AttentionArgs& a, Tensor& out, const void* q_pos,
                                     const void* ctx_slots, const CudaBackendOptions& o) {
  kernels::PagedAttentionParams p;
  p.q = B(q);
  p.q_stride = q.cols;
  p.out = B(out);
  p.out_stride = out.cols;
  p.q_pos = static_cast<const int32_t*>(q_pos);
  p.num_q = static_cast<int>(q.rows);
  p.k_pool = B(pool.k[layer]);
  p.v_pool = B(pool.v[layer]);
  p.kv_stride = pool.kv_dim;
  p.num_slots = o.attn_bulk_kv ? pool.k[layer].rows : 0;
  p.ctx_slots = static_cast<const int32_t*>(ctx_slots);
  p.ctx_len = static_cast<int>(a.ctx_slots.size());
  p.n_heads = a.n_heads;
  p.n_kv_heads = a.n_kv_heads;
  p.head_dim = a.head_dim;
  p.scale = a.scale > 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  p.warps = o.attn_warps;
  p.impl = static_cast<int>(o.attn_impl);
  p.split_waves = o.split_waves;
  return p;
}

}  // namespace

absl::Status CudaBackend::Attention(const Tensor& q, const KvPool& pool, int layer,
                                    const AttentionArgs& a, Tensor& out) {
  RETURN_IF_ERROR(CheckLayer(pool, layer));
  RETURN_IF_ERROR(CheckBf16(q, "Attention q"));
  RETURN_IF_ERROR(CheckBf16(out, "Attention out"));
  const int H = a.n_heads, KV = a.n_kv_heads, hd = a.head_dim;
  const int64_t n = q.rows, ctx = static_cast<int64_t>(a.ctx_slots.size());
  if (!a.seqs.empty() && n > 0) return AttentionBatched(q, pool, layer, a, out);
  RETURN_IF_ERROR(ValidateAttention(q, pool, a, out));
  if (!kernels::PagedAttentionSupported(hd, H, KV)) {
    return absl::UnimplementedError(absl::StrCat("Attention: unsupported head_dim ", hd,
                                                 " with ", H, "/", KV, " heads"));
  }
  const bool want_cross = a.out_cross != nullptr;
  const bool want_recv = a.out_recv != nullptr;
  if (n == 0) return absl::OkStatus();
  const bool stats = want_cross || want_recv;
  if (!stats && !recording() && DenseForCudnn(q, a, n, ctx, hd)) {
    absl::Status s = CudnnDense(q, pool, layer, a, out);
    if (s.ok() || options_.cudnn_attention == CudaBackendOptions::Cudnn::kRequired) return s;
    if (!cudnn_fallback_logged_) {
      cudnn_fallback_logged_ = true;
      std::fprintf(stderr, "cuda backend: cuDNN attention unavailable, own kernel used: %s\n",
                   std::string(s.message()).c_str());
    }
  }
  if (stats) RETURN_IF_ERROR(FlushGraph());  // the statistics come back to the host
  if (want_cross && options_.cudnn_statistics && !recording() && DenseForCudnn(q, a, n, ctx, hd)) {
    const int rows_per_block = 16 * (options_.attn_warps == 4 ? 4 : 8) / (H / KV);
    const std::vector<int32_t> tiles = StatsTileGroups(a.key_group, kernels::kStatsTileKeys);
    const double share = ComplementReadShare(a.q_pos, a.q_group, a.recv_weight, tiles,
                                             kernels::kStatsTileKeys, ctx, rows_per_block);
    if (share <= options_.cudnn_statistics_max_share) {
      absl::Status s = CudnnStatistics(q, pool, layer, a, out, tiles);
      if (s.ok() || options_.cudnn_attention == CudaBackendOptions::Cudnn::kRequired) return s;
      if (!cudnn_stats_fallback_logged_) {
        cudnn_stats_fallback_logged_ = true;
        std::fprintf(stderr, "cuda backend: cuDNN statistics unavailable, own kernel used: %s\n",
                     std::string(s.message()).c_str());
      }
    }
  }

  std::vector<HostSpan> spans = {{a.q_pos.data(), a.q_pos.size_bytes()},
                                 {a.ctx_slots.data(), a.ctx_slots.size_bytes()}};
  if (want_cross) {
    spans.push_back({a.key_group.data(), a.key_group.size_bytes()});
    spans.push_back({a.q_group.data(), a.q_group.size_bytes()});
  }
  if (want_recv) spans.push_back({a.recv_weight.data(), a.recv_weight.size_bytes()});
  ASSIGN_OR_RETURN(auto d, Stage(spans));

  kernels::PagedAttentionParams p = Params(q, pool, layer, a, out, d[0], d[1], options_);

  const size_t split_bytes = kernels::PagedAttentionWorkspaceBytes(p);
  ASSIGN_OR_RETURN(const AttentionWorkspace w,
                   CarveAttentionWorkspace(split_bytes, stats ? n * H : 0, want_cross ? n : 0,
                                           want_recv ? ctx : 0));
  float *lse = w.lse, *cross = w.cross, *recv = w.recv;
  p.lse = lse;
  // The cross mass rides in the attention pass (online softmax); only the received attention
  // needs the second pass, and only over the rows that carry a weight.
  if (want_cross) {
    p.key_group = static_cast<const int32_t*>(d[2]);
    p.q_group = static_cast<const int32_t*>(d[3]);
    p.out_cross = cross;
    CUDA_RETURN(cudaMemsetAsync(cross, 0, n * 4, stream_), "Attention stats clear");
  }
  void* split_ws = w.split;
  if (!stats) {
    return Run("Attention", [=, this] {
      return kernels::PagedAttention(p, split_ws, split_bytes, stream_);
    }, p, split_ws, split_bytes);
  }
  CUDA_RETURN(kernels::PagedAttention(p, split_ws, split_bytes, stream_), "Attention");

  kernels::AttentionStatsParams s;
  if (want_recv) {
    s.recv_weight = static_cast<const float*>(d[want_cross ? 4 : 2]);
    s.out_recv = recv;
  }
  return FinishStatistics(p, s, a, cross, recv);
}

// One carving of attn_scratch_ for every attention path: [split-K partials | lse | cross |
// recv], each part 256-byte aligned (the kernels' vector loads); a part of size 0 stays null.
absl::StatusOr<CudaBackend::AttentionWorkspace> CudaBackend::CarveAttentionWorkspace(
    size_t split_bytes, int64_t lse_floats, int64_t cross_floats, int64_t recv_floats) {
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t sizes[4] = {align(split_bytes), align(static_cast<size_t>(lse_floats) * 4),
                           align(static_cast<size_t>(cross_floats) * 4),
                           align(static_cast<size_t>(recv_floats) * 4)};
  ASSIGN_OR_RETURN(void* ws,
                   Workspace(attn_scratch_, sizes[0] + sizes[1] + sizes[2] + sizes[3] + 256));
  char* at[4];
  at[0] = static_cast<char*>(ws);
  for (int i = 1; i < 4; ++i) at[i] = at[i - 1] + sizes[i - 1];
  AttentionWorkspace w;
  w.split = sizes[0] ? at[0] : nullptr;
  w.lse = sizes[1] ? reinterpret_cast<float*>(at[1]) : nullptr;
  w.cross = sizes[2] ? reinterpret_cast<float*>(at[2]) : nullptr;
  w.recv = sizes[3] ? reinterpret_cast<float*>(at[3]) : nullptr;
  return w;
}

// Launches the statistics pass when s asks for anything (recv, or the cross mass by complement)
// after clearing its outputs, then adds the device's cross and recv sums to a's host arrays.
absl::Status CudaBackend::FinishStatistics(const kernels::PagedAttentionParams& p,
                                           const kernels::AttentionStatsParams& s,
                                           const AttentionArgs& a, float* cross, float* recv) {
  const int64_t n = p.num_q, ctx = p.ctx_len;
  const bool want_cross = a.out_cross != nullptr, want_recv = a.out_recv != nullptr;
  if (s.out_recv != nullptr) {
    CUDA_RETURN(cudaMemsetAsync(recv, 0, ctx * 4, stream_), "Attention stats clear");
  }
  if (s.out_recv != nullptr || s.cross_complement) {
    CUDA_RETURN(kernels::AttentionStats(p, s, stream_), "Attention stats");
  }
  std::vector<float> host_cross(want_cross ? n : 0), host_recv(want_recv ? ctx : 0);
  if (want_cross) {
    CUDA_RETURN(cudaMemcpyAsync(host_cross.data(), cross, n * 4, cudaMemcpyDeviceToHost,
                                stream_),
                "Attention stats copy");
  }
  if (want_recv) {
    CUDA_RETURN(cudaMemcpyAsync(host_recv.data(), recv, ctx * 4, cudaMemcpyDeviceToHost,
                                stream_),
                "Attention stats copy");
  }
  CUDA_RETURN(cudaStreamSynchronize(stream_), "Attention stats sync");
  for (int64_t i = 0; i < static_cast<int64_t>(host_cross.size()); ++i)
    a.out_cross[i] += host_cross[i];
  for (int64_t j = 0; j < static_cast<int64_t>(host_recv.size()); ++j)
    a.out_recv[j] += host_recv[j];
  return absl::OkStatus();
}

// Dense attention with the selection statistics, the attention on cuDNN: its softmax
// normaliser comes out ([heads, rows], natural log), and the statistics pass reads it
// (AttentionStatsParams::lse_by_head) to take each row's cross mass as 1 minus the mass on its
// own segment and the shared keys, reading only the key tiles that hold those
// (tile_groups, from StatsTileGroups), plus the received attention of the weighted rows.
absl::Status CudaBackend::CudnnStatistics(const Tensor& q, const KvPool& pool, int layer,
                                          const AttentionArgs& a, Tensor& out,
                                          const std::vector<int32_t>& tile_groups) {
  const int H = a.n_heads;
  const int64_t n = q.rows, ctx = static_cast<int64_t>(a.ctx_slots.size());
  const bool want_recv = a.out_recv != nullptr;
  ASSIGN_OR_RETURN(const AttentionWorkspace w,
                   CarveAttentionWorkspace(0, n * H, n, want_recv ? ctx : 0));
  float *lse = w.lse, *cross = w.cross, *recv = w.recv;
  RETURN_IF_ERROR(CudnnDense(q, pool, layer, a, out, lse));

  std::vector<HostSpan> spans = {{a.q_pos.data(), a.q_pos.size_bytes()},
                                 {a.ctx_slots.data(), a.ctx_slots.size_bytes()},
                                 {a.key_group.data(), a.key_group.size_bytes()},
                                 {a.q_group.data(), a.q_group.size_bytes()},
                                 {tile_groups.data(), tile_groups.size() * sizeof(int32_t)}};
  // The weighted rows (the new tokens), for the wgmma kernel's received-attention blocks.
  std::vector<int32_t> weighted;
  if (want_recv) {
    spans.push_back({a.recv_weight.data(), a.recv_weight.size_bytes()});
    for (int64_t i = 0; i < n; ++i)
      if (a.recv_weight[i] > 0.0f) weighted.push_back(static_cast<int32_t>(i));
    if (!weighted.empty()) spans.push_back({weighted.data(), weighted.size() * sizeof(int32_t)});
  }
  ASSIGN_OR_RETURN(auto d, Stage(spans));
  // The statistics pass runs on mma.sync, or its cross mass on the wgmma statistics kernel
  // (wgmma_statistics), whatever attn_impl says, and writes no output.
  const kernels::PagedAttentionParams p = Params(q, pool, layer, a, out, d[0], d[1], options_);
  kernels::AttentionStatsParams s;
  s.key_group = static_cast<const int32_t*>(d[2]);
  s.q_group = static_cast<const int32_t*>(d[3]);
  s.tile_groups = static_cast<const int32_t*>(d[4]);
  s.cross_complement = true;
  s.impl = options_.wgmma_statistics ? 0 : 1;
  s.lse_by_head = lse;
  s.out_cross = cross;
  CUDA_RETURN(cudaMemsetAsync(cross, 0, n * 4, stream_), "Attention stats clear");
  if (want_recv) {
    s.recv_weight = static_cast<const float*>(d[5]);
    s.out_recv = recv;
    s.recv_rows = weighted.empty() ? nullptr : static_cast<const int32_t*>(d[6]);
    s.num_recv_rows = static_cast<int>(weighted.size());
  }
  if (want_recv && options_.stats_recv_split && !weighted.empty()) {
    // The rows with weight (the new tokens) get blocks of their own over parts of the keys:
    // the range from the first weighted row to the last.
    s.recv_rows_begin = weighted.front();
    s.recv_rows_end = weighted.back() + 1;
  }
  return FinishStatistics(p, s, a, cross, recv);
}

// Whether this call is dense causal attention cuDNN can take: consecutive query positions
// ending at the last key (a prefill from position 0, or a chunk after earlier ones), long
// enough, aligned rows and a head size its fused engine supports.
bool CudaBackend::DenseForCudnn(const Tensor& q, const AttentionArgs& a, int64_t n, int64_t ctx,
                                int hd) {
  if (options_.cudnn_attention == CudaBackendOptions::Cudnn::kOff ||
      n < options_.cudnn_min_tokens || (hd != 64 && hd != 128)) {
    return false;
  }
  if (q.cols % 8 != 0 || a.n_heads % a.n_kv_heads != 0) return false;
  const int32_t p0 = a.q_pos[0];
  if (p0 + n != ctx) return false;
  for (int64_t i = 1; i < n; ++i) {
    if (a.q_pos[i] != p0 + i) return false;
  }
  return true;
}

// Dense causal attention through cuDNN's fused engine. K and V are read in place when the
// sequence's slots are consecutive (a fresh prefill's blocks), else gathered into a scratch
// copy first (~0.1 ms per layer at 32K, against ~11 ms saved).
absl::Status CudaBackend::CudnnDense(const Tensor& q, const KvPool& pool, int layer,
                                     const AttentionArgs& a, Tensor& out, float* lse) {
  if (!cudnn_) {
    if (!cudnn_status_.ok()) return cudnn_status_;
    auto c = CudnnAttention::Create(stream_, options_.cudnn_library);
    if (!c.ok()) {
      cudnn_status_ = c.status();
      return cudnn_status_;
    }
    cudnn_ = std::move(*c);
  }
  const int64_t n = q.rows, ctx = static_cast<int64_t>(a.ctx_slots.size());
  const int64_t kv_dim = pool.kv_dim;
  bool consecutive = true;
  for (int64_t j = 1; j < ctx && consecutive; ++j) {
    consecutive = a.ctx_slots[j] == a.ctx_slots[0] + j;
  }
  const bf16* k = B(pool.k[layer]);
  const bf16* v = B(pool.v[layer]);
  if (consecutive) {
    k += static_cast<int64_t>(a.ctx_slots[0]) * kv_dim;
    v += static_cast<int64_t>(a.ctx_slots[0]) * kv_dim;
  } else {
    ASSIGN_OR_RETURN(auto d, Stage({{a.ctx_slots.data(), a.ctx_slots.size_bytes()}}));
    const size_t half = static_cast<size_t>(ctx * kv_dim);
    ASSIGN_OR_RETURN(void* ws, cudnn_kv_.Get(2 * half * sizeof(bf16), stream_));
    bf16* kc = static_cast<bf16*>(ws);
    bf16* vc = kc + half;
    const auto* idx = static_cast<const int32_t*>(d[0]);
    const int64_t pool_rows = pool.k[layer].rows;
    CUDA_RETURN(kernels::GatherRows(k, kv_dim, pool_rows, idx, kc, kv_dim, ctx, kv_dim, stream_),
                "cuDNN attention: K gather");
    CUDA_RETURN(kernels::GatherRows(v, kv_dim, pool_rows, idx, vc, kv_dim, ctx, kv_dim, stream_),
                "cuDNN attention: V gather");
    k = kc;
    v = vc;
  }
  CudnnAttentionShape sh;
  sh.n_q = n;
  sh.n_kv = ctx;
  sh.heads = a.n_heads;
  sh.kv_heads = a.n_kv_heads;
  sh.head_dim = a.head_dim;
  sh.q_stride = q.cols;
  sh.kv_stride = kv_dim;
  sh.o_stride = out.cols;
  sh.scale = a.scale > 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  sh.stats_out = lse != nullptr;
  const int64_t built = cudnn_->plans_built();
  const double ms = cudnn_->plan_build_ms();
  RETURN_IF_ERROR(cudnn_->Run(sh, q.data, k, v, out.data, lse));
  if (cudnn_->plans_built() > built && cudnn_->plans_built() <= 8) {
    std::fprintf(stderr, "cuda backend: cuDNN %s attention plan %lldx%lld built in %.1f ms\n",
                 cudnn_->version().c_str(), static_cast<long long>(n),
                 static_cast<long long>(ctx), cudnn_->plan_build_ms() - ms);
  }
  return absl::OkStatus();
}

// Several sequences in one launch (batched decode): every sequence's slot table, positions
// and row ranges staged in one copy; one attention kernel (split over keys) and one combine.
// Falls back to one call per sequence where the batched kernel does not apply.
absl::Status CudaBackend::AttentionBatched(const Tensor& q, const KvPool& pool, int layer,
                                           const AttentionArgs& a, Tensor& out) {
  const int64_t n = q.rows;
  const int S = static_cast<int>(a.seqs.size());
  // Positions, row starts, table offsets and lengths (sizes fixed by the batch) come first,
  // then the tables: table s at the running 16-byte-aligned offset from the first table (the
  // layout Stage gives the spans), so a recorded step's arrays keep their addresses as the
  // tables grow.
  std::vector<int32_t> rows(S + 1), start(S), len(S);
  std::vector<HostSpan> spans;
  spans.push_back({a.q_pos.data(), a.q_pos.size_bytes()});
  spans.push_back({rows.data(), rows.size() * 4});
  spans.push_back({start.data(), start.size() * 4});
  spans.push_back({len.data(), len.size() * 4});
  int64_t off = 0;
  int max_ctx = 0;
  for (int i = 0; i < S; ++i) {
    const SeqRows& sq = a.seqs[i];
    spans.push_back({sq.ctx_slots.data(), sq.ctx_slots.size_bytes()});
    rows[i] = static_cast<int32_t>(sq.row_begin);
    start[i] = static_cast<int32_t>(off / 4);
    len[i] = static_cast<int32_t>(sq.ctx_slots.size());
    max_ctx = std::max(max_ctx, len[i]);
    off += static_cast<int64_t>((sq.ctx_slots.size_bytes() + 15) / 16 * 16);
  }
  rows[S] = static_cast<int32_t>(n);
  // Every layer of a decode step stages the same tables: a device copy staged under this
  // domain (batched attention over a pool of this size) passed the slot checks when staged.
  const uint64_t domain = 1 + static_cast<uint64_t>(pool.num_blocks) * pool.block_size;
  Hash128 key;
  bool checked = false;
  std::vector<void*> in_scope;  // the scope's copy of these tables, when staged earlier in it
  if (recording()) {
    if (const std::vector<void*>* dev = recorder_.StagedInScope(spans, domain)) in_scope = *dev;
    checked = !in_scope.empty();
  } else {
    key = StageKey(spans, domain);
    checked = StageHas(key);
  }
  RETURN_IF_ERROR(ValidateAttention(q, pool, a, out, /*check_slots=*/!checked));
  if (!kernels::PagedAttentionSupported(a.head_dim, a.n_heads, a.n_kv_heads)) {
    return absl::UnimplementedError("Attention: unsupported head_dim for batched sequences");
  }
  // Positions and tables are set once staged, below (the split decision needs neither).
  kernels::PagedAttentionParams p = Params(q, pool, layer, a, out, nullptr, nullptr, options_);
  int64_t max_rows = 0;
  for (const SeqRows& sq : a.seqs) max_rows = std::max(max_rows, sq.row_end - sq.row_begin);
  if (max_rows > kernels::PagedAttentionMaxRowsPerSeq(p)) {
    // A mixed step (Engine::StepWithChunks): the leading decode rows (and short chunks among
    // them) stay one batched launch, the sequences from the first long one on (the prefill
    // chunks) get a call each.
    const int64_t limit = kernels::PagedAttentionMaxRowsPerSeq(p);
    size_t k = 0;
    while (k < a.seqs.size() && a.seqs[k].row_end - a.seqs[k].row_begin <= limit) ++k;
    if (k >= 2 && a.seqs[0].row_begin == 0) {
      const int64_t rows_k = a.seqs[k - 1].row_end;
      AttentionArgs head = a;
      head.seqs = a.seqs.subspan(0, k);
      head.q_pos = a.q_pos.subspan(0, static_cast<size_t>(rows_k));
      Tensor qh = RowView(q, 0, rows_k), oh = RowView(out, 0, rows_k);
      RETURN_IF_ERROR(AttentionBatched(qh, pool, layer, head, oh));
      AttentionArgs rest = a;
      rest.seqs = a.seqs.subspan(k);
      return AttentionBySequence(*this, q, pool, layer, rest, out);  // validates per sequence
    }
    return AttentionBySequence(*this, q, pool, layer, a, out);  // validates per sequence
  }
  std::vector<void*> d;
  if (!in_scope.empty()) {
    d = std::move(in_scope);
  } else if (recording()) {
    ASSIGN_OR_RETURN(d, recorder_.StageRecorded(spans, domain));
  } else {
    ASSIGN_OR_RETURN(d, Stage(spans, key));
  }
  p.q_pos = static_cast<const int32_t*>(d[0]);
  p.num_seqs = S;
  p.max_seq_rows = static_cast<int>(max_rows);
  p.decode_kernel = static_cast<int>(options_.decode_attn);
  p.seq_rows = static_cast<const int32_t*>(d[1]);
  p.seq_ctx_start = static_cast<const int32_t*>(d[2]);
  p.seq_ctx_len = static_cast<const int32_t*>(d[3]);
  p.ctx_slots = static_cast<const int32_t*>(d[4]);
  p.ctx_len = static_cast<int>(off / 4);
  p.max_seq_ctx = max_ctx;
  // Early key requests only with tables staged before this call: a miss stages them with a
  // copy kernel right before the attention (layer 0 of a step), which the early reads would
  // race.
  p.decode_early_kv = options_.decode_early_kv && checked ? 1 : 0;
  if (recording()) {
    // The lengths are read on the device; the launch is planned for a bucket of context
    // lengths (key blocks past a sequence's end add nothing), so the next steps' launches are
    // the same and a captured graph replays until the bucket is outgrown.
    p.max_seq_ctx = static_cast<int>(std::max<size_t>(RoundUpPow2(max_ctx), 256));
    p.ctx_len = p.max_seq_ctx;
  }
  const size_t ws_bytes = kernels::PagedAttentionWorkspaceBytes(p);
  ASSIGN_OR_RETURN(const AttentionWorkspace w, CarveAttentionWorkspace(ws_bytes, 0, 0, 0));
  void* split_ws = w.split;
  return Run("Attention (batched)", [=, this] {
    return kernels::PagedAttention(p, split_ws, ws_bytes, stream_);
  }, p, split_ws, ws_bytes);
}

}  // namespace sparsex::cuda_internal
