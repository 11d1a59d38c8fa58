// sparsex-cache-cli: talk to cache servers from the shell, with deterministic synthetic blocks
// (cache_server/synthetic.h) so that any process can check what another one stored.
//
//   sparsex-cache-cli put    --address=127.0.0.1:50070 --seed=1 --segments=8 --layers=4
//   sparsex-cache-cli get    --address=127.0.0.1:50070 --seed=1 --segments=8 --layers=4
//   sparsex-cache-cli lookup --members=a:1,b:2 --replication=2 --seed=1 --segments=8
//   sparsex-cache-cli stats  --address=127.0.0.1:50070
//   sparsex-cache-cli evict  --address=127.0.0.1:50070 --all
//   sparsex-cache-cli hang-put --address=... --seed=1 --segment=0 --write_fraction=0.5
//       (reserves one block, writes part of it, prints "reserved <id>", then sleeps: for
//        testing what a client killed mid-put leaves behind)
//
// A server with credentials needs the cluster's: --tls_ca=ca.pem --tls_cert=c.pem --tls_key=k.pem.
// get exits 0 when every block matched byte for byte, 3 on a mismatch, 4 on a miss.
// Every command prints one JSON line.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "cache_client/cluster_client.h"
#include "cache_server/synthetic.h"
#include "common/kv_block.h"

namespace {

using namespace sparsex;
using namespace sparsex::cache;

struct Args {
  std::map<std::string, std::string> kv;
  std::string Get(const std::string& k, const std::string& def = "") const {
    auto it = kv.find(k);
    return it == kv.end() ? def : it->second;
  }
  uint64_t U(const std::string& k, uint64_t def) const {
    auto it = kv.find(k);
    return it == kv.end() ? def : std::stoull(it->second);
  }
  bool B(const std::string& k) const {
    auto it = kv.find(k);
    return it != kv.end() && it->second != "false" && it->second != "0";
  }
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t c = s.find(',', start);
    if (c == std::string::npos) c = s.size();
    if (c > start) out.push_back(s.substr(start, c - start));
    start = c + 1;
  }
  return out;
}

