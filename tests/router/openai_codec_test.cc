// The OpenAI JSON <-> proto mapping (router/openai_codec.h), without an HTTP server: completion
// and chat requests into v1::GenerateRequest (fields mapped, OpenAI defaults, stop strings,
// stream_options.include_usage), bad fields as INVALID_ARGUMENT naming the field (message and
// ErrorParam), body checks (UTF-8, depth, syntax), StopFilter, and the response JSON shapes.
#include "router/openai_codec.h"

#include <limits>
#include <string>
#include <tuple>

#include "gtest/gtest.h"

namespace sparsex::router::openai {
namespace {

using json = nlohmann::json;

absl::StatusOr<Request> Completion(const std::string& body) {
  return ParseRequest(body, Endpoint::kCompletions);
}
absl::StatusOr<Request> Chat(const std::string& body) {
  return ParseRequest(body, Endpoint::kChat);
}

// The request must fail with INVALID_ARGUMENT naming `param` (in ErrorParam and, quoted, in the
// message unless `quoted` is false).
void ExpectBadField(const absl::StatusOr<Request>& r, const std::string& param,
                    bool quoted = true) {
  ASSERT_FALSE(r.ok()) << "expected an error naming " << param;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(ErrorParam(r.status()), param) << r.status();
  if (quoted) {
    EXPECT_NE(r.status().message().find("'" + param + "'"), std::string::npos) << r.status();
  }
}

TEST(OpenAiCodecTest, CompletionFieldsAreMapped) {
  auto r = Completion(R"({
      "model": "tiny", "prompt": "1 2 3", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
      "top_k": 40, "seed": 18446744073709551615, "ignore_eos": true, "add_bos": false,
      "stream": true, "n": 1, "echo": false,
      "reuse": {"enable": true, "store_new_segments": false, "register_prefix": true,
                "full_layers": 2, "recompute_ratio": 0.25, "selector": "attention",
                "store_after_misses": 1}})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& q = r->req;
  EXPECT_EQ(q.model(), "tiny");
  EXPECT_EQ(q.prompt(), "1 2 3");
  EXPECT_EQ(q.prompt_ids_size(), 0);
  EXPECT_EQ(q.segments_size(), 0);
  EXPECT_EQ(q.sampling().max_tokens(), 7);
  EXPECT_FLOAT_EQ(q.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(q.sampling().top_p(), 0.9f);
  EXPECT_EQ(q.sampling().top_k(), 40);
  EXPECT_EQ(q.sampling().seed(), 18446744073709551615ull);
  EXPECT_TRUE(q.sampling().ignore_eos());
  ASSERT_TRUE(q.has_add_bos());
  EXPECT_FALSE(q.add_bos());
  EXPECT_TRUE(q.reuse().enable());
  EXPECT_FALSE(q.reuse().store_new_segments());
  EXPECT_TRUE(q.reuse().register_prefix());
  EXPECT_EQ(q.reuse().full_layers(), 2);
  EXPECT_FLOAT_EQ(q.reuse().recompute_ratio(), 0.25f);
  EXPECT_EQ(q.reuse().selector(), "attention");
  EXPECT_EQ(q.reuse().store_after_misses(), 1);
  EXPECT_TRUE(r->stream);
  EXPECT_FALSE(r->include_usage);
  EXPECT_TRUE(r->stop.empty());
}

TEST(OpenAiCodecTest, OpenAiDefaults) {
  auto r = Completion(R"({"prompt": "1"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FLOAT_EQ(r->req.sampling().temperature(), 1.0f);  // OpenAI's default
  EXPECT_FALSE(r->req.sampling().has_max_tokens());        // the worker's default applies
  EXPECT_FALSE(r->req.has_add_bos());
  EXPECT_FALSE(r->req.has_reuse());
  EXPECT_FALSE(r->stream);
  // null is absent.
  auto n = Completion(R"({"prompt": "1", "temperature": null, "max_tokens": null, "stop": null})");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_FLOAT_EQ(n->req.sampling().temperature(), 1.0f);
  EXPECT_FALSE(n->req.sampling().has_max_tokens());
}

TEST(OpenAiCodecTest, CompletionPromptForms) {
  auto ids = Completion(R"({"prompt": [5, 6, 7.0]})");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(std::vector<int32_t>(ids->req.prompt_ids().begin(), ids->req.prompt_ids().end()),
            (std::vector<int32_t>{5, 6, 7}));
  auto one_text = Completion(R"({"prompt": ["1 2"]})");
  ASSERT_TRUE(one_text.ok()) << one_text.status();
  EXPECT_EQ(one_text->req.prompt(), "1 2");
  auto one_ids = Completion(R"({"prompt": [[8, 9]]})");
  ASSERT_TRUE(one_ids.ok()) << one_ids.status();
  EXPECT_EQ(one_ids->req.prompt_ids_size(), 2);

  ExpectBadField(Completion(R"({"prompt": ["1", "2"]})"), "prompt", false);  // one prompt only
  ExpectBadField(Completion(R"({"prompt": ""})"), "prompt");
  ExpectBadField(Completion(R"({"prompt": []})"), "prompt");
  ExpectBadField(Completion(R"({"prompt": 5})"), "prompt");
  ExpectBadField(Completion(R"({"prompt": null})"), "prompt");
  ExpectBadField(Completion(R"({"max_tokens": 5})"), "prompt");  // required
}

TEST(OpenAiCodecTest, CompletionSegments) {
  auto r = Completion(R"({"segments": ["1 2", [3, 4], {"text": "5", "cacheable": false},
                                       {"text": "6"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& q = r->req;
  ASSERT_EQ(q.segments_size(), 4);
  EXPECT_EQ(q.segments(0).text(), "1 2");
  EXPECT_FALSE(q.segments(0).has_cacheable());
  ASSERT_TRUE(q.segments(1).has_ids());
  EXPECT_EQ(q.segments(1).ids().ids_size(), 2);
  EXPECT_EQ(q.segments(1).ids().ids(1), 4);
  EXPECT_EQ(q.segments(2).text(), "5");
  ASSERT_TRUE(q.segments(2).has_cacheable());
  EXPECT_FALSE(q.segments(2).cacheable());
  EXPECT_FALSE(q.segments(3).has_cacheable());
  EXPECT_TRUE(q.prompt().empty());

  // Never both: the client would get an answer to another prompt.
  auto both = Completion(R"({"segments": ["1"], "prompt": "2"})");
  ExpectBadField(both, "prompt");
  EXPECT_NE(both.status().message().find("not both"), std::string::npos);
  ExpectBadField(Completion(R"({"segments": "1 2"})"), "segments");
  ExpectBadField(Completion(R"({"segments": [5]})"), "segments");
  ExpectBadField(Completion(R"({"segments": [{"cacheable": true}]})"), "segments");
  ExpectBadField(Completion(R"({"segments": [[1, 4294967699]]})"), "segments[][]");
}

TEST(OpenAiCodecTest, ChatMessagesBecomeSegments) {
  auto r = Chat(R"({"model": "tiny", "messages": [
      {"role": "system", "content": "1 2"},
      {"role": "user", "content": [{"type": "text", "text": "3"}, {"type": "text", "text": " 4"}]},
      {"role": "assistant", "content": null},
      {"role": "user", "content": ""},
      {"role": "user"},
      {"role": "user", "content": "5"}],
      "max_completion_tokens": 9, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& q = r->req;
  ASSERT_EQ(q.segments_size(), 3);  // empty messages are skipped
  EXPECT_EQ(q.segments(0).text(), "1 2");
  EXPECT_EQ(q.segments(1).text(), "3 4");
  EXPECT_EQ(q.segments(2).text(), "5");
  EXPECT_EQ(q.sampling().max_tokens(), 9);
  EXPECT_EQ(q.model(), "tiny");
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  // No chat template: served with the contents as plain text, and the response says so.
  EXPECT_EQ(r->warning, kNoChatTemplateWarning);
  EXPECT_EQ(std::string(kNoChatTemplateWarning),
            "model has no chat template; messages joined as plain text");
  auto cmpl = Completion(R"({"prompt": "1"})");
  ASSERT_TRUE(cmpl.ok()) << cmpl.status();
  EXPECT_EQ(cmpl->warning, "");  // completions are never templated

  // max_tokens and max_completion_tokens that disagree are refused (neither silently wins);
  // a completion takes max_completion_tokens too.
  auto both = Chat(R"({"messages": [{"role": "user", "content": "1"}], "max_tokens": 3,
                       "max_completion_tokens": 9})");
  ExpectBadField(both, "max_completion_tokens");
  auto completion = Completion(R"({"prompt": "1", "max_completion_tokens": 9})");
  ASSERT_TRUE(completion.ok()) << completion.status();
  EXPECT_EQ(completion->req.sampling().max_tokens(), 9);
}

TEST(OpenAiCodecTest, BadChatMessages) {
  ExpectBadField(Chat(R"({"messages": []})"), "messages");
  ExpectBadField(Chat(R"({"messages": "hi"})"), "messages");
  ExpectBadField(Chat(R"({"model": "tiny"})"), "messages");
  ExpectBadField(Chat(R"({"messages": [{"content": "1"}]})"), "messages[]");
  ExpectBadField(Chat(R"({"messages": [{"role": 1, "content": "1"}]})"), "messages[]");
  ExpectBadField(Chat(R"({"messages": [{"role": "user", "content": 5}]})"), "messages[].content");
  ExpectBadField(Chat(R"({"messages": [{"role": "user",
                           "content": [{"type": "image_url", "image_url": "x"}]}]})"),
                 "messages[].content");
  ExpectBadField(Chat(R"({"messages": [{"role": "user", "content": [{"type": 5, "text": "1"}]}]})"),
                 "messages[].content");
  auto empty = Chat(R"({"messages": [{"role": "user", "content": ""}]})");
  ExpectBadField(empty, "messages", false);
  EXPECT_EQ(empty.status().message(), "every message is empty");
  ExpectBadField(Chat(R"({"messages": [{"role": "user", "content": "1"}],
                          "max_completion_tokens": 4294967297})"),
                 "max_completion_tokens");
}

