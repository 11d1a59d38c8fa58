#include "gpu_worker/reuse/host_arena.h"

#include <cstdlib>

namespace sparsex {

HostArena::HostArena(uint8_t* base, size_t bytes)
    : base_(base), bytes_(bytes / kAlign * kAlign) {
  ranges_.Reset(bytes_);
}

uint8_t* HostArena::Allocate(size_t n) {
  if (n == 0 || n > bytes_) return nullptr;
  const size_t need = (n + kAlign - 1) / kAlign * kAlign;
  std::lock_guard<std::mutex> l(mu_);
  const std::optional<size_t> off = ranges_.Take(need);
  if (!off) return nullptr;
  used_bytes_ += need;
  return base_ + *off;
}

void HostArena::Free(uint8_t* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> l(mu_);
  const size_t len = ranges_.Give(static_cast<size_t>(p - base_));
  if (len == 0) std::abort();  // not ours, or freed twice: memory would be handed out twice
  used_bytes_ -= len;
}

size_t HostArena::used() const {
  std::lock_guard<std::mutex> l(mu_);
  return used_bytes_;
}

}  // namespace sparsex
