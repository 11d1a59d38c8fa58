// The model runner: one transformer layer at a time over an arbitrary set of rows, written once
// against the Backend interface. Dense prefill, chunked prefill, decode and sparse recompute
// all compose these calls; only the rows, their positions and their KV slots differ.
//
//   ASSIGN_OR_RETURN(auto r, ModelRunner::Create(model, backend.get(), kv_opts));
//   ASSIGN_OR_RETURN(Tensor x, r->Embed(ids));
//   for (int l = 0; l < r->config().n_layers; ++l) RETURN_IF_ERROR(r->Layer(l, x, rows));
//   ASSIGN_OR_RETURN(std::vector<float> logits, r->Logits(x, {x.rows - 1}));
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "gpu_worker/backend/backend.h"
#include "gpu_worker/engine/tensor_parallel.h"
#include "gpu_worker/kv/block_manager.h"

namespace sparsex {

// Rows [row_begin, row_end) of a batched Layer call belong to one sequence whose positions
// 0..ctx_len-1 live at ctx_slots.
using RowGroup = SeqRows;

// The rows one Layer call processes: all of one sequence, or (groups non-empty) rows of several
// sequences, e.g. one decode row per running sequence, sharing every matmul.
struct LayerRows {
  std::span<const int32_t> pos;        // [rows] absolute position of each row
  std::span<const int32_t> slots;      // [rows] KV slot each row's K/V is written to
  std::span<const int32_t> ctx_slots;  // [ctx_len] slot of every position of the sequence
  std::span<const RowGroup> groups = {};  // several sequences (ctx_slots unused); no statistics
};

// Copies of the pre-RoPE K and V of the processed rows, per layer (segment storage): on the
// host in fp32, or with on_backend in backend memory in the compute dtype (the caller frees
// dk/dv), which spares a GPU the download of the whole projection.
struct KvCapture {
  bool on_backend = false;
  std::vector<std::vector<float>> k, v;  // host: [n_layers][rows * kv_dim]
  std::vector<Tensor> dk, dv;            // on_backend: [n_layers] of [rows, kv_dim]
};

class ModelRunner {
 public:
  // With comm (tensor parallelism), `model` is this rank's shard (see ShardModel): the runner
  // all-reduces the attention and MLP outputs and the selection statistics.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const Model& model, Backend* backend,
                                                             const KvCacheOptions& kv,
                                                             Communicator* comm = nullptr);
  // Random weights of the given shapes (speed work; see Backend::RandomWeights).
  static absl::StatusOr<std::unique_ptr<ModelRunner>> CreateRandom(const ModelConfig& cfg,
                                                                   uint64_t seed,
                                                                   Backend* backend,
                                                                   const KvCacheOptions& kv,
                                                                   Communicator* comm = nullptr);
  ~ModelRunner();

  const ModelConfig& config() const { return cfg_; }
  Backend& backend() { return *be_; }
  KvPool& pool() { return pool_; }
  const RopeParams& rope() const { return rope_; }
  int kv_dim() const { return cfg_.n_kv_heads * cfg_.head_dim; }

