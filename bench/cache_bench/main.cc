// sparsex-cache-bench: cache server data-plane throughput next to ucx_perftest, and lookup
// latency, on this machine in one run.
//
//   build/bin/sparsex-cache-bench --json OUT.json [--iters 10] [--lookups 100000]
//       [--rounds 3] [--ucx_tls sysv,posix,cma,self] [--tokens 4096 --layers 32 --kv_dim 1024]
//       [--perftest /usr/bin/ucx_perftest] [--server_args "--flag=value ..."]
//
// 1. Starts build/bin/sparsex-cache-server (no disk tier) on 127.0.0.1, puts one segment of a
//    Llama-3-8B shape (4096 tokens x 32 layers x 8 KV heads x 128 dims x K,V x bf16 = 512 MiB,
//    one 16 MiB block per layer) and fetches it `iters` times with CacheClient::FetchInto
//    (lease, 32 RMA gets in layer order, xxh3 verification of every block, release).
// 2. Runs ucx_perftest -t ucp_get with the same message size (16 MiB) and the same UCX_TLS.
// 3. Puts `lookup_blocks` tiny blocks and times `lookups` single-fingerprint Lookup RPCs
//    (half present, half absent), plus batches of 1000.
// Writes {fetch_gbps, perftest_gbps, ratio, lookup_p50_us, lookup_p99_us, ...}.
#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_args.h"
#include "cache_client/cache_client.h"
#include "cache_server/synthetic.h"
#include "testing/server_process.h"
#include "common/kv_block.h"

