#include "gpu_worker/backend/backend.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/bf16.h"
#include "common/logits.h"
#include "common/thread_pool.h"

namespace sparsex {

namespace {

// An integer in [lo, hi] naming `what` (a row count, a launch count): other values are
// reported on stderr and leave the default.
void IntFromEnv(const char* name, long lo, long hi, const char* what, int& field) {
  const char* c = std::getenv(name);
  if (c == nullptr) return;
  char* end = nullptr;
  const long v = std::strtol(c, &end, 10);
  if (end != c && *end == '\0' && v >= lo && v <= hi) {
    field = static_cast<int>(v);
  } else {
    std::fprintf(stderr, "%s=%s is not a %s in [%ld, %ld]: %d used\n", name, c, what, lo, hi,
                 field);
  }
}

// A strict 0/1 switch: other values are reported on stderr and leave the default.
void SwitchFromEnv(const char* name, bool& field) {
  const char* c = std::getenv(name);
  if (c == nullptr) return;
  const std::string v = c;
  if (v == "0" || v == "1") {
    field = v == "1";
  } else {
    std::fprintf(stderr, "%s=%s is not 0 or 1: %d used\n", name, c, field ? 1 : 0);
  }
}

}  // namespace

CudaBackendOptions CudaBackendOptionsFromEnv() {
  CudaBackendOptions o;
  const char* env = std::getenv("SPX_SMALL_N_GEMM");
  o.small_n_gemm = env == nullptr || std::string(env) != "0";
  if (const char* v = std::getenv("SPX_SMALL_N_VARIANT")) {
    static constexpr const char* kNames[] = {"warp2", "warp2-deep", "warp4", "splitk4",
                                             "splitk8"};
    const std::string s = v;
    int chosen = -2;
    if (s.empty() || s == "auto") chosen = -1;
    for (int i = 0; i < 5; ++i) {
      if (s == kNames[i] || s == std::to_string(i)) chosen = i;
    }
    if (chosen == -2) {
      std::fprintf(stderr, "SPX_SMALL_N_VARIANT=%s is not one of auto, warp2, warp2-deep, "
                   "warp4, splitk4, splitk8 or 0-4: automatic choice used\n", v);
      chosen = -1;
    }
    o.small_n_variant = chosen;
  }
  IntFromEnv("SPX_SMALL_N_ROWS", 0, 8, "row count", o.small_n_auto_rows);
  if (const char* f = std::getenv("SPX_FUSED_SWIGLU")) o.fused_swiglu = std::string(f) != "0";
  if (const char* f = std::getenv("SPX_GEMM_SWIGLU")) o.sm90_gemm_swiglu = std::string(f) == "1";
  IntFromEnv("SPX_GEMM_SWIGLU_VARIANT", 0, 1, "variant", o.sm90_gemm_swiglu_variant);
  if (const char* u = std::getenv("SPX_UPLOAD_DIRECT")) o.upload_direct = std::string(u) == "1";
  if (const char* w = std::getenv("SPX_ATTN_WARPS")) o.attn_warps = std::atoi(w);
  if (const char* w = std::getenv("SPX_SPLIT_WAVES")) o.split_waves = std::max(0, std::atoi(w));
  if (const char* f = std::getenv("SPX_FUSED_RESIDUAL")) o.fused_residual = std::string(f) == "1";
  if (const char* im = std::getenv("SPX_ATTN_IMPL")) {
    using Impl = CudaBackendOptions::AttentionImpl;
    const std::string v = im;
    if (v == "mma") {
      o.attn_impl = Impl::kMma;
    } else if (v == "wgmma") {
      o.attn_impl = Impl::kWgmma;
    } else if (v == "wgmma-pipe") {
      o.attn_impl = Impl::kWgmmaPipelined;
    } else if (v == "wgmma-ws") {
      o.attn_impl = Impl::kWgmmaWarpSpecialized;
    } else if (v == "wgmma-ws-pp") {
      o.attn_impl = Impl::kWgmmaWsPingPong;
    } else if (v == "wgmma-ws-pipe") {
      o.attn_impl = Impl::kWgmmaWsPipelined;
    } else if (v == "wgmma-ws-128") {
      o.attn_impl = Impl::kWgmmaWs128;
    } else if (v == "wgmma-ws-128-lsum") {
      o.attn_impl = Impl::kWgmmaWs128RowSum;
    } else if (!v.empty() && v != "auto") {
      std::fprintf(stderr, "SPX_ATTN_IMPL=%s is not one of mma, wgmma, wgmma-pipe, wgmma-ws, "
                   "wgmma-ws-pp, wgmma-ws-pipe, wgmma-ws-128, wgmma-ws-128-lsum, auto: "
                   "automatic choice used\n",
                   im);
    }
  }
  if (const char* d = std::getenv("SPX_DECODE_ATTN")) {
    using Decode = CudaBackendOptions::DecodeAttention;
    const std::string v = d;
    if (v == "tile") {
      o.decode_attn = Decode::kTile;
    } else if (v == "packed32") {
      o.decode_attn = Decode::kPacked32;
    } else if (!v.empty() && v != "auto") {
      std::fprintf(stderr, "SPX_DECODE_ATTN=%s is not one of tile, packed32, auto: "
                   "automatic choice used\n", d);
    }
  }
  if (const char* g = std::getenv("SPX_CUDA_GRAPHS")) o.cuda_graphs = std::string(g) != "0";
  IntFromEnv("SPX_GRAPH_FIRST_SEGMENT", 1, 64, "launch count", o.graph_first_segment);
  if (const char* a = std::getenv("SPX_DEVICE_SAMPLING")) {
    o.device_sampling = std::string(a) != "0";
  }
  if (const char* c = std::getenv("SPX_CUDNN_ATTENTION")) {
    using Cudnn = CudaBackendOptions::Cudnn;
    const std::string v = c;
    o.cudnn_attention = v == "0" ? Cudnn::kOff : v == "require" ? Cudnn::kRequired
                                                                : Cudnn::kWhenAvailable;
  }
  if (const char* m = std::getenv("SPX_CUDNN_MIN_TOKENS")) o.cudnn_min_tokens = std::atoll(m);
  if (const char* l = std::getenv("SPX_CUDNN_LIB")) o.cudnn_library = l;
  SwitchFromEnv("SPX_DECODE_EARLY_KV", o.decode_early_kv);
  SwitchFromEnv("SPX_CUDNN_STATS", o.cudnn_statistics);
  SwitchFromEnv("SPX_STATS_RECV_SPLIT", o.stats_recv_split);
  SwitchFromEnv("SPX_ATTN_BULK_KV", o.attn_bulk_kv);
  SwitchFromEnv("SPX_WGMMA_STATS", o.wgmma_statistics);
  if (const char* m = std::getenv("SPX_CUDNN_STATS_MAX_SHARE")) {
    char* end = nullptr;
    const double v = std::strtod(m, &end);
    if (end != m && *end == '\0' && v >= 0.0 && v <= 1.0) {
      o.cudnn_statistics_max_share = v;
    } else {
      std::fprintf(stderr, "SPX_CUDNN_STATS_MAX_SHARE=%s is not a share in [0, 1]: %g used\n", m,
                   o.cudnn_statistics_max_share);
    }
  }
  return o;
}

absl::Status Backend::RowSqDist(const Tensor& a, int64_t a_col, const Tensor& b, int64_t b_col,
                                int64_t n_cols, std::span<float> out) {
  if (a.rows != b.rows || static_cast<int64_t>(out.size()) != a.rows ||
      a_col + n_cols > a.cols || b_col + n_cols > b.cols) {
    return absl::InvalidArgumentError("RowSqDist: shapes do not match");
  }
  std::vector<float> ha(static_cast<size_t>(a.rows * a.cols)), hb(static_cast<size_t>(b.rows * b.cols));
  RETURN_IF_ERROR(Download(a, ha));
  RETURN_IF_ERROR(Download(b, hb));
  for (int64_t i = 0; i < a.rows; ++i) {
    double d = 0;
    for (int64_t j = 0; j < n_cols; ++j) {
      const double x = ha[i * a.cols + a_col + j] - hb[i * b.cols + b_col + j];
      d += x * x;
    }
    out[i] += static_cast<float>(d);
  }
  return absl::OkStatus();
}

absl::Status Backend::DrawRows(const Tensor& logits, std::span<const RowDraw> draws,
                               std::span<int32_t> out) {
  if (static_cast<int64_t>(out.size()) != logits.rows ||
      static_cast<int64_t>(draws.size()) != logits.rows) {
    return absl::InvalidArgumentError("DrawRows: one draw and one output per row");
  }
  std::vector<float> h(static_cast<size_t>(logits.rows * logits.cols));
  RETURN_IF_ERROR(Download(logits, h));
  // Rows on the pool when it is free, as the scheduler's host sampling does.
  ParallelForIfIdle(logits.rows, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      out[i] = DrawToken(std::span<const float>(h).subspan(i * logits.cols, logits.cols),
                         draws[i]);
    }
  }, LogitRowsPerTask(logits.cols));
  return absl::OkStatus();
}

