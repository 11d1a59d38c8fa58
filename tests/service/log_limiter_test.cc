// Found by the fault suite: with the cache server down every write-back failed with a
// log line of its own (89 lines within a second of cache_kill). Write-back and fetch failures
// now go through LogLimiter: one line per 5 s, which says how many were held back.
#include "gpu_worker/service/log_limiter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace sparsex::service::internal {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(LogLimiterTest, OneLinePerPeriodWithTheCountHeldBack) {
  LogLimiter limit(seconds(5));
  const auto t0 = LogLimiter::Clock::time_point() + seconds(1000);
  uint64_t held = 99;
  ASSERT_TRUE(limit.Admit(t0, &held));  // the first failure is logged at once
  EXPECT_EQ(held, 0u);
  int logged = 0;
  for (int i = 1; i < 89; ++i) logged += limit.Admit(t0 + milliseconds(11 * i), &held);
  EXPECT_EQ(logged, 0);  // the other 88 of that second are not
  ASSERT_FALSE(limit.Admit(t0 + milliseconds(4999), &held));
  ASSERT_TRUE(limit.Admit(t0 + seconds(5), &held));  // 5 s later: one line with the count
  EXPECT_EQ(held, 89u);
  ASSERT_TRUE(limit.Admit(t0 + seconds(60), &held));  // a quiet minute: nothing held back
  EXPECT_EQ(held, 0u);
}

TEST(LogLimiterTest, ConcurrentCallersLogOnce) {
  LogLimiter limit(seconds(5));
  const auto now = LogLimiter::Clock::now();
  std::atomic<int> logged{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        uint64_t held = 0;
        logged += limit.Admit(now, &held);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(logged.load(), 1);
  uint64_t held = 0;
  ASSERT_TRUE(limit.Admit(now + seconds(5), &held));
  EXPECT_EQ(held, 399u);
}

}  // namespace
}  // namespace sparsex::service::internal