TEST(OpenAiCodecTest, BadFieldsAreInvalidArgumentNamingTheField) {
  struct Case {
    const char* fields;
    const char* param;
    bool quoted = true;
  };
  const Case cases[] = {
      {R"("model": 5)", "model"},
      {R"("temperature": "hot")", "temperature"},
      {R"("top_p": true)", "top_p"},
      {R"("top_k": -1)", "top_k"},
      {R"("top_k": 4294967296)", "top_k"},
      {R"("top_k": 1.5)", "top_k"},
      {R"("seed": -1)", "seed"},
      {R"("seed": 18446744073709551616)", "seed"},
      {R"("max_tokens": 0)", "max_tokens"},
      {R"("max_tokens": 1048577)", "max_tokens"},
      {R"("max_tokens": "5")", "max_tokens"},
      {R"("ignore_eos": 1)", "ignore_eos"},
      {R"("n": 2)", "n", false},
      {R"("n": 1.5)", "n"},
      {R"("echo": true)", "echo", false},
      {R"("stream": "yes")", "stream"},
      {R"("stop": 5)", "stop"},
      {R"("stop": ["a", 5])", "stop"},
      {R"("add_bos": "no")", "add_bos"},
      {R"("reuse": true)", "reuse"},
      {R"("reuse": {"enable": 1})", "reuse.enable"},
      {R"("reuse": {"store_new_segments": null})", "reuse.store_new_segments"},
      {R"("reuse": {"register_prefix": "y"})", "reuse.register_prefix"},
      {R"("reuse": {"full_layers": 4294967297})", "reuse.full_layers"},
      {R"("reuse": {"full_layers": 0.5})", "reuse.full_layers"},
      {R"("reuse": {"recompute_ratio": "a"})", "reuse.recompute_ratio"},
      {R"("reuse": {"store_after_misses": 1.5})", "reuse.store_after_misses"},
      {R"("reuse": {"store_after_misses": "1"})", "reuse.store_after_misses"},
      {R"("reuse": {"selector": 1})", "reuse.selector"},
      {R"("prompt": [1, 4294967699])", "prompt[]"},  // 2^32 + 403 is not token 403
      {R"("prompt": [1, -4294967296])", "prompt[]"},
      {R"("prompt": [1, 2.5])", "prompt[]"},
      {R"("prompt": [1, "2"])", "prompt[]"},
      {R"("prompt": [1, 1e300])", "prompt[]"},
  };
  for (const Case& c : cases) {
    const std::string fields = c.fields;
    // The prompt cases carry their own prompt.
    const std::string body = fields.rfind(R"("prompt")", 0) == 0
                                 ? "{" + fields + "}"
                                 : R"({"prompt": "1", )" + fields + "}";
    SCOPED_TRACE(body);
    ExpectBadField(Completion(body), c.param, c.quoted);
  }
}