absl::Status Backend::MatMulAdd(const Tensor& x, const Tensor& w, Tensor& out) {
  ASSIGN_OR_RETURN(Tensor tmp, Alloc(out.rows, out.cols));
  absl::Status s = MatMul(x, w, tmp);
  if (s.ok()) s = Add(out, tmp);
  Free(tmp);
  return s;
}

absl::Status Backend::MatMulSwiGLU(const Tensor& x, const Tensor& w, Tensor& out) {
  if (w.rows % 2 != 0) return absl::InvalidArgumentError("MatMulSwiGLU: odd gate_up rows");
  ASSIGN_OR_RETURN(Tensor tmp, Alloc(x.rows, w.rows));
  absl::Status s = MatMul(x, w, tmp);
  if (s.ok()) s = SwiGLU(tmp, out);
  Free(tmp);
  return s;
}

absl::Status Backend::UploadBf16(std::span<const uint16_t> host, Tensor& dst) {
  std::vector<float> wide(host.size());
  for (size_t i = 0; i < host.size(); ++i) wide[i] = FromBf16(host[i]);
  return Upload(wide, dst);
}

absl::StatusOr<int64_t> Backend::UploadBf16Async(std::span<const uint16_t> host, Tensor& dst) {
  RETURN_IF_ERROR(UploadBf16(host, dst));
  return int64_t{0};
}

