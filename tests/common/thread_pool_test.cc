#include "common/thread_pool.h"

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace sparsex {
namespace {

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    ParallelFor(n, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) ++hits[i];
    });
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n " << n << " i " << i;
    std::vector<std::atomic<int>> again(static_cast<size_t>(n));
    ParallelForIfIdle(n, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) ++again[i];
    });
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(again[i].load(), 1) << "n " << n << " i " << i;
  }
}

// While another thread's loop holds the pool, ParallelForIfIdle runs inline on its caller and
// returns without waiting for that loop (the scheduler's sampling beside a fetch's decode).
TEST(ThreadPool, ParallelForIfIdleDoesNotWaitForAnotherLoop) {
  if (NumThreads() < 2) GTEST_SKIP() << "one thread: every loop runs inline";
  std::promise<void> started, release;
  std::shared_future<void> go = release.get_future().share();
  std::atomic<bool> once{false};
  std::thread other([&] {
    ParallelFor(NumThreads(), [&](int64_t, int64_t) {
      if (!once.exchange(true)) started.set_value();
      go.wait();
    });
  });
  started.get_future().wait();
  std::set<std::thread::id> ran_on;
  std::mutex mu;
  std::vector<int> hits(64, 0);
  ParallelForIfIdle(64, [&](int64_t lo, int64_t hi) {
    std::lock_guard<std::mutex> l(mu);
    ran_on.insert(std::this_thread::get_id());
    for (int64_t i = lo; i < hi; ++i) ++hits[i];
  });
  // Back while the other loop still holds the pool: it ran here, every index once.
  EXPECT_EQ(ran_on, std::set<std::thread::id>{std::this_thread::get_id()});
  for (int h : hits) EXPECT_EQ(h, 1);
  release.set_value();
  other.join();
}

}  // namespace
}  // namespace sparsex