// OpenAI fields SparseX does not implement are refused naming the field, never ignored; at their
// neutral values they pass. max_completion_tokens works on both endpoints.
TEST(OpenAiCodecTest, UnimplementedOpenAiFieldsAreRefusedNotIgnored) {
  const std::pair<const char*, const char*> refused[] = {
      {R"("tools": [{"type": "function", "function": {"name": "f"}}])", "tools"},
      {R"("tool_choice": "auto")", "tool_choice"},
      {R"("functions": [{"name": "f"}])", "functions"},
      {R"("function_call": "auto")", "function_call"},
      {R"("response_format": {"type": "json_object"})", "response_format"},
      {R"("response_format": "text")", "response_format"},
      {R"("suffix": "end")", "suffix"},
      {R"("best_of": 3)", "best_of"},
      {R"("logit_bias": {"x": -100})", "logit_bias"},
      {R"("logit_bias": {"5": 101})", "logit_bias"},
      {R"("logit_bias": [1])", "logit_bias"},
      {R"("frequency_penalty": 7)", "frequency_penalty"},
      {R"("presence_penalty": "x")", "presence_penalty"},
      {R"("modalities": ["text", "audio"])", "modalities"},
      {R"("audio": {"voice": "x"})", "audio"},
      {R"("user": 5)", "user"},
      {R"("max_tokens": 4, "max_completion_tokens": 5)", "max_completion_tokens"},
  };
  for (const auto& [fields, param] : refused) {
    for (bool chat : {false, true}) {
      const std::string body =
          chat ? R"({"messages": [{"role": "user", "content": "hi"}], )" + std::string(fields) + "}"
               : R"({"prompt": "1", )" + std::string(fields) + "}";
      SCOPED_TRACE(body);
      ExpectBadField(chat ? Chat(body) : Completion(body), param);
    }
  }
  // Neutral values are accepted.
  auto ok = Completion(R"({"prompt": "1", "tools": [], "tool_choice": "none", "logprobs": null,
      "top_logprobs": 0, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
      "response_format": {"type": "text"}, "best_of": 1, "suffix": "", "user": "u-1",
      "modalities": ["text"], "some_vendor_extension": {"x": 1}})");
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto pen = Completion(R"({"prompt": "1", "logit_bias": {"5": -100, "7": 2.5},
      "presence_penalty": 0.5, "frequency_penalty": -1})");
  ASSERT_TRUE(pen.ok()) << pen.status();
  EXPECT_EQ(pen->req.sampling().logit_bias().at(5), -100.0f);
  EXPECT_EQ(pen->req.sampling().logit_bias().at(7), 2.5f);
  EXPECT_EQ(pen->req.sampling().presence_penalty(), 0.5f);
  EXPECT_EQ(pen->req.sampling().frequency_penalty(), -1.0f);
  auto c = Completion(R"({"prompt": "1", "max_completion_tokens": 7})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->req.sampling().max_tokens(), 7);
  auto both = Chat(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
      "max_completion_tokens": 9})");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->req.sampling().max_tokens(), 9);
}

