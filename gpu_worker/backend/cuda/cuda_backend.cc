// CUDA backend: bf16 storage, fp32 accumulation, one stream per backend. Operations validate
// their arguments on the host exactly as the CPU reference does, stage host index spans
// (positions, slots, ids) through a pinned ring into device copies that later calls with the
// same bytes reuse (every layer of a pass stages the same arrays), and launch the kernels of
// kernels/ on the stream; only Download, ReadKv, Attention with selection
// statistics and Synchronize wait for the device.
#include "gpu_worker/backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/hash.h"
#include "gpu_worker/backend/cuda/cudnn_attention.h"
#include "gpu_worker/backend/cuda/device_scratch.h"
#include "gpu_worker/backend/rope.h"
#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/rope.h"

namespace sparsex {
namespace {

using bf16 = __nv_bfloat16;

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

#define CUDA_RETURN(expr, what)                                  \
  do {                                                           \
    cudaError_t spx_cuda_err_ = (expr);                          \
    if (spx_cuda_err_ != cudaSuccess) return CudaError(spx_cuda_err_, what); \
  } while (0)

bf16* B(const Tensor& t) { return static_cast<bf16*>(t.data); }

absl::Status CheckShape(const Tensor& t, int64_t rows, int64_t cols, const char* what) {
  if (t.rows != rows || t.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected [", rows, ", ", cols,
                                                   "], got [", t.rows, ", ", t.cols, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckBf16(const Tensor& t, const char* what) {
  if (t.dtype != DType::kBF16 || (t.data == nullptr && !t.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a tensor of the CUDA backend"));
  }
  return absl::OkStatus();
}

// Host spans to stage in one copy; each lands 16-byte aligned in the device scratch.
struct HostSpan {
  const void* data;
  size_t bytes;
};

// Device memory for the tensors and index arrays of recorded scopes (Backend::BeginGraph):
// one allocation carved first-fit on the host, so that the same sequence of requests gets the
// same addresses every time (what lets a recorded sequence recur) and no allocation call is
// captured into a graph. Reuse in program order is safe: everything runs in order on the
// backend's stream.
class GraphArena {
 public:
  ~GraphArena() {
    if (base_) cudaFree(base_);
  }
  size_t size() const { return size_; }
  size_t live() const { return used_.size(); }
  // Replaces the memory (none may be live).
  absl::Status Reserve(size_t bytes) {
    if (base_) cudaFree(base_);
    base_ = nullptr;
    size_ = 0;
    free_.clear();
    CUDA_RETURN(cudaMalloc(&base_, bytes), "graph arena alloc");
    size_ = bytes;
    free_[0] = bytes;
    return absl::OkStatus();
  }
  bool Owns(const void* p) const {
    return base_ != nullptr && p >= base_ && p < base_ + size_;
  }
  void* Take(size_t bytes) {
    bytes = std::max<size_t>((bytes + 255) / 256 * 256, 256);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      const size_t off = it->first, len = it->second;
      free_.erase(it);
      if (len > bytes) free_[off + bytes] = len - bytes;
      used_[off] = bytes;
      return base_ + off;
    }
    return nullptr;
  }
  void Give(void* p) {
    auto it = used_.find(static_cast<size_t>(static_cast<char*>(p) - base_));
    if (it == used_.end()) return;
    size_t off = it->first, len = it->second;
    used_.erase(it);
    auto next = free_.lower_bound(off);
    if (next != free_.end() && next->first == off + len) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += len;
        return;
      }
    }
    free_[off] = len;
  }

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
  std::map<size_t, size_t> free_, used_;  // offset -> length
};

size_t RoundUpPow2(size_t v) {
  size_t r = 1;
  while (r < v) r <<= 1;
  return r;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    cudnn_.reset();  // its handle is bound to stream_
    for (GraphEntry& g : graphs_) cudaGraphExecDestroy(g.exec);
    if (graph_done_) cudaEventDestroy(graph_done_);
    if (graph_pinned_) cudaFreeHost(graph_pinned_);
    for (auto& [k, p] : rope_tables_) cudaFree(p);
    if (pinned_) cudaFreeHost(pinned_);
    for (auto& [t, ev] : tickets_) cudaEventDestroy(ev);
    for (StageEntry& e : stage_cache_) {
      if (e.dev) cudaFree(e.dev);
    }
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream create");
    CUDA_RETURN(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking),
                "copy stream create");
    // Keep freed pool memory cached: temporaries are allocated and freed every forward pass.
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) {
      uint64_t threshold = UINT64_MAX;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    }
    cublasStatus_t st = gemm_.Init(64u << 20);
    if (st != CUBLAS_STATUS_SUCCESS) {
      return absl::InternalError(absl::StrCat("cuBLASLt init: ", kernels::CublasStatusName(st)));
    }
    // SPX_SMALL_N_GEMM=0 sends decode-sized matmuls to cuBLASLt too (for comparisons).
    const char* env = std::getenv("SPX_SMALL_N_GEMM");
    use_small_n_gemm_ = env == nullptr || std::string(env) != "0";
    // SPX_ATTN_WARPS=4|8 picks the attention block size (default: the kernel's).
    if (const char* w = std::getenv("SPX_ATTN_WARPS")) attn_warps_ = std::atoi(w);
    if (const char* f = std::getenv("SPX_FUSED_RESIDUAL")) fused_residual_ = std::string(f) == "1";
    // SPX_ATTN_IMPL=mma|wgmma|wgmma-pipe|wgmma-128 forces an attention kernel (default: auto).
    if (const char* im = std::getenv("SPX_ATTN_IMPL")) {
      const std::string v = im;
      attn_impl_ = v == "mma"          ? 1
                   : v == "wgmma"      ? 2
                   : v == "wgmma-pipe" ? 3
                   : v == "wgmma-128"  ? 4
                                       : 0;
    }
    pinned_size_ = 16u << 20;
    CUDA_RETURN(cudaMallocHost(&pinned_, pinned_size_), "pinned staging alloc");
    // SPX_CUDA_GRAPHS=0 runs recorded scopes (BeginGraph) as plain launches (for comparisons).
    if (const char* g = std::getenv("SPX_CUDA_GRAPHS")) graphs_enabled_ = std::string(g) != "0";
    // SPX_CUDNN_ATTENTION=0 keeps dense prefill attention on our kernels; =require turns a
    // cuDNN failure into an error instead of the fallback (tests). SPX_CUDNN_MIN_TOKENS: the
    // fewest query rows that go to cuDNN. Default 16384: each new shape costs a plan build
    // (~40-100 ms on the H200, ~1 s for the first, which compiles the kernel), repaid within
    // one prefill only from about 16K tokens (32 layers x 1.8x faster attention).
    if (const char* c = std::getenv("SPX_CUDNN_ATTENTION")) {
      const std::string v = c;
      cudnn_mode_ = v == "0" ? 0 : v == "require" ? 2 : 1;
    }
    if (const char* m = std::getenv("SPX_CUDNN_MIN_TOKENS")) cudnn_min_tokens_ = std::atoll(m);
    CUDA_RETURN(cudaEventCreateWithFlags(&graph_done_, cudaEventDisableTiming), "graph event");
    return absl::OkStatus();
  }

  cudaStream_t stream() const { return stream_; }

  std::string name() const override { return "cuda"; }
  DType compute_dtype() const override { return DType::kBF16; }

