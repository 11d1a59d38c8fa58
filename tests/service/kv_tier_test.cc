// The worker's cache-cluster tier against a real in-process cache server (UCX data plane):
// write-back then fetch into a fresh store gives back the same KV; a block that is not the
// segment's (wrong shape) or is corrupt is never used, and the failure is reported.
#include "gpu_worker/service/kv_tier.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <tuple>

#include "cache_client/cache_client.h"
#include "cache_server/server.h"
#include "common/bf16.h"
#include "common/kv_block.h"
#include "gtest/gtest.h"
#include "testing/server_process.h"
#include "tests/service/test_util.h"

namespace sparsex::service {
namespace {

constexpr int kLayers = 3, kDim = 8;

SegmentKv MakeKv(int n, float base) {
  SegmentKv kv;
  kv.n_tokens = n;
  kv.n_layers = kLayers;
  kv.kv_dim = kDim;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> k(n * kDim), v(n * kDim);
    for (int i = 0; i < n * kDim; ++i) {
      k[i] = base + l + 0.001f * i;
      v[i] = -base - l - 0.002f * i;
    }
    kv.k.push_back(k);
    kv.v.push_back(v);
  }
  return kv;
}

TEST(KvTierCodecTest, RoundTripAndRejects) {
  const Hash128 model{1, 2}, seg{3, 4};
  SegmentKv kv = MakeKv(5, 1.0f);
  auto b = EncodeSegmentLayer(model, seg, kv, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  SegmentKv out;
  out.n_tokens = 5;
  out.n_layers = kLayers;
  out.kv_dim = kDim;
  out.k.resize(kLayers);
  out.v.resize(kLayers);
  ASSERT_TRUE(DecodeSegmentLayer(KvBlockBytes(*b), model, seg, 1, &out).ok());
  EXPECT_EQ(out.k[1], kv.k[1]);
  EXPECT_EQ(out.v[1], kv.v[1]);
  EXPECT_FALSE(DecodeSegmentLayer(KvBlockBytes(*b), model, seg, 2, &out).ok());       // layer
  EXPECT_FALSE(DecodeSegmentLayer(KvBlockBytes(*b), Hash128{9, 9}, seg, 1, &out).ok());  // model
  std::string bad = *b;
  bad[bad.size() - 3] ^= 0x40;  // payload bit flip
  EXPECT_EQ(DecodeSegmentLayer(KvBlockBytes(bad), model, seg, 1, &out).code(),
            absl::StatusCode::kDataLoss);
  out.n_tokens = 6;  // shape mismatch
  EXPECT_FALSE(DecodeSegmentLayer(KvBlockBytes(*b), model, seg, 1, &out).ok());
}

// bf16 on the wire (what a CUDA worker writes): half the payload, rounded to nearest even,
// exact for values that are bf16 already (a bf16 backend's KV).
TEST(KvTierCodecTest, Bf16OnTheWireHalvesThePayloadAndRoundsToNearestEven) {
  const Hash128 model{1, 2}, seg{3, 4};
  SegmentKv kv = MakeKv(5, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < kv.k[l].size(); ++i) {
      kv.k[l][i] = 1.0f + l + static_cast<float>(i) / 64;  // bf16-exact
      kv.v[l][i] = -0.5f - static_cast<float>(i) / 128;
    }
  }
  auto f32 = EncodeSegmentLayer(model, seg, kv, 1, KvDtype::kF32);
  auto bf16 = EncodeSegmentLayer(model, seg, kv, 1, KvDtype::kBF16);
  ASSERT_TRUE(f32.ok() && bf16.ok());
  EXPECT_EQ(bf16->size() - kKvBlockHeaderBytes, (f32->size() - kKvBlockHeaderBytes) / 2);
  SegmentKv out;
  out.n_tokens = 5;
  out.n_layers = kLayers;
  out.kv_dim = kDim;
  out.k.resize(kLayers);
  out.v.resize(kLayers);
  ASSERT_TRUE(DecodeSegmentLayer(KvBlockBytes(*bf16), model, seg, 1, &out).ok());
  EXPECT_EQ(out.k[1], kv.k[1]);
  EXPECT_EQ(out.v[1], kv.v[1]);
  // Ties go to the even mantissa; other values to the nearest bf16.
  kv.k[1][0] = 1.0f + 1.0f / 256;      // tie between 1 and 1 + 2^-7: 1
  kv.k[1][1] = 1.0f + 3.0f / 256;      // tie between 1 + 2^-7 and 1 + 2^-6: 1 + 2^-6
  kv.k[1][2] = 1.0f + 1.0f / 256 + 1e-6f;  // above the tie: 1 + 2^-7
  auto r = EncodeSegmentLayer(model, seg, kv, 1, KvDtype::kBF16);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(DecodeSegmentLayer(KvBlockBytes(*r), model, seg, 1, &out).ok());
  EXPECT_EQ(out.k[1][0], 1.0f);
  EXPECT_EQ(out.k[1][1], 1.0f + 1.0f / 64);
  EXPECT_EQ(out.k[1][2], 1.0f + 1.0f / 128);
  EXPECT_FALSE(EncodeSegmentLayer(model, seg, kv, 1, KvDtype::kF16).ok());
  EXPECT_EQ(ParseWireDtype("fp8").status().code(), absl::StatusCode::kInvalidArgument);
}

// Into caller memory (the write-back's kept buffers): the same bytes as the string form, and a
// buffer of any other size is refused before anything is written.
TEST(KvTierCodecTest, EncodeIntoCallerMemory) {
  const Hash128 model{1, 2}, seg{3, 4};
  SegmentKv kv = MakeKv(7, 2.0f);
  for (KvDtype d : {KvDtype::kF32, KvDtype::kBF16}) {
    auto want = EncodeSegmentLayer(model, seg, kv, 2, d);
    auto bytes = SegmentLayerBytes(kv, d);
    ASSERT_TRUE(want.ok() && bytes.ok());
    ASSERT_EQ(*bytes, want->size());
    std::vector<uint8_t> buf(*bytes + 1, 0xab);
    EXPECT_EQ(EncodeSegmentLayerInto(model, seg, kv, 2, d, {buf.data(), buf.size()}).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(buf[0], 0xab);
    ASSERT_TRUE(EncodeSegmentLayerInto(model, seg, kv, 2, d, {buf.data(), *bytes}).ok());
    EXPECT_EQ(std::string(buf.begin(), buf.begin() + *bytes), *want);
  }
  std::vector<uint8_t> buf(64);
  EXPECT_FALSE(
      EncodeSegmentLayerInto(model, seg, kv, kLayers, KvDtype::kF32, {buf.data(), 64}).ok());
}

class KvTierServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = testutil::StartMemoryCacheServer();
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    ClusterTierOptions t;
    t.servers = {server_->grpc_address()};
    auto tier = ClusterKvTier::Connect(t, model_, kLayers, kDim);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(*tier);
  }
  void TearDown() override {
    tier_.reset();
    server_.reset();
  }
  // A plain cache client of the server (writes that bypass the tier).
  absl::StatusOr<std::unique_ptr<cache::CacheClient>> Client() {
    cache::CacheClientOptions co;
    co.address = server_->grpc_address();
    co.model_fp = model_;
    return cache::CacheClient::Connect(co);
  }
  // A to_tier that keeps what it is handed (called on the fetch's decode threads).
  static ClusterKvTier::ToTier Collect(std::vector<std::pair<SegmentRef, SegmentKvBf16>>& out) {
    auto mu = std::make_shared<std::mutex>();
    return [&out, mu](const SegmentRef& r, SegmentKvBf16&& kv) {
      std::lock_guard<std::mutex> l(*mu);
      out.emplace_back(r, std::move(kv));
      return true;
    };
  }
  // The segment's fetch fails as "corrupt" and stores nothing.
  void ExpectCorruptFetch(const std::vector<SegmentRef>& refs, SegmentStore& store) {
    FetchOutcome f = tier_->FetchMissing(refs, &store);
    EXPECT_EQ(f.fetched, 0);
    EXPECT_EQ(f.failures, 1);
    ASSERT_EQ(f.failure_reasons.size(), 1u);
    EXPECT_EQ(f.failure_reasons[0], "corrupt");
    EXPECT_FALSE(store.Contains(refs[0].fp));
  }
  const Hash128 model_{11, 22};
  std::unique_ptr<cache::CacheServer> server_;
  std::unique_ptr<ClusterKvTier> tier_;
};

