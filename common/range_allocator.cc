#include "common/range_allocator.h"

#include <iterator>

namespace sparsex {

void RangeAllocator::Reset(size_t size) {
  free_.clear();
  used_.clear();
  if (size > 0) free_.emplace(0, size);
}

std::optional<size_t> RangeAllocator::Take(size_t bytes) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const size_t off = it->first, len = it->second;
    free_.erase(it);
    if (len > bytes) free_.emplace(off + bytes, len - bytes);
    used_.emplace(off, bytes);
    return off;
  }
  return std::nullopt;
}

size_t RangeAllocator::Give(size_t offset) {
  auto u = used_.find(offset);
  if (u == used_.end()) return 0;
  const size_t taken = u->second;
  size_t off = offset, len = taken;
  used_.erase(u);
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(off, len);
  return taken;
}

}  // namespace sparsex
