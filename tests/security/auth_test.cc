// API keys, tenants and KV scopes (router/auth.h), the scope in every fingerprint
// (common/fingerprint.h, model/prompt.h, the block manager), and the plaintext rule
// (proto/grpc_tls.h).
#include <openssl/sha.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "common/fingerprint.h"
#include "gpu_worker/kv/block_manager.h"
#include "gtest/gtest.h"
#include "model/prompt.h"
#include "proto/grpc_tls.h"
#include "router/auth.h"
#include "testing/server_process.h"

namespace sparsex {
namespace {

using router::Authenticator;

std::string Sha(const std::string& s) {
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), md);
  std::string out;
  char b[3];
  for (unsigned char c : md) {
    snprintf(b, sizeof b, "%02x", c);
    out += b;
  }
  return out;
}

std::string KeyFile() {
  return R"({"shared_scopes": ["public"], "keys": [
    {"sha256": ")" + Sha("key-a") + R"(", "tenant": "alice", "read_scopes": ["public"],
     "max_concurrent": 2},
    {"sha256": ")" + Sha("key-b") + R"(", "tenant": "bob", "requests_per_s": 1},
    {"sha256": ")" + Sha("key-loader") + R"(", "tenant": "loader", "write_scope": "public"},
    {"sha256": ")" + Sha("key-ops") + R"(", "tenant": "ops", "admin": true}]})";
}

TEST(Auth, KeysMapToTenants) {
  auto a = Authenticator::FromJson(KeyFile(), "0123456789abcdef0123");
  ASSERT_TRUE(a.ok()) << a.status();
  auto alice = (*a)->Authenticate("Bearer key-a");
  ASSERT_TRUE(alice.ok()) << alice.status();
  EXPECT_EQ((*alice)->name, "alice");
  EXPECT_FALSE((*alice)->admin);
  ASSERT_EQ((*alice)->read_scopes.size(), 1u);
  auto bob = (*a)->Authenticate("bearer   key-b ");  // scheme case-insensitive, spaces trimmed
  ASSERT_TRUE(bob.ok());
  EXPECT_NE((*alice)->private_scope.salt, (*bob)->private_scope.salt);
  EXPECT_NE((*alice)->private_scope.salt, Hash128{});
  auto loader = (*a)->Authenticate("Bearer key-loader");
  ASSERT_TRUE(loader.ok());
  EXPECT_EQ((*loader)->store_scope().salt, (*alice)->read_scopes[0].salt);
  EXPECT_TRUE((*(*a)->Authenticate("Bearer key-ops"))->admin);
}

TEST(Auth, BadCredentialsAreUnauthenticatedAndNeverEchoed) {
  auto a = Authenticator::FromJson(KeyFile(), "");
  ASSERT_TRUE(a.ok());
  for (const char* h : {"", "key-a", "Basic a2V5LWE=", "Bearer ", "Bearer key-x", "Bearer key-a\x01",
                        "Bearer k\xc3\xa9y"}) {
    auto t = (*a)->Authenticate(h);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnauthenticated) << h;
    EXPECT_EQ(std::string(t.status().message()).find("key-"), std::string::npos);
  }
  EXPECT_FALSE((*a)->Authenticate("Bearer " + std::string(600, 'k')).ok());
}

TEST(Auth, DisabledIsTheUnscopedAdmin) {
  auto a = Authenticator::Disabled();
  EXPECT_FALSE(a->enabled());
  auto t = a->Authenticate("");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE((*t)->admin);
  EXPECT_EQ((*t)->store_scope().salt, Hash128{});
}

TEST(Auth, KeyFileErrorsNameTheProblem) {
  const std::string good = Sha("x");
  struct Case {
    std::string json, want;
  } cases[] = {
      {"[]", "not a JSON object"},
      {R"({"keys": {}})", "\"keys\" must be an array"},
      {R"({"keys": [], "extra": 1})", "unknown field 'extra'"},
      {R"({"keys": [{"tenant": "a"}]})", "sha256"},
      {R"({"keys": [{"sha256": "abc", "tenant": "a"}]})", "64 hex digits"},
      {R"({"keys": [{"sha256": ")" + good + R"(", "tenant": "a b"}]})", "tenant"},
      {R"({"keys": [{"sha256": ")" + good + R"(", "tenant": "a", "read_scopes": ["nope"]}]})",
       "not listed in shared_scopes"},
      {R"({"keys": [{"sha256": ")" + good + R"(", "tenant": "a", "max_concurrent": -1}]})",
       "max_concurrent"},
      {R"({"keys": [{"sha256": ")" + good + R"(", "tenant": "a", "role": "x"}]})",
       "unknown field 'role'"},
      {R"({"keys": [{"sha256": ")" + good + R"(", "tenant": "a"},
                    {"sha256": ")" + good + R"(", "tenant": "b"}]})",
       "listed twice"},
      {std::string(100, '[') + std::string(100, ']'), ""},
  };
  for (const auto& c : cases) {
    auto a = Authenticator::FromJson(c.json, "");
    EXPECT_FALSE(a.ok()) << c.json;
    EXPECT_NE(std::string(a.status().message()).find(c.want), std::string::npos)
        << c.json << " -> " << a.status();
  }
}

