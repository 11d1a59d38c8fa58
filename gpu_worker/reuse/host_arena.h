// A thread-safe first-fit allocator over one fixed block of memory that the caller owns.
//
// The streaming cluster fetch decodes each segment straight into such a block when the backend
// pinned it (ReuseOptions::stream_pinned_bytes): the engine then copies a streamed layer to the
// GPU by DMA alone, where pageable memory needed a host copy into staging chunks first (on the
// H200 that copy, ~131 MB a layer for a 32K prompt, kept the prefill ~0.3 s behind the fetch).
// Pinning is slow (cudaHostAlloc of gigabytes takes seconds), so the block is pinned once and
// carved here.
//
//   HostArena a(base, bytes);
//   uint8_t* p = a.Allocate(n);  // nullptr when no free range fits (the caller falls back)
//   a.Free(p);
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "common/range_allocator.h"

namespace sparsex {

class HostArena {
 public:
  // Ranges start at multiples of kAlign from base (a DMA engine reads aligned rows fastest).
  static constexpr size_t kAlign = 4096;
  HostArena(uint8_t* base, size_t bytes);
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // At least n bytes (n > 0), or nullptr when no free range is large enough. Any thread.
  uint8_t* Allocate(size_t n);
  // Gives back a range Allocate returned (adjacent free ranges merge). Any thread.
  void Free(uint8_t* p);
  size_t capacity() const { return bytes_; }
  size_t used() const;  // bytes handed out (rounded up to kAlign)

 private:
  uint8_t* const base_;
  const size_t bytes_;
  mutable std::mutex mu_;
  RangeAllocator ranges_;  // under mu_
  size_t used_bytes_ = 0;
};

}  // namespace sparsex
