#include "common/random.h"

#include <chrono>
#include <mutex>
#include <random>

namespace sparsex {

uint64_t RandomU64() {
  static std::mutex mu;
  static std::mt19937_64 g([] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }());
  std::lock_guard<std::mutex> l(mu);
  return g();
}

std::string RandomHex(int n) {
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += kHex[RandomU64() % 16];
  return s;
}

}  // namespace sparsex
