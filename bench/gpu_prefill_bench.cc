// GPU prefill / decode benchmark on the synthetic Llama-3-8B shape (seeded random bf16 weights
// generated on the GPU). The forward pass is the engine's own ModelRunner (embedding, then per
// layer: rmsnorm, qkv matmul, rope, KV write, paged attention, o-proj, add, rmsnorm, gate_up,
// swiglu, down, add; final norm + last-token logits), so the sparse-recompute executor built on
// the same runner is measured the same way. Timing: CUDA events on the backend's stream, median
// of --reps runs after --warmup runs. Also times single ops (attention per layer, the four
// GEMMs) to place the time. Prints a table and writes JSON (--out). --small-n measures only the
// decode matmuls: every small-n kernel variant per decode shape, gate_up + SwiGLU fused or not,
// and decode steps per backend configuration (SmallNMain).
//
//   gpu_prefill_bench --lengths 2048,8192,16384,32768 --reps 3 --out gpu_prefill_raw.json
//   gpu_prefill_bench --small-n --decode-steps 40 --out small_n.json
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/gpu_memory.h"
#include "common/hash.h"
#include "gpu_worker/backend/attention_stats_plan.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/engine/runner.h"

#if SPARSEX_WITH_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "gpu_worker/backend/cuda/cuda_backend.h"
#include "gpu_worker/backend/cuda/cudnn_attention.h"
#include "kernels/attention.h"
#include "kernels/attention_sm90.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#endif

namespace sparsex {
namespace {

struct Options {
  std::vector<int> lengths = {2048, 8192, 16384, 32768};
  int reps = 3;
  int warmup = 1;
  int decode_ctx = 8192;
  int decode_steps = 32;
  int decode_batch = 32;  // sequences of the batched decode case (0 skips it)
  int layers = 0;  // 0: the model's 32
  bool micro = true;
  bool small_n = false;  // --small-n: the decode matmul section alone (SmallNMain)
  int profile_decode = 0;  // --profile-decode B: 11 more steps of batch B in a profiler range
  std::string out = "gpu_prefill_raw.json";
};

double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::atoi(item.c_str()));
  return v;
}

#if SPARSEX_WITH_CUDA

#define CHECK_OK(expr)                                                          \
  do {                                                                          \
    absl::Status st_ = (expr);                                                  \
    if (!st_.ok()) {                                                            \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, st_.ToString().c_str()); \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

// A GEMM's operands uniform in [-0.05, 0.05] (x first, then w, from one generator).
void UploadOperands(Backend& be, Tensor& x, Tensor& w, uint32_t seed) {
  std::vector<float> hx(static_cast<size_t>(x.rows) * x.cols);
  std::vector<float> hw(static_cast<size_t>(w.rows) * w.cols);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-0.05f, 0.05f);
  for (float& v : hx) v = d(rng);
  for (float& v : hw) v = d(rng);
  CHECK_OK(be.Upload(hx, x));
  CHECK_OK(be.Upload(hw, w));
}

template <typename T>
T Unwrap(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*v);
}

class EventTimer {
 public:
  explicit EventTimer(cudaStream_t s) : s_(s) {
    cudaEventCreate(&a_);
    cudaEventCreate(&b_);
  }
  ~EventTimer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  void Start() { cudaEventRecord(a_, s_); }
  double StopMs() {
    cudaEventRecord(b_, s_);
    cudaEventSynchronize(b_);
    float ms = 0;
    cudaEventElapsedTime(&ms, a_, b_);
    return ms;
  }

 private:
  cudaStream_t s_;
  cudaEvent_t a_, b_;
};

