// The compute backend: a small table of tensor operations behind an abstract class with a
// factory, in the spirit of ggml-backend. The CPU reference (fp32) and the CUDA backend (bf16
// storage, fp32 accumulation) implement the same operations; the model runner, the prefill
// planner and the sparse-recompute executor are written once against this interface, and one
// consistency test checks every operation of every backend against the CPU reference.
//
//   ASSIGN_OR_RETURN(auto be, CreateBackend({.kind = "cpu"}));
//   ASSIGN_OR_RETURN(Tensor x, be->Alloc(n, dim));
//   be->RmsNorm(x, w, eps, y);
//
// Tensors are 2-D, row-major, owned by the backend that allocated them. Row counts may be zero
// (an operation on zero rows is a no-op). Operations are enqueued in order on the backend's
// stream; host-visible results (Download*) synchronise.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/logits.h"
#include "common/status.h"
#include "model/model.h"

namespace sparsex {

struct Tensor {
  void* data = nullptr;  // backend memory (host for CPU, device for CUDA)
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0;
  bool host = false;  // parked in (pinned) host memory by AllocHost; see there
  size_t bytes() const { return static_cast<size_t>(rows * cols) * DTypeSize(dtype); }
  bool empty() const { return rows == 0 || cols == 0; }
};

// Rows [r0, r0 + n) of t, aliasing its memory (not to be freed).
inline Tensor RowView(const Tensor& t, int64_t r0, int64_t n) {
  Tensor v = t;
  v.data = static_cast<char*>(t.data) + static_cast<size_t>(r0 * t.cols) * DTypeSize(t.dtype);
  v.rows = n;
  return v;
}

// The model's weights resident in backend memory.
struct BackendLayer {
  Tensor attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down;  // wqkv: [(H+2KV)*hd, dim]
};                                                          // w_gate_up: [2*ffn, dim]
struct BackendWeights {
  Tensor tok_embeddings, final_norm, output;
  std::vector<BackendLayer> layers;
};

// Paged KV storage for all layers: per layer K and V pools of [num_blocks * block_size, kv_dim]
// rows; a token's "slot" is block_id * block_size + offset. K is stored after RoPE.
struct KvPool {
  int num_layers = 0, num_blocks = 0, block_size = 16, kv_dim = 0;
  std::vector<Tensor> k, v;  // [num_layers]
};

struct RopeParams {
  int head_dim = 0;
  float theta = 10000.0f;
  RopeLayout layout = RopeLayout::kAdjacentPairs;
  RopeScaling scaling;
};

// Rows [row_begin, row_end) of a batched attention call belong to one sequence whose positions
// 0..ctx_slots.size()-1 live at those slots.
struct SeqRows {
  int64_t row_begin = 0, row_end = 0;
  std::span<const int32_t> ctx_slots;
};

// One attention call: rows of q (each with its own absolute position) of one sequence attend
// over that sequence's keys at positions [0, q_pos[i]] (causal limit of the row's own position),
// read through the slot table. Serves dense prefill, chunked prefill, decode and sparse recompute.
struct AttentionArgs {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0.0f;                  // 1/sqrt(head_dim) when 0
  std::span<const int32_t> q_pos;      // [q.rows] absolute positions
  std::span<const int32_t> ctx_slots;  // [ctx_len] slot of each position 0..ctx_len-1
  // Optional selection signal (SparseX selector), computed without an N x N matrix.
  // key_group: [ctx_len] segment id of each key; -1 marks shared keys (BOS/sink) ignored by both
  // statistics. q_group: [q.rows] the segment of each query row.
  std::span<const int32_t> key_group;
  std::span<const int32_t> q_group;
  // out_cross[i] += sum over heads of the probability row i puts on keys of other groups
  // (excluding group -1), divided by n_heads. Needs key_group and q_group.
  float* out_cross = nullptr;  // host [q.rows]
  // recv_weight[i] > 0 marks query rows whose attention is accumulated onto keys:
  // out_recv[j] += sum_i recv_weight[i] * mean over heads of p(i -> j).
  std::span<const float> recv_weight;
  float* out_recv = nullptr;  // host [ctx_len]
  // Several sequences in one call (batched decode): consecutive row ranges covering all rows,
  // each with its own context; ctx_slots is then unused and no statistics may be asked for.
  std::span<const SeqRows> seqs;
};

// The CUDA backend's kernel choices (docs/operations.md, "GPU kernel switches"). The backend
// reads nothing else: a process fills one from its SPX_* environment variables, once, with
// CudaBackendOptionsFromEnv() where it builds its BackendOptions (the worker's main, the CLI,
// the benchmarks). Ignored by the CPU backend.
struct CudaBackendOptions {
  // Kernel for unsplit head-dim-128 attention (PagedAttentionParams::impl, kernels/attention.h).
  // kAuto: the warp-specialised wgmma kernel when the build has sm_90a code and the GPU is
  // compute capability 9.0 (calls with the fused cross mass too; on 128-key tiles,
  // kWgmmaWs128), else mma.sync. Split-K
  // (decode) always runs mma.sync.
  enum class AttentionImpl {
    kAuto = 0,
    kMma = 1,
    kWgmma = 2,
    kWgmmaPipelined = 3,
    kWgmmaWarpSpecialized = 4,
    // The ws kernel with the consumer warpgroups taking turns at the tensor cores (ping-pong).
    // H100, without setmaxnreg: level with ws.
    kWgmmaWsPingPong = 5,
    // The ws kernel with each consumer warpgroup's next Q K^T issued before its softmax
    // (FlashAttention-3's intra-warpgroup overlap). H100: ~1-2% behind ws.
    kWgmmaWsPipelined = 6,
    // The ws kernel on 128-key tiles (3 stages): half the per-tile overheads of an
    // issue-bound kernel. H100: 473 against ws's 439 TFLOP/s on a 32K causal layer, 431
    // against 389 on 15% sparse rows; kAuto's choice.
    kWgmmaWs128 = 7,
    // The ws-128 kernel with the softmax's row sums on the tensor cores (P times a block of
    // ones beside P V) instead of an FADD a score. H100: no gain (32K reuse prefill 287.9
    // against 285.9 / 289.0 ms for kAuto).
    kWgmmaWs128RowSum = 8
  };
  enum class Cudnn { kOff = 0, kWhenAvailable = 1, kRequired = 2 };

