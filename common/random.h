// Random identifiers (request ids, process instance ids): not for cryptography. One generator
// per process, seeded from std::random_device and the clock, shared under a mutex.
//
//   std::string id = "req-" + RandomHex(16);
//   uint64_t instance = RandomU64();
#pragma once

#include <cstdint>
#include <string>

namespace sparsex {

uint64_t RandomU64();
std::string RandomHex(int n);  // n lowercase hex digits

}  // namespace sparsex
