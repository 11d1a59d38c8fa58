// sparsex-fetch-bench: where a worker's cache-cluster fetch spends its time, on this machine.
//
//   build/bin/sparsex-fetch-bench [--segments 2] [--tokens 4064] [--layers 32] [--kv_dim 1024]
//       [--iters 3] [--ucx_tls ...] [--fetch_batch_mb 512] [--wire_dtype f32|bf16]
//       [--arena_mb N] [--dead_peers N] [--writer_process 1] [--mapped_copies 0|1]
//       [--json OUT.json]
//
// Starts sparsex-cache-server (memory only) on 127.0.0.1, writes `segments` segments of the
// given shape (defaults: Llama-3-8B segments of the serving benchmark, fp32 K and V as the
// worker's host store keeps them, ~1 GiB each) through ClusterKvTier::Put, then fetches them
// `iters` times into a fresh SegmentStore with ClusterKvTier::FetchMissing, the worker's own
// fetch path (blocks travel as --wire_dtype: f32, or bf16 as a CUDA worker writes them), and
// prints each fetch's phases (FetchOutcome::phases: lookup, lock, transfer,
// decode, put) and GB/s. The server's arena holds every segment (no disk promotion).
// --dead_peers N first starts N other fetchers (this binary, --peer mode: each connects and
// fetches every segment once), then kills them with SIGKILL before the measured fetches, as
// bench/gpu/fetch.sh kills worker A before worker B fetches: whether a dead peer's endpoints
// slow the cache server's data plane for the others. --mapped_copies 0 moves the bytes with
// UCX's gets and puts instead of copies through the mapped arena (the default on one host).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_args.h"
#include "gpu_worker/service/kv_tier.h"
#include "testing/server_process.h"

