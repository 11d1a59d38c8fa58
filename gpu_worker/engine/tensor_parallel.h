// Tensor parallelism (Megatron-style) for models larger than one device: attention heads and KV
// heads are split across ranks, the MLP is split column-wise (gate/up) and row-wise (down), and
// the partial outputs of the attention projection and of the down projection are summed with an
// all-reduce. Every rank keeps only its KV heads in its paged cache and segment store; segment
// fingerprints stay those of the unsharded model.
//
//   auto group = CreateInProcessGroup(2);            // or an NCCL communicator per GPU
//   EngineOptions o; o.tp = {.rank = r, .size = 2, .comm = group[r].get()};
//   auto engine = Engine::Create(model, o);          // one engine (and thread) per rank
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "gpu_worker/backend/backend.h"

namespace sparsex {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In-place sum over all ranks of a backend tensor (same shape on every rank).
  virtual absl::Status AllReduceSum(Backend& be, Tensor& t) = 0;
  // In-place sum over all ranks of a host array (selection statistics).
  virtual absl::Status AllReduceSumHost(std::span<float> v) = 0;
};

// Ranks of one process exchanging through host memory (tests, CPU serving). Each rank must run
// on its own thread; collectives block until every rank has arrived.
std::vector<std::unique_ptr<Communicator>> CreateInProcessGroup(int size);

struct TensorParallelOptions {
  int rank = 0;                  // Default: 0
  int size = 1;                  // number of ranks; 1 disables sharding. Default: 1
  Communicator* comm = nullptr;  // required when size > 1 (not owned)
};

// This rank's shard of a model: a Model whose config has n_heads/size, n_kv_heads/size and
// ffn_dim/size, and whose weights are the matching slices (row slices alias the original
// mapping; column slices are copied). Keeps the original fingerprint.
absl::StatusOr<std::unique_ptr<Model>> ShardModel(const Model& model, int rank, int size);

}  // namespace sparsex
