// /v1/chat/completions with a chat template (router/openai_codec.h ChatFormat), on the synthetic
// "tiny" model (its tokenizer reads decimal numbers, so the test templates write their role
// headers as numbers): one segment per message's rendered span plus the generation prompt, the
// same segment fingerprints when a history is re-sent or a system prompt repeated (through
// PrepareRequest, as the router routes), BOS never doubled, unknown roles refused with 400,
// template errors, and the fallback for templates that are not prefix-stable.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "router/openai_codec.h"
#include "router/prepare.h"

namespace sparsex::router::openai {
namespace {

// Role headers 900 (system), 901 (user), 902 (assistant); 903 ends a turn; BOS is "7 ".
constexpr char kTemplate[] =
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}900 {% elif m.role == 'user' %}901 {% else %}902 {% endif %}"
    "{{ m.content | trim }} 903 {% endfor %}"
    "{% if add_generation_prompt %}902 {% endif %}";

class ChatFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = LoadModelInfo("synthetic:tiny");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    Use(kTemplate, "7 ");
  }
  void Use(const std::string& tmpl, const std::string& bos = "") {
    model_.chat_template = tmpl;
    model_.bos_token = bos;
    model_.eos_token = "8 ";
    format_ = MakeChatFormat(model_);
  }
  absl::StatusOr<Request> Chat(const std::string& body) {
    return ParseRequest(body, Endpoint::kChat, &format_);
  }
  // The segment fingerprints PrepareRequest computes for routing, in segment order.
  std::vector<Hash128> SegmentFps(const Request& r) {
    ServedIdentity id;
    id.known = true;
    id.fingerprint = Hash128{0x1234, 0x5678};
    id.encoding = "none";
    id.block_size = 4;
    auto p = PrepareRequest(r.req, model_, ChunkingOptions{}, id);
    EXPECT_TRUE(p.ok()) << p.status();
    std::vector<Hash128> out;
    if (!p.ok()) return out;
    for (const IndexEntry& e : p->fps) {
      if (!e.block) out.push_back(e.fp);
    }
    return out;
  }
  static std::vector<int32_t> Ids(const v1::Segment& s) {
    return {s.ids().ids().begin(), s.ids().ids().end()};
  }

  ModelInfo model_;
  ChatFormat format_;
};

TEST_F(ChatFormatTest, OneSegmentPerMessageSpanThenTheGenerationPrompt) {
  auto r = Chat(R"({"messages": [{"role": "system", "content": "10 11"},
                                  {"role": "user", "content": " 20 21 "},
                                  {"role": "assistant", "content": "30"},
                                  {"role": "user", "content": "40"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& q = r->req;
  ASSERT_EQ(q.segments_size(), 5);
  EXPECT_EQ(Ids(q.segments(0)), (std::vector<int32_t>{900, 10, 11, 903}));  // BOS "7" cut
  EXPECT_EQ(Ids(q.segments(1)), (std::vector<int32_t>{901, 20, 21, 903}));
  EXPECT_EQ(Ids(q.segments(2)), (std::vector<int32_t>{902, 30, 903}));
  EXPECT_EQ(Ids(q.segments(3)), (std::vector<int32_t>{901, 40, 903}));
  EXPECT_EQ(Ids(q.segments(4)), (std::vector<int32_t>{902}));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(q.segments(i).cacheable()) << i;
  EXPECT_FALSE(q.segments(4).cacheable());  // the generation prompt
  // The template's BOS is the shared sink (add_bos), not a token of the first segment.
  ASSERT_TRUE(q.has_add_bos());
  EXPECT_TRUE(q.add_bos());
  EXPECT_TRUE(q.prompt().empty());
  EXPECT_EQ(q.prompt_ids_size(), 0);
}

TEST_F(ChatFormatTest, ResentHistoryAndRepeatedSystemPromptKeepTheirFingerprints) {
  auto first = Chat(R"({"messages": [{"role": "system", "content": "10 11 12 13"},
                                      {"role": "user", "content": "20 21 22"}]})");
  auto next = Chat(R"({"messages": [{"role": "system", "content": "10 11 12 13"},
                                     {"role": "user", "content": "20 21 22"},
                                     {"role": "assistant", "content": "30 31"},
                                     {"role": "user", "content": "40 41"}]})");
  auto other = Chat(R"({"messages": [{"role": "system", "content": "10 11 12 13"},
                                      {"role": "user", "content": "50 51"}]})");
  ASSERT_TRUE(first.ok() && next.ok() && other.ok());
  const auto a = SegmentFps(*first), b = SegmentFps(*next), c = SegmentFps(*other);
  // Cacheable segments only: the messages' spans (the generation prompt is not fingerprinted).
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 4u);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(a[0], b[0]);  // the re-sent turns
  EXPECT_EQ(a[1], b[1]);
  EXPECT_EQ(a[0], c[0]);  // the same system prompt in another conversation
  EXPECT_NE(a[1], c[1]);
  EXPECT_NE(b[2], b[3]);
}