// logprobs: /v1/completions takes an integer in [0, 5] (legacy), chat a boolean plus
// top_logprobs in [0, 20]; both map onto GenerateRequest.logprobs / top_logprobs.
TEST(OpenAiCodecTest, LogprobsFields) {
  auto c = Completion(R"({"prompt": "1", "logprobs": 3})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->req.logprobs());
  EXPECT_EQ(c->req.top_logprobs(), 3);
  auto c0 = Completion(R"({"prompt": "1", "logprobs": 0})");
  ASSERT_TRUE(c0.ok()) << c0.status();
  EXPECT_TRUE(c0->req.logprobs());
  EXPECT_EQ(c0->req.top_logprobs(), 0);
  auto off = Completion(R"({"prompt": "1", "logprobs": null})");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->req.logprobs());
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  auto h = Chat("{" + msgs + R"(, "logprobs": true, "top_logprobs": 20})");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->req.logprobs());
  EXPECT_EQ(h->req.top_logprobs(), 20);
  auto h0 = Chat("{" + msgs + R"(, "logprobs": true})");
  ASSERT_TRUE(h0.ok()) << h0.status();
  EXPECT_TRUE(h0->req.logprobs());
  EXPECT_EQ(h0->req.top_logprobs(), 0);
  auto hoff = Chat("{" + msgs + R"(, "logprobs": false, "top_logprobs": 0})");
  ASSERT_TRUE(hoff.ok()) << hoff.status();
  EXPECT_FALSE(hoff->req.logprobs());

  ExpectBadField(Completion(R"({"prompt": "1", "logprobs": 6})"), "logprobs");
  ExpectBadField(Completion(R"({"prompt": "1", "logprobs": -1})"), "logprobs");
  ExpectBadField(Completion(R"({"prompt": "1", "logprobs": 2.5})"), "logprobs");
  ExpectBadField(Completion(R"({"prompt": "1", "logprobs": true})"), "logprobs");
  ExpectBadField(Completion(R"({"prompt": "1", "top_logprobs": 2})"), "top_logprobs");
  ExpectBadField(Chat("{" + msgs + R"(, "logprobs": 2})"), "logprobs");
  ExpectBadField(Chat("{" + msgs + R"(, "logprobs": true, "top_logprobs": 21})"), "top_logprobs");
  ExpectBadField(Chat("{" + msgs + R"(, "logprobs": true, "top_logprobs": -1})"), "top_logprobs");
  // top_logprobs without logprobs: true is refused, as OpenAI does.
  ExpectBadField(Chat("{" + msgs + R"(, "top_logprobs": 5})"), "top_logprobs");
  ExpectBadField(Chat("{" + msgs + R"(, "logprobs": false, "top_logprobs": 1})"), "top_logprobs");
}

