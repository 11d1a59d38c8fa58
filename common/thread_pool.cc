#include "common/thread_pool.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace sparsex {
namespace {

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { Loop(i); });
    size_ = n;
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }

  void Run(int parts, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> run_lock(run_mu_);  // one parallel loop at a time
    RunLocked(parts, fn);
  }
  // Run when no other loop holds the pool; false (nothing ran) when one does.
  bool TryRun(int parts, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> run_lock(run_mu_, std::try_to_lock);
    if (!run_lock.owns_lock()) return false;
    RunLocked(parts, fn);
    return true;
  }

 private:
  void RunLocked(int parts, const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> l(mu_);
      fn_ = &fn;
      parts_ = parts;
      next_ = 1;
      done_ = 0;
      ++gen_;
    }
    cv_.notify_all();
    fn(0);
    Finish();
    std::unique_lock<std::mutex> l(mu_);
    done_cv_.wait(l, [&] { return done_ == parts_; });
    fn_ = nullptr;
  }
  void Finish() {
    // The caller also takes remaining parts.
    for (;;) {
      int p;
      {
        std::lock_guard<std::mutex> l(mu_);
        ++done_;
        if (next_ >= parts_) {
          done_cv_.notify_all();
          return;
        }
        p = next_++;
      }
      (*fn_)(p);
    }
  }
  void Loop(int) {
    uint64_t seen = 0;
    for (;;) {
      int p;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || (gen_ != seen && next_ < parts_); });
        if (stop_) return;
        seen = gen_;
        p = next_++;
      }
      (*fn_)(p);
      Finish();
    }
  }

  std::vector<std::thread> workers_;
  int size_ = 1;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int parts_ = 0, next_ = 0, done_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

Pool& GetPool() {
  static Pool* pool = [] {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* e = std::getenv("SPARSEX_THREADS")) n = std::atoi(e);
    return new Pool(std::max(1, n));
  }();
  return *pool;
}

}  // namespace

int NumThreads() { return GetPool().size(); }

namespace {
// Splits [0, n) into up to one contiguous part per pool thread and runs them: on the pool,
// waiting for another thread's loop to end, or (try_only) only if no loop holds the pool now;
// false when nothing ran. Inline when there is only one part.
bool RunSplit(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t min_per_thread,
              bool try_only) {
  Pool& pool = GetPool();
  int64_t parts = std::min<int64_t>(pool.size(), n / std::max<int64_t>(1, min_per_thread));
  if (parts <= 1) {
    fn(0, n);
    return true;
  }
  int64_t chunk = (n + parts - 1) / parts;
  auto part = [&](int p) {
    int64_t b = p * chunk, e = std::min(n, b + chunk);
    if (b < e) fn(b, e);
  };
  if (!try_only) {
    pool.Run(static_cast<int>(parts), part);
    return true;
  }
  return pool.TryRun(static_cast<int>(parts), part);
}
}  // namespace

void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                 int64_t min_per_thread) {
  if (n > 0) RunSplit(n, fn, min_per_thread, /*try_only=*/false);
}

void ParallelForIfIdle(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                       int64_t min_per_thread) {
  if (n > 0 && !RunSplit(n, fn, min_per_thread, /*try_only=*/true)) fn(0, n);
}

}  // namespace sparsex