absl::Status Backend::RopeWriteKv(KvPool& pool, int layer, Tensor& qkv, int n_heads,
                                  std::span<const int32_t> pos, std::span<const int32_t> slots,
                                  const RopeParams& p) {
  if (p.head_dim <= 0 || pool.kv_dim % p.head_dim != 0 || n_heads < 0) {
    return absl::InvalidArgumentError("RopeWriteKv: kv_dim is not a multiple of head_dim");
  }
  const int kv_heads = pool.kv_dim / p.head_dim;
  const int64_t k_col = static_cast<int64_t>(n_heads) * p.head_dim;
  RETURN_IF_ERROR(Rope(qkv, 0, n_heads + kv_heads, pos, p));
  return WriteKv(pool, layer, qkv, k_col, qkv, k_col + pool.kv_dim, slots);
}

absl::Status Backend::AssembleKv(KvPool& pool, int layer, const Tensor& k_pre, const Tensor& v,
                                 int64_t row0, std::span<const int32_t> pos,
                                 std::span<const int32_t> slots, const RopeParams& rope) {
  const int64_t n = static_cast<int64_t>(pos.size());
  if (static_cast<int64_t>(slots.size()) != n) {
    return absl::InvalidArgumentError("AssembleKv: one slot per position required");
  }
  if (n == 0) return absl::OkStatus();
  if (rope.head_dim <= 0 || pool.kv_dim % rope.head_dim != 0) {
    return absl::InvalidArgumentError("AssembleKv: kv_dim is not a multiple of head_dim");
  }
  ASSIGN_OR_RETURN(Tensor k, Alloc(n, pool.kv_dim));
  absl::StatusOr<Tensor> vt = Alloc(n, pool.kv_dim);
  absl::Status s = vt.status();
  if (s.ok()) s = CopyRows(k_pre, row0, k, 0, n);
  if (s.ok()) s = CopyRows(v, row0, *vt, 0, n);
  if (s.ok()) s = Rope(k, 0, pool.kv_dim / rope.head_dim, pos, rope);
  if (s.ok()) s = WriteKv(pool, layer, k, 0, *vt, 0, slots);
  Free(k);
  if (vt.ok()) Free(*vt);
  return s;
}

