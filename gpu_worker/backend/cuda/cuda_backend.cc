// CUDA backend: bf16 storage, fp32 accumulation, one stream per backend. This file holds its
// setup, memory and weights, and the op adapters: operations validate their arguments on the
// host exactly as the CPU reference does, stage host index spans (positions, slots, ids) through
// the IndexStager (index_stager.h) and launch the kernels of kernels/ on the stream, or queue
// them inside a recorded scope (graph_recorder.h); only Download, ReadKv, Attention with
// selection statistics and Synchronize wait for the device. Which attention kernel serves a
// call is attention_dispatch.cc's; the class is declared in cuda_backend_internal.h. Kernel
// choices come from CudaBackendOptions only (backend.h), never from the environment.
#include "gpu_worker/backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "common/thread_pool.h"
#include "gpu_worker/backend/cuda/cuda_backend_internal.h"
#include "gpu_worker/backend/rope.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/rope.h"

namespace sparsex {
namespace cuda_internal {

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  cudnn_.reset();  // its handle is bound to stream_
  recorder_.Release();
  for (auto& [k, p] : rope_tables_) cudaFree(p);
  stager_.Release();
  for (auto& [t, ev] : tickets_) cudaEventDestroy(ev);
  FreePinnedChunks(chunks_);
  FreePinnedChunks(async_chunks_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::Init() {
  if (options_.small_n_variant < -1 || options_.small_n_variant >= kernels::kSmallNGemmVariants) {
    return absl::InvalidArgumentError(absl::StrCat("small_n_variant ", options_.small_n_variant,
                                                   ": not -1 (auto) or a kernel variant"));
  }
  if (options_.sm90_gemm_swiglu_variant < 0 ||
      options_.sm90_gemm_swiglu_variant >= kernels::kSm90GemmSwiGluVariants) {
    return absl::InvalidArgumentError(absl::StrCat("sm90_gemm_swiglu_variant ",
                                                   options_.sm90_gemm_swiglu_variant,
                                                   ": not a kernel variant (0-1)"));
  }
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
  RETURN_IF_ERROR(stager_.Init(stream_));
  RETURN_IF_ERROR(recorder_.Init(stream_, options_.cuda_graphs, options_.graph_first_segment));
  return absl::OkStatus();
}

// ---- memory ----
absl::StatusOr<Tensor> CudaBackend::Alloc(int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) return absl::InvalidArgumentError("negative tensor shape");
  Tensor t{nullptr, DType::kBF16, rows, cols};
  const size_t bytes = std::max<size_t>(t.bytes(), 16);
  // Inside a recorded scope: arena memory (none left: the scope ends, and plain memory).
  ASSIGN_OR_RETURN(t.data, recorder_.TakeTensor(bytes));
  if (t.data != nullptr) return t;
  cudaError_t e = cudaMallocAsync(&t.data, bytes, stream_);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes,
                                                     " bytes on the GPU: ",
                                                     cudaGetErrorString(e)));
  }
  return t;
}

