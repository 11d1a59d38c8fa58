// Router abuse limits, against real processes on loopback: one sparsex-worker (stories260K on
// the CPU) and one sparsex-router per test, stopped by PID. docs/operations.md "Per-client
// limits and the admin listener".
//   - UnseededSamplingDrawsAFreshSeed: at temperature 1, two identical requests without a seed
//     differ (within a few tries); with a seed they are equal. HTTP and gRPC.
//   - AdminListenerAnswersWhileClientsFloodTheApi: one client's idle connections stop at its
//     per-client allowance (429) while another client is still served; with the API's whole
//     connection limit taken (idle connections from several addresses) the admin listener's
//     /healthz, /livez and /metrics still answer 200.
//   - OneClientCannotTakeEveryStream: with the worker frozen (SIGSTOP) so that completions stay
//     in flight, a client's completion past http_max_streams_per_client is answered 429 at once
//     while another client's is accepted; SIGCONT and every accepted one completes.
// Every test client is on 127.0.0.0/8: a socket bound to 127.0.0.2 (3, ...) before connecting is
// another client to the router's per-address limits.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "proto/sparsex.grpc.pb.h"
#include "testing/models_dir.h"
#include "testing/server_process.h"

namespace sparsex {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace ct = cache::testing;

// A TCP connection to 127.0.0.1:port from source address `from`.
int Connect(int port, const char* from = "127.0.0.1",
            std::chrono::milliseconds rcv_timeout = 10000ms) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval tv{static_cast<time_t>(rcv_timeout.count() / 1000),
             static_cast<suseconds_t>((rcv_timeout.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, from, &src.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) {
    ::close(fd);
    return -1;
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& s) {
  for (size_t off = 0; off < s.size();) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

std::string ReadAll(int fd) {
  std::string out;
  char buf[16384];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string Request(const std::string& method, const std::string& path,
                    const std::string& body = "") {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (!body.empty()) {
    r += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n";
  }
  return r + "\r\n" + body;
}

struct Reply {
  int status = 0;
  std::string body;
};

Reply Parse(const std::string& resp) {
  Reply r;
  if (resp.rfind("HTTP/1.", 0) != 0) return r;
  r.status = std::atoi(resp.c_str() + resp.find(' ') + 1);
  const size_t e = resp.find("\r\n\r\n");
  if (e != std::string::npos) r.body = resp.substr(e + 4);
  return r;
}

Reply Exchange(int port, const std::string& req, const char* from = "127.0.0.1",
               std::chrono::milliseconds timeout = 30000ms) {
  const int fd = Connect(port, from, timeout);
  if (fd < 0) return {};
  Reply r;
  if (SendAll(fd, req)) r = Parse(ReadAll(fd));
  ::close(fd);
  return r;
}

// The completion text of a non-streaming /v1/completions response ("" when none).
std::string Text(const Reply& r) {
  json j = json::parse(r.body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices")) return "";
  return j["choices"][0].value("text", "");
}

// Value of the sample line of `metric` (name with labels, exactly as rendered); NAN if none.
double MetricValue(const std::string& page, const std::string& metric) {
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(metric + " ", 0) == 0) return std::stod(line.substr(metric.size() + 1));
  }
  return NAN;
}

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str(), nullptr, false);
}

class RouterLimits : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ct::MakeTempDir("sparsex-router-limits");
    model_ = sparsex::testing::ModelsDir() + "/stories260K/stories260K.gguf";
    if (!std::ifstream(model_).good()) GTEST_SKIP() << "model " << model_ << " not found";
  }
  void TearDown() override {
    if (router_) router_->Stop(5s);
    if (worker_) {
      worker_->Signal(SIGCONT);  // a frozen one must be able to stop
      worker_->Stop(5s);
    }
    if (HasFailure()) {
      for (const char* log : {"router.log", "worker.log"}) {
        std::ifstream in(dir_ + "/" + log);
        std::stringstream ss;
        ss << in.rdbuf();
        std::string s = ss.str();
        if (s.size() > 4000) s = s.substr(s.size() - 4000);
        std::cerr << "---- " << log << " (tail) ----\n" << s << "\n";
      }
    }
    ct::RemoveTree(dir_);
  }

  json WaitReady(ct::ChildProcess& proc, const std::string& file) {
    const Clock::time_point end = Clock::now() + 60s;
    while (Clock::now() < end) {
      json j = ReadJson(file);
      if (!j.is_discarded() && j.is_object()) return j;
      if (!proc.Running()) break;
      std::this_thread::sleep_for(50ms);
    }
    return json();
  }

  void StartWorker() {
    const std::string ready = dir_ + "/worker.ready";
    std::vector<std::string> argv = {
        ct::BinDir() + "/sparsex-worker", "--model", model_, "--device", "cpu", "--port", "0",
        "--metrics_port", "0", "--kv_blocks", "1024", "--load_report_ms", "100",
        "--ready_file", ready};
    if (HasFlag("sparsex-worker", "insecure_loopback")) argv.push_back("--insecure_loopback");
    auto p = ct::ChildProcess::Spawn(argv, dir_ + "/worker.log");
    ASSERT_TRUE(p.ok()) << p.status();
    worker_ = std::move(*p);
    json j = WaitReady(*worker_, ready);
    ASSERT_TRUE(j.is_object()) << "worker did not start";
    worker_port_ = j["grpc_port"];
  }

