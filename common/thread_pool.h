// A small fixed-size pool for data-parallel loops in the CPU reference backend.
//
//   ParallelFor(n, [&](int64_t begin, int64_t end) { for (i = begin; i < end; ++i) ...; });
#pragma once

#include <cstdint>
#include <functional>

namespace sparsex {

// Splits [0, n) into contiguous chunks run on the process-wide pool (size: hardware threads,
// or SPARSEX_THREADS). Runs inline when n < min_per_thread * 2 or the pool has one thread.
void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                 int64_t min_per_thread = 1);

// ParallelFor when no other loop holds the pool now, else inline on the caller: for work that
// must not wait behind another thread's long loop (the scheduler's sampling between decode
// steps, while a cluster fetch decodes a round on the pool).
void ParallelForIfIdle(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                       int64_t min_per_thread = 1);

int NumThreads();

}  // namespace sparsex