TEST_F(KvTierServerTest, WriteBackThenFetchIntoAnotherWorkersStore) {
  const Hash128 a{100, 1}, b{100, 2}, absent{100, 3};
  ASSERT_TRUE(tier_->Put(a, MakeKv(20, 1.0f)).ok());
  ASSERT_TRUE(tier_->Put(b, MakeKv(7, 2.0f)).ok());
  ASSERT_TRUE(tier_->Put(a, MakeKv(20, 1.0f)).ok());  // again: ALREADY_EXISTS is fine

  SegmentStore store(SegmentStoreOptions{});
  std::vector<SegmentRef> refs = {{a, 20}, {b, 7}, {absent, 4}};
  FetchOutcome f = tier_->FetchMissing(refs, &store);
  EXPECT_EQ(f.fetched, 2);
  EXPECT_EQ(f.absent, 1);
  EXPECT_EQ(f.failures, 0);
  // Every phase ran and was timed (the worker exports them per phase).
  EXPECT_GT(f.phases.lookup_ms, 0);
  EXPECT_GE(f.phases.lock_ms, 0);
  EXPECT_GT(f.phases.transfer_ms, 0);
  EXPECT_GT(f.phases.decode_ms, 0);
  EXPECT_GT(f.phases.put_ms, 0);
  auto got = store.Get(a);
  ASSERT_NE(got, nullptr);
  SegmentKv want = MakeKv(20, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(got->k[l], want.k[l]);
    EXPECT_EQ(got->v[l], want.v[l]);
  }
  // Already local: nothing to fetch.
  FetchOutcome again = tier_->FetchMissing(refs, &store);
  EXPECT_EQ(again.fetched, 0);
  EXPECT_EQ(again.absent, 1);
  EXPECT_EQ(again.phases.transfer_ms, 0);  // nothing present: no data-plane work
}