  // Decode-sized matmuls on the weight-streaming small-n kernel; false sends them to cuBLASLt
  // (comparisons). SPX_SMALL_N_GEMM=0 sets false. Default: true
  bool small_n_gemm = true;
  // Which small-n kernel (kernels::SmallNGemmVariant, kernels/gemm.h): 0 warp2 (the v2 kernel),
  // 1 warp2-deep, 2 warp4, 3 splitk4, 4 splitk8, each for every supported shape (comparisons);
  // -1 the automatic choice: calls of at most small_n_auto_rows rows on the small-n kernel at
  // the variant kernels::SmallNGemmAutoVariant picks per shape, cuBLASLt for the rest.
  // SPX_SMALL_N_VARIANT=auto|warp2|warp2-deep|warp4|splitk4|splitk8 or the number. Default: -1
  int small_n_variant = -1;
  // The most rows of a matmul the automatic choice (small_n_variant -1) sends to the small-n
  // kernel; 0 sends every matmul to cuBLASLt (on an H200: 5.15-5.20 ms at batch 1 against
  // 5.28-5.32 with the small-n kernel, before its weight loads were issued ahead). H100, 8K
  // context, same call: batch 1 6.32 ms a step with splitk8 on every shape against 6.63 on
  // cuBLASLt, the small-n kernel's weight loads issued before its PDL wait overlapping the
  // previous kernel (docs/perf-notes.md). SPX_SMALL_N_ROWS (0-8). Default: 1
  int small_n_auto_rows = 1;
  // Backend::MatMulSwiGLU on decode rows (at most kernels::kSmallNGemmMaxRows) as one kernel:
  // the gate_up projection with SwiGLU in its epilogue, bit-identical to the small-n matmul
  // then SwiGLU; false runs those two (comparisons). Needs small_n_gemm.
  // SPX_FUSED_SWIGLU=0 sets false. Default: true
  bool fused_swiglu = true;
  // Backend::MatMulSwiGLU on more rows than the small-n kernel takes (prefill) as one Hopper
  // kernel (kernels::Sm90GemmSwiGlu: wgmma, SwiGLU in the epilogue) where the build has sm_90a
  // code and the device is compute capability 9.0, instead of cuBLASLt then SwiGLU, which
  // write and read back the [n, 2 * ffn] gate_up product (1.9 GB a layer at 32K rows).
  // Bit-identical results. H100 (docs/perf-notes.md): peak memory 1.5 GiB lower
  // at 32K and 6.0 GiB at 128K, the reuse prefill level (within its spread), the full prefill
  // 0.4% slower. SPX_GEMM_SWIGLU=1 sets true. Default: false
  bool sm90_gemm_swiglu = false;
  // Which shape of that kernel (kernels::Sm90GemmSwiGluVariant, kernels/gemm.h): 0 three
  // stages with the SwiGLU on idle warps, 1 four stages with the SwiGLU after each tile
  // (comparisons). SPX_GEMM_SWIGLU_VARIANT (0-1). Default: 0
  int sm90_gemm_swiglu_variant = 0;
  // Backend::UploadBf16 of a large host buffer (a fetched segment's layer) as one copy from
  // the pageable buffer, staged by the driver, instead of through the backend's two pinned
  // chunks filled on the shared thread pool (which a concurrent cluster fetch's decode also
  // uses: comparisons). SPX_UPLOAD_DIRECT=1 sets true. Default: false
  bool upload_direct = false;
  // Backend::DrawRows on the device (kernels::DrawRows: a decode step's greedy and
  // plain-temperature rows bring back one int each); false downloads their logits and draws
  // on the host (the same DrawToken). BackendConsistency.DrawRowsOnTheDevice checks it; H100:
  // decode step 6.89 -> 6.76 ms at batch 1, 19.44 -> 18.94 ms at batch 32.
  // SPX_DEVICE_SAMPLING=0 sets false. Default: true
  bool device_sampling = true;
  // Tensor-core attention block: 4 or 8 warps; 0 is the kernel's default (8).
  // SPX_ATTN_WARPS. Default: 0
  int attn_warps = 0;
  // The down projection's residual add folded into the GEMM epilogue (cuBLASLt beta = 1):
  // rounds once instead of twice; no faster at decode (docs/perf-notes.md v9). Applies where
  // the add is not already folded into the next layer's attention norm (ModelRunner::Forward
  // folds it for every layer but the last). SPX_FUSED_RESIDUAL=1 sets true. Default: false
  bool fused_residual = false;
  // SPX_ATTN_IMPL=mma|wgmma|wgmma-pipe|wgmma-ws|wgmma-ws-pp|wgmma-ws-pipe|wgmma-ws-128|
  // wgmma-ws-128-lsum. Default: kAuto
  AttentionImpl attn_impl = AttentionImpl::kAuto;
  // The ws-128 kernel (kWgmmaWs128, kAuto's choice on sm_90a) loads each key tile whose 16-key
  // groups sit in whole pool blocks (BlockManagerOptions' 16-slot blocks: every full tile of a
  // sequence) as bulk tensor copies from one thread (PagedAttentionParams::num_slots); false
  // gathers every tile with cp.async (comparisons). SPX_ATTN_BULK_KV=0 sets false. Default: true
  bool attn_bulk_kv = true;
  // Batched decode attention (PagedAttentionParams::decode_kernel): kAuto the packed decode
  // kernel whenever a sequence's rows x G fit 16 (decode), kTile the general tile kernel,
  // kPacked32 the packed kernel on 32-key tiles (comparisons). SPX_DECODE_ATTN=tile|packed32.
  // Default: kAuto
  enum class DecodeAttention { kAuto = 0, kTile = 1, kPacked32 = 2 };
  DecodeAttention decode_attn = DecodeAttention::kAuto;
  // Split-K of attention launches too small to fill the GPU (decode): about this many blocks
  // per SM (PagedAttentionParams::split_waves); 0 the kernel's default (2 for at most 16
  // blocks, else 1). SPX_SPLIT_WAVES.
  // Default: 0
  int split_waves = 0;
  // The packed decode attention requests the key tiles below its rows' positions before its
  // programmatic-launch wait, and the step's RoPE + K/V write lets it start before its own wait
  // (RopeArgs::trigger_first), so those requests overlap the qkv projection and the RoPE; only
  // where the call's tables were staged by an earlier call (every layer of a step but the
  // first; PagedAttentionParams::decode_early_kv). Measured on an H100: batch 1
  // at 8K 6.19-6.23 ms a step against 6.29-6.30 off, batch 32 unchanged (docs/perf-notes.md).
  // SPX_DECODE_EARLY_KV=0 sets false. Default: true
  bool decode_early_kv = true;
  // Recorded scopes (Backend::BeginGraph) replayed as captured CUDA graphs; false runs them as
  // plain launches (comparisons). SPX_CUDA_GRAPHS=0 sets false. Default: true
  bool cuda_graphs = true;
  // Launches in the first graph segment of a recorded scope; each next segment holds twice as
  // many, up to 64 (GraphRecorder). The device starts a step once the first segment is
  // recorded, so a short one hides the host's recording of the rest behind the device's work
  // H100, 8K context: batch 1
  // -0.03 ms a step, batch 32 -0.26 to -0.49 ms against 64 (docs/perf-notes.md).
  // SPX_GRAPH_FIRST_SEGMENT (1-64). Default: 8
  int graph_first_segment = 8;
  // Dense causal prefill attention through cuDNN's fused engine when libcudnn.so.9 loads
  // (kWhenAvailable: our kernel when it does not); kRequired turns a cuDNN failure into an error
  // instead of the fallback (tests). SPX_CUDNN_ATTENTION=0|require. Default: kWhenAvailable
  Cudnn cudnn_attention = Cudnn::kWhenAvailable;
  // The fewest query rows that go to cuDNN. Each new shape costs a plan build (~40-100 ms on the
  // H200, ~1 s for the first, which compiles the kernel), repaid within one prefill only from
  // about 16K tokens (32 layers x 1.8x faster attention). SPX_CUDNN_MIN_TOKENS. Default: 16384
  int64_t cudnn_min_tokens = 16384;
  // cuDNN library opened first (then libcudnn.so.9 from the loader path); empty: none.
  // SPX_CUDNN_LIB. Default: ""
  std::string cudnn_library;
  // Dense attention that also wants the selection statistics (the reuse prefill's full layers)
  // on cuDNN too: cuDNN's softmax normaliser, then a pass over each row's own segment and the
  // shared keys only, whose mass is 1 minus the cross mass (kernels::AttentionStatsParams::
  // cross_complement), where that pass reads at most cudnn_statistics_max_share of the key
  // tiles a plain pass reads (ComplementReadShare, gpu_worker/backend/attention_stats_plan.h);
  // else our kernel with the cross mass fused. Needs cudnn_attention; its failure falls back
  // like dense attention does (kRequired: an error). Measured on an H100 (32K reuse
  // prefill): the two full layers 113.0 -> 89.8 ms (docs/perf-notes.md). SPX_CUDNN_STATS=0 sets
  // false, =1 true (anything else is reported and ignored). Default: true
  bool cudnn_statistics = true;
  // Above this read share cuDNN plus the complement pass would cost about what our kernel with
  // the cross mass fused costs (a model from the H200's per-layer figures at 32K: cuDNN 14.8 ms,
  // our fused pass ~31 ms, a full statistics read ~27.5 ms; not yet measured as a whole).
  // SPX_CUDNN_STATS_MAX_SHARE. Default: 0.5
  double cudnn_statistics_max_share = 0.5;
  // In that complement pass, the received attention of the weighted rows (the new tokens) in
  // blocks of their own, each over a part of the keys, instead of inside the cross-mass blocks,
  // where their reads of every key trail the launch (kernels::AttentionStatsParams::
  // recv_rows_begin). H100, 32K: 6.64 -> 4.72 ms a layer (3.99 without the received
  // attention), reuse prefill 320.0 -> 314.7 ms.
  // SPX_STATS_RECV_SPLIT=1 sets true, =0 false. Default: true
  bool stats_recv_split = true;
  // The complement pass (cross mass and the new rows' received attention) on the wgmma kernel
  // of kernels/attention_stats_sm90.cu (sm_90a; AttentionStatsParams::impl 0; needs
  // stats_recv_split); false keeps it on mma.sync (comparisons).
  // SPX_WGMMA_STATS=0 sets false. Default: true
  bool wgmma_statistics = true;
};

// CudaBackendOptions from the SPX_* environment variables: each unset variable leaves its
// field's default. An SPX_ATTN_IMPL value other than mma, wgmma, wgmma-pipe, wgmma-ws,
// wgmma-ws-pp, wgmma-ws-pipe, wgmma-ws-128, wgmma-ws-128-lsum or auto (the removed wgmma-128,
// wgmma-ws-qreg, wgmma-ws-qreg-rr, wgmma-ws-p64 and wgmma-ws-128-pipe included) keeps kAuto
// and says so on stderr. Only parses strings:
// defined in CPU-only builds too. SPX_PDL is read by the kernels themselves (kernels/ops.cu).
CudaBackendOptions CudaBackendOptionsFromEnv();

struct BackendOptions {
  std::string kind = "cpu";  // "cpu" or "cuda". Default: cpu
  int device = 0;            // CUDA device ordinal. Default: 0
  CudaBackendOptions cuda = {};  // kind "cuda" only. Default: the struct's (no environment)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual DType compute_dtype() const = 0;  // activation/weight storage type

