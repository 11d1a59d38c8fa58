// Reuse-prefill benchmark: time to first token of a RAG-shaped prompt whose documents are all
// stored segments (shuffled order) plus new tokens, against full prefill of the same prompt,
// through the engine's own ReuseEngine on any backend. Cases:
//   full         plain prefill of all tokens (one chunk)
//   reuse_device segments already in the device tier (GPU memory on CUDA)
//   reuse_pinned segments in the pinned host tier (bf16), copied to the device layer by layer
//                on a second stream while the full layers compute
//   reuse_host   segments copied from the fp32 host store for every request (tiers disabled)
// (--cases picks some: full always runs). Records carry the device memory peak on CUDA.
// Wall-clock time of the Prefill call, which ends by downloading the logits (synchronous);
// median of --reps runs after --warmup runs. One more run per case with ReuseOptions::profile
// reports where the time goes (lookup/staging, full layers, selection, sparse layers, logits).
//
//   reuse_prefill_bench --model synthetic:llama3-8b --device cuda --segments 8
//       --segment-tokens 4096 --new-tokens 256 --full-layers 2 --ratio 0.15 --out reuse.json
// --refresh-kv 0 turns off ReuseOptions::refresh_first_sparse_kv (its cost, measured);
// --assemble-ahead 0 turns off ReuseOptions::assemble_kv_ahead.
// --tp N runs every case on N tensor-parallel ranks (EngineGroup: CPU ranks in one process, or
// one GPU per rank over NCCL); the segment stores hold each rank's KV-head share.
// --profile-range CASE (CUDA builds): one more run of that case between cudaProfilerStart and
// cudaProfilerStop, so that `ncu --profile-from-start off` times only its kernels
// (bench/gpu/profile_prefill.sh) instead of the segment encoding's thousands before it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bench/gpu_memory.h"
#if SPARSEX_WITH_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#endif
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/engine/engine_group.h"
#include "gpu_worker/reuse/reuse_prefill.h"