int Fail(const absl::Status& s) {
  std::cout << "{\"ok\":false,\"code\":" << static_cast<int>(s.code()) << ",\"error\":\""
            << std::string(s.message()) << "\"}" << std::endl;
  return 1;
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: sparsex-cache-cli put|get|lookup|stats|evict|hang-put --flag=value...\n";
    return 2;
  }
  const std::string cmd = argv[1];
  Args a;
  for (int i = 2; i < argc; ++i) {
    std::string s = argv[i];
    if (s.rfind("--", 0) != 0) {
      std::cerr << "bad argument " << s << "\n";
      return 2;
    }
    s = s.substr(2);
    auto eq = s.find('=');
    if (eq == std::string::npos) a.kv[s] = "true";
    else a.kv[s.substr(0, eq)] = s.substr(eq + 1);
  }
  const uint64_t seed = a.U("seed", 1);
  const uint64_t first = a.U("first", 0);
  const uint64_t segments = a.U("segments", 1);
  const uint32_t layers = static_cast<uint32_t>(a.U("layers", 1));
  SyntheticShape shape;
  shape.num_tokens = static_cast<uint32_t>(a.U("tokens", 16));
  shape.kv_dim = static_cast<uint32_t>(a.U("kv_dim", 64));

  ClusterClientOptions co;
  co.members = Split(a.Get("members", a.Get("address")));
  co.replication = static_cast<uint32_t>(a.U("replication", 1));
  co.client.model_fp = SyntheticModel(a.U("model_seed", seed));
  co.client.transport = a.Get("transport", "ucx");
  co.client.ucx_tls = a.Get("ucx_tls");
  co.client.mapped_copies = a.Get("mapped_copies", "true") != "false";
  co.client.lease_ttl_ms = static_cast<uint32_t>(a.U("lease_ms", 0));
  // A cache server with credentials serves only members: the CLI presents a certificate of
  // the cluster CA (docs/security.md).
  co.client.tls = {a.Get("tls_ca"), a.Get("tls_cert"), a.Get("tls_key")};
  if (co.members.empty()) {
    std::cerr << "--address or --members is required\n";
    return 2;
  }

  auto cluster = ClusterClient::Connect(co);
  if (!cluster.ok()) return Fail(cluster.status());
  ClusterClient& c = **cluster;

  std::vector<BlockKey> keys;
  std::vector<std::pair<uint64_t, uint32_t>> ids;
  for (uint64_t s = first; s < first + segments; ++s) {
    for (uint32_t l = 0; l < layers; ++l) {
      keys.push_back(SyntheticKey(seed, s, l));
      ids.emplace_back(s, l);
    }
  }

  // The client of the server owning the first key (what put and get report on).
  auto first_member = [&] {
    return c.Member(c.Owners(keys.empty() ? Hash128{} : keys[0].segment)[0]);
  };
  if (cmd == "put") {
    uint64_t stored = 0, existed = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      std::string b = SyntheticBlock(co.client.model_fp, seed, ids[i].first, ids[i].second, shape);
      absl::Status s = c.Put(keys[i], KvBlockBytes(b));
      if (s.code() == absl::StatusCode::kAlreadyExists) ++existed;
      else if (!s.ok()) return Fail(s);
      else ++stored;
    }
    auto m0 = first_member();
    std::cout << "{\"ok\":true,\"stored\":" << stored << ",\"existed\":" << existed
              << ",\"data_plane\":\"" << (m0.ok() ? (*m0)->data_plane() : "?")
              << "\",\"mapped_copies\":" << (m0.ok() && (*m0)->mapped_copies() ? "true" : "false")
              << "}"
              << std::endl;
    return 0;
  }
  if (cmd == "get") {
    std::vector<std::string> bufs(keys.size());
    uint64_t ok = 0, missing = 0, mismatched = 0;
    auto m0 = first_member();
    const size_t batch = std::max<uint32_t>(1, layers);  // one segment per lease
    for (size_t base = 0; base < keys.size(); base += batch) {
      std::span<const BlockKey> ks(keys.data() + base, std::min(batch, keys.size() - base));
      auto st = c.FetchInto(ks, [&](size_t i, uint64_t size) {
        bufs[base + i].resize(size);
        return reinterpret_cast<uint8_t*>(bufs[base + i].data());
      });
      if (!st.ok()) return Fail(st.status());
      for (size_t i = 0; i < ks.size(); ++i) {
        if (!(*st)[i].ok()) {
          ++missing;
          continue;
        }
        const auto [seg, layer] = ids[base + i];
        std::string want = SyntheticBlock(co.client.model_fp, seed, seg, layer, shape);
        if (want == bufs[base + i]) ++ok;
        else ++mismatched;
      }
    }
    std::cout << "{\"ok\":" << (missing == 0 && mismatched == 0 ? "true" : "false")
              << ",\"matched\":" << ok << ",\"missing\":" << missing
              << ",\"mismatched\":" << mismatched << ",\"mapped_copies\":"
              << (m0.ok() && (*m0)->mapped_copies() ? "true" : "false") << "}" << std::endl;
    return mismatched ? 3 : missing ? 4 : 0;
  }
  if (cmd == "lookup") {
    auto r = c.Lookup(keys);
    if (!r.ok()) return Fail(r.status());
    uint64_t present = 0, memory = 0;
    for (const auto& e : *r) {
      present += e.present;
      memory += e.present && e.tier == Tier::kMemory;
    }
    std::cout << "{\"ok\":true,\"present\":" << present << ",\"memory\":" << memory
              << ",\"total\":" << keys.size() << "}" << std::endl;
    return 0;
  }
  if (cmd == "stats" || cmd == "evict" || cmd == "hang-put") {
    auto m = c.Member(0);
    if (!m.ok()) return Fail(m.status());
    CacheClient& one = **m;
    if (cmd == "stats") {
      auto s = one.Stats();
      if (!s.ok()) return Fail(s.status());
      std::cout << "{\"ok\":true,\"memory_used_bytes\":" << s->memory_used_bytes
                << ",\"memory_capacity_bytes\":" << s->memory_capacity_bytes
                << ",\"memory_blocks\":" << s->memory_blocks
                << ",\"disk_blocks\":" << s->disk_blocks
                << ",\"active_leases\":" << s->active_leases
                << ",\"active_reservations\":" << s->active_reservations
                << ",\"reclaimed_reservations\":" << s->reclaimed_reservations
                << ",\"hits_memory\":" << s->hits_memory << ",\"hits_disk\":" << s->hits_disk
                << ",\"misses\":" << s->misses << ",\"corrupt_blocks\":" << s->corrupt_blocks
                << ",\"corrupt_reports_refuted\":" << s->corrupt_reports_refuted
                << ",\"disk_degraded\":" << (s->disk_degraded ? 1 : 0)
                << ",\"memory_only_commits\":" << s->memory_only_commits << "}" << std::endl;
      return 0;
    }
    if (cmd == "evict") {
      auto n = a.B("all") ? one.Evict({}, true) : one.Evict(keys);
      if (!n.ok()) return Fail(n.status());
      std::cout << "{\"ok\":true,\"evicted\":" << *n << "}" << std::endl;
      return 0;
    }
    // hang-put
    const uint64_t seg = a.U("segment", 0);
    std::string b = SyntheticBlock(co.client.model_fp, seed, seg, 0, shape);
    auto r = one.Reserve(SyntheticKey(seed, seg, 0), b.size());
    if (!r.ok()) return Fail(r.status());
    const double frac = std::stod(a.Get("write_fraction", "0.5"));
    const uint64_t n = static_cast<uint64_t>(static_cast<double>(b.size()) * frac);
    if (n > 0 && one.data_plane() == "ucx") {
      absl::Status s = one.Write(*r, {reinterpret_cast<const uint8_t*>(b.data()), n});
      if (!s.ok()) return Fail(s);
    }
    std::cout << "{\"ok\":true,\"reserved\":" << r->id << ",\"written\":" << n << "}"
              << std::endl;
    for (;;) pause();  // until killed
  }
  std::cerr << "unknown command " << cmd << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "sparsex-cache-cli: " << e.what() << "\n";
    return 2;
  }
}
