// The cache-cluster tier of a worker: segments missing from the local store are looked up in
// the cache servers (rendezvous-placed), fetched over UCX, verified and put into the local
// store before prefill; segments the worker computes are written back. A failed, partial or
// corrupt fetch is never used: the segment is recomputed and the failure counted. A transfer
// that fails (e.g. the cache server restarted under the worker) is a "transport" failure and
// evicts nothing; the cache client re-exchanges endpoints with a restarted server by itself.
//
// A segment's KV travels as one KV block per layer (common/kv_block.h, K before RoPE then V,
// [n_tokens][kv_dim] each, fp32 or bf16: ClusterTierOptions::wire_dtype), keyed by the segment
// fingerprint and the layer. A fetch decodes either dtype into the fp32 host store. Under tensor
// parallelism each rank moves only its KV heads' share, stored in the cluster under the share's
// own key (ShareKey: the fingerprint mixed with rank and degree); the local store keeps the
// plain fingerprint.
//
//   ASSIGN_OR_RETURN(auto tier, ClusterKvTier::Connect(opts, model_fp, n_layers, kv_dim));
//   FetchOutcome f = tier->FetchMissing(segments, &store);   // before prefill
//   tier->Put(fp, kv);                                       // write-back
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/hash.h"
#include "common/kv_block.h"
#include "common/status.h"
#include "gpu_worker/reuse/segment_store.h"
#include "gpu_worker/reuse/streamed_segment.h"
#include "gpu_worker/service/block_mac.h"
#include "proto/grpc_tls.h"

namespace sparsex::cache {
class ClusterClient;
}

