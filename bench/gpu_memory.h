// Device memory figures for the GPU benchmarks' records: how much a prefill needs at its peak.
// Weights and the KV pool are cudaMalloc'd once (static); activations, scratch and the
// backend's other tensors (e.g. a device tier) come from the stream-ordered pool
// (cudaMallocAsync), whose high-water mark CUDA tracks.
// Peak = static + the pool's high-water mark since the last Reset (the pool may reserve a
// little more than it hands out). CPU builds report zeros.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#if SPARSEX_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sparsex::bench {

struct GpuMemory {
  double total_gib = 0;      // the device's memory
  double static_gib = 0;     // in use outside the stream-ordered pool when Reset ran
  double pool_peak_gib = 0;  // the pool's high-water mark since Reset
  double peak_gib() const { return static_gib + pool_peak_gib; }
  // ", \"mem_peak_gib\": ..." fields for a JSON record (empty on CPU builds).
  std::string JsonFields() const {
    if (total_gib == 0) return "";
    char b[160];
    std::snprintf(b, sizeof b,
                  ", \"mem_peak_gib\": %.2f, \"mem_static_gib\": %.2f, \"mem_pool_peak_gib\": %.2f",
                  peak_gib(), static_gib, pool_peak_gib);
    return b;
  }
};

class GpuMemoryMeter {
 public:
  // Starts a measurement: records what is in use outside the pool and resets its high-water mark.
  void Reset() {
#if SPARSEX_WITH_CUDA
    cudaDeviceSynchronize();
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess || Pool() == nullptr) return;
    uint64_t reserved = 0, zero = 0;
    cudaMemPoolGetAttribute(Pool(), cudaMemPoolAttrReservedMemCurrent, &reserved);
    cudaMemPoolSetAttribute(Pool(), cudaMemPoolAttrUsedMemHigh, &zero);  // resets to current
    total_ = static_cast<double>(total_b);
    static_ = static_cast<double>(total_b - free_b) - static_cast<double>(reserved);
#endif
  }
  GpuMemory Read() const {
    GpuMemory m;
#if SPARSEX_WITH_CUDA
    if (total_ == 0 || Pool() == nullptr) return m;
    cudaDeviceSynchronize();
    uint64_t high = 0;
    cudaMemPoolGetAttribute(Pool(), cudaMemPoolAttrUsedMemHigh, &high);
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    m.total_gib = total_ / kGiB;
    m.static_gib = static_ / kGiB;
    m.pool_peak_gib = static_cast<double>(high) / kGiB;
#endif
    return m;
  }

 private:
#if SPARSEX_WITH_CUDA
  static cudaMemPool_t Pool() {
    int dev = 0;
    cudaMemPool_t p = nullptr;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetDefaultMemPool(&p, dev) != cudaSuccess) {
      return nullptr;
    }
    return p;
  }
#endif
  double total_ = 0, static_ = 0;
};

}  // namespace sparsex::bench
