// Chat templates (model/chat_template.h): the model families' templates and a constructs
// template (tests/model/chat_templates/) rendered on several conversations and compared byte for
// byte with Python's jinja2 in transformers' environment (render_jinja2.py, Debian
// python3-jinja2); errors (raise_exception, unknown filter/tag, limits) as clear statuses; the
// per-message spans of RenderChatSpans.
#include "model/chat_template.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "testing/models_dir.h"

namespace sparsex {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

const fs::path kDir = fs::path(__FILE__).parent_path() / "chat_templates";

std::string ReadFile(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::shared_ptr<const ChatTemplate> Load(const std::string& file) {
  auto t = ChatTemplate::Parse(ReadFile(kDir / file));
  EXPECT_TRUE(t.ok()) << file << ": " << t.status();
  return t.ok() ? *t : nullptr;
}

absl::StatusOr<std::string> RenderSource(const std::string& src, const json& ctx,
                                         const ChatTemplateLimits& lim = {}) {
  ASSIGN_OR_RETURN(auto t, ChatTemplate::Parse(src, lim));
  return t->RenderJson(ctx.dump());
}

// Runs the reference renderer on `cases` ([{template, context}]); fails the test when Python's
// jinja2 is missing (scripts/setup.sh installs python3-jinja2).
json RunJinja2(const json& cases) {
  const fs::path in = fs::temp_directory_path() /
                      ("chat_template_cases_" + std::to_string(::getpid()) + ".json");
  std::ofstream(in) << cases.dump();
  const std::string cmd = "/usr/bin/python3 " + (kDir / "render_jinja2.py").string() + " " +
                          in.string() + " 2>&1";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  fs::remove(in);
  json j = json::parse(out, nullptr, false);
  if (j.is_discarded() || !j.is_array()) {
    ADD_FAILURE() << "render_jinja2.py failed (apt-get install python3-jinja2):\n" << out;
    return json::array();
  }
  return j;
}

std::string FirstDifference(const std::string& a, const std::string& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return "first difference at byte " + std::to_string(k) + ": ours '" + a.substr(k, 40) +
         "' vs jinja2 '" + b.substr(k, 40) + "'";
}

TEST(ChatTemplateTest, MatchesJinja2ByteForByte) {
  const json manifest = json::parse(ReadFile(kDir / "cases.json"));
  json cases = json::array();
  std::vector<std::string> names;
  for (const json& t : manifest["templates"]) {
    const std::string src = ReadFile(kDir / t["file"].get<std::string>());
    for (const json& c : manifest["conversations"]) {
      json ctx = c;
      ctx.erase("name");
      ctx["bos_token"] = t["bos_token"];
      ctx["eos_token"] = t["eos_token"];
      cases.push_back({{"template", src}, {"context", ctx}});
      names.push_back(t["file"].get<std::string>() + " x " + c["name"].get<std::string>());
    }
  }
  const json want = RunJinja2(cases);
  ASSERT_EQ(want.size(), cases.size());
  int rendered = 0, failed = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(names[k]);
    absl::StatusOr<std::string> got = RenderSource(cases[k]["template"].get<std::string>(),
                                                   cases[k]["context"]);
    if (want[k]["ok"].get<bool>()) {
      ASSERT_TRUE(got.ok()) << got.status();
      const std::string w = want[k]["text"].get<std::string>();
      EXPECT_EQ(*got, w) << FirstDifference(*got, w);
      ++rendered;
    } else {
      const std::string err = want[k]["error"].get<std::string>();
      EXPECT_FALSE(got.ok()) << "jinja2 failed with " << err << " but we rendered:\n" << *got;
      if (!got.ok() && err.rfind("TemplateError: ", 0) == 0) {  // raise_exception: same text
        EXPECT_NE(got.status().message().find(err.substr(15)), std::string::npos)
            << got.status() << " vs " << err;
      }
      ++failed;
    }
  }
  // The matrix exercises both outcomes (the alternation checks refuse some conversations).
  EXPECT_GT(rendered, 40);
  EXPECT_GT(failed, 3);
}

TEST(ChatTemplateTest, WhitespaceControlMatchesJinja2) {
  // Small sources for the lexer's corners: trim_blocks, lstrip_blocks, -/+ markers, comments,
  // CRLF, a trailing newline, tags at the start of the template.
  const std::vector<std::string> srcs = {
      "a\n  {% if true %}\n  b\n  {% endif %}\nc\n",
      "  {% if true %}x{% endif %}  \n",
      "{% for i in [1,2] %}\n  {{ i }}\n{% endfor %}\n",
      "x {%- if true -%} y {%- endif -%} z",
      "x {%+ if true %} y {% endif +%}\nz",
      "a\r\nb {# c #}\n  {# d #}\ne\n\n",
      "{{- ' a ' -}}  \n  {{ 'b' }}\n",
      "line\n\t {%- set x = 1 %}\n{{ x }}",
      "{% if true %}{% endif %}\n\n",
      "  {{ 'v' }}  {% if true %}  {% endif %}",
      "{{ {'a': {'b': 1}} }}",
      "{{ '%}' }}{{ \"}}\" }}",
  };
  json cases = json::array();
  for (const auto& s : srcs) cases.push_back({{"template", s}, {"context", json::object()}});
  const json want = RunJinja2(cases);
  ASSERT_EQ(want.size(), cases.size());
  for (size_t k = 0; k < srcs.size(); ++k) {
    SCOPED_TRACE(json(srcs[k]).dump());
    auto got = RenderSource(srcs[k], json::object());
    ASSERT_EQ(got.ok(), want[k]["ok"].get<bool>()) << got.status() << " " << want[k].dump();
    if (got.ok()) {
      EXPECT_EQ(json(*got).dump(), want[k]["text"].dump());
    }
  }
}

// The string value of `key` in a GGUF file's metadata (type 8: u64 length, bytes), found by
// its key bytes; "" when absent. Enough for the vocabulary-only files of llama.cpp's tests.
std::string GgufString(const std::string& bytes, const std::string& key) {
  const size_t k = bytes.find(key);
  if (k == std::string::npos || k + key.size() + 12 > bytes.size()) return "";
  const size_t p = k + key.size();
  uint32_t type;
  uint64_t n;
  std::memcpy(&type, bytes.data() + p, 4);
  std::memcpy(&n, bytes.data() + p + 4, 8);
  if (type != 8 || n > bytes.size() - p - 12) return "";
  return bytes.substr(p + 12, n);
}

TEST(ChatTemplateTest, PublishedPhi3TemplateFromAGguf) {
  // llama.cpp's Phi-3 vocabulary GGUF carries the template as Microsoft published it.
  const fs::path gguf =
      fs::path(sparsex::testing::ModelsDir()) / "tokenizer-vectors" / "ggml-vocab-phi-3.gguf";
  ASSERT_TRUE(fs::exists(gguf)) << gguf << " is missing; set $SPARSEX_MODELS";
  const std::string src = GgufString(ReadFile(gguf), "tokenizer.chat_template");
  ASSERT_FALSE(src.empty());
  auto t = ChatTemplate::Parse(src);
  ASSERT_TRUE(t.ok()) << t.status();
  const json manifest = json::parse(ReadFile(kDir / "cases.json"));
  json cases = json::array();
  for (const json& c : manifest["conversations"]) {
    json ctx = c;
    ctx.erase("name");
    ctx["bos_token"] = "<s>";
    ctx["eos_token"] = "<|endoftext|>";
    cases.push_back({{"template", src}, {"context", ctx}});
  }
  const json want = RunJinja2(cases);
  ASSERT_EQ(want.size(), cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    auto got = (*t)->RenderJson(cases[k]["context"].dump());
    ASSERT_EQ(got.ok(), want[k]["ok"].get<bool>()) << k << " " << got.status();
    if (got.ok()) {
      EXPECT_EQ(*got, want[k]["text"].get<std::string>()) << k;
    }
  }
  // Per-message spans: the user turn carries the assistant header that follows it.
  const std::vector<ChatMessage> msgs = {{"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}};
  auto s = RenderChatSpans(**t, msgs, {.add_generation_prompt = true, .bos_token = "<s>",
                                       .eos_token = "<|endoftext|>"});
  ASSERT_TRUE(s.ok() && s->per_message) << (s.ok() ? s->fallback_reason : s.status().ToString());
  EXPECT_EQ(s->spans[0], "<s><|user|>\nHi<|end|>\n<|assistant|>\n");
  EXPECT_EQ(s->spans[1], "Hello.<|end|>\n");
  EXPECT_EQ(s->spans[2], "<|user|>\nBye<|end|>\n<|assistant|>\n");
  EXPECT_EQ(s->suffix, "");
}

TEST(ChatTemplateTest, RenderTakesMessagesAndVariables) {
  auto t = Load("llama3.jinja");
  ASSERT_NE(t, nullptr);
  const std::vector<ChatMessage> msgs = {{"system", "Be brief."}, {"user", " Hi "}};
  auto r = t->Render(msgs, {.add_generation_prompt = true, .bos_token = "<|begin_of_text|>",
                            .eos_token = "<|eot_id|>"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, RaiseExceptionIsAClearError) {
  auto t = Load("gemma.jinja");
  ASSERT_NE(t, nullptr);
  const std::vector<ChatMessage> msgs = {{"system", "x"}, {"user", "y"}};
  auto r = t->Render(msgs, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "chat template: System role not supported");
}

void ExpectError(const std::string& src, const std::string& fragment,
                 const ChatTemplateLimits& lim = {}, const json& ctx = json::object()) {
  auto r = RenderSource(src, ctx, lim);
  ASSERT_FALSE(r.ok()) << "rendered: " << *r;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find(fragment), std::string::npos)
      << "'" << fragment << "' not in: " << r.status();
}

TEST(ChatTemplateTest, ErrorsNameTheProblem) {
  ExpectError("a\n{{ x | frobnicate }}", "unknown filter 'frobnicate' (line 2)");
  ExpectError("{{ x is frob }}", "unknown test 'frob'");
  ExpectError("{% include 'other.jinja' %}", "unsupported template tag 'include'");
  ExpectError("{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}",
              "macro 'm' takes not more than 1 argument(s)");
  ExpectError("{% macro m(a) %}{{ a }}{% endmacro %}{{ m(b=2) }}", "no keyword argument 'b'");
  ExpectError("{% if true %}x", "missing '{% endif %}'");
  ExpectError("{{ 'a' ", "unclosed '{{'");
  ExpectError("{# never closed", "unclosed comment");
  ExpectError("{{ 'abc }}", "unterminated string");
  ExpectError("{{ x.y }}", "'x' is undefined");
  ExpectError("{{ messages[0]['role'] }}", "list index 0 out of range (line 1)", {},
              {{"messages", json::array()}});
  ExpectError("{{ m.a.b }}", "'dict object' has no attribute 'a'", {}, {{"m", json::object()}});
  ExpectError("{{ 1 + 'a' }}", "unsupported operand types for +: 'int' and 'str'");
  ExpectError("{{ 1 / 0 }}", "division by zero");
  ExpectError("{{ 'a' < 1 }}", "'<' not supported");
  ExpectError("{% set x = 1 %}{% set x.y = 2 %}", "is not a namespace()");
  ExpectError("{% break %}", "'break' outside a loop");
  ExpectError("{{ 9223372036854775807 + 1 }}", "integer overflow");
  ExpectError("{{ none() }}", "'NoneType' object is not callable");
  ExpectError("{{ [1][::0] }}", "slice step cannot be zero");
}

TEST(ChatTemplateTest, LimitsAreErrorsNotCrashes) {
  ChatTemplateLimits lim;
  lim.max_depth = 32;
  // Expression depth: parentheses, a long operator chain, nested literals, unary chains.
  ExpectError("{{ " + std::string(100, '(') + "1" + std::string(100, ')') + " }}",
              "nested deeper than 32", lim);
  std::string chain = "{{ 1";
  for (int k = 0; k < 100; ++k) chain += " + 1";
  ExpectError(chain + " }}", "nested deeper than 32", lim);
  ExpectError("{{ " + std::string(100, '[') + std::string(100, ']') + " }}",
              "nested deeper than 32", lim);
  ExpectError("{{ " + std::string(100, '-') + "1 }}", "nested deeper than 32", lim);
  std::string ifs;
  for (int k = 0; k < 100; ++k) ifs += "{% if true %}";
  for (int k = 0; k < 100; ++k) ifs += "{% endif %}";
  ExpectError(ifs, "blocks nested deeper than 32", lim);
  // The default limit still stops a template far deeper than any real one.
  ExpectError("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}",
              "nested deeper than 64");
  // Loop iterations, output size, string growth, the source size.
  ExpectError("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "macro calls nested deeper than 16");
  lim = ChatTemplateLimits{};
  lim.max_iterations = 1000;
  ExpectError("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
              "more than 1000 loop iterations", lim);
  ExpectError("{% for i in range(100000) %}{% endfor %}", "range of more than 1000 items", lim);
  lim = ChatTemplateLimits{};
  lim.max_output_bytes = 1000;
  ExpectError("{% for i in range(600) %}ab{% endfor %}", "output exceeds the limit of 1000", lim);
  ExpectError("{{ 'x' * 100000000000 }}", "exceeds the output limit", lim);
  ExpectError("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
              "{% set ns.s = ns.s + ns.s %}{% endfor %}",
              "exceeds the output limit", lim);
  // Values nested without end, and a namespace holding itself.
  ExpectError("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}"
              "{% endfor %}",
              "nested deeper than 256");
  auto cyc = RenderSource("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns.me.me is defined }}",
                          json::object());
  ASSERT_TRUE(cyc.ok()) << cyc.status();
  EXPECT_EQ(*cyc, "True");
  ExpectError("{% set ns = namespace() %}{% set ns.me = [ns] %}{{ ns | tojson }}",
              "Namespace is not JSON serializable");
  lim = ChatTemplateLimits{};
  lim.max_source_bytes = 10;
  auto big = ChatTemplate::Parse(std::string(11, 'x'), lim);
  EXPECT_FALSE(big.ok());
}

TEST(ChatTemplateTest, EveryPrefixOfARealTemplateParsesOrFailsCleanly) {
  // Truncated templates (a cut download, a bad GGUF string) never crash the parser.
  const std::string src = ReadFile(kDir / "llama31.jinja");
  int ok = 0;
  for (size_t n = 0; n <= src.size(); n += 7) {
    auto t = ChatTemplate::Parse(src.substr(0, n));
    if (t.ok()) {
      ++ok;
      (void)(*t)->Render(std::vector<ChatMessage>{{"user", "hi"}}, {});
    }
  }
  EXPECT_GT(ok, 0);
}

TEST(ChatTemplateTest, RandomTokenSoupNeverCrashes) {
  // Templates assembled from random pieces of the syntax: every one parses and renders, or
  // fails with a status; none crashes, hangs or throws.
  const std::vector<std::string> pieces = {
      "{{", "}}", "{%", "%}", "{%-", "-%}", "{#", "#}", " if ", " for ", " in ", " else ",
      " endif ", " endfor ", " set ", " = ", "x", "messages", "m", ".role", "[0]", "[1:]", "[::-1]",
      "(", ")", "[", "]", "{", "}", ",", ":", " | trim", " | tojson", " | length", " is defined",
      " is not none", " not ", " and ", " or ", " + ", " - ", " * ", " // ", " % ", " ~ ", " == ",
      "'s'", "\"t\"", "1", "0", "-1", "none", "true", "loop.index", "ns.a", "namespace(a=1)",
      "range(3)", "raise_exception('r')", ".strip()", ".split(',')", "\n", "  ", "text",
      " macro ", " endmacro ", "f", "f(x)", "f()", "f(1, x=2)"};
  std::mt19937 rng(1234);
  int ok = 0;
  for (int k = 0; k < 3000; ++k) {
    std::string src;
    const int n = 1 + static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) src += pieces[rng() % pieces.size()];
    auto t = ChatTemplate::Parse(src);
    if (!t.ok()) continue;
    auto r = (*t)->Render(std::vector<ChatMessage>{{"user", "a,b"}, {"assistant", "c"}},
                          {.add_generation_prompt = true, .bos_token = "<s>", .eos_token = "</s>"});
    ok += r.ok();
  }
  EXPECT_GT(ok, 100);
}

std::string Join(const ChatSpans& s) {
  std::string all;
  for (const auto& x : s.spans) all += x;
  return all + s.suffix;
}

TEST(ChatTemplateTest, SpansOnePerMessage) {
  const std::vector<ChatMessage> msgs = {
      {"system", "You are terse."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}};
  const ChatTemplateVars vars{.add_generation_prompt = true, .bos_token = "<s>",
                              .eos_token = "</s>"};
  for (const char* file : {"llama3.jinja", "llama31.jinja", "qwen25.jinja", "chatml.jinja",
                           "phi3.jinja"}) {
    SCOPED_TRACE(file);
    auto t = Load(file);
    ASSERT_NE(t, nullptr);
    auto s = RenderChatSpans(*t, msgs, vars);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(s->per_message) << s->fallback_reason;
    ASSERT_EQ(s->spans.size(), msgs.size());
    EXPECT_EQ(Join(*s), s->text);
    for (size_t i = 1; i < msgs.size(); ++i) {
      EXPECT_NE(s->spans[i].find(msgs[i].content), std::string::npos) << i << ": " << s->spans[i];
    }
    EXPECT_FALSE(s->suffix.empty());  // the generation prompt
    // A longer conversation repeats the earlier spans exactly (what segment reuse needs).
    std::vector<ChatMessage> more = msgs;
    more.push_back({"assistant", "Ciao."});
    more.push_back({"user", "Again"});
    auto s2 = RenderChatSpans(*t, more, vars);
    ASSERT_TRUE(s2.ok() && s2->per_message);
    for (size_t i = 0; i < msgs.size(); ++i) EXPECT_EQ(s2->spans[i], s->spans[i]) << i;
  }
  // Phi-3 closes a conversation without a generation prompt with EOS: the spans exclude it.
  auto phi = Load("phi3.jinja");
  auto s = RenderChatSpans(*phi, msgs, vars);
  ASSERT_TRUE(s.ok() && s->per_message);
  EXPECT_EQ(s->spans[1], "<|user|>\nHi<|end|>\n");
  EXPECT_EQ(s->suffix, "<|assistant|>\n");
}

TEST(ChatTemplateTest, SpansOfVeryLongConversationsFallBack) {
  auto t = Load("chatml.jinja");
  ASSERT_NE(t, nullptr);
  ChatTemplateVars vars;
  vars.add_generation_prompt = true;
  std::vector<ChatMessage> msgs(257, ChatMessage{"user", "x"});
  auto s = RenderChatSpans(*t, msgs, vars);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->per_message);
  EXPECT_NE(s->fallback_reason.find("more than 256 messages"), std::string::npos);
  msgs.resize(256);
  s = RenderChatSpans(*t, msgs, vars);
  ASSERT_TRUE(s.ok() && s->per_message);
}

TEST(ChatTemplateTest, SpansFallBackWhenNotPrefixStable) {
  // Mistral v0.3 moves the system prompt into the last user turn: earlier renderings are not
  // prefixes of later ones, so the prompt is one span.
  auto t = Load("mistral_v3.jinja");
  ASSERT_NE(t, nullptr);
  const std::vector<ChatMessage> msgs = {
      {"system", "Sys"}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}};
  auto s = RenderChatSpans(*t, msgs, {.add_generation_prompt = true, .bos_token = "<s>",
                                      .eos_token = "</s>"});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->per_message);
  EXPECT_FALSE(s->fallback_reason.empty());
  EXPECT_EQ(s->text, "<s>[INST] Hi[/INST] Hello.</s>[INST] Sys\n\nBye[/INST]");
  // Qwen3 renders the assistant turn that ends a conversation with an (empty) <think> block,
  // which it drops once a user turn follows: not prefix-stable past the first assistant turn.
  auto q3 = Load("qwen3.jinja");
  ASSERT_NE(q3, nullptr);
  const std::vector<ChatMessage> turns = {{"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}};
  auto s3 = RenderChatSpans(*q3, turns, {.add_generation_prompt = true, .bos_token = "",
                                         .eos_token = "<|im_end|>"});
  ASSERT_TRUE(s3.ok()) << s3.status();
  EXPECT_FALSE(s3->per_message);
  const std::vector<ChatMessage> first_turn = {{"system", "Sys"}, {"user", "Hi"}};
  s3 = RenderChatSpans(*q3, first_turn, {.add_generation_prompt = true, .bos_token = "",
                                         .eos_token = "<|im_end|>"});
  ASSERT_TRUE(s3.ok() && s3->per_message);
  // A template error on the whole conversation is the error.
  auto g = Load("gemma.jinja");
  EXPECT_FALSE(RenderChatSpans(*g, msgs, {}).ok());
}

}  // namespace
}  // namespace sparsex