namespace sparsex {
namespace {

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*v);
}
void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> a = {
      {"model", "synthetic:tiny"}, {"device", "cpu"},      {"segments", "8"},
      {"segment-tokens", "256"},   {"new-tokens", "32"},   {"full-layers", "2"},
      {"ratio", "0.15"},           {"reps", "3"},          {"warmup", "1"},
      {"out", "reuse_prefill.json"}, {"seed", "7"},          {"tp", "1"},
      {"cases", "full,reuse_device,reuse_pinned,reuse_host"}, {"refresh-kv", "1"},
      {"profile-range", ""}, {"assemble-ahead", "1"}};
  for (int i = 1; i + 1 < argc; i += 2) a[std::string(argv[i]).substr(2)] = argv[i + 1];
  const int nseg = std::stoi(a["segments"]), seg_len = std::stoi(a["segment-tokens"]),
            n_new = std::stoi(a["new-tokens"]), reps = std::stoi(a["reps"]),
            warmup = std::stoi(a["warmup"]), tp = std::stoi(a["tp"]);
  auto model = Check(LoadModel(a["model"]), "load model");
  const ModelConfig& c = model->config();
  const int total = 1 + nseg * seg_len + n_new;
  EngineOptions eo;
  eo.backend.kind = a["device"];
  eo.backend.cuda = CudaBackendOptionsFromEnv();  // the SPX_* kernel switches
  eo.kv.enable_prefix_caching = false;  // every run is a cold prefill of the same prompt
  eo.kv.num_blocks = (total + 2 * seg_len) / eo.kv.block_size + 16;
  eo.prefill_chunk = total;
  eo.tp.size = tp;
  std::vector<std::unique_ptr<SegmentStore>> stores;
  std::vector<SegmentStore*> store_ptrs;
  for (int r = 0; r < tp; ++r) {
    stores.push_back(std::make_unique<SegmentStore>(
        SegmentStoreOptions{.capacity_bytes = (size_t{64} << 30) / static_cast<size_t>(tp)}));
    store_ptrs.push_back(stores.back().get());
  }
  ReuseOptions ro;
  ro.full_layers = std::stoi(a["full-layers"]);
  ro.budget.ratio = std::stof(a["ratio"]);
  ro.refresh_first_sparse_kv = a["refresh-kv"] != "0";  // layer F's KV for every reused row
  ro.assemble_kv_ahead = a["assemble-ahead"] != "0";  // sparse layers' KV assembled at selection
  ro.store_new_segments = false;
  ro.register_prefix = false;

  std::mt19937 rng(std::stoi(a["seed"]));
  std::uniform_int_distribution<int> tok(10, c.vocab_size - 10);
  std::vector<PromptSegment> segs;
  for (int s = 0; s < nseg; ++s) {
    PromptSegment p;
    for (int i = 0; i < seg_len; ++i) p.tokens.push_back(tok(rng));
    segs.push_back(p);
  }
  PromptSegment question;
  for (int i = 0; i < n_new; ++i) question.tokens.push_back(tok(rng));
  question.cacheable = false;

  // One engine group per case (tiers differ); the stores persist across them.
  auto group = [&](size_t device_tier, size_t host_tier) {
    return Check(EngineGroup::Create(*model, eo, store_ptrs, ro, device_tier, host_tier),
                 "engine group");
  };
  auto t0 = std::chrono::steady_clock::now();
  auto host_only = group(0, 0);
  for (const auto& s : segs) Check(host_only->EnsureStored(s.tokens), "store segment");
  const double store_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::shuffle(segs.begin(), segs.end(), rng);  // reused in another order than stored
  segs.push_back(question);

  std::map<const ReuseStats*, bench::GpuMemory> mem;  // each case's device memory peak
  auto time_case = [&](EngineGroup& re, const ReuseOptions& o, ReuseStats* stats,
                       const char* name) {
    std::vector<double> ms;
    bench::GpuMemoryMeter meter;
    meter.Reset();
    ReuseOptions prof = o;
    prof.profile = true;
    for (int i = 0; i < warmup + reps; ++i) {
      auto s = std::chrono::steady_clock::now();
      auto r = Check(re.ReusePrefill(segs, true, &o), "prefill");
      const double t =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count();
      re.Release(r.seq);
      *stats = r.stats;
      if (i >= warmup) ms.push_back(t);
    }
    if (o.enable_reuse) {  // the phases, from one more (synchronising) run
      auto r = Check(re.ReusePrefill(segs, true, &prof), "prefill (profile)");
      re.Release(r.seq);
      *stats = r.stats;
    }
    mem[stats] = meter.Read();
    if (a["profile-range"] == name) {
#if SPARSEX_WITH_CUDA
      cudaDeviceSynchronize();
      cudaProfilerStart();
      auto r = Check(re.ReusePrefill(segs, true, &o), "prefill (profiler range)");
      cudaDeviceSynchronize();
      cudaProfilerStop();
      re.Release(r.seq);
#else
      std::fprintf(stderr, "--profile-range: a CUDA build only\n");
#endif
    }
    return Median(ms);
  };
  ReuseOptions full = ro;
  full.enable_reuse = false;
  // --cases picks which run (full always does: the others' speedups are against it); long
  // contexts skip the slow host case.
  auto wanted = [&](const char* c) {
    return ("," + a["cases"] + ",").find("," + std::string(c) + ",") != std::string::npos;
  };
  ReuseStats st_full, st_dev, st_pin, st_host;
  const double full_ms = time_case(*host_only, full, &st_full, "full");
  double host_ms = 0, dev_ms = 0, pin_ms = 0;
  if (wanted("reuse_host")) host_ms = time_case(*host_only, ro, &st_host, "reuse_host");
  host_only.reset();
  const size_t tier = (size_t{48} << 30) / static_cast<size_t>(tp);
  if (wanted("reuse_device")) {
    auto tiered = group(tier, 0);
    dev_ms = time_case(*tiered, ro, &st_dev, "reuse_device");
  }
  if (wanted("reuse_pinned")) {
    auto pinned = group(0, tier);
    pin_ms = time_case(*pinned, ro, &st_pin, "reuse_pinned");
  }

  std::printf("model %s on %s, tp %d: %d tokens (%d segments x %d + %d new), F=%d r=%.2f; "
              "segments encoded and stored in %.1f s\n",
              a["model"].c_str(), a["device"].c_str(), tp, total, nseg, seg_len, n_new,
              ro.full_layers, ro.budget.ratio, store_s);
  std::printf("%-14s %10s %8s %8s %8s %8s | profiled run (ms): %s\n", "case", "ttft_ms",
              "speedup", "reused", "select", "share", "lookup full select sparse logits");
  auto row = [&](const char* name, double ms, const ReuseStats& s) {
    std::printf("%-14s %10.1f %8.2f %8d %8d %8.3f | %.1f %.1f %.1f %.1f %.1f", name, ms,
                full_ms / ms, s.reused_tokens, s.selected_tokens, s.compute_share, s.lookup_ms,
                s.full_ms, s.select_ms, s.sparse_ms, s.logits_ms);
    if (mem[&s].total_gib > 0) std::printf(" | memory peak %.1f GiB", mem[&s].peak_gib());
    std::printf("\n");
  };
  struct Case {
    const char* name;
    double ms;
    const ReuseStats* stats;
  };
  std::vector<Case> cases = {{"full", full_ms, &st_full}};
  for (const Case& c : {Case{"reuse_device", dev_ms, &st_dev}, Case{"reuse_pinned", pin_ms, &st_pin},
                        Case{"reuse_host", host_ms, &st_host}}) {
    if (wanted(c.name)) cases.push_back(c);
  }
  for (const Case& c : cases) row(c.name, c.ms, *c.stats);
  std::ofstream f(a["out"]);
  f << "[\n";
  auto rec = [&](const char* name, double ms, const ReuseStats& s, bool last) {
    f << "  {\"case\": \"" << name << "\", \"model\": \"" << a["model"] << "\", \"device\": \""
      << a["device"] << "\", \"tp\": " << tp << ", \"tokens\": " << total << ", \"segments\": "
      << nseg << ", \"segment_tokens\": " << seg_len << ", \"new_tokens\": " << n_new
      << ", \"full_layers\": " << ro.full_layers << ", \"ratio\": " << ro.budget.ratio
      << ", \"ms\": " << ms
      << ", \"full_ms\": " << full_ms << ", \"speedup_vs_full\": " << full_ms / ms
      << ", \"reused_tokens\": " << s.reused_tokens << ", \"selected_tokens\": "
      << s.selected_tokens << ", \"compute_share\": " << s.compute_share
      << ", \"sparse_attended_keys\": " << s.sparse_attended_keys
      << ", \"profile_ms\": {\"lookup\": " << s.lookup_ms << ", \"full_layers\": " << s.full_ms
      << ", \"select\": " << s.select_ms << ", \"sparse_layers\": " << s.sparse_ms
      << ", \"logits\": " << s.logits_ms << "}" << mem[&s].JsonFields() << "}"
      << (last ? "\n" : ",\n");
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    rec(cases[i].name, cases[i].ms, *cases[i].stats, i + 1 == cases.size());
  }
  f << "]\n";
  return 0;
}

}  // namespace
}  // namespace sparsex

int main(int argc, char** argv) { return sparsex::Main(argc, argv); }
