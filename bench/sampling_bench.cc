// sampling_bench: the host side of a batched decode step, on this machine's CPUs: the
// scheduler samples every decoding request's next token from its row of logits
// (BatchScheduler::SampleAndEmitAll), which the GPU waits out before the next step.
//
//   build/bin/sampling_bench [--vocab 128256] [--batches 1,8,32] [--reps 20]
//       [--temperature 0] [--top_k 0] [--top_p 1] [--json OUT.json]
//
// Per batch size: milliseconds per step with the rows sampled one after another on one thread
// (as a scheduler without the pool did) and on the thread pool (ParallelForIfIdle, as the
// scheduler does now), the same samplers and seeded rows (N(0, 1) logits), median of --reps.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "common/thread_pool.h"
#include "gpu_worker/engine/sampler.h"

namespace {

using sparsex::ParallelForIfIdle;
using sparsex::Sampler;
using sparsex::SamplingParams;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  sparsex::bench::Args a;
  std::string bad;
  if (!a.Parse(argc, argv, &bad)) {
    std::fprintf(stderr, "sampling_bench: bad argument %s\n", bad.c_str());
    return 2;
  }
  const int vocab = static_cast<int>(a.U("vocab", 128256));
  const int reps = static_cast<int>(std::max<uint64_t>(1, a.U("reps", 20)));
  const float temperature = std::stof(a.Get("temperature", "0"));
  const int top_k = static_cast<int>(a.U("top_k", 0));
  const float top_p = std::stof(a.Get("top_p", "1"));
  std::vector<int> batches;
  {
    std::stringstream ss(a.Get("batches", "1,8,32"));
    for (std::string t; std::getline(ss, t, ',');) batches.push_back(std::stoi(t));
  }
  if (vocab < 1 || batches.empty()) {
    std::fprintf(stderr, "sampling_bench: --vocab >= 1 and --batches required\n");
    return 2;
  }
  std::printf("vocabulary %d, temperature %g, top_k %d, top_p %g, %d pool threads, median of %d "
              "steps\n", vocab, temperature, top_k, top_p, sparsex::NumThreads(), reps);
  std::ostringstream json;
  json << "{\n  \"vocab\": " << vocab << ",\n  \"temperature\": " << temperature
       << ",\n  \"top_k\": " << top_k << ",\n  \"top_p\": " << top_p
       << ",\n  \"threads\": " << sparsex::NumThreads() << ",\n  \"records\": [";
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (size_t bi = 0; bi < batches.size(); ++bi) {
    const int B = std::max(1, batches[bi]);
    std::vector<std::vector<float>> rows(B, std::vector<float>(static_cast<size_t>(vocab)));
    for (auto& row : rows) {
      for (float& x : row) x = nd(rng);
    }
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.seed = 7;
    std::vector<std::unique_ptr<Sampler>> s;
    for (int i = 0; i < B; ++i) s.push_back(std::make_unique<Sampler>(p));
    std::vector<double> serial, pool;
    std::vector<int32_t> tok(B);
    int64_t check = 0;
    for (int r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < B; ++i) tok[i] = s[i]->Sample(rows[i]);
      auto t1 = std::chrono::steady_clock::now();
      for (int32_t t : tok) check += t;
      ParallelForIfIdle(B, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) tok[i] = s[i]->Sample(rows[i]);
      }, sparsex::LogitRowsPerTask(vocab));
      auto t2 = std::chrono::steady_clock::now();
      for (int32_t t : tok) check -= t;  // greedy: the same tokens both ways
      serial.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      pool.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    std::printf("batch %3d: one thread %8.3f ms, pool %8.3f ms per step%s\n", B, Median(serial),
                Median(pool), temperature == 0 && check != 0 ? "  (greedy tokens differ!)" : "");
    json << (bi ? "," : "") << "\n    {\"batch\": " << B << ", \"serial_ms\": " << Median(serial)
         << ", \"pool_ms\": " << Median(pool) << "}";
  }
  json << "\n  ]\n}\n";
  const std::string out = a.Get("json", "");
  if (!out.empty()) std::ofstream(out) << json.str();
  return 0;
}
