// First-fit ranges of one span of offsets [0, size): the bookkeeping of an arena over memory
// its owner holds (the CUDA backend's graph arena of device memory, the engine's pinned block
// that streamed fetches decode into). Freed ranges merge with free neighbours. Not
// thread-safe: the owner locks where it needs to.
//
//   RangeAllocator r;
//   r.Reset(bytes);
//   std::optional<size_t> off = r.Take(n);  // n already rounded as the owner aligns
//   r.Give(*off);
#pragma once

#include <cstddef>
#include <map>
#include <optional>

namespace sparsex {

class RangeAllocator {
 public:
  // Forgets every range: all of [0, size) free.
  void Reset(size_t size);
  // The offset of the first free range of at least `bytes`; nullopt when none is that large.
  std::optional<size_t> Take(size_t bytes);
  // Gives back the range taken at `offset`; its length, or 0 when no range was taken there.
  size_t Give(size_t offset);
  size_t live() const { return used_.size(); }  // ranges taken

 private:
  std::map<size_t, size_t> free_, used_;  // offset -> length; free ranges never adjacent
};

}  // namespace sparsex