  // Whether `binary --help` lists `flag` (a loopback test cluster runs without credentials,
  // which the binaries ask for explicitly).
  static bool HasFlag(const std::string& binary, const std::string& flag) {
    const std::string cmd = ct::BinDir() + "/" + binary + " --help 2>&1";
    FILE* f = ::popen(cmd.c_str(), "r");
    if (f == nullptr) return false;
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    ::pclose(f);
    return out.find("--" + flag) != std::string::npos;
  }

  void StartRouter(const std::vector<std::string>& extra = {}) {
    const std::string ready = dir_ + "/router.ready";
    std::vector<std::string> argv = {
        ct::BinDir() + "/sparsex-router", "--model", model_, "--workers",
        "127.0.0.1:" + std::to_string(worker_port_), "--grpc_address", "127.0.0.1:0",
        "--http_address", "127.0.0.1:0", "--admin_address", "127.0.0.1:0", "--ready_file", ready};
    if (HasFlag("sparsex-router", "insecure_loopback")) argv.push_back("--insecure_loopback");
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = ct::ChildProcess::Spawn(argv, dir_ + "/router.log");
    ASSERT_TRUE(p.ok()) << p.status();
    router_ = std::move(*p);
    json j = WaitReady(*router_, ready);
    ASSERT_TRUE(j.is_object()) << "router did not start";
    http_port_ = j["http_port"];
    grpc_port_ = j["grpc_port"];
    admin_port_ = j.value("admin_port", -1);
    ASSERT_GT(admin_port_, 0) << j.dump();
    const Clock::time_point end = Clock::now() + 30s;
    while (Clock::now() < end) {
      json h = json::parse(Exchange(admin_port_, Request("GET", "/healthz")).body, nullptr, false);
      if (h.is_object() && h.value("healthy_workers", 0) == 1) break;
      std::this_thread::sleep_for(100ms);
    }
    stub_ = v1::SparseX::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port_),
                                                     grpc::InsecureChannelCredentials()));
  }

  std::string GrpcText(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 30s);
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse m;
    std::string text;
    while (reader->Read(&m)) text += m.text();
    grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return text;
  }

  std::string dir_, model_;
  std::unique_ptr<ct::ChildProcess> worker_, router_;
  int worker_port_ = 0, http_port_ = 0, grpc_port_ = 0, admin_port_ = 0;
  std::unique_ptr<v1::SparseX::Stub> stub_;
};

TEST_F(RouterLimits, UnseededSamplingDrawsAFreshSeed) {
  StartWorker();
  StartRouter();
  const auto http = [&](std::optional<uint64_t> seed) {
    // Reuse off and nothing stored: every request computes the same prompt KV exactly, so a
    // seed alone decides the tokens.
    json b = {{"prompt", "Once upon a time"}, {"max_tokens", 24}, {"temperature", 1.0},
              {"ignore_eos", true},
              {"reuse", {{"enable", false}, {"store_new_segments", false},
                         {"register_prefix", false}}}};
    if (seed) b["seed"] = *seed;
    Reply r = Exchange(http_port_, Request("POST", "/v1/completions", b.dump()));
    EXPECT_EQ(r.status, 200) << r.body;
    return Text(r);
  };
  const auto grpc_text = [&](std::optional<uint64_t> seed) {
    v1::GenerateRequest req;
    req.set_prompt("Once upon a time");
    req.mutable_sampling()->set_temperature(1.0f);
    req.mutable_sampling()->set_max_tokens(24);
    req.mutable_sampling()->set_ignore_eos(true);
    req.mutable_reuse()->set_enable(false);
    req.mutable_reuse()->set_store_new_segments(false);
    req.mutable_reuse()->set_register_prefix(false);
    if (seed) req.mutable_sampling()->set_seed(*seed);
    return GrpcText(req);
  };
  // Without a seed: two identical requests differ (24 tokens at temperature 1 on a 512-token
  // vocabulary agree by chance with a vanishing probability; five tries).
  for (const auto& [api, gen] :
       {std::pair<const char*, std::function<std::string(std::optional<uint64_t>)>>{"http", http},
        {"grpc", grpc_text}}) {
    bool differ = false;
    for (int i = 0; i < 5 && !differ; ++i) {
      const std::string a = gen(std::nullopt), b = gen(std::nullopt);
      ASSERT_FALSE(a.empty()) << api;
      differ = a != b;
    }
    EXPECT_TRUE(differ) << api << ": unseeded requests at temperature 1 all returned one text";
    // With a seed: the same text every time (0 included: a seed, not "unset").
    for (uint64_t seed : {uint64_t{0}, uint64_t{12345}}) {
      const std::string a = gen(seed);
      EXPECT_FALSE(a.empty()) << api;
      EXPECT_EQ(gen(seed), a) << api << " seed " << seed;
      EXPECT_EQ(gen(seed), a) << api << " seed " << seed;
    }
  }
  // Both APIs draw the same tokens for the same seed.
  EXPECT_EQ(http(7), grpc_text(7));
}

