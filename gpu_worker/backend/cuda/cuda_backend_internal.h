// The CUDA backend's class (internal to gpu_worker/backend/cuda), declared for the files that
// define its parts: cuda_backend.cc (setup, memory, weights, the op adapters, RoPE tables) and
// attention_dispatch.cc (which kernel serves an attention call: mma.sync, wgmma, split-K,
// batched or cuDNN). Index arrays are staged by an IndexStager (index_stager.h), launches run
// or are recorded by a GraphRecorder (graph_recorder.h). Callers outside use backend.h and
// cuda_backend.h only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cuda/cuda_status.h"
#include "gpu_worker/backend/cuda/cudnn_attention.h"
#include "gpu_worker/backend/cuda/device_scratch.h"
#include "gpu_worker/backend/cuda/graph_recorder.h"
#include "gpu_worker/backend/cuda/index_stager.h"
#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "kernels/rope.h"

namespace sparsex::cuda_internal {

using bf16 = __nv_bfloat16;

inline bf16* B(const Tensor& t) { return static_cast<bf16*>(t.data); }

inline absl::Status CheckShape(const Tensor& t, int64_t rows, int64_t cols, const char* what) {
  if (t.rows != rows || t.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected [", rows, ", ", cols,
                                                   "], got [", t.rows, ", ", t.cols, "]"));
  }
  return absl::OkStatus();
}