  // ---- memory ----
  absl::StatusOr<Tensor> Alloc(int64_t rows, int64_t cols) override {
    if (rows < 0 || cols < 0) return absl::InvalidArgumentError("negative tensor shape");
    Tensor t{nullptr, DType::kBF16, rows, cols};
    const size_t bytes = std::max<size_t>(t.bytes(), 16);
    if (recording_) {
      if ((t.data = arena_.Take(bytes)) != nullptr) return t;
      // Out of arena: the scope ends here (a larger arena next time) and runs as launched.
      arena_want_ = std::max(arena_want_, 2 * arena_.size());
      RETURN_IF_ERROR(FlushGraph());
    }
    cudaError_t e = cudaMallocAsync(&t.data, bytes, stream_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes,
                                                       " bytes on the GPU: ",
                                                       cudaGetErrorString(e)));
    }
    return t;
  }
  void Free(Tensor& t) override {
    if (arena_.Owns(t.data)) {
      arena_.Give(t.data);  // later users are enqueued after this tensor's last reader
    } else if (t.data && t.host) {
      KeepError(FlushGraph());
      // Queued copies may still read it: cudaFreeHost would not wait for this stream.
      cudaStreamSynchronize(copy_stream_);
      cudaStreamSynchronize(stream_);
      cudaFreeHost(t.data);
    } else if (t.data) {
      cudaFreeAsync(t.data, stream_);
    }
    t = Tensor{};
  }

  absl::StatusOr<Tensor> AllocHost(int64_t rows, int64_t cols) override {
    RETURN_IF_ERROR(FlushGraph());
    if (rows < 0 || cols < 0) return absl::InvalidArgumentError("negative tensor shape");
    Tensor t{nullptr, DType::kBF16, rows, cols};
    t.host = true;
    const size_t bytes = std::max<size_t>(t.bytes(), 16);
    cudaError_t e = cudaHostAlloc(&t.data, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes,
                                                       " bytes of pinned host memory: ",
                                                       cudaGetErrorString(e)));
    }
    return t;
  }

  absl::StatusOr<int64_t> Prefetch(const Tensor& src, Tensor& dst) override {
    RETURN_IF_ERROR(FlushGraph());
    RETURN_IF_ERROR(CheckBf16(src, "Prefetch src"));
    RETURN_IF_ERROR(CheckBf16(dst, "Prefetch dst"));
    RETURN_IF_ERROR(CheckShape(dst, src.rows, src.cols, "Prefetch"));
    // The copy starts after what the compute stream has queued so far (dst's stream-ordered
    // allocation included) and runs beside what is queued later.
    cudaEvent_t ready = nullptr, done = nullptr;
    CUDA_RETURN(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "Prefetch event");
    CUDA_RETURN(cudaEventRecord(ready, stream_), "Prefetch record");
    CUDA_RETURN(cudaStreamWaitEvent(copy_stream_, ready, 0), "Prefetch wait");
    cudaEventDestroy(ready);
    if (!src.empty()) {
      CUDA_RETURN(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDefault,
                                  copy_stream_),
                  "Prefetch copy");
    }
    CUDA_RETURN(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "Prefetch event");
    CUDA_RETURN(cudaEventRecord(done, copy_stream_), "Prefetch record");
    tickets_.emplace(++last_ticket_, done);
    return last_ticket_;
  }

  absl::Status Await(int64_t ticket) override {
    RETURN_IF_ERROR(FlushGraph());
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return absl::OkStatus();  // already awaited
    cudaError_t e = cudaStreamWaitEvent(stream_, it->second, 0);
    cudaEventDestroy(it->second);  // released once the wait is satisfied
    tickets_.erase(it);
    CUDA_RETURN(e, "Await");
    return absl::OkStatus();
  }

  absl::Status Upload(std::span<const float> host, Tensor& dst) override {
    RETURN_IF_ERROR(FlushGraph());
    RETURN_IF_ERROR(CheckBf16(dst, "Upload"));
    if (host.size() != static_cast<size_t>(dst.rows * dst.cols)) {
      return absl::InvalidArgumentError("Upload: size mismatch");
    }
    if (host.empty()) return absl::OkStatus();
    if (dst.host) {
      bf16* d = B(dst);
      for (size_t i = 0; i < host.size(); ++i) d[i] = __float2bfloat16_rn(host[i]);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(void* tmp, f32_scratch_.Get(host.size_bytes(), stream_));
    CUDA_RETURN(cudaMemcpyAsync(tmp, host.data(), host.size_bytes(), cudaMemcpyHostToDevice,
                                stream_),
                "Upload copy");
    CUDA_RETURN(kernels::F32ToBf16(static_cast<float*>(tmp), B(dst),
                                   static_cast<int64_t>(host.size()), stream_),
                "Upload convert");
    return absl::OkStatus();
  }

  absl::Status Download(const Tensor& src, std::span<float> host) override {
    RETURN_IF_ERROR(FlushGraph());
    RETURN_IF_ERROR(CheckBf16(src, "Download"));
    if (host.size() != static_cast<size_t>(src.rows * src.cols)) {
      return absl::InvalidArgumentError("Download: size mismatch");
    }
    if (host.empty()) return absl::OkStatus();
    if (src.host) {
      CUDA_RETURN(cudaStreamSynchronize(stream_), "Download sync");
      const bf16* d = B(src);
      for (size_t i = 0; i < host.size(); ++i) host[i] = __bfloat162float(d[i]);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(void* tmp, f32_scratch_.Get(host.size_bytes(), stream_));
    CUDA_RETURN(kernels::Bf16ToF32(B(src), static_cast<float*>(tmp),
                                   static_cast<int64_t>(host.size()), stream_),
                "Download convert");
    CUDA_RETURN(cudaMemcpyAsync(host.data(), tmp, host.size_bytes(), cudaMemcpyDeviceToHost,
                                stream_),
                "Download copy");
    CUDA_RETURN(cudaStreamSynchronize(stream_), "Download sync");
    return absl::OkStatus();
  }

  // Copies a host weight (F32/F16/BF16) into rows of dst as bf16, in bounded chunks.
  absl::Status UploadView(const TensorView& v, bf16* dst) {
    const int64_t n = v.numel();
    if (n == 0) return absl::OkStatus();
    if (v.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(v.name, ": no data"));
    const size_t esize = DTypeSize(v.dtype);
    if (v.nbytes < static_cast<size_t>(n) * esize) {
      return absl::InvalidArgumentError(absl::StrCat(v.name, ": buffer smaller than its shape"));
    }
    if (v.dtype == DType::kBF16) {
      CUDA_RETURN(cudaMemcpyAsync(dst, v.data, n * 2, cudaMemcpyHostToDevice, stream_),
                  "weight copy");
      return absl::OkStatus();
    }
    constexpr int64_t kChunk = 16 << 20;  // elements per staged chunk
    ASSIGN_OR_RETURN(void* tmp, f32_scratch_.Get(kChunk * 4, stream_));
    const char* src = static_cast<const char*>(v.data);
    for (int64_t off = 0; off < n; off += kChunk) {
      const int64_t c = std::min(kChunk, n - off);
      CUDA_RETURN(cudaMemcpyAsync(tmp, src + off * esize, c * esize, cudaMemcpyHostToDevice,
                                  stream_),
                  "weight copy");
      if (v.dtype == DType::kF32) {
        CUDA_RETURN(kernels::F32ToBf16(static_cast<float*>(tmp), dst + off, c, stream_),
                    "weight convert");
      } else {
        CUDA_RETURN(kernels::F16ToBf16(tmp, dst + off, c, stream_), "weight convert");
      }
      // The staging buffer is reused by the next chunk: wait for this one.
      CUDA_RETURN(cudaStreamSynchronize(stream_), "weight sync");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Tensor> FromViews(std::initializer_list<const TensorView*> views, int64_t cols,
                                   int64_t expect_rows) {
    int64_t rows = 0;
    for (auto* v : views) {
      if (cols <= 0 || v->numel() % cols != 0) {
        return absl::InvalidArgumentError(absl::StrCat("weight ", v->name, " has ", v->numel(),
                                                       " elements, not a multiple of ", cols));
      }
      rows += v->numel() / cols;
    }
    if (expect_rows >= 0 && rows != expect_rows) {
      return absl::InvalidArgumentError(absl::StrCat("weights ", (*views.begin())->name,
                                                     "...: ", rows, " rows, expected ",
                                                     expect_rows));
    }
    ASSIGN_OR_RETURN(Tensor t, Alloc(rows, cols));
    bf16* p = B(t);
    for (auto* v : views) {
      absl::Status s = UploadView(*v, p);
      if (!s.ok()) {
        Free(t);
        return s;
      }
      p += v->numel();
    }
    return t;
  }

  absl::StatusOr<BackendWeights> LoadWeights(const Model& model) override {
    RETURN_IF_ERROR(FlushGraph());
    const ModelConfig& c = model.config();
    const ModelWeights& w = model.weights();
    BackendWeights out;
    auto load = [&]() -> absl::Status {
      const int64_t hd = c.head_dim;
      ASSIGN_OR_RETURN(out.tok_embeddings, FromViews({&w.tok_embeddings}, c.dim, c.vocab_size));
      ASSIGN_OR_RETURN(out.final_norm, FromViews({&w.final_norm}, c.dim, 1));
      ASSIGN_OR_RETURN(out.output, FromViews({&w.output}, c.dim, c.vocab_size));
      for (const LayerWeights& lw : w.layers) {
        BackendLayer bl;
        out.layers.push_back(bl);
        BackendLayer& l = out.layers.back();
        ASSIGN_OR_RETURN(l.attn_norm, FromViews({&lw.attn_norm}, c.dim, 1));
        ASSIGN_OR_RETURN(l.wqkv, FromViews({&lw.wq, &lw.wk, &lw.wv}, c.dim,
                                           (c.n_heads + 2 * c.n_kv_heads) * hd));
        ASSIGN_OR_RETURN(l.wo, FromViews({&lw.wo}, c.n_heads * hd, c.dim));
        ASSIGN_OR_RETURN(l.ffn_norm, FromViews({&lw.ffn_norm}, c.dim, 1));
        ASSIGN_OR_RETURN(l.w_gate_up, FromViews({&lw.w_gate, &lw.w_up}, c.dim, 2 * c.ffn_dim));
        ASSIGN_OR_RETURN(l.w_down, FromViews({&lw.w_down}, c.ffn_dim, c.dim));
      }
      CUDA_RETURN(cudaStreamSynchronize(stream_), "LoadWeights sync");
      return absl::OkStatus();
    };
    absl::Status s = load();
    if (!s.ok()) {
      FreeWeights(out);
      return s;
    }
    return out;
  }

  absl::StatusOr<BackendWeights> RandomWeights(const ModelConfig& c, uint64_t seed) override {
    RETURN_IF_ERROR(FlushGraph());
    uint64_t counter = 0;
    auto rand = [&](int64_t rows, int64_t cols) -> absl::StatusOr<Tensor> {
      ASSIGN_OR_RETURN(Tensor t, Alloc(rows, cols));
      const float a = 1.0f / std::sqrt(static_cast<float>(cols));
      const uint64_t s = seed * 0x9E3779B97F4A7C15ull + (++counter) * 0xC2B2AE3D27D4EB4Full;
      CUDA_RETURN(kernels::FillUniform(B(t), rows * cols, a, s, stream_), "RandomWeights fill");
      return t;
    };
    auto ones = [&](int64_t n) -> absl::StatusOr<Tensor> {
      ASSIGN_OR_RETURN(Tensor t, Alloc(1, n));
      CUDA_RETURN(kernels::Fill(B(t), n, 1.0f, stream_), "RandomWeights fill");
      return t;
    };
    ASSIGN_OR_RETURN(BackendWeights out, MakeWeights(*this, c, rand, ones));
    if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      FreeWeights(out);
      return CudaError(e, "RandomWeights sync");
    }
    return out;
  }

  void FreeWeights(BackendWeights& w) override {
    KeepError(FlushGraph());
    Backend::FreeWeights(w);
    cudaStreamSynchronize(stream_);  // frees are stream-ordered
  }

  absl::StatusOr<KvPool> AllocKvPool(int num_layers, int num_blocks, int block_size,
                                     int kv_dim) override {
    RETURN_IF_ERROR(FlushGraph());
    if (num_layers < 0 || num_blocks < 0 || block_size <= 0 || kv_dim <= 0) {
      return absl::InvalidArgumentError("AllocKvPool: bad shape");
    }
    KvPool p;
    p.num_layers = num_layers;
    p.num_blocks = num_blocks;
    p.block_size = block_size;
    p.kv_dim = kv_dim;
    const int64_t rows = static_cast<int64_t>(num_blocks) * block_size;
    for (int l = 0; l < num_layers; ++l) {
      for (std::vector<Tensor>* vec : {&p.k, &p.v}) {
        Tensor t{nullptr, DType::kBF16, rows, kv_dim};
        cudaError_t e = cudaMalloc(&t.data, std::max<size_t>(t.bytes(), 16));
        if (e != cudaSuccess) {
          cudaGetLastError();
          FreeKvPool(p);
          return absl::ResourceExhaustedError(absl::StrCat("KV pool: cannot allocate ",
                                                           t.bytes(), " bytes"));
        }
        vec->push_back(t);
        CUDA_RETURN(cudaMemsetAsync(t.data, 0, t.bytes(), stream_), "KV pool clear");
      }
    }
    return p;
  }
  void FreeKvPool(KvPool& pool) override {
    KeepError(FlushGraph());
    cudaStreamSynchronize(stream_);
    for (Tensor& t : pool.k) cudaFree(t.data);
    for (Tensor& t : pool.v) cudaFree(t.data);
    pool = KvPool{};
  }
  absl::Status Synchronize() override {
    RETURN_IF_ERROR(FlushGraph());
    CUDA_RETURN(cudaStreamSynchronize(stream_), "Synchronize");
    return absl::OkStatus();
  }

  // ---- operations ----
  absl::Status Embedding(const Tensor& table, std::span<const int32_t> ids,
                         Tensor& out) override {
    RETURN_IF_ERROR(CheckBf16(table, "Embedding table"));
    RETURN_IF_ERROR(CheckBf16(out, "Embedding out"));
    RETURN_IF_ERROR(CheckShape(out, static_cast<int64_t>(ids.size()), table.cols, "Embedding"));
    for (int32_t id : ids) {
      if (id < 0 || id >= table.rows) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", id, " out of range [0, ",
                                                       table.rows, ")"));
      }
    }
    if (ids.empty()) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto d, Stage({{ids.data(), ids.size_bytes()}}));
    const auto* di = static_cast<const int32_t*>(d[0]);
    return Run("Embedding", [=, this] {
      return kernels::GatherRows(B(table), table.cols, table.rows, di, B(out), out.cols,
                                 out.rows, out.cols, stream_);
    }, table.data, table.rows, table.cols, di, out.data, out.rows, out.cols);
  }

  absl::Status RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    RETURN_IF_ERROR(CheckBf16(x, "RmsNorm x"));
    RETURN_IF_ERROR(CheckBf16(w, "RmsNorm w"));
    RETURN_IF_ERROR(CheckBf16(out, "RmsNorm out"));
    RETURN_IF_ERROR(CheckShape(out, x.rows, x.cols, "RmsNorm"));
    if (w.rows * w.cols != x.cols) return absl::InvalidArgumentError("RmsNorm: weight size");
    return Run("RmsNorm", [=, this] {
      return kernels::RmsNorm(B(x), x.cols, B(w), B(out), out.cols, x.rows,
                              static_cast<int>(x.cols), eps, stream_);
    }, x.data, x.rows, x.cols, w.data, out.data, out.cols, eps);
  }

  absl::Status MatMul(const Tensor& x, const Tensor& w, Tensor& out) override {
    return Gemm(x, w, out, 0.0f);
  }
  // The residual add in the GEMM epilogue (beta = 1) rounds once where MatMul + Add rounds
  // twice; on stories260K that flipped a near-tie of the GPU-vs-CPU greedy check at token 45
  // and saved only ~1% at 32K (docs/perf-notes.md), so it is opt-in: SPX_FUSED_RESIDUAL=1.
  absl::Status MatMulAdd(const Tensor& x, const Tensor& w, Tensor& out) override {
    if (!fused_residual_) return Backend::MatMulAdd(x, w, out);
    return Gemm(x, w, out, 1.0f);
  }
  // out = x @ w^T + beta * out (beta = 1: the residual add in the GEMM epilogue).
  absl::Status Gemm(const Tensor& x, const Tensor& w, Tensor& out, float beta) {
    RETURN_IF_ERROR(CheckBf16(x, "MatMul x"));
    RETURN_IF_ERROR(CheckBf16(w, "MatMul w"));
    RETURN_IF_ERROR(CheckBf16(out, "MatMul out"));
    if (x.cols != w.cols) {
      return absl::InvalidArgumentError(absl::StrCat("MatMul: inner dims ", x.cols, " vs ",
                                                     w.cols));
    }
    RETURN_IF_ERROR(CheckShape(out, x.rows, w.rows, "MatMul"));
    if (x.rows == 0 || w.rows == 0) return absl::OkStatus();
    if (use_small_n_gemm_ &&
        kernels::SmallNGemmSupported(B(x), x.cols, B(w), w.cols, x.rows, x.cols)) {
      return Run("MatMul (small n)", [=, this] {
        return kernels::SmallNGemm(B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows, w.rows,
                                   x.cols, beta, stream_);
      }, x.data, x.rows, x.cols, w.data, w.rows, out.data, out.cols, beta);
    }
    // cuBLASLt reports a status of its own: a failed launch is mapped onto a CUDA error for the
    // recorded path and logged with the shapes here.
    auto run = [=, this] {
      cublasStatus_t st = gemm_.Run(B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows, w.rows,
                                    x.cols, beta, stream_);
      return st == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorLaunchFailure;
    };
    if (!recording_) {
      cublasStatus_t st = gemm_.Run(B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows, w.rows,
                                    x.cols, beta, stream_);
      if (st != CUBLAS_STATUS_SUCCESS) {
        return absl::InternalError(absl::StrCat("MatMul [", x.rows, "x", x.cols, "] @ [", w.rows,
                                                "x", w.cols, "]^T: ",
                                                kernels::CublasStatusName(st)));
      }
      return absl::OkStatus();
    }
    return Run("MatMul (cuBLASLt)", run, x.data, x.rows, x.cols, w.data, w.rows, out.data,
               out.cols, beta);
  }

  absl::Status Add(Tensor& a, const Tensor& b) override {
    RETURN_IF_ERROR(CheckBf16(a, "Add a"));
    RETURN_IF_ERROR(CheckBf16(b, "Add b"));
    RETURN_IF_ERROR(CheckShape(b, a.rows, a.cols, "Add"));
    return Run("Add", [=, this] {
      return kernels::Add(B(a), a.cols, B(b), b.cols, a.rows, a.cols, stream_);
    }, a.data, a.rows, a.cols, b.data, b.cols);
  }

  absl::Status AddRmsNorm(Tensor& x, const Tensor& b, const Tensor& w, float eps,
                          Tensor& out) override {
    RETURN_IF_ERROR(CheckBf16(x, "AddRmsNorm x"));
    RETURN_IF_ERROR(CheckBf16(b, "AddRmsNorm b"));
    RETURN_IF_ERROR(CheckBf16(w, "AddRmsNorm w"));
    RETURN_IF_ERROR(CheckBf16(out, "AddRmsNorm out"));
    RETURN_IF_ERROR(CheckShape(b, x.rows, x.cols, "AddRmsNorm"));
    RETURN_IF_ERROR(CheckShape(out, x.rows, x.cols, "AddRmsNorm"));
    if (w.rows * w.cols != x.cols) return absl::InvalidArgumentError("AddRmsNorm: weight size");
    return Run("AddRmsNorm", [=, this] {
      return kernels::AddRmsNorm(B(x), x.cols, B(b), b.cols, B(w), B(out), out.cols, x.rows,
                                 static_cast<int>(x.cols), eps, stream_);
    }, x.data, x.rows, x.cols, b.data, b.cols, w.data, out.data, out.cols, eps);
  }

  absl::Status SwiGLU(const Tensor& x, Tensor& out) override {
    RETURN_IF_ERROR(CheckBf16(x, "SwiGLU x"));
    RETURN_IF_ERROR(CheckBf16(out, "SwiGLU out"));
    RETURN_IF_ERROR(CheckShape(out, x.rows, x.cols / 2, "SwiGLU"));
    return Run("SwiGLU", [=, this] {
      return kernels::SwiGlu(B(x), x.cols, B(out), out.cols, x.rows, out.cols, stream_);
    }, x.data, x.rows, x.cols, out.data, out.cols);
  }

  absl::Status Rope(Tensor& x, int64_t col_offset, int n_heads, std::span<const int32_t> pos,
                    const RopeParams& p) override {
    RETURN_IF_ERROR(CheckBf16(x, "Rope"));
    if (static_cast<int64_t>(pos.size()) != x.rows) {
      return absl::InvalidArgumentError("Rope: one position per row required");
    }
    if (col_offset < 0 || p.head_dim <= 0 ||
        col_offset + static_cast<int64_t>(n_heads) * p.head_dim > x.cols || p.head_dim % 2) {
      return absl::InvalidArgumentError("Rope: columns out of range or odd head_dim");
    }
    if (x.rows == 0 || n_heads == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(const float* inv, RopeTable(p));
    ASSIGN_OR_RETURN(auto d, Stage({{pos.data(), pos.size_bytes()}}));
    const kernels::RopeArgs r{inv, p.head_dim, p.layout == RopeLayout::kHalves};
    const auto* dp = static_cast<const int32_t*>(d[0]);
    return Run("Rope", [=, this] {
      return kernels::Rope(B(x) + col_offset, x.cols, x.rows, n_heads, dp, r, stream_);
    }, x.data, x.rows, x.cols, col_offset, n_heads, dp, inv, r.head_dim, r.halves);
  }

  absl::Status CheckLayer(const KvPool& pool, int layer) {
    if (layer < 0 || layer >= pool.num_layers || layer >= static_cast<int>(pool.k.size())) {
      return absl::OutOfRangeError(absl::StrCat("KV layer ", layer, " outside pool of ",
                                                pool.num_layers));
    }
    return absl::OkStatus();
  }
  kernels::KvPoolView View(const KvPool& pool, int layer) {
    kernels::KvPoolView v;
    v.k = B(pool.k[layer]);
    v.v = B(pool.v[layer]);
    v.num_slots = static_cast<int64_t>(pool.num_blocks) * pool.block_size;
    v.kv_dim = pool.kv_dim;
    return v;
  }

  absl::Status WriteKv(KvPool& pool, int layer, const Tensor& k_src, int64_t k_col,
                       const Tensor& v_src, int64_t v_col,
                       std::span<const int32_t> slots) override {
    RETURN_IF_ERROR(CheckLayer(pool, layer));
    RETURN_IF_ERROR(CheckBf16(k_src, "WriteKv k"));
    RETURN_IF_ERROR(CheckBf16(v_src, "WriteKv v"));
    RETURN_IF_ERROR(ValidateSlots(pool, slots));
    const int64_t n = static_cast<int64_t>(slots.size());
    if (k_src.rows < n || v_src.rows < n || k_col < 0 || v_col < 0 ||
        k_col + pool.kv_dim > k_src.cols || v_col + pool.kv_dim > v_src.cols) {
      return absl::InvalidArgumentError("WriteKv: source rows/columns out of range");
    }
    if (n == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto d, Stage({{slots.data(), slots.size_bytes()}}));
    const auto* ds = static_cast<const int32_t*>(d[0]);
    const kernels::KvPoolView view = View(pool, layer);
    return Run("WriteKv", [=, this] {
      return kernels::WriteKv(view, B(k_src) + k_col, k_src.cols, B(v_src) + v_col, v_src.cols,
                              ds, n, stream_);
    }, view.k, view.v, view.num_slots, view.kv_dim, k_src.data, k_src.cols, k_col, v_src.data,
               v_src.cols, v_col, ds, n);
  }

  absl::Status AssembleKv(KvPool& pool, int layer, const Tensor& k_pre, const Tensor& v,
                          int64_t row0, std::span<const int32_t> pos,
                          std::span<const int32_t> slots, const RopeParams& rope) override {
    RETURN_IF_ERROR(CheckLayer(pool, layer));
    RETURN_IF_ERROR(CheckBf16(k_pre, "AssembleKv k"));
    RETURN_IF_ERROR(CheckBf16(v, "AssembleKv v"));
    RETURN_IF_ERROR(ValidateSlots(pool, slots));
    const int64_t n = static_cast<int64_t>(pos.size());
    if (static_cast<int64_t>(slots.size()) != n) {
      return absl::InvalidArgumentError("AssembleKv: one slot per position required");
    }
    if (k_pre.cols != pool.kv_dim || v.cols != pool.kv_dim || row0 < 0 ||
        row0 + n > k_pre.rows || row0 + n > v.rows) {
      return absl::OutOfRangeError("AssembleKv: source rows/columns out of range");
    }
    if (rope.head_dim <= 0 || rope.head_dim % 2 || pool.kv_dim % rope.head_dim) {
      return absl::InvalidArgumentError("AssembleKv: kv_dim is not a multiple of head_dim");
    }
    if (n == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(const float* inv, RopeTable(rope));
    ASSIGN_OR_RETURN(auto d, Stage({{pos.data(), pos.size_bytes()},
                                    {slots.data(), slots.size_bytes()}}));
    const kernels::RopeArgs r{inv, rope.head_dim, rope.layout == RopeLayout::kHalves};
    const auto* dp = static_cast<const int32_t*>(d[0]);
    const auto* ds = static_cast<const int32_t*>(d[1]);
    const kernels::KvPoolView view = View(pool, layer);
    const int heads = pool.kv_dim / rope.head_dim;
    return Run("AssembleKv", [=, this] {
      return kernels::AssembleKv(view, B(k_pre) + row0 * k_pre.cols, k_pre.cols,
                                 B(v) + row0 * v.cols, v.cols, dp, ds, n, heads, r, stream_);
    }, view.k, view.v, view.num_slots, view.kv_dim, k_pre.data, k_pre.cols, v.data, v.cols, row0,
               dp, ds, n, heads, inv, r.head_dim, r.halves);
  }

  absl::Status RowSqDist(const Tensor& a, int64_t a_col, const Tensor& b, int64_t b_col,
                         int64_t n_cols, std::span<float> out) override {
    RETURN_IF_ERROR(FlushGraph());
    RETURN_IF_ERROR(CheckBf16(a, "RowSqDist a"));
    RETURN_IF_ERROR(CheckBf16(b, "RowSqDist b"));
    if (a.rows != b.rows || static_cast<int64_t>(out.size()) != a.rows || a_col < 0 ||
        b_col < 0 || n_cols < 0 || a_col + n_cols > a.cols || b_col + n_cols > b.cols) {
      return absl::InvalidArgumentError("RowSqDist: shapes do not match");
    }
    if (a.rows == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(void* tmp, f32_scratch_.Get(out.size_bytes(), stream_));
    float* dev = static_cast<float*>(tmp);
    CUDA_RETURN(kernels::RowSqDist(B(a) + a_col, a.cols, B(b) + b_col, b.cols, a.rows, n_cols,
                                   dev, stream_),
                "RowSqDist");
    std::vector<float> host(out.size());
    CUDA_RETURN(cudaMemcpyAsync(host.data(), dev, out.size_bytes(), cudaMemcpyDeviceToHost,
                                stream_),
                "RowSqDist copy");
    CUDA_RETURN(cudaStreamSynchronize(stream_), "RowSqDist sync");
    for (size_t i = 0; i < out.size(); ++i) out[i] += host[i];
    return absl::OkStatus();
  }

  absl::Status ReadKv(const KvPool& pool, int layer, std::span<const int32_t> slots,
                      std::span<float> k_host, std::span<float> v_host) override {
    RETURN_IF_ERROR(FlushGraph());
    RETURN_IF_ERROR(CheckLayer(pool, layer));
    RETURN_IF_ERROR(ValidateSlots(pool, slots));
    const int64_t n = static_cast<int64_t>(slots.size()), d = pool.kv_dim;
    if (k_host.size() != static_cast<size_t>(n * d) || v_host.size() != static_cast<size_t>(n * d)) {
      return absl::InvalidArgumentError("ReadKv: host buffers must hold slots * kv_dim floats");
    }
    if (n == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto dp, Stage({{slots.data(), slots.size_bytes()}}));
    const int32_t* ds = static_cast<const int32_t*>(dp[0]);
    // [n*d bf16 rows | n*d fp32] for each of K and V, in one scratch allocation.
    const size_t rows_bytes = (static_cast<size_t>(n * d) * 2 + 15) / 16 * 16;
    ASSIGN_OR_RETURN(void* tmp, f32_scratch_.Get(2 * (rows_bytes + n * d * 4), stream_));
    const int64_t num_slots = static_cast<int64_t>(pool.num_blocks) * pool.block_size;
    char* base = static_cast<char*>(tmp);
    for (int which = 0; which < 2; ++which) {
      const Tensor& src = which == 0 ? pool.k[layer] : pool.v[layer];
      bf16* rows = reinterpret_cast<bf16*>(base + which * (rows_bytes + n * d * 4));
      float* f = reinterpret_cast<float*>(reinterpret_cast<char*>(rows) + rows_bytes);
      CUDA_RETURN(kernels::GatherRows(B(src), d, num_slots, ds, rows, d, n, d, stream_),
                  "ReadKv gather");
      CUDA_RETURN(kernels::Bf16ToF32(rows, f, n * d, stream_), "ReadKv convert");
      float* host = which == 0 ? k_host.data() : v_host.data();
      CUDA_RETURN(cudaMemcpyAsync(host, f, n * d * 4, cudaMemcpyDeviceToHost, stream_),
                  "ReadKv copy");
    }
    CUDA_RETURN(cudaStreamSynchronize(stream_), "ReadKv sync");
    return absl::OkStatus();
  }

  absl::Status Attention(const Tensor& q, const KvPool& pool, int layer,
                         const AttentionArgs& a, Tensor& out) override {
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
    if (!stats && !recording_ && DenseForCudnn(q, a, n, ctx, hd)) {
      absl::Status s = CudnnDense(q, pool, layer, a, out);
      if (s.ok() || cudnn_mode_ == 2) return s;
      if (!cudnn_fallback_logged_) {
        cudnn_fallback_logged_ = true;
        std::fprintf(stderr, "cuda backend: cuDNN attention unavailable, own kernel used: %s\n",
                     std::string(s.message()).c_str());
      }
    }
    if (stats) RETURN_IF_ERROR(FlushGraph());  // the statistics come back to the host

    std::vector<HostSpan> spans = {{a.q_pos.data(), a.q_pos.size_bytes()},
                                   {a.ctx_slots.data(), a.ctx_slots.size_bytes()}};
    if (want_cross) {
      spans.push_back({a.key_group.data(), a.key_group.size_bytes()});
      spans.push_back({a.q_group.data(), a.q_group.size_bytes()});
    }
    if (want_recv) spans.push_back({a.recv_weight.data(), a.recv_weight.size_bytes()});
    ASSIGN_OR_RETURN(auto d, Stage(spans));

    kernels::PagedAttentionParams p;
    p.q = B(q);
    p.q_stride = q.cols;
    p.out = B(out);
    p.out_stride = out.cols;
    p.q_pos = static_cast<const int32_t*>(d[0]);
    p.num_q = static_cast<int>(n);
    p.k_pool = B(pool.k[layer]);
    p.v_pool = B(pool.v[layer]);
    p.kv_stride = pool.kv_dim;
    p.ctx_slots = static_cast<const int32_t*>(d[1]);
    p.ctx_len = static_cast<int>(ctx);
    p.n_heads = H;
    p.n_kv_heads = KV;
    p.head_dim = hd;
    p.scale = a.scale > 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(hd));
    p.warps = attn_warps_;
    p.impl = attn_impl_;

    // Workspace: [split-K partials | lse (n*H) | cross (n) | recv (ctx)], 256-byte aligned parts.
    auto align = [](size_t b) { return (b + 255) / 256 * 256; };
    const size_t split_bytes = align(kernels::PagedAttentionWorkspaceBytes(p));
    const size_t lse_bytes = stats ? align(static_cast<size_t>(n) * H * 4) : 0;
    const size_t cross_bytes = want_cross ? align(static_cast<size_t>(n) * 4) : 0;
    const size_t recv_bytes = want_recv ? align(static_cast<size_t>(ctx) * 4) : 0;
    ASSIGN_OR_RETURN(void* ws, Workspace(attn_scratch_, split_bytes + lse_bytes + cross_bytes +
                                                            recv_bytes + 256));
    char* wp = static_cast<char*>(ws);
    float* lse = stats ? reinterpret_cast<float*>(wp + split_bytes) : nullptr;
    float* cross = want_cross ? reinterpret_cast<float*>(wp + split_bytes + lse_bytes) : nullptr;
    float* recv =
        want_recv ? reinterpret_cast<float*>(wp + split_bytes + lse_bytes + cross_bytes) : nullptr;
    p.lse = lse;
    // The cross mass rides in the attention pass (online softmax); only the received attention
    // needs the second pass, and only over the rows that carry a weight.
    if (want_cross) {
      p.key_group = static_cast<const int32_t*>(d[2]);
      p.q_group = static_cast<const int32_t*>(d[3]);
      p.out_cross = cross;
      CUDA_RETURN(cudaMemsetAsync(cross, 0, n * 4, stream_), "Attention stats clear");
    }
    void* split_ws = split_bytes ? ws : nullptr;
    if (!stats) {
      return Run("Attention", [=, this] {
        return kernels::PagedAttention(p, split_ws, split_bytes, stream_);
      }, p, split_ws, split_bytes);
    }
    CUDA_RETURN(kernels::PagedAttention(p, split_ws, split_bytes, stream_), "Attention");

    if (want_recv) {
      kernels::AttentionStatsParams s;
      s.recv_weight = static_cast<const float*>(d[want_cross ? 4 : 2]);
      s.out_recv = recv;
      CUDA_RETURN(cudaMemsetAsync(recv, 0, ctx * 4, stream_), "Attention stats clear");
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

  // Whether this call is dense causal attention cuDNN can take: consecutive query positions
  // ending at the last key (a prefill from position 0, or a chunk after earlier ones), long
  // enough, aligned rows and a head size its fused engine supports.
  bool DenseForCudnn(const Tensor& q, const AttentionArgs& a, int64_t n, int64_t ctx, int hd) {
    if (cudnn_mode_ == 0 || n < cudnn_min_tokens_ || (hd != 64 && hd != 128)) return false;
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
  absl::Status CudnnDense(const Tensor& q, const KvPool& pool, int layer, const AttentionArgs& a,
                          Tensor& out) {
    if (!cudnn_) {
      if (!cudnn_status_.ok()) return cudnn_status_;
      auto c = CudnnAttention::Create(stream_);
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
    const int64_t built = cudnn_->plans_built();
    const double ms = cudnn_->plan_build_ms();
    RETURN_IF_ERROR(cudnn_->Run(sh, q.data, k, v, out.data));
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
  absl::Status AttentionBatched(const Tensor& q, const KvPool& pool, int layer,
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
    if (recording_) {
      checked = StagedInScope(spans, domain);
    } else {
      key = StageKey(spans, domain);
      checked = StageHas(key);
    }
    RETURN_IF_ERROR(ValidateAttention(q, pool, a, out, /*check_slots=*/!checked));
    if (!kernels::PagedAttentionSupported(a.head_dim, a.n_heads, a.n_kv_heads)) {
      return absl::UnimplementedError("Attention: unsupported head_dim for batched sequences");
    }
    kernels::PagedAttentionParams p;
    p.q = B(q);
    p.q_stride = q.cols;
    p.out = B(out);
    p.out_stride = out.cols;
    p.num_q = static_cast<int>(n);
    p.k_pool = B(pool.k[layer]);
    p.v_pool = B(pool.v[layer]);
    p.kv_stride = pool.kv_dim;
    p.n_heads = a.n_heads;
    p.n_kv_heads = a.n_kv_heads;
    p.head_dim = a.head_dim;
    p.scale = a.scale > 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
    p.warps = attn_warps_;
    p.impl = attn_impl_;
    int64_t max_rows = 0;
    for (const SeqRows& sq : a.seqs) max_rows = std::max(max_rows, sq.row_end - sq.row_begin);
    if (max_rows > kernels::PagedAttentionMaxRowsPerSeq(p)) {
      return AttentionBySequence(*this, q, pool, layer, a, out);  // validates per sequence
    }
    std::vector<void*> d;
    if (recording_) {
      ASSIGN_OR_RETURN(d, StageRecorded(spans, domain));
    } else {
      ASSIGN_OR_RETURN(d, Stage(spans, key));
    }
    p.q_pos = static_cast<const int32_t*>(d[0]);
    p.num_seqs = S;
    p.seq_rows = static_cast<const int32_t*>(d[1]);
    p.seq_ctx_start = static_cast<const int32_t*>(d[2]);
    p.seq_ctx_len = static_cast<const int32_t*>(d[3]);
    p.ctx_slots = static_cast<const int32_t*>(d[4]);
    p.ctx_len = static_cast<int>(off / 4);
    p.max_seq_ctx = max_ctx;
    if (recording_) {
      // The lengths are read on the device; the launch is planned for a bucket of context
      // lengths (key blocks past a sequence's end add nothing), so the next steps' launches are
      // the same and a captured graph replays until the bucket is outgrown.
      p.max_seq_ctx = static_cast<int>(std::max<size_t>(RoundUpPow2(max_ctx), 256));
      p.ctx_len = p.max_seq_ctx;
    }
    const size_t ws_bytes = kernels::PagedAttentionWorkspaceBytes(p);
    ASSIGN_OR_RETURN(void* ws, Workspace(attn_scratch_, ws_bytes + 256));
    void* split_ws = ws_bytes ? ws : nullptr;
    return Run("Attention (batched)", [=, this] {
      return kernels::PagedAttention(p, split_ws, ws_bytes, stream_);
    }, p, split_ws, ws_bytes);
  }

  absl::Status GatherRows(const Tensor& src, std::span<const int32_t> idx, Tensor& dst) override {
    RETURN_IF_ERROR(CheckBf16(src, "GatherRows src"));
    RETURN_IF_ERROR(CheckBf16(dst, "GatherRows dst"));
    RETURN_IF_ERROR(CheckShape(dst, static_cast<int64_t>(idx.size()), src.cols, "GatherRows"));
    for (int32_t i : idx) {
      if (i < 0 || i >= src.rows) return absl::OutOfRangeError("GatherRows index");
    }
    if (idx.empty()) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto d, Stage({{idx.data(), idx.size_bytes()}}));
    const auto* di = static_cast<const int32_t*>(d[0]);
    return Run("GatherRows", [=, this] {
      return kernels::GatherRows(B(src), src.cols, src.rows, di, B(dst), dst.cols, dst.rows,
                                 dst.cols, stream_);
    }, src.data, src.rows, src.cols, di, dst.data, dst.rows, dst.cols);
  }

  absl::Status ScatterRows(const Tensor& src, std::span<const int32_t> idx,
                           Tensor& dst) override {
    RETURN_IF_ERROR(CheckBf16(src, "ScatterRows src"));
    RETURN_IF_ERROR(CheckBf16(dst, "ScatterRows dst"));
    RETURN_IF_ERROR(CheckShape(src, static_cast<int64_t>(idx.size()), dst.cols, "ScatterRows"));
    for (int32_t i : idx) {
      if (i < 0 || i >= dst.rows) return absl::OutOfRangeError("ScatterRows index");
    }
    if (idx.empty()) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto d, Stage({{idx.data(), idx.size_bytes()}}));
    const auto* di = static_cast<const int32_t*>(d[0]);
    return Run("ScatterRows", [=, this] {
      return kernels::ScatterRows(B(src), src.cols, di, B(dst), dst.cols, dst.rows, src.rows,
                                  src.cols, stream_);
    }, src.data, src.rows, src.cols, di, dst.data, dst.rows, dst.cols);
  }

  absl::Status CopyRows(const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row,
                        int64_t n) override {
    RETURN_IF_ERROR(CheckBf16(src, "CopyRows src"));
    RETURN_IF_ERROR(CheckBf16(dst, "CopyRows dst"));
    if (src.cols != dst.cols || src_row < 0 || dst_row < 0 || n < 0 || src_row + n > src.rows ||
        dst_row + n > dst.rows) {
      return absl::OutOfRangeError("CopyRows: range outside tensors");
    }
    if (n == 0 || src.cols == 0) return absl::OkStatus();
    if (src.host || dst.host) RETURN_IF_ERROR(FlushGraph());  // host memory: never recorded
    void* to = B(dst) + dst_row * dst.cols;
    const void* from = B(src) + src_row * src.cols;
    const size_t bytes = static_cast<size_t>(n * src.cols) * 2;
    return Run("CopyRows", [=, this] {
      return cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, stream_);
    }, to, from, bytes);
  }

 private:
  // Copies host spans into the pinned ring, then with one async copy into the device scratch;
  // returns the device address of each span. The device scratch is reused by every call:
  // stream order puts each copy after the kernels that read the previous call's data. The
  // pinned ring only wraps after a stream sync, so no queued copy reads overwritten bytes.
  // The key of a Stage request: its bytes, and a domain (requests of different domains never
  // share a device copy; 0 for plain index arrays).
  static Hash128 StageKey(const std::vector<HostSpan>& spans, uint64_t domain = 0) {
    Hasher h;
    h.U64(domain);
    for (const HostSpan& s : spans) h.U64(s.bytes).Bytes(s.data, s.bytes);
    return h.Finish();
  }
  // Whether a device copy staged under `key` is still held.
  bool StageHas(const Hash128& key) const {
    for (const StageEntry& e : stage_cache_) {
      if (e.valid && e.key == key) return true;
    }
    return false;
  }
  absl::StatusOr<std::vector<void*>> Stage(const std::vector<HostSpan>& spans) {
    if (recording_) return StageRecorded(spans, 0);
    return Stage(spans, StageKey(spans));
  }
  // The same index arrays come back for every layer of a forward pass (positions, slots, slot
  // tables): a request whose key matches a recent one reuses its device copy.
  absl::StatusOr<std::vector<void*>> Stage(const std::vector<HostSpan>& spans,
                                           const Hash128& key) {
    size_t total = 0;
    for (const HostSpan& s : spans) total += (s.bytes + 15) / 16 * 16;
    total = std::max<size_t>(total, 16);
    auto pointers = [&spans](void* base) {
      std::vector<void*> out;
      size_t off = 0;
      for (const HostSpan& s : spans) {
        out.push_back(static_cast<char*>(base) + off);
        off += (s.bytes + 15) / 16 * 16;
      }
      return out;
    };
    StageEntry* victim = &stage_cache_[0];
    for (StageEntry& e : stage_cache_) {
      if (e.valid && e.key == key) {
        e.used = ++stage_tick_;
        return pointers(e.dev);
      }
      if (!e.valid || (victim->valid && e.used < victim->used)) victim = &e;
    }
    if (total > pinned_size_) {
      CUDA_RETURN(cudaStreamSynchronize(stream_), "stage: sync");
      cudaFreeHost(pinned_);
      pinned_ = nullptr;
      pinned_size_ = std::max(total, 2 * pinned_size_);
      CUDA_RETURN(cudaMallocHost(&pinned_, pinned_size_), "stage: pinned alloc");
      pinned_off_ = 0;
    } else if (pinned_off_ + total > pinned_size_) {
      CUDA_RETURN(cudaStreamSynchronize(stream_), "stage: sync");
      pinned_off_ = 0;
    }
    // Miss: the least recently used entry takes it (stream order keeps earlier readers of its
    // old contents ahead of the overwrite).
    StageEntry& e = *victim;
    e.valid = false;
    if (e.cap < total) {
      if (e.dev) cudaFreeAsync(e.dev, stream_);
      e.dev = nullptr;
      e.cap = 0;
      const size_t cap = std::max<size_t>(total, 4096);
      CUDA_RETURN(cudaMallocAsync(&e.dev, cap, stream_), "stage: alloc");
      e.cap = cap;
    }
    char* host = static_cast<char*>(pinned_) + pinned_off_;
    size_t off = 0;
    for (const HostSpan& s : spans) {
      if (s.bytes) std::memcpy(host + off, s.data, s.bytes);
      off += (s.bytes + 15) / 16 * 16;
    }
    // Copied by a kernel reading the pinned ring, not by a copy engine: Prefetch's bulk copies
    // on the other stream would otherwise hold these small ones (and the layer) behind them.
    CUDA_RETURN(kernels::CopyFromPinned(host, e.dev, off ? off : 16, stream_), "stage: copy");
    pinned_off_ += total;
    e.key = key;
    e.valid = true;
    e.used = ++stage_tick_;
    return pointers(e.dev);
  }

  // ---- recorded scopes ----
  // Inside a scope every operation validates and stages its arrays when it is called but its
  // launch is only queued (Run); the queue runs at the scope's end (FlushGraph): as a graph
  // captured before when the queue's signature (every launch's operation, buffers, shapes and
  // parameters, staged arrays by address) matches one, captured into a new graph the second
  // time a signature is seen, else launched one by one.
  template <class T>
  void SigOne(const T& v) {
    if constexpr (std::is_same_v<T, kernels::PagedAttentionParams>) {
      SigAll(v.q, v.q_stride, v.out, v.out_stride, v.q_pos, v.num_q, v.k_pool, v.v_pool,
             v.kv_stride, v.ctx_slots, v.ctx_len, v.n_heads, v.n_kv_heads, v.head_dim, v.scale,
             v.lse, v.warps, v.impl, v.key_group, v.q_group, v.out_cross, v.num_seqs, v.seq_rows,
             v.seq_ctx_start, v.seq_ctx_len, v.max_seq_ctx);
    } else {
      static_assert(std::is_arithmetic_v<T> || std::is_pointer_v<T> || std::is_enum_v<T>);
      sig_->Bytes(&v, sizeof v);
    }
  }
  template <class... A>
  void SigAll(const A&... a) {
    (SigOne(a), ...);
  }
  // Launches f now, or (recording) queues it under a signature of what it launches.
  template <class F, class... A>
  absl::Status Run(const char* what, F&& f, const A&... sig) {
    if (!recording_) {
      CUDA_RETURN(f(), what);
      return absl::OkStatus();
    }
    sig_->Str(what);
    SigAll(sig...);
    pending_.push_back({std::function<cudaError_t()>(std::forward<F>(f)), what});
    // A long scope goes out in segments of a fixed number of launches, each replayed as its
    // own graph: the device runs one segment while the host records the next.
    if (pending_.size() >= kSegmentLaunches) return FlushSegment();
    return absl::OkStatus();
  }
  // Device scratch for one operation: from the arena inside a scope (given back when the
  // scope's launches are enqueued), else the growing scratch.
  absl::StatusOr<void*> Workspace(DeviceScratch& scratch, size_t bytes) {
    if (recording_) {
      if (void* p = arena_.Take(bytes)) {
        scope_temps_.push_back(p);
        return p;
      }
      arena_want_ = std::max(arena_want_, 2 * arena_.size());
      RETURN_IF_ERROR(FlushGraph());
    }
    return scratch.Get(bytes, stream_);
  }
  // Whether arrays with these bytes were staged earlier in this scope (and so were checked).
  bool StagedInScope(const std::vector<HostSpan>& spans, uint64_t domain) {
    return FindScopeStage(spans, domain) != nullptr;
  }
  struct ScopeStage {
    uint64_t domain = 0;
    std::vector<size_t> sizes;
    const char* pinned = nullptr;  // the bytes as staged
    std::vector<void*> dev;
  };
  const ScopeStage* FindScopeStage(const std::vector<HostSpan>& spans, uint64_t domain) const {
    for (const ScopeStage& e : scope_stages_) {
      if (e.domain != domain || e.sizes.size() != spans.size()) continue;
      bool same = true;
      size_t off = 0;
      for (size_t i = 0; i < spans.size() && same; ++i) {
        same = e.sizes[i] == spans[i].bytes &&
               (spans[i].bytes == 0 || std::memcmp(e.pinned + off, spans[i].data,
                                                   spans[i].bytes) == 0);
        off += (spans[i].bytes + 15) / 16 * 16;
      }
      if (same) return &e;
    }
    return nullptr;
  }
  // Stage inside a scope: the bytes go to the scope's pinned area and a queued kernel copies
  // them to arena memory. The copy covers a power-of-two capacity, so arrays that grow from
  // step to step (slot tables) keep their launch until the capacity is outgrown. Arrays with
  // the same bytes as earlier ones in the scope share their copy.
  absl::StatusOr<std::vector<void*>> StageRecorded(const std::vector<HostSpan>& spans,
                                                   uint64_t domain) {
    if (const ScopeStage* e = FindScopeStage(spans, domain)) return e->dev;
    size_t total = 0;
    for (const HostSpan& sp : spans) total += (sp.bytes + 15) / 16 * 16;
    const size_t cap = std::max<size_t>(RoundUpPow2(total), 256);
    void* dev = graph_pinned_off_ + cap <= graph_pinned_size_ ? arena_.Take(cap) : nullptr;
    if (dev == nullptr) {
      if (graph_pinned_off_ + cap > graph_pinned_size_) {
        graph_pinned_want_ = std::max(graph_pinned_want_, 2 * (graph_pinned_off_ + cap));
      } else {
        arena_want_ = std::max(arena_want_, 2 * arena_.size());
      }
      RETURN_IF_ERROR(FlushGraph());
      return domain == 0 ? Stage(spans) : Stage(spans, StageKey(spans, domain));
    }
    scope_temps_.push_back(dev);
    char* host = static_cast<char*>(graph_pinned_) + graph_pinned_off_;
    graph_pinned_off_ += cap;
    ScopeStage e;
    e.domain = domain;
    e.pinned = host;
    size_t off = 0;
    for (const HostSpan& sp : spans) {
      if (sp.bytes) std::memcpy(host + off, sp.data, sp.bytes);
      e.sizes.push_back(sp.bytes);
      e.dev.push_back(static_cast<char*>(dev) + off);
      off += (sp.bytes + 15) / 16 * 16;
    }
    RETURN_IF_ERROR(Run("stage", [=, this] {
      return kernels::CopyFromPinned(host, dev, cap, stream_);
    }, static_cast<const void*>(host), dev, cap));
    scope_stages_.push_back(std::move(e));
    return scope_stages_.back().dev;
  }

 public:
  absl::Status BeginGraph() override {
    RETURN_IF_ERROR(FlushGraph());
    if (!graphs_enabled_) return absl::OkStatus();
    // The pinned area is rewritten below: the last launch must have read it.
    CUDA_RETURN(cudaEventSynchronize(graph_done_), "graph: wait");
    if (arena_.live() == 0 && arena_.size() < arena_want_) {
      CUDA_RETURN(cudaStreamSynchronize(stream_), "graph arena: sync");
      RETURN_IF_ERROR(arena_.Reserve(arena_want_));
    }
    if (graph_pinned_size_ < graph_pinned_want_) {
      if (graph_pinned_) cudaFreeHost(graph_pinned_);
      graph_pinned_ = nullptr;
      graph_pinned_size_ = 0;
      CUDA_RETURN(cudaMallocHost(&graph_pinned_, graph_pinned_want_), "graph pinned alloc");
      graph_pinned_size_ = graph_pinned_want_;
    }
    graph_pinned_off_ = 0;
    sig_ = std::make_unique<Hasher>();
    recording_ = true;
    scope_replayed_ = true;
    return absl::OkStatus();
  }
  absl::Status EndGraph() override {
    absl::Status s = FlushGraph();
    if (s.ok()) s = kept_error_;
    kept_error_ = absl::OkStatus();
    return s;
  }
  GraphStats graph_stats() const override { return gstats_; }

 private:
  void KeepError(absl::Status s) {
    if (!s.ok() && kept_error_.ok()) kept_error_ = std::move(s);
  }
  // Ends the recording scope: enqueues its queued launches (see above) and gives its arena
  // memory back.
  absl::Status FlushGraph() {
    if (!recording_) return absl::OkStatus();
    absl::Status st = FlushSegment();
    recording_ = false;
    scope_stages_.clear();
    ++gstats_.scopes;
    if (st.ok() && scope_replayed_) ++gstats_.replayed;
    for (void* p : scope_temps_) arena_.Give(p);
    scope_temps_.clear();
    if (cudaError_t e = cudaEventRecord(graph_done_, stream_); e != cudaSuccess && st.ok()) {
      st = CudaError(e, "graph: record");
    }
    return st;
  }
  // Enqueues the launches queued since the last segment: a graph replayed, a new graph
  // captured, or one launch each.
  absl::Status FlushSegment() {
    if (pending_.empty()) return absl::OkStatus();
    const Hash128 sig = sig_->Finish();
    sig_ = std::make_unique<Hasher>();
    std::vector<Pending> work = std::move(pending_);
    pending_.clear();
    auto run_all = [&]() -> absl::Status {
      for (Pending& w : work) CUDA_RETURN(w.launch(), w.what);
      return absl::OkStatus();
    };
    absl::Status st;
    GraphEntry* hit = nullptr;
    for (GraphEntry& g : graphs_) {
      if (g.sig == sig) hit = &g;
    }
    scope_replayed_ = scope_replayed_ && hit != nullptr;
    if (hit != nullptr) {
      hit->used = ++graph_tick_;
      ++gstats_.graph_launches;
      cudaError_t e = cudaGraphLaunch(hit->exec, stream_);
      st = e == cudaSuccess ? absl::OkStatus() : CudaError(e, "graph launch");
    } else if (Seen(sig) >= 2) {
      st = Capture(sig, run_all);
    } else {
      st = run_all();
    }
    return st;
  }
  // How often this signature ended a scope (counting this time).
  int Seen(const Hash128& sig) {
    for (auto& [h, n] : seen_) {
      if (h == sig) return ++n;
    }
    if (seen_.size() >= 4 * kMaxGraphs) seen_.erase(seen_.begin());
    seen_.emplace_back(sig, 1);
    return 1;
  }
  absl::Status Capture(const Hash128& sig, const std::function<absl::Status()>& run_all) {
    CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                "graph: begin capture");
    absl::Status st = run_all();
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(stream_, &graph);
    if (st.ok() && e != cudaSuccess) st = CudaError(e, "graph: end capture");
    cudaGraphExec_t exec = nullptr;
    if (st.ok()) {
      e = cudaGraphInstantiate(&exec, graph, 0);
      if (e != cudaSuccess) st = CudaError(e, "graph: instantiate");
    }
    if (graph) cudaGraphDestroy(graph);
    if (!st.ok()) {
      // Nothing ran: launch the queue one by one, and never try this signature again.
      cudaGetLastError();
      for (auto& [h, n] : seen_) {
        if (h == sig) n = std::numeric_limits<int>::min() / 2;
      }
      return run_all();
    }
    if (graphs_.size() >= kMaxGraphs) {
      auto lru = std::min_element(graphs_.begin(), graphs_.end(),
                                  [](const GraphEntry& a, const GraphEntry& b) {
                                    return a.used < b.used;
                                  });
      CUDA_RETURN(cudaStreamSynchronize(stream_), "graph: sync");  // may still run
      cudaGraphExecDestroy(lru->exec);
      graphs_.erase(lru);
    }
    graphs_.push_back({sig, exec, ++graph_tick_});
    ++gstats_.captured;
    ++gstats_.graph_launches;
    CUDA_RETURN(cudaGraphLaunch(exec, stream_), "graph launch");
    return absl::OkStatus();
  }

  absl::StatusOr<const float*> RopeTable(const RopeParams& p) {
    const auto key = std::make_tuple(p.head_dim, p.theta, static_cast<int>(p.scaling.type),
                                     p.scaling.factor, p.scaling.low_freq_factor,
                                     p.scaling.high_freq_factor, p.scaling.original_max_position);
    auto it = rope_tables_.find(key);
    if (it != rope_tables_.end()) return it->second;
    const std::vector<float> inv = RopeInvFreq(p);
    float* dptr = nullptr;
    CUDA_RETURN(cudaMalloc(&dptr, inv.size() * 4), "rope table alloc");
    CUDA_RETURN(cudaMemcpy(dptr, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice),
                "rope table copy");
    rope_tables_.emplace(key, dptr);
    return dptr;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;  // Prefetch copies, beside the compute stream
  // Recently staged index arrays and their device copies (Stage), least recently used replaced.
  struct StageEntry {
    Hash128 key;
    void* dev = nullptr;
    size_t cap = 0;
    uint64_t used = 0;
    bool valid = false;
  };
  std::array<StageEntry, 16> stage_cache_;
  uint64_t stage_tick_ = 0;
  std::map<int64_t, cudaEvent_t> tickets_;
  int64_t last_ticket_ = 0;
  kernels::LtGemm gemm_;
  DeviceScratch f32_scratch_, attn_scratch_;
  // Dense prefill attention through cuDNN (created on first use; see DenseForCudnn).
  std::unique_ptr<CudnnAttention> cudnn_;
  absl::Status cudnn_status_;  // why cuDNN could not be loaded (then not retried)
  int cudnn_mode_ = 1;         // 0 off, 1 when available, 2 required
  int64_t cudnn_min_tokens_ = 16384;
  bool cudnn_fallback_logged_ = false;
  DeviceScratch cudnn_kv_;  // gathered K and V when a sequence's slots are not consecutive
  bool use_small_n_gemm_ = true;
  bool fused_residual_ = false;
  int attn_impl_ = 0;
  int attn_warps_ = 0;
  void* pinned_ = nullptr;
  size_t pinned_size_ = 0, pinned_off_ = 0;
  // Recorded scopes (BeginGraph).
  // Graphs kept (least recently used replaced); launches per segment of a scope.
  static constexpr size_t kMaxGraphs = 256;
  static constexpr size_t kSegmentLaunches = 64;
  struct Pending {
    std::function<cudaError_t()> launch;
    const char* what;
  };
  struct GraphEntry {
    Hash128 sig;
    cudaGraphExec_t exec = nullptr;
    uint64_t used = 0;
  };
  bool graphs_enabled_ = true;
  bool recording_ = false;
  bool scope_replayed_ = false;  // every segment of this scope so far was a replay
  std::unique_ptr<Hasher> sig_;
  std::vector<Pending> pending_;
  std::vector<ScopeStage> scope_stages_;
  std::vector<void*> scope_temps_;  // arena memory given back at the scope's end
  GraphArena arena_;
  size_t arena_want_ = 64u << 20;
  void* graph_pinned_ = nullptr;
  size_t graph_pinned_size_ = 0, graph_pinned_off_ = 0, graph_pinned_want_ = 4u << 20;
  cudaEvent_t graph_done_ = nullptr;
  std::vector<GraphEntry> graphs_;
  std::vector<std::pair<Hash128, int>> seen_;
  uint64_t graph_tick_ = 0;
  GraphStats gstats_;
  absl::Status kept_error_;
  std::map<std::tuple<int, float, int, float, float, float, int>, float*> rope_tables_;
};

}  // namespace

bool CudaAvailable() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ",
                                               e == cudaSuccess ? "none found"
                                                                : cudaGetErrorString(e)));
  }
  if (device < 0 || device >= n) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " not in [0, ", n,
                                                   ")"));
  }
  auto be = std::make_unique<CudaBackend>(device);
  RETURN_IF_ERROR(be->Init());
  return std::unique_ptr<Backend>(std::move(be));
}

cudaStream_t CudaBackendStream(Backend& backend) {
  auto* cb = dynamic_cast<CudaBackend*>(&backend);
  return cb ? cb->stream() : nullptr;
}

}  // namespace sparsex