namespace sparsex::service {

struct ClusterTierOptions {
  // Cache server gRPC addresses; empty turns the tier off. Default: none
  std::vector<std::string> servers;
  // Mutual TLS to the cache servers (the worker's own certificate and the cluster CA).
  // Default: none (plaintext; the servers must allow it)
  TlsFiles tls;
  // The cluster's KV MAC key (64 hex digits; block_mac.h): every block written is sealed with
  // it and a fetched block is used only when its MAC verifies. "": no MACs. Default: ""
  std::string mac_key_file;
  uint32_t replication = 1;     // copies of each segment. Default: 1
  std::string transport = "ucx";  // data plane: ucx | grpc. Default: ucx
  std::string ucx_tls;          // UCX transports (as UCX_TLS); "": UCX's choice. Default: ""
  uint32_t rpc_timeout_ms = 5000;  // per control RPC. Default: 5000
  // Bytes leased and transferred per fetch round, at most; capped at a quarter of the smallest
  // cache server's memory arena (asked at Connect): a server serves a lease from its arena
  // (promoting blocks from disk), so one lease larger than the arena can never be granted
  // whole. Each round costs a fixed ~20-40 ms besides its bytes (two RPCs, the last block's
  // check): 64 MiB rounds moved 1.3 GB/s on the H200, 1.6-1.9 GB/s here where 256 MiB-1 GiB
  // rounds reach 3.7-5.5 (docs/benchmarks.md). Two staging buffers of this size are kept.
  // Default: 512 MiB
  uint64_t fetch_batch_bytes = uint64_t{512} << 20;
  // Element type of K/V written to the cluster: "f32" or "bf16" (half the bytes on the wire
  // and in the cache servers; exact for KV a bf16 backend computed, which is why the worker
  // picks it for --device cuda). Fetches decode both. "" = f32. Default: ""
  std::string wire_dtype;
  // Same-host cache server: copy through the mapped arena on several threads instead of UCX's
  // gets and puts (cache::TransportOptions::mapped_copies). Default: true
  bool mapped_copies = true;
  // Fetched segments go to the engine's device (or pinned host) tier in bf16 instead of the
  // fp32 host store (ReuseEngine::OfferFetched; not under tensor parallelism, and only with a
  // bf16 wire_dtype, i.e. a bf16 backend that loses nothing by it): the first prefill
  // then skips the store's checksums, conversion and upload (on the H200, same call: B's 32K
  // fetch-and-prefill 3.5x its GPU-tier prefill this way, 5.2x through the store;
  // docs/benchmarks.md). --cache_fetch_to_tier. Default: true
  bool fetch_to_tier = true;
  // With fetch_to_tier: blocks move in layer order into segments a reuse prefill reads as
  // they arrive (ClusterKvTier::StreamTo, ReuseEngine::OfferStreamed), and the request is
  // admitted once its fetch has started, so its prefill runs beside the transfer. On the
  // H200 B's 32K fetch-and-prefill took 2.20x its GPU-tier prefill this way,
  // against 3.09x with whole segments (docs/benchmarks.md). --cache_fetch_stream. Default: true
  bool stream_fetch = true;
};

struct SegmentRef {
  Hash128 fp;
  int num_tokens = 0;
};

// Where a fetch's time went, by FetchMissing's own clock (milliseconds; summed over rounds).
struct FetchPhases {
  double lookup_ms = 0;    // which layers the cluster holds (metadata RPCs)
  double lock_ms = 0;      // waiting for the data plane (another fetch or a write-back layer)
  double transfer_ms = 0;  // leases, data-plane copies and the cache client's checksum checks
  double decode_ms = 0;    // block headers checked, K/V copied into the segments' layers
  double put_ms = 0;       // the fetched segments put into the local store
  FetchPhases& operator+=(const FetchPhases& o) {
    lookup_ms += o.lookup_ms;
    lock_ms += o.lock_ms;
    transfer_ms += o.transfer_ms;
    decode_ms += o.decode_ms;
    put_ms += o.put_ms;
    return *this;
  }
};

struct FetchOutcome {
  int fetched = 0;   // segments fetched and stored locally
  int failures = 0;  // present in the cluster but not usable (transport error, corrupt, partial)
  int incomplete = 0;  // of the failures: some layers missing at lookup (nothing transferred)
  uint64_t bytes = 0;  // bytes transferred
  // Of bytes: blocks that landed straight in their streamed segment's pinned layer frames
  // (StreamedSegment::LayerFrame), with no decode copy after the transfer.
  uint64_t in_place_bytes = 0;
  int absent = 0;    // not in the cluster
  std::vector<std::string> failure_reasons;  // one per failure: transport | corrupt | incomplete
  std::vector<SegmentRef> stored;
  FetchPhases phases;
};

// The cluster key of rank `rank`'s share of segment fp under `size`-way tensor parallelism;
// size 1: fp itself.
Hash128 ShareKey(const Hash128& fp, int rank, int size);

// "f32" or "bf16"; INVALID_ARGUMENT otherwise.
absl::StatusOr<KvDtype> ParseWireDtype(std::string_view name);

// Bytes of one layer of kv encoded as a KV block of `dtype`.
absl::StatusOr<uint64_t> SegmentLayerBytes(const SegmentKv& kv, KvDtype dtype);
// Encodes layer `layer` of a segment as one KV block of `dtype` (f32, or bf16 rounded to
// nearest even) into `out` of exactly SegmentLayerBytes bytes.
absl::Status EncodeSegmentLayerInto(const Hash128& model_fp, const Hash128& fp,
                                    const SegmentKv& kv, int layer, KvDtype dtype,
                                    std::span<uint8_t> out);
// The same into a new string.
absl::StatusOr<std::string> EncodeSegmentLayer(const Hash128& model_fp, const Hash128& fp,
                                               const SegmentKv& kv, int layer,
                                               KvDtype dtype = KvDtype::kF32);
// Checks a fetched block (header, checksum, model, segment, layer, shape) and copies its K/V
// (f32 or bf16) into layer `layer` of *kv as fp32 (already shaped: n_tokens, n_layers, kv_dim). DATA_LOSS or
// FAILED_PRECONDITION when it does not match.
absl::Status DecodeSegmentLayer(std::span<const uint8_t> block, const Hash128& model_fp,
                                const Hash128& fp, int layer, SegmentKv* kv);

class ClusterKvTier {
 public:
  static absl::StatusOr<std::unique_ptr<ClusterKvTier>> Connect(const ClusterTierOptions& o,
                                                                const Hash128& model_fp,
                                                                int n_layers, int kv_dim);
  ~ClusterKvTier();

