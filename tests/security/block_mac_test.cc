// KV block provenance (gpu_worker/service/block_mac.h): a block is used only when a holder of
// the cluster's KV MAC key sealed it and nothing changed since. The attack it answers: garbage
// KV committed under a public document's fingerprint, with a valid header and checksums, was
// served to the next user; here such a block reaches the cache server and is refused by the
// worker that fetches it.
#include "gpu_worker/service/block_mac.h"

#include <fstream>

#include "cache_client/cache_client.h"
#include "common/fingerprint.h"
#include "common/kv_block.h"
#include "gpu_worker/service/kv_tier.h"
#include "gtest/gtest.h"
#include "testing/server_process.h"
#include "tests/service/test_util.h"

namespace sparsex::service {
namespace {

constexpr int kLayers = 2, kDim = 8, kTokens = 5;

SegmentKv MakeKv(float base) {
  SegmentKv kv;
  kv.n_tokens = kTokens;
  kv.n_layers = kLayers;
  kv.kv_dim = kDim;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> k(kTokens * kDim), v(kTokens * kDim);
    for (int i = 0; i < kTokens * kDim; ++i) {
      k[i] = base + l + 0.01f * i;
      v[i] = -base - l - 0.02f * i;
    }
    kv.k.push_back(k);
    kv.v.push_back(v);
  }
  return kv;
}

std::unique_ptr<BlockMac> Mac(uint8_t fill) {
  std::vector<uint8_t> key(32, fill);
  return *BlockMac::FromKey(key);
}

TEST(BlockMac, SealedBlocksVerifyAndAnyChangeIsRefused) {
  const Hash128 model{1, 2}, seg{3, 4};
  auto block = EncodeSegmentLayer(model, seg, MakeKv(1.0f), 1, KvDtype::kBF16);
  ASSERT_TRUE(block.ok());
  std::span<uint8_t> b(reinterpret_cast<uint8_t*>(block->data()), block->size());
  auto mac = Mac(7);
  EXPECT_EQ(mac->Verify(b).code(), absl::StatusCode::kDataLoss) << "not sealed";
  ASSERT_TRUE(mac->Seal(b).ok());
  EXPECT_TRUE(mac->Verify(b).ok());
  EXPECT_TRUE(VerifyKvBlock(b).ok()) << "still a well-formed block (header checksum redone)";
  EXPECT_EQ(Mac(8)->Verify(b).code(), absl::StatusCode::kDataLoss) << "another key";
  for (size_t at : {size_t{33}, size_t{50}, kKvBlockHeaderBytes + 3, b.size() - 1}) {
    std::string copy = *block;
    copy[at] ^= 0x10;
    std::span<const uint8_t> c(reinterpret_cast<const uint8_t*>(copy.data()), copy.size());
    EXPECT_EQ(mac->Verify(c).code(), absl::StatusCode::kDataLoss) << "byte " << at;
  }
}

TEST(BlockMac, KeyFileErrors) {
  const std::string dir = cache::testing::MakeTempDir("spx-mac");
  auto write = [&](const std::string& s) {
    std::ofstream(dir + "/k") << s;
    return BlockMac::FromFile(dir + "/k");
  };
  EXPECT_TRUE(write(std::string(64, 'a') + "\n").ok());
  EXPECT_FALSE(write(std::string(63, 'a')).ok());
  EXPECT_FALSE(write(std::string(64, 'g')).ok());
  EXPECT_FALSE(BlockMac::FromFile(dir + "/missing").ok());
  cache::testing::RemoveTree(dir);
}

// Through a real cache server: a block put by someone without the key (valid header and
// checksums, under the very key a worker will look up) is fetched as "unauthenticated" and never
// used; the same segment written by a worker with the key is fetched whole.
TEST(BlockMac, ClusterTierUsesOnlySealedBlocks) {
  auto server = testutil::StartMemoryCacheServer();
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string dir = cache::testing::MakeTempDir("spx-mac");
  std::ofstream(dir + "/kv_mac.key") << std::string(64, 'c');
  const Hash128 model{11, 22};
  const Hash128 seg = SegmentFingerprint(model, std::vector<int32_t>{1, 2, 3}, "none");
  ClusterTierOptions t;
  t.servers = {(*server)->grpc_address()};
  t.mac_key_file = dir + "/kv_mac.key";
  auto tier = ClusterKvTier::Connect(t, model, kLayers, kDim);
  ASSERT_TRUE(tier.ok()) << tier.status();

  // The attacker's blocks: well-formed, checksummed, unsealed.
  cache::CacheClientOptions co;
  co.address = (*server)->grpc_address();
  co.model_fp = model;
  auto attacker = cache::CacheClient::Connect(co);
  ASSERT_TRUE(attacker.ok()) << attacker.status();
  const SegmentKv garbage = MakeKv(99.0f);
  for (int l = kLayers - 1; l >= 0; --l) {
    auto b = EncodeSegmentLayer(model, seg, garbage, l, KvDtype::kF32);
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE((*attacker)
                    ->Put({seg, static_cast<uint32_t>(l), static_cast<uint32_t>(l + 1)},
                          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(b->data()),
                                                   b->size()))
                    .ok());
  }
  std::vector<SegmentRef> refs = {{seg, kTokens}};
  SegmentStore store(SegmentStoreOptions{});
  FetchOutcome f = (*tier)->FetchMissing(refs, &store);
  EXPECT_EQ(f.fetched, 0);
  ASSERT_EQ(f.failure_reasons.size(), 1u);
  EXPECT_EQ(f.failure_reasons[0], "unauthenticated");
  EXPECT_FALSE(store.Contains(seg));

  // A member's write of another segment, sealed: fetched whole.
  const Hash128 seg2 = SegmentFingerprint(model, std::vector<int32_t>{4, 5, 6}, "none");
  ASSERT_TRUE((*tier)->Put(seg2, MakeKv(1.0f)).ok());
  std::vector<SegmentRef> refs2 = {{seg2, kTokens}};
  FetchOutcome g = (*tier)->FetchMissing(refs2, &store);
  EXPECT_EQ(g.fetched, 1);
  ASSERT_TRUE(store.Contains(seg2));
  cache::testing::RemoveTree(dir);
}

}  // namespace
}  // namespace sparsex::service
