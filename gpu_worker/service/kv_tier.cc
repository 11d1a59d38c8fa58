#include "gpu_worker/service/kv_tier.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>

#include "cache_client/cluster_client.h"
#include "common/bf16.h"
#include "common/huge_pages.h"
#include "common/kv_block.h"
#include "common/thread_pool.h"

namespace sparsex::service {

// A fetched bf16 block lands in a streamed segment's layer frame as it is (FetchMissing).
static_assert(StreamedSegment::kLayerPrefixBytes == kKvBlockHeaderBytes);

namespace {

// A kept transfer buffer (re)allocated to `bytes`: advised for huge pages and touched now, not
// in a request's transfer (fresh memory's first touch cost more than the copy into it).
void Reallocate(std::unique_ptr<uint8_t[]>* buf, size_t* cap, size_t bytes) {
  buf->reset(new uint8_t[bytes]);
  AdviseHugePages(buf->get(), bytes);
  std::memset(buf->get(), 0, bytes);
  *cap = bytes;
}

// Copies n elements of dtype `dt` at src into dst as fp32.
void CopyToF32(const uint8_t* src, KvDtype dt, size_t n, float* dst) {
  if (dt == KvDtype::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, src + 2 * i, 2);
    dst[i] = FromBf16(b);
  }
}

// The header of a fetched block checked against the segment layer it must be; with
// verify_payload its payload checksum too (skipped when the cache client already checked the
// whole block's).
absl::StatusOr<KvBlockView> CheckSegmentLayer(std::span<const uint8_t> block,
                                              const Hash128& model_fp, const Hash128& fp,
                                              int layer, const SegmentKv& kv, bool verify_payload) {
  ASSIGN_OR_RETURN(KvBlockView v, verify_payload ? VerifyKvBlock(block) : DecodeKvBlock(block));
  RETURN_IF_ERROR(CheckKvLayout(v.header));
  const KvBlockHeader& h = v.header;
  if (!(h.model_fp == model_fp) || !(h.segment_fp == fp)) {
    return absl::DataLossError("fetched block belongs to another model or segment");
  }
  if (h.layer_begin != static_cast<uint32_t>(layer) ||
      h.layer_end != static_cast<uint32_t>(layer + 1) ||
      (h.dtype != KvDtype::kF32 && h.dtype != KvDtype::kBF16) ||
      h.num_tokens != static_cast<uint32_t>(kv.n_tokens) ||
      h.kv_dim != static_cast<uint32_t>(kv.kv_dim)) {
    return absl::DataLossError(absl::StrCat("fetched block has the wrong shape: layers [",
                                            h.layer_begin, ",", h.layer_end, ") tokens ",
                                            h.num_tokens, " kv_dim ", h.kv_dim, " dtype ",
                                            KvDtypeName(h.dtype)));
  }
  return v;
}

// K (half 0) or V (half 1) of a checked block into layer `layer` of *kv. Fresh memory: the
// resize is its first touch, which dominates a fetch (docs/benchmarks.md), so halves of
// different blocks run on different threads.
void CopyHalf(const KvBlockView& v, int layer, int half, SegmentKv* kv) {
  const size_t n = static_cast<size_t>(kv->n_tokens) * kv->kv_dim;
  std::vector<float>& dst = half == 0 ? kv->k[layer] : kv->v[layer];
  ResizeHuge(dst, n);
  const size_t es = KvDtypeSize(v.header.dtype);
  CopyToF32(v.payload.data() + half * n * es, v.header.dtype, n, dst.data());
}

// The same into a bf16 segment's half (its pinned block, or pageable memory it sizes): bf16
// blocks copied as they are, f32 ones rounded.
void CopyHalfBf16(const KvBlockView& v, int half, std::span<uint16_t> dst) {
  const size_t n = dst.size();
  if (v.header.dtype == KvDtype::kBF16) {
    std::memcpy(dst.data(), v.payload.data() + half * n * 2, n * 2);
    return;
  }
  const uint8_t* src = v.payload.data() + half * n * 4;
  for (size_t i = 0; i < n; ++i) {
    float f;
    std::memcpy(&f, src + 4 * i, 4);
    dst[i] = ToBf16(f);
  }
}

}  // namespace

