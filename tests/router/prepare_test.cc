// PrepareRequest (router/prepare.h) on the synthetic "tiny" model (vocabulary 1000, context
// 8192, 4 layers, BOS 1; its tokenizer reads decimal numbers, so "3 4" is [3, 4]), without any
// gRPC server: segments versus a plain prompt, content-defined chunking, the vocabulary and
// context checks, and the routing fingerprints, equal to model/prompt.h's FingerprintRequest
// once the served identity is known and absent while it is not.
#include "router/prepare.h"

#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/prompt.h"

namespace sparsex::router {
namespace {

class PrepareTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = LoadModelInfo("synthetic:tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = new ModelInfo(std::move(*m));
  }
  static void TearDownTestSuite() { delete model_; }

  static ServedIdentity Known(int block_size = 4, const std::string& encoding = "none") {
    ServedIdentity id;
    id.known = true;
    id.fingerprint = Hash128{0x1234, 0x5678};
    id.fingerprint_hex = id.fingerprint.Hex();
    id.encoding = encoding;
    id.block_size = block_size;
    return id;
  }

  static absl::StatusOr<Prepared> Prep(const v1::GenerateRequest& req,
                                       const ServedIdentity& id = {},
                                       const ChunkingOptions& chunking = {}) {
    return PrepareRequest(req, *model_, chunking, id);
  }

  static std::vector<int32_t> Tokens(const worker::v1::TokenSegment& s) {
    return {s.tokens().begin(), s.tokens().end()};
  }

  static ModelInfo* model_;
};
ModelInfo* PrepareTest::model_ = nullptr;

std::string Numbers(int begin, int end) {
  std::string s;
  for (int i = begin; i < end; ++i) s += std::to_string(i % 997 + 3) + " ";
  return s;
}

TEST_F(PrepareTest, SegmentsMapOneToOne) {
  v1::GenerateRequest req;
  req.add_segments()->set_text("3 4 5");
  v1::Segment* ids = req.add_segments();
  ids->mutable_ids()->add_ids(7);
  ids->mutable_ids()->add_ids(8);
  ids->set_cacheable(false);
  req.set_request_id("r-1");
  req.mutable_sampling()->set_max_tokens(5);
  req.set_return_token_ids(true);
  auto p = Prep(req);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->wreq.segments_size(), 2);
  EXPECT_EQ(Tokens(p->wreq.segments(0)), (std::vector<int32_t>{3, 4, 5}));
  EXPECT_TRUE(p->wreq.segments(0).cacheable());  // unset: cacheable
  EXPECT_EQ(Tokens(p->wreq.segments(1)), (std::vector<int32_t>{7, 8}));
  EXPECT_FALSE(p->wreq.segments(1).cacheable());
  EXPECT_EQ(p->prompt_tokens, 1 + 3 + 2);  // BOS by default
  EXPECT_TRUE(p->wreq.add_bos());
  EXPECT_EQ(p->wreq.request_id(), "r-1");
  EXPECT_EQ(p->wreq.sampling().max_tokens(), 5);
  EXPECT_TRUE(p->wreq.return_token_ids());
}

TEST_F(PrepareTest, PlainPromptIsChunkedAsChunkPrompt) {
  const ChunkingOptions chunking{.min_tokens = 8, .avg_tokens = 16, .max_tokens = 32};
  v1::GenerateRequest text;
  text.set_prompt(Numbers(0, 300));
  text.set_add_bos(false);
  auto p = Prep(text, {}, chunking);
  ASSERT_TRUE(p.ok()) << p.status();
  std::vector<int32_t> ids = model_->tokenizer->Encode(text.prompt(), false);
  ASSERT_EQ(ids.size(), 300u);
  const std::vector<PromptSegment> want = ChunkPrompt(ids, chunking);
  ASSERT_GT(want.size(), 1u);
  ASSERT_EQ(p->wreq.segments_size(), static_cast<int>(want.size()));
  std::vector<int32_t> all;
  for (int i = 0; i < p->wreq.segments_size(); ++i) {
    EXPECT_EQ(Tokens(p->wreq.segments(i)), want[i].tokens) << i;
    EXPECT_LE(p->wreq.segments(i).tokens_size(), chunking.max_tokens);
    const std::vector<int32_t> t = Tokens(p->wreq.segments(i));
    all.insert(all.end(), t.begin(), t.end());
  }
  EXPECT_EQ(all, ids);  // the segments cover the prompt in order
  EXPECT_EQ(p->prompt_tokens, 300);  // no BOS
  EXPECT_FALSE(p->wreq.add_bos());

  // prompt_ids: the same segments.
  v1::GenerateRequest id_req;
  for (int32_t t : ids) id_req.add_prompt_ids(t);
  id_req.set_add_bos(false);
  auto q = Prep(id_req, {}, chunking);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->wreq.segments_size(), p->wreq.segments_size());
  for (int i = 0; i < q->wreq.segments_size(); ++i) {
    EXPECT_EQ(Tokens(q->wreq.segments(i)), Tokens(p->wreq.segments(i)));
  }
}

