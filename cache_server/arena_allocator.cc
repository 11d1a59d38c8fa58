#include "cache_server/arena_allocator.h"

#include <cassert>

namespace sparsex::cache {

ArenaAllocator::ArenaAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity & ~(alignment - 1)), align_(alignment) {
  assert(alignment > 0 && (alignment & (alignment - 1)) == 0);
  if (capacity_ > 0) Insert(0, capacity_);
}

void ArenaAllocator::Insert(uint64_t off, uint64_t len) {
  by_offset_.emplace(off, len);
  by_size_.emplace(len, off);
}

void ArenaAllocator::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  by_offset_.erase(it);
}

std::optional<uint64_t> ArenaAllocator::Allocate(uint64_t size) {
  if (size == 0) size = 1;
  const uint64_t need = Rounded(size);
  auto it = by_size_.lower_bound({need, 0});
  if (it == by_size_.end()) return std::nullopt;
  const uint64_t off = it->second, len = it->first;
  Erase(by_offset_.find(off));
  if (len > need) Insert(off + need, len - need);
  used_ += need;
  return off;
}

void ArenaAllocator::Free(uint64_t offset, uint64_t size) {
  if (size == 0) size = 1;
  uint64_t len = Rounded(size);
  used_ -= len;
  uint64_t off = offset;
  auto next = by_offset_.lower_bound(off);
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      Erase(prev);
    }
  }
  next = by_offset_.lower_bound(off);
  if (next != by_offset_.end() && off + len == next->first) {
    len += next->second;
    Erase(next);
  }
  Insert(off, len);
}

uint64_t ArenaAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

}  // namespace sparsex::cache