  // ---- memory ----
  virtual absl::StatusOr<Tensor> Alloc(int64_t rows, int64_t cols) = 0;
  virtual void Free(Tensor& t) = 0;
  virtual absl::Status Upload(std::span<const float> host, Tensor& dst) = 0;  // fp32 -> dtype
  // Uploads bf16 values (the upper halves of fp32). Default: widened to fp32, then Upload (exact
  // on any backend); the CUDA backend copies them as they are.
  virtual absl::Status UploadBf16(std::span<const uint16_t> host, Tensor& dst);
  // UploadBf16 off the compute stream: host may be reused once it returns, the copy itself
  // runs beside the queued compute work, and work enqueued after Await(ticket) sees dst. Host
  // memory from AllocHost (pinned on CUDA) is read by the copy directly instead: it must stay
  // unchanged until work enqueued after Await(ticket) has run (e.g. a Synchronize). The
  // copy is not ordered after queued compute work: dst must be memory no queued work still
  // reads or writes (e.g. allocated before a Synchronize). For a cluster fetch streamed layer
  // by layer: the host no longer waits for the previous layer's compute before it can stage
  // the next layer's bytes (on the H200 the staging chunks' reuse waited for it, so the fetch
  // and the prefill ran one after the other). Default: UploadBf16 now, ticket 0.
  virtual absl::StatusOr<int64_t> UploadBf16Async(std::span<const uint16_t> host, Tensor& dst);
  virtual absl::Status Download(const Tensor& src, std::span<float> host) = 0;
  virtual absl::StatusOr<BackendWeights> LoadWeights(const Model& model) = 0;
  // Seeded random weights of the given shapes generated in backend memory (speed work only:
  // e.g. Llama-3-8B shapes on a GPU without a 16 GB host copy). Values ~ U(-a, a) with
  // a = 1/sqrt(in_features); norms are 1. Deterministic for a seed on a given backend.
  virtual absl::StatusOr<BackendWeights> RandomWeights(const ModelConfig& cfg, uint64_t seed) = 0;
  // Default: Free of every tensor.
  virtual void FreeWeights(BackendWeights& w);
  // Memory for data parked off the device (the pinned host tier of segment KV). On CUDA: pinned
  // host memory in the compute dtype (Tensor::host set) that Upload, CopyRows and Prefetch
  // accept; other operations take device tensors only. Default: Alloc (the CPU's memory is the
  // host's).
  virtual absl::StatusOr<Tensor> AllocHost(int64_t rows, int64_t cols) { return Alloc(rows, cols); }
  // Copies all of src into dst (same shape) off the compute stream, so the copy overlaps the
  // work enqueued after it; returns a ticket. Operations enqueued after Await(ticket) see the
  // copied data; dst must not be freed before Await. Default: CopyRows now, ticket 0.
  virtual absl::StatusOr<int64_t> Prefetch(const Tensor& src, Tensor& dst);
  virtual absl::Status Await(int64_t ticket) {
    (void)ticket;
    return absl::OkStatus();
  }
  virtual absl::StatusOr<KvPool> AllocKvPool(int num_layers, int num_blocks, int block_size,
                                             int kv_dim) = 0;
  virtual void FreeKvPool(KvPool& pool) = 0;
  virtual absl::Status Synchronize() = 0;