v1::GenerateResponse LogprobsMessage(
    const std::vector<std::tuple<std::string, float, std::vector<std::pair<std::string, float>>>>&
        tokens) {
  v1::GenerateResponse m;
  int id = 100;
  for (const auto& [tok, lp, top] : tokens) {
    v1::TokenLogprob* e = m.add_logprobs();
    e->set_token_id(id++);
    e->set_token(tok);
    e->set_token_bytes(tok);
    e->set_logprob(lp);
    for (const auto& [t, v] : top) {
      v1::TopLogprob* x = e->add_top_logprobs();
      x->set_token_id(id++);
      x->set_token(t);
      x->set_token_bytes(t);
      x->set_logprob(v);
    }
    m.mutable_text()->append(tok);
  }
  return m;
}

TEST(OpenAiCodecTest, CompletionLogprobsShape) {
  LogprobsTracker lp(/*chat=*/false);
  lp.Add(LogprobsMessage({{" Once", -0.5f, {{" Once", -0.5f}, {" The", -1.5f}}},
                          {" upon", -0.25f, {{" upon", -0.25f}, {" up", -2.0f}}}}));
  const json j = lp.Take(0, /*all=*/true);
  EXPECT_EQ(j["tokens"], json({" Once", " upon"}));
  EXPECT_EQ(j["token_logprobs"], json({-0.5, -0.25}));
  EXPECT_EQ(j["top_logprobs"][0], json({{" Once", -0.5}, {" The", -1.5}}));
  EXPECT_EQ(j["top_logprobs"][1], json({{" upon", -0.25}, {" up", -2.0}}));
  EXPECT_EQ(j["text_offset"], json({0, 5}));
  // The next chunk continues the offsets; the sampled token is in its dict even when it is not
  // among the alternatives (OpenAI: up to logprobs + 1 entries); -inf is -9999.
  lp.Add(LogprobsMessage({{" a", -std::numeric_limits<float>::infinity(), {{" é", -0.1f}}}}));
  const json k = lp.Take(0, true);
  EXPECT_EQ(k["text_offset"], json::array({10}));
  EXPECT_EQ(k["token_logprobs"], json::array({-9999.0}));
  EXPECT_EQ(k["top_logprobs"][0], json({{" é", -0.1f}, {" a", -9999.0}}));
  EXPECT_TRUE(lp.Take(0, true).is_null());  // nothing pending
  // The whole response carries it, an empty response an empty shape.
  const ResponseMeta cmpl{"cmpl-1", 1, "tiny", false};
  const json r = Response(cmpl, " Once upon", "length", v1::Usage(), "w", j);
  EXPECT_EQ(r["choices"][0]["logprobs"], j);
  const json empty = LogprobsTracker(false).Take(0, true, /*empty=*/true);
  EXPECT_EQ(empty["tokens"], json::array());
  EXPECT_EQ(empty["text_offset"], json::array());
}

