// CPU reference backend: fp32 everywhere, straightforward loops, multithreaded over rows or
// output features. It defines the exact semantics every other backend is checked against.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <mutex>
#include <vector>

#include "common/thread_pool.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/rope.h"

namespace sparsex {
namespace {

float* F(const Tensor& t) { return static_cast<float*>(t.data); }

float Dot(const float* a, const float* b, int64_t n) {
  // Eight partial sums let the compiler vectorise without -ffast-math.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  }
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

absl::Status CheckShape(const Tensor& t, int64_t rows, int64_t cols, const char* what) {
  if (t.rows != rows || t.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected [", rows, ", ", cols,
                                                   "], got [", t.rows, ", ", t.cols, "]"));
  }
  return absl::OkStatus();
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  DType compute_dtype() const override { return DType::kF32; }

  absl::StatusOr<Tensor> Alloc(int64_t rows, int64_t cols) override {
    if (rows < 0 || cols < 0) return absl::InvalidArgumentError("negative tensor shape");
    Tensor t{nullptr, DType::kF32, rows, cols};
    size_t n = static_cast<size_t>(rows * cols);
    t.data = std::calloc(std::max<size_t>(n, 1), sizeof(float));
    if (t.data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", n * 4, " bytes"));
    }
    return t;
  }
  void Free(Tensor& t) override {
    std::free(t.data);
    t = Tensor{};
  }
  absl::Status Upload(std::span<const float> host, Tensor& dst) override {
    if (host.size() != static_cast<size_t>(dst.rows * dst.cols)) {
      return absl::InvalidArgumentError("Upload: size mismatch");
    }
    std::memcpy(dst.data, host.data(), host.size_bytes());
    return absl::OkStatus();
  }
  absl::Status Download(const Tensor& src, std::span<float> host) override {
    if (host.size() != static_cast<size_t>(src.rows * src.cols)) {
      return absl::InvalidArgumentError("Download: size mismatch");
    }
    std::memcpy(host.data(), src.data, host.size_bytes());
    return absl::OkStatus();
  }

  absl::StatusOr<Tensor> FromView(const TensorView& v, int64_t rows, int64_t cols) {
    if (v.numel() != rows * cols) {
      return absl::InvalidArgumentError(absl::StrCat("weight ", v.name, " has ", v.numel(),
                                                     " elements, expected ", rows * cols));
    }
    ASSIGN_OR_RETURN(Tensor t, Alloc(rows, cols));
    v.ToF32(F(t));
    return t;
  }
  // Stacks views row-wise into one tensor (wq;wk;wv and gate;up).
  absl::StatusOr<Tensor> Stack(std::initializer_list<const TensorView*> views, int64_t cols) {
    int64_t rows = 0;
    for (auto* v : views) rows += v->numel() / cols;
    ASSIGN_OR_RETURN(Tensor t, Alloc(rows, cols));
    float* p = F(t);
    for (auto* v : views) {
      v->ToF32(p);
      p += v->numel();
    }
    return t;
  }

  absl::StatusOr<BackendWeights> LoadWeights(const Model& model) override {
    const ModelConfig& c = model.config();
    const ModelWeights& w = model.weights();
    BackendWeights out;
    ASSIGN_OR_RETURN(out.tok_embeddings, FromView(w.tok_embeddings, c.vocab_size, c.dim));
    ASSIGN_OR_RETURN(out.final_norm, FromView(w.final_norm, 1, c.dim));
    ASSIGN_OR_RETURN(out.output, FromView(w.output, c.vocab_size, c.dim));
    for (const LayerWeights& lw : w.layers) {
      BackendLayer bl;
      ASSIGN_OR_RETURN(bl.attn_norm, FromView(lw.attn_norm, 1, c.dim));
      ASSIGN_OR_RETURN(bl.wqkv, Stack({&lw.wq, &lw.wk, &lw.wv}, c.dim));
      ASSIGN_OR_RETURN(bl.wo, FromView(lw.wo, c.dim, c.n_heads * c.head_dim));
      ASSIGN_OR_RETURN(bl.ffn_norm, FromView(lw.ffn_norm, 1, c.dim));
      ASSIGN_OR_RETURN(bl.w_gate_up, Stack({&lw.w_gate, &lw.w_up}, c.dim));
      ASSIGN_OR_RETURN(bl.w_down, FromView(lw.w_down, c.dim, c.ffn_dim));
      out.layers.push_back(bl);
    }
    return out;
  }

  absl::StatusOr<BackendWeights> RandomWeights(const ModelConfig& c, uint64_t seed) override {
    std::mt19937_64 rng(seed);
    auto rand = [&](int64_t rows, int64_t cols) -> absl::StatusOr<Tensor> {
      ASSIGN_OR_RETURN(Tensor t, Alloc(rows, cols));
      float a = 1.0f / std::sqrt(static_cast<float>(cols));
      std::uniform_real_distribution<float> d(-a, a);
      for (int64_t i = 0; i < rows * cols; ++i) F(t)[i] = d(rng);
      return t;
    };
    auto ones = [&](int64_t n) -> absl::StatusOr<Tensor> {
      ASSIGN_OR_RETURN(Tensor t, Alloc(1, n));
      std::fill(F(t), F(t) + n, 1.0f);
      return t;
    };
    return MakeWeights(*this, c, rand, ones);
  }

  absl::StatusOr<KvPool> AllocKvPool(int num_layers, int num_blocks, int block_size,
                                     int kv_dim) override {
    KvPool p;
    p.num_layers = num_layers;
    p.num_blocks = num_blocks;
    p.block_size = block_size;
    p.kv_dim = kv_dim;
    for (int l = 0; l < num_layers; ++l) {
      ASSIGN_OR_RETURN(Tensor k, Alloc(static_cast<int64_t>(num_blocks) * block_size, kv_dim));
      ASSIGN_OR_RETURN(Tensor v, Alloc(static_cast<int64_t>(num_blocks) * block_size, kv_dim));
      p.k.push_back(k);
      p.v.push_back(v);
    }
    return p;
  }
  void FreeKvPool(KvPool& pool) override {
    for (Tensor& t : pool.k) Free(t);
    for (Tensor& t : pool.v) Free(t);
    pool = KvPool{};
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status Embedding(const Tensor& table, std::span<const int32_t> ids,
                         Tensor& out) override {
    RETURN_IF_ERROR(CheckShape(out, static_cast<int64_t>(ids.size()), table.cols, "Embedding"));
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= table.rows) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " out of range [0, ",
                                                       table.rows, ")"));
      }
      std::memcpy(F(out) + i * out.cols, F(table) + ids[i] * table.cols, table.cols * 4);
    }
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    RETURN_IF_ERROR(CheckShape(out, x.rows, x.cols, "RmsNorm"));
    const int64_t d = x.cols;
    ParallelFor(x.rows, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* xi = F(x) + r * d;
        float ss = 0;
        for (int64_t j = 0; j < d; ++j) ss += xi[j] * xi[j];
        ss = 1.0f / std::sqrt(ss / d + eps);
        float* o = F(out) + r * d;
        for (int64_t j = 0; j < d; ++j) o[j] = F(w)[j] * (ss * xi[j]);
      }
    }, 16);
    return absl::OkStatus();
  }

  absl::Status MatMul(const Tensor& x, const Tensor& w, Tensor& out) override {
    return Gemm(x, w, out, false);
  }
  // Same sums as MatMul followed by Add, so results are bit-identical either way.
  absl::Status MatMulAdd(const Tensor& x, const Tensor& w, Tensor& out) override {
    return Gemm(x, w, out, true);
  }
  absl::Status Gemm(const Tensor& x, const Tensor& w, Tensor& out, bool accumulate) {
    if (x.cols != w.cols) {
      return absl::InvalidArgumentError(absl::StrCat("MatMul: inner dims ", x.cols, " vs ",
                                                     w.cols));
    }
    RETURN_IF_ERROR(CheckShape(out, x.rows, w.rows, "MatMul"));
    const int64_t n = x.rows, m = w.rows, k = x.cols;
    // Parallel over output features: each weight row is read once per call and reused for
    // every input row while it is hot in cache.
    ParallelFor(m, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        const float* wr = F(w) + j * k;
        for (int64_t i = 0; i < n; ++i) {
          const float d = Dot(F(x) + i * k, wr, k);
          F(out)[i * m + j] = accumulate ? F(out)[i * m + j] + d : d;
        }
      }
    }, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, n * k / 64)));
    return absl::OkStatus();
  }

  absl::Status Add(Tensor& a, const Tensor& b) override {
    RETURN_IF_ERROR(CheckShape(b, a.rows, a.cols, "Add"));
    const int64_t n = a.rows * a.cols;
    for (int64_t i = 0; i < n; ++i) F(a)[i] += F(b)[i];
    return absl::OkStatus();
  }

  absl::Status SwiGLU(const Tensor& x, Tensor& out) override {
    RETURN_IF_ERROR(CheckShape(out, x.rows, x.cols / 2, "SwiGLU"));
    const int64_t h = out.cols;
    for (int64_t r = 0; r < x.rows; ++r) {
      const float* g = F(x) + r * x.cols;
      const float* u = g + h;
      float* o = F(out) + r * h;
      for (int64_t j = 0; j < h; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
    }
    return absl::OkStatus();
  }

  // The same dot products and the same expression as MatMul then SwiGLU, so results are
  // bit-identical either way; no [n, 2*half] intermediate.
  absl::Status MatMulSwiGLU(const Tensor& x, const Tensor& w, Tensor& out) override {
    if (x.cols != w.cols) {
      return absl::InvalidArgumentError(absl::StrCat("MatMulSwiGLU: inner dims ", x.cols,
                                                     " vs ", w.cols));
    }
    if (w.rows % 2 != 0) return absl::InvalidArgumentError("MatMulSwiGLU: odd gate_up rows");
    RETURN_IF_ERROR(CheckShape(out, x.rows, w.rows / 2, "MatMulSwiGLU"));
    const int64_t n = x.rows, h = out.cols, k = x.cols;
    ParallelFor(h, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        const float* wg = F(w) + j * k;
        const float* wu = F(w) + (h + j) * k;
        for (int64_t i = 0; i < n; ++i) {
          const float g = Dot(F(x) + i * k, wg, k);
          const float u = Dot(F(x) + i * k, wu, k);
          F(out)[i * h + j] = g / (1.0f + std::exp(-g)) * u;
        }
      }
    }, std::max<int64_t>(1, 2048 / std::max<int64_t>(1, n * k / 64)));
    return absl::OkStatus();
  }

  absl::Status Rope(Tensor& x, int64_t col_offset, int n_heads, std::span<const int32_t> pos,
                    const RopeParams& p) override {
    if (static_cast<int64_t>(pos.size()) != x.rows) {
      return absl::InvalidArgumentError("Rope: one position per row required");
    }
    if (col_offset + static_cast<int64_t>(n_heads) * p.head_dim > x.cols || p.head_dim % 2) {
      return absl::InvalidArgumentError("Rope: columns out of range or odd head_dim");
    }
    const std::vector<float> inv = RopeInvFreq(p);
    const int half = p.head_dim / 2;
    for (int64_t r = 0; r < x.rows; ++r) {
      for (int j = 0; j < half; ++j) {
        const float val = static_cast<float>(pos[r]) * inv[j];
        const float c = std::cos(val), s = std::sin(val);
        for (int h = 0; h < n_heads; ++h) {
          float* v = F(x) + r * x.cols + col_offset + static_cast<int64_t>(h) * p.head_dim;
          const int i0 = p.layout == RopeLayout::kAdjacentPairs ? 2 * j : j;
          const int i1 = p.layout == RopeLayout::kAdjacentPairs ? 2 * j + 1 : j + half;
          const float a = v[i0], b = v[i1];
          v[i0] = a * c - b * s;
          v[i1] = a * s + b * c;
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status WriteKv(KvPool& pool, int layer, const Tensor& k_src, int64_t k_col,
                       const Tensor& v_src, int64_t v_col,
                       std::span<const int32_t> slots) override {
    RETURN_IF_ERROR(ValidateSlots(pool, slots));
    const int64_t d = pool.kv_dim;
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(F(pool.k[layer]) + slots[i] * d, F(k_src) + i * k_src.cols + k_col, d * 4);
      std::memcpy(F(pool.v[layer]) + slots[i] * d, F(v_src) + i * v_src.cols + v_col, d * 4);
    }
    return absl::OkStatus();
  }

  absl::Status ReadKv(const KvPool& pool, int layer, std::span<const int32_t> slots,
                      std::span<float> k_host, std::span<float> v_host) override {
    RETURN_IF_ERROR(ValidateSlots(pool, slots));
    const int64_t d = pool.kv_dim;
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(k_host.data() + i * d, F(pool.k[layer]) + slots[i] * d, d * 4);
      std::memcpy(v_host.data() + i * d, F(pool.v[layer]) + slots[i] * d, d * 4);
    }
    return absl::OkStatus();
  }

  absl::Status Attention(const Tensor& q, const KvPool& pool, int layer,
                         const AttentionArgs& a, Tensor& out) override {
    const int H = a.n_heads, KV = a.n_kv_heads, hd = a.head_dim;
    const int64_t n = q.rows, ctx = static_cast<int64_t>(a.ctx_slots.size());
    RETURN_IF_ERROR(ValidateAttention(q, pool, a, out));
    if (!a.seqs.empty()) return AttentionBySequence(*this, q, pool, layer, a, out);
    const bool want_cross = a.out_cross != nullptr;
    const bool want_recv = a.out_recv != nullptr;
    const float scale = a.scale > 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(hd));
    const float* K = F(pool.k[layer]);
    const float* V = F(pool.v[layer]);
    const int64_t d = pool.kv_dim;
    const int group = H / KV;
    // Rows [b, e); recv (ctx floats) takes their received attention when not null.
    auto rows = [&](int64_t b, int64_t e, float* recv) {
      std::vector<float> sc(ctx);
      for (int64_t i = b; i < e; ++i) {
        const int64_t len = a.q_pos[i] + 1;
        float cross = 0;
        for (int h = 0; h < H; ++h) {
          const float* qh = F(q) + i * q.cols + static_cast<int64_t>(h) * hd;
          const int64_t kc = static_cast<int64_t>(h / group) * hd;
          float mx = -INFINITY;
          for (int64_t j = 0; j < len; ++j) {
            sc[j] = Dot(qh, K + a.ctx_slots[j] * d + kc, hd) * scale;
            mx = std::max(mx, sc[j]);
          }
          float sum = 0;
          for (int64_t j = 0; j < len; ++j) {
            sc[j] = std::exp(sc[j] - mx);
            sum += sc[j];
          }
          const float inv = 1.0f / sum;
          float* o = F(out) + i * out.cols + static_cast<int64_t>(h) * hd;
          std::fill(o, o + hd, 0.0f);
          for (int64_t j = 0; j < len; ++j) {
            const float p = sc[j] * inv;
            const float* vr = V + a.ctx_slots[j] * d + kc;
            for (int t = 0; t < hd; ++t) o[t] += p * vr[t];
            if (want_cross) {
              const int32_t g = a.key_group[j];
              if (g >= 0 && g != a.q_group[i]) cross += p;
            }
            if (recv != nullptr && a.recv_weight[i] > 0) recv[j] += a.recv_weight[i] * p / H;
          }
        }
        if (want_cross) a.out_cross[i] += cross / H;
      }
    };
    if (!want_recv) {
      ParallelFor(n, [&](int64_t b, int64_t e) { rows(b, e, nullptr); }, 4);
      return absl::OkStatus();
    }
    // The received attention is a sum over rows: each chunk of kStatRows rows (a fixed split,
    // whatever the thread count) accumulates its own, and the chunks are added in row order.
    // Float sums depend on their order, and the selection ranks these sums: summed in the order
    // threads finished (as before), identical requests ranked differently; split per thread,
    // workers with other core counts would (docs/reliability.md, greedy reproducibility).
    constexpr int64_t kStatRows = 64;
    const int64_t chunks = (n + kStatRows - 1) / kStatRows;
    std::vector<std::vector<float>> recv(chunks);  // empty: no weighted row in the chunk
    ParallelFor(chunks, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t b = c * kStatRows, e = std::min(n, b + kStatRows);
        bool weighted = false;
        for (int64_t i = b; i < e; ++i) weighted = weighted || a.recv_weight[i] > 0;
        if (weighted) recv[c].assign(ctx, 0.0f);
        rows(b, e, weighted ? recv[c].data() : nullptr);
      }
    });
    for (const std::vector<float>& part : recv) {
      for (size_t j = 0; j < part.size(); ++j) a.out_recv[j] += part[j];
    }
    return absl::OkStatus();
  }

  absl::Status GatherRows(const Tensor& src, std::span<const int32_t> idx, Tensor& dst) override {
    RETURN_IF_ERROR(CheckShape(dst, static_cast<int64_t>(idx.size()), src.cols, "GatherRows"));
    for (size_t i = 0; i < idx.size(); ++i) {
      if (idx[i] < 0 || idx[i] >= src.rows) return absl::OutOfRangeError("GatherRows index");
      std::memcpy(F(dst) + i * dst.cols, F(src) + idx[i] * src.cols, src.cols * 4);
    }
    return absl::OkStatus();
  }
  absl::Status ScatterRows(const Tensor& src, std::span<const int32_t> idx,
                           Tensor& dst) override {
    RETURN_IF_ERROR(CheckShape(src, static_cast<int64_t>(idx.size()), dst.cols, "ScatterRows"));
    for (size_t i = 0; i < idx.size(); ++i) {
      if (idx[i] < 0 || idx[i] >= dst.rows) return absl::OutOfRangeError("ScatterRows index");
      std::memcpy(F(dst) + idx[i] * dst.cols, F(src) + i * src.cols, src.cols * 4);
    }
    return absl::OkStatus();
  }
  absl::Status CopyRows(const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row,
                        int64_t n) override {
    if (src.cols != dst.cols || src_row < 0 || dst_row < 0 || src_row + n > src.rows ||
        dst_row + n > dst.rows) {
      return absl::OutOfRangeError("CopyRows: range outside tensors");
    }
    std::memcpy(F(dst) + dst_row * dst.cols, F(src) + src_row * src.cols, n * src.cols * 4);
    return absl::OkStatus();
  }
  absl::Status CopyCols(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                        int64_t n_cols) override {
    if (src.rows != dst.rows || src_col < 0 || dst_col < 0 || n_cols < 0 ||
        src_col + n_cols > src.cols || dst_col + n_cols > dst.cols) {
      return absl::OutOfRangeError("CopyCols: range outside tensors");
    }
    for (int64_t r = 0; r < src.rows; ++r) {
      std::memcpy(F(dst) + r * dst.cols + dst_col, F(src) + r * src.cols + src_col, n_cols * 4);
    }
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend() {
  return std::unique_ptr<Backend>(new CpuBackend());
}

}  // namespace sparsex
