#include "gpu_worker/service/kv_tier.h"

#include <chrono>
#include <cstring>

#include "cache_client/cluster_client.h"
#include "common/huge_pages.h"
#include "common/kv_block.h"

namespace sparsex::service {

absl::StatusOr<std::string> EncodeSegmentLayer(const Hash128& model_fp, const Hash128& fp,
                                               const SegmentKv& kv, int layer) {
  if (layer < 0 || layer >= kv.n_layers) return absl::InvalidArgumentError("layer out of range");
  const size_t n = static_cast<size_t>(kv.n_tokens) * kv.kv_dim;
  if (kv.k[layer].size() != n || kv.v[layer].size() != n) {
    return absl::InvalidArgumentError("segment KV has the wrong shape");
  }
  KvBlockHeader h;
  h.model_fp = model_fp;
  h.segment_fp = fp;
  h.layer_begin = static_cast<uint32_t>(layer);
  h.layer_end = static_cast<uint32_t>(layer + 1);
  h.num_tokens = static_cast<uint32_t>(kv.n_tokens);
  h.kv_dim = static_cast<uint32_t>(kv.kv_dim);
  h.dtype = KvDtype::kF32;
  // K and V are copied once, straight behind the header (the payload is then encoded in place).
  ASSIGN_OR_RETURN(const uint64_t total, KvBlockEncodedBytes(h));
  std::string out;
  ResizeHuge(out, total);
  uint8_t* payload = reinterpret_cast<uint8_t*>(out.data()) + kKvBlockHeaderBytes;
  std::memcpy(payload, kv.k[layer].data(), n * sizeof(float));
  std::memcpy(payload + n * sizeof(float), kv.v[layer].data(), n * sizeof(float));
  RETURN_IF_ERROR(EncodeKvBlockInto(h, {payload, 2 * n * sizeof(float)},
                                    {reinterpret_cast<uint8_t*>(out.data()), out.size()}));
  return out;
}

absl::Status DecodeSegmentLayer(std::span<const uint8_t> block, const Hash128& model_fp,
                                const Hash128& fp, int layer, SegmentKv* kv) {
  ASSIGN_OR_RETURN(KvBlockView v, VerifyKvBlock(block));
  RETURN_IF_ERROR(CheckKvLayout(v.header));
  const KvBlockHeader& h = v.header;
  if (!(h.model_fp == model_fp) || !(h.segment_fp == fp)) {
    return absl::DataLossError("fetched block belongs to another model or segment");
  }
  if (h.layer_begin != static_cast<uint32_t>(layer) ||
      h.layer_end != static_cast<uint32_t>(layer + 1) || h.dtype != KvDtype::kF32 ||
      h.num_tokens != static_cast<uint32_t>(kv->n_tokens) ||
      h.kv_dim != static_cast<uint32_t>(kv->kv_dim)) {
    return absl::DataLossError(absl::StrCat("fetched block has the wrong shape: layers [",
                                            h.layer_begin, ",", h.layer_end, ") tokens ",
                                            h.num_tokens, " kv_dim ", h.kv_dim, " dtype ",
                                            KvDtypeName(h.dtype)));
  }
  const size_t n = static_cast<size_t>(kv->n_tokens) * kv->kv_dim;
  ResizeHuge(kv->k[layer], n);
  ResizeHuge(kv->v[layer], n);
  std::memcpy(kv->k[layer].data(), v.payload.data(), n * sizeof(float));
  std::memcpy(kv->v[layer].data(), v.payload.data() + n * sizeof(float), n * sizeof(float));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ClusterKvTier>> ClusterKvTier::Connect(
    const ClusterTierOptions& o, const Hash128& model_fp, int n_layers, int kv_dim) {
  if (o.servers.empty()) return absl::InvalidArgumentError("cluster tier: no cache servers");
  cache::ClusterClientOptions co;
  co.members = o.servers;
  co.replication = o.replication;
  co.client.model_fp = model_fp;
  co.client.transport = o.transport;
  co.client.ucx_tls = o.ucx_tls;
  co.client.rpc_timeout_ms = o.rpc_timeout_ms;
  ASSIGN_OR_RETURN(auto client, cache::ClusterClient::Connect(co));
  std::unique_ptr<ClusterKvTier> t(new ClusterKvTier());
  t->opts_ = o;
  t->model_fp_ = model_fp;
  t->n_layers_ = n_layers;
  t->kv_dim_ = kv_dim;
  t->client_ = std::move(client);
  return t;
}

ClusterKvTier::~ClusterKvTier() = default;

Hash128 ShareKey(const Hash128& fp, int rank, int size) {
  if (size <= 1) return fp;
  Hasher h;
  h.Str("sparsex.tp-share").Bytes(&fp, sizeof fp).U64(static_cast<uint64_t>(rank)).U64(
      static_cast<uint64_t>(size));
  return h.Finish();
}

FetchOutcome ClusterKvTier::FetchMissing(std::span<const SegmentRef> segments,
                                         SegmentStore* store, int tp_rank, int tp_size) {
  FetchOutcome out;
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || kv_dim_ % tp_size != 0) {
    out.failures = static_cast<int>(segments.size());
    out.failure_reasons.assign(segments.size(), "incomplete");
    return out;
  }
  const int kv_dim = kv_dim_ / tp_size;
  auto key = [&](const Hash128& fp) { return ShareKey(fp, tp_rank, tp_size); };
  std::vector<SegmentRef> want;
  for (const SegmentRef& s : segments) {
    if (s.num_tokens <= 0 || store->Contains(s.fp)) continue;
    bool dup = false;
    for (const SegmentRef& w : want) dup = dup || w.fp == s.fp;
    if (!dup) want.push_back(s);
  }
  if (want.empty()) return out;
  auto fail = [&out](const std::string& reason) {
    ++out.failures;
    out.failure_reasons.push_back(reason);
  };
  // Which segments the cluster has whole: every layer is looked up (metadata only), because a
  // server evicts layers one by one; a segment with a missing layer is skipped before any byte
  // moves instead of failing after its other layers were transferred. The lookup runs outside
  // mu_ (the cluster client is thread-safe): a request never waits for a write-back's transfer
  // just to learn that the cluster lacks its segments (on the H200 those lookups averaged
  // 0.26-0.44 s under write-back load while they queued behind it).
  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  Clock::time_point t = Clock::now();
  std::vector<cache::BlockKey> probe;
  for (const SegmentRef& s : want) {
    for (int layer = 0; layer < n_layers_; ++layer) {
      probe.push_back({key(s.fp), static_cast<uint32_t>(layer), static_cast<uint32_t>(layer + 1)});
    }
  }
  auto look = client_->Lookup(probe);
  out.phases.lookup_ms = ms_since(t);
  if (!look.ok()) {
    // The cluster cannot tell: nothing is known to be there; count one transport failure.
    fail("transport");
    return out;
  }
  std::vector<SegmentRef> present;
  std::vector<cache::BlockKey> keys;  // every layer of the present segments, in fetch order
  std::vector<uint64_t> layer_bytes;  // and their sizes
  for (size_t i = 0; i < want.size(); ++i) {
    int have = 0;
    for (int layer = 0; layer < n_layers_; ++layer) have += (*look)[i * n_layers_ + layer].present;
    if (have == n_layers_) {
      present.push_back(want[i]);
      for (int layer = 0; layer < n_layers_; ++layer) {
        keys.push_back(probe[i * n_layers_ + layer]);
        layer_bytes.push_back((*look)[i * n_layers_ + layer].size);
      }
    } else if (have == 0) {
      ++out.absent;
    } else {
      ++out.incomplete;
      fail("incomplete");
    }
  }
  if (present.empty()) return out;
  t = Clock::now();
  std::lock_guard<std::mutex> l(mu_);
  out.phases.lock_ms = ms_since(t);
  // Each segment's KV is assembled layer by layer as its rounds arrive; `reason` marks one
  // that cannot be used.
  std::vector<SegmentKv> kvs(present.size());
  std::vector<std::string> reason(present.size());
  for (size_t s = 0; s < present.size(); ++s) {
    kvs[s].n_tokens = present[s].num_tokens;
    kvs[s].n_layers = n_layers_;
    kvs[s].kv_dim = kv_dim;
    kvs[s].k.resize(n_layers_);
    kvs[s].v.resize(n_layers_);
  }
  std::vector<cache::BlockKey> bad;  // blocks that are not what their key says
  // Lease and transfer in rounds of at most fetch_batch_bytes (at least one block each), into
  // the staging buffer; each round's blocks are decoded into their segments before the next.
  for (size_t begin = 0; begin < keys.size();) {
    size_t end = begin;
    uint64_t bytes = 0;
    while (end < keys.size() &&
           (end == begin || bytes + layer_bytes[end] <= opts_.fetch_batch_bytes)) {
      bytes += layer_bytes[end++];
    }
    if (staging_bytes_ < bytes) {
      staging_.reset(new uint8_t[bytes]);  // uninitialised: every byte is written by a transfer
      staging_bytes_ = bytes;
    }
    std::vector<uint64_t> offset(end - begin), size(end - begin, 0);
    uint64_t at = 0;
    for (size_t i = begin; i < end; ++i) {
      offset[i - begin] = at;
      at += layer_bytes[i];
    }
    t = Clock::now();
    auto st = client_->FetchInto(
        std::span<const cache::BlockKey>(keys.data() + begin, end - begin),
        [&](size_t i, uint64_t n) -> uint8_t* {
          // The lookup's size is what the round reserved; a block that grew since (rewritten)
          // does not fit: no destination, the client reports it as failed.
          if (n > layer_bytes[begin + i]) return nullptr;
          size[i] = n;
          return staging_.get() + offset[i];
        },
        {});
    out.phases.transfer_ms += ms_since(t);
    t = Clock::now();
    for (size_t i = begin; i < end; ++i) {
      const size_t s = i / n_layers_;
      const int layer = static_cast<int>(i % n_layers_);
      if (!reason[s].empty()) continue;
      const absl::Status ks = st.ok() ? (*st)[i - begin] : st.status();
      if (!ks.ok()) {
        // NOT_FOUND after a positive lookup: evicted meanwhile ("incomplete"), or its bytes
        // failed the checksum ("corrupt"; the client already reported it to the server, which
        // verifies before dropping it, so it is not evicted here: marked "corrupt_reported").
        if (cache::FailedVerification(ks)) reason[s] = "corrupt_reported";
        else reason[s] = ks.code() == absl::StatusCode::kNotFound ? "incomplete" : "transport";
        continue;
      }
      out.bytes += size[i - begin];
      absl::Status ds = DecodeSegmentLayer(
          std::span<const uint8_t>(staging_.get() + offset[i - begin], size[i - begin]),
          model_fp_, key(present[s].fp), layer, &kvs[s]);
      if (!ds.ok()) reason[s] = "corrupt";
    }
    out.phases.decode_ms += ms_since(t);
    begin = end;
  }
  t = Clock::now();
  for (size_t s = 0; s < present.size(); ++s) {
    if (reason[s] == "corrupt_reported") {
      fail("corrupt");
      continue;
    }
    if (!reason[s].empty()) {
      fail(reason[s]);
      if (reason[s] == "corrupt") {
        for (int layer = 0; layer < n_layers_; ++layer) bad.push_back(keys[s * n_layers_ + layer]);
      }
      continue;
    }
    if (store->Put(present[s].fp, std::move(kvs[s])).ok()) {
      ++out.fetched;
      out.stored.push_back(present[s]);
    }
  }
  out.phases.put_ms = ms_since(t);
  // Drop what did not verify, so this worker's write-back (or another's) replaces it.
  if (!bad.empty()) (void)client_->Evict(bad);
  return out;
}

absl::Status ClusterKvTier::Put(const Hash128& base_fp, const SegmentKv& kv, int tp_rank,
                                int tp_size) {
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || kv.kv_dim * tp_size != kv_dim_) {
    return absl::InvalidArgumentError("cache cluster: segment share does not match the model");
  }
  const Hash128 fp = ShareKey(base_fp, tp_rank, tp_size);
  std::vector<std::string> blocks;
  for (int l = 0; l < kv.n_layers; ++l) {
    ASSIGN_OR_RETURN(std::string b, EncodeSegmentLayer(model_fp_, fp, kv, l));
    blocks.push_back(std::move(b));
  }
  // Layer 0 last: a reader that finds layer 0 (the presence probe) finds every layer. The
  // client is taken per layer, not for the whole segment: a fetch (which a request waits for)
  // then waits for one layer's transfer instead of a whole write-back (on the H200 with an 8B
  // model a 1500-token segment is 32 x 12 MiB; holding it throughout made chat TTFT p50 0.6-1 s).
  for (int l = kv.n_layers - 1; l >= 0; --l) {
    std::lock_guard<std::mutex> lock(mu_);
    absl::Status s = client_->Put({fp, static_cast<uint32_t>(l), static_cast<uint32_t>(l + 1)},
                                  KvBlockBytes(blocks[l]));
    if (!s.ok() && s.code() != absl::StatusCode::kAlreadyExists) return s;
  }
  return absl::OkStatus();
}

}  // namespace sparsex::service