// A CUDA worker writes bf16; it fetches half the bytes, and an f32 worker reads the same blocks.
TEST_F(KvTierServerTest, Bf16WriterHalvesTheFetchAndAnF32TierReadsItToo) {
  ClusterTierOptions t;
  t.servers = {server_->grpc_address()};
  t.wire_dtype = "bf16";
  auto bf = ClusterKvTier::Connect(t, model_, kLayers, kDim);
  ASSERT_TRUE(bf.ok()) << bf.status();
  SegmentKv kv = MakeKv(40, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < kv.k[l].size(); ++i) {
      kv.k[l][i] = static_cast<float>(l) + static_cast<float>(i % 50) / 32;  // bf16-exact
      kv.v[l][i] = -static_cast<float>(i % 70) / 16;
    }
  }
  const Hash128 seg{150, 1}, plain{150, 2};
  ASSERT_TRUE((*bf)->Put(seg, kv).ok());
  ASSERT_TRUE(tier_->Put(plain, kv).ok());  // f32, for the byte count
  std::vector<SegmentRef> refs = {{seg, 40}}, plain_refs = {{plain, 40}};
  SegmentStore a(SegmentStoreOptions{}), b(SegmentStoreOptions{});
  FetchOutcome fb = (*bf)->FetchMissing(refs, &a);
  FetchOutcome ff = tier_->FetchMissing(plain_refs, &b);
  ASSERT_EQ(fb.fetched, 1);
  ASSERT_EQ(ff.fetched, 1);
  EXPECT_LT(fb.bytes, ff.bytes * 6 / 10);
  FetchOutcome cross = tier_->FetchMissing(refs, &b);  // the f32 tier reads the bf16 blocks
  ASSERT_EQ(cross.fetched, 1);
  for (SegmentStore* st : {&a, &b}) {
    auto got = st->Get(seg);
    ASSERT_NE(got, nullptr);
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(got->k[l], kv.k[l]);
      EXPECT_EQ(got->v[l], kv.v[l]);
    }
  }
  t.wire_dtype = "f16";
  EXPECT_EQ(ClusterKvTier::Connect(t, model_, kLayers, kDim).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// For a worker with a device tier the fetch hands the segments over in bf16 instead of putting
// them into the store: bf16 blocks as they are (their widening equals what the fp32 path
// stores), f32 blocks rounded to nearest even; the store stays empty. Not under tensor
// parallelism.
TEST_F(KvTierServerTest, FetchHandsBf16SegmentsToTheTierWithoutTheStore) {
  ClusterTierOptions t;
  t.servers = {server_->grpc_address()};
  t.wire_dtype = "bf16";
  auto bf = ClusterKvTier::Connect(t, model_, kLayers, kDim);
  ASSERT_TRUE(bf.ok()) << bf.status();
  const Hash128 wire16{160, 1}, wire32{160, 2};
  const SegmentKv kv = MakeKv(33, 1.5f);
  ASSERT_TRUE((*bf)->Put(wire16, kv).ok());
  ASSERT_TRUE(tier_->Put(wire32, kv).ok());
  for (const Hash128& fp : {wire16, wire32}) {
    SegmentStore store(SegmentStoreOptions{}), plain(SegmentStoreOptions{});
    std::vector<SegmentRef> refs = {{fp, 33}};
    std::vector<std::pair<SegmentRef, SegmentKvBf16>> out;
    FetchOutcome f = tier_->FetchMissing(refs, &store, 0, 1, Collect(out));
    ASSERT_EQ(f.fetched, 1);
    ASSERT_EQ(f.stored.size(), 1u);
    EXPECT_FALSE(store.Contains(fp));
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].first.fp, fp);
    const SegmentKvBf16& got = out[0].second;
    ASSERT_EQ(got.n_tokens, 33);
    ASSERT_EQ(got.n_layers, kLayers);
    ASSERT_EQ(got.kv_dim, kDim);
    // The fp32 path's store content, rounded to bf16 where the wire was f32.
    ASSERT_EQ(tier_->FetchMissing(refs, &plain).fetched, 1);
    auto ref = plain.Get(fp);
    ASSERT_NE(ref, nullptr);
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_EQ(got.k[l].size(), ref->k[l].size());
      for (size_t i = 0; i < got.k[l].size(); ++i) {
        const float rk = fp == wire16 ? ref->k[l][i] : FromBf16(got.k[l][i]);
        const float rv = fp == wire16 ? ref->v[l][i] : FromBf16(got.v[l][i]);
        EXPECT_EQ(FromBf16(got.k[l][i]), rk);
        EXPECT_EQ(FromBf16(got.v[l][i]), rv);
        EXPECT_NEAR(FromBf16(got.k[l][i]), kv.k[l][i], std::abs(kv.k[l][i]) / 128 + 1e-6f);
        EXPECT_NEAR(FromBf16(got.v[l][i]), kv.v[l][i], std::abs(kv.v[l][i]) / 128 + 1e-6f);
      }
    }
  }
  SegmentStore store(SegmentStoreOptions{});
  std::vector<SegmentRef> refs = {{wire16, 33}};
  std::vector<std::pair<SegmentRef, SegmentKvBf16>> out;
  EXPECT_EQ(tier_->FetchMissing(refs, &store, 0, 2, Collect(out)).fetched, 0);  // not under TP
  EXPECT_TRUE(out.empty());
  // A segment the tier does not take is neither fetched nor stored.
  FetchOutcome refused = tier_->FetchMissing(
      refs, &store, 0, 1, [](const SegmentRef&, SegmentKvBf16&&) { return false; });
  EXPECT_EQ(refused.fetched, 0);
  EXPECT_TRUE(refused.stored.empty());
  EXPECT_EQ(refused.failures, 0);
}

