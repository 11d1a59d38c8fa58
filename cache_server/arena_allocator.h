// Offset allocator for the memory-tier arena: best fit over a free list that coalesces on free.
// Pure bookkeeping (no memory is touched); not thread-safe (BlockCache holds its lock).
//
//   ArenaAllocator a(1 << 30, 256);
//   std::optional<uint64_t> off = a.Allocate(16 << 20);
//   a.Free(*off, 16 << 20);
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace sparsex::cache {

class ArenaAllocator {
 public:
  // `alignment` must be a power of two.
  ArenaAllocator(uint64_t capacity, uint64_t alignment);

  // Offset of a free range of at least `size` bytes (rounded up to the alignment), or nullopt.
  std::optional<uint64_t> Allocate(uint64_t size);
  // Returns a range from Allocate (same size argument).
  void Free(uint64_t offset, uint64_t size);

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }  // rounded sizes
  uint64_t largest_free() const;
  uint64_t Rounded(uint64_t size) const { return (size + align_ - 1) & ~(align_ - 1); }
  size_t free_ranges() const { return by_offset_.size(); }

 private:
  void Insert(uint64_t off, uint64_t len);
  void Erase(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t capacity_, align_, used_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> length
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (length, offset)
};

}  // namespace sparsex::cache