TEST_F(PrepareTest, SegmentsAndPromptAreExclusive) {
  v1::GenerateRequest both;
  both.set_prompt("1 2");
  both.add_segments()->set_text("3 4");
  EXPECT_EQ(Prep(both).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(Prep(both).status().message().find("not both"), std::string::npos);

  v1::GenerateRequest ids_too;
  ids_too.set_prompt("1 2");
  ids_too.add_prompt_ids(3);
  EXPECT_EQ(Prep(ids_too).status().code(), absl::StatusCode::kInvalidArgument);

  v1::GenerateRequest none;
  EXPECT_EQ(Prep(none).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(Prep(none).status().message().find("empty request"), std::string::npos);
}

TEST_F(PrepareTest, InvalidUtf8IsRefusedNamingTheField) {
  v1::GenerateRequest seg;
  seg.add_segments()->set_text("1 2");
  seg.add_segments()->set_text("3 \xff");
  EXPECT_EQ(Prep(seg).status().message(), "segment 1: invalid UTF-8");

  v1::GenerateRequest prompt;
  prompt.set_prompt("1 \xc3");
  EXPECT_EQ(Prep(prompt).status().message(), "prompt: invalid UTF-8");

  v1::GenerateRequest id;
  id.set_prompt("1 2");
  id.set_request_id("x\xfe");
  EXPECT_EQ(Prep(id).status().message(), "request_id: invalid UTF-8");
}

TEST_F(PrepareTest, TokenIdsMustBeInTheVocabulary) {
  for (int32_t bad : {1000, -1, 1 << 30}) {
    v1::GenerateRequest req;
    req.add_prompt_ids(5);
    req.add_prompt_ids(bad);
    absl::Status s = Prep(req).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("outside the vocabulary of 1000"), std::string::npos) << s;

    v1::GenerateRequest seg;
    seg.add_segments()->mutable_ids()->add_ids(bad);
    EXPECT_EQ(Prep(seg).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  v1::GenerateRequest ok;
  ok.add_prompt_ids(999);
  EXPECT_TRUE(Prep(ok).ok());
}

TEST_F(PrepareTest, PromptMustFitTheContext) {
  v1::GenerateRequest fits;  // 8191 tokens + BOS = 8192, the context length
  fits.mutable_prompt_ids()->Resize(8191, 5);
  auto p = Prep(fits);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->prompt_tokens, 8192);

  v1::GenerateRequest over = fits;
  over.add_prompt_ids(5);
  absl::Status s = Prep(over).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("exceeds the context length of 8192"), std::string::npos) << s;
  over.set_add_bos(false);  // without BOS it fits again
  EXPECT_TRUE(Prep(over).ok());

  v1::GenerateRequest empty;  // one segment of text with no tokens, no BOS
  empty.add_segments()->set_text("no digits");
  empty.set_add_bos(false);
  EXPECT_EQ(Prep(empty).status().message(), "empty prompt");
}

TEST_F(PrepareTest, SamplingAndReuseRangesAreChecked) {
  v1::GenerateRequest req;
  req.set_prompt("1 2");
  req.mutable_sampling()->add_stop_ids(1000);
  EXPECT_NE(Prep(req).status().message().find("stop_ids"), std::string::npos);
  req.mutable_sampling()->clear_stop_ids();
  req.mutable_reuse()->set_full_layers(5);  // 4 layers
  EXPECT_NE(Prep(req).status().message().find("full_layers"), std::string::npos);
  req.mutable_reuse()->set_full_layers(4);
  EXPECT_TRUE(Prep(req).ok());
}

TEST_F(PrepareTest, RequestIdIsGeneratedWhenEmpty) {
  v1::GenerateRequest req;
  req.set_prompt("1 2");
  auto a = Prep(req);
  auto b = Prep(req);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->wreq.request_id().rfind("req-", 0), 0u) << a->wreq.request_id();
  EXPECT_EQ(a->wreq.request_id().size(), 4u + 16u);
  EXPECT_NE(a->wreq.request_id(), b->wreq.request_id());
}

