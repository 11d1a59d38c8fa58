// Router input hardening, through the real front ends of a router serving the
// synthetic "tiny" model (vocabulary 1000, 4 layers) whose one static worker never answers:
// a request the router accepts ends in 503 (no healthy worker), one it refuses in 400 (HTTP)
// or INVALID_ARGUMENT (gRPC) before any routing.
//   - JSON nested 10,000 levels deep is a 400, and the router lives on;
//   - integers that do not fit their field (token ids, top_k, reuse.full_layers, max_tokens,
//     seed) are a 400 naming the field, never wrapped;
//   - prompt together with segments is a 400, not one of them dropped;
//   - /v1/models matches exactly (GET /v1/modelsXYZ is a 404);
//   - a request_id with invalid UTF-8 is INVALID_ARGUMENT "request_id: invalid UTF-8";
//   - stop_ids outside the vocabulary are INVALID_ARGUMENT;
//   - a prompt over max_prompt_bytes is refused before tokenizing, naming the limit.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "gtest/gtest.h"
#include "proto/sparsex.grpc.pb.h"
#include "router/frontends.h"
#include "router/router.h"

namespace sparsex::router {
namespace {

using json = nlohmann::json;

struct HttpReply {
  int status = 0;
  std::string body;
  json Json() const { return json::parse(body, nullptr, false); }
  std::string Param() const {
    json j = Json();
    if (j.is_discarded() || !j.contains("error") || !j["error"]["param"].is_string()) return "";
    return j["error"]["param"].get<std::string>();
  }
};

std::ostream& operator<<(std::ostream& os, const HttpReply& r) {
  return os << r.status << " " << r.body.substr(0, 300);
}

HttpReply Http(int port, const std::string& method, const std::string& path,
               const std::string& body = "") {
  HttpReply r;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return r;
  timeval tv{30, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return r;
  }
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (method == "POST") {
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\n";
  }
  req += "\r\n" + body;
  for (size_t off = 0; off < req.size();) {
    const ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  std::string resp;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const size_t sp = resp.find(' ');
  const size_t hdr_end = resp.find("\r\n\r\n");
  if (sp == std::string::npos || hdr_end == std::string::npos) return r;
  r.status = std::atoi(resp.c_str() + sp + 1);
  r.body = resp.substr(hdr_end + 4);
  return r;
}

class RouterInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    RouterOptions o;
    o.insecure_loopback = true;  // a loopback test cluster
    o.model_path = "synthetic:tiny";
    o.model_name = "tiny";
    o.workers = {"127.0.0.1:1"};  // nothing listens there: no worker is ever healthy
    auto r = Router::Create(o);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = r->release();
    auto h = HttpFrontend::Start(router_, "127.0.0.1:0", 4);
    ASSERT_TRUE(h.ok()) << h.status();
    http_ = h->release();
    auto g = GrpcFrontend::Start(router_, "127.0.0.1:0");
    ASSERT_TRUE(g.ok()) << g.status();
    grpc_ = g->release();
  }
  static void TearDownTestSuite() {
    delete grpc_;
    delete http_;
    delete router_;
  }

  static HttpReply Post(const std::string& path, const std::string& body) {
    return Http(http_->port(), "POST", path, body);
  }
  static HttpReply Completion(const std::string& fields) {
    return Post("/v1/completions", "{" + fields + "}");
  }
  static absl::Status Generate(const v1::GenerateRequest& req) {
    return router_->Generate(req, [](const v1::GenerateResponse&) { return true; }, {});
  }

