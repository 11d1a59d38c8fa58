// BlockKey <-> its proto message (proto/cache.proto), shared by the client and the server.
#pragma once

#include "cache_client/block_key.h"
#include "common/status.h"
#include "proto/cache.pb.h"

namespace sparsex::cache {

// INVALID_ARGUMENT for a malformed fingerprint or an empty layer range.
absl::StatusOr<BlockKey> KeyFromProto(const v1::BlockKey& k);
void KeyToProto(const BlockKey& k, v1::BlockKey* out);

}  // namespace sparsex::cache