  // ---- recorded scopes (decode graphs) ----
  // The operations enqueued from BeginGraph until EndGraph, or until the first operation that
  // waits for the device (Download, ReadKv, statistics, Synchronize, ...), form one recorded
  // sequence. When a sequence recurs with the same operations, shapes, buffers and parameters
  // (the contents of the host index arrays may differ), a backend may replay it as one
  // captured graph instead of one launch per operation (CUDA graphs: decode steps, whose
  // launches otherwise cost more than their kernels). Inside a scope the host index arrays an
  // operation was given are copied when it is called, so they may change afterwards; tensors
  // allocated in a scope should be freed before the next scope begins (their addresses are
  // part of what must recur). Errors of recorded launches surface at the end of the sequence.
  // Default: nothing is recorded, operations run as they are called.
  virtual absl::Status BeginGraph() { return absl::OkStatus(); }
  virtual absl::Status EndGraph() { return absl::OkStatus(); }
  struct GraphStats {
    int64_t scopes = 0;          // recorded sequences ended
    int64_t replayed = 0;        // ... all of whose launches were graphs captured before
    int64_t captured = 0;        // graphs captured (a long sequence is several graphs)
    int64_t graph_launches = 0;  // graphs launched (captured ones included)
  };
  virtual GraphStats graph_stats() const { return {}; }