namespace {

using namespace sparsex;
using namespace sparsex::cache;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

using sparsex::bench::Args;

// ucx_perftest ucp_get bandwidth (GB/s, 1e9) for `size`-byte messages.
std::string g_perftest = "ucx_perftest";  // --perftest: path or name on PATH

absl::StatusOr<double> Perftest(uint64_t size, int iters, const std::string& tls,
                                std::string* log) {
  static int runs = 0;
  const int port = 20000 + static_cast<int>((getpid() * 7 + runs++) % 20000);
  std::vector<std::string> env;
  if (!tls.empty()) env.push_back("UCX_TLS=" + tls);
  const std::string dir = testing::MakeTempDir("sparsex-perftest-");
  ASSIGN_OR_RETURN(auto server,
                   testing::ChildProcess::Spawn(
                       {"/bin/sh", "-c", absl::StrCat("exec ", g_perftest, " -p ", port)},
                       dir + "/server.log", env));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::string cmd = absl::StrCat(tls.empty() ? "" : "UCX_TLS=" + tls + " ",
                                 g_perftest, " 127.0.0.1 -p ", port,
                                 " -t ucp_get -s ", size, " -n ", iters, " -w 5");
  *log = cmd;
  auto r = testing::RunCommand(cmd, std::chrono::seconds(120));
  server->Stop(std::chrono::seconds(5));
  testing::RemoveTree(dir);
  if (!r.ok()) return r.status();
  // "Final:  iters  lat50  lat_avg  lat_overall  bw_avg  bw_overall  rate_avg  rate_overall"
  std::regex re(R"(Final:\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+))");
  std::smatch m;
  if (!std::regex_search(r->second, m, re)) {
    return absl::UnavailableError("cannot parse ucx_perftest output:\n" + r->second);
  }
  const double mbps = std::stod(m[2]);  // overall, MB/s with MB = 2^20
  return mbps * 1048576.0 / 1e9;
}

int Run(const Args& a) {
  const std::string json_path = a.Get("json", "");
  g_perftest = a.Get("perftest", "ucx_perftest");
  const int iters = static_cast<int>(a.U("iters", 10));
  const uint64_t lookups = a.U("lookups", 100000);
  const uint64_t lookup_blocks = a.U("lookup_blocks", 10000);
  const std::string tls = a.Get("ucx_tls", "");
  SyntheticShape shape;
  shape.num_tokens = static_cast<uint32_t>(a.U("tokens", 4096));
  shape.kv_dim = static_cast<uint32_t>(a.U("kv_dim", 1024));
  const uint32_t layers = static_cast<uint32_t>(a.U("layers", 32));
  const uint64_t block_bytes = SyntheticBlockBytes(shape);
  const uint64_t segment_bytes = block_bytes * layers;
  const uint64_t arena = segment_bytes + (256ull << 20);

  const std::string dir = testing::MakeTempDir("sparsex-cache-bench-");
  std::vector<std::string> env;
  if (!tls.empty()) env.push_back("UCX_TLS=" + tls);
  std::vector<std::string> server_args = {
      "--disk_backend=none", absl::StrCat("--memory_capacity=", arena),
      absl::StrCat("--max_block_bytes=", block_bytes + 4096), "--metrics_port=-1"};
  {
    // Extra server flags, space separated (e.g. --server_args="--ucx_allocate_arena=false").
    std::string extra = a.Get("server_args", "");
    size_t p = 0;
    while (p < extra.size()) {
      size_t q = extra.find(' ', p);
      if (q == std::string::npos) q = extra.size();
      if (q > p) server_args.push_back(extra.substr(p, q - p));
      p = q + 1;
    }
  }
  auto server = testing::ServerProcess::Start(testing::BinDir(), server_args, dir,
                                              std::chrono::seconds(30), env);
  if (!server.ok()) {
    std::cerr << server.status() << "\n";
    return 1;
  }

  CacheClientOptions co;
  co.address = (*server)->address();
  co.model_fp = SyntheticModel(7);
  co.ucx_tls = tls;
  co.fallback_to_grpc = false;
  auto client = CacheClient::Connect(co);
  if (!client.ok()) {
    std::cerr << client.status() << "\n";
    return 1;
  }
  CacheClient& c = **client;

  // --- put the segment (twice: the first put into a fresh arena pays one page fault per
  // 4 KiB on both sides, which a VM makes expensive; the second is the steady state)
  std::vector<BlockKey> keys;
  for (uint32_t l = 0; l < layers; ++l) keys.push_back(SyntheticKey(7, 0, l));
  // Destination/source: memory from the data plane (--buffer=ucx, default) or plain
  // anonymous memory registered with it (--buffer=mmap).
  const bool ucx_buffer = a.Get("buffer", "ucx") == "ucx";
  uint8_t* buf = ucx_buffer ? c.AllocateBuffer(segment_bytes)
                            : static_cast<uint8_t*>(mmap(nullptr, segment_bytes,
                                                         PROT_READ | PROT_WRITE,
                                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (buf == nullptr) {
    std::cerr << "no buffer\n";
    return 1;
  }
  std::memset(buf, 0, segment_bytes);
  auto fill = [&] {
    for (uint32_t l = 0; l < layers; ++l) {
      std::span<uint8_t> blk(buf + l * block_bytes, block_bytes);
      (void)SyntheticBlockInto(co.model_fp, 7, 0, l, shape, blk);
    }
  };
  if (!ucx_buffer) (void)c.RegisterMemory(buf, segment_bytes);
  auto put_all = [&]() -> absl::StatusOr<double> {
    auto t0 = Clock::now();
    for (uint32_t l = 0; l < layers; ++l) {
      RETURN_IF_ERROR(c.Put(keys[l], {buf + l * block_bytes, block_bytes}));
    }
    return Seconds(Clock::now() - t0);
  };
  fill();
  auto put_cold = put_all();
  if (put_cold.ok()) (void)c.Evict(keys);
  auto put_warm = put_cold.ok() ? put_all() : put_cold;
  if (!put_warm.ok()) {
    std::cerr << "put: " << put_warm.status() << "\n";
    return 1;
  }
  std::memset(buf, 0, segment_bytes);

  // --- fetch, interleaved with ucx_perftest rounds so that both see the same machine load
  auto fetch = [&](CacheClient& cl, double* first_layer_s) -> absl::StatusOr<double> {
    auto start = Clock::now();
    bool first = true;
    auto st = cl.FetchInto(
        keys, [&](size_t i, uint64_t size) { return buf + i * block_bytes; },
        [&](size_t i, const absl::Status& s, std::span<const uint8_t>) {
          if (first && first_layer_s) *first_layer_s = Seconds(Clock::now() - start);
          first = false;
        });
    const double s = Seconds(Clock::now() - start);
    if (!st.ok()) return st.status();
    for (const auto& x : *st) {
      if (!x.ok()) return x;
    }
    return s;
  };
  CacheClientOptions nv = co;
  nv.verify = false;
  auto c2 = CacheClient::Connect(nv);
  if (!c2.ok()) {
    std::cerr << c2.status() << "\n";
    return 1;
  }
  if (!ucx_buffer) (void)(*c2)->RegisterMemory(buf, segment_bytes);
  const int rounds = static_cast<int>(a.U("rounds", 3));
  std::vector<double> times, first_layer, times_nv, perf_r, perf_block_r;
  std::string perf_cmd, perf_block_cmd;
  for (int round = 0; round < rounds; ++round) {
    for (int i = 0; i < iters + 1; ++i) {
      double fl = 0;
      auto s = fetch(c, &fl);
      if (!s.ok()) {
        std::cerr << "fetch: " << s.status() << "\n";
        return 1;
      }
      if (i > 0) {  // first is warm-up
        times.push_back(*s);
        first_layer.push_back(fl);
      }
    }
    for (int i = 0; i < iters + 1; ++i) {
      auto s = fetch(**c2, nullptr);
      if (s.ok() && i > 0) times_nv.push_back(*s);
    }
    // Same volume as one segment fetch (one 512 MiB message, DRAM to DRAM), and the block
    // size (one 16 MiB buffer reused, which stays in the CPU's last-level cache).
    auto perf = Perftest(segment_bytes, std::max(5, iters), tls, &perf_cmd);
    if (perf.ok()) perf_r.push_back(*perf);
    else std::cerr << "perftest: " << perf.status() << "\n";
    auto pb = Perftest(block_bytes, std::max(20, iters * static_cast<int>(layers) / 4), tls,
                       &perf_block_cmd);
    if (pb.ok()) perf_block_r.push_back(*pb);
    else std::cerr << "perftest: " << pb.status() << "\n";
  }
  // Byte-for-byte check of the last fetch.
  uint64_t mismatches = 0;
  {
    std::vector<uint8_t> want(block_bytes);
    for (uint32_t l = 0; l < layers; ++l) {
      (void)SyntheticBlockInto(co.model_fp, 7, 0, l, shape, want);
      mismatches += std::memcmp(want.data(), buf + l * block_bytes, block_bytes) != 0;
    }
  }
  if (!ucx_buffer) {
    (*c2)->UnregisterMemory(buf);
    c.UnregisterMemory(buf);
  }
  c2->reset();
  if (ucx_buffer) c.FreeBuffer(buf, segment_bytes);
  else munmap(buf, segment_bytes);
  const double fetch_s = Percentile(times, 0.5);
  const double fetch_gbps = static_cast<double>(segment_bytes) / fetch_s / 1e9;
  const double fetch_best_gbps =
      static_cast<double>(segment_bytes) / *std::min_element(times.begin(), times.end()) / 1e9;
  const double fetch_nv_gbps =
      times_nv.empty() ? 0 : static_cast<double>(segment_bytes) / Percentile(times_nv, 0.5) / 1e9;
  const double perf_gbps = Percentile(perf_r, 0.5);
  const double perf_block_gbps = Percentile(perf_block_r, 0.5);
  const double put_s = *put_warm;
  const double put_cold_s = *put_cold;

  // --- lookups
  SyntheticShape tiny;
  tiny.num_tokens = 1;
  tiny.kv_dim = 8;
  std::vector<BlockKey> present;
  for (uint64_t i = 0; i < lookup_blocks; ++i) {
    BlockKey k = SyntheticKey(8, i, 0);
    std::string b = SyntheticBlock(co.model_fp, 8, i, 0, tiny);
    absl::Status s = c.Put(k, KvBlockBytes(b));
    if (!s.ok() && s.code() != absl::StatusCode::kAlreadyExists) {
      std::cerr << "put tiny: " << s << "\n";
      return 1;
    }
    present.push_back(k);
  }
  std::vector<double> lat;
  lat.reserve(lookups);
  uint64_t hits = 0;
  for (uint64_t i = 0; i < lookups; ++i) {
    BlockKey k = (i % 2 == 0) ? present[(i / 2) % present.size()] : SyntheticKey(9, i, 0);
    auto s0 = Clock::now();
    auto r = c.Lookup({&k, 1});
    lat.push_back(Seconds(Clock::now() - s0) * 1e6);
    if (!r.ok()) {
      std::cerr << "lookup: " << r.status() << "\n";
      return 1;
    }
    hits += (*r)[0].present;
  }
  std::vector<double> batch_lat;
  for (uint64_t b = 0; b < std::max<uint64_t>(1, lookups / 1000); ++b) {
    std::vector<BlockKey> ks;
    for (uint64_t j = 0; j < 1000; ++j) {
      uint64_t i = b * 1000 + j;
      ks.push_back((i % 2 == 0) ? present[(i / 2) % present.size()] : SyntheticKey(9, i, 0));
    }
    auto s0 = Clock::now();
    auto r = c.Lookup(ks);
    batch_lat.push_back(Seconds(Clock::now() - s0) * 1e6);
    if (!r.ok()) return 1;
  }
  client->reset();
  (*server)->Stop();
  testing::RemoveTree(dir);

  char out[8192];
  std::snprintf(
      out, sizeof out,
      "{\n"
      "  \"segment_bytes\": %llu,\n  \"block_bytes\": %llu,\n  \"blocks\": %u,\n"
      "  \"iters\": %d,\n  \"ucx_tls\": \"%s\",\n  \"buffer\": \"%s\",\n"
      "  \"fetch_gbps\": %.3f,\n  \"fetch_best_gbps\": %.3f,\n"
      "  \"fetch_noverify_gbps\": %.3f,\n  \"fetch_median_ms\": %.2f,\n"
      "  \"first_layer_ms\": %.3f,\n  \"put_gbps\": %.3f,\n  \"put_cold_gbps\": %.3f,\n"
      "  \"rounds\": %d,\n"
      "  \"perftest_gbps\": %.3f,\n  \"perftest_cmd\": \"%s\",\n  \"ratio\": %.3f,\n"
      "  \"perftest_block_gbps\": %.3f,\n  \"perftest_block_cmd\": \"%s\",\n"
      "  \"ratio_vs_block\": %.3f,\n"
      "  \"byte_mismatches\": %llu,\n"
      "  \"lookups\": %llu,\n  \"lookup_hits\": %llu,\n  \"lookup_index_blocks\": %llu,\n"
      "  \"lookup_p50_us\": %.1f,\n  \"lookup_p99_us\": %.1f,\n"
      "  \"lookup_batch1000_p50_us\": %.1f,\n  \"lookup_batch1000_p99_us\": %.1f\n}\n",
      static_cast<unsigned long long>(segment_bytes), static_cast<unsigned long long>(block_bytes),
      layers, iters, tls.c_str(), ucx_buffer ? "ucx" : "mmap", fetch_gbps, fetch_best_gbps, fetch_nv_gbps, fetch_s * 1e3,
      Percentile(first_layer, 0.5) * 1e3, static_cast<double>(segment_bytes) / put_s / 1e9,
      static_cast<double>(segment_bytes) / put_cold_s / 1e9, rounds,
      perf_gbps, perf_cmd.c_str(), perf_gbps > 0 ? fetch_gbps / perf_gbps : 0.0,
      perf_block_gbps, perf_block_cmd.c_str(),
      perf_block_gbps > 0 ? fetch_gbps / perf_block_gbps : 0.0,
      static_cast<unsigned long long>(mismatches), static_cast<unsigned long long>(lookups),
      static_cast<unsigned long long>(hits), static_cast<unsigned long long>(lookup_blocks),
      Percentile(lat, 0.5), Percentile(lat, 0.99), Percentile(batch_lat, 0.5),
      Percentile(batch_lat, 0.99));
  std::cout << out;
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << out;
  }
  return mismatches == 0 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) { return sparsex::bench::Main(argc, argv, Run); }