// Several segments over several fetch rounds: each is handed over once, whole, and the ones
// handed over are exactly those reported fetched.
TEST_F(KvTierServerTest, FetchToTheTierHandsEachSegmentOverOnceWhole) {
  ClusterTierOptions t;
  t.servers = {server_->grpc_address()};
  t.wire_dtype = "bf16";
  t.fetch_batch_bytes = 1;  // one block per round: segments span rounds
  auto bf = ClusterKvTier::Connect(t, model_, kLayers, kDim);
  ASSERT_TRUE(bf.ok()) << bf.status();
  std::vector<SegmentRef> refs;
  for (int s = 0; s < 5; ++s) {
    const Hash128 fp{170, static_cast<uint64_t>(s)};
    ASSERT_TRUE((*bf)->Put(fp, MakeKv(20 + s, 0.5f * s)).ok());
    refs.push_back({fp, 20 + s});
  }
  SegmentStore store(SegmentStoreOptions{});
  std::vector<std::pair<SegmentRef, SegmentKvBf16>> out;
  FetchOutcome f = (*bf)->FetchMissing(refs, &store, 0, 1, Collect(out));
  EXPECT_EQ(f.fetched, 5);
  EXPECT_EQ(f.failures, 0);
  ASSERT_EQ(out.size(), 5u);
  for (const auto& [ref, kv] : out) {
    EXPECT_EQ(kv.n_tokens, ref.num_tokens);
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(kv.k[l].size(), static_cast<size_t>(ref.num_tokens) * kDim);
      EXPECT_EQ(kv.v[l].size(), static_cast<size_t>(ref.num_tokens) * kDim);
    }
  }
  EXPECT_EQ(f.stored.size(), 5u);
  EXPECT_EQ(store.stats().entries, 0);
}