TEST(OpenAiCodecTest, ChatLogprobsShape) {
  LogprobsTracker lp(/*chat=*/true);
  lp.Add(LogprobsMessage({{"Hé", -0.5f, {{"Hé", -0.5f}, {"A", -1.0f}}}}));
  const json j = lp.Take(0, true);
  ASSERT_EQ(j["content"].size(), 1u);
  const json& e = j["content"][0];
  EXPECT_EQ(e["token"], "Hé");
  EXPECT_EQ(e["logprob"], -0.5);
  EXPECT_EQ(e["bytes"], json({72, 195, 169}));
  EXPECT_EQ(e["top_logprobs"], json::parse(R"([{"token": "Hé", "logprob": -0.5,
      "bytes": [72, 195, 169]}, {"token": "A", "logprob": -1.0, "bytes": [65]}])"));
  EXPECT_TRUE(j["refusal"].is_null());
  const ResponseMeta chat{"chatcmpl-1", 1, "tiny", true};
  EXPECT_EQ(Response(chat, "Hé", "stop", v1::Usage(), "w", j)["choices"][0]["logprobs"], j);
  EXPECT_EQ(LogprobsTracker(true).Take(0, true, true)["content"], json::array());
}

// Streaming: each chunk carries the logprobs of its own tokens; with a stop string, a token's
// entry waits until its text passed the stop filter, and tokens after the stop are dropped.
TEST(OpenAiCodecTest, StreamedLogprobsFollowTheirText) {
  const ResponseMeta chat{"chatcmpl-1", 1, "tiny", true};
  LogprobsTracker lp(true);
  lp.Add(LogprobsMessage({{"ab", -1.0f, {}}}));
  const json c1 = StreamChunk(chat, "ab", nullptr, lp.Take(2, true));
  EXPECT_EQ(c1["choices"][0]["logprobs"]["content"][0]["token"], "ab");
  EXPECT_TRUE(StreamChunk(chat, "x")["choices"][0]["logprobs"].is_null());
  const ResponseMeta cmpl{"cmpl-1", 1, "tiny", false};
  EXPECT_TRUE(StreamChunk(cmpl, "x")["choices"][0]["logprobs"].is_null());

  // Stop string "cd": tokens "ab", "c", "d", "e" arrive; the filter holds back "c".
  LogprobsTracker s(true);
  StopFilter stop({"cd"});
  size_t emitted = 0;
  std::vector<std::string> chunk_tokens;
  for (const char* t : {"ab", "c", "d", "e"}) {
    v1::GenerateResponse m = LogprobsMessage({{t, -1.0f, {}}});
    s.Add(m);
    const std::string o = stop.Push(m.text(), false);
    emitted += o.size();
    const json j = s.Take(emitted, false);
    std::string toks;
    if (!j.is_null()) {
      for (const json& x : j["content"]) toks += x["token"].get<std::string>() + "|";
    }
    chunk_tokens.push_back(toks);
    if (stop.stopped()) break;
  }
  // "ab" goes out with its text; "c" is held with its text, and is cut with it by the stop.
  EXPECT_EQ(chunk_tokens, (std::vector<std::string>{"ab|", "", ""}));
  EXPECT_TRUE(stop.stopped());
  EXPECT_TRUE(s.Take(emitted, false).is_null());

  // Completions: text_offset continues across streamed chunks.
  LogprobsTracker c(false);
  c.Add(LogprobsMessage({{"ab", -1.0f, {}}}));
  EXPECT_EQ(c.Take(2, true)["text_offset"], json::array({0}));
  c.Add(LogprobsMessage({{"cd", -1.0f, {}}, {"e", -1.0f, {}}}));
  EXPECT_EQ(c.Take(5, true)["text_offset"], json({2, 4}));
}