  // Fetches the segments the local store lacks and puts them there. A block whose bytes
  // arrive intact (the cache client verified their checksum) but that is not the segment's
  // layer (model, segment, layer, shape) is not used and is evicted from the cache servers, so
  // a later write-back replaces it; a block that fails its checksum is a miss the cache client
  // reports (the server re-verifies before dropping anything). With tp_size > 1, fetches rank
  // tp_rank's share (kv_dim / tp_size columns) into that rank's store. Thread-safe.
  //
  // With `to_tier` (no tensor parallelism) the fetched segments are not put into the store but
  // handed to it in bf16 (blocks in bf16 copied as they are, f32 ones rounded), for the
  // engine's tiers (ReuseEngine::OfferFetched), each as soon as its last layer is decoded, on
  // whichever thread decoded it, while later segments still transfer (so the engine uploads
  // one while the next arrives); to_tier's false (not taken) leaves it out of `fetched` and
  // `stored`.
  using ToTier = std::function<bool(const SegmentRef&, SegmentKvBf16&&)>;
  //
  // With `stream` instead (no tensor parallelism) the blocks move in layer order (every
  // segment's layer l before any segment's layer l + 1) and land in StreamedSegments that
  // stream->open made for each segment before any byte moved; stream->started runs once they
  // are all open, with the transfer lock held, so the caller's prefill can run beside the
  // transfer, each layer as it arrives. A segment that cannot complete is Fail()ed; only
  // complete ones count as fetched.
  struct StreamTo {
    std::function<std::shared_ptr<StreamedSegment>(const SegmentRef&)> open;
    std::function<void()> started;
  };
  FetchOutcome FetchMissing(std::span<const SegmentRef> segments, SegmentStore* store,
                            int tp_rank = 0, int tp_size = 1, const ToTier& to_tier = nullptr,
                            const StreamTo* stream = nullptr);
  // Writes a segment's KV (or a rank's share of it) to its owners (ALREADY_EXISTS counts as
  // success). Thread-safe.
  absl::Status Put(const Hash128& fp, const SegmentKv& kv, int tp_rank = 0, int tp_size = 1);
  const std::vector<std::string>& servers() const { return opts_.servers; }
  KvDtype wire_dtype() const { return wire_; }
  int n_layers() const { return n_layers_; }
  int kv_dim() const { return kv_dim_; }  // of the whole model (every rank's share)

 private:
  ClusterKvTier() = default;
  ClusterTierOptions opts_;
  Hash128 model_fp_;
  int n_layers_ = 0, kv_dim_ = 0;
  std::mutex mu_;  // one transfer at a time (fetch rounds, write-back layers); lookups run without it
  KvDtype wire_ = KvDtype::kF32;
  uint64_t round_bytes_ = 0;  // fetch_batch_bytes capped by the members' arenas
  bool payload_verified_ = true;  // the cache client checks each whole block's checksum
  std::unique_ptr<BlockMac> mac_;  // ClusterTierOptions::mac_key_file; null: no MACs
  // Where fetch rounds' blocks land (under mu_), two so that one round decodes while the next
  // transfers; allocated at Connect and kept: fresh memory per round cost page faults on every
  // round (docs/benchmarks.md).
  std::unique_ptr<uint8_t[]> staging_[2];
  size_t staging_bytes_[2] = {0, 0};
  // Write-back: one Put at a time encodes its layers into these two buffers (under put_mu_),
  // the next layer while the current one transfers; grown to the largest layer, then kept.
  std::mutex put_mu_;
  std::unique_ptr<uint8_t[]> put_staging_[2];
  size_t put_staging_bytes_[2] = {0, 0};
  std::unique_ptr<cache::ClusterClient> client_;
};

}  // namespace sparsex::service