// Streaming (StreamTo): every segment is opened before any byte moves, `started` runs once
// after that, and each segment fills to exactly what the one-piece bf16 fetch hands over,
// whether its memory is pageable or a block of the caller's (the engine's pinned memory); a
// segment nobody opens is not fetched, and one of another shape is failed, not written.
TEST_F(KvTierServerTest, StreamingFetchFillsEachSegmentLayerByLayer) {
  ClusterTierOptions t;
  t.servers = {server_->grpc_address()};
  t.wire_dtype = "bf16";
  t.fetch_batch_bytes = 1;  // one block per round
  auto bf = ClusterKvTier::Connect(t, model_, kLayers, kDim);
  ASSERT_TRUE(bf.ok()) << bf.status();
  std::vector<SegmentRef> refs;
  for (int s = 0; s < 3; ++s) {
    const Hash128 fp{180, static_cast<uint64_t>(s)};
    ASSERT_TRUE((*bf)->Put(fp, MakeKv(15 + s, 0.25f * (s + 1))).ok());
    refs.push_back({fp, 15 + s});
  }
  SegmentStore store(SegmentStoreOptions{});
  std::vector<std::pair<SegmentRef, SegmentKvBf16>> whole;
  ASSERT_EQ((*bf)->FetchMissing(refs, &store, 0, 1, Collect(whole)).fetched, 3);
  std::vector<std::shared_ptr<StreamedSegment>> opened;
  int started = 0, released = 0;
  std::vector<uint16_t> block(StreamedSegment::Bytes(15, kLayers, kDim) / 2, 0);
  ClusterKvTier::StreamTo stream;
  stream.open = [&](const SegmentRef& r) -> std::shared_ptr<StreamedSegment> {
    EXPECT_EQ(started, 0);
    if (r.fp == refs[2].fp) return nullptr;  // not taken
    if (r.fp == refs[0].fp) {
      opened.push_back(std::make_shared<StreamedSegment>(r.num_tokens, kLayers, kDim,
                                                         block.data(), [&] { ++released; }));
    } else {
      opened.push_back(std::make_shared<StreamedSegment>(r.num_tokens, kLayers, kDim));
    }
    return opened.back();
  };
  stream.started = [&] {
    EXPECT_EQ(opened.size(), 2u);
    ++started;
  };
  FetchOutcome f = (*bf)->FetchMissing(refs, &store, 0, 1, nullptr, &stream);
  EXPECT_EQ(started, 1);
  EXPECT_EQ(f.fetched, 2);
  EXPECT_EQ(f.failures, 0);
  ASSERT_EQ(opened.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(opened[i]->Complete());
    EXPECT_FALSE(opened[i]->Failed());
    const SegmentKvBf16* ref = nullptr;
    for (const auto& [r, kv] : whole) {
      if (r.fp == refs[i].fp) ref = &kv;
    }
    ASSERT_NE(ref, nullptr);
    for (int l = 0; l < kLayers; ++l) {
      const std::span<const uint16_t> k = opened[i]->k(l), v = opened[i]->v(l);
      EXPECT_EQ(std::vector<uint16_t>(k.begin(), k.end()), ref->k[l]);
      EXPECT_EQ(std::vector<uint16_t>(v.begin(), v.end()), ref->v[l]);
    }
  }
  EXPECT_TRUE(opened[0]->in_block());
  EXPECT_NE(std::count(block.begin(), block.end(), uint16_t{0}), static_cast<long>(block.size()));
  // The block sink's layers came in place (each bf16 block written into its layer frame, no
  // decode copy); the pageable one's were staged and copied.
  EXPECT_EQ(f.in_place_bytes, StreamedSegment::Bytes(15, kLayers, kDim));
  EXPECT_GT(f.bytes, f.in_place_bytes);
  opened.clear();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(store.stats().entries, 0);
  // A sink of another shape than the tier's is failed and never written.
  std::shared_ptr<StreamedSegment> wrong;
  ClusterKvTier::StreamTo other;
  other.open = [&](const SegmentRef& r) {
    wrong = std::make_shared<StreamedSegment>(r.num_tokens, kLayers + 1, kDim);
    return wrong;
  };
  const std::vector<SegmentRef> third = {refs[2]};
  FetchOutcome g = (*bf)->FetchMissing(third, &store, 0, 1, nullptr, &other);
  ASSERT_NE(wrong, nullptr);
  EXPECT_TRUE(wrong->Failed());
  EXPECT_FALSE(wrong->Ready(0));
  EXPECT_EQ(g.fetched, 0);
}

// Blocks another worker wrote in f32 do not fit a block sink's bf16 frames: they are staged
// and rounded into it as before, with the same values as a whole fetch gives.
TEST_F(KvTierServerTest, F32BlocksStreamIntoABlockSinkThroughTheDecode) {
  ClusterTierOptions t;
  t.servers = {server_->grpc_address()};
  t.wire_dtype = "f32";
  auto f32 = ClusterKvTier::Connect(t, model_, kLayers, kDim);
  ASSERT_TRUE(f32.ok()) << f32.status();
  const Hash128 fp{181, 1};
  ASSERT_TRUE((*f32)->Put(fp, MakeKv(13, 0.5f)).ok());
  const std::vector<SegmentRef> refs = {{fp, 13}};
  SegmentStore store(SegmentStoreOptions{});
  std::vector<std::pair<SegmentRef, SegmentKvBf16>> whole;
  ASSERT_EQ((*f32)->FetchMissing(refs, &store, 0, 1, Collect(whole)).fetched, 1);
  ASSERT_EQ(whole.size(), 1u);
  std::vector<uint16_t> block(StreamedSegment::Bytes(13, kLayers, kDim) / 2, 0);
  std::shared_ptr<StreamedSegment> seg;
  ClusterKvTier::StreamTo stream;
  stream.open = [&](const SegmentRef& r) {
    seg = std::make_shared<StreamedSegment>(r.num_tokens, kLayers, kDim, block.data(), nullptr);
    return seg;
  };
  FetchOutcome f = (*f32)->FetchMissing(refs, &store, 0, 1, nullptr, &stream);
  EXPECT_EQ(f.fetched, 1);
  EXPECT_EQ(f.in_place_bytes, 0u);
  ASSERT_NE(seg, nullptr);
  ASSERT_TRUE(seg->Complete());
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(std::vector<uint16_t>(seg->k(l).begin(), seg->k(l).end()), whole[0].second.k[l]);
    EXPECT_EQ(std::vector<uint16_t>(seg->v(l).begin(), seg->v(l).end()), whole[0].second.v[l]);
  }
}