void CudaBackend::Free(Tensor& t) {
  if (recorder_.InArena(t.data)) {
    recorder_.GiveTensor(t.data);  // later users are enqueued after this tensor's last reader
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

absl::StatusOr<Tensor> CudaBackend::AllocHost(int64_t rows, int64_t cols) {
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

absl::StatusOr<int64_t> CudaBackend::Prefetch(const Tensor& src, Tensor& dst) {
  RETURN_IF_ERROR(FlushGraph());
  RETURN_IF_ERROR(CheckBf16(src, "Prefetch src"));
  RETURN_IF_ERROR(CheckBf16(dst, "Prefetch dst"));
  RETURN_IF_ERROR(CheckShape(dst, src.rows, src.cols, "Prefetch"));
  // The copy starts after what the compute stream has queued so far (dst's stream-ordered
  // allocation included) and runs beside what is queued later.
  cudaEvent_t ready = nullptr;
  CUDA_RETURN(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "Prefetch event");
  CUDA_RETURN(cudaEventRecord(ready, stream_), "Prefetch record");
  CUDA_RETURN(cudaStreamWaitEvent(copy_stream_, ready, 0), "Prefetch wait");
  cudaEventDestroy(ready);
  if (!src.empty()) {
    CUDA_RETURN(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDefault,
                                copy_stream_),
                "Prefetch copy");
  }
  return CopyStreamTicket();
}

absl::StatusOr<int64_t> CudaBackend::CopyStreamTicket() {
  cudaEvent_t done = nullptr;
  CUDA_RETURN(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "copy ticket event");
  CUDA_RETURN(cudaEventRecord(done, copy_stream_), "copy ticket record");
  tickets_.emplace(++last_ticket_, done);
  return last_ticket_;
}

absl::Status CudaBackend::Await(int64_t ticket) {
  RETURN_IF_ERROR(FlushGraph());
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return absl::OkStatus();  // already awaited
  cudaError_t e = cudaStreamWaitEvent(stream_, it->second, 0);
  cudaEventDestroy(it->second);  // released once the wait is satisfied
  tickets_.erase(it);
  CUDA_RETURN(e, "Await");
  return absl::OkStatus();
}

absl::Status CudaBackend::Upload(std::span<const float> host, Tensor& dst) {
  RETURN_IF_ERROR(FlushGraph());
  RETURN_IF_ERROR(CheckBf16(dst, "Upload"));
  if (host.size() != static_cast<size_t>(dst.rows * dst.cols)) {
    return absl::InvalidArgumentError("Upload: size mismatch");
  }
  if (host.empty()) return absl::OkStatus();
  if (dst.host) {
    bf16* d = B(dst);
    ParallelFor(static_cast<int64_t>(host.size()), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) d[i] = __float2bfloat16_rn(host[i]);
    }, int64_t{1} << 18);
    return absl::OkStatus();
  }
  if (static_cast<int64_t>(host.size()) >= kUploadChunk / 4) {
    return UploadViaPinned(chunks_, stream_, static_cast<int64_t>(host.size()), B(dst),
                           [&](bf16* buf, int64_t off, int64_t m) {
                             const float* src = host.data() + off;
                             ParallelFor(m, [&](int64_t lo, int64_t hi) {
                               for (int64_t i = lo; i < hi; ++i) {
                                 buf[i] = __float2bfloat16_rn(src[i]);
                               }
                             }, int64_t{1} << 18);
                           });
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

absl::Status CudaBackend::EnsurePinnedChunks(PinnedChunks& c) {
  for (int b = 0; b < 2; ++b) {
    if (c.buf[b] != nullptr) continue;
    CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&c.buf[b]), kUploadChunk * sizeof(bf16),
                              cudaHostAllocDefault),
                "Upload staging");
    CUDA_RETURN(cudaEventCreateWithFlags(&c.done[b], cudaEventDisableTiming), "Upload event");
  }
  return absl::OkStatus();
}

void CudaBackend::FreePinnedChunks(PinnedChunks& c) {
  for (int b = 0; b < 2; ++b) {
    if (c.done[b]) cudaEventDestroy(c.done[b]);
    if (c.buf[b]) cudaFreeHost(c.buf[b]);
  }
  c = PinnedChunks{};
}

