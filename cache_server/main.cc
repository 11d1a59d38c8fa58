// sparsex-cache-server: the cache server binary. Every ServerOptions field is a flag
// (--name=value or --name value); sizes accept K/M/G/T suffixes (powers of 1024).
//
//   sparsex-cache-server --disk_path=/var/lib/sparsex/cache --memory_capacity=8G
//                        --grpc_port=50070 --metrics_port=9470
//
// SIGTERM/SIGINT shut down cleanly (in-flight RPCs finish; in write-back mode memory blocks
// are written to disk). With --ready_file=PATH the server writes
//   {"grpc_port":N,"metrics_port":M,"pid":P,"server_id":"...","instance_id":I}
// to PATH (atomically) once it serves, which is how tests find ports chosen with port 0.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>

#include "cache_server/server.h"

namespace {

using sparsex::cache::ServerOptions;

absl::StatusOr<uint64_t> ParseSize(const std::string& v) {
  if (v.empty()) return absl::InvalidArgumentError("empty size");
  size_t pos = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(v, &pos);
  } catch (...) {
    return absl::InvalidArgumentError("bad size '" + v + "'");
  }
  std::string suffix = v.substr(pos);
  uint64_t mul = 1;
  if (suffix == "" || suffix == "B") mul = 1;
  else if (suffix == "K" || suffix == "KiB") mul = 1ull << 10;
  else if (suffix == "M" || suffix == "MiB") mul = 1ull << 20;
  else if (suffix == "G" || suffix == "GiB") mul = 1ull << 30;
  else if (suffix == "T" || suffix == "TiB") mul = 1ull << 40;
  else return absl::InvalidArgumentError("bad size suffix in '" + v + "'");
  return static_cast<uint64_t>(n) * mul;
}

absl::StatusOr<bool> ParseBool(const std::string& v) {
  if (v == "" || v == "1" || v == "true" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "no") return false;
  return absl::InvalidArgumentError("bad boolean '" + v + "'");
}

struct Flag {
  const char* help;
  std::function<absl::Status(const std::string&)> set;
  bool is_bool = false;
};

std::map<std::string, Flag> Flags(ServerOptions* o, std::string* ready_file) {
  auto str = [](std::string* dst) {
    return [dst](const std::string& v) { *dst = v; return absl::OkStatus(); };
  };
  auto size = [](uint64_t* dst) {
    return [dst](const std::string& v) -> absl::Status {
      ASSIGN_OR_RETURN(*dst, ParseSize(v));
      return absl::OkStatus();
    };
  };
  auto u32 = [](uint32_t* dst) {
    return [dst](const std::string& v) -> absl::Status {
      ASSIGN_OR_RETURN(uint64_t x, ParseSize(v));
      if (x > 0xffffffffull) return absl::InvalidArgumentError("value too large");
      *dst = static_cast<uint32_t>(x);
      return absl::OkStatus();
    };
  };
  auto port = [](int* dst) {
    return [dst](const std::string& v) -> absl::Status {
      try {
        *dst = std::stoi(v);
      } catch (...) {
        return absl::InvalidArgumentError("bad port '" + v + "'");
      }
      if (*dst < -1 || *dst > 65535) return absl::InvalidArgumentError("bad port '" + v + "'");
      return absl::OkStatus();
    };
  };
  auto boolean = [](bool* dst) {
    return [dst](const std::string& v) -> absl::Status {
      ASSIGN_OR_RETURN(*dst, ParseBool(v));
      return absl::OkStatus();
    };
  };
  auto& c = o->cache;
  auto& t = o->transport;
  std::map<std::string, Flag> f;
  f["address"] = {"address to bind (default 127.0.0.1)", str(&o->address)};
  f["grpc_port"] = {"gRPC port, 0 = any free (default 0)", port(&o->grpc_port)};
  f["metrics_port"] = {"metrics port, 0 = any free, -1 = off (default 0)",
                       port(&o->metrics_port)};
  f["server_id"] = {"member name (default address:port)", str(&o->server_id)};
  f["memory_capacity"] = {"memory-tier arena bytes (default 1G)",
                          size(&c.memory_capacity_bytes)};
  f["max_block_bytes"] = {"largest block a put may reserve (default 256M)",
                          size(&c.max_block_bytes)};
  f["arena_alignment"] = {"arena allocation granularity (default 256)",
                          size(&c.arena_alignment)};
  f["eviction"] = {"memory eviction: lru | cost (default lru)",
                   [&c](const std::string& v) -> absl::Status {
                     if (v == "lru") c.eviction = sparsex::cache::EvictionPolicyKind::kLru;
                     else if (v == "cost" || v == "cost_aware")
                       c.eviction = sparsex::cache::EvictionPolicyKind::kCostAware;
                     else return absl::InvalidArgumentError("eviction must be lru or cost");
                     return absl::OkStatus();
                   }};
  f["disk_backend"] = {"rocksdb | memory | none (default rocksdb)", str(&c.disk_backend)};
  f["disk_path"] = {"RocksDB directory (required for rocksdb)", str(&c.disk_path)};
  f["disk_capacity"] = {"disk bytes before LRU removal, 0 = unbounded (default 0)",
                        size(&c.disk_capacity_bytes)};
  f["disk_reserve"] = {"free disk bytes kept, min 4M; below it: memory-only (default 512M)",
                       size(&c.disk_reserve_bytes)};
  f["disk_recheck_ms"] = {"how often a degraded disk tier is re-checked (default 1000)",
                          u32(&c.disk_recheck_ms)};
  f["write_through"] = {"persist on commit (default true)", boolean(&c.write_through), true};
  f["sync_writes"] = {"fsync the WAL per commit (default false)", boolean(&c.sync_writes), true};
  f["warm_load_bytes"] = {"bytes reloaded into memory after a restart (default 256M)",
                          size(&c.warm_load_bytes)};
  f["default_lease_ms"] = {"lease ttl when asked for 0 (default 30000)",
                           u32(&c.default_lease_ms)};
  f["max_lease_ms"] = {"longest lease (default 600000)", u32(&c.max_lease_ms)};
  f["reservation_timeout_ms"] = {"uncommitted puts reclaimed after (default 30000)",
                                 u32(&c.reservation_timeout_ms)};
  f["max_client_reserved_bytes"] = {
      "uncommitted bytes one client connection may reserve at once (default 0: a quarter of "
      "the memory capacity, at least one max_block_bytes)",
      size(&c.max_client_reserved_bytes)};
  f["sweep_interval_ms"] = {"sweeper period (default 100)", u32(&c.sweep_interval_ms)};
  f["transport"] = {"data plane: ucx | none (default ucx)", str(&t.kind)};
  f["ucx_tls"] = {"UCX transports, as UCX_TLS (default: env / UCX's choice)", str(&t.ucx_tls)};
  f["ucx_allocate_arena"] = {"let UCX allocate the arena (default true)",
                             boolean(&t.ucx_allocate_arena), true};
  f["prefault_arena"] = {"fault the arena in at startup, in the background (default true)",
                         boolean(&t.prefault_arena), true};
  f["cuda_pin"] = {"page-lock the arena for CUDA: auto | on | off (default auto)",
                   str(&t.cuda_pin)};
  f["ready_file"] = {"write ports as JSON here once serving", str(ready_file)};
  f["tls_ca"] = {"cluster CA (PEM): clients must present a certificate it signed",
                 str(&o->tls.ca)};
  f["tls_cert"] = {"this server's certificate (PEM, signed by the cluster CA)",
                   str(&o->tls.cert)};
  f["tls_key"] = {"this server's private key (PEM)", str(&o->tls.key)};
  f["insecure_loopback"] = {"serve plaintext without client certificates; refused unless "
                            "--address is loopback (default false)",
                            boolean(&o->insecure_loopback), true};
  return f;
}