// One sequence laid out over a shuffled block table.
struct SeqLayout {
  std::vector<int32_t> ids, pos, slots;
  SeqLayout(int n, int num_blocks, int bs, int vocab, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> table(num_blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    ids.resize(n);
    pos.resize(n);
    slots.resize(n);
    std::uniform_int_distribution<int> tok(0, vocab - 1);
    for (int i = 0; i < n; ++i) {
      ids[i] = tok(rng);
      pos[i] = i;
      slots[i] = table[i / bs] * bs + i % bs;
    }
  }
};

struct Record {
  std::string name;
  int tokens;
  double ms, min_ms;
  int reps;
  std::string extra;  // additional JSON fields, starting with ','
};

// Decode steps of B sequences (one row each) after ctx tokens of context, sequence b's
// positions at slots[b]: the engine's decode pass (ModelRunner::Forward, greedy next token),
// as plain launches or (graph) a recorded scope replayed as a CUDA graph; with draws the
// tokens are drawn on the device (ForwardHead, as the scheduler's greedy and plain-temperature
// steps do: inv_temperature 0 greedy, else Gumbel-max) and the time includes bringing them
// back, else it includes the logits' download. Median and minimum ms per step over the steps
// after the first 3 (warm-up, recording, capture).
std::pair<double, double> DecodeSteps(ModelRunner& runner, EventTimer& timer,
                                      const std::vector<std::vector<int32_t>>& slots, int ctx,
                                      int steps, int B, bool graph, bool draw = false,
                                      float inv_temperature = 0.0f,
                                      uint64_t* token_hash = nullptr) {
  // A hash chained over every step's tokens: a greedy run's tokens are deterministic, so two
  // configurations that must compute the same (a reordering of requests) print the same hash.
  uint64_t hash = 0;
  auto mix = [&hash](const std::vector<int32_t>& t) {
    hash = Hash64(t.data(), t.size() * sizeof(int32_t), hash);
  };
  const int vocab = runner.config().vocab_size;
  std::vector<int32_t> toks(B, 7), pos(B), wslots(B), all(B);
  std::iota(all.begin(), all.end(), 0);
  std::vector<RowDraw> draws(draw ? B : 0);
  for (int b = 0; b < static_cast<int>(draws.size()); ++b) {
    draws[b].inv_temperature = inv_temperature;
    draws[b].seed = static_cast<uint64_t>(b);
  }
  std::vector<double> times;
  for (int t = 0; t < steps; ++t) {
    const int p = ctx + t;
    std::vector<RowGroup> groups(B);
    for (int b = 0; b < B; ++b) {
      pos[b] = p;
      wslots[b] = slots[b][p];
      groups[b] = {b, b + 1, std::span<const int32_t>(slots[b].data(), p + 1)};
    }
    timer.Start();
    LayerRows rows{pos, wslots, {}, groups};
    if (draw) {
      for (RowDraw& d : draws) d.counter = static_cast<uint64_t>(t);
      ModelRunner::HeadOut h = Unwrap(runner.ForwardHead(toks, rows, all, graph, draws), "decode");
      const double ms = timer.StopMs();
      toks = h.drawn;
      mix(toks);
      if (t >= 3) times.push_back(ms);
      continue;
    }
    std::vector<float> logits = Unwrap(runner.Forward(toks, rows, all, graph), "decode");
    const double ms = timer.StopMs();
    for (int b = 0; b < B; ++b) {
      auto first = logits.begin() + static_cast<int64_t>(b) * vocab;
      toks[b] = static_cast<int32_t>(std::max_element(first, first + vocab) - first);
    }
    mix(toks);
    if (t >= 3) times.push_back(ms);  // first steps warm up (and record, then capture)
  }
  if (token_hash != nullptr) *token_hash = hash;
  if (times.empty()) return {NAN, NAN};
  return std::make_pair(Median(times), *std::min_element(times.begin(), times.end()));
}

// Slot tables of `batch` sequences that each own consecutive blocks of the pool, room for
// ctx + steps positions; *num_blocks gets the blocks they use.
std::vector<std::vector<int32_t>> DecodeSlots(int batch, int ctx, int steps, int bs,
                                              int* num_blocks) {
  const int per = (ctx + steps + bs) / bs + 1;  // blocks per sequence
  std::vector<std::vector<int32_t>> slots(batch);
  for (int b = 0; b < batch; ++b) {
    slots[b].resize(ctx + steps);
    for (int p = 0; p < ctx + steps; ++p) slots[b][p] = (b * per + p / bs) * bs + p % bs;
  }
  *num_blocks = batch * per;
  return slots;
}

void WriteJson(const std::string& path, const cudaDeviceProp& prop,
               const std::string& dense_attention, int layers,
               const std::vector<Record>& records) {
  std::ofstream f(path);
  f << "{\n  \"device\": \"" << prop.name << "\",\n  \"model\": \"synthetic:llama3-8b\",\n"
    << "  \"dense_attention\": \"" << dense_attention << "\",\n"
    << "  \"layers\": " << layers << ",\n  \"records\": [\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "    {\"case\": \"%s\", \"tokens\": %d, \"ms\": %.4f, \"min_ms\": %.4f, "
                  "\"reps\": %d%s}%s\n",
                  r.name.c_str(), r.tokens, r.ms, r.min_ms, r.reps, r.extra.c_str(),
                  i + 1 < records.size() ? "," : "");
    f << buf;
  }
  f << "  ]\n}\n";
  std::printf("wrote %s\n", path.c_str());
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// --small-n: the decode matmuls alone (docs/perf-notes.md). For every small-n
// kernel variant (and cuBLASLt), every decode shape and 1, 2, 4, 8 rows: time per call and
// TB/s of weight bytes; the gate_up projection with SwiGLU fused against the two kernels; then
// whole decode steps (batch 1, 2, 4, ... up to min(--decode-batch, 8)) per configuration: the
// environment's, with SPX_FUSED_SWIGLU flipped, cuBLASLt only, SPX_FUSED_RESIDUAL flipped, and
// each variant. Calls run back to back (the next one's blocks start under the previous one with
// PDL, as in a decode step) over copies of each weight matrix, 512 MiB in all, so no call finds
// its weights in the 50 MB L2.
int SmallNMain(const Options& o) {
  const CudaBackendOptions env = CudaBackendOptionsFromEnv();
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  Check(cudaSetDevice(0), "cudaSetDevice");
  ModelConfig cfg = Unwrap(MakeSyntheticModel("llama3-8b"), "synthetic model")->config();
  if (o.layers > 0) cfg.n_layers = o.layers;
  std::printf("device: %s, %d SMs; synthetic llama3-8b decode matmuls; PDL %s\n", prop.name,
              prop.multiProcessorCount, std::getenv("SPX_PDL") && std::string(std::getenv(
              "SPX_PDL")) == "0" ? "off (SPX_PDL=0)" : "on");
  std::vector<Record> records;
  using kernels::bf16;
  using kernels::SmallNGemmVariant;
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  {
    EventTimer timer(stream);
    const int H = cfg.n_heads, KV = cfg.n_kv_heads, hd = cfg.head_dim;
    struct Shape {
      const char* name;
      int64_t m, k;
    } shapes[] = {{"qkv", static_cast<int64_t>(H + 2 * KV) * hd, cfg.dim},
                  {"o", cfg.dim, static_cast<int64_t>(H) * hd},
                  {"gate_up", 2LL * cfg.ffn_dim, cfg.dim},
                  {"down", cfg.dim, cfg.ffn_dim},
                  {"lm_head", cfg.vocab_size, cfg.dim}};
    const int kRows[] = {1, 2, 4, 8};
    constexpr double kCycledBytes = 512.0 * (1 << 20);
    int64_t max_k = 0, max_m = 0;
    for (const Shape& sh : shapes) {
      max_k = std::max(max_k, sh.k);
      max_m = std::max(max_m, sh.m);
    }
    bf16 *x = nullptr, *y = nullptr, *act = nullptr;
    Check(cudaMalloc(&x, 8 * max_k * sizeof(bf16)), "cudaMalloc");
    Check(cudaMalloc(&y, 8 * max_m * sizeof(bf16)), "cudaMalloc");
    Check(cudaMalloc(&act, 8 * max_m * sizeof(bf16)), "cudaMalloc");
    Check(kernels::FillUniform(x, 8 * max_k, 1.0f, 77, stream), "fill");
    kernels::LtGemm lt;
    lt.Init(64u << 20);
    // Median and minimum of 7 samples (after 2) of `calls` launches each, per launch.
    auto per_call = [&](int calls, auto&& launch) {
      std::vector<double> t;
      for (int r = 0; r < 2 + 7; ++r) {
        timer.Start();
        for (int i = 0; i < calls; ++i) launch(i);
        const double ms = timer.StopMs() / calls;
        if (r >= 2) t.push_back(ms);
      }
      return std::make_pair(Median(t), *std::min_element(t.begin(), t.end()));
    };
    auto copies_of = [&](int64_t m, int64_t k) {
      const int c = std::max(2, static_cast<int>(std::ceil(kCycledBytes / (2.0 * m * k))));
      std::vector<bf16*> w(c);
      for (int i = 0; i < c; ++i) {
        Check(cudaMalloc(&w[i], m * k * sizeof(bf16)), "cudaMalloc weights");
        Check(kernels::FillUniform(w[i], m * k, 1.0f / std::sqrt(static_cast<float>(k)),
                                   1000 + i, stream), "fill");
      }
      return w;
    };
    std::printf("\nsmall-n matmuls: us per call / TB/s of weights (median of 7)\n%-8s %5s ",
                "shape", "rows");
    for (int v = 0; v < kernels::kSmallNGemmVariants; ++v) {
      std::printf(" %14s", kernels::SmallNGemmVariantName(static_cast<SmallNGemmVariant>(v)));
    }
    std::printf(" %14s\n", "cuBLASLt");
    for (const Shape& sh : shapes) {
      const std::vector<bf16*> w = copies_of(sh.m, sh.k);
      const int c = static_cast<int>(w.size());
      const int calls = std::max(20, 2 * c);
      const double bytes = 2.0 * sh.m * sh.k;
      for (int n : kRows) {
        std::printf("%-8s %5d ", sh.name, n);
        auto cell = [&](const std::string& impl, std::pair<double, double> t) {
          const double tbs = bytes / t.first * 1e-9;
          std::printf(" %7.2f / %4.2f", t.first * 1e3, tbs);
          char extra[200];
          std::snprintf(extra, sizeof extra,
                        ", \"shape\": \"%s\", \"m\": %lld, \"k\": %lld, \"rows\": %d, "
                        "\"impl\": \"%s\", \"us\": %.2f, \"tb_s\": %.3f",
                        sh.name, static_cast<long long>(sh.m), static_cast<long long>(sh.k), n,
                        impl.c_str(), t.first * 1e3, tbs);
          records.push_back({"small_n_gemm", n, t.first, t.second, 7, extra});
        };
        for (int v = 0; v < kernels::kSmallNGemmVariants; ++v) {
          const auto variant = static_cast<SmallNGemmVariant>(v);
          cell(kernels::SmallNGemmVariantName(variant), per_call(calls, [&](int i) {
            Check(kernels::SmallNGemm(x, sh.k, w[i % c], sh.k, y, sh.m, n, sh.m, sh.k, 0.0f,
                                      stream, variant), "SmallNGemm");
          }));
        }
        cell("cublaslt", per_call(calls, [&](int i) {
          if (lt.Run(x, sh.k, w[i % c], sh.k, y, sh.m, n, sh.m, sh.k, 0.0f, stream) !=
              CUBLAS_STATUS_SUCCESS) {
            Check(cudaErrorLaunchFailure, "cuBLASLt");
          }
        }));
        std::printf("\n");
        std::fflush(stdout);
      }
      for (bf16* p : w) cudaFree(p);
    }

    // gate_up + SwiGLU: the two kernels against the fused one, per variant.
    const int64_t half = cfg.ffn_dim, k = cfg.dim;
    const std::vector<bf16*> w = copies_of(2 * half, k);
    const int c = static_cast<int>(w.size());
    const int calls = std::max(20, 2 * c);
    std::printf("\ngate_up + SwiGLU (%lld x %lld): us per call, separate (small-n matmul, then "
                "SwiGLU) -> fused\n%5s ", static_cast<long long>(2 * half),
                static_cast<long long>(k), "rows");
    for (int v = 0; v < kernels::kSmallNGemmVariants; ++v) {
      std::printf(" %20s", kernels::SmallNGemmVariantName(static_cast<SmallNGemmVariant>(v)));
    }
    std::printf("\n");
    for (int n : kRows) {
      std::printf("%5d ", n);
      for (int v = 0; v < kernels::kSmallNGemmVariants; ++v) {
        const auto variant = static_cast<SmallNGemmVariant>(v);
        const auto sep = per_call(calls, [&](int i) {
          Check(kernels::SmallNGemm(x, k, w[i % c], k, y, 2 * half, n, 2 * half, k, 0.0f, stream,
                                    variant), "SmallNGemm");
          Check(kernels::SwiGlu(y, 2 * half, act, half, n, half, stream), "SwiGlu");
        });
        const auto fused = per_call(calls, [&](int i) {
          Check(kernels::SmallNGemmSwiGlu(x, k, w[i % c], k, act, half, n, half, k, stream,
                                          variant), "SmallNGemmSwiGlu");
        });
        std::printf("   %7.2f -> %7.2f", sep.first * 1e3, fused.first * 1e3);
        for (auto [name, t] : {std::pair{"separate", sep}, {"fused", fused}}) {
          char extra[200];
          std::snprintf(extra, sizeof extra,
                        ", \"rows\": %d, \"variant\": \"%s\", \"path\": \"%s\", "
                        "\"us\": %.2f, \"tb_s\": %.3f", n,
                        kernels::SmallNGemmVariantName(variant), name, t.first * 1e3,
                        4.0 * half * k / t.first * 1e-9);
          records.push_back({"gate_up_swiglu", n, t.first, t.second, 7, extra});
        }
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    for (bf16* p : w) cudaFree(p);
    cudaFree(x);
    cudaFree(y);
    cudaFree(act);
  }
  cudaStreamDestroy(stream);

  // Whole decode steps per configuration, each its own backend and random weights (seed 1234,
  // the same values): the context's KV written by one prefill of sequence 0, the other
  // sequences reading whatever their blocks hold (the cost does not depend on it).
  if (o.decode_steps > 3) {
    const int bs = 16, ctx = o.decode_ctx;
    // 1, 2, 4, ... up to the small-n kernel's row limit: the auto policy switches at 2 rows.
    std::vector<int> batches = {1};
    const int big = std::min(o.decode_batch, kernels::kSmallNGemmMaxRows);
    for (int b = 2; b <= big; b *= 2) batches.push_back(b);
    int num_blocks = 0;
    const auto slots = DecodeSlots(batches.back(), ctx, o.decode_steps, bs, &num_blocks);
    struct Config {
      std::string name;
      CudaBackendOptions opts;
    };
    std::vector<Config> configs = {{"environment", env}};
    configs.push_back({env.fused_swiglu ? "SPX_FUSED_SWIGLU=0" : "SPX_FUSED_SWIGLU=1", env});
    configs.back().opts.fused_swiglu = !env.fused_swiglu;
    configs.push_back({"SPX_SMALL_N_GEMM=0 (cuBLASLt)", env});
    configs.back().opts.small_n_gemm = false;
    // The down projection's residual add in the matmul's epilogue (beta = 1): one launch fewer
    // per layer, measured ~1% at prefill sizes before the decode step's launches were counted.
    configs.push_back({env.fused_residual ? "SPX_FUSED_RESIDUAL=0" : "SPX_FUSED_RESIDUAL=1", env});
    configs.back().opts.fused_residual = !env.fused_residual;
    // Split-K of the decode attention (batch 1: 8 KV-head blocks, split to ~2 blocks per SM).
    for (int waves : {1, 3, 4}) {
      configs.push_back({"SPX_SPLIT_WAVES=" + std::to_string(waves), env});
      configs.back().opts.split_waves = waves;
    }
    for (int v = 0; v < kernels::kSmallNGemmVariants; ++v) {
      configs.push_back({std::string("SPX_SMALL_N_VARIANT=") +
                             kernels::SmallNGemmVariantName(static_cast<SmallNGemmVariant>(v)),
                         env});
      configs.back().opts.small_n_variant = v;
    }
    std::printf("\ndecode steps at %d context, CUDA graphs %s; environment: small-n %s, "
                "variant %d, fused SwiGLU %s\n", ctx, env.cuda_graphs ? "on" : "off",
                env.small_n_gemm ? "on" : "off", env.small_n_variant,
                env.fused_swiglu ? "on" : "off");
    for (const Config& c : configs) {
      auto be = Unwrap(CreateCudaBackend(0, c.opts), "CreateCudaBackend");
      KvCacheOptions kv;
      kv.block_size = bs;
      kv.num_blocks = num_blocks;
      auto runner = Unwrap(ModelRunner::CreateRandom(cfg, 1234, be.get(), kv), "CreateRandom");
      EventTimer timer(CudaBackendStream(*be));
      {
        SeqLayout seq(ctx, num_blocks, bs, cfg.vocab_size, 4242);
        std::vector<int32_t> sl(slots[0].begin(), slots[0].begin() + ctx);
        LayerRows rows{seq.pos, sl, sl};
        CHECK_OK(runner->Forward(seq.ids, rows, {}).status());
        CHECK_OK(be->Synchronize());
      }
      std::printf("%-32s", c.name.c_str());
      for (int B : batches) {
        auto [med, mn] = DecodeSteps(*runner, timer, slots, ctx, o.decode_steps, B,
                                     c.opts.cuda_graphs);
        std::printf("  batch %d: %.3f ms/step (min %.3f)", B, med, mn);
        char extra[240];
        std::snprintf(extra, sizeof extra,
                      ", \"config\": \"%s\", \"batch\": %d, \"context\": %d, "
                      "\"tokens_per_s\": %.1f, \"cuda_graph\": %s",
                      c.name.c_str(), B, ctx, 1000.0 * B / med,
                      c.opts.cuda_graphs ? "true" : "false");
        records.push_back({"decode_step", ctx, med, mn, o.decode_steps - 3, extra});
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  WriteJson(o.out, prop, "n/a", cfg.n_layers, records);
  return 0;
}

int Main(const Options& o) {
  if (!CudaAvailable()) {
    std::printf("gpu_prefill_bench: no CUDA device; nothing measured\n");
    return 0;
  }
  if (o.small_n) return SmallNMain(o);
  // The SPX_* kernel switches (docs/operations.md), read once.
  CudaBackendOptions cuda_opts = CudaBackendOptionsFromEnv();
  // The decode_*_device_* records time the device draw (kernels::DrawRows), whatever the
  // serving default (SPX_DEVICE_SAMPLING) is; the other records download the logits.
  cuda_opts.device_sampling = true;
  auto be = Unwrap(CreateCudaBackend(0, cuda_opts), "CreateCudaBackend");
  cudaStream_t stream = CudaBackendStream(*be);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  // The same shapes as `--model synthetic:llama3-8b` everywhere else.
  ModelConfig cfg = Unwrap(MakeSyntheticModel("llama3-8b"), "synthetic model")->config();
  if (o.layers > 0) cfg.n_layers = o.layers;
  const int bs = 16;
  int max_len = o.decode_ctx + o.decode_steps + 1;
  for (int n : o.lengths) max_len = std::max(max_len, n);
  KvCacheOptions kv;
  kv.block_size = bs;
  kv.num_blocks = (max_len + bs - 1) / bs + 8;
  if (o.decode_steps > 0 && o.decode_batch > 1) {  // one block range per decoding sequence
    kv.num_blocks = std::max(kv.num_blocks,
                             o.decode_batch * ((o.decode_ctx + o.decode_steps + bs) / bs + 1));
  }
  auto t0 = std::chrono::steady_clock::now();
  auto runner = Unwrap(ModelRunner::CreateRandom(cfg, 1234, be.get(), kv), "CreateRandom");
  CHECK_OK(be->Synchronize());
  const double init_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("device: %s, %d SMs; synthetic llama3-8b, %d layers; weights generated in %.2f s\n",
              prop.name, prop.multiProcessorCount, cfg.n_layers, init_s);

  // Which kernel serves dense prefill attention (the backend's choice, reported with the figures).
  std::string dense_attention = "own kernel";
  {
    auto dnn = CudnnAttention::Create(stream, cuda_opts.cudnn_library);
    if (cuda_opts.cudnn_attention == CudaBackendOptions::Cudnn::kOff) {
      dense_attention = "own kernel (SPX_CUDNN_ATTENTION=0)";
    } else if (dnn.ok()) {
      dense_attention = "cuDNN " + (*dnn)->version();
    } else {
      dense_attention = "own kernel (" + std::string(dnn.status().message()) + ")";
    }
  }
  std::printf("dense prefill attention: %s\n", dense_attention.c_str());

  std::vector<Record> records;
  EventTimer timer(stream);
  const int H = cfg.n_heads, KV = cfg.n_kv_heads, hd = cfg.head_dim;

  // ---- full prefill ----
  for (int n : o.lengths) {
    SeqLayout seq(n, kv.num_blocks, bs, cfg.vocab_size, 42 + n);
    LayerRows rows{seq.pos, seq.slots, seq.slots};
    std::vector<double> times;
    float last_logit = 0;
    bench::GpuMemoryMeter meter;
    meter.Reset();
    for (int r = 0; r < o.warmup + o.reps; ++r) {
      timer.Start();
      Tensor x = Unwrap(runner->Embed(seq.ids), "Embed");
      for (int l = 0; l < cfg.n_layers; ++l) CHECK_OK(runner->Layer(l, x, rows));
      const int32_t last = n - 1;
      std::vector<float> logits = Unwrap(runner->Logits(x, {&last, 1}), "Logits");
      be->Free(x);
      const double ms = timer.StopMs();
      last_logit = logits[0];
      if (!std::isfinite(last_logit)) {
        std::fprintf(stderr, "non-finite logits at %d tokens\n", n);
        return 1;
      }
      if (r >= o.warmup) times.push_back(ms);
    }
    const double med = Median(times);
    const bench::GpuMemory mem = meter.Read();
    records.push_back({"full_prefill", n, med, *std::min_element(times.begin(), times.end()),
                       o.reps, mem.JsonFields()});
    std::printf("full prefill %6d tokens: %9.2f ms (min %.2f, %d reps), memory peak %.1f GiB "
                "(cudaMalloc'd %.1f, stream-ordered pool peak %.1f)\n",
                n, med, records.back().min_ms, o.reps, mem.peak_gib(), mem.static_gib,
                mem.pool_peak_gib);
    std::fflush(stdout);
  }

  // ---- single ops: attention of one layer at each length, GEMMs at the longest ----
  if (o.micro) {
    const int nmax = *std::max_element(o.lengths.begin(), o.lengths.end());
    SeqLayout seq(nmax, kv.num_blocks, bs, cfg.vocab_size, 42 + nmax);
    const int64_t qcols = static_cast<int64_t>(H + 2 * KV) * hd;
    Tensor qkv = Unwrap(be->Alloc(nmax, qcols), "Alloc");
    Tensor att = Unwrap(be->Alloc(nmax, static_cast<int64_t>(H) * hd), "Alloc");
    {
      std::vector<float> host(static_cast<size_t>(nmax) * qcols);
      std::mt19937 rng(7);
      std::uniform_real_distribution<float> d(-1.0f, 1.0f);
      for (float& v : host) v = d(rng);
      CHECK_OK(be->Upload(host, qkv));
    }
    CHECK_OK(be->WriteKv(runner->pool(), 0, qkv, static_cast<int64_t>(H) * hd, qkv,
                         static_cast<int64_t>(H + KV) * hd, seq.slots));
    // Attention kernels called directly (both block sizes), on the pool of layer 0.
    int32_t *d_pos = nullptr, *d_slots = nullptr, *d_sel = nullptr, *d_group = nullptr,
            *d_tiles = nullptr;
    float *d_lse = nullptr, *d_cross = nullptr, *d_recv = nullptr, *d_w = nullptr;
    cudaMalloc(&d_pos, nmax * 4);
    cudaMalloc(&d_slots, nmax * 4);
    cudaMalloc(&d_sel, nmax * 4);
    cudaMalloc(&d_group, nmax * 4);
    cudaMalloc(&d_lse, static_cast<size_t>(nmax) * H * 4);
    cudaMalloc(&d_cross, nmax * 4);
    cudaMalloc(&d_recv, nmax * 4);
    cudaMalloc(&d_w, nmax * 4);
    cudaMemcpy(d_pos, seq.pos.data(), nmax * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_slots, seq.slots.data(), nmax * 4, cudaMemcpyHostToDevice);
    {
      // Selector shapes: segments of 4096 tokens after a sink; the last 256 rows are "new".
      std::vector<int32_t> grp(nmax);
      std::vector<float> w(nmax, 0.0f);
      for (int j = 0; j < nmax; ++j) grp[j] = j == 0 ? -1 : (j - 1) / 4096;
      for (int j = std::max(0, nmax - 256); j < nmax; ++j) w[j] = 1.0f;
      cudaMemcpy(d_group, grp.data(), nmax * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_w, w.data(), nmax * 4, cudaMemcpyHostToDevice);
      // The complement statistics' tile ranges (CudaBackendOptions::cudnn_statistics).
      const std::vector<int32_t> tiles = StatsTileGroups(grp, kernels::kStatsTileKeys);
      cudaMalloc(&d_tiles, tiles.size() * 4);
      cudaMemcpy(d_tiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice);
    }
    void* d_ws = nullptr;
    size_t ws_bytes = 0;
    auto attention = [&](const kernels::PagedAttentionParams& p) {
      const size_t need = kernels::PagedAttentionWorkspaceBytes(p);
      if (need > ws_bytes) {
        cudaStreamSynchronize(stream);
        cudaFree(d_ws);
        cudaMalloc(&d_ws, need);
        ws_bytes = need;
      }
      const cudaError_t e = kernels::PagedAttention(p, d_ws, ws_bytes, stream);
      if (e != cudaSuccess) {
        std::fprintf(stderr, "PagedAttention: %s\n", cudaGetErrorString(e));
        std::exit(1);
      }
    };
    auto time_op = [&](auto&& fn) {
      std::vector<double> t;
      for (int r = 0; r < 2 + 5; ++r) {
        timer.Start();
        fn();
        const double ms = timer.StopMs();
        if (r >= 2) t.push_back(ms);
      }
      return std::make_pair(Median(t), *std::min_element(t.begin(), t.end()));
    };
    for (int n : o.lengths) {
      kernels::PagedAttentionParams p;
      p.q = static_cast<const kernels::bf16*>(qkv.data);
      p.q_stride = qkv.cols;
      p.out = static_cast<kernels::bf16*>(att.data);
      p.out_stride = att.cols;
      p.q_pos = d_pos;
      p.num_q = n;
      p.k_pool = static_cast<const kernels::bf16*>(runner->pool().k[0].data);
      p.v_pool = static_cast<const kernels::bf16*>(runner->pool().v[0].data);
      p.kv_stride = runner->pool().kv_dim;
      p.ctx_slots = d_slots;
      p.ctx_len = n;
      p.n_heads = H;
      p.n_kv_heads = KV;
      p.head_dim = hd;
      p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
      const double flops = 4.0 * (static_cast<double>(n) * (n + 1) / 2) * hd * H;
      // Sparse recompute shape: 15% of the rows (evenly spread), each over all earlier keys.
      std::vector<int32_t> sel;
      for (int i = 0; i < n; ++i)
        if ((i * 20) % 133 < 20 || i == n - 1) sel.push_back(i);
      cudaMemcpy(d_sel, sel.data(), sel.size() * 4, cudaMemcpyHostToDevice);
      double sflops = 0;
      for (int q : sel) sflops += 4.0 * (q + 1) * hd * H;
      // Kernels: mma.sync with 4 and 8 warps, then (sm_90a) the wgmma variants (plain,
      // pipelined, warp-specialised, ws ping-pong, ws pipelined, ws on 128-key tiles with its
      // K/V gathered by cp.async and with whole pool blocks as bulk tensor copies).
      // SPX_MICRO_IMPLS=mma limits the list to mma.sync, ws128-only to the ws-128 rows; no-pp,
      // no-pipe, no-ws128 and no-lsum in it (e.g. "no-pp,no-pipe") leave out that kernel (a
      // variant whose test failed).
      struct Impl {
        int impl, warps;
        const char* name;
        bool bulk = false;  // PagedAttentionParams::num_slots set (bulk copies where they fit)
      };
      std::vector<Impl> impls = {{1, 4, "mma.sync 4 warps"}, {1, 8, "mma.sync 8 warps"}};
      const char* only = std::getenv("SPX_MICRO_IMPLS");
      const bool ws128_only = only && std::string(only).find("ws128-only") != std::string::npos;
      if (ws128_only) impls.clear();
      if (kernels::Sm90AttentionAvailable() && !(only && std::string(only) == "mma")) {
        const std::string skip = only ? only : "";
        if (!ws128_only) {
          impls.push_back({2, 8, "wgmma"});
          impls.push_back({3, 8, "wgmma pipelined"});
          impls.push_back({4, 8, "wgmma warp-specialised"});
          if (skip.find("no-pp") == std::string::npos)
            impls.push_back({5, 8, "wgmma ws ping-pong"});
          if (skip.find("no-pipe") == std::string::npos)
            impls.push_back({6, 8, "wgmma ws pipelined"});
        }
        if (skip.find("no-ws128") == std::string::npos) {
          impls.push_back({7, 8, "wgmma ws 128-key tiles"});
          impls.push_back({7, 8, "wgmma ws 128-key tiles bulk K/V", true});
          if (skip.find("no-lsum") == std::string::npos)
            impls.push_back({8, 8, "wgmma ws 128-key tiles bulk K/V, row sums on MMA", true});
        }
      }
      for (const Impl& im : impls) {
        const int warps = im.warps;
        p.warps = warps;
        p.impl = im.impl;
        p.num_slots = im.bulk ? runner->pool().k[0].rows : 0;
        p.q_pos = d_pos;
        p.num_q = n;
        p.lse = nullptr;
        auto [ms, mn] = time_op([&] {
          attention(p);
        });
        char extra[160];
        std::snprintf(extra, sizeof extra, ", \"kernel\": \"%s\", \"tflops\": %.1f", im.name,
                      flops / ms * 1e-9);
        records.push_back({"attention_layer_causal", n, ms, mn, 5, extra});
        std::printf("attention (1 layer, causal, %s) %6d: %8.3f ms  %6.1f TFLOP/s\n", im.name,
                    n, ms, flops / ms * 1e-9);
        p.q_pos = d_sel;
        p.num_q = static_cast<int>(sel.size());
        auto [ms2, mn2] = time_op([&] {
          attention(p);
        });
        std::snprintf(extra, sizeof extra,
                      ", \"kernel\": \"%s\", \"rows\": %zu, \"tflops\": %.1f", im.name,
                      sel.size(), sflops / ms2 * 1e-9);
        records.push_back({"attention_layer_sparse15", n, ms2, mn2, 5, extra});
        std::printf("attention (1 layer, %zu sparse rows, %s) %6d: %8.3f ms  %6.1f "
                    "TFLOP/s\n", sel.size(), im.name, n, ms2, sflops / ms2 * 1e-9);
      }
      p.impl = 0;
      p.num_slots = 0;
      // Selection statistics (second pass) over the dense causal layer, default block size.
      p.warps = 0;
      p.q_pos = d_pos;
      p.num_q = n;
      p.lse = d_lse;
      attention(p);
      kernels::AttentionStatsParams st;
      st.key_group = d_group;
      st.q_group = d_group;
      st.recv_weight = d_w;
      st.out_cross = d_cross;
      st.out_recv = d_recv;
      auto time_stats = [&](const char* what) {
        return time_op([&] {
          const cudaError_t e = kernels::AttentionStats(p, st, stream);
          if (e != cudaSuccess) {
            std::fprintf(stderr, "AttentionStats (%s): %s\n", what, cudaGetErrorString(e));
            std::exit(1);
          }
        });
      };
      auto [ms3, mn3] = time_stats("direct");
      records.push_back({"attention_stats_layer", n, ms3, mn3, 5, ""});
      std::printf("selection statistics pass (1 layer, cross + recv of 256 rows) %6d: %8.3f ms\n",
                  n, ms3);
      // The same statistics by complement (the cuDNN path's second pass): each row's own
      // 4096-token segment and the sink only, every tile for the blocks of the 256 new rows.
      st.cross_complement = true;
      st.tile_groups = d_tiles;
      // The weighted rows' received attention in blocks of their own over parts of the keys
      // (the backend's choice), then in the cross-mass blocks (the earlier layout).
      // The cross mass on the wgmma kernel (sm_90a: the default, with the pool's whole blocks
      // as bulk copies), then on mma.sync (AttentionStatsParams::impl 1).
      st.recv_rows_begin = std::min(std::max(0, nmax - 256), n);
      st.recv_rows_end = n;
      p.num_slots = runner->pool().k[0].rows;
      auto [ms4, mn4] = time_stats("complement");
      records.push_back({"attention_stats_complement_layer", n, ms4, mn4, 5, ""});
      std::printf("selection statistics by complement (1 layer, 4096-token segments) %6d: "
                  "%8.3f ms\n", n, ms4);
      st.impl = 1;
      auto [ms7, mn7] = time_stats("complement, mma.sync");
      records.push_back({"attention_stats_complement_mma_layer", n, ms7, mn7, 5, ""});
      std::printf("selection statistics by complement on mma.sync %6d: %8.3f ms\n", n, ms7);
      st.recv_rows_begin = st.recv_rows_end = 0;
      auto [ms6, mn6] = time_stats("complement, received attention unsplit");
      records.push_back({"attention_stats_complement_unsplit_layer", n, ms6, mn6, 5, ""});
      std::printf("selection statistics by complement, received attention unsplit %6d: "
                  "%8.3f ms\n", n, ms6);
      // Without the received attention: the blocks of the 256 weighted rows read every key
      // tile (32K keys) where the others read their own segment; the difference is their cost.
      st.recv_weight = nullptr;
      st.out_recv = nullptr;
      auto [ms5, mn5] = time_stats("complement, cross only");
      records.push_back({"attention_stats_complement_cross_only_layer", n, ms5, mn5, 5, ""});
      std::printf("selection statistics by complement, cross mass only (no received attention) "
                  "%6d: %8.3f ms\n", n, ms5);
      // The cross mass alone on the wgmma kernel: bulk copies, then cp.async gathers.
      st.impl = 0;
      for (bool bulk : {true, false}) {
        p.num_slots = bulk ? runner->pool().k[0].rows : 0;
        auto [ms8, mn8] = time_stats("complement, cross only, wgmma");
        char extra[80];
        std::snprintf(extra, sizeof extra, ", \"kernel\": \"wgmma%s\"", bulk ? " bulk" : "");
        records.push_back({"attention_stats_complement_cross_only_layer", n, ms8, mn8, 5, extra});
        std::printf("selection statistics by complement, cross mass only, wgmma%s %6d: %8.3f "
                    "ms\n", bulk ? " (bulk K)" : " (gathered K)", n, ms8);
      }
      p.num_slots = 0;
    }
    cudaFree(d_pos);
    cudaFree(d_slots);
    cudaFree(d_sel);
    cudaFree(d_group);
    cudaFree(d_tiles);
    cudaFree(d_lse);
    cudaFree(d_cross);
    cudaFree(d_recv);
    cudaFree(d_w);
    cudaFree(d_ws);
    // GEMMs of one layer at nmax tokens.
    struct G {
      const char* name;
      int64_t m, k;
    } gemms[] = {{"gemm_qkv", qcols, cfg.dim},
                 {"gemm_o", cfg.dim, static_cast<int64_t>(H) * hd},
                 {"gemm_gate_up", 2LL * cfg.ffn_dim, cfg.dim},
                 {"gemm_down", cfg.dim, cfg.ffn_dim}};
    double gemm_total = 0;
    for (const G& g : gemms) {
      Tensor x = Unwrap(be->Alloc(nmax, g.k), "Alloc");
      Tensor w = Unwrap(be->Alloc(g.m, g.k), "Alloc");
      Tensor y = Unwrap(be->Alloc(nmax, g.m), "Alloc");
      UploadOperands(*be, x, w, 9);
      std::vector<double> t;
      for (int r = 0; r < 2 + 5; ++r) {
        timer.Start();
        CHECK_OK(be->MatMul(x, w, y));
        const double ms = timer.StopMs();
        if (r >= 2) t.push_back(ms);
      }
      const double ms = Median(t);
      gemm_total += ms;
      const double flops = 2.0 * nmax * g.m * g.k;
      char extra[64];
      std::snprintf(extra, sizeof extra, ", \"tflops\": %.1f", flops / ms * 1e-9);
      records.push_back({g.name, nmax, ms, *std::min_element(t.begin(), t.end()), 5, extra});
      std::printf("%-13s %6d x %6lld x %6lld: %8.3f ms  %6.1f TFLOP/s\n", g.name, nmax,
                  static_cast<long long>(g.m), static_cast<long long>(g.k), ms,
                  flops / ms * 1e-9);
      be->Free(x);
      be->Free(w);
      be->Free(y);
    }
    std::printf("GEMMs of one layer at %d tokens: %.2f ms (x%d layers = %.1f ms)\n", nmax,
                gemm_total, cfg.n_layers, gemm_total * cfg.n_layers);
    // gate_up + SwiGLU: cuBLASLt then the SwiGLU pass (what MatMulSwiGLU runs by default)
    // against the Hopper kernel with SwiGLU in its epilogue (SPX_GEMM_SWIGLU=1), at nmax rows
    // and at the 32K reuse prefill's sparse rows (5133: 15% of 32512 reused + 256 new).
    if (kernels::Sm90AttentionAvailable()) {
      kernels::LtGemm lt;
      lt.Init(64u << 20);
      const int64_t F = cfg.ffn_dim, D = cfg.dim;
      Tensor x = Unwrap(be->Alloc(nmax, D), "Alloc");
      Tensor w = Unwrap(be->Alloc(2 * F, D), "Alloc");
      Tensor gu = Unwrap(be->Alloc(nmax, 2 * F), "Alloc");
      Tensor act = Unwrap(be->Alloc(nmax, F), "Alloc");
      Tensor act2 = Unwrap(be->Alloc(nmax, F), "Alloc");
      UploadOperands(*be, x, w, 11);
      auto* xp = static_cast<const kernels::bf16*>(x.data);
      auto* wp = static_cast<const kernels::bf16*>(w.data);
      auto* gp = static_cast<kernels::bf16*>(gu.data);
      auto* ap = static_cast<kernels::bf16*>(act.data);
      auto* a2 = static_cast<kernels::bf16*>(act2.data);
      std::vector<int64_t> row_counts = {nmax};
      if (nmax > 5133) row_counts.push_back(5133);
      for (int64_t rows : row_counts) {
        auto [ms_a, mn_a] = time_op([&] {
          if (lt.Run(xp, D, wp, D, gp, 2 * F, rows, 2 * F, D, 0.0f, stream) !=
                  CUBLAS_STATUS_SUCCESS ||
              kernels::SwiGlu(gp, 2 * F, ap, F, rows, F, stream) != cudaSuccess) {
            std::fprintf(stderr, "cuBLASLt + SwiGLU failed\n");
            std::exit(1);
          }
        });
        const double flops = 2.0 * rows * 2 * F * D;
        char extra[160];
        std::snprintf(extra, sizeof extra, ", \"tflops\": %.1f", flops / ms_a * 1e-9);
        records.push_back({"gate_up_swiglu_cublaslt", static_cast<int>(rows), ms_a, mn_a, 5,
                           extra});
        std::printf("gate_up + SwiGLU %6lld rows: cuBLASLt + SwiGLU %8.3f ms (%6.1f TFLOP/s)\n",
                    static_cast<long long>(rows), ms_a, flops / ms_a * 1e-9);
        std::vector<float> ha(static_cast<size_t>(rows) * F), hb(ha.size());
        CHECK_OK(be->Download(RowView(act, 0, rows), ha));
        for (int v = 0; v < kernels::kSm90GemmSwiGluVariants; ++v) {
          const auto var = static_cast<kernels::Sm90GemmSwiGluVariant>(v);
          auto [ms_b, mn_b] = time_op([&] {
            const cudaError_t e =
                kernels::Sm90GemmSwiGlu(xp, D, wp, D, a2, F, rows, F, D, stream, var);
            if (e != cudaSuccess) {
              std::fprintf(stderr, "Sm90GemmSwiGlu: %s\n", cudaGetErrorString(e));
              std::exit(1);
            }
          });
          // The two outputs side by side (same inputs): a wrong Hopper result shows here too.
          CHECK_OK(be->Download(RowView(act2, 0, rows), hb));
          double num = 0, den = 0;
          for (size_t i = 0; i < ha.size(); ++i) {
            num += (static_cast<double>(hb[i]) - ha[i]) * (static_cast<double>(hb[i]) - ha[i]);
            den += static_cast<double>(ha[i]) * ha[i];
          }
          const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
          std::snprintf(extra, sizeof extra,
                        ", \"variant\": \"%s\", \"tflops\": %.1f, \"rel_err_vs_cublaslt\": %.2e",
                        kernels::Sm90GemmSwiGluVariantName(var), flops / ms_b * 1e-9, rel);
          records.push_back({"gate_up_swiglu_sm90", static_cast<int>(rows), ms_b, mn_b, 5,
                             extra});
          std::printf("gate_up + SwiGLU %6lld rows: Hopper kernel %-15s %8.3f ms (%6.1f "
                      "TFLOP/s), relative difference %.2e\n",
                      static_cast<long long>(rows), kernels::Sm90GemmSwiGluVariantName(var), ms_b,
                      flops / ms_b * 1e-9, rel);
        }
      }
      be->Free(x);
      be->Free(w);
      be->Free(gu);
      be->Free(act);
      be->Free(act2);
    }
    // Decode-sized matmuls (n = 1): the weight-streaming kernel against cuBLASLt.
    {
      kernels::LtGemm lt;
      lt.Init(64u << 20);
      struct G1 {
        const char* name;
        int64_t m, k;
      } shapes[] = {{"gemv_qkv", qcols, cfg.dim},
                    {"gemv_o", cfg.dim, static_cast<int64_t>(H) * hd},
                    {"gemv_gate_up", 2LL * cfg.ffn_dim, cfg.dim},
                    {"gemv_down", cfg.dim, cfg.ffn_dim},
                    {"gemv_lm_head", cfg.vocab_size, cfg.dim}};
      for (const G1& g : shapes) {
        Tensor x = Unwrap(be->Alloc(1, g.k), "Alloc");
        Tensor w = Unwrap(be->Alloc(g.m, g.k), "Alloc");
        Tensor y = Unwrap(be->Alloc(1, g.m), "Alloc");
        const double bytes = 2.0 * g.m * g.k;
        auto* xp = static_cast<const kernels::bf16*>(x.data);
        auto* wp = static_cast<const kernels::bf16*>(w.data);
        auto* yp = static_cast<kernels::bf16*>(y.data);
        auto [ms_a, mn_a] = time_op([&] {
          if (kernels::SmallNGemm(xp, g.k, wp, g.k, yp, g.m, 1, g.m, g.k, 0.0f, stream) !=
              cudaSuccess) {
            std::fprintf(stderr, "SmallNGemm failed\n");
            std::exit(1);
          }
        });
        auto [ms_b, mn_b] = time_op([&] {
          if (lt.Run(xp, g.k, wp, g.k, yp, g.m, 1, g.m, g.k, 0.0f, stream) !=
              CUBLAS_STATUS_SUCCESS) {
            std::fprintf(stderr, "cuBLASLt GEMV failed\n");
            std::exit(1);
          }
        });
        char extra[128];
        std::snprintf(extra, sizeof extra, ", \"impl\": \"small_n\", \"tb_s\": %.2f",
                      bytes / ms_a * 1e-9);
        records.push_back({g.name, 1, ms_a, mn_a, 5, extra});
        std::snprintf(extra, sizeof extra, ", \"impl\": \"cublaslt\", \"tb_s\": %.2f",
                      bytes / ms_b * 1e-9);
        records.push_back({g.name, 1, ms_b, mn_b, 5, extra});
        std::printf("%-13s 1 x %6lld x %6lld: small-n %7.3f ms (%.2f TB/s), cuBLASLt %7.3f ms "
                    "(%.2f TB/s)\n", g.name, static_cast<long long>(g.m),
                    static_cast<long long>(g.k), ms_a, bytes / ms_a * 1e-9, ms_b,
                    bytes / ms_b * 1e-9);
        be->Free(x);
        be->Free(w);
        be->Free(y);
      }
    }
    be->Free(qkv);
    be->Free(att);
    CHECK_OK(be->Synchronize());
  }

  // ---- decode at decode_ctx tokens of context: batch 1 and batch B ----
  // Each sequence owns its own blocks of the pool (distinct KV memory, as in serving); the
  // context's KV is written once by a prefill of sequence 0 (the others read whatever their
  // blocks hold, which the attention's cost does not depend on). Every step is the engine's
  // decode pass (ModelRunner::Forward over one row per sequence, greedy next token), once as
  // plain launches and once as a recorded scope replayed as a CUDA graph.
  if (o.decode_steps > 0) {
    const int ctx = o.decode_ctx;
    const int per = (ctx + o.decode_steps + bs) / bs + 1;  // blocks per sequence
    const int max_b = std::max(1, o.decode_batch);
    std::vector<std::vector<int32_t>> slots(max_b);
    for (int b = 0; b < max_b; ++b) {
      slots[b].resize(ctx + o.decode_steps);
      for (int p = 0; p < ctx + o.decode_steps; ++p) slots[b][p] = (b * per + p / bs) * bs + p % bs;
    }
    {
      SeqLayout seq(ctx, kv.num_blocks, bs, cfg.vocab_size, 4242);
      std::vector<int32_t> sl(slots[0].begin(), slots[0].begin() + ctx);
      LayerRows rows{seq.pos, sl, sl};
      CHECK_OK(runner->Forward(seq.ids, rows, {}).status());
      CHECK_OK(be->Synchronize());
    }
    // Batched decode attention of one layer alone, per kernel (PagedAttentionParams::
    // decode_kernel): B sequences of ctx keys each, one query row each; the figure is the K/V
    // bytes read per call over its time (the kernels' floor is the copy bandwidth).
    for (int B : {1, o.decode_batch}) {
      if (B < 1) continue;
      const int64_t qcols = static_cast<int64_t>(H + 2 * KV) * hd;
      Tensor q = Unwrap(be->Alloc(B, qcols), "Alloc");
      Tensor att = Unwrap(be->Alloc(B, static_cast<int64_t>(H) * hd), "Alloc");
      std::vector<float> qh(static_cast<size_t>(B) * qcols);
      std::mt19937 rng(11);
      std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
      for (float& v : qh) v = ud(rng);
      CHECK_OK(be->Upload(qh, q));
      std::vector<int32_t> rows(B + 1), start(B), len(B, ctx), qpos(B, ctx - 1), all_slots;
      for (int b = 0; b <= B; ++b) rows[b] = b;
      for (int b = 0; b < B; ++b) {
        start[b] = static_cast<int32_t>(all_slots.size());
        all_slots.insert(all_slots.end(), slots[b].begin(), slots[b].begin() + ctx);
      }
      int32_t *d_rows, *d_start, *d_len, *d_qpos, *d_slots;
      cudaMalloc(&d_rows, rows.size() * 4);
      cudaMalloc(&d_start, start.size() * 4);
      cudaMalloc(&d_len, len.size() * 4);
      cudaMalloc(&d_qpos, qpos.size() * 4);
      cudaMalloc(&d_slots, all_slots.size() * 4);
      cudaMemcpy(d_rows, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_start, start.data(), start.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_len, len.data(), len.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_qpos, qpos.data(), qpos.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_slots, all_slots.data(), all_slots.size() * 4, cudaMemcpyHostToDevice);
      kernels::PagedAttentionParams p;
      p.q = static_cast<const kernels::bf16*>(q.data);
      p.q_stride = qcols;
      p.out = static_cast<kernels::bf16*>(att.data);
      p.out_stride = att.cols;
      p.q_pos = d_qpos;
      p.num_q = B;
      p.k_pool = static_cast<const kernels::bf16*>(runner->pool().k[0].data);
      p.v_pool = static_cast<const kernels::bf16*>(runner->pool().v[0].data);
      p.kv_stride = runner->pool().kv_dim;
      p.ctx_slots = d_slots;
      p.ctx_len = static_cast<int>(all_slots.size());
      p.n_heads = H;
      p.n_kv_heads = KV;
      p.head_dim = hd;
      p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
      p.num_seqs = B;
      p.seq_rows = d_rows;
      p.seq_ctx_start = d_start;
      p.seq_ctx_len = d_len;
      p.max_seq_ctx = ctx;
      p.max_seq_rows = 1;
      const double bytes = 2.0 * B * ctx * KV * hd * 2;
      struct KernelCase {
        int kernel, waves, early;
        const char* name;
      };
      // Batch 1 fills 8 blocks: its split-K (about `waves` blocks per SM) decides the time.
      for (auto [kernel, waves, early, name] :
           {KernelCase{1, 0, 0, "tile"}, {0, 0, 0, "packed 16 keys"},
            {2, 0, 0, "packed 32 keys"}, {0, 1, 0, "packed 16 keys, split waves 1"},
            {0, 3, 0, "packed 16 keys, split waves 3"},
            {0, 4, 0, "packed 16 keys, split waves 4"},
            {0, 0, 1, "packed 16 keys, early key requests"}}) {
        if (waves > 0 && B > 1) continue;  // 256 blocks already fill the GPU: no split
        p.decode_kernel = kernel;
        p.split_waves = waves;
        p.decode_early_kv = early;
        const size_t ws_bytes = kernels::PagedAttentionWorkspaceBytes(p);
        void* ws = nullptr;
        if (ws_bytes) cudaMalloc(&ws, ws_bytes);
        std::vector<double> t;
        for (int r = 0; r < 3 + 20; ++r) {
          timer.Start();  // 10 calls back to back: a batch-1 call is ~10 us
          for (int k = 0; k < 10; ++k) {
            const cudaError_t e = kernels::PagedAttention(p, ws, ws_bytes, stream);
            if (e != cudaSuccess) {
              std::fprintf(stderr, "PagedAttention (decode, %s): %s\n", name,
                           cudaGetErrorString(e));
              return 1;
            }
          }
          const double ms = timer.StopMs() / 10;
          if (r >= 3) t.push_back(ms);
        }
        cudaFree(ws);
        const double med = Median(t);
        char extra[160];
        std::snprintf(extra, sizeof extra,
                      ", \"batch\": %d, \"kernel\": \"%s\", \"gb_per_s\": %.0f", B, name,
                      bytes / med * 1e-6);
        records.push_back({"decode_attention_layer", ctx, med,
                           *std::min_element(t.begin(), t.end()), 20, extra});
        std::printf("decode attention (1 layer, batch %d, %d keys each, %s): %.4f ms = %.0f "
                    "GB/s\n", B, ctx, name, med, bytes / med * 1e-6);
      }
      for (int32_t* d : {d_rows, d_start, d_len, d_qpos, d_slots}) cudaFree(d);
      be->Free(q);
      be->Free(att);
    }
    std::vector<int> batches = {1};
    if (o.decode_batch > 1) batches.push_back(o.decode_batch);
    // Plain launches, a CUDA graph, and a CUDA graph whose tokens are drawn on the device:
    // greedy, and at temperature 1 (Gumbel-max; the scheduler's path for such requests).
    struct Mode {
      bool graph, draw;
      float inv_temperature;
      const char* suffix;
      const char* what;
    };
    const Mode modes[] = {{false, false, 0.0f, "_launches", ", launches"},
                          {true, false, 0.0f, "", ", CUDA graph"},
                          {true, true, 0.0f, "_device_greedy", ", CUDA graph, greedy on the device"},
                          {true, true, 1.0f, "_device_t1", ", CUDA graph, T=1 on the device"}};
    for (int B : batches) {
      for (const Mode& m : modes) {
        const bool graph = m.graph;
        const auto before = be->graph_stats();
        uint64_t tokens = 0;
        auto [med, mn] = DecodeSteps(*runner, timer, slots, ctx, o.decode_steps, B, graph, m.draw,
                                     m.inv_temperature, &tokens);
        const auto after = be->graph_stats();
        const std::string name = B == 1 ? "decode_bs1_ms_per_token"
                                        : "decode_bs" + std::to_string(B) + "_ms_per_step";
        char extra[200];
        std::snprintf(extra, sizeof extra,
                      ", \"batch\": %d, \"context\": %d, \"tokens_per_s\": %.1f, "
                      "\"cuda_graph\": %s, \"graph_replays\": %lld",
                      B, ctx, 1000.0 * B / med, graph ? "true" : "false",
                      static_cast<long long>(after.replayed - before.replayed));
        records.push_back({name + m.suffix, ctx, med, mn, o.decode_steps - 3, extra});
        std::printf("decode batch %d at %d context%s: %.3f ms/step = %.0f tokens/s (min %.3f; "
                    "%lld graph replays; tokens %016llx)\n",
                    B, ctx, m.what, med, 1000.0 * B / med, mn,
                    static_cast<long long>(after.replayed - before.replayed),
                    static_cast<unsigned long long>(tokens));
      }
      if (B == o.profile_decode) {
        // Steps of the default serving path (graph, greedy drawn on the device) between
        // cudaProfilerStart and Stop, for a tracer (bench/gpu/profile_decode_trace.sh, which
        // divides by 11): the timed modes above captured the graphs, so all 11 are replays.
        cudaProfilerStart();
        DecodeSteps(*runner, timer, slots, ctx, std::min(11, o.decode_steps), B, true, true, 0.0f);
        CHECK_OK(be->Synchronize());
        cudaProfilerStop();
      }
    }
  }

  WriteJson(o.out, prop, dense_attention, cfg.n_layers, records);
  return 0;
}
#else
int Main(const Options&) {
  std::printf("gpu_prefill_bench: built without CUDA (SPARSEX_WITH_CUDA=0); nothing measured\n");
  return 0;
}
#endif

}  // namespace
}  // namespace sparsex

int main(int argc, char** argv) {
  sparsex::Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--lengths") {
      o.lengths = sparsex::ParseList(next());
    } else if (a == "--reps") {
      o.reps = std::atoi(next());
    } else if (a == "--warmup") {
      o.warmup = std::atoi(next());
    } else if (a == "--decode-ctx") {
      o.decode_ctx = std::atoi(next());
    } else if (a == "--decode-steps") {
      o.decode_steps = std::atoi(next());
    } else if (a == "--decode-batch") {
      o.decode_batch = std::atoi(next());
    } else if (a == "--layers") {
      o.layers = std::atoi(next());
    } else if (a == "--no-micro") {
      o.micro = false;
    } else if (a == "--profile-decode") {
      o.profile_decode = std::atoi(next());
    } else if (a == "--small-n") {
      o.small_n = true;
    } else if (a == "--out") {
      o.out = next();
    } else {
      std::fprintf(stderr,
                   "usage: gpu_prefill_bench [--lengths 2048,8192,16384,32768] [--reps 3] "
                   "[--warmup 1] [--decode-ctx 8192] [--decode-steps 32] [--decode-batch 32] [--layers N] "
                   "[--no-micro] [--small-n] [--profile-decode B] [--out file.json]\n");
      return 2;
    }
  }
  if (o.lengths.empty() || o.reps < 1) return 2;
  return sparsex::Main(o);
}
