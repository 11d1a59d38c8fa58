#include "common/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace sparsex {

bool HugePagesEnabled() {
  static const bool on = [] {
    const char* e = std::getenv("SPX_HUGE_PAGES");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on;
}

void AdviseHugePages(void* p, size_t bytes) {
  if (!HugePagesEnabled()) return;
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (begin + bytes) & ~(kHuge - 1);
  // Advice only: failure (no THP, a kernel without MADV_HUGEPAGE) keeps 4 KiB pages.
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
}

}  // namespace sparsex
