// Fault injection into a worker's host segment store, for tests: the store keeps no hook for
// it. Beside the tests that use it: testing/ holds no engine code (tests/arch).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

#include "gpu_worker/reuse/segment_store.h"

namespace sparsex::testing {

// Flips one bit of the first K value of the segment stored under fp, in place, as a stray
// write or a bad DIMM would: the entry stays, its block checksums no longer match, and the
// next use must find it corrupt. Counts one hit (the lookup). False when fp is not stored.
// The store's entries are not const objects (it hands out const views of them), so the write
// through const_cast is defined; callers run it while nothing else uses the store.
inline bool CorruptStoredSegment(SegmentStore& store, const Hash128& fp) {
  std::shared_ptr<const SegmentKv> kv = store.Get(fp);
  if (kv == nullptr || kv->k.empty() || kv->k[0].empty()) return false;
  float& x = const_cast<float&>(kv->k[0][0]);
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u ^= 0x00400000u;
  std::memcpy(&x, &u, 4);
  return true;
}

}  // namespace sparsex::testing
