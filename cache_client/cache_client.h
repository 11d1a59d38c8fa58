// Client of one cache server, for workers: gRPC control plane + UCX data plane. Blocks are
// encoded KV blocks (common/kv_block.h); every fetched block is checksum-verified before it is
// handed out, and a block that fails is returned as a miss and reported to the server, which
// re-verifies its own copy and drops it only if that fails too. Only a block whose bytes
// arrived under a lease that held is reported; a failed transfer or a lost lease is a
// transport error. The client follows server restarts: replies carry the server's
// incarnation (instance_id), and before moving bytes the client exchanges endpoints again
// (GetEndpoint + reconnect) when its endpoint came from another incarnation or a transfer
// failed. No gRPC or UCX header leaks from here.
//
//   CacheClientOptions o;
//   o.address = "127.0.0.1:50070";
//   o.model_fp = model_fp;
//   ASSIGN_OR_RETURN(auto c, CacheClient::Connect(o));
//   RETURN_IF_ERROR(c->Put(key, block_bytes));                // reserve, RMA put, commit
//   std::vector<BlockKey> layers = ...;                       // layer order
//   ASSIGN_OR_RETURN(auto st, c->FetchInto(layers,
//       [&](size_t i, uint64_t size) { return dst[i]; },      // where block i lands
//       [&](size_t i, const absl::Status& s, std::span<const uint8_t> b) {
//         /* layer i ready (or missing): start computing */ }));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache_client/types.h"
#include "cache_client/block_key.h"
#include "common/fingerprint.h"
#include "common/hash.h"
#include "common/status.h"
#include "proto/grpc_tls.h"

namespace sparsex::cache {

struct CacheClientOptions {
  // Server gRPC address "host:port". Default: "" (required).
  std::string address;
  // Model whose KV this client reads and writes. Default: {} (all zero).
  Hash128 model_fp;
  // KV layout version sent with every request. Default: kKvLayoutVersion.
  uint32_t layout_version = kKvLayoutVersion;
  // Data plane: "ucx" (RMA) or "grpc" (bytes inline in Commit/Read). Default: "ucx".
  std::string transport = "ucx";
  // Use "grpc" when the server offers no UCX data plane. Default: true.
  bool fallback_to_grpc = true;
  // UCX transports (as UCX_TLS); empty: environment / UCX default. Default: "".
  std::string ucx_tls;
  // Deadline of each control RPC. Default: 10000 ms.
  uint32_t rpc_timeout_ms = 10000;
  // Deadline of one data-plane transfer batch. Default: 60000 ms.
  uint32_t transfer_timeout_ms = 60000;
  // Lease time-to-live requested by FetchInto; 0: server default. Default: 0.
  uint32_t lease_ttl_ms = 0;
  // Verify the checksum of every fetched block. Default: true.
  bool verify = true;
  // Verify on helper threads (half the hardware threads, 1 to 8), overlapped with the
  // transfer of the next blocks (on_block then runs on those threads, still one block at a
  // time and in key order). Default: true.
  bool verify_in_background = true;
  // UCX with a same-host server: copy through the mapped arena on several threads
  // (TransportOptions::mapped_copies). Default: true.
  bool mapped_copies = true;
  // Mutual TLS to the server (proto/grpc_tls.h): this member's certificate and the cluster CA.
  // Empty: plaintext (the server must allow it). Default: plaintext.
  TlsFiles tls;
};

struct LookupInfo {
  bool present = false;
  Tier tier = Tier::kNone;
  uint64_t size = 0;
  uint32_t layout_version = 0;
  absl::StatusCode code = absl::StatusCode::kNotFound;
};

class CacheClient {
 public:
  // Connects (GetEndpoint) and sets up the data plane. UNAVAILABLE when unreachable.
  static absl::StatusOr<std::unique_ptr<CacheClient>> Connect(const CacheClientOptions& options);
  ~CacheClient();
  CacheClient(const CacheClient&) = delete;
  CacheClient& operator=(const CacheClient&) = delete;

