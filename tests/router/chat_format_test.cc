// /v1/chat/completions with a chat template (router/openai_codec.h ChatFormat), on the synthetic
// "tiny" model (its tokenizer reads decimal numbers, so the test templates write their role
// headers as numbers): one segment per message's rendered span plus the generation prompt, the
// same segment fingerprints when a history is re-sent or a system prompt repeated (through
// PrepareRequest, as the router routes), BOS never doubled, unknown roles refused with 400,
// template errors, and the fallback for templates that are not prefix-stable. Then through the
// HTTP front end, with a Hugging Face directory whose tokenizer_config.json carries a Llama-3
// template and whose tokenizer has the header tokens as special tokens.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/etcd/http_client.h"
#include "gtest/gtest.h"
#include "router/frontends.h"
#include "router/openai_codec.h"
#include "router/prepare.h"
#include "router/router.h"
#include "tests/model/byte_alphabet.h"

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
  Use("{% include 'other.jinja' %}");
  EXPECT_FALSE(format_.template_error.ok());
  auto u = Chat(R"({"messages": [{"role": "user", "content": "1"}]})");
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(u.status().message().find("include"), std::string::npos) << u.status();
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

// ---- A byte-level BPE model directory with a Llama-3 chat template, served over HTTP.

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kBos = 256, kStartHeader = 257, kEndHeader = 258, kEot = 259;

void WriteLlama3Dir(const fs::path& dir, const std::string& chat_template) {
  fs::create_directories(dir);
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[sparsex::testing::Gpt2ByteChar(b)] = b;
  json added = json::array();
  int id = kBos;
  for (const char* t : {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"}) {
    added.push_back({{"id", id++}, {"content", t}, {"special", true}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false}});
  }
  const json tok = {
      {"version", "1.0"}, {"added_tokens", added}, {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false},
                         {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()},
                 {"byte_fallback", false}, {"ignore_merges", false}}}};
  const json config = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
                       {"hidden_size", 16}, {"intermediate_size", 24},
                       {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                       {"num_key_value_heads", 2}, {"vocab_size", 264},
                       {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5},
                       {"rope_theta", 500000.0}};
  json tc = {{"bos_token", "<|begin_of_text|>"}, {"eos_token", "<|eot_id|>"}};
  if (!chat_template.empty()) tc["chat_template"] = chat_template;
  std::ofstream(dir / "tokenizer.json") << tok.dump();
  std::ofstream(dir / "config.json") << config.dump();
  std::ofstream(dir / "tokenizer_config.json") << tc.dump();
}

constexpr char kLlama3[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}";

TEST(ChatFormatModelTest, Llama3TemplateFromTokenizerConfig) {
  const fs::path dir = fs::temp_directory_path() / ("chat_fmt_" + std::to_string(::getpid()));
  WriteLlama3Dir(dir, kLlama3);
  auto model = LoadModelInfo(dir.string());
  ASSERT_TRUE(model.ok()) << model.status();
  const ChatFormat f = MakeChatFormat(*model);
  ASSERT_NE(f.tmpl, nullptr) << f.template_error;
  auto r = ParseRequest(R"({"messages": [{"role": "system", "content": "Hi"},
                                          {"role": "user", "content": "ok"}]})",
                        Endpoint::kChat, &f);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->warning, "");  // rendered through the model's template: nothing to warn about
  ASSERT_EQ(r->req.segments_size(), 3);
  const auto ids = [&](int i) {
    return std::vector<int32_t>(r->req.segments(i).ids().ids().begin(),
                                r->req.segments(i).ids().ids().end());
  };
  // The special tokens are their ids; the template's BOS is add_bos, not a token of segment 0.
  EXPECT_EQ(ids(0), (std::vector<int32_t>{kStartHeader, 's', 'y', 's', 't', 'e', 'm', kEndHeader,
                                          '\n', '\n', 'H', 'i', kEot}));
  EXPECT_EQ(ids(1), (std::vector<int32_t>{kStartHeader, 'u', 's', 'e', 'r', kEndHeader, '\n',
                                          '\n', 'o', 'k', kEot}));
  EXPECT_EQ(ids(2), (std::vector<int32_t>{kStartHeader, 'a', 's', 's', 'i', 's', 't', 'a', 'n',
                                          't', kEndHeader, '\n', '\n'}));
  EXPECT_TRUE(r->req.add_bos());
  EXPECT_EQ(model->tokenizer->bos_id(), kBos);
  fs::remove_all(dir);
}