void Usage(const std::map<std::string, Flag>& flags) {
  std::cout << "usage: sparsex-cache-server [--flag=value ...]\n";
  for (const auto& [name, f] : flags) std::cout << "  --" << name << "  " << f.help << "\n";
}

absl::Status WriteReadyFile(const std::string& path, const sparsex::cache::CacheServer& s) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "{\"grpc_port\":" << s.grpc_port() << ",\"metrics_port\":" << s.metrics_port()
        << ",\"pid\":" << getpid() << ",\"server_id\":\"" << s.server_id()
        << "\",\"instance_id\":" << s.instance_id() << "}\n";
    if (!out) return absl::UnavailableError("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError("cannot rename " + tmp);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  ServerOptions options;
  std::string ready_file;
  auto flags = Flags(&options, &ready_file);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      Usage(flags);
      return 0;
    }
    if (a.rfind("--", 0) != 0) {
      std::cerr << "unexpected argument '" << a << "'\n";
      return 2;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = flags.find(name);
    if (it == flags.end()) {
      std::cerr << "unknown flag --" << name << " (see --help)\n";
      return 2;
    }
    if (!has_value && !it->second.is_bool) {
      if (i + 1 >= argc) {
        std::cerr << "--" << name << " needs a value\n";
        return 2;
      }
      value = argv[++i];
    }
    if (absl::Status s = it->second.set(value); !s.ok()) {
      std::cerr << "--" << name << ": " << s.message() << "\n";
      return 2;
    }
  }

  // Signals are taken synchronously by this thread; block them before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto server = sparsex::cache::CacheServer::Start(options);
  if (!server.ok()) {
    std::cerr << "sparsex-cache-server: " << server.status() << "\n";
    return 1;
  }
  std::cerr << "sparsex-cache-server: serving " << (*server)->server_id() << " grpc port "
            << (*server)->grpc_port() << " metrics port " << (*server)->metrics_port()
            << " transport " << options.transport.kind << " instance " << (*server)->instance_id()
            << ((*server)->cuda_pinned() ? " arena cuda-pinned" : "") << "\n";
  if (!ready_file.empty()) {
    if (absl::Status s = WriteReadyFile(ready_file, **server); !s.ok()) {
      std::cerr << "sparsex-cache-server: " << s << "\n";
      return 1;
    }
  }
  int sig = 0;
  sigwait(&sigs, &sig);
  std::cerr << "sparsex-cache-server: signal " << sig << ", shutting down\n";
  (*server)->Shutdown();
  server->reset();
  return 0;
}