absl::StatusOr<KvDtype> ParseWireDtype(std::string_view name) {
  if (name == "f32") return KvDtype::kF32;
  if (name == "bf16") return KvDtype::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("cache cluster: wire dtype must be f32 or bf16, not '", std::string(name), "'"));
}

absl::StatusOr<uint64_t> SegmentLayerBytes(const SegmentKv& kv, KvDtype dtype) {
  if (dtype != KvDtype::kF32 && dtype != KvDtype::kBF16) {
    return absl::InvalidArgumentError("segment KV travels as f32 or bf16");
  }
  KvBlockHeader h;
  h.layer_begin = 0;
  h.layer_end = 1;
  h.num_tokens = static_cast<uint32_t>(kv.n_tokens);
  h.kv_dim = static_cast<uint32_t>(kv.kv_dim);
  h.dtype = dtype;
  return KvBlockEncodedBytes(h);
}

absl::Status EncodeSegmentLayerInto(const Hash128& model_fp, const Hash128& fp,
                                    const SegmentKv& kv, int layer, KvDtype dtype,
                                    std::span<uint8_t> out) {
  if (layer < 0 || layer >= kv.n_layers) return absl::InvalidArgumentError("layer out of range");
  if (dtype != KvDtype::kF32 && dtype != KvDtype::kBF16) {
    return absl::InvalidArgumentError("segment KV travels as f32 or bf16");
  }
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
  h.dtype = dtype;
  ASSIGN_OR_RETURN(const uint64_t total, KvBlockEncodedBytes(h));
  if (out.size() != total) return absl::InvalidArgumentError("encode buffer has the wrong size");
  // K and V are written once, straight behind the header (the payload is then encoded in place).
  uint8_t* payload = out.data() + kKvBlockHeaderBytes;
  const size_t es = KvDtypeSize(dtype);
  if (dtype == KvDtype::kF32) {
    std::memcpy(payload, kv.k[layer].data(), n * sizeof(float));
    std::memcpy(payload + n * sizeof(float), kv.v[layer].data(), n * sizeof(float));
  } else {
    for (int half = 0; half < 2; ++half) {
      const float* src = (half == 0 ? kv.k[layer] : kv.v[layer]).data();
      uint8_t* dst = payload + half * n * es;
      for (size_t i = 0; i < n; ++i) {
        const uint16_t b = ToBf16(src[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
    }
  }
  return EncodeKvBlockInto(h, {payload, 2 * n * es}, out);
}

absl::StatusOr<std::string> EncodeSegmentLayer(const Hash128& model_fp, const Hash128& fp,
                                               const SegmentKv& kv, int layer, KvDtype dtype) {
  ASSIGN_OR_RETURN(const uint64_t total, SegmentLayerBytes(kv, dtype));
  std::string out;
  ResizeHuge(out, total);
  RETURN_IF_ERROR(EncodeSegmentLayerInto(
      model_fp, fp, kv, layer, dtype, {reinterpret_cast<uint8_t*>(out.data()), out.size()}));
  return out;
}

absl::Status DecodeSegmentLayer(std::span<const uint8_t> block, const Hash128& model_fp,
                                const Hash128& fp, int layer, SegmentKv* kv) {
  ASSIGN_OR_RETURN(KvBlockView v, CheckSegmentLayer(block, model_fp, fp, layer, *kv, true));
  CopyHalf(v, layer, 0, kv);
  CopyHalf(v, layer, 1, kv);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ClusterKvTier>> ClusterKvTier::Connect(
    const ClusterTierOptions& o, const Hash128& model_fp, int n_layers, int kv_dim) {
  if (o.servers.empty()) return absl::InvalidArgumentError("cluster tier: no cache servers");
  cache::ClusterClientOptions co;
  co.members = o.servers;
  co.replication = o.replication;
  co.client.model_fp = model_fp;
  co.client.tls = o.tls;
  co.client.transport = o.transport;
  co.client.ucx_tls = o.ucx_tls;
  co.client.rpc_timeout_ms = o.rpc_timeout_ms;
  co.client.mapped_copies = o.mapped_copies;
  ASSIGN_OR_RETURN(const KvDtype wire, ParseWireDtype(o.wire_dtype.empty() ? "f32" : o.wire_dtype));
  ASSIGN_OR_RETURN(auto client, cache::ClusterClient::Connect(co));
  std::unique_ptr<ClusterKvTier> t(new ClusterKvTier());
  t->opts_ = o;
  t->wire_ = wire;
  t->payload_verified_ = co.client.verify;
  if (!o.mac_key_file.empty()) {
    ASSIGN_OR_RETURN(t->mac_, BlockMac::FromFile(o.mac_key_file));
  }
  t->model_fp_ = model_fp;
  t->n_layers_ = n_layers;
  t->kv_dim_ = kv_dim;
  t->client_ = std::move(client);
  uint64_t arena = 0;  // the smallest member arena that answered
  for (size_t m = 0; m < t->client_->members().size(); ++m) {
    auto c = t->client_->Member(m);
    if (!c.ok()) continue;
    auto st = (*c)->Stats();
    if (st.ok() && st->memory_capacity_bytes > 0) {
      arena = arena == 0 ? st->memory_capacity_bytes : std::min(arena, st->memory_capacity_bytes);
    }
  }
  t->round_bytes_ = arena > 0 ? std::min(o.fetch_batch_bytes, arena / 4) : o.fetch_batch_bytes;
  // Touched now, not in a request's fetch: the first touch of fresh memory costs more than the
  // transfer into it (on this VM the first 512 MiB-round fetch took 4.7 s, the next 0.3 s).
  for (int b = 0; b < 2; ++b) {
    Reallocate(&t->staging_[b], &t->staging_bytes_[b], t->round_bytes_);
  }
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

FetchOutcome ClusterKvTier::FetchMissing(
    std::span<const SegmentRef> segments, SegmentStore* store, int tp_rank, int tp_size,
    const ToTier& to_tier, const StreamTo* stream) {
  const bool streaming = stream != nullptr;
  const bool bf16 = static_cast<bool>(to_tier) || streaming;
  FetchOutcome out;
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || kv_dim_ % tp_size != 0 ||
      (bf16 && tp_size != 1)) {
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
  std::vector<size_t> present_at;  // index into want
  for (size_t i = 0; i < want.size(); ++i) {
    int have = 0;
    for (int layer = 0; layer < n_layers_; ++layer) have += (*look)[i * n_layers_ + layer].present;
    if (have == n_layers_) {
      present.push_back(want[i]);
      present_at.push_back(i);
    } else if (have == 0) {
      ++out.absent;
    } else {
      ++out.incomplete;
      fail("incomplete");
    }
  }
  if (present.empty()) return out;
  // Every layer of the present segments, in fetch order (segment by segment; layer by layer
  // when streaming), with their sizes and where each goes.
  std::vector<cache::BlockKey> keys;
  std::vector<uint64_t> layer_bytes;
  std::vector<size_t> key_seg;  // index into present
  std::vector<int> key_layer;
  auto add_key = [&](size_t s, int layer) {
    const size_t at = present_at[s] * n_layers_ + layer;
    keys.push_back(probe[at]);
    layer_bytes.push_back((*look)[at].size);
    key_seg.push_back(s);
    key_layer.push_back(layer);
  };
  if (streaming) {
    for (int layer = 0; layer < n_layers_; ++layer) {
      for (size_t s = 0; s < present.size(); ++s) add_key(s, layer);
    }
  } else {
    for (size_t s = 0; s < present.size(); ++s) {
      for (int layer = 0; layer < n_layers_; ++layer) add_key(s, layer);
    }
  }
  t = Clock::now();
  std::lock_guard<std::mutex> l(mu_);
  out.phases.lock_ms = ms_since(t);
  // bf16: each segment decodes into a StreamedSegment (the caller's when streaming, else one of
  // our own, handed to to_tier whole by the decode that completes it; `taken` records the
  // answer, read after the decodes are joined). fp32: into kvs, for the store.
  std::vector<std::shared_ptr<StreamedSegment>> sinks(bf16 ? present.size() : 0);
  for (size_t s = 0; s < sinks.size(); ++s) {
    sinks[s] = streaming ? stream->open(present[s])
                         : std::make_shared<StreamedSegment>(present[s].num_tokens, n_layers_,
                                                             kv_dim);
    // The decode copies blocks of this tier's shape: a sink of another shape (another model's
    // engine) is never written, and fails so that no prefill waits for it.
    if (sinks[s] != nullptr &&
        (sinks[s]->n_tokens() != present[s].num_tokens || sinks[s]->n_layers() != n_layers_ ||
         sinks[s]->kv_dim() != kv_dim)) {
      sinks[s]->Fail();
      sinks[s] = nullptr;
    }
  }
  if (streaming && stream->started) stream->started();
  std::vector<char> taken(present.size(), 0);
  // `reason` marks a segment that cannot be used; kvs also gives CheckSegmentLayer the shape.
  std::vector<SegmentKv> kvs(present.size());
  std::vector<std::string> reason(present.size());
  for (size_t s = 0; s < present.size(); ++s) {
    kvs[s].n_tokens = present[s].num_tokens;
    kvs[s].n_layers = n_layers_;
    kvs[s].kv_dim = kv_dim;
    if (bf16) continue;
    kvs[s].k.resize(n_layers_);
    kvs[s].v.resize(n_layers_);
  }
  std::vector<cache::BlockKey> bad;  // blocks that are not what their key says
  // Per key (segment-major, layer order): why it cannot be used ("" when decoded).
  std::vector<std::string> key_reason(keys.size());
  // Lease and transfer in rounds of at most round_bytes_ (at least one block each). Two
  // staging buffers: round r+1 is transferred into one while round r is decoded out of the
  // other on the thread pool (decoding into fresh host memory costs about as much as the
  // transfer, docs/benchmarks.md), so decode_ms counts only the wait for a decode.
  std::future<void> decoding[2];
  auto wait_decode = [&](int b) {
    if (!decoding[b].valid()) return;
    const Clock::time_point w = Clock::now();
    decoding[b].get();
    out.phases.decode_ms += ms_since(w);
  };
  for (size_t begin = 0, round = 0; begin < keys.size(); ++round) {
    size_t end = begin;
    uint64_t bytes = 0;
    while (end < keys.size() &&
           (end == begin || bytes + layer_bytes[end] <= round_bytes_)) {
      bytes += layer_bytes[end++];
    }
    const int b = static_cast<int>(round & 1);
    wait_decode(b);  // its staging buffer is free again
    // A bf16 block of the segment's shape goes straight into its layer's frame when the sink
    // is a block (StreamedSegment::LayerFrame: the header's room, K, V, as the block is laid
    // out): no staging, no decode copy. The others are staged and decoded.
    // dst: where each key's block goes, its layer frame (in_place) or its place in the staging
    // buffer.
    std::vector<uint8_t*> dst(end - begin, nullptr);
    std::vector<char> in_place(end - begin, 0);
    std::vector<uint64_t> offset(end - begin), size(end - begin, 0);
    uint64_t at = 0;
    for (size_t i = begin; i < end; ++i) {
      StreamedSegment* sink = bf16 ? sinks[key_seg[i]].get() : nullptr;
      if (sink != nullptr && sink->in_block()) {
        std::span<uint8_t> f = sink->LayerFrame(key_layer[i]);
        if (f.size() == layer_bytes[i]) {
          dst[i - begin] = f.data();
          in_place[i - begin] = 1;
          continue;
        }
      }
      offset[i - begin] = at;
      at += layer_bytes[i];
    }
    if (staging_bytes_[b] < at) {  // a block larger than a round
      Reallocate(&staging_[b], &staging_bytes_[b], at);
    }
    for (size_t j = 0; j < dst.size(); ++j) {
      if (!in_place[j]) dst[j] = staging_[b].get() + offset[j];
    }
    t = Clock::now();
    auto st = client_->FetchInto(
        std::span<const cache::BlockKey>(keys.data() + begin, end - begin),
        [&](size_t i, uint64_t n) -> uint8_t* {
          // The lookup's size is what the round reserved; a block that grew since (rewritten)
          // does not fit: no destination, the client reports it as failed.
          if (n > layer_bytes[begin + i]) return nullptr;
          size[i] = n;
          return dst[i];
        },
        {});
    out.phases.transfer_ms += ms_since(t);
    std::vector<size_t> ok_keys;  // keys of this round whose bytes arrived verified
    for (size_t i = begin; i < end; ++i) {
      const absl::Status ks = st.ok() ? (*st)[i - begin] : st.status();
      if (ks.ok()) {
        out.bytes += size[i - begin];
        ok_keys.push_back(i);
        continue;
      }
      // NOT_FOUND after a positive lookup: evicted meanwhile ("incomplete"), or its bytes
      // failed the checksum ("corrupt"; the client already reported it to the server, which
      // verifies before dropping it, so it is not evicted here: marked "corrupt_reported").
      if (cache::FailedVerification(ks)) key_reason[i] = "corrupt_reported";
      else key_reason[i] = ks.code() == absl::StatusCode::kNotFound ? "incomplete" : "transport";
    }
    // With a KV MAC key, every block's MAC first (whole blocks, in parallel on the pool): a
    // block no cluster member sealed, or one changed since, is never used.
    if (mac_ != nullptr && !ok_keys.empty()) {
      std::vector<char> authentic(ok_keys.size(), 0);
      ParallelFor(static_cast<int64_t>(ok_keys.size()), [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          const size_t i = ok_keys[j];
          authentic[j] =
              mac_->Verify(std::span<const uint8_t>(dst[i - begin], size[i - begin])).ok();
        }
      });
      std::vector<size_t> kept;
      for (size_t j = 0; j < ok_keys.size(); ++j) {
        if (authentic[j]) kept.push_back(ok_keys[j]);
        else key_reason[ok_keys[j]] = "unauthenticated";
      }
      ok_keys = std::move(kept);
    }
    // Headers are checked here (cheap); the copies (K and V of each block) run on the pool.
    // Different keys write different layers' vectors, so rounds never share a destination.
    std::vector<std::pair<KvBlockView, size_t>> views;
    for (size_t i : ok_keys) {
      const size_t s = key_seg[i];
      const int layer = key_layer[i];
      auto v = CheckSegmentLayer(std::span<const uint8_t>(dst[i - begin], size[i - begin]),
                                 model_fp_, key(present[s].fp), layer, kvs[s],
                                 !payload_verified_);
      if (!v.ok()) {
        key_reason[i] = "corrupt";
      } else if (in_place[i - begin] && v->header.dtype == KvDtype::kBF16) {
        // In place: K and V are where the segment reads them (a block of another dtype has
        // another size and was staged).
        out.in_place_bytes += size[i - begin];
        sinks[s]->HalfDone(layer);
        if (sinks[s]->HalfDone(layer) && !streaming) {
          taken[s] = to_tier(present[s], sinks[s]->TakeKv()) ? 1 : 0;
        }
      } else {
        views.emplace_back(*v, i);
      }
    }
    decoding[b] = std::async(std::launch::async, [&, to16 = bf16, views = std::move(views)] {
      ParallelFor(static_cast<int64_t>(views.size()) * 2, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          const auto& [v, i] = views[j / 2];
          const size_t s = key_seg[i];
          const int layer = key_layer[i], half = static_cast<int>(j % 2);
          if (!to16) {
            CopyHalf(v, layer, half, &kvs[s]);
            continue;
          }
          if (sinks[s] == nullptr) continue;  // streamed, not taken: checked, not copied
          CopyHalfBf16(v, half, sinks[s]->Half(layer, half));
          // Only decoded halves count, and a key that failed is never decoded: a segment
          // completes only when every layer arrived intact.
          if (sinks[s]->HalfDone(layer) && !streaming) {
            taken[s] = to_tier(present[s], sinks[s]->TakeKv()) ? 1 : 0;
          }
        }
      });
    });
    begin = end;
  }
  wait_decode(0);
  wait_decode(1);
  for (size_t i = 0; i < keys.size(); ++i) {
    std::string& r = reason[key_seg[i]];
    // "corrupt" (evict every layer) outranks the others; otherwise the first reason stands.
    if (!key_reason[i].empty() && (r.empty() || key_reason[i] == "corrupt")) r = key_reason[i];
  }
  t = Clock::now();
  for (size_t s = 0; s < present.size(); ++s) {
    if (streaming && sinks[s] != nullptr && !sinks[s]->Complete()) sinks[s]->Fail();
    if (reason[s] == "corrupt_reported") {
      fail("corrupt");
      continue;
    }
    if (!reason[s].empty()) {
      fail(reason[s]);
      if (reason[s] == "corrupt") {
        for (size_t i = 0; i < keys.size(); ++i) {
          if (key_seg[i] == s) bad.push_back(keys[i]);
        }
      }
      continue;
    }
    const bool kept = !bf16      ? store->Put(present[s].fp, std::move(kvs[s])).ok()
                      : streaming ? sinks[s] != nullptr && sinks[s]->Complete()
                                  : taken[s] != 0;
    if (kept) {
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
  ASSIGN_OR_RETURN(const uint64_t bytes, SegmentLayerBytes(kv, wire_));
  // Each layer is encoded into one of two buffers kept across write-backs, the next layer while
  // the current one transfers: a fresh block per layer cost its page faults and, over UCX, a
  // memory registration of its new address on every put (16 MiB layers moved ~0.15 GB/s that
  // way on this VM, docs/benchmarks.md), where the reused buffers hit UCX's registration cache.
  std::lock_guard<std::mutex> put_lock(put_mu_);
  for (int b = 0; b < 2; ++b) {
    if (put_staging_bytes_[b] < bytes) {
      Reallocate(&put_staging_[b], &put_staging_bytes_[b], bytes);
    }
  }
  auto buf = [&](int l) { return std::span<uint8_t>(put_staging_[l & 1].get(), bytes); };
  // Layer 0 last: a reader that finds layer 0 (the presence probe) finds every layer. The
  // client is taken per layer, not for the whole segment: a fetch (which a request waits for)
  // then waits for one layer's transfer instead of a whole write-back (on the H200 with an 8B
  // model a 1500-token segment is 32 x 12 MiB; holding it throughout made chat TTFT p50 0.6-1 s).
  auto encode = [&](int l) -> absl::Status {
    RETURN_IF_ERROR(EncodeSegmentLayerInto(model_fp_, fp, kv, l, wire_, buf(l)));
    return mac_ != nullptr ? mac_->Seal(buf(l)) : absl::OkStatus();
  };
  RETURN_IF_ERROR(encode(kv.n_layers - 1));
  for (int l = kv.n_layers - 1; l >= 0; --l) {
    std::future<absl::Status> next;
    if (l > 0) next = std::async(std::launch::async, [&, l] { return encode(l - 1); });
    absl::Status s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s = client_->Put({fp, static_cast<uint32_t>(l), static_cast<uint32_t>(l + 1)}, buf(l));
    }
    const absl::Status e = next.valid() ? next.get() : absl::OkStatus();
    if (!s.ok() && s.code() != absl::StatusCode::kAlreadyExists) return s;
    RETURN_IF_ERROR(e);
  }
  return absl::OkStatus();
}

}  // namespace sparsex::service