absl::Status CudaBackend::DownloadViaPinned(const bf16* src, std::span<float> host) {
  PinnedChunks& c = chunks_;
  RETURN_IF_ERROR(EnsurePinnedChunks(c));
  const int64_t n = static_cast<int64_t>(host.size());
  // Chunk k is widened while chunk k + 1 copies.
  auto widen = [&](int b, int64_t off, int64_t m) -> absl::Status {
    CUDA_RETURN(cudaEventSynchronize(c.done[b]), "Download wait");
    c.pending[b] = false;
    const bf16* buf = c.buf[b];
    float* out = host.data() + off;
    // A decode step's logits: on the pool only when it is free (inline rather than behind a
    // cluster fetch's decode of a round, which would hold the step for that round).
    ParallelForIfIdle(m, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) out[i] = __bfloat162float(buf[i]);
    }, int64_t{1} << 18);
    return absl::OkStatus();
  };
  int prev_b = -1;
  int64_t prev_off = 0, prev_m = 0;
  for (int64_t off = 0, k = 0; off < n; off += kUploadChunk, ++k) {
    const int b = static_cast<int>(k & 1);
    if (c.pending[b]) {  // an upload's copy out of this chunk, or an unread download
      CUDA_RETURN(cudaEventSynchronize(c.done[b]), "Download wait");
      c.pending[b] = false;
    }
    const int64_t m = std::min(kUploadChunk, n - off);
    CUDA_RETURN(cudaMemcpyAsync(c.buf[b], src + off, m * sizeof(bf16),
                                cudaMemcpyDeviceToHost, stream_),
                "Download copy");
    CUDA_RETURN(cudaEventRecord(c.done[b], stream_), "Download record");
    c.pending[b] = true;
    if (prev_b >= 0) RETURN_IF_ERROR(widen(prev_b, prev_off, prev_m));
    prev_b = b;
    prev_off = off;
    prev_m = m;
  }
  if (prev_b >= 0) RETURN_IF_ERROR(widen(prev_b, prev_off, prev_m));
  return absl::OkStatus();
}