TEST_F(KvTierServerTest, ABlockOfTheWrongShapeIsAFailureNotAHit) {
  // Another writer put a well-formed block under the segment's key whose shape does not match
  // the segment (e.g. a buggy or older worker): the fetch must not use it.
  const Hash128 seg{200, 1};
  auto client = Client();
  ASSERT_TRUE(client.ok()) << client.status();
  SegmentKv wrong = MakeKv(9, 5.0f);  // 9 tokens; the request's segment has 12
  for (int l = kLayers - 1; l >= 0; --l) {
    auto blk = EncodeSegmentLayer(model_, seg, wrong, l);
    ASSERT_TRUE(blk.ok());
    ASSERT_TRUE((*client)->Put({seg, static_cast<uint32_t>(l), static_cast<uint32_t>(l + 1)},
                               KvBlockBytes(*blk))
                    .ok());
  }
  SegmentStore store(SegmentStoreOptions{});
  std::vector<SegmentRef> refs = {{seg, 12}};
  ExpectCorruptFetch(refs, store);
  // The bad blocks were evicted: the right KV can be written back and fetched.
  ASSERT_TRUE(tier_->Put(seg, MakeKv(12, 6.0f)).ok());
  FetchOutcome g = tier_->FetchMissing(refs, &store);
  EXPECT_EQ(g.fetched, 1);
  EXPECT_EQ(g.failures, 0);
}

// Found by the fault suite: a block whose bytes arrive and fail their checksum was
// counted as an "incomplete" fetch (the client answers it NOT_FOUND, a miss); it is "corrupt".
// The tier leaves it to the client's report (the server re-verifies and drops it).
TEST_F(KvTierServerTest, ABlockThatFailsItsChecksumIsCountedCorrupt) {
  const Hash128 seg{300, 1};
  const SegmentKv kv = MakeKv(12, 7.0f);
  auto client = Client();
  ASSERT_TRUE(client.ok()) << client.status();
  cache::Reservation layer1;
  uint64_t layer1_size = 0;
  for (int l = kLayers - 1; l >= 0; --l) {
    auto blk = EncodeSegmentLayer(model_, seg, kv, l);
    ASSERT_TRUE(blk.ok());
    auto r = (*client)->Reserve({seg, static_cast<uint32_t>(l), static_cast<uint32_t>(l + 1)},
                                blk->size());
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE((*client)->Write(*r, KvBlockBytes(*blk)).ok());
    ASSERT_TRUE((*client)->Commit(*r, KvBlockWireChecksum(KvBlockBytes(*blk))).ok());
    if (l == 1) {
      layer1 = *r;
      layer1_size = blk->size();
    }
  }
  // A stray write into layer 1's committed payload: its memory copy no longer verifies.
  const std::string junk(64, '\x5a');
  ASSERT_TRUE((*client)->Write(layer1, KvBlockBytes(junk), layer1_size - 100).ok());
  SegmentStore store(SegmentStoreOptions{});
  std::vector<SegmentRef> refs = {{seg, 12}};
  ExpectCorruptFetch(refs, store);  // was "incomplete"
  auto st = (*client)->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->corrupt_blocks, 1u);  // the client's report, confirmed by the server
  ASSERT_TRUE(tier_->Put(seg, kv).ok());
  FetchOutcome g = tier_->FetchMissing(refs, &store);
  EXPECT_EQ(g.fetched, 1);
  EXPECT_EQ(g.failures, 0);
}