TEST(OpenAiCodecTest, StopStringsAndStreamOptions) {
  auto one = Completion(R"({"prompt": "1", "stop": "\n\n"})");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->stop, (std::vector<std::string>{"\n\n"}));
  auto many = Completion(R"({"prompt": "1", "stop": ["a", "", "bc"]})");
  ASSERT_TRUE(many.ok()) << many.status();
  EXPECT_EQ(many->stop, (std::vector<std::string>{"a", "bc"}));  // empty ones dropped
  EXPECT_TRUE(many->req.sampling().stop_ids().empty());  // strings stay in the HTTP layer

  auto usage = Completion(R"({"prompt": "1", "stream": true,
                              "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(usage.ok()) << usage.status();
  EXPECT_TRUE(usage->include_usage);
  // Lenient, as clients send it: anything else is ignored.
  for (const char* so : {R"({"include_usage": "yes"})", R"(true)", R"({})", R"(null)"}) {
    auto r = Completion(std::string(R"({"prompt": "1", "stream_options": )") + so + "}");
    ASSERT_TRUE(r.ok()) << so << ": " << r.status();
    EXPECT_FALSE(r->include_usage) << so;
  }
}

TEST(OpenAiCodecTest, BodyChecks) {
  struct Case {
    std::string body, message;
  };
  const std::string deep = std::string(10000, '[') + std::string(10000, ']');
  const Case cases[] = {
      {"{\"prompt\": \"\xff\"}", "request body is not valid UTF-8"},
      {R"({"prompt": "1", "junk": )" + deep + "}", "deeper than 64"},
      {R"({"prompt": )", "malformed JSON in request body"},
      {R"([1, 2])", "request body must be a JSON object"},
      {R"("prompt")", "request body must be a JSON object"},
  };
  for (const Case& c : cases) {
    for (Endpoint e : {Endpoint::kCompletions, Endpoint::kChat}) {
      auto r = ParseRequest(c.body, e);
      ASSERT_FALSE(r.ok()) << c.message;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(r.status().message().find(c.message), std::string::npos) << r.status();
      EXPECT_EQ(ErrorParam(r.status()), "");
    }
  }
  // Deep nesting is refused before parsing, also where the parser would recurse in a field.
  const std::string deeper = std::string(100000, '[') + std::string(100000, ']');
  auto r = Chat(R"({"messages": [{"role": "user", "content": )" + deeper + "}]}");
  EXPECT_NE(r.status().message().find("deeper than 64"), std::string::npos) << r.status();
}

TEST(OpenAiCodecTest, ErrorParamIsEmptyForOtherStatuses) {
  EXPECT_EQ(ErrorParam(absl::OkStatus()), "");
  EXPECT_EQ(ErrorParam(absl::InvalidArgumentError("unknown model 'x'")), "");
  EXPECT_EQ(ErrorParam(absl::UnavailableError("no worker")), "");
}

TEST(OpenAiCodecTest, StopFilterHoldsBackAPossibleStopString) {
  StopFilter f({"END"});  // holds back the last 2 bytes
  EXPECT_EQ(f.Push("hello E", false), "hello");
  EXPECT_FALSE(f.stopped());
  EXPECT_EQ(f.Push("N", false), " ");
  EXPECT_EQ(f.Push("D tail", false), "");  // "END" found: nothing from it on
  EXPECT_TRUE(f.stopped());
  EXPECT_EQ(f.Push("more", true), "");  // nothing after a stop string

  StopFilter g({"xyz"});
  EXPECT_EQ(g.Push("abcxy", false), "abc");
  EXPECT_EQ(g.Push("q", false), "x");
  EXPECT_EQ(g.Push("", true), "yq");  // the final chunk flushes everything
  EXPECT_FALSE(g.stopped());

  StopFilter none({});
  EXPECT_EQ(none.Push("abc", false), "abc");
}

TEST(OpenAiCodecTest, StopFilterNeverSplitsUtf8) {
  StopFilter f({"zz"});  // holds back 1 byte
  // "é" is 2 bytes (C3 A9): holding back the last byte would split it, so both wait.
  EXPECT_EQ(f.Push("a\xc3\xa9", false), "a");
  EXPECT_EQ(f.Push("b", false), "\xc3\xa9");
  EXPECT_EQ(f.Push("", true), "b");
}