absl::StatusOr<int64_t> Backend::Prefetch(const Tensor& src, Tensor& dst) {
  if (src.rows != dst.rows || src.cols != dst.cols) {
    return absl::InvalidArgumentError("Prefetch: shapes differ");
  }
  RETURN_IF_ERROR(CopyRows(src, 0, dst, 0, src.rows));
  return 0;
}

void Backend::FreeWeights(BackendWeights& w) {
  Free(w.tok_embeddings);
  Free(w.final_norm);
  Free(w.output);
  for (BackendLayer& l : w.layers) {
    for (Tensor* t : {&l.attn_norm, &l.wqkv, &l.wo, &l.ffn_norm, &l.w_gate_up, &l.w_down}) {
      Free(*t);
    }
  }
  w.layers.clear();
}

absl::StatusOr<BackendWeights> MakeWeights(Backend& be, const ModelConfig& c,
                                           const MatrixMaker& matrix, const NormMaker& norm) {
  BackendWeights out;
  auto make = [&]() -> absl::Status {
    const int64_t hd = c.head_dim;
    ASSIGN_OR_RETURN(out.tok_embeddings, matrix(c.vocab_size, c.dim));
    ASSIGN_OR_RETURN(out.final_norm, norm(c.dim));
    ASSIGN_OR_RETURN(out.output, matrix(c.vocab_size, c.dim));
    for (int l = 0; l < c.n_layers; ++l) {
      BackendLayer& bl = out.layers.emplace_back();
      ASSIGN_OR_RETURN(bl.attn_norm, norm(c.dim));
      ASSIGN_OR_RETURN(bl.wqkv, matrix((c.n_heads + 2 * c.n_kv_heads) * hd, c.dim));
      ASSIGN_OR_RETURN(bl.wo, matrix(c.dim, c.n_heads * hd));
      ASSIGN_OR_RETURN(bl.ffn_norm, norm(c.dim));
      ASSIGN_OR_RETURN(bl.w_gate_up, matrix(2 * c.ffn_dim, c.dim));
      ASSIGN_OR_RETURN(bl.w_down, matrix(c.dim, c.ffn_dim));
    }
    return absl::OkStatus();
  };
  absl::Status s = make();
  if (!s.ok()) {
    be.FreeWeights(out);
    return s;
  }
  return out;
}