  static Router* router_;
  static HttpFrontend* http_;
  static GrpcFrontend* grpc_;
};
Router* RouterInputTest::router_ = nullptr;
HttpFrontend* RouterInputTest::http_ = nullptr;
GrpcFrontend* RouterInputTest::grpc_ = nullptr;

// The baseline: a valid request passes every check and fails only for want of a worker.
TEST_F(RouterInputTest, ValidRequestsReachRouting) {
  EXPECT_EQ(Completion(R"("prompt": "1 2 3", "max_tokens": 4)").status, 503);
  EXPECT_EQ(Completion(R"("prompt": [1, 2, 3], "top_k": 5, "seed": 18446744073709551615)").status,
            503);
  EXPECT_EQ(Completion(R"("segments": [[1, 2], "3 4"], "reuse": {"full_layers": 2})").status, 503);
  // A number with no fraction is an integer.
  EXPECT_EQ(Completion(R"("prompt": [1, 2.0], "max_tokens": 4.0)").status, 503);
  const HttpReply chat = Post("/v1/chat/completions",
                              R"({"messages": [{"role": "user", "content": "1 2"}]})");
  EXPECT_EQ(chat.status, 503) << chat;
}

TEST_F(RouterInputTest, DeeplyNestedJsonIs400AndTheRouterLivesOn) {
  const std::string deep = std::string(10000, '[') + std::string(10000, ']');
  const HttpReply r = Post("/v1/chat/completions",
                           R"({"messages": [{"role": "user", "content": )" + deep + "}]}");
  EXPECT_EQ(r.status, 400) << r;
  EXPECT_NE(r.body.find("deeper than 64"), std::string::npos) << r;
  const HttpReply c = Completion(R"("prompt": "1", "junk": )" + deep);
  EXPECT_EQ(c.status, 400) << c;
  // 100,000 levels (200 KB, far below the body limit) of objects and arrays.
  std::string deeper;
  for (int i = 0; i < 100000; ++i) deeper += i % 2 ? "[" : "{\"a\":";
  deeper += "1";
  for (int i = 100000; i-- > 0;) deeper += i % 2 ? "]" : "}";
  const HttpReply d = Completion(R"("prompt": "1", "junk": )" + deeper);
  EXPECT_EQ(d.status, 400) << d;
  EXPECT_NE(d.body.find("deeper than 64"), std::string::npos) << d;
  // Still serving.
  EXPECT_EQ(Http(http_->port(), "GET", "/v1/models").status, 200);
  EXPECT_EQ(Completion(R"("prompt": "1 2")").status, 503);
}

TEST_F(RouterInputTest, IntegersThatDoNotFitTheirFieldAre400NamingIt) {
  struct Case {
    std::string fields, param;
  };
  const Case cases[] = {
      {R"("prompt": [1, 4294967699])", "prompt[]"},  // 2^32 + 403 was served as token 403
      {R"("prompt": [[1, 4294967699]])", "prompt[]"},
      {R"("prompt": [1, -4294967296])", "prompt[]"},
      {R"("prompt": [1, 2.5])", "prompt[]"},
      {R"("prompt": [1, "2"])", "prompt[]"},
      {R"("segments": [[4294967699]])", "segments[][]"},
      {R"("segments": [[1e300]])", "segments[][]"},
      {R"("prompt": "1", "top_k": 4294967296)", "top_k"},  // was top_k 0 (off)
      {R"("prompt": "1", "top_k": -1)", "top_k"},
      {R"("prompt": "1", "top_k": 1.5)", "top_k"},
      {R"("prompt": "1", "reuse": {"full_layers": 4294967297})", "reuse.full_layers"},  // was 1
      {R"("prompt": "1", "reuse": {"full_layers": 0.5})", "reuse.full_layers"},
      {R"("prompt": "1", "max_tokens": 4294967297)", "max_tokens"},
      {R"("prompt": "1", "max_tokens": 0)", "max_tokens"},
      {R"("prompt": "1", "max_tokens": 1.5)", "max_tokens"},
      {R"("prompt": "1", "seed": -1)", "seed"},
      {R"("prompt": "1", "seed": 18446744073709551616)", "seed"},
      {R"("prompt": "1", "n": 1.5)", "n"},
  };
  for (const Case& c : cases) {
    const HttpReply r = Completion(c.fields);
    EXPECT_EQ(r.status, 400) << c.fields << " -> " << r;
    EXPECT_EQ(r.Param(), c.param) << c.fields << " -> " << r;
    EXPECT_NE(r.body.find("'" + c.param + "'"), std::string::npos) << c.fields << " -> " << r;
  }
  const HttpReply chat = Post("/v1/chat/completions",
                              R"({"messages": [{"role": "user", "content": "1"}],
                                  "max_completion_tokens": 4294967297})");
  EXPECT_EQ(chat.status, 400) << chat;
  EXPECT_EQ(chat.Param(), "max_completion_tokens") << chat;
}