TEST(OpenAiCodecTest, ResponseJson) {
  v1::Usage u;
  u.set_prompt_tokens(10);
  u.set_completion_tokens(4);
  u.set_prefix_tokens(2);
  u.set_reused_tokens(5);
  u.set_recomputed_tokens(1);
  u.set_new_tokens(3);
  u.set_segments_hit(2);
  const json usage = UsageJson(u, "w1");
  EXPECT_EQ(usage["total_tokens"], 14);
  // Cached: the 2 prefix tokens and the 4 reused tokens not recomputed; the recomputed one apart.
  EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], 6);
  EXPECT_EQ(usage["prompt_tokens_details"]["recomputed_tokens"], 1);
  EXPECT_EQ(usage["sparsex"]["reused_tokens"], 5);
  EXPECT_EQ(usage["sparsex"]["worker"], "w1");

  const ResponseMeta cmpl{"cmpl-1", 123, "tiny", false};
  const json r = Response(cmpl, "1 2", "length", u, "w1");
  EXPECT_EQ(r["id"], "cmpl-1");
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["created"], 123);
  EXPECT_EQ(r["model"], "tiny");
  EXPECT_EQ(r["choices"][0]["text"], "1 2");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(r["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(r["usage"], usage);

  const ResponseMeta chat{"chatcmpl-1", 123, "tiny", true};
  const json c = Response(chat, "hi", "stop", u, "w1");
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(c["choices"][0]["message"]["content"], "hi");

  const json chunk = StreamChunk(cmpl, "3");
  EXPECT_EQ(chunk["object"], "text_completion");
  EXPECT_EQ(chunk["choices"][0]["text"], "3");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  const json chat_chunk = StreamChunk(chat, "x");
  EXPECT_EQ(chat_chunk["object"], "chat.completion.chunk");
  EXPECT_EQ(chat_chunk["choices"][0]["delta"]["content"], "x");
  const json last = StreamChunk(chat, "", "stop");
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  const json role = StreamRoleChunk(chat);
  EXPECT_EQ(role["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(role["choices"][0]["delta"]["content"], "");
  const json uc = StreamUsageChunk(chat, u, "w1");
  EXPECT_TRUE(uc["choices"].is_array() && uc["choices"].empty());
  EXPECT_EQ(uc["usage"], usage);
  EXPECT_EQ(uc["id"], "chatcmpl-1");
}

// prompt_tokens_details.cached_tokens counts only tokens used from a cache without recompute.
TEST(OpenAiCodecTest, CachedTokensExcludeRecomputedOnes) {
  const auto details = [](int prefix, int reused, int recomputed) {
    v1::Usage u;
    u.set_prompt_tokens(prefix + reused + 10);
    u.set_prefix_tokens(prefix);
    u.set_reused_tokens(reused);
    u.set_recomputed_tokens(recomputed);
    u.set_new_tokens(10);
    return UsageJson(u, "w")["prompt_tokens_details"];
  };
  // No cache at all.
  EXPECT_EQ(details(0, 0, 0), (json{{"cached_tokens", 0}, {"recomputed_tokens", 0}}));
  // An exact prefix only: all of it cached.
  EXPECT_EQ(details(64, 0, 0), (json{{"cached_tokens", 64}, {"recomputed_tokens", 0}}));
  // Reused segments with 15% recomputed: 300 of 2000 reused tokens are not cached.
  EXPECT_EQ(details(16, 2000, 300), (json{{"cached_tokens", 1716}, {"recomputed_tokens", 300}}));
  // Every reused token recomputed (no sparse layer): only the prefix is cached.
  EXPECT_EQ(details(16, 500, 500), (json{{"cached_tokens", 16}, {"recomputed_tokens", 500}}));
  // A report of more recomputed than reused tokens is clamped, never a negative count.
  EXPECT_EQ(details(8, 10, 25), (json{{"cached_tokens", 8}, {"recomputed_tokens", 10}}));
  // The worker's own figures stay in "sparsex" as reported.
  v1::Usage u;
  u.set_reused_tokens(40);
  u.set_recomputed_tokens(6);
  const json j = UsageJson(u, "w");
  EXPECT_EQ(j["sparsex"]["reused_tokens"], 40);
  EXPECT_EQ(j["sparsex"]["recomputed_tokens"], 6);
  EXPECT_EQ(j["prompt_tokens_details"]["cached_tokens"], 34);
}

}  // namespace
}  // namespace sparsex::router::openai
