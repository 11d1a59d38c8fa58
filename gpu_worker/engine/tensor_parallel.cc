#include "gpu_worker/engine/tensor_parallel.h"

#include <condition_variable>
#include <cstring>
#include <mutex>

namespace sparsex {
namespace {

// Shared state of an in-process group: a reusable two-phase barrier around a host accumulator.
struct GroupState {
  explicit GroupState(int n) : size(n), parts(n) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<float> acc;
  // Each rank's contribution, summed in rank order by the last rank to arrive: a float sum
  // depends on its order, and the arrival order is a race.
  std::vector<std::vector<float>> parts;
  int arrived = 0, departed = 0;
  uint64_t generation = 0;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<GroupState> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }

  absl::Status AllReduceSumHost(std::span<float> v) override {
    std::unique_lock<std::mutex> l(g_->mu);
    // Wait until the previous collective has fully drained.
    g_->cv.wait(l, [&] { return g_->departed == 0; });
    if (g_->arrived == 0) g_->acc.assign(v.size(), 0.0f);
    if (g_->acc.size() != v.size()) {
      return absl::InvalidArgumentError("all-reduce: ranks passed different sizes");
    }
    g_->parts[rank_].assign(v.begin(), v.end());
    const uint64_t gen = g_->generation;
    if (++g_->arrived == g_->size) {
      for (const std::vector<float>& part : g_->parts) {
        for (size_t i = 0; i < v.size(); ++i) g_->acc[i] += part[i];
      }
      g_->arrived = 0;
      g_->departed = g_->size;
      ++g_->generation;
      g_->cv.notify_all();
    } else {
      g_->cv.wait(l, [&] { return g_->generation != gen; });
    }
    std::memcpy(v.data(), g_->acc.data(), v.size_bytes());
    if (--g_->departed == 0) g_->cv.notify_all();
    return absl::OkStatus();
  }

  absl::Status AllReduceSum(Backend& be, Tensor& t) override {
    std::vector<float> host(static_cast<size_t>(t.rows * t.cols));
    RETURN_IF_ERROR(be.Download(t, host));
    RETURN_IF_ERROR(AllReduceSumHost(host));
    return be.Upload(host, t);
  }

 private:
  std::shared_ptr<GroupState> g_;
  int rank_;
};

// Row slice [r0, r0 + rows) of a [R, C] view: contiguous, aliases the source bytes.
TensorView RowSlice(const TensorView& v, int64_t r0, int64_t rows) {
  TensorView out = v;
  const int64_t cols = v.shape.size() == 2 ? v.shape[1] : 1;
  const size_t es = DTypeSize(v.dtype);
  out.data = static_cast<const uint8_t*>(v.data) + r0 * cols * es;
  out.shape = {rows, cols};
  out.nbytes = rows * cols * es;
  return out;
}

// Column slice [c0, c0 + cols) of a [R, C] view, copied to fp32 into owned storage.
TensorView ColSlice(const TensorView& v, int64_t c0, int64_t cols, Model& owner) {
  const int64_t R = v.shape[0], C = v.shape[1];
  std::vector<float> full(static_cast<size_t>(R * C));
  v.ToF32(full.data());
  std::vector<uint8_t>& buf = owner.owned_.emplace_back(static_cast<size_t>(R * cols) * 4);
  float* dst = reinterpret_cast<float*>(buf.data());
  for (int64_t r = 0; r < R; ++r) std::memcpy(dst + r * cols, full.data() + r * C + c0, cols * 4);
  TensorView out;
  out.name = v.name;
  out.dtype = DType::kF32;
  out.shape = {R, cols};
  out.data = buf.data();
  out.nbytes = buf.size();
  return out;
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateInProcessGroup(int size) {
  auto g = std::make_shared<GroupState>(size);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<InProcessCommunicator>(g, r));
  return out;
}

absl::StatusOr<std::unique_ptr<Model>> ShardModel(const Model& m, int rank, int size) {
  const ModelConfig& c = m.config();
  if (size < 1 || rank < 0 || rank >= size) return absl::InvalidArgumentError("bad TP rank/size");
  if (c.n_heads % size || c.n_kv_heads % size || c.ffn_dim % size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor parallel degree ", size, " must divide heads (", c.n_heads, "), kv heads (",
        c.n_kv_heads, ") and ffn_dim (", c.ffn_dim, ")"));
  }
  auto s = std::make_unique<Model>();
  s->config_ = c;
  s->config_.n_heads = c.n_heads / size;
  s->config_.n_kv_heads = c.n_kv_heads / size;
  s->config_.ffn_dim = c.ffn_dim / size;
  s->fingerprint_ = m.fingerprint();  // same KV identity for every TP degree
  s->source_ = m.source();
  s->owned_.reserve(2 * c.n_layers);  // ColSlice keeps pointers into these buffers
  const int64_t hd = c.head_dim;
  const int64_t qh = s->config_.n_heads, kvh = s->config_.n_kv_heads, ff = s->config_.ffn_dim;
  const ModelWeights& w = m.weights();
  s->weights_.tok_embeddings = w.tok_embeddings;
  s->weights_.final_norm = w.final_norm;
  s->weights_.output = w.output;
  for (const LayerWeights& lw : w.layers) {
    LayerWeights o;
    o.attn_norm = lw.attn_norm;
    o.ffn_norm = lw.ffn_norm;
    o.wq = RowSlice(lw.wq, rank * qh * hd, qh * hd);
    o.wk = RowSlice(lw.wk, rank * kvh * hd, kvh * hd);
    o.wv = RowSlice(lw.wv, rank * kvh * hd, kvh * hd);
    o.wo = ColSlice(lw.wo, rank * qh * hd, qh * hd, *s);
    o.w_gate = RowSlice(lw.w_gate, rank * ff, ff);
    o.w_up = RowSlice(lw.w_up, rank * ff, ff);
    o.w_down = ColSlice(lw.w_down, rank * ff, ff, *s);
    s->weights_.layers.push_back(o);
  }
  return s;
}

}  // namespace sparsex