  // ---- operations (shapes checked by callers; see the CPU reference for exact semantics) ----
  // out[i] = table[ids[i]]
  virtual absl::Status Embedding(const Tensor& table, std::span<const int32_t> ids,
                                 Tensor& out) = 0;
  // out = x / rms(x) * w, per row
  virtual absl::Status RmsNorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) = 0;
  // out = x @ w^T   (x [n, k], w [m, k], out [n, m])
  virtual absl::Status MatMul(const Tensor& x, const Tensor& w, Tensor& out) = 0;
  // out += x @ w^T: the residual add folded into the projection (one pass over out instead of
  // a separate Add). Default: MatMul into a temporary, then Add.
  virtual absl::Status MatMulAdd(const Tensor& x, const Tensor& w, Tensor& out);
  // a += b
  virtual absl::Status Add(Tensor& a, const Tensor& b) = 0;
  // x += b; out = x / rms(x) * w (the residual add and the next norm in one pass; the sum is
  // rounded as Add would). Default: Add, then RmsNorm.
  virtual absl::Status AddRmsNorm(Tensor& x, const Tensor& b, const Tensor& w, float eps,
                                  Tensor& out) {
    RETURN_IF_ERROR(Add(x, b));
    return RmsNorm(x, w, eps, out);
  }
  // out[:, j] = silu(x[:, j]) * x[:, j + half]   (x [n, 2*half], out [n, half])
  virtual absl::Status SwiGLU(const Tensor& x, Tensor& out) = 0;
  // out = SwiGLU(x @ w^T)   (x [n, k], w [2*half, k]: gate rows then up rows, out [n, half]):
  // the MLP's gate_up projection and activation as one operation, so a backend can skip the
  // [n, 2*half] intermediate. Results equal MatMul then SwiGLU. Default: exactly that, through
  // a temporary.
  virtual absl::Status MatMulSwiGLU(const Tensor& x, const Tensor& w, Tensor& out);
  // Rotates columns [col_offset, col_offset + n_heads*head_dim) of x in place, row i at pos[i].
  virtual absl::Status Rope(Tensor& x, int64_t col_offset, int n_heads,
                            std::span<const int32_t> pos, const RopeParams& p) = 0;
  // Copies columns [col_offset, col_offset + pool.kv_dim) of src rows into pool rows at slots.
  virtual absl::Status WriteKv(KvPool& pool, int layer, const Tensor& k_src, int64_t k_col,
                               const Tensor& v_src, int64_t v_col,
                               std::span<const int32_t> slots) = 0;
  // A layer's RoPE and KV write: qkv [n, (n_heads + 2 * pool.kv_dim / head_dim) * head_dim]
  // holds Q heads, K heads, V; rotates the Q and K heads in place (row i at pos[i]) and writes
  // the rotated K and V rows to the pool at slots. Equals Rope(qkv, 0, Q + K heads) then
  // WriteKv (that is the default; the CUDA backend runs one kernel).
  virtual absl::Status RopeWriteKv(KvPool& pool, int layer, Tensor& qkv, int n_heads,
                                   std::span<const int32_t> pos, std::span<const int32_t> slots,
                                   const RopeParams& p);
  // KV assembly of a reused segment: rows [row0, row0 + pos.size()) of k_pre (K before RoPE)
  // rotated to positions pos and written with the same rows of v to the pool at slots.
  // Default: CopyRows, Rope, WriteKv through temporaries (backends fuse it into one pass).
  virtual absl::Status AssembleKv(KvPool& pool, int layer, const Tensor& k_pre, const Tensor& v,
                                  int64_t row0, std::span<const int32_t> pos,
                                  std::span<const int32_t> slots, const RopeParams& rope);
  // Reads K and V rows at slots into host fp32 ([slots.size(), kv_dim] each).
  virtual absl::Status ReadKv(const KvPool& pool, int layer, std::span<const int32_t> slots,
                              std::span<float> k_host, std::span<float> v_host) = 0;
  // out = attention(q (columns [0, n_heads*head_dim) of q), paged K/V of `layer`).
  virtual absl::Status Attention(const Tensor& q, const KvPool& pool, int layer,
                                 const AttentionArgs& args, Tensor& out) = 0;
  // dst[i] = src[idx[i]]
  virtual absl::Status GatherRows(const Tensor& src, std::span<const int32_t> idx,
                                  Tensor& dst) = 0;
  // dst[idx[i]] = src[i]
  virtual absl::Status ScatterRows(const Tensor& src, std::span<const int32_t> idx,
                                   Tensor& dst) = 0;
  // out[i] += sum_j (a[i, a_col + j] - b[i, b_col + j])^2 for j < n_cols (KV deviation signal).
  // Default: on the host after downloading both (backends may override with a kernel).
  virtual absl::Status RowSqDist(const Tensor& a, int64_t a_col, const Tensor& b, int64_t b_col,
                                 int64_t n_cols, std::span<float> out);
  // out[i] = the token drawn from row i as draws[i] says (common/logits.h DrawToken: greedy, or
  // Gumbel-max at a temperature from the request's seed and draw count), or -1 when no token
  // can be drawn from it (a NaN or +Inf, or all -Inf). A greedy or plain-temperature decode
  // step needs nothing else of its logits. Default: on the host after downloading the rows;
  // the CUDA backend draws on the device and copies back one int per row (a batch-32 step of
  // a 128K vocabulary: 128 bytes instead of 8 MB plus widening and sampling).
  virtual absl::Status DrawRows(const Tensor& logits, std::span<const RowDraw> draws,
                                std::span<int32_t> out);
  // Copies rows [src_row, src_row + n) of src to rows [dst_row, ...) of dst (same cols).
  virtual absl::Status CopyRows(const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row,
                                int64_t n) = 0;
  // Copies columns [src_col, src_col + n_cols) of every row of src to columns [dst_col, ...) of
  // dst (same rows): the pre-RoPE K and V of a projection kept in backend memory for storage.
  virtual absl::Status CopyCols(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                                int64_t n_cols) = 0;
};