// Tensor parallelism: each rank writes and fetches only its KV-head share, under its own key;
// the local stores keep the segment's own fingerprint.
TEST_F(KvTierServerTest, TensorParallelRanksMoveTheirOwnShares) {
  const Hash128 seg{300, 1};
  auto share = [](float base) {
    SegmentKv kv = MakeKv(10, base);
    kv.kv_dim = kDim / 2;  // 2-way TP: half the KV columns per rank
    for (int l = 0; l < kLayers; ++l) {
      kv.k[l].resize(10 * kDim / 2);
      kv.v[l].resize(10 * kDim / 2);
    }
    return kv;
  };
  ASSERT_TRUE(tier_->Put(seg, share(1.0f), 0, 2).ok());
  ASSERT_TRUE(tier_->Put(seg, share(7.0f), 1, 2).ok());
  EXPECT_FALSE(tier_->Put(seg, MakeKv(10, 1.0f), 1, 2).ok());  // a whole segment is no share
  EXPECT_NE(ShareKey(seg, 0, 2), ShareKey(seg, 1, 2));
  EXPECT_EQ(ShareKey(seg, 0, 1), seg);

  std::vector<SegmentRef> refs = {{seg, 10}};
  SegmentStore whole(SegmentStoreOptions{});  // a TP=1 worker does not see the shares
  EXPECT_EQ(tier_->FetchMissing(refs, &whole).absent, 1);
  for (int r = 0; r < 2; ++r) {
    SegmentStore store(SegmentStoreOptions{});
    FetchOutcome f = tier_->FetchMissing(refs, &store, r, 2);
    EXPECT_EQ(f.fetched, 1) << "rank " << r;
    auto got = store.Get(seg);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(got->kv_dim, kDim / 2);
    SegmentKv want = share(r == 0 ? 1.0f : 7.0f);
    for (int l = 0; l < kLayers; ++l) EXPECT_EQ(got->k[l], want.k[l]) << "rank " << r;
  }
}

TEST_F(KvTierServerTest, UnreachableClusterMeansRecompute) {
  // The cluster client skips members that do not answer: their segments count as absent, the
  // request recomputes them, nothing blocks or crashes.
  const Hash128 seg{300, 1};
  ASSERT_TRUE(tier_->Put(seg, MakeKv(4, 1.0f)).ok());
  server_->Shutdown();
  SegmentStore store(SegmentStoreOptions{});
  std::vector<SegmentRef> refs = {{seg, 4}};
  FetchOutcome f = tier_->FetchMissing(refs, &store);
  EXPECT_EQ(f.fetched, 0);
  EXPECT_EQ(f.failures + f.absent, 1);
  EXPECT_FALSE(store.Contains(seg));
  EXPECT_FALSE(tier_->Put(Hash128{300, 2}, MakeKv(4, 1.0f)).ok());
}

// A segment larger than the server's memory arena (the case of an 8B model's ~2000-token
// segment against a 256 MiB arena): one lease for all of it can never be granted, so the tier
// fetches in rounds of at most fetch_batch_bytes, each promoted from the disk tier on its own.
absl::StatusOr<std::unique_ptr<cache::CacheServer>> StartSmallServer(const std::string& disk) {
  cache::ServerOptions o;
  o.insecure_loopback = true;  // a loopback test cluster
  o.grpc_port = 0;
  o.metrics_port = -1;
  o.cache.memory_capacity_bytes = 4 << 20;
  o.cache.disk_backend = disk;
  return cache::CacheServer::Start(o);
}

TEST(KvTierLargeSegmentTest, SegmentLargerThanTheArenaIsFetchedInRounds) {
  auto server = StartSmallServer("memory");
  ASSERT_TRUE(server.ok()) << server.status();
  const Hash128 model{5, 6}, fp{7, 8};
  const int n = 24576;  // 1.5 MiB of fp32 K+V per layer, 4.5 MiB in all (arena: 4 MiB)
  SegmentKv kv = MakeKv(n, 2.0f);
  ClusterTierOptions t;
  t.servers = {(*server)->grpc_address()};
  t.fetch_batch_bytes = 2 << 20;
  auto writer = ClusterKvTier::Connect(t, model, kLayers, kDim);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*writer)->Put(fp, kv).ok());

  SegmentStore store(SegmentStoreOptions{});
  SegmentRef ref{fp, n};
  FetchOutcome f = (*writer)->FetchMissing({&ref, 1}, &store);
  EXPECT_EQ(f.failures, 0) << (f.failure_reasons.empty() ? "" : f.failure_reasons[0]);
  ASSERT_EQ(f.fetched, 1);
  EXPECT_GE(f.bytes, uint64_t{3} * n * kDim * 8);
  std::shared_ptr<const SegmentKv> got = store.Get(fp);
  ASSERT_NE(got, nullptr);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(got->k[l], kv.k[l]);
    EXPECT_EQ(got->v[l], kv.v[l]);
  }
}

