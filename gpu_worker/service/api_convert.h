// Conversions between the API messages (proto/sparsex.proto) and the engine's option structs:
// the worker's validation of a request at its process boundary. The range checks come from
// proto/request_check.h, which the router applies too.
#pragma once

#include "common/hash.h"
#include "common/status.h"
#include "gpu_worker/engine/sampler.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "proto/sparsex.pb.h"

namespace sparsex::service {

// The sampling seed of a request: its `seed` when set (reproducible), else a fresh random one.
uint64_t SeedFor(const v1::SamplingParams& p);
// Unset fields take the API defaults (temperature 0, top_p 1, max_tokens 16; no seed: a fresh
// random one, SeedFor). INVALID_ARGUMENT with a message naming the field when a value is out
// of range (stop_ids against vocab_size when it is > 0).
absl::StatusOr<SamplingParams> SamplingFromProto(const v1::SamplingParams& p, int vocab_size = 0);
// `defaults` with the request's set fields applied; validated against the model's layer count.
absl::StatusOr<ReuseOptions> ReuseFromProto(const v1::ReuseOptions& p,
                                            const ReuseOptions& defaults, int n_layers);

}  // namespace sparsex::service
