// Eviction order of a tier. The policy only orders keys; the tier decides what may go (leased
// and in-flight blocks are skipped by the visitor's predicate).
//
//   auto p = MakeEvictionPolicy(EvictionPolicyKind::kLru);
//   p->Insert(k, bytes, cost);  p->Touch(k);
//   p->ForEachCandidate([&](const BlockKey& k) { return TryEvict(k); /* true: stop */ });
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "cache_client/block_key.h"
#include "cache_server/options.h"

namespace sparsex::cache {

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // `cost`: recompute cost of the block (any unit, > 0); used by cost-aware policies.
  virtual void Insert(const BlockKey& k, uint64_t bytes, double cost) = 0;
  virtual void Touch(const BlockKey& k) = 0;
  // `evicted`: removed by eviction (cost-aware policies age by it) rather than deleted.
  virtual void Erase(const BlockKey& k, bool evicted) = 0;
  // Visits keys in eviction order until `fn` returns true. `fn` may Erase the visited key
  // (and only that key).
  virtual void ForEachCandidate(const std::function<bool(const BlockKey&)>& fn) = 0;
  virtual size_t size() const = 0;
};

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionPolicyKind kind);

}  // namespace sparsex::cache