absl::Status ValidateSlots(const KvPool& pool, std::span<const int32_t> slots) {
  const int64_t cap = static_cast<int64_t>(pool.num_blocks) * pool.block_size;
  for (int32_t s : slots) {
    if (s < 0 || s >= cap) {
      return absl::OutOfRangeError(absl::StrCat("KV slot ", s, " outside pool of ", cap));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateAttention(const Tensor& q, const KvPool& pool, const AttentionArgs& a,
                               const Tensor& out, bool check_slots) {
  const int H = a.n_heads, KV = a.n_kv_heads, hd = a.head_dim;
  const int64_t n = q.rows, ctx = static_cast<int64_t>(a.ctx_slots.size());
  if (static_cast<int64_t>(a.q_pos.size()) != n) {
    return absl::InvalidArgumentError("Attention: one position per query row required");
  }
  if (out.rows != n || out.cols != static_cast<int64_t>(H) * hd) {
    return absl::InvalidArgumentError(absl::StrCat("Attention out: expected [", n, ", ",
                                                   static_cast<int64_t>(H) * hd, "], got [",
                                                   out.rows, ", ", out.cols, "]"));
  }
  if (KV <= 0 || H <= 0 || hd <= 0 || H % KV != 0 || KV * hd != pool.kv_dim ||
      static_cast<int64_t>(H) * hd > q.cols) {
    return absl::InvalidArgumentError("Attention: inconsistent head counts");
  }
  if (!a.seqs.empty()) {
    if (a.out_cross != nullptr || a.out_recv != nullptr) {
      return absl::InvalidArgumentError("Attention: no statistics for batched sequences");
    }
    int64_t next = 0;
    for (const SeqRows& s : a.seqs) {
      if (s.row_begin != next || s.row_end < s.row_begin || s.row_end > n) {
        return absl::InvalidArgumentError("Attention: sequence row ranges must cover the rows "
                                          "in order");
      }
      next = s.row_end;
      const int64_t sctx = static_cast<int64_t>(s.ctx_slots.size());
      for (int64_t i = s.row_begin; i < s.row_end; ++i) {
        if (a.q_pos[i] < 0 || a.q_pos[i] >= sctx) {
          return absl::OutOfRangeError(absl::StrCat("query position ", a.q_pos[i],
                                                    " outside its sequence's context of ", sctx));
        }
      }
      if (check_slots) RETURN_IF_ERROR(ValidateSlots(pool, s.ctx_slots));
    }
    if (next != n) return absl::InvalidArgumentError("Attention: rows outside every sequence");
    return absl::OkStatus();
  }
  for (int32_t p : a.q_pos) {
    if (p < 0 || p >= ctx) {
      return absl::OutOfRangeError(absl::StrCat("query position ", p, " outside context of ",
                                                ctx));
    }
  }
  RETURN_IF_ERROR(ValidateSlots(pool, a.ctx_slots));
  if (a.out_cross != nullptr && (a.key_group.size() != static_cast<size_t>(ctx) ||
                                 a.q_group.size() != static_cast<size_t>(n))) {
    return absl::InvalidArgumentError("Attention: cross statistic needs key_group and q_group");
  }
  if (a.out_recv != nullptr && a.recv_weight.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError("Attention: recv statistic needs recv_weight per row");
  }
  return absl::OkStatus();
}

absl::Status AttentionBySequence(Backend& be, const Tensor& q, const KvPool& pool, int layer,
                                 const AttentionArgs& a, Tensor& out) {
  for (const SeqRows& s : a.seqs) {
    const int64_t n = s.row_end - s.row_begin;
    if (n == 0) continue;
    AttentionArgs one = a;
    one.seqs = {};
    one.q_pos = a.q_pos.subspan(s.row_begin, n);
    one.ctx_slots = s.ctx_slots;
    Tensor qv = RowView(q, s.row_begin, n), ov = RowView(out, s.row_begin, n);
    RETURN_IF_ERROR(be.Attention(qv, pool, layer, one, ov));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& opts) {
  if (opts.kind == "cpu") return CreateCpuBackend();
  if (opts.kind == "cuda") {
#if SPARSEX_WITH_CUDA
    if (!CudaAvailable()) return absl::UnavailableError("no usable CUDA device in this process");
    return CreateCudaBackend(opts.device, opts.cuda);
#else
    return absl::UnavailableError("this build has no CUDA backend (SPARSEX_WITH_CUDA=0)");
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", opts.kind,
                                                 "' (expected cpu or cuda)"));
}

#if !SPARSEX_WITH_CUDA
bool CudaAvailable() { return false; }
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int, const CudaBackendOptions&) {
  return absl::UnavailableError("this build has no CUDA backend (SPARSEX_WITH_CUDA=0)");
}
#endif

}  // namespace sparsex