  absl::StatusOr<std::vector<LookupInfo>> Lookup(std::span<const BlockKey> keys);

  // Two-phase put of one encoded KV block. ALREADY_EXISTS when the block is committed or
  // being put by another client.
  absl::Status Put(const BlockKey& key, std::span<const uint8_t> block, double cost = 0);

  // The same in steps (Put is Reserve + Write + Commit).
  absl::StatusOr<Reservation> Reserve(const BlockKey& key, uint64_t size, double cost = 0);
  // Data-plane write of bytes [at, at + bytes.size()) of the reserved block.
  absl::Status Write(const Reservation& r, std::span<const uint8_t> bytes, uint64_t at = 0);
  // `inline_block`: the whole block through gRPC instead of Write.
  absl::Status Commit(const Reservation& r, uint64_t checksum,
                      std::span<const uint8_t> inline_block = {});
  absl::Status Abort(const Reservation& r);

  // Where block i (of `size` bytes) lands; must stay valid until FetchInto returns.
  using Allocator = std::function<uint8_t*(size_t index, uint64_t size)>;
  // Called in key order as each block is ready (OK) or known missing (NOT_FOUND), never
  // concurrently; possibly from a helper thread (CacheClientOptions::verify_in_background).
  using OnBlock =
      std::function<void(size_t index, const absl::Status& status, std::span<const uint8_t>)>;

  // Leases `keys` (layer order), fetches the present ones in one batch of RMA gets, verifies
  // them, releases the lease. Per-key status: OK or NOT_FOUND (absent, other model, corrupt:
  // FailedVerification tells a block whose bytes arrived and failed the checksum);
  // UNAVAILABLE "transfer_unverified" for a block that did not verify after the lease was lost
  // (not reported as corrupt). The call fails as a whole only on RPC/transport errors.
  absl::StatusOr<std::vector<absl::Status>> FetchInto(std::span<const BlockKey> keys,
                                                      const Allocator& alloc,
                                                      const OnBlock& on_block = {});
  // Convenience: blocks as strings.
  absl::StatusOr<std::vector<absl::StatusOr<std::string>>> Fetch(std::span<const BlockKey> keys);

  absl::StatusOr<uint32_t> Evict(std::span<const BlockKey> keys, bool all = false);
  absl::StatusOr<CacheStats> Stats();
  // OK while the server is serving (UNAVAILABLE otherwise).
  absl::Status Health();
  // The whole Health reply: incarnation, disk tier state.
  absl::StatusOr<ServerHealth> GetHealth();

  // Registers local memory used as a fetch destination / put source (zero-copy with RDMA).
  absl::Status RegisterMemory(void* p, size_t n);
  void UnregisterMemory(void* p);
  // Memory allocated and registered by the data plane (fastest destination: on one host UCX
  // places it in shared memory). Falls back to plain anonymous memory. Free with FreeBuffer.
  uint8_t* AllocateBuffer(size_t n);
  void FreeBuffer(uint8_t* p, size_t n);

  const std::string& server_id() const;
  // Incarnation of the server the data-plane endpoint was obtained from (0: not reported).
  uint64_t instance_id() const;
  // Times the data-plane endpoint was exchanged again (server restart, failed transfer).
  uint64_t reconnects() const;
  const std::string& address() const;
  // "ucx" or "grpc".
  const std::string& data_plane() const;
  // Whether transfers copy through a local mapping of the server's arena (UCX, same host).
  bool mapped_copies() const;

  struct Impl;

 private:
  explicit CacheClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True for FetchInto's per-key NOT_FOUND of a block whose bytes arrived and failed their
// checksum (the block was reported to the server as corrupt). Still NOT_FOUND, so that callers
// keep treating it as a miss (ClusterClient asks the next owner); this only tells why, e.g.
// for the worker's fetch failure metric (reason "corrupt", not "incomplete").
bool FailedVerification(const absl::Status& s);

}  // namespace sparsex::cache
