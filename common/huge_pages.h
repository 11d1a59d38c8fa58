// Transparent huge pages for large, freshly allocated host buffers (segment KV, KV blocks).
//
// A segment of an 8B model is ~1 GiB of fp32 K/V; filling fresh memory faults once per 4 KiB
// page, and on a VM those faults cost most of a cluster fetch (docs/benchmarks.md, "Where a
// cluster fetch goes"). Advising the buffer before its first touch lets the kernel back its
// 2 MiB-aligned interior with huge pages (one fault per 2 MiB) where THP is enabled as
// "madvise" or "always"; elsewhere the advice is ignored.
//
//   std::vector<float> v;
//   ResizeHuge(v, n);  // reserve, advise, then resize (the zero-fill is the first touch)
#pragma once

#include <cstddef>

namespace sparsex {

// Whether AdviseHugePages advises: true unless the environment sets SPX_HUGE_PAGES=0 (read
// once per process; operators who keep THP for other workloads, and same-run comparisons).
bool HugePagesEnabled();
// Advises [p, p + bytes) for huge pages (its 2 MiB-aligned interior); no effect when smaller.
void AdviseHugePages(void* p, size_t bytes);

// Resizes a contiguous container (std::vector, std::string) to n elements, advising a new
// allocation for huge pages before the resize touches it.
template <typename C>
void ResizeHuge(C& c, size_t n) {
  if (c.capacity() < n) {
    c.reserve(n);
    AdviseHugePages(c.data(), n * sizeof(*c.data()));
  }
  c.resize(n);
}

}  // namespace sparsex
