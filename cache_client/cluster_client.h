// Client of a cache cluster: places each segment on `replication` members chosen by
// rendezvous (highest-random-weight) hashing over the member names, so adding or removing a
// member moves only the segments it wins or held. All layers of a segment share placement.
//
//   ClusterClientOptions o;
//   o.members = {"10.0.0.1:50070", "10.0.0.2:50070", "10.0.0.3:50070"};
//   o.replication = 2;
//   o.client.model_fp = model_fp;
//   ASSIGN_OR_RETURN(auto cluster, ClusterClient::Connect(o));
//   RETURN_IF_ERROR(cluster->Put(key, block));         // to both owners
//   ASSIGN_OR_RETURN(auto st, cluster->FetchInto(keys, alloc, on_block));  // owners in order
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cache_client/cache_client.h"

namespace sparsex::cache {

// Members ordered by rendezvous weight for `segment`, best first (indices into `members`).
// Deterministic across processes and machines.
std::vector<size_t> RendezvousOrder(const Hash128& segment, std::span<const std::string> members);
uint64_t RendezvousWeight(const Hash128& segment, std::string_view member);

struct ClusterClientOptions {
  // Member gRPC addresses; the address string is the member's name in the hash. Default: {}.
  std::vector<std::string> members;
  // Copies of each segment (clamped to the member count). Default: 1.
  uint32_t replication = 1;
  // Per-member client options (address is ignored). Default: CacheClientOptions{}.
  CacheClientOptions client;
};

// Thread-safe: members connect lazily under a lock and each CacheClient synchronises its own
// transport, so a Lookup (a control RPC) never waits for another thread's transfer.
class ClusterClient {
 public:
  // Connects to every member; members that do not answer are skipped (and retried on use).
  // UNAVAILABLE only when no member answers.
  static absl::StatusOr<std::unique_ptr<ClusterClient>> Connect(
      const ClusterClientOptions& options);
  ~ClusterClient();

  // The members holding `segment` (replication of them, best first).
  std::vector<size_t> Owners(const Hash128& segment) const;
  const std::vector<std::string>& members() const;

  // Per key: the first owner that has it (present), else absent.
  absl::StatusOr<std::vector<LookupInfo>> Lookup(std::span<const BlockKey> keys);
  // Puts to every owner; OK when at least one owner holds it (ALREADY_EXISTS counts).
  absl::Status Put(const BlockKey& key, std::span<const uint8_t> block, double cost = 0);
  // Fetches from the owners in order, asking the next owner only for blocks still missing.
  // on_block is called once per key, in key order within a segment.
  absl::StatusOr<std::vector<absl::Status>> FetchInto(std::span<const BlockKey> keys,
                                                      const CacheClient::Allocator& alloc,
                                                      const CacheClient::OnBlock& on_block = {});
  // Evicts from every owner; returns the number of copies removed.
  absl::StatusOr<uint32_t> Evict(std::span<const BlockKey> keys);

  // The client of member i (connecting if needed); UNAVAILABLE when it does not answer.
  absl::StatusOr<CacheClient*> Member(size_t i);

 private:
  ClusterClient() = default;
  ClusterClientOptions opt_;
  std::vector<std::unique_ptr<CacheClient>> clients_;  // created once, never replaced
  std::mutex members_mu_;  // guards the lazy creation of clients_ entries
};

}  // namespace sparsex::cache