// Weights of cfg's shapes, in the order tok_embeddings, final_norm, output, then per layer
// attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down, each made by `matrix` (rows, cols) or `norm`
// (n); on an error everything made so far is freed. Backends build RandomWeights on it.
using MatrixMaker = std::function<absl::StatusOr<Tensor>(int64_t rows, int64_t cols)>;
using NormMaker = std::function<absl::StatusOr<Tensor>(int64_t n)>;
absl::StatusOr<BackendWeights> MakeWeights(Backend& be, const ModelConfig& cfg,
                                           const MatrixMaker& matrix, const NormMaker& norm);

// What every backend requires of its inputs, checked in one place: slots inside the pool; for
// attention also the shapes, head counts, each query position inside the context and the
// statistics arrays sized to match. check_slots = false skips the slot-table range checks (a
// backend that has checked these very tables before, e.g. the same batch at the next layer).
absl::Status ValidateSlots(const KvPool& pool, std::span<const int32_t> slots);
absl::Status ValidateAttention(const Tensor& q, const KvPool& pool, const AttentionArgs& a,
                               const Tensor& out, bool check_slots = true);

// A batched attention call (a.seqs) as one call per sequence on row views: the CPU backend's
// way, and the CUDA backend's where its batched kernel does not apply.
absl::Status AttentionBySequence(Backend& be, const Tensor& q, const KvPool& pool, int layer,
                                 const AttentionArgs& a, Tensor& out);

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& opts);
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend();
// Defined only when SPARSEX_WITH_CUDA; CreateBackend reports Unavailable otherwise.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options = {});
// True when a CUDA device is usable in this process (false without CUDA or a driver).
bool CudaAvailable();

}  // namespace sparsex