TEST(Auth, ConcurrencyAndRateLimits) {
  auto a = Authenticator::FromJson(KeyFile(), "");
  ASSERT_TRUE(a.ok());
  auto alice = *(*a)->Authenticate("Bearer key-a");
  {
    auto s1 = (*a)->Admit(*alice);
    auto s2 = (*a)->Admit(*alice);
    ASSERT_TRUE(s1.ok() && s2.ok());
    auto s3 = (*a)->Admit(*alice);
    EXPECT_EQ(s3.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(std::string(s3.status().message()).find("2 requests at once"), std::string::npos);
  }
  EXPECT_TRUE((*a)->Admit(*alice).ok()) << "slots come back when the requests end";
  auto bob = *(*a)->Authenticate("Bearer key-b");
  EXPECT_TRUE((*a)->Admit(*bob).ok());
  auto again = (*a)->Admit(*bob);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(Auth, KeyFileRotatesWithoutRestartAndKeepsOldKeysOnBadFile) {
  const std::string dir = cache::testing::MakeTempDir("spx-auth");
  const std::string path = dir + "/keys.json";
  auto write = [&](const std::string& s) {
    std::ofstream(path + ".tmp") << s;
    std::filesystem::rename(path + ".tmp", path);
  };
  write(R"({"keys": [{"sha256": ")" + Sha("old") + R"(", "tenant": "t"}]})");
  auto a = Authenticator::FromFile(path, "");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE((*a)->Authenticate("Bearer old").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  write(R"({"keys": [{"sha256": ")" + Sha("new") + R"(", "tenant": "t"}]})");
  EXPECT_TRUE((*a)->Authenticate("Bearer new").ok());
  EXPECT_FALSE((*a)->Authenticate("Bearer old").ok()) << "a removed key stops working";
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  write("{ not json");
  EXPECT_TRUE((*a)->Authenticate("Bearer new").ok()) << "a broken file keeps the last keys";
  cache::testing::RemoveTree(dir);
}

TEST(Auth, ScopeSaltsAreKeyed) {
  EXPECT_EQ(router::ScopeSalt("k1234567890123456", "tenant/a"),
            router::ScopeSalt("k1234567890123456", "tenant/a"));
  EXPECT_NE(router::ScopeSalt("k1234567890123456", "tenant/a"),
            router::ScopeSalt("k1234567890123457", "tenant/a"));
  EXPECT_NE(router::ScopeSalt("", "tenant/a"), router::ScopeSalt("", "tenant/b"));
  EXPECT_EQ(Authenticator::FromFile("/nonexistent/keys.json", "").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The scope is part of every key: segments, exact-prefix blocks (router and worker alike).
TEST(Scope, InEverySegmentAndPrefixKey) {
  const Hash128 model{1, 2}, sa{3, 4}, sb{5, 6};
  const std::vector<int32_t> toks = {5, 6, 7, 8, 9, 10, 11, 12, 13};
  EXPECT_EQ(ScopedModelFingerprint(model, Hash128{}), model) << "unscoped keys are unchanged";
  EXPECT_NE(SegmentFingerprint(ScopedModelFingerprint(model, sa), toks, "none"),
            SegmentFingerprint(ScopedModelFingerprint(model, sb), toks, "none"));
  PromptSegment s;
  s.tokens = toks;
  s.scope = sa;
  std::vector<PromptSegment> segs{s};
  auto fa = FingerprintRequest(model, segs, 1, {.block_size = 4, .prefix_scope = sa});
  segs[0].scope = sb;
  auto fb = FingerprintRequest(model, segs, 1, {.block_size = 4, .prefix_scope = sb});
  ASSERT_EQ(fa.prefix_blocks.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_NE(fa.prefix_blocks[i], fb.prefix_blocks[i]);
  EXPECT_NE(*fa.segments[0], *fb.segments[0]);
  // The worker's block manager chains from the same root as the router.
  BlockManager bm({.block_size = 4, .num_blocks = 8}, model);
  std::vector<int32_t> all = {1};
  all.insert(all.end(), toks.begin(), toks.end());
  auto hashes = bm.BlockHashes(std::span<const int32_t>(all.data(), 8), -1, sa);
  ASSERT_EQ(hashes.size(), 2u);
  EXPECT_EQ(hashes[0], fa.prefix_blocks[0]);
  EXPECT_EQ(hashes[1], fa.prefix_blocks[1]);
}

TEST(Tls, PlaintextOnlyWhenAskedAndOnLoopback) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:80"));
  EXPECT_TRUE(IsLoopbackAddress("127.5.0.1:0"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:1"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:80"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:80"));
  EXPECT_FALSE(IsLoopbackAddress(":80"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:80"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.1:80"));
  EXPECT_FALSE(IsLoopbackAddress("127.0.0.1.evil.com:80"));
  EXPECT_TRUE(CheckPlaintextAllowed(true, "insecure_loopback", {"127.0.0.1:1", ""}).ok());
  EXPECT_EQ(CheckPlaintextAllowed(false, "insecure_loopback", {"127.0.0.1:1"}).code(),
            absl::StatusCode::kFailedPrecondition);
  auto s = CheckPlaintextAllowed(true, "insecure_loopback", {"127.0.0.1:1", "0.0.0.0:8000"});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("0.0.0.0:8000"), std::string::npos);
  EXPECT_FALSE(CheckTlsFiles({.ca = "/nonexistent"}).ok()) << "all three or none";
  EXPECT_FALSE(CheckTlsFiles({"/nonexistent/ca", "/nonexistent/c", "/nonexistent/k"}).ok());
}

}  // namespace
}  // namespace sparsex