  absl::StatusOr<Tensor> Embed(std::span<const int32_t> ids);
  // Runs layer l over the rows of x (residual stream, [rows, dim]) in place: writes their K/V
  // at rows.slots, attends each row over positions [0, pos] through rows.ctx_slots.
  //
  // `carry` (Forward's consecutive layers over the same rows) computes the next layer's
  // attention norm with a layer's closing residual add (after the down projection: one
  // AddRmsNorm instead of an Add and a RmsNorm; bit-identical). With carry->normed on entry,
  // carry->h already holds this layer's attention norm of x; on return it holds the next
  // layer's (normed) unless l is the last layer or tensor parallelism all-reduces the MLP
  // output. x is complete on return either way.
  // Forward's buffers across layers (allocated by it): the norm output and the down
  // projection's output.
  struct NormCarry {
    Tensor h;      // [rows, dim]
    Tensor delta;  // [rows, dim]
    bool normed = false;
  };
  absl::Status Layer(int l, Tensor& x, const LayerRows& rows, AttentionArgs* stats = nullptr,
                     KvCapture* capture = nullptr, NormCarry* carry = nullptr);
  // The pre-RoPE Q|K|V projection layer l would compute for the rows of x (no KV write, no
  // attention), in backend memory (caller frees): the CacheBlend deviation signal at the first
  // sparse layer. Columns: [q (H*hd) | k (kv_dim) | v (kv_dim)].
  absl::StatusOr<Tensor> ProjectQkv(int l, const Tensor& x);
  // What ProjectQkv costs per row in layers' worth of work: its weight multiply-adds over a
  // layer's (QKV, output, gate/up, down; attention, which depends on the context, left out).
  double ProjectionCost() const {
    const double d = cfg_.dim, hd = cfg_.head_dim, qkv = (cfg_.n_heads + 2.0 * cfg_.n_kv_heads) * hd;
    return d * qkv / (d * qkv + cfg_.n_heads * hd * d + 3.0 * d * cfg_.ffn_dim);
  }
  // Writes the K/V of a ProjectQkv result (RoPE at pos on K, in place) into layer l's pool at
  // slots, as Layer would for those rows.
  absl::Status WriteProjectedKv(int l, Tensor& qkv, std::span<const int32_t> pos,
                                std::span<const int32_t> slots);
  // Sums a host array over tensor-parallel ranks (no-op without tensor parallelism).
  absl::Status SumAcrossRanks(std::span<float> v) {
    return comm_ != nullptr ? comm_->AllReduceSumHost(v) : absl::OkStatus();
  }
  // Embeds ids, runs every layer over them (LayerRows as for Layer) and returns the logits of
  // out_rows (none: empty). With `graph` (and no tensor parallelism, whose collectives are not
  // recorded) the pass is one recorded backend scope (Backend::BeginGraph): decode steps of the
  // same batch replay one captured CUDA graph.
  absl::StatusOr<std::vector<float>> Forward(std::span<const int32_t> ids, const LayerRows& rows,
                                             std::span<const int32_t> out_rows,
                                             bool graph = false);
  // What a pass gives back for its output rows: the first draws.size() of them as the tokens
  // drawn on the backend (Backend::DrawRows: -1 where no token can be drawn), the rest as
  // logits ([(out_rows - draws) * vocab] fp32).
  struct HeadOut {
    std::vector<int32_t> drawn;
    std::vector<float> logits;
  };
  // Forward with the first draws.size() of out_rows drawn on the backend: a greedy or
  // plain-temperature decode step's logits never leave the device.
  absl::StatusOr<HeadOut> ForwardHead(std::span<const int32_t> ids, const LayerRows& rows,
                                      std::span<const int32_t> out_rows, bool graph,
                                      std::span<const RowDraw> draws);
  // Final norm + output projection of the given rows: [rows.size() * vocab] fp32.
  absl::StatusOr<std::vector<float>> Logits(const Tensor& x, std::span<const int32_t> rows);
  // The same projection, the first draws.size() rows drawn on the backend (HeadOut).
  absl::StatusOr<HeadOut> Head(const Tensor& x, std::span<const int32_t> rows,
                               std::span<const RowDraw> draws);
  // RoPE at `pos` applied to rows [row0, row0 + pos.size()) of pre-RoPE K (backend memory),
  // written with the same rows of V into the pool at slots.
  absl::Status AssembleKvFrom(int layer, const Tensor& k_pre, const Tensor& v, int64_t row0,
                              std::span<const int32_t> pos, std::span<const int32_t> slots);
  // RoPE at `pos` applied to pre-RoPE K rows from the host, written with V into the pool.
  absl::Status AssembleKv(int layer, std::span<const float> k_pre, std::span<const float> v,
                          std::span<const int32_t> pos, std::span<const int32_t> slots);

 private:
  ModelRunner() = default;
  absl::Status Init(const KvCacheOptions& kv);
  ModelConfig cfg_;
  Backend* be_ = nullptr;
  BackendWeights w_;
  KvPool pool_;
  Communicator* comm_ = nullptr;
  RopeParams rope_;
};

}  // namespace sparsex