TEST_F(PrepareTest, NoFingerprintsWhileTheIdentityIsUnknown) {
  v1::GenerateRequest req;
  req.add_segments()->set_text(Numbers(0, 40));
  req.add_segments()->set_text(Numbers(40, 70));
  auto p = Prep(req, ServedIdentity{});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fps.empty());
  EXPECT_EQ(p->wreq.segments_size(), 2);  // the request itself is complete
}

// The entries PrepareRequest should produce: prefix blocks, then segments, as the workers hash
// them (FingerprintRequest).
std::vector<IndexEntry> Expected(const ServedIdentity& id, const std::vector<PromptSegment>& segs,
                                 int32_t bos, bool reuse_on) {
  const RequestFingerprints f = FingerprintRequest(
      id.fingerprint, segs, bos,
      {.block_size = id.block_size, .encoding = id.encoding, .segments = reuse_on});
  std::vector<IndexEntry> out;
  for (const Hash128& h : f.prefix_blocks) out.push_back({h, id.block_size, true});
  for (size_t i = 0; i < segs.size(); ++i) {
    if (f.segments[i]) out.push_back({*f.segments[i], static_cast<int>(segs[i].tokens.size())});
  }
  return out;
}

void ExpectSameEntries(const std::vector<IndexEntry>& got, const std::vector<IndexEntry>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].fp, want[i].fp) << i;
    EXPECT_EQ(got[i].num_tokens, want[i].num_tokens) << i;
    EXPECT_EQ(got[i].block, want[i].block) << i;
  }
}

TEST_F(PrepareTest, FingerprintsEqualFingerprintRequestsWhenTheIdentityIsKnown) {
  const ServedIdentity id = Known(/*block_size=*/4);
  const Tokenizer& tok = *model_->tokenizer;
  v1::GenerateRequest req;
  req.add_segments()->set_text(Numbers(0, 40));
  req.add_segments()->set_text(Numbers(40, 55));
  v1::Segment* private_seg = req.add_segments();
  private_seg->set_text(Numbers(55, 60));
  private_seg->set_cacheable(false);
  std::vector<PromptSegment> segs;
  for (const v1::Segment& s : req.segments()) {
    segs.push_back({tok.Encode(s.text(), false), !s.has_cacheable() || s.cacheable()});
  }

  auto p = Prep(req, id);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::vector<IndexEntry> want = Expected(id, segs, tok.bos_id(), true);
  ExpectSameEntries(p->fps, want);
  int blocks = 0, seg_entries = 0;
  for (const IndexEntry& e : p->fps) (e.block ? blocks : seg_entries)++;
  EXPECT_GT(blocks, 0);
  EXPECT_EQ(seg_entries, 2);  // the uncacheable segment has none

  // Without BOS the hashes differ, and match FingerprintRequest without BOS.
  req.set_add_bos(false);
  auto nb = Prep(req, id);
  ASSERT_TRUE(nb.ok()) << nb.status();
  ExpectSameEntries(nb->fps, Expected(id, segs, -1, true));
  EXPECT_NE(nb->fps.front().fp, p->fps.front().fp);

  // Reuse off: no segment fingerprints, the exact-prefix blocks remain.
  req.set_add_bos(true);
  req.mutable_reuse()->set_enable(false);
  auto off = Prep(req, id);
  ASSERT_TRUE(off.ok()) << off.status();
  ExpectSameEntries(off->fps, Expected(id, segs, tok.bos_id(), false));
  for (const IndexEntry& e : off->fps) EXPECT_TRUE(e.block);

  // The identity's block size and encoding are what it hashes with.
  req.clear_reuse();
  const ServedIdentity other_id = Known(/*block_size=*/8, "rope_delta");
  auto other = Prep(req, other_id);
  ASSERT_TRUE(other.ok());
  ExpectSameEntries(other->fps, Expected(other_id, segs, tok.bos_id(), true));
  EXPECT_NE(other->fps.back().fp, p->fps.back().fp);  // a segment, hashed with the encoding
}

TEST_F(PrepareTest, PlainPromptFingerprintsFollowTheChunks) {
  const ServedIdentity id = Known(/*block_size=*/16);
  const ChunkingOptions chunking{.min_tokens = 8, .avg_tokens = 16, .max_tokens = 32};
  v1::GenerateRequest req;
  req.set_prompt(Numbers(100, 260));
  auto p = Prep(req, id, chunking);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::vector<int32_t> ids = model_->tokenizer->Encode(req.prompt(), false);
  ExpectSameEntries(p->fps, Expected(id, ChunkPrompt(ids, chunking),
                                     model_->tokenizer->bos_id(), true));
}

}  // namespace
}  // namespace sparsex::router