inline absl::Status CheckBf16(const Tensor& t, const char* what) {
  if (t.dtype != DType::kBF16 || (t.data == nullptr && !t.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a tensor of the CUDA backend"));
  }
  return absl::OkStatus();
}

// bf16 storage, fp32 accumulation, one stream per backend. Operations validate their arguments
// on the host exactly as the CPU reference does, stage host index spans (IndexStager, or the
// GraphRecorder inside a recorded scope) and launch the kernels of kernels/ on the stream.
class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options)
      : device_(device), options_(options) {}
  ~CudaBackend() override;
  absl::Status Init();

  cudaStream_t stream() const { return stream_; }

  std::string name() const override { return "cuda"; }
  DType compute_dtype() const override { return DType::kBF16; }

  // ---- memory (cuda_backend.cc) ----
  absl::StatusOr<Tensor> Alloc(int64_t rows, int64_t cols) override;
  void Free(Tensor& t) override;
  absl::StatusOr<Tensor> AllocHost(int64_t rows, int64_t cols) override;
  absl::StatusOr<int64_t> Prefetch(const Tensor& src, Tensor& dst) override;
  absl::Status Await(int64_t ticket) override;
  absl::Status Upload(std::span<const float> host, Tensor& dst) override;
  absl::Status Download(const Tensor& src, std::span<float> host) override;
  absl::StatusOr<BackendWeights> LoadWeights(const Model& model) override;
  absl::StatusOr<BackendWeights> RandomWeights(const ModelConfig& c, uint64_t seed) override;
  void FreeWeights(BackendWeights& w) override;
  absl::StatusOr<KvPool> AllocKvPool(int num_layers, int num_blocks, int block_size,
                                     int kv_dim) override;
  void FreeKvPool(KvPool& pool) override;
  absl::Status Synchronize() override;

  // ---- recorded scopes (GraphRecorder) ----
  absl::Status BeginGraph() override { return recorder_.Begin(); }
  absl::Status EndGraph() override { return recorder_.End(); }
  GraphStats graph_stats() const override { return recorder_.stats(); }

  // ---- operations (cuda_backend.cc; Attention in attention_dispatch.cc) ----
  absl::Status Embedding(const Tensor& table, std::span<const int32_t> ids,
                         Tensor& out) override;
  absl::Status RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override;
  absl::Status MatMul(const Tensor& x, const Tensor& w, Tensor& out) override;
  absl::Status MatMulAdd(const Tensor& x, const Tensor& w, Tensor& out) override;
  absl::Status Add(Tensor& a, const Tensor& b) override;
  absl::Status AddRmsNorm(Tensor& x, const Tensor& b, const Tensor& w, float eps,
                          Tensor& out) override;
  absl::Status SwiGLU(const Tensor& x, Tensor& out) override;
  absl::Status MatMulSwiGLU(const Tensor& x, const Tensor& w, Tensor& out) override;
  absl::Status Rope(Tensor& x, int64_t col_offset, int n_heads, std::span<const int32_t> pos,
                    const RopeParams& p) override;
  absl::Status WriteKv(KvPool& pool, int layer, const Tensor& k_src, int64_t k_col,
                       const Tensor& v_src, int64_t v_col,
                       std::span<const int32_t> slots) override;
  absl::Status RopeWriteKv(KvPool& pool, int layer, Tensor& qkv, int n_heads,
                           std::span<const int32_t> pos, std::span<const int32_t> slots,
                           const RopeParams& p) override;
  absl::Status AssembleKv(KvPool& pool, int layer, const Tensor& k_pre, const Tensor& v,
                          int64_t row0, std::span<const int32_t> pos,
                          std::span<const int32_t> slots, const RopeParams& rope) override;
  absl::Status DrawRows(const Tensor& logits, std::span<const RowDraw> draws,
                        std::span<int32_t> out) override;
  absl::Status RowSqDist(const Tensor& a, int64_t a_col, const Tensor& b, int64_t b_col,
                         int64_t n_cols, std::span<float> out) override;
  absl::Status ReadKv(const KvPool& pool, int layer, std::span<const int32_t> slots,
                      std::span<float> k_host, std::span<float> v_host) override;
  absl::Status Attention(const Tensor& q, const KvPool& pool, int layer,
                         const AttentionArgs& a, Tensor& out) override;
  absl::Status GatherRows(const Tensor& src, std::span<const int32_t> idx, Tensor& dst) override;
  absl::Status ScatterRows(const Tensor& src, std::span<const int32_t> idx,
                           Tensor& dst) override;
  absl::Status CopyRows(const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row,
                        int64_t n) override;
  absl::Status CopyCols(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                        int64_t n_cols) override;

 private:
  // ---- weights (cuda_backend.cc) ----
  // Copies a host weight (F32/F16/BF16) into rows of dst as bf16, in bounded chunks.
  absl::Status UploadView(const TensorView& v, bf16* dst);
  absl::StatusOr<Tensor> FromViews(std::initializer_list<const TensorView*> views, int64_t cols,
                                   int64_t expect_rows);

  // ---- op helpers (cuda_backend.cc) ----
  // out = x @ w^T + beta * out (beta = 1: the residual add in the GEMM epilogue).
  absl::Status Gemm(const Tensor& x, const Tensor& w, Tensor& out, float beta);
  bool UseSmallN(const Tensor& x, const Tensor& w) const;
  absl::Status CheckLayer(const KvPool& pool, int layer);
  kernels::KvPoolView View(const KvPool& pool, int layer);
  absl::StatusOr<const float*> RopeTable(const RopeParams& p);
  // What the RoPE kernels of a layer take: the rotation (frequency table and layout), the
  // positions and slots staged on the device, and the layer's pool.
  struct RopeLaunch {
    kernels::RopeArgs rope;
    const int32_t* pos = nullptr;
    const int32_t* slots = nullptr;
    kernels::KvPoolView view;
  };
  absl::StatusOr<RopeLaunch> StageRope(const KvPool& pool, int layer,
                                       std::span<const int32_t> pos,
                                       std::span<const int32_t> slots, const RopeParams& p);

  // ---- attention dispatch (attention_dispatch.cc) ----
  // Whether this call is dense causal attention cuDNN can take.
  bool DenseForCudnn(const Tensor& q, const AttentionArgs& a, int64_t n, int64_t ctx, int hd);
  // Dense causal attention through cuDNN's fused engine; lse (device, [heads, rows]) set: its
  // softmax normaliser too.
  absl::Status CudnnDense(const Tensor& q, const KvPool& pool, int layer, const AttentionArgs& a,
                          Tensor& out, float* lse = nullptr);
  // Dense attention on cuDNN with the selection statistics by complement
  // (CudaBackendOptions::cudnn_statistics).
  absl::Status CudnnStatistics(const Tensor& q, const KvPool& pool, int layer,
                               const AttentionArgs& a, Tensor& out,
                               const std::vector<int32_t>& tile_groups);
  // attn_scratch_ as [split-K partials | lse | cross | recv]; a part of size 0 is null.
  struct AttentionWorkspace {
    void* split = nullptr;
    float* lse = nullptr;
    float* cross = nullptr;
    float* recv = nullptr;
  };
  absl::StatusOr<AttentionWorkspace> CarveAttentionWorkspace(size_t split_bytes,
                                                             int64_t lse_floats,
                                                             int64_t cross_floats,
                                                             int64_t recv_floats);
  // The statistics pass (when s asks for one) and the sums back into a's host arrays.
  absl::Status FinishStatistics(const kernels::PagedAttentionParams& p,
                                const kernels::AttentionStatsParams& s, const AttentionArgs& a,
                                float* cross, float* recv);
  // Several sequences in one launch (batched decode).
  absl::Status AttentionBatched(const Tensor& q, const KvPool& pool, int layer,
                                const AttentionArgs& a, Tensor& out);

  // ---- staging and recording: the op adapters' names for IndexStager and GraphRecorder ----
  bool recording() const { return recorder_.recording(); }
  // Launches f now, or (recording) queues it under a signature of what it launches.
  template <class F, class... A>
  absl::Status Run(const char* what, F&& f, const A&... sig) {
    return recorder_.Run(what, std::forward<F>(f), sig...);
  }
  absl::StatusOr<void*> Workspace(DeviceScratch& scratch, size_t bytes) {
    return recorder_.Workspace(scratch, bytes);
  }
  absl::Status FlushGraph() { return recorder_.Flush(); }
  void KeepError(absl::Status s) { recorder_.KeepError(std::move(s)); }
  static Hash128 StageKey(const std::vector<HostSpan>& spans, uint64_t domain = 0) {
    return IndexStager::Key(spans, domain);
  }
  bool StageHas(const Hash128& key) const { return stager_.Has(key); }
  absl::StatusOr<std::vector<void*>> Stage(const std::vector<HostSpan>& spans) {
    if (recording()) return recorder_.StageRecorded(spans, 0);
    return Stage(spans, StageKey(spans));
  }
  absl::StatusOr<std::vector<void*>> Stage(const std::vector<HostSpan>& spans,
                                           const Hash128& key) {
    return stager_.Stage(spans, key);
  }

  int device_;
  const CudaBackendOptions options_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;  // Prefetch copies, beside the compute stream
  // Large fp32 uploads (segment KV from the host store) are converted to bf16 on host threads
  // into two pinned chunks and copied from there: half the bytes, at the pinned rate, where a
  // pageable fp32 copy plus a device conversion took ~2 s for a 32K-token fetched prompt.
  static constexpr int64_t kUploadChunk = int64_t{4} << 20;  // elements per pinned chunk
  // Copies n elements to dst through the two pinned chunks; fill(buf, off, m) puts elements
  // [off, off + m) into a chunk (converted or as they are) while the other chunk copies.
  // Two pinned chunks of kUploadChunk elements, each with the event of its last copy.
  struct PinnedChunks {
    bf16* buf[2] = {nullptr, nullptr};
    cudaEvent_t done[2] = {nullptr, nullptr};
    bool pending[2] = {false, false};
  };
  absl::Status EnsurePinnedChunks(PinnedChunks& c);
  void FreePinnedChunks(PinnedChunks& c);
  // The copies go on `stream`; refilling a chunk waits only for that chunk's earlier copy.
  absl::Status UploadViaPinned(PinnedChunks& c, cudaStream_t stream, int64_t n, bf16* dst,
                               const std::function<void(bf16* buf, int64_t off, int64_t m)>& fill);
  absl::Status UploadBf16(std::span<const uint16_t> host, Tensor& dst) override;
  // Through two pinned chunks of its own, copied on copy_stream_: refilling a chunk waits only
  // for that chunk's earlier copy, never for the compute stream.
  absl::StatusOr<int64_t> UploadBf16Async(std::span<const uint16_t> host, Tensor& dst) override;
  // Large downloads (a decode batch's logits: 32 x 128256) the other way: bf16 copied into the
  // same two pinned chunks, widened to fp32 on host threads while the next chunk copies; the
  // pageable fp32 copy took ~1 ms of a 15 ms batch-32 decode step on the H200.
  static constexpr int64_t kDownloadPinnedMin = int64_t{1} << 18;  // elements
  absl::Status DownloadViaPinned(const bf16* src, std::span<float> host);
  PinnedChunks chunks_;        // Upload, UploadBf16 and DownloadViaPinned, on stream_
  PinnedChunks async_chunks_;  // UploadBf16Async, on copy_stream_
  IndexStager stager_;
  std::map<int64_t, cudaEvent_t> tickets_;
  // A ticket for Await: an event after what the copy stream has queued so far.
  absl::StatusOr<int64_t> CopyStreamTicket();
  int64_t last_ticket_ = 0;
  kernels::LtGemm gemm_;
  DeviceScratch f32_scratch_, attn_scratch_;
  // Dense prefill attention through cuDNN (created on first use; see DenseForCudnn).
  std::unique_ptr<CudnnAttention> cudnn_;
  absl::Status cudnn_status_;  // why cuDNN could not be loaded (then not retried)
  bool cudnn_fallback_logged_ = false;
  bool cudnn_stats_fallback_logged_ = false;
  DeviceScratch cudnn_kv_;  // gathered K and V when a sequence's slots are not consecutive
  GraphRecorder recorder_{&stager_};
  std::map<std::tuple<int, float, int, float, float, float, int>, float*> rope_tables_;
};

}  // namespace sparsex::cuda_internal