TEST_F(ChatFormatTest, NoBosUnlessTheTemplateWritesOneOrTheClientAsks) {
  Use("{% for m in messages %}901 {{ m.content }} 903 {% endfor %}902 ");  // ChatML-like
  auto r = Chat(R"({"messages": [{"role": "user", "content": "5"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->req.has_add_bos());
  EXPECT_FALSE(r->req.add_bos());
  auto asked = Chat(R"({"add_bos": true, "messages": [{"role": "user", "content": "5"}]})");
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_TRUE(asked->req.add_bos());
}

TEST_F(ChatFormatTest, UnknownRolesAre400NamingTheRole) {
  for (bool with_template : {true, false}) {
    SCOPED_TRACE(with_template);
    if (!with_template) Use("");
    auto r = Chat(R"({"messages": [{"role": "user", "content": "1"},
                                    {"role": "wizard", "content": "2"}]})");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ErrorParam(r.status()), "messages[1].role");
    EXPECT_NE(r.status().message().find("'wizard'"), std::string::npos) << r.status();
    // The known roles pass.
    auto ok = Chat(R"({"messages": [{"role": "developer", "content": "1"},
                                     {"role": "system", "content": "2"},
                                     {"role": "user", "content": "3"},
                                     {"role": "assistant", "content": "4"},
                                     {"role": "tool", "content": "5"}]})");
    EXPECT_TRUE(ok.ok()) << ok.status();
  }
  // Without any format (as before templates): plain segments, roles still checked.
  auto plain = ParseRequest(R"({"messages": [{"role": "wizard", "content": "2"}]})",
                            Endpoint::kChat);
  EXPECT_FALSE(plain.ok());
}

TEST_F(ChatFormatTest, TemplateErrorsAreClear) {
  // raise_exception in the template: 400 with its message.
  Use("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
      "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}");
  auto r = Chat(R"({"messages": [{"role": "system", "content": "1"}]})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("System role not supported"), std::string::npos);
  // A model template this renderer cannot parse: chat refused (501), never served without it.
  Use("{% macro m() %}{% endmacro %}");
  EXPECT_FALSE(format_.template_error.ok());
  auto u = Chat(R"({"messages": [{"role": "user", "content": "1"}]})");
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(u.status().message().find("macro"), std::string::npos) << u.status();
}

TEST_F(ChatFormatTest, NotPrefixStableTemplatesGiveOnePlainPrompt) {
  // The system prompt goes into the last user turn (as Mistral v0.3): earlier renderings are
  // not prefixes of later ones, so the rendering is one prompt (chunked by the router).
  Use("{{ bos_token }}{% for m in messages if m.role != 'system' %}"
      "{% if loop.last and messages[0].role == 'system' %}900 {{ messages[0].content }} {% endif %}"
      "901 {{ m.content }} 903 {% endfor %}",
      "7 ");
  auto r = Chat(R"({"messages": [{"role": "system", "content": "10"},
                                  {"role": "user", "content": "20"},
                                  {"role": "assistant", "content": "30"},
                                  {"role": "user", "content": "40"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->req.segments_size(), 0);
  EXPECT_EQ(std::vector<int32_t>(r->req.prompt_ids().begin(), r->req.prompt_ids().end()),
            (std::vector<int32_t>{901, 20, 903, 901, 30, 903, 900, 10, 901, 40, 903}));
  EXPECT_TRUE(r->req.add_bos());
}

}  // namespace
}  // namespace sparsex::router::openai