namespace {

using namespace sparsex;
using namespace sparsex::service;
using Clock = std::chrono::steady_clock;

using sparsex::bench::Args;

SegmentKv MakeSegment(int tokens, int layers, int kv_dim, float base) {
  SegmentKv kv;
  kv.n_tokens = tokens;
  kv.n_layers = layers;
  kv.kv_dim = kv_dim;
  const size_t n = static_cast<size_t>(tokens) * kv_dim;
  for (int l = 0; l < layers; ++l) {
    std::vector<float> k(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      k[i] = base + 0.001f * static_cast<float>(i % 4093) + l;
      v[i] = -base - 0.002f * static_cast<float>(i % 4091) - l;
    }
    kv.k.push_back(std::move(k));
    kv.v.push_back(std::move(v));
  }
  return kv;
}

// Writes segments 1..n through ClusterKvTier::Put; *put_s: the write-backs alone.
absl::Status WriteSegments(ClusterKvTier& tier, int segments, int tokens, int layers,
                           int kv_dim, double* put_s) {
  *put_s = 0;
  for (int s = 0; s < segments; ++s) {
    const Hash128 fp{0xfe7c4, static_cast<uint64_t>(s + 1)};
    SegmentKv kv = MakeSegment(tokens, layers, kv_dim, static_cast<float>(s));
    const Clock::time_point put0 = Clock::now();
    RETURN_IF_ERROR(tier.Put(fp, kv));
    *put_s += std::chrono::duration<double>(Clock::now() - put0).count();
  }
  return absl::OkStatus();
}

// --peer ADDR: connect, then with --put 1 write the segments (the writer process), else fetch
// them once (a peer to be killed); write --ready (the put seconds), then wait to be killed.
int Peer(const Args& a) {
  const int segments = static_cast<int>(a.U("segments", 2));
  const int tokens = static_cast<int>(a.U("tokens", 4064));
  const int layers = static_cast<int>(a.U("layers", 32));
  const int kv_dim = static_cast<int>(a.U("kv_dim", 1024));
  ClusterTierOptions t;
  t.servers = {a.Get("peer", "")};
  t.ucx_tls = a.Get("ucx_tls", "");
  t.mapped_copies = a.U("mapped_copies", 1) != 0;
  t.fetch_batch_bytes = a.U("fetch_batch_mb", 512) << 20;
  t.wire_dtype = a.Get("wire_dtype", "f32");
  auto tier = ClusterKvTier::Connect(t, Hash128{0x5eed, 8}, layers, kv_dim);
  if (!tier.ok()) {
    std::fprintf(stderr, "peer connect: %s\n", tier.status().ToString().c_str());
    return 1;
  }
  if (a.U("put", 0) != 0) {
    double put_s = 0;
    if (absl::Status st = WriteSegments(**tier, segments, tokens, layers, kv_dim, &put_s);
        !st.ok()) {
      std::fprintf(stderr, "writer: %s\n", st.ToString().c_str());
      return 1;
    }
    std::ofstream(a.Get("ready", "")) << put_s << "\n";
    return 0;
  }
  std::vector<SegmentRef> refs;
  for (int s = 0; s < segments; ++s) refs.push_back({Hash128{0xfe7c4, uint64_t(s + 1)}, tokens});
  SegmentStoreOptions so;
  so.capacity_bytes = uint64_t(2) * tokens * kv_dim * sizeof(float) * layers * segments +
                      (64ull << 20);
  SegmentStore store(so);
  FetchOutcome f = (*tier)->FetchMissing(refs, &store);
  std::printf("peer: fetched %d of %d segments\n", f.fetched, segments);
  std::fflush(stdout);
  std::ofstream(a.Get("ready", "")) << f.fetched << "\n";
  std::this_thread::sleep_for(std::chrono::minutes(10));  // killed long before
  return 0;
}

int Run(const Args& a) {
  if (!a.Get("peer", "").empty()) return Peer(a);
  const int segments = static_cast<int>(a.U("segments", 2));
  const int tokens = static_cast<int>(a.U("tokens", 4064));
  const int layers = static_cast<int>(a.U("layers", 32));
  const int kv_dim = static_cast<int>(a.U("kv_dim", 1024));
  const int iters = static_cast<int>(a.U("iters", 3));
  const std::string tls = a.Get("ucx_tls", "");
  const uint64_t layer_bytes = static_cast<uint64_t>(tokens) * kv_dim * 2 * sizeof(float);
  const uint64_t total = layer_bytes * layers * segments;
  // The server's arena: every segment with room to spare, or --arena_mb (the cluster run of
  // bench/gpu/fetch.sh gives its cache server 32 GB: a larger arena than the bytes it holds).
  const uint64_t arena_mb = a.U("arena_mb", 0);
  const uint64_t arena = arena_mb ? arena_mb << 20 : total + total / 8 + (256ull << 20);

  const std::string dir = sparsex::cache::testing::MakeTempDir("sparsex-fetch-bench-");
  std::vector<std::string> env;
  if (!tls.empty()) env.push_back("UCX_TLS=" + tls);
  auto server = sparsex::cache::testing::ServerProcess::Start(
      sparsex::cache::testing::BinDir(),
      {"--disk_backend=none", absl::StrCat("--memory_capacity=", arena),
       absl::StrCat("--max_block_bytes=", layer_bytes + 65536), "--metrics_port=-1"},
      dir, std::chrono::seconds(30), env);
  if (!server.ok()) {
    std::fprintf(stderr, "cache server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  ClusterTierOptions t;
  t.servers = {(*server)->address()};
  t.ucx_tls = tls;
  t.mapped_copies = a.U("mapped_copies", 1) != 0;
  t.fetch_batch_bytes = a.U("fetch_batch_mb", 512) << 20;
  t.wire_dtype = a.Get("wire_dtype", "f32");
  const Hash128 model{0x5eed, 8};
  auto tier = ClusterKvTier::Connect(t, model, layers, kv_dim);
  if (!tier.ok()) {
    std::fprintf(stderr, "connect: %s\n", tier.status().ToString().c_str());
    return 1;
  }
  std::vector<SegmentRef> refs;
  // The segments are written by this process, or with --writer_process 1 by a child process
  // (as worker A writes what worker B fetches: B's mapping of the server's arena is fresh).
  double put_s = 0;
  const bool writer_process = a.U("writer_process", 0) != 0;
  for (int s = 0; s < segments; ++s) refs.push_back({Hash128{0xfe7c4, uint64_t(s + 1)}, tokens});
  if (writer_process) {
    const std::string ready = absl::StrCat(dir, "/writer.ready");
    std::vector<std::string> argv = {
        "/proc/self/exe", "--peer", (*server)->address(), "--put", "1", "--ready", ready,
        "--segments", absl::StrCat(segments), "--tokens", absl::StrCat(tokens),
        "--layers", absl::StrCat(layers), "--kv_dim", absl::StrCat(kv_dim),
        "--wire_dtype", t.wire_dtype, "--mapped_copies", t.mapped_copies ? "1" : "0"};
    if (!tls.empty()) argv.insert(argv.end(), {"--ucx_tls", tls});
    auto child = sparsex::cache::testing::ChildProcess::Spawn(
        argv, absl::StrCat(dir, "/writer.log"), env);
    if (!child.ok()) {
      std::fprintf(stderr, "writer: %s\n", child.status().ToString().c_str());
      return 1;
    }
    auto st = (*child)->Wait(std::chrono::minutes(5));
    if (!st.ok() || *st != 0 || !(std::ifstream(ready) >> put_s)) {
      std::fprintf(stderr, "writer process failed (see %s/writer.log)\n", dir.c_str());
      return 1;
    }
  } else if (absl::Status st = WriteSegments(**tier, segments, tokens, layers, kv_dim, &put_s);
             !st.ok()) {
    std::fprintf(stderr, "put: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("%d segments of %d tokens x %d layers x kv_dim %d (fp32 K+V: %.1f MiB each) "
              "written back%s in %.2f s (%.2f GB/s of fp32 K/V)\n",
              segments, tokens, layers, kv_dim, layer_bytes * layers / 1048576.0,
              writer_process ? " by another process" : "", put_s, total / put_s * 1e-9);

  // Dead peers: started, each fetches every segment once, then SIGKILL (no disconnect).
  const int dead = static_cast<int>(a.U("dead_peers", 0));
  std::vector<std::unique_ptr<sparsex::cache::testing::ChildProcess>> peers;
  for (int p = 0; p < dead; ++p) {
    const std::string ready = absl::StrCat(dir, "/peer", p, ".ready");
    std::vector<std::string> argv = {
        "/proc/self/exe", "--peer", (*server)->address(), "--ready", ready,
        "--segments", absl::StrCat(segments), "--tokens", absl::StrCat(tokens),
        "--layers", absl::StrCat(layers), "--kv_dim", absl::StrCat(kv_dim),
        "--fetch_batch_mb", absl::StrCat(a.U("fetch_batch_mb", 512))};
    if (!tls.empty()) argv.insert(argv.end(), {"--ucx_tls", tls});
    std::vector<std::string> penv;
    if (!tls.empty()) penv.push_back("UCX_TLS=" + tls);
    auto child = sparsex::cache::testing::ChildProcess::Spawn(
        argv, absl::StrCat(dir, "/peer", p, ".log"), penv);
    if (!child.ok()) {
      std::fprintf(stderr, "peer: %s\n", child.status().ToString().c_str());
      return 1;
    }
    const Clock::time_point until = Clock::now() + std::chrono::seconds(120);
    while (!std::ifstream(ready).good() && (*child)->Running() && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!std::ifstream(ready).good()) {
      std::fprintf(stderr, "peer %d did not fetch (see %s/peer%d.log)\n", p, dir.c_str(), p);
      return 1;
    }
    peers.push_back(std::move(*child));
  }
  for (auto& p : peers) {
    p->Signal(SIGKILL);
    (void)p->Wait(std::chrono::seconds(10));
  }
  if (dead > 0) std::printf("%d peer(s) fetched every segment, then were killed (SIGKILL)\n", dead);

  std::string records;
  for (int it = 0; it < iters; ++it) {
    SegmentStoreOptions so;
    so.capacity_bytes = total + (64ull << 20);
    SegmentStore store(so);
    const Clock::time_point t0 = Clock::now();
    FetchOutcome f = (*tier)->FetchMissing(refs, &store);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    const FetchPhases& p = f.phases;
    std::printf("fetch %d: %d of %d segments, %.1f MiB in %.1f ms = %.2f GB/s | lookup %.1f, "
                "lock %.1f, transfer %.1f (%.2f GB/s), decode %.1f, put %.1f ms\n",
                it + 1, f.fetched, segments, f.bytes / 1048576.0, ms, f.bytes / ms * 1e-6,
                p.lookup_ms, p.lock_ms, p.transfer_ms,
                p.transfer_ms > 0 ? f.bytes / p.transfer_ms * 1e-6 : 0.0, p.decode_ms, p.put_ms);
    if (f.fetched != segments) {
      std::fprintf(stderr, "fetch %d: %d failures (%s)\n", it + 1, f.failures,
                   f.failure_reasons.empty() ? "" : f.failure_reasons[0].c_str());
      return 1;
    }
    absl::StrAppend(&records, records.empty() ? "" : ",\n",
                    absl::StrFormat("  {\"iter\": %d, \"bytes\": %d, \"ms\": %.2f, \"gb_per_s\": "
                                    "%.3f, \"lookup_ms\": %.2f, \"lock_ms\": %.2f, "
                                    "\"transfer_ms\": %.2f, \"decode_ms\": %.2f, \"put_ms\": %.2f}",
                                    it + 1, f.bytes, ms, f.bytes / ms * 1e-6, p.lookup_ms,
                                    p.lock_ms, p.transfer_ms, p.decode_ms, p.put_ms));
  }
  (*server)->Stop();
  sparsex::cache::testing::RemoveTree(dir);
  if (const std::string path = a.Get("json", ""); !path.empty()) {
    std::ofstream out(path);
    out << absl::StrFormat("{\"segments\": %d, \"tokens\": %d, \"layers\": %d, \"kv_dim\": %d, "
                           "\"ucx_tls\": \"%s\", \"mapped_copies\": %s, \"wire_dtype\": \"%s\", \"arena_bytes\": %d, "
                           "\"dead_peers\": %d, \"writer_process\": %s, \"put_s\": %.3f, \"fetches\": [\n%s\n]}\n",
                           segments, tokens, layers, kv_dim, tls,
                           t.mapped_copies ? "true" : "false", t.wire_dtype, arena, dead,
                           writer_process ? "true" : "false", put_s, records);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return sparsex::bench::Main(argc, argv, Run); }