struct HttpReply {
  int status = 0;
  json body;
};

HttpReply PostJson(int port, const std::string& path, const std::string& body) {
  HttpReply r;
  auto resp = http::HttpRequest("127.0.0.1:" + std::to_string(port), "POST", path, body,
                                {.timeout_ms = 30000});
  if (!resp.ok()) return r;
  r.status = resp->status;
  r.body = json::parse(resp->body, nullptr, false);
  return r;
}

// The router and its HTTP front end over a model directory; no worker is healthy, so a request
// that passes the codec ends in 503, one it refuses ends in 400/501.
class ChatHttpTest : public ::testing::Test {
 protected:
  void Serve(const std::string& chat_template) {
    dir_ = fs::temp_directory_path() / ("chat_http_" + std::to_string(::getpid()));
    WriteLlama3Dir(dir_, chat_template);
    RouterOptions o;
    o.insecure_loopback = true;  // a loopback test cluster
    o.model_path = dir_.string();
    o.model_name = "llama3-chat";
    o.workers = {"127.0.0.1:1"};  // nothing listens there
    auto r = Router::Create(o);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
    auto h = HttpFrontend::Start(router_.get(), "127.0.0.1:0", 2);
    ASSERT_TRUE(h.ok()) << h.status();
    http_ = std::move(*h);
  }
  void TearDown() override {
    http_.reset();
    router_.reset();
    fs::remove_all(dir_);
  }
  HttpReply Chat(const std::string& messages) {
    return PostJson(http_->port(), "/v1/chat/completions",
                    R"({"max_tokens": 2, "messages": )" + messages + "}");
  }
  fs::path dir_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<HttpFrontend> http_;
};

TEST_F(ChatHttpTest, RolesAndTemplateErrorsOverHttp) {
  Serve(std::string(kLlama3) +
        "{% if messages[-1].role == 'assistant' %}{{ raise_exception('end with a user turn') }}"
        "{% endif %}");
  HttpReply ok = Chat(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(ok.status, 503) << ok.body.dump();  // rendered and prepared; no worker to serve it
  HttpReply wizard = Chat(R"([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}])");
  EXPECT_EQ(wizard.status, 400) << wizard.body.dump();
  EXPECT_EQ(wizard.body["error"]["param"], "messages[1].role") << wizard.body.dump();
  EXPECT_NE(wizard.body["error"]["message"].get<std::string>().find("'wizard'"),
            std::string::npos);
  HttpReply raised = Chat(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}])");
  EXPECT_EQ(raised.status, 400) << raised.body.dump();
  EXPECT_NE(raised.body.dump().find("end with a user turn"), std::string::npos) << raised.body.dump();
}

TEST_F(ChatHttpTest, AnUnparsableTemplateRefusesChatOnly) {
  Serve("{% include 'other.jinja' %}");
  HttpReply chat = Chat(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(chat.status, 501) << chat.body.dump();
  EXPECT_NE(chat.body.dump().find("include"), std::string::npos) << chat.body.dump();
  HttpReply completion = PostJson(http_->port(), "/v1/completions",
                                  R"({"prompt": "hi", "max_tokens": 2})");
  EXPECT_EQ(completion.status, 503) << completion.body.dump();  // served as before
}

}  // namespace
}  // namespace sparsex::router::openai
