#include "cache_client/types.h"

namespace sparsex::cache {

const char* TierName(Tier t) {
  switch (t) {
    case Tier::kMemory: return "memory";
    case Tier::kDisk: return "disk";
    case Tier::kNone: break;
  }
  return "none";
}

}  // namespace sparsex::cache
