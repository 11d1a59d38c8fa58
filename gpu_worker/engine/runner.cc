#include "gpu_worker/engine/runner.h"

#include <deque>

namespace sparsex {
namespace {

// Frees backend tensors at scope exit so every error path releases scratch memory.
class Scratch {
 public:
  explicit Scratch(Backend* be) : be_(be) {}
  ~Scratch() {
    for (Tensor& t : ts_) be_->Free(t);
  }
  absl::StatusOr<Tensor*> Get(int64_t rows, int64_t cols) {
    ASSIGN_OR_RETURN(Tensor t, be_->Alloc(rows, cols));
    ts_.push_back(t);
    return &ts_.back();
  }

 private:
  Backend* be_;
  std::deque<Tensor> ts_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const Model& model,
                                                                 Backend* backend,
                                                                 const KvCacheOptions& kv,
                                                                 Communicator* comm) {
  std::unique_ptr<ModelRunner> r(new ModelRunner());
  r->cfg_ = model.config();
  r->be_ = backend;
  r->comm_ = comm != nullptr && comm->size() > 1 ? comm : nullptr;
  ASSIGN_OR_RETURN(r->w_, backend->LoadWeights(model));
  RETURN_IF_ERROR(r->Init(kv));
  return r;
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::CreateRandom(const ModelConfig& cfg,
                                                                       uint64_t seed,
                                                                       Backend* backend,
                                                                       const KvCacheOptions& kv,
                                                                       Communicator* comm) {
  std::unique_ptr<ModelRunner> r(new ModelRunner());
  r->cfg_ = cfg;
  r->be_ = backend;
  r->comm_ = comm != nullptr && comm->size() > 1 ? comm : nullptr;
  ASSIGN_OR_RETURN(r->w_, backend->RandomWeights(cfg, seed));
  RETURN_IF_ERROR(r->Init(kv));
  return r;
}

absl::Status ModelRunner::Init(const KvCacheOptions& kv) {
  rope_.head_dim = cfg_.head_dim;
  rope_.theta = cfg_.rope_theta;
  rope_.layout = cfg_.rope_layout;
  rope_.scaling = cfg_.rope_scaling;
  ASSIGN_OR_RETURN(pool_, be_->AllocKvPool(cfg_.n_layers, kv.num_blocks, kv.block_size,
                                           kv_dim()));
  return absl::OkStatus();
}

ModelRunner::~ModelRunner() {
  if (be_ == nullptr) return;
  be_->FreeWeights(w_);
  be_->FreeKvPool(pool_);
}

absl::StatusOr<Tensor> ModelRunner::Embed(std::span<const int32_t> ids) {
  ASSIGN_OR_RETURN(Tensor x, be_->Alloc(static_cast<int64_t>(ids.size()), cfg_.dim));
  absl::Status s = be_->Embedding(w_.tok_embeddings, ids, x);
  if (!s.ok()) {
    be_->Free(x);
    return s;
  }
  return x;
}

absl::Status ModelRunner::Layer(int l, Tensor& x, const LayerRows& rows, AttentionArgs* stats,
                                KvCapture* capture, NormCarry* carry) {
  const int64_t n = x.rows;
  if (n == 0) return absl::OkStatus();
  if (static_cast<int64_t>(rows.pos.size()) != n || static_cast<int64_t>(rows.slots.size()) != n) {
    return absl::InvalidArgumentError("Layer: positions and slots must match the rows");
  }
  const BackendLayer& w = w_.layers[l];
  const int H = cfg_.n_heads, KV = cfg_.n_kv_heads, hd = cfg_.head_dim;
  Scratch s(be_);
  Tensor* h = carry != nullptr ? &carry->h : nullptr;
  if (h == nullptr) {
    ASSIGN_OR_RETURN(h, s.Get(n, cfg_.dim));
  }
  // The attention norm, unless the previous layer's closing residual add computed it already.
  if (carry != nullptr && carry->normed) {
    carry->normed = false;
  } else {
    RETURN_IF_ERROR(be_->RmsNorm(x, w.attn_norm, cfg_.rms_eps, *h));
  }
  ASSIGN_OR_RETURN(Tensor* qkv, s.Get(n, static_cast<int64_t>(H + 2 * KV) * hd));
  RETURN_IF_ERROR(be_->MatMul(*h, w.wqkv, *qkv));
  if (capture != nullptr && capture->on_backend) {
    // K before RoPE and V are what a segment stores: position-independent.
    const int64_t kd = kv_dim(), qd = static_cast<int64_t>(H) * hd;
    ASSIGN_OR_RETURN(Tensor k, be_->Alloc(n, kd));
    capture->dk.push_back(k);
    ASSIGN_OR_RETURN(Tensor v, be_->Alloc(n, kd));
    capture->dv.push_back(v);
    RETURN_IF_ERROR(be_->CopyCols(*qkv, qd, capture->dk.back(), 0, kd));
    RETURN_IF_ERROR(be_->CopyCols(*qkv, qd + kd, capture->dv.back(), 0, kd));
  } else if (capture != nullptr) {
    // K before RoPE and V are what a segment stores: position-independent.
    std::vector<float> all(static_cast<size_t>(qkv->rows * qkv->cols));
    RETURN_IF_ERROR(be_->Download(*qkv, all));
    const int64_t kd = kv_dim(), qd = static_cast<int64_t>(H) * hd;
    auto& k = capture->k.emplace_back(n * kd);
    auto& v = capture->v.emplace_back(n * kd);
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(all.begin() + i * qkv->cols + qd, kd, k.begin() + i * kd);
      std::copy_n(all.begin() + i * qkv->cols + qd + kd, kd, v.begin() + i * kd);
    }
  }
  // K before RoPE is captured above; then the rotation and the KV write (Q and K heads are
  // adjacent columns: one rotation pass over both, fused with the KV write).
  RETURN_IF_ERROR(be_->RopeWriteKv(pool_, l, *qkv, H, rows.pos, rows.slots, rope_));
  AttentionArgs args;
  // Under tensor parallelism each rank sees only its heads: statistics are gathered into
  // zeroed local arrays, summed over ranks and averaged, so every rank selects identically.
  std::vector<float> cross_local, recv_local;
  if (stats != nullptr) {
    args = *stats;
    if (comm_ != nullptr) {
      if (stats->out_cross != nullptr) {
        cross_local.assign(n, 0.0f);
        args.out_cross = cross_local.data();
      }
      if (stats->out_recv != nullptr) {
        recv_local.assign(rows.ctx_slots.size(), 0.0f);
        args.out_recv = recv_local.data();
      }
    }
  }
  args.n_heads = H;
  args.n_kv_heads = KV;
  args.head_dim = hd;
  args.q_pos = rows.pos;
  args.ctx_slots = rows.ctx_slots;
  ASSIGN_OR_RETURN(Tensor* att, s.Get(n, static_cast<int64_t>(H) * hd));
  if (!rows.groups.empty()) {
    if (stats != nullptr) {
      return absl::InvalidArgumentError("Layer: no selection statistics for batched rows");
    }
    args.seqs = rows.groups;
  }
  RETURN_IF_ERROR(be_->Attention(*qkv, pool_, l, args, *att));
  if (comm_ != nullptr && stats != nullptr) {
    const float inv = 1.0f / static_cast<float>(comm_->size());
    for (auto [local, out] : {std::pair{&cross_local, stats->out_cross},
                              std::pair{&recv_local, stats->out_recv}}) {
      if (out == nullptr) continue;
      RETURN_IF_ERROR(comm_->AllReduceSumHost(*local));
      for (size_t i = 0; i < local->size(); ++i) out[i] += (*local)[i] * inv;
    }
  }
  // The attention output joins the residual stream in the same pass as the MLP's norm; under
  // tensor parallelism the partial projections are all-reduced first.
  ASSIGN_OR_RETURN(Tensor* o, s.Get(n, cfg_.dim));
  RETURN_IF_ERROR(be_->MatMul(*att, w.wo, *o));
  if (comm_ != nullptr) RETURN_IF_ERROR(comm_->AllReduceSum(*be_, *o));
  RETURN_IF_ERROR(be_->AddRmsNorm(x, *o, w.ffn_norm, cfg_.rms_eps, *h));
  // gate_up and SwiGLU as one operation: the CUDA backend runs decode rows as one kernel that
  // never writes the [n, 2*ffn] intermediate; other row counts and backends compute the same.
  ASSIGN_OR_RETURN(Tensor* act, s.Get(n, cfg_.ffn_dim));
  RETURN_IF_ERROR(be_->MatMulSwiGLU(*h, w.w_gate_up, *act));
  if (comm_ == nullptr && carry != nullptr && l + 1 < cfg_.n_layers) {
    // The closing residual add with the next layer's attention norm.
    RETURN_IF_ERROR(be_->MatMul(*act, w.w_down, carry->delta));
    RETURN_IF_ERROR(be_->AddRmsNorm(x, carry->delta, w_.layers[l + 1].attn_norm, cfg_.rms_eps,
                                    carry->h));
    carry->normed = true;
    return absl::OkStatus();
  }
  if (comm_ == nullptr) return be_->MatMulAdd(*act, w.w_down, x);
  RETURN_IF_ERROR(be_->MatMul(*act, w.w_down, *o));
  RETURN_IF_ERROR(comm_->AllReduceSum(*be_, *o));
  return be_->Add(x, *o);
}

absl::StatusOr<std::vector<float>> ModelRunner::Forward(std::span<const int32_t> ids,
                                                       const LayerRows& rows,
                                                       std::span<const int32_t> out_rows,
                                                       bool graph) {
  ASSIGN_OR_RETURN(HeadOut h, ForwardHead(ids, rows, out_rows, graph, {}));
  return std::move(h.logits);
}

absl::StatusOr<ModelRunner::HeadOut> ModelRunner::ForwardHead(std::span<const int32_t> ids,
                                                              const LayerRows& rows,
                                                              std::span<const int32_t> out_rows,
                                                              bool graph,
                                                              std::span<const RowDraw> draws) {
  graph = graph && comm_ == nullptr;
  if (graph) RETURN_IF_ERROR(be_->BeginGraph());
  absl::StatusOr<HeadOut> logits = HeadOut{};
  absl::StatusOr<Tensor> x = Embed(ids);
  if (!x.ok()) logits = x.status();
  NormCarry carry;  // one norm buffer and one delta buffer for all layers
  bool have_carry = false;
  if (x.ok() && x->rows > 0) {
    absl::StatusOr<Tensor> h = be_->Alloc(x->rows, cfg_.dim);
    absl::StatusOr<Tensor> delta = be_->Alloc(x->rows, cfg_.dim);
    if (h.ok() && delta.ok()) {
      carry.h = *h;
      carry.delta = *delta;
      have_carry = true;
    } else {
      if (h.ok()) be_->Free(*h);
      if (delta.ok()) be_->Free(*delta);
      logits = h.ok() ? delta.status() : h.status();
    }
  }
  for (int l = 0; l < cfg_.n_layers && logits.ok(); ++l) {
    absl::Status st = Layer(l, *x, rows, nullptr, nullptr, have_carry ? &carry : nullptr);
    if (!st.ok()) logits = st;
  }
  if (logits.ok() && !out_rows.empty()) logits = Head(*x, out_rows, draws);
  if (x.ok()) be_->Free(*x);
  if (have_carry) {
    be_->Free(carry.h);
    be_->Free(carry.delta);
  }
  if (graph) {
    absl::Status st = be_->EndGraph();
    if (!st.ok() && logits.ok()) logits = st;
  }
  return logits;
}

absl::StatusOr<Tensor> ModelRunner::ProjectQkv(int l, const Tensor& x) {
  const int64_t n = x.rows;
  const int64_t cols = static_cast<int64_t>(cfg_.n_heads) * cfg_.head_dim + 2 * kv_dim();
  Scratch s(be_);
  ASSIGN_OR_RETURN(Tensor* h, s.Get(n, cfg_.dim));
  RETURN_IF_ERROR(be_->RmsNorm(x, w_.layers[l].attn_norm, cfg_.rms_eps, *h));
  ASSIGN_OR_RETURN(Tensor qkv, be_->Alloc(n, cols));
  absl::Status st = be_->MatMul(*h, w_.layers[l].wqkv, qkv);
  if (!st.ok()) {
    be_->Free(qkv);
    return st;
  }
  return qkv;
}

absl::Status ModelRunner::WriteProjectedKv(int l, Tensor& qkv, std::span<const int32_t> pos,
                                           std::span<const int32_t> slots) {
  return be_->RopeWriteKv(pool_, l, qkv, cfg_.n_heads, pos, slots, rope_);
}

absl::Status ModelRunner::AssembleKvFrom(int layer, const Tensor& k_pre, const Tensor& v,
                                         int64_t row0, std::span<const int32_t> pos,
                                         std::span<const int32_t> slots) {
  return be_->AssembleKv(pool_, layer, k_pre, v, row0, pos, slots, rope_);
}

absl::StatusOr<std::vector<float>> ModelRunner::Logits(const Tensor& x,
                                                       std::span<const int32_t> rows) {
  ASSIGN_OR_RETURN(HeadOut h, Head(x, rows, {}));
  return std::move(h.logits);
}

absl::StatusOr<ModelRunner::HeadOut> ModelRunner::Head(const Tensor& x,
                                                       std::span<const int32_t> rows,
                                                       std::span<const RowDraw> draws) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t drawn = static_cast<int64_t>(draws.size());
  if (drawn > n) return absl::InvalidArgumentError("Head: more draws than rows");
  Scratch s(be_);
  ASSIGN_OR_RETURN(Tensor* sel, s.Get(n, cfg_.dim));
  RETURN_IF_ERROR(be_->GatherRows(x, rows, *sel));
  ASSIGN_OR_RETURN(Tensor* h, s.Get(n, cfg_.dim));
  ASSIGN_OR_RETURN(Tensor* lg, s.Get(n, cfg_.vocab_size));
  RETURN_IF_ERROR(be_->RmsNorm(*sel, w_.final_norm, cfg_.rms_eps, *h));
  RETURN_IF_ERROR(be_->MatMul(*h, w_.output, *lg));
  HeadOut out;
  out.drawn.resize(drawn);
  if (drawn > 0) RETURN_IF_ERROR(be_->DrawRows(RowView(*lg, 0, drawn), draws, out.drawn));
  out.logits.resize(static_cast<size_t>(n - drawn) * cfg_.vocab_size);
  if (drawn < n) RETURN_IF_ERROR(be_->Download(RowView(*lg, drawn, n - drawn), out.logits));
  return out;
}

absl::Status ModelRunner::AssembleKv(int layer, std::span<const float> k_pre,
                                     std::span<const float> v, std::span<const int32_t> pos,
                                     std::span<const int32_t> slots) {
  const int64_t n = static_cast<int64_t>(pos.size());
  if (n == 0) return absl::OkStatus();
  const int64_t kd = kv_dim();
  if (static_cast<int64_t>(k_pre.size()) != n * kd || static_cast<int64_t>(v.size()) != n * kd ||
      static_cast<int64_t>(slots.size()) != n) {
    return absl::InvalidArgumentError("AssembleKv: sizes do not match");
  }
  Scratch s(be_);
  ASSIGN_OR_RETURN(Tensor* k, s.Get(n, kd));
  ASSIGN_OR_RETURN(Tensor* vt, s.Get(n, kd));
  RETURN_IF_ERROR(be_->Upload(k_pre, *k));
  RETURN_IF_ERROR(be_->Upload(v, *vt));
  RETURN_IF_ERROR(be_->Rope(*k, 0, cfg_.n_kv_heads, pos, rope_));
  return be_->WriteKv(pool_, layer, *k, 0, *vt, 0, slots);
}

}  // namespace sparsex
