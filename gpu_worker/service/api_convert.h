// Conversions between the API messages (proto/sparsex.proto) and the engine's option structs,
// shared by the router (early validation) and the worker (execution), so both apply the same
// defaults and the same checks.
#pragma once

#include "common/hash.h"
#include "common/status.h"
#include "gpu_worker/engine/sampler.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "proto/sparsex.pb.h"

namespace sparsex::service {

// Unset fields take the API defaults (temperature 0, top_p 1, max_tokens 16). INVALID_ARGUMENT
// with a message naming the field when a value is out of range.
absl::StatusOr<SamplingParams> SamplingFromProto(const v1::SamplingParams& p);
// `defaults` with the request's set fields applied; validated against the model's layer count.
absl::StatusOr<ReuseOptions> ReuseFromProto(const v1::ReuseOptions& p,
                                            const ReuseOptions& defaults, int n_layers);

// Hash128 <-> 16 bytes, big-endian (hi then lo): the fingerprint encoding of every proto.
std::string EncodeFingerprintBytes(const Hash128& h);
absl::StatusOr<Hash128> DecodeFingerprintBytes(std::string_view s);

// UTF-8 checks for API strings (proto3 strings must be valid UTF-8 on the wire).
bool IsValidUtf8(std::string_view s);
std::string SanitizeUtf8(std::string_view s);  // invalid sequences become U+FFFD

}  // namespace sparsex::service
