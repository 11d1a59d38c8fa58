// At most one log line per period for a failure that repeats: with the cache server down every
// request's fetch and every segment's write-back fails, and one line each flooded the log (89
// write-back lines in a second of the fault suite's cache_kill). The line that is
// written says how many were held back since the previous one.
//
//   static LogLimiter limit(std::chrono::seconds(5));
//   if (uint64_t held; limit.Admit(Clock::now(), &held)) Log(msg, held);
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>

namespace sparsex::service::internal {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogLimiter(Clock::duration period) : period_(period) {}

  // True when a line may be written at `now` (the first one, or `period` after the last one
  // written); *held_back is then the number of lines refused since that last one. False (and
  // the line is counted) otherwise.
  bool Admit(Clock::time_point now, uint64_t* held_back) {
    std::lock_guard<std::mutex> lock(mu_);
    if (last_ && now - *last_ < period_) {
      ++held_;
      return false;
    }
    last_ = now;
    *held_back = held_;
    held_ = 0;
    return true;
  }

 private:
  const Clock::duration period_;
  std::mutex mu_;
  std::optional<Clock::time_point> last_;
  uint64_t held_ = 0;
};

}  // namespace sparsex::service::internal