TEST_F(RouterLimits, AdminListenerAnswersWhileClientsFloodTheApi) {
  StartWorker();
  StartRouter({"--http_max_connections", "24", "--http_max_connections_per_client", "8",
               "--http_idle_timeout_ms", "60000", "--http_read_timeout_ms", "60000"});
  // One client's idle connections: the first 8 stay open, the next are refused at once (429).
  std::vector<int> idle;
  for (int i = 0; i < 8; ++i) {
    const int fd = Connect(http_port_, "127.0.0.1");
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(300ms);  // accepted and counted
  for (int i = 0; i < 4; ++i) {
    const int fd = Connect(http_port_, "127.0.0.1", 5000ms);
    ASSERT_GE(fd, 0);
    const Reply r = Parse(ReadAll(fd));
    ::close(fd);
    EXPECT_EQ(r.status, 429) << r.body;
    EXPECT_NE(r.body.find("http_max_connections_per_client"), std::string::npos) << r.body;
  }
  // Another client is served meanwhile: a completion and the API port's /healthz.
  Reply c = Exchange(http_port_,
                     Request("POST", "/v1/completions",
                             R"({"prompt": "Once", "max_tokens": 4, "temperature": 0})"),
                     "127.0.0.2");
  EXPECT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(Exchange(http_port_, Request("GET", "/healthz"), "127.0.0.2").status, 200);
  // Two more clients fill the API's connection limit (24 = 3 x 8): every API connection is
  // refused now, and the admin listener still answers every probe.
  for (const char* from : {"127.0.0.3", "127.0.0.4"}) {
    for (int i = 0; i < 8; ++i) {
      const int fd = Connect(http_port_, from);
      ASSERT_GE(fd, 0);
      idle.push_back(fd);
    }
  }
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(Exchange(http_port_, Request("GET", "/healthz"), "127.0.0.5", 5000ms).status, 503);
  for (int i = 0; i < 5; ++i) {
    const Reply h = Exchange(admin_port_, Request("GET", "/healthz"), "127.0.0.1", 2000ms);
    EXPECT_EQ(h.status, 200) << h.body;
    EXPECT_NE(h.body.find("\"ok\""), std::string::npos) << h.body;
    EXPECT_EQ(Exchange(admin_port_, Request("GET", "/livez"), "127.0.0.1", 2000ms).status, 200);
    const Reply m = Exchange(admin_port_, Request("GET", "/metrics"), "127.0.0.1", 2000ms);
    EXPECT_EQ(m.status, 200);
    EXPECT_EQ(MetricValue(m.body,
                          "sparsex_router_http_closed_total{reason=\"client_connection_limit\"}"),
              4.0);
  }
  // The admin listener serves nothing else.
  EXPECT_EQ(Exchange(admin_port_, Request("POST", "/v1/completions", R"({"prompt": "x"})"),
                     "127.0.0.1", 2000ms)
                .status,
            404);
  for (int fd : idle) ::close(fd);
}

TEST_F(RouterLimits, OneClientCannotTakeEveryStream) {
  StartWorker();
  // The router keeps a frozen worker's connection for 30 s: its completions stay in flight.
  StartRouter({"--http_threads", "8", "--http_max_streams_per_client", "2",
               "--worker_keepalive_timeout_ms", "30000"});
  worker_->Signal(SIGSTOP);
  const std::string body =
      R"({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": true})";
  std::vector<int> held;
  for (int i = 0; i < 2; ++i) {
    const int fd = Connect(http_port_, "127.0.0.1", 30000ms);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, Request("POST", "/v1/completions", body)));
    held.push_back(fd);
  }
  std::this_thread::sleep_for(500ms);  // both read and handed to generation threads
  // The third from the same client: 429 at once, saying why.
  const Clock::time_point t0 = Clock::now();
  const Reply third = Exchange(http_port_, Request("POST", "/v1/completions", body), "127.0.0.1",
                               5000ms);
  EXPECT_EQ(third.status, 429) << third.body;
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_NE(third.body.find("http_max_streams_per_client"), std::string::npos) << third.body;
  // Another client's completion is accepted (in flight too, until the worker resumes).
  const int other = Connect(http_port_, "127.0.0.2", 30000ms);
  ASSERT_GE(other, 0);
  ASSERT_TRUE(SendAll(other, Request("POST", "/v1/completions", body)));
  held.push_back(other);
  std::this_thread::sleep_for(500ms);
  worker_->Signal(SIGCONT);
  for (int fd : held) {
    const std::string got = ReadAll(fd);
    ::close(fd);
    EXPECT_EQ(Parse(got).status, 200) << got.substr(0, 300);
    EXPECT_NE(got.find("[DONE]"), std::string::npos) << got.substr(0, 300);
  }
  // Its streams done, the client is served again.
  const Reply again = Exchange(http_port_, Request("POST", "/v1/completions", body));
  EXPECT_EQ(again.status, 200) << again.body;
}

}  // namespace
}  // namespace sparsex