TEST_F(RouterInputTest, PromptWithSegmentsIs400) {
  for (const char* fields : {R"("prompt": "1 2", "segments": ["3 4"])",
                             R"("prompt": [1, 2], "segments": [])",
                             R"("segments": [[1]], "prompt": "")"}) {
    const HttpReply r = Completion(fields);
    EXPECT_EQ(r.status, 400) << fields << " -> " << r;
    EXPECT_NE(r.body.find("not both"), std::string::npos) << fields << " -> " << r;
  }
  // gRPC: Prepare refuses the same.
  v1::GenerateRequest req;
  req.set_prompt("1 2");
  req.add_segments()->set_text("3 4");
  EXPECT_EQ(Generate(req).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterInputTest, ModelsPathMatchesExactly) {
  const int port = http_->port();
  EXPECT_EQ(Http(port, "GET", "/v1/models").status, 200);
  const HttpReply one = Http(port, "GET", "/v1/models/tiny");
  EXPECT_EQ(one.status, 200) << one;
  EXPECT_EQ(one.Json().value("id", ""), "tiny") << one;
  EXPECT_EQ(Http(port, "GET", "/v1/models/other").status, 404);
  for (const char* path : {"/v1/modelsXYZ", "/v1/models.json", "/v1/models_"}) {
    const HttpReply r = Http(port, "GET", path);
    EXPECT_EQ(r.status, 404) << path << " -> " << r;
  }
}

TEST_F(RouterInputTest, InvalidUtf8RequestIdIsInvalidArgument) {
  v1::GenerateRequest req;
  req.set_prompt("1 2");
  req.set_request_id("req-\xff\xfe");
  absl::Status s = Generate(req);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "request_id: invalid UTF-8");

  // The same through the public gRPC API (it used to be INTERNAL with an empty message).
  auto ch = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_->port()),
                                grpc::InsecureChannelCredentials());
  auto stub = v1::SparseX::NewStub(ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  grpc::Status gs = reader->Finish();
  EXPECT_EQ(gs.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << gs.error_message();
  EXPECT_EQ(gs.error_message(), "request_id: invalid UTF-8");
  // A valid one passes (and fails only for want of a worker).
  req.set_request_id("req-\xc3\xa9");
  EXPECT_EQ(Generate(req).code(), absl::StatusCode::kUnavailable);
}

TEST_F(RouterInputTest, OutOfVocabularyStopIdsAreInvalidArgument) {
  v1::GenerateRequest req;
  req.set_prompt("1 2");
  for (int32_t bad : {1000, 1 << 30, -1}) {  // the vocabulary is 1000
    req.mutable_sampling()->clear_stop_ids();
    req.mutable_sampling()->add_stop_ids(bad);
    absl::Status s = Generate(req);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s;
    EXPECT_NE(s.message().find("stop_ids"), std::string::npos) << s;
    EXPECT_NE(s.message().find("vocabulary of 1000"), std::string::npos) << s;
  }
  req.mutable_sampling()->clear_stop_ids();
  req.mutable_sampling()->add_stop_ids(999);
  EXPECT_EQ(Generate(req).code(), absl::StatusCode::kUnavailable);
}

// A prompt over max_prompt_bytes (default 4 MiB) is refused on its raw text, before any
// templating or tokenization, on both APIs, naming the limit; over gRPC a message past the
// bound plus 8 MiB is not even read (tokenizing a 30 MB prompt costs 26 s of CPU and 1.8 GB).
TEST_F(RouterInputTest, OversizedPromptsAreRefusedBeforeTokenizing) {
  const std::string big((size_t{4} << 20) + 2, '1');  // 4 MiB + 2 bytes
  const auto names_limit = [](const std::string& m) {
    return m.find("max_prompt_bytes") != std::string::npos &&
           m.find(std::to_string(size_t{4} << 20)) != std::string::npos;
  };
  HttpReply r = Post("/v1/completions", json{{"prompt", big}}.dump());
  EXPECT_EQ(r.status, 400) << r;
  EXPECT_EQ(r.Param(), "prompt") << r;
  EXPECT_TRUE(names_limit(r.body)) << r;
  r = Post("/v1/chat/completions",
           json{{"messages", {{{"role", "user"}, {"content", big.substr(0, big.size() / 2)}},
                              {{"role", "user"}, {"content", big.substr(big.size() / 2)}}}}}
               .dump());
  EXPECT_EQ(r.status, 400) << r;
  EXPECT_EQ(r.Param(), "messages") << r;
  EXPECT_TRUE(names_limit(r.body)) << r;
  r = Post("/v1/completions", json{{"segments", {big.substr(0, 100), big}}}.dump());
  EXPECT_EQ(r.status, 400) << r;
  EXPECT_TRUE(names_limit(r.body)) << r;

  // gRPC: the router's own check, and gRPC's receive bound above it.
  v1::GenerateRequest req;
  req.set_prompt(big);
  absl::Status s = Generate(req);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(names_limit(std::string(s.message()))) << s;
  auto ch = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_->port()),
                                grpc::InsecureChannelCredentials());
  auto stub = v1::SparseX::NewStub(ch);
  const auto call = [&](const v1::GenerateRequest& rq) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub->Generate(&ctx, rq);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
    }
    return reader->Finish();
  };
  grpc::Status gs = call(req);
  EXPECT_EQ(gs.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << gs.error_message();
  EXPECT_TRUE(names_limit(gs.error_message())) << gs.error_message();
  v1::GenerateRequest seg_req;
  seg_req.add_segments()->set_text(big.substr(0, 3 << 20));
  seg_req.add_segments()->set_text(big.substr(0, 2 << 20));
  gs = call(seg_req);
  EXPECT_EQ(gs.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << gs.error_message();
  EXPECT_TRUE(names_limit(gs.error_message())) << gs.error_message();
  v1::GenerateRequest huge;
  huge.set_prompt(std::string(size_t{13} << 20, '1'));  // past 4 MiB + 8 MiB
  gs = call(huge);
  EXPECT_EQ(gs.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << gs.error_message();
  v1::TokenizeRequest tr;
  tr.set_text(big);
  auto t = router_->Tokenize(tr);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_TRUE(names_limit(std::string(t.status().message()))) << t.status();
}

}  // namespace
}  // namespace sparsex::router
