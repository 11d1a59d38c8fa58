#include "cache_client/key_codec.h"

namespace sparsex::cache {

absl::StatusOr<BlockKey> KeyFromProto(const v1::BlockKey& k) {
  BlockKey key;
  ASSIGN_OR_RETURN(key.segment, DecodeFingerprint(k.segment_fp()));
  key.layer_begin = k.layer_begin();
  key.layer_end = k.layer_end();
  RETURN_IF_ERROR(ValidateBlockKey(key));
  return key;
}

void KeyToProto(const BlockKey& k, v1::BlockKey* out) {
  out->set_segment_fp(EncodeFingerprint(k.segment));
  out->set_layer_begin(k.layer_begin);
  out->set_layer_end(k.layer_end);
}

}  // namespace sparsex::cache
