// Tensor-parallel communicators over NCCL for the GPUs of one process (one rank per device,
// each rank driven by its own thread). Compiled only with SPARSEX_WITH_CUDA and
// SPARSEX_WITH_NCCL; the header has no NCCL or CUDA dependency.
//
//   ASSIGN_OR_RETURN(auto comms, CreateNcclGroup({0, 1}));   // ranks 0, 1 on GPUs 0, 1
//   EngineOptions o; o.backend = {.kind = "cuda", .device = r};
//   o.tp = {.rank = r, .size = 2, .comm = comms[r].get()};
//
// AllReduceSum runs on the backend's CUDA stream (ordered with the layer's kernels, no host
// synchronisation); AllReduceSumHost stages the host array through a device buffer on the
// communicator's own stream and waits for it. NVLink multicast (NVLS) is switched off by
// setting NCCL_NVLS_ENABLE=0 before the communicators are made, unless the environment already
// sets it.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "gpu_worker/engine/tensor_parallel.h"

namespace sparsex {

// One communicator per entry of `devices` (rank r uses CUDA device devices[r]), made with
// ncclCommInitAll. Errors (no such device, NCCL failures) come back as a Status.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclGroup(
    std::span<const int> devices);

}  // namespace sparsex