TEST(KvTierLargeSegmentTest, PartlyEvictedSegmentCostsNoTransfer) {
  auto server = StartSmallServer("none");  // memory only: evicted layers are gone
  ASSERT_TRUE(server.ok()) << server.status();
  const Hash128 model{5, 6}, fp{7, 9};
  const int n = 24576;
  ClusterTierOptions t;
  t.servers = {(*server)->grpc_address()};
  auto tier = ClusterKvTier::Connect(t, model, kLayers, kDim);
  ASSERT_TRUE(tier.ok()) << tier.status();
  (void)(*tier)->Put(fp, MakeKv(n, 3.0f));  // the last layer written evicts an earlier one
  SegmentStore store(SegmentStoreOptions{});
  SegmentRef ref{fp, n};
  FetchOutcome f = (*tier)->FetchMissing({&ref, 1}, &store);
  EXPECT_EQ(f.fetched, 0);
  ASSERT_EQ(f.failures, 1);
  EXPECT_EQ(f.incomplete, 1);
  EXPECT_EQ(f.failure_reasons[0], "incomplete");
  EXPECT_EQ(f.bytes, 0u);  // found out by lookup, before any transfer
  EXPECT_FALSE(store.Contains(fp));
}

// The cache server restarts (same port, same RocksDB directory) under a running
// worker. The worker's tier, the same object, must notice the new incarnation and exchange
// endpoints again: its fetch gets the restarted server's disk blocks intact, nothing is
// reported or dropped as corrupt, and its write-back succeeds.
TEST(KvTierRestartTest, RestartedServerServesItsDiskBlocksToTheRunningWorker) {
  const std::string dir = cache::testing::MakeTempDir("sparsex-kv-tier-restart-");
  ASSERT_FALSE(dir.empty());
  auto start = [&](int port) {
    cache::ServerOptions o;
    o.insecure_loopback = true;  // a loopback test cluster
    o.grpc_port = port;
    o.metrics_port = -1;
    o.cache.memory_capacity_bytes = 16 << 20;
    o.cache.disk_backend = SPARSEX_WITH_ROCKSDB ? "rocksdb" : "memory";
    o.cache.disk_path = dir + "/db";
    o.cache.disk_reserve_bytes = 4 << 20;
    return cache::CacheServer::Start(o);
  };
  auto server = start(0);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->grpc_port();
  const uint64_t first = (*server)->instance_id();
  const Hash128 model{31, 32};
  ClusterTierOptions t;
  t.servers = {(*server)->grpc_address()};
  auto tier = ClusterKvTier::Connect(t, model, kLayers, kDim);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const Hash128 a{400, 1}, b{400, 2};
  ASSERT_TRUE((*tier)->Put(a, MakeKv(64, 1.0f)).ok());
  ASSERT_TRUE((*tier)->Put(b, MakeKv(32, 2.0f)).ok());
  {
    SegmentStore warm(SegmentStoreOptions{});
    SegmentRef ref{a, 64};
    ASSERT_EQ((*tier)->FetchMissing({&ref, 1}, &warm).fetched, 1);
  }
  if (!SPARSEX_WITH_ROCKSDB) GTEST_SKIP() << "needs RocksDB: the blocks must outlive the server";
  (*server)->Shutdown();
  server->reset();
  server = start(port);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_EQ((*server)->grpc_port(), port);
  ASSERT_NE((*server)->instance_id(), first);

  SegmentStore store(SegmentStoreOptions{});
  std::vector<SegmentRef> refs = {{a, 64}, {b, 32}};
  FetchOutcome f = (*tier)->FetchMissing(refs, &store);
  EXPECT_EQ(f.fetched, 2) << (f.failure_reasons.empty() ? "" : f.failure_reasons[0]);
  EXPECT_EQ(f.failures, 0);
  for (const auto& [fp, base, n] : {std::tuple{a, 1.0f, 64}, std::tuple{b, 2.0f, 32}}) {
    auto got = store.Get(fp);
    ASSERT_NE(got, nullptr);
    SegmentKv want = MakeKv(n, base);
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(got->k[l], want.k[l]);
      EXPECT_EQ(got->v[l], want.v[l]);
    }
  }
  cache::CacheStats st = (*server)->cache()->Stats();
  EXPECT_EQ(st.corrupt_blocks, 0u);
  EXPECT_EQ(st.corrupt_reports_refuted, 0u);
  EXPECT_EQ(st.disk_blocks, 2u * kLayers);
  // Write-back from the same worker works.
  const Hash128 c{400, 3};
  absl::Status put = (*tier)->Put(c, MakeKv(16, 3.0f));
  EXPECT_TRUE(put.ok()) << put;
  SegmentStore again(SegmentStoreOptions{});
  SegmentRef ref{c, 16};
  EXPECT_EQ((*tier)->FetchMissing({&ref, 1}, &again).fetched, 1);
  EXPECT_EQ((*server)->cache()->Stats().disk_blocks, 3u * kLayers);
  server->reset();
  cache::testing::RemoveTree(dir);
}

}  // namespace
}  // namespace sparsex::service
