// A GPU timeline without Nsight Systems (the H100 machines have none): a CUPTI injection
// library. Loaded by the CUDA driver through CUDA_INJECTION64_PATH, it records every kernel,
// copy and memset between the program's cudaProfilerStart and cudaProfilerStop (the whole run
// when SPX_CUPTI_RANGE=0) with the host time at which the API call that queued it began, and
// writes them at the stop as CSV to $SPX_CUPTI_OUT (default cupti_trace.csv), the columns
// bench/gpu/nsys_gaps.py reads: Start (ns), Duration (ns), Launch (ns), Stream, Name. With the
// launch times a gap shows whether the host queued the next operation late (host-bound) or the
// device sat on work it already had (dependencies, launch latency); <out>.api.csv lists the
// host's CUDA calls (what it was doing meanwhile).
//
//   CUDA_INJECTION64_PATH=.../libspx_cupti_trace.so SPX_CUPTI_OUT=t.csv \
//     reuse_prefill_bench ... --profile-range reuse_device
#include <cupti.h>
#include <cxxabi.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Op {
  uint64_t start, end;
  uint32_t correlation, stream;
  std::string name;
};

std::mutex mu;  // CUPTI delivers buffers from its own thread
std::vector<Op> ops;
std::unordered_map<uint32_t, uint64_t> launch_at;  // correlation id -> API call start
struct ApiCall {
  uint64_t start, end;
  CUpti_CallbackDomain domain;
  CUpti_CallbackId cbid;
};
std::vector<ApiCall> api;  // the host's CUDA calls (what it did while the device idled)
std::atomic<bool> tracing{false}, written{false};

constexpr CUpti_ActivityKind kKinds[] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
    CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};

void Report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  std::fprintf(stderr, "cupti_trace: %s: %s\n", what, s ? s : "unknown error");
}

// The kernel's qualified name with its template arguments (which tell the variants apart),
// without the return type, the parameter list and the anonymous namespaces; CSV-safe.
std::string Demangled(const char* n) {
  int st = 0;
  char* d = abi::__cxa_demangle(n, nullptr, nullptr, &st);
  std::string out = st == 0 && d ? d : n;
  std::free(d);
  const std::string anon = "(anonymous namespace)::";
  for (size_t at; (at = out.find(anon)) != std::string::npos;) out.erase(at, anon.size());
  if (out.rfind("void ", 0) == 0) out.erase(0, 5);
  // The parameter list: the first '(' outside template brackets.
  int depth = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == '<') ++depth;
    if (out[i] == '>') --depth;
    if (out[i] == '(' && depth == 0) {
      out.resize(i);
      break;
    }
  }
  for (char& c : out) {
    if (c == ',' || c == '"') c = ';';
  }
  return out;
}

void CUPTIAPI BufferRequested(uint8_t** buf, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = 8 << 20;
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buf ? kBytes : 0;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
        ops.push_back({k->start, k->end, k->correlationId, k->streamId, Demangled(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
        ops.push_back({m->start, m->end, m->correlationId, m->streamId,
                       "[CUDA memcpy kind " + std::to_string(m->copyKind) + " " +
                           std::to_string(m->bytes) + " B]"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
        ops.push_back({m->start, m->end, m->correlationId, m->streamId,
                       "[CUDA memset " + std::to_string(m->bytes) + " B]"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(rec);
        // A launch's correlation id may name both a runtime call and the driver call under
        // it: the earliest start is kept, the outermost call's.
        const uint32_t id = a->correlationId;  // packed fields: copied, not bound
        const uint64_t at = a->start;
        auto [it, fresh] = launch_at.emplace(id, at);
        if (!fresh && at < it->second) it->second = at;
        api.push_back({at, a->end,
                       rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                : CUPTI_CB_DOMAIN_DRIVER_API,
                       a->cbid});
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
  std::free(buf);
}

void Write() {
  if (written.exchange(true)) return;
  Report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flush");
  const char* path = std::getenv("SPX_CUPTI_OUT");
  if (!path || !*path) path = "cupti_trace.csv";
  std::FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "cupti_trace: cannot write %s\n", path);
    return;
  }
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(f, "Start (ns),Duration (ns),Launch (ns),Stream,Name\n");
  for (const Op& o : ops) {
    auto it = launch_at.find(o.correlation);
    std::fprintf(f, "%llu,%llu,%llu,%u,%s\n", static_cast<unsigned long long>(o.start),
                 static_cast<unsigned long long>(o.end - o.start),
                 static_cast<unsigned long long>(it == launch_at.end() ? 0 : it->second),
                 o.stream, o.name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "cupti_trace: %zu operations written to %s\n", ops.size(), path);
  // The host's CUDA calls beside it (<path>.api.csv): Start (ns), Duration (ns), Name.
  const std::string api_path = std::string(path) + ".api.csv";
  if (std::FILE* g = std::fopen(api_path.c_str(), "w")) {
    std::fprintf(g, "Start (ns),Duration (ns),Name\n");
    for (const ApiCall& c : api) {
      const char* name = nullptr;
      cuptiGetCallbackName(c.domain, c.cbid, &name);
      std::fprintf(g, "%llu,%llu,%s\n", static_cast<unsigned long long>(c.start),
                   static_cast<unsigned long long>(c.end - c.start), name ? name : "?");
    }
    std::fclose(g);
  }
}

void Enable(bool on) {
  if (tracing.exchange(on) == on) return;
  for (CUpti_ActivityKind k : kKinds) {
    Report(on ? cuptiActivityEnable(k) : cuptiActivityDisable(k), "activity kind");
  }
}

void CUPTIAPI OnApi(void*, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API) return;
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (cbid == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000 &&
      info->callbackSite == CUPTI_API_EXIT) {
    Enable(true);
  } else if (cbid == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000 &&
             info->callbackSite == CUPTI_API_ENTER) {
    Write();  // before disabling: records still in flight are flushed with their kinds on
    Enable(false);
  }
}

}  // namespace

// Called once by the CUDA driver at cuInit when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  Report(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted), "buffers");
  const char* range = std::getenv("SPX_CUPTI_RANGE");
  if (range && std::strcmp(range, "0") == 0) {
    Enable(true);
    std::atexit(Write);
    return 1;
  }
  CUpti_SubscriberHandle sub;
  Report(cuptiSubscribe(&sub, OnApi, nullptr), "subscribe");
  Report(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API,
                             CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000),
         "profiler start callback");
  Report(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API,
                             CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000),
         "profiler stop callback");
  return 1;
}