namespace {
// Whether p lies in page-locked host memory (cudaHostAlloc'd or registered), which a copy
// engine reads directly.
bool IsPinnedHost(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // pageable memory on older runtimes: not an error to keep
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

// UploadViaPinned's fill for bf16 host data: copied as it is, on host threads.
std::function<void(bf16*, int64_t, int64_t)> CopyBf16Fill(std::span<const uint16_t> host) {
  return [host](bf16* buf, int64_t off, int64_t m) {
    auto* b16 = reinterpret_cast<uint16_t*>(buf);
    const uint16_t* src = host.data() + off;
    ParallelFor(m, [&](int64_t lo, int64_t hi) {
      std::memcpy(b16 + lo, src + lo, static_cast<size_t>(hi - lo) * sizeof(uint16_t));
    }, int64_t{1} << 19);
  };
}
}  // namespace

// bf16 as it is: into a pinned tensor by host threads, else through the two pinned chunks (a
// chunk refilled while the other copies) to the device.
absl::Status CudaBackend::UploadBf16(std::span<const uint16_t> host, Tensor& dst) {
  RETURN_IF_ERROR(FlushGraph());
  RETURN_IF_ERROR(CheckBf16(dst, "UploadBf16"));
  if (host.size() != static_cast<size_t>(dst.rows * dst.cols)) {
    return absl::InvalidArgumentError("UploadBf16: size mismatch");
  }
  const int64_t n = static_cast<int64_t>(host.size());
  if (n == 0) return absl::OkStatus();
  if (dst.host) {
    auto* d = static_cast<uint16_t*>(dst.data);
    ParallelFor(n, [&](int64_t lo, int64_t hi) {
      std::memcpy(d + lo, host.data() + lo, static_cast<size_t>(hi - lo) * sizeof(uint16_t));
    }, int64_t{1} << 19);
    return absl::OkStatus();
  }
  if (options_.upload_direct) {
    CUDA_RETURN(cudaMemcpyAsync(B(dst), host.data(), host.size_bytes(), cudaMemcpyHostToDevice,
                                stream_),
                "UploadBf16 direct copy");
    return absl::OkStatus();
  }
  return UploadViaPinned(chunks_, stream_, n, B(dst), CopyBf16Fill(host));
}

absl::StatusOr<int64_t> CudaBackend::UploadBf16Async(std::span<const uint16_t> host,
                                                      Tensor& dst) {
  RETURN_IF_ERROR(FlushGraph());
  RETURN_IF_ERROR(CheckBf16(dst, "UploadBf16Async"));
  if (host.size() != static_cast<size_t>(dst.rows * dst.cols)) {
    return absl::InvalidArgumentError("UploadBf16Async: size mismatch");
  }
  if (dst.host || host.empty()) {
    RETURN_IF_ERROR(UploadBf16(host, dst));
    return int64_t{0};
  }
  if (IsPinnedHost(host.data())) {
    // Pinned memory (a streamed fetch's block): the DMA reads it directly, no host staging
    // copy; the caller keeps it unchanged until the work after Await has run (the contract).
    CUDA_RETURN(cudaMemcpyAsync(B(dst), host.data(), host.size_bytes(), cudaMemcpyHostToDevice,
                                copy_stream_),
                "UploadBf16Async direct copy");
    return CopyStreamTicket();
  }
  // Its own chunks on the copy stream: a refill never waits for the compute stream.
  RETURN_IF_ERROR(UploadViaPinned(async_chunks_, copy_stream_, static_cast<int64_t>(host.size()),
                                  B(dst), CopyBf16Fill(host)));
  return CopyStreamTicket();
}

absl::Status CudaBackend::UploadViaPinned(
    PinnedChunks& c, cudaStream_t stream, int64_t n, bf16* dst,
    const std::function<void(bf16* buf, int64_t off, int64_t m)>& fill) {
  RETURN_IF_ERROR(EnsurePinnedChunks(c));
  for (int64_t off = 0, k = 0; off < n; off += kUploadChunk, ++k) {
    const int b = static_cast<int>(k & 1);
    if (c.pending[b]) {  // the copy out of this chunk must be done before it is refilled
      CUDA_RETURN(cudaEventSynchronize(c.done[b]), "Upload wait");
      c.pending[b] = false;
    }
    const int64_t m = std::min(kUploadChunk, n - off);
    fill(c.buf[b], off, m);
    CUDA_RETURN(cudaMemcpyAsync(dst + off, c.buf[b], m * sizeof(bf16), cudaMemcpyHostToDevice,
                                stream),
                "Upload copy");
    CUDA_RETURN(cudaEventRecord(c.done[b], stream), "Upload record");
    c.pending[b] = true;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Download(const Tensor& src, std::span<float> host) {
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
  if (static_cast<int64_t>(host.size()) >= kDownloadPinnedMin) {
    return DownloadViaPinned(B(src), host);
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
absl::Status CudaBackend::UploadView(const TensorView& v, bf16* dst) {
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

absl::StatusOr<Tensor> CudaBackend::FromViews(std::initializer_list<const TensorView*> views,
                                              int64_t cols, int64_t expect_rows) {
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

absl::StatusOr<BackendWeights> CudaBackend::LoadWeights(const Model& model) {
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

absl::StatusOr<BackendWeights> CudaBackend::RandomWeights(const ModelConfig& c, uint64_t seed) {
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

void CudaBackend::FreeWeights(BackendWeights& w) {
  KeepError(FlushGraph());
  Backend::FreeWeights(w);
  cudaStreamSynchronize(stream_);  // frees are stream-ordered
}

absl::StatusOr<KvPool> CudaBackend::AllocKvPool(int num_layers, int num_blocks, int block_size,
                                                int kv_dim) {
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

void CudaBackend::FreeKvPool(KvPool& pool) {
  KeepError(FlushGraph());
  cudaStreamSynchronize(stream_);
  for (Tensor& t : pool.k) cudaFree(t.data);
  for (Tensor& t : pool.v) cudaFree(t.data);
  pool = KvPool{};
}

absl::Status CudaBackend::Synchronize() {
  RETURN_IF_ERROR(FlushGraph());
  CUDA_RETURN(cudaStreamSynchronize(stream_), "Synchronize");
  return absl::OkStatus();
}

// ---- operations ----
absl::Status CudaBackend::Embedding(const Tensor& table, std::span<const int32_t> ids,
                                    Tensor& out) {
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

absl::Status CudaBackend::RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
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

absl::Status CudaBackend::MatMul(const Tensor& x, const Tensor& w, Tensor& out) {
  return Gemm(x, w, out, 0.0f);
}

// The residual add in the GEMM epilogue (beta = 1) rounds once where MatMul + Add rounds
// twice; on stories260K that flipped a near-tie of the GPU-vs-CPU greedy check at token 45
// and saved only ~1% at 32K (docs/perf-notes.md), so it is opt-in: SPX_FUSED_RESIDUAL=1.
absl::Status CudaBackend::MatMulAdd(const Tensor& x, const Tensor& w, Tensor& out) {
  if (!options_.fused_residual) return Backend::MatMulAdd(x, w, out);
  return Gemm(x, w, out, 1.0f);
}

// The small-n kernel for x @ w^T when it is on and supports the operands: at the auto variant
// for calls of at most small_n_auto_rows rows (SmallNGemmAutoVariant picks per shape), a
// variant chosen explicitly (SPX_SMALL_N_VARIANT) for every supported shape (comparisons).
bool CudaBackend::UseSmallN(const Tensor& x, const Tensor& w) const {
  if (!options_.small_n_gemm ||
      !kernels::SmallNGemmSupported(B(x), x.cols, B(w), w.cols, x.rows, x.cols)) {
    return false;
  }
  return options_.small_n_variant >= 0 || x.rows <= options_.small_n_auto_rows;
}

// out = x @ w^T + beta * out (beta = 1: the residual add in the GEMM epilogue).
absl::Status CudaBackend::Gemm(const Tensor& x, const Tensor& w, Tensor& out, float beta) {
  RETURN_IF_ERROR(CheckBf16(x, "MatMul x"));
  RETURN_IF_ERROR(CheckBf16(w, "MatMul w"));
  RETURN_IF_ERROR(CheckBf16(out, "MatMul out"));
  if (x.cols != w.cols) {
    return absl::InvalidArgumentError(absl::StrCat("MatMul: inner dims ", x.cols, " vs ",
                                                   w.cols));
  }
  RETURN_IF_ERROR(CheckShape(out, x.rows, w.rows, "MatMul"));
  if (x.rows == 0 || w.rows == 0) return absl::OkStatus();
  if (UseSmallN(x, w)) {
    const auto variant = static_cast<kernels::SmallNGemmVariant>(options_.small_n_variant);
    return Run("MatMul (small n)", [=, this] {
      return kernels::SmallNGemm(B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows, w.rows,
                                 x.cols, beta, stream_, variant);
    }, x.data, x.rows, x.cols, w.data, w.rows, out.data, out.cols, beta);
  }
  // cuBLASLt reports a status of its own: a failed launch is mapped onto a CUDA error for the
  // recorded path and logged with the shapes here.
  auto run = [=, this] {
    cublasStatus_t st = gemm_.Run(B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows, w.rows,
                                  x.cols, beta, stream_);
    return st == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorLaunchFailure;
  };
  if (!recording()) {
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

absl::Status CudaBackend::Add(Tensor& a, const Tensor& b) {
  RETURN_IF_ERROR(CheckBf16(a, "Add a"));
  RETURN_IF_ERROR(CheckBf16(b, "Add b"));
  RETURN_IF_ERROR(CheckShape(b, a.rows, a.cols, "Add"));
  return Run("Add", [=, this] {
    return kernels::Add(B(a), a.cols, B(b), b.cols, a.rows, a.cols, stream_);
  }, a.data, a.rows, a.cols, b.data, b.cols);
}

absl::Status CudaBackend::AddRmsNorm(Tensor& x, const Tensor& b, const Tensor& w, float eps,
                                     Tensor& out) {
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

absl::Status CudaBackend::SwiGLU(const Tensor& x, Tensor& out) {
  RETURN_IF_ERROR(CheckBf16(x, "SwiGLU x"));
  RETURN_IF_ERROR(CheckBf16(out, "SwiGLU out"));
  RETURN_IF_ERROR(CheckShape(out, x.rows, x.cols / 2, "SwiGLU"));
  return Run("SwiGLU", [=, this] {
    return kernels::SwiGlu(B(x), x.cols, B(out), out.cols, x.rows, out.cols, stream_);
  }, x.data, x.rows, x.cols, out.data, out.cols);
}

// Decode rows: one kernel, the small-n matmul with SwiGLU in its epilogue (bit-identical to
// MatMul then SwiGLU with the same variant). Otherwise those two through a temporary.
absl::Status CudaBackend::MatMulSwiGLU(const Tensor& x, const Tensor& w, Tensor& out) {
  RETURN_IF_ERROR(CheckBf16(x, "MatMulSwiGLU x"));
  RETURN_IF_ERROR(CheckBf16(w, "MatMulSwiGLU w"));
  RETURN_IF_ERROR(CheckBf16(out, "MatMulSwiGLU out"));
  if (x.cols != w.cols) {
    return absl::InvalidArgumentError(absl::StrCat("MatMulSwiGLU: inner dims ", x.cols, " vs ",
                                                   w.cols));
  }
  if (w.rows % 2 != 0) return absl::InvalidArgumentError("MatMulSwiGLU: odd gate_up rows");
  RETURN_IF_ERROR(CheckShape(out, x.rows, w.rows / 2, "MatMulSwiGLU"));
  if (x.rows == 0 || w.rows == 0) return absl::OkStatus();
  if (options_.fused_swiglu && UseSmallN(x, w)) {
    const auto variant = static_cast<kernels::SmallNGemmVariant>(options_.small_n_variant);
    return Run("MatMulSwiGLU (small n)", [=, this] {
      return kernels::SmallNGemmSwiGlu(B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows,
                                       out.cols, x.cols, stream_, variant);
    }, x.data, x.rows, x.cols, w.data, w.rows, out.data, out.cols);
  }
  // (The Hopper kernel takes at least 128 rows: never a small-n call.)
  if (options_.sm90_gemm_swiglu &&
      kernels::Sm90GemmSwiGluSupported(B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows,
                                       out.cols, x.cols)) {
    return Run("MatMulSwiGLU (sm90)", [=, this] {
      return kernels::Sm90GemmSwiGlu(
          B(x), x.cols, B(w), w.cols, B(out), out.cols, x.rows, out.cols, x.cols, stream_,
          static_cast<kernels::Sm90GemmSwiGluVariant>(options_.sm90_gemm_swiglu_variant));
    }, x.data, x.rows, x.cols, w.data, w.rows, out.data, out.cols);
  }
  return Backend::MatMulSwiGLU(x, w, out);
}

absl::Status CudaBackend::Rope(Tensor& x, int64_t col_offset, int n_heads,
                               std::span<const int32_t> pos, const RopeParams& p) {
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

absl::Status CudaBackend::CheckLayer(const KvPool& pool, int layer) {
  if (layer < 0 || layer >= pool.num_layers || layer >= static_cast<int>(pool.k.size())) {
    return absl::OutOfRangeError(absl::StrCat("KV layer ", layer, " outside pool of ",
                                              pool.num_layers));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaBackend::RopeLaunch> CudaBackend::StageRope(const KvPool& pool, int layer,
                                                               std::span<const int32_t> pos,
                                                               std::span<const int32_t> slots,
                                                               const RopeParams& p) {
  RopeLaunch l;
  ASSIGN_OR_RETURN(const float* inv, RopeTable(p));
  ASSIGN_OR_RETURN(auto d, Stage({{pos.data(), pos.size_bytes()},
                                  {slots.data(), slots.size_bytes()}}));
  l.rope = kernels::RopeArgs{inv, p.head_dim, p.layout == RopeLayout::kHalves};
  l.pos = static_cast<const int32_t*>(d[0]);
  l.slots = static_cast<const int32_t*>(d[1]);
  l.view = View(pool, layer);
  return l;
}

kernels::KvPoolView CudaBackend::View(const KvPool& pool, int layer) {
  kernels::KvPoolView v;
  v.k = B(pool.k[layer]);
  v.v = B(pool.v[layer]);
  v.num_slots = static_cast<int64_t>(pool.num_blocks) * pool.block_size;
  v.kv_dim = pool.kv_dim;
  return v;
}

absl::Status CudaBackend::WriteKv(KvPool& pool, int layer, const Tensor& k_src, int64_t k_col,
                                  const Tensor& v_src, int64_t v_col,
                                  std::span<const int32_t> slots) {
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

absl::Status CudaBackend::RopeWriteKv(KvPool& pool, int layer, Tensor& qkv, int n_heads,
                                      std::span<const int32_t> pos,
                                      std::span<const int32_t> slots, const RopeParams& p) {
  RETURN_IF_ERROR(CheckLayer(pool, layer));
  RETURN_IF_ERROR(CheckBf16(qkv, "RopeWriteKv"));
  RETURN_IF_ERROR(ValidateSlots(pool, slots));
  const int64_t n = qkv.rows;
  if (static_cast<int64_t>(pos.size()) != n || static_cast<int64_t>(slots.size()) != n) {
    return absl::InvalidArgumentError("RopeWriteKv: one position and one slot per row required");
  }
  if (p.head_dim <= 0 || p.head_dim % 2 || pool.kv_dim % p.head_dim || n_heads < 0 ||
      static_cast<int64_t>(n_heads) * p.head_dim + 2 * pool.kv_dim > qkv.cols) {
    return absl::InvalidArgumentError("RopeWriteKv: columns out of range or odd head_dim");
  }
  if (n == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(RopeLaunch l, StageRope(pool, layer, pos, slots, p));
  l.rope.trigger_first = options_.decode_early_kv;
  return Run("RopeWriteKv", [=, this] {
    return kernels::RopeWriteKv(l.view, B(qkv), qkv.cols, n, n_heads, l.pos, l.slots, l.rope,
                                stream_);
  }, l.view.k, l.view.v, l.view.num_slots, l.view.kv_dim, qkv.data, qkv.rows, qkv.cols, n_heads,
             l.pos, l.slots, l.rope.inv_freq, l.rope.head_dim, l.rope.halves,
             l.rope.trigger_first);
}

absl::Status CudaBackend::AssembleKv(KvPool& pool, int layer, const Tensor& k_pre, const Tensor& v,
                                     int64_t row0, std::span<const int32_t> pos,
                                     std::span<const int32_t> slots, const RopeParams& rope) {
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
  ASSIGN_OR_RETURN(const RopeLaunch l, StageRope(pool, layer, pos, slots, rope));
  const int heads = pool.kv_dim / rope.head_dim;
  return Run("AssembleKv", [=, this] {
    return kernels::AssembleKv(l.view, B(k_pre) + row0 * k_pre.cols, k_pre.cols,
                               B(v) + row0 * v.cols, v.cols, l.pos, l.slots, n, heads, l.rope,
                               stream_);
  }, l.view.k, l.view.v, l.view.num_slots, l.view.kv_dim, k_pre.data, k_pre.cols, v.data, v.cols,
             row0, l.pos, l.slots, n, heads, l.rope.inv_freq, l.rope.head_dim, l.rope.halves);
}

// The kernel reads the draws as they are laid out here.
static_assert(sizeof(RowDraw) == sizeof(kernels::RowDraw) &&
              offsetof(RowDraw, inv_temperature) == offsetof(kernels::RowDraw, inv_temperature) &&
              offsetof(RowDraw, seed) == offsetof(kernels::RowDraw, seed) &&
              offsetof(RowDraw, counter) == offsetof(kernels::RowDraw, counter));

// The draw runs after the step's recorded launches (a captured decode graph ends at the
// flush), so only rows ints cross to the host (and 24 bytes a row of draws to the device).
absl::Status CudaBackend::DrawRows(const Tensor& logits, std::span<const RowDraw> draws,
                                   std::span<int32_t> out) {
  RETURN_IF_ERROR(FlushGraph());
  RETURN_IF_ERROR(CheckBf16(logits, "DrawRows"));
  if (static_cast<int64_t>(out.size()) != logits.rows ||
      static_cast<int64_t>(draws.size()) != logits.rows) {
    return absl::InvalidArgumentError("DrawRows: one draw and one output per row");
  }
  if (out.empty()) return absl::OkStatus();
  if (logits.host || !options_.device_sampling) return Backend::DrawRows(logits, draws, out);
  // One scratch allocation: the draws (24 bytes a row), then the tokens.
  const size_t draw_bytes = draws.size_bytes();
  ASSIGN_OR_RETURN(void* tmp, f32_scratch_.Get(draw_bytes + out.size_bytes(), stream_));
  auto* dev_draws = static_cast<kernels::RowDraw*>(tmp);
  int32_t* dev_out = reinterpret_cast<int32_t*>(static_cast<char*>(tmp) + draw_bytes);
  CUDA_RETURN(cudaMemcpyAsync(dev_draws, draws.data(), draw_bytes, cudaMemcpyHostToDevice,
                              stream_),
              "DrawRows draws");
  CUDA_RETURN(kernels::DrawRows(B(logits), logits.cols, logits.rows, logits.cols, dev_draws,
                                dev_out, stream_),
              "DrawRows");
  CUDA_RETURN(cudaMemcpyAsync(out.data(), dev_out, out.size_bytes(), cudaMemcpyDeviceToHost,
                              stream_),
              "DrawRows copy");
  CUDA_RETURN(cudaStreamSynchronize(stream_), "DrawRows sync");
  return absl::OkStatus();
}

absl::Status CudaBackend::RowSqDist(const Tensor& a, int64_t a_col, const Tensor& b, int64_t b_col,
                                    int64_t n_cols, std::span<float> out) {
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

absl::Status CudaBackend::ReadKv(const KvPool& pool, int layer, std::span<const int32_t> slots,
                                 std::span<float> k_host, std::span<float> v_host) {
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

absl::Status CudaBackend::GatherRows(const Tensor& src, std::span<const int32_t> idx, Tensor& dst) {
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

absl::Status CudaBackend::ScatterRows(const Tensor& src, std::span<const int32_t> idx,
                                      Tensor& dst) {
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

absl::Status CudaBackend::CopyRows(const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row,
                                   int64_t n) {
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

absl::Status CudaBackend::CopyCols(const Tensor& src, int64_t src_col, Tensor& dst,
                                   int64_t dst_col, int64_t n_cols) {
  RETURN_IF_ERROR(CheckBf16(src, "CopyCols src"));
  RETURN_IF_ERROR(CheckBf16(dst, "CopyCols dst"));
  if (src.rows != dst.rows || src_col < 0 || dst_col < 0 || n_cols < 0 ||
      src_col + n_cols > src.cols || dst_col + n_cols > dst.cols) {
    return absl::OutOfRangeError("CopyCols: range outside tensors");
  }
  if (src.rows == 0 || n_cols == 0) return absl::OkStatus();
  if (src.host || dst.host) RETURN_IF_ERROR(FlushGraph());  // host memory: never recorded
  void* to = B(dst) + dst_col;
  const void* from = B(src) + src_col;
  const size_t dpitch = static_cast<size_t>(dst.cols) * 2, spitch = static_cast<size_t>(src.cols) * 2;
  const size_t width = static_cast<size_t>(n_cols) * 2, height = static_cast<size_t>(src.rows);
  // One strided copy (no kernel): rows of n_cols bf16 out of rows of src.cols.
  return Run("CopyCols", [=, this] {
    return cudaMemcpy2DAsync(to, dpitch, from, spitch, width, height, cudaMemcpyDefault, stream_);
  }, to, from, dpitch, spitch, width, height);
}

absl::StatusOr<const float*> CudaBackend::RopeTable(const RopeParams& p) {
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

}  // namespace cuda_internal

bool CudaAvailable() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options) {
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
  auto be = std::make_unique<cuda_internal::CudaBackend>(device, options);
  RETURN_IF_ERROR(be->Init());
  return std::unique_ptr<Backend>(std::move(be));
}

cudaStream_t CudaBackendStream(Backend& backend) {
  auto* cb = dynamic_cast<cuda_internal::CudaBackend*>(&backend);
  return cb ? cb->stream() : nullptr;
}

}  // namespace sparsex
