#include "gpu_worker/reuse/host_arena.h"

#include <cstdlib>
#include <iterator>

namespace sparsex {

HostArena::HostArena(uint8_t* base, size_t bytes)
    : base_(base), bytes_(bytes / kAlign * kAlign) {
  if (bytes_ > 0) free_.emplace(0, bytes_);
}

uint8_t* HostArena::Allocate(size_t n) {
  if (n == 0 || n > bytes_) return nullptr;
  const size_t need = (n + kAlign - 1) / kAlign * kAlign;
  std::lock_guard<std::mutex> l(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const size_t off = it->first, len = it->second;
    free_.erase(it);
    if (len > need) free_.emplace(off + need, len - need);
    used_.emplace(off, need);
    used_bytes_ += need;
    return base_ + off;
  }
  return nullptr;
}

void HostArena::Free(uint8_t* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> l(mu_);
  auto u = used_.find(static_cast<size_t>(p - base_));
  if (u == used_.end()) std::abort();  // not ours, or freed twice: memory would be handed out twice
  size_t off = u->first, len = u->second;
  used_.erase(u);
  used_bytes_ -= len;
  // Merge with the free ranges on either side.
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
}

size_t HostArena::used() const {
  std::lock_guard<std::mutex> l(mu_);
  return used_bytes_;
}

}  // namespace sparsex
