// Router faults, each against real processes on 127.0.0.1:
// one sparsex-router and two sparsex-workers (stories260K on the CPU, static membership, no
// etcd), started per test and stopped by PID. docs/reliability.md "Router front end and
// worker faults".
//   - HealthAndMetricsAnswerUnderIdleTricklingConnectionsAndStreams: 70 idle or
//     trickling connections plus 70 streams looping; every /healthz and /metrics probe answers
//     within 1 s, and a completion still completes.
//   - ConnectionLimitAndTimeoutsRefuseQuickly: over --http_max_connections a
//     connection gets 503 at once; idle and trickling connections get 408 after their
//     timeouts.
//   - AbandonedNonStreamingRequestsStopGenerating: 10 non-streaming completions
//     whose sockets close after 0.3 s stop generating at the worker promptly.
//   - FrozenWorkerIsRoutedAroundAndUnstartedRequestsRetried: one worker SIGSTOPped;
//     every request succeeds within a bound, the router marks it unhealthy within ~2 s;
//     SIGCONT at the end and it serves again.
//   - FrozenWorkerMidGenerationNonStreamingRequestsStartOver: a non-streaming
//     request whose worker freezes mid-generation (nothing sent to the client yet) starts over
//     on the other worker and succeeds.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
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

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Value of the first sample line of `metric` (name with labels, exactly as rendered).
double MetricValue(const std::string& page, const std::string& metric) {
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(metric + " ", 0) == 0) return std::stod(line.substr(metric.size() + 1));
  }
  return NAN;
}

int Connect(int port, std::chrono::milliseconds rcv_timeout = 5000ms) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval tv{static_cast<time_t>(rcv_timeout.count() / 1000),
             static_cast<suseconds_t>((rcv_timeout.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  timeval stv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &stv, sizeof stv);
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

// Reads until the peer closes or the receive timeout; the bytes read.
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

int StatusOf(const std::string& resp) {
  if (resp.rfind("HTTP/1.", 0) != 0) return 0;
  return std::atoi(resp.c_str() + resp.find(' ') + 1);
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

struct Timed {
  int status = 0;
  std::string body;
  double ms = 0;
};

// One HTTP exchange, bounded by `timeout` (status 0: no complete answer in time).
Timed Exchange(int port, const std::string& req, std::chrono::milliseconds timeout) {
  Timed t;
  const Clock::time_point t0 = Clock::now();
  const int fd = Connect(port, timeout);
  if (fd >= 0) {
    if (SendAll(fd, req)) {
      const std::string resp = ReadAll(fd);
      t.status = StatusOf(resp);
      const size_t e = resp.find("\r\n\r\n");
      if (e != std::string::npos) t.body = resp.substr(e + 4);
    }
    ::close(fd);
  }
  t.ms = Ms(Clock::now() - t0);
  if (t.ms > timeout.count()) t.status = 0;
  return t;
}

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str(), nullptr, false);
}

class RouterFaults : public ::testing::Test {
 protected:
  struct Worker {
    std::unique_ptr<ct::ChildProcess> proc;
    int grpc_port = 0, metrics_port = 0;
    std::string Metrics() const {
      auto r = ct::HttpGet(metrics_port, "/metrics");
      return r.ok() ? *r : "";
    }
  };

  void SetUp() override {
    dir_ = ct::MakeTempDir("sparsex-router-faults");
    model_ = sparsex::testing::ModelsDir() + "/stories260K/stories260K.gguf";
    if (!std::ifstream(model_).good()) GTEST_SKIP() << "model " << model_ << " not found";
  }
  void TearDown() override {
    if (router_) router_->Stop(5s);
    for (Worker& w : workers_) {
      if (w.proc) {
        w.proc->Signal(SIGCONT);  // a frozen one must be able to stop
        w.proc->Stop(5s);
      }
    }
    if (HasFailure()) {
      for (const char* log : {"router.log", "worker0.log", "worker1.log"}) {
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

  // Waits for a ready file written by `proc`.
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

  void StartWorkers(int n, const std::vector<std::string>& extra = {}) {
    for (int i = 0; i < n; ++i) {
      const std::string ready = dir_ + "/worker" + std::to_string(i) + ".ready";
      std::vector<std::string> argv = {ct::BinDir() + "/sparsex-worker", "--model", model_,
                                       "--device", "cpu", "--port", "0", "--metrics_port", "0",
                                       "--worker_id", "worker-" + std::to_string(i),
                                       "--kv_blocks", "1024", "--load_report_ms", "100",
                                       "--insecure_loopback", "--ready_file", ready};
      argv.insert(argv.end(), extra.begin(), extra.end());
      auto p = ct::ChildProcess::Spawn(argv, dir_ + "/worker" + std::to_string(i) + ".log");
      ASSERT_TRUE(p.ok()) << p.status();
      Worker w;
      w.proc = std::move(*p);
      json j = WaitReady(*w.proc, ready);
      ASSERT_TRUE(j.is_object()) << "worker " << i << " did not start";
      w.grpc_port = j["grpc_port"];
      w.metrics_port = j["metrics_port"];
      workers_.push_back(std::move(w));
    }
  }

  void StartRouter(const std::vector<std::string>& extra = {}) {
    std::string members;
    for (const Worker& w : workers_) {
      members += (members.empty() ? "" : ",") + std::string("127.0.0.1:") +
                 std::to_string(w.grpc_port);
    }
    const std::string ready = dir_ + "/router.ready";
    std::vector<std::string> argv = {ct::BinDir() + "/sparsex-router", "--model", model_,
                                     "--workers", members, "--grpc_address", "127.0.0.1:0",
                                     "--http_address", "127.0.0.1:0", "--insecure_loopback",
                                     "--ready_file", ready};
    // Every client here is 127.0.0.1 and stands for many users (70 streams at once): no
    // per-client stream limit (router_limits_e2e_test covers it).
    argv.insert(argv.end(), {"--http_max_streams_per_client", "-1"});
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = ct::ChildProcess::Spawn(argv, dir_ + "/router.log");
    ASSERT_TRUE(p.ok()) << p.status();
    router_ = std::move(*p);
    json j = WaitReady(*router_, ready);
    ASSERT_TRUE(j.is_object()) << "router did not start";
    http_port_ = j["http_port"];
    grpc_port_ = j["grpc_port"];
    ASSERT_TRUE(WaitHealthy(static_cast<int>(workers_.size()), 30s));
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port_),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::SparseX::NewStub(channel_);
  }

  int HealthyWorkers() {
    Timed t = Exchange(http_port_, Request("GET", "/healthz"), 2000ms);
    json j = json::parse(t.body, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return -1;
    return j.value("healthy_workers", -1);
  }
  bool WaitHealthy(int n, std::chrono::milliseconds timeout) {
    const Clock::time_point end = Clock::now() + timeout;
    while (Clock::now() < end) {
      if (HealthyWorkers() == n) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }
  std::string RouterMetrics() {
    return Exchange(http_port_, Request("GET", "/metrics"), 3000ms).body;
  }
  double WorkerTokens() {  // tokens generated by every worker so far (first + later ones)
    double sum = 0;
    for (const Worker& w : workers_) {
      const std::string m = w.Metrics();
      sum += MetricValue(m, "sparsex_worker_ttft_seconds_count") +
             MetricValue(m, "sparsex_worker_inter_token_seconds_count");
    }
    return sum;
  }
  double WorkerRunning() {
    double sum = 0;
    for (const Worker& w : workers_) sum += MetricValue(w.Metrics(), "sparsex_worker_running");
    return sum;
  }

  static std::string Completion(int max_tokens, bool stream) {
    return json{{"prompt", "Once upon a time"},
                {"max_tokens", max_tokens},
                {"ignore_eos", true},
                {"temperature", 0},
                {"stream", stream}}
        .dump();
  }

  std::string dir_, model_;
  std::vector<Worker> workers_;
  std::unique_ptr<ct::ChildProcess> router_;
  int http_port_ = 0, grpc_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::SparseX::Stub> stub_;
};

// HTTP starvation: 70 idle or trickling connections and 70 streams used to take all 64 civetweb
// threads (one-hour request timeout): /healthz, /metrics and completions timed out.
TEST_F(RouterFaults, HealthAndMetricsAnswerUnderIdleTricklingConnectionsAndStreams) {
  StartWorkers(2);
  StartRouter();
  // 35 idle connections (never send a byte) and 35 trickling ones (a request head one byte
  // every 200 ms, within the default idle timeout, so they stay open for the whole probe).
  std::vector<int> idle, trickle;
  for (int i = 0; i < 35; ++i) {
    const int a = Connect(http_port_), b = Connect(http_port_);
    ASSERT_GE(a, 0);
    ASSERT_GE(b, 0);
    idle.push_back(a);
    trickle.push_back(b);
  }
  std::atomic<bool> stop{false};
  std::thread trickler([&] {
    const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " +
                             std::string(200, 'a');
    for (size_t i = 0; !stop && i < head.size(); ++i) {
      for (int fd : trickle) ::send(fd, &head[i], 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(200ms);
    }
  });
  // 70 streams, each re-opened when it ends, until the probes are done.
  std::atomic<int> streams_done{0}, streams_bad{0};
  std::vector<std::thread> streamers;
  for (int i = 0; i < 70; ++i) {
    streamers.emplace_back([&] {
      while (!stop) {
        const int fd = Connect(http_port_, 30000ms);
        if (fd < 0) {
          ++streams_bad;
          std::this_thread::sleep_for(50ms);
          continue;
        }
        SendAll(fd, Request("POST", "/v1/completions", Completion(200, true)));
        std::string got = ReadAll(fd);
        ::close(fd);
        if (StatusOf(got) == 200 && got.find("[DONE]") != std::string::npos) ++streams_done;
        else if (!stop) ++streams_bad;
      }
    });
  }
  std::this_thread::sleep_for(1s);  // every generation thread busy, streams queued
  // Probes: /healthz and /metrics alternately for 6 s, each bounded by 1 s.
  int probes = 0, failed = 0;
  double worst = 0;
  std::string why;
  const Clock::time_point end = Clock::now() + 6s;
  while (Clock::now() < end) {
    const bool health = probes % 2 == 0;
    Timed t = Exchange(http_port_, Request("GET", health ? "/healthz" : "/metrics"), 1000ms);
    ++probes;
    worst = std::max(worst, t.ms);
    const bool ok = t.status == 200 && (health ? t.body.find("\"ok\"") != std::string::npos
                                               : t.body.find("sparsex_router_requests_total") !=
                                                     std::string::npos);
    if (!ok) {
      ++failed;
      why = (health ? "/healthz " : "/metrics ") + std::to_string(t.status) + " after " +
            std::to_string(t.ms) + " ms";
    }
    std::this_thread::sleep_for(100ms);
  }
  // A non-streaming completion still completes (it waits for a generation thread at worst).
  Timed c = Exchange(http_port_, Request("POST", "/v1/completions", Completion(8, false)),
                     30000ms);
  const std::string m = RouterMetrics();
  stop = true;
  trickler.join();
  for (std::thread& t : streamers) t.join();
  for (int fd : idle) ::close(fd);
  for (int fd : trickle) ::close(fd);
  EXPECT_EQ(failed, 0) << failed << " of " << probes << " probes failed, last: " << why;
  EXPECT_LT(worst, 1000.0);
  EXPECT_GE(probes, 30);
  EXPECT_EQ(c.status, 200) << c.body;
  EXPECT_GT(streams_done.load(), 0);
  EXPECT_EQ(streams_bad.load(), 0);
  std::cerr << "probes " << probes << ", worst " << worst << " ms; streams completed "
            << streams_done << "; completion " << c.ms << " ms; open connections "
            << MetricValue(m, "sparsex_router_http_connections") << "\n";
}

// HTTP starvation: the limits are enforced (flags with small values here).
TEST_F(RouterFaults, ConnectionLimitAndTimeoutsRefuseQuickly) {
  StartWorkers(1);
  StartRouter({"--http_max_connections", "16", "--http_idle_timeout_ms", "600",
               "--http_read_timeout_ms", "1500"});
  // 16 idle connections fill the limit (the probes above closed theirs).
  std::this_thread::sleep_for(300ms);
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) idle.push_back(Connect(http_port_, 3000ms));
  std::this_thread::sleep_for(100ms);
  // One more: 503 (or a close) at once, not a wait.
  {
    const Clock::time_point t0 = Clock::now();
    const int fd = Connect(http_port_, 2000ms);
    ASSERT_GE(fd, 0);
    SendAll(fd, Request("GET", "/healthz"));
    const std::string resp = ReadAll(fd);
    ::close(fd);
    const double ms = Ms(Clock::now() - t0);
    EXPECT_LT(ms, 1000.0);
    EXPECT_TRUE(resp.empty() || StatusOf(resp) == 503) << resp.substr(0, 200);
  }
  // The idle ones are answered 408 and closed after ~600 ms.
  {
    const Clock::time_point t0 = Clock::now();
    int got_408 = 0;
    for (int fd : idle) {
      const std::string resp = ReadAll(fd);  // until the server closes (3 s receive timeout)
      got_408 += StatusOf(resp) == 408 ? 1 : 0;
      ::close(fd);
    }
    const double ms = Ms(Clock::now() - t0);
    EXPECT_EQ(got_408, 16);
    EXPECT_LT(ms, 2000.0);
  }
  // A trickling request (one byte every 100 ms: never idle) is cut at the read timeout.
  {
    const int fd = Connect(http_port_, 5000ms);
    ASSERT_GE(fd, 0);
    const Clock::time_point t0 = Clock::now();
    const std::string head = "POST /v1/completions HTTP/1.1\r\nX-Pad: " + std::string(100, 'a');
    std::atomic<bool> stop{false};
    std::thread t([&] {
      for (size_t i = 0; !stop && i < head.size(); ++i) {
        if (::send(fd, &head[i], 1, MSG_NOSIGNAL) != 1) break;
        std::this_thread::sleep_for(100ms);
      }
    });
    const std::string resp = ReadAll(fd);
    const double ms = Ms(Clock::now() - t0);
    stop = true;
    t.join();
    ::close(fd);
    EXPECT_EQ(StatusOf(resp), 408) << resp.substr(0, 200);
    EXPECT_GE(ms, 1400.0);
    EXPECT_LT(ms, 2500.0);
  }
  // Served again once the connections are gone.
  Timed h = Exchange(http_port_, Request("GET", "/healthz"), 1000ms);
  EXPECT_EQ(h.status, 200);
  const std::string m = RouterMetrics();
  EXPECT_GE(MetricValue(m, "sparsex_router_http_closed_total{reason=\"connection_limit\"}"), 1);
  EXPECT_GE(MetricValue(m, "sparsex_router_http_closed_total{reason=\"idle_timeout\"}"), 16);
  EXPECT_GE(MetricValue(m, "sparsex_router_http_closed_total{reason=\"read_timeout\"}"), 1);
}

// Abandoned requests: non-streaming completions whose clients close the connection used to run to the
// end (10 requests closed after 0.3 s produced 20,000 tokens).
TEST_F(RouterFaults, AbandonedNonStreamingRequestsStopGenerating) {
  // Two sequences at a time: run to the end, the ten requests would keep the worker busy for
  // well over a second (stories260K decodes a few thousand tokens a second here).
  StartWorkers(1, {"--max_running", "2"});
  StartRouter();
  const double before = WorkerTokens();
  constexpr int kRequests = 10, kMaxTokens = 480;
  std::vector<int> fds;
  for (int i = 0; i < kRequests; ++i) {
    const int fd = Connect(http_port_);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, Request("POST", "/v1/completions", Completion(kMaxTokens, false))));
    fds.push_back(fd);
  }
  // Close as soon as generation has begun: a fixed wait let a fast machine finish four of the
  // ten requests (CI: 1984 tokens in 300 ms), which is no test of abandonment.
  const Clock::time_point sent = Clock::now();
  while (WorkerTokens() == before && Clock::now() - sent < 10s) std::this_thread::sleep_for(2ms);
  ASSERT_GT(WorkerTokens(), before) << "no generation began within 10 s";
  for (int fd : fds) ::close(fd);
  const Clock::time_point closed = Clock::now();
  // Generation stops: within 500 ms no running sequence and a token count that held still for
  // 100 ms (the running gauge alone can be read before the scheduler published the first
  // admissions: CI once saw 0 running at once, then 70 more tokens), and it stays put.
  double running = -1, at_stop = -1;
  while (Clock::now() - closed < 500ms) {
    running = WorkerRunning();
    const double tokens = WorkerTokens();
    std::this_thread::sleep_for(100ms);
    if (running == 0 && WorkerRunning() == 0 && WorkerTokens() == tokens) {
      at_stop = tokens;
      break;
    }
    running = -1;
  }
  const double stopped_ms = Ms(Clock::now() - closed);
  if (at_stop < 0) at_stop = WorkerTokens();
  std::this_thread::sleep_for(1000ms);
  const double later = WorkerTokens();
  const std::string wm = workers_[0].Metrics();
  EXPECT_EQ(running, 0) << "still running " << stopped_ms << " ms after the clients left";
  EXPECT_EQ(later, at_stop) << "tokens still being generated";
  const double generated = later - before;
  // Run to the end they would make kRequests * kMaxTokens tokens.
  EXPECT_LT(generated, kRequests * kMaxTokens / 2.0);
  // Every request is accounted for at the router (a request whose client left before it was
  // forwarded never reaches the worker): at most the two running ones finished, the rest were
  // cancelled, at the router or at the worker.
  const std::string rm = RouterMetrics();
  auto count = [](const std::string& page, const std::string& sample) {  // absent counts 0
    const double v = MetricValue(page, sample);
    return std::isnan(v) ? 0.0 : v;
  };
  const std::string http = "sparsex_router_requests_total{api=\"http\",outcome=";
  EXPECT_EQ(count(rm, http + "\"ok\"}") + count(rm, http + "\"cancelled\"}"), kRequests);
  EXPECT_LE(count(rm, http + "\"ok\"}"), 2);
  EXPECT_LE(count(wm, "sparsex_worker_requests_total{outcome=\"ok\"}"), 2);
  std::cerr << "generated " << generated << " tokens (of " << kRequests * kMaxTokens
            << " requested); worker idle " << stopped_ms << " ms after the close\n";
}

// A frozen worker (SIGSTOP) kept getting requests until its etcd lease expired, and
// its requests stalled ~15 s. Here membership is static, so nothing but the router's own
// detection can take it out.
TEST_F(RouterFaults, FrozenWorkerIsRoutedAroundAndUnstartedRequestsRetried) {
  StartWorkers(2);
  StartRouter();
  auto generate = [&](int i, std::chrono::milliseconds deadline) {
    v1::GenerateRequest r;
    r.set_prompt("Once upon a time " + std::to_string(i));
    r.mutable_sampling()->set_temperature(0);
    r.mutable_sampling()->set_max_tokens(8);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    auto reader = stub_->Generate(&ctx, r);
    v1::GenerateResponse m;
    std::string worker;
    while (reader->Read(&m)) {
      if (m.finished()) worker = m.worker();
    }
    grpc::Status s = reader->Finish();
    return std::make_pair(s, worker);
  };
  // Both workers serve.
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(generate(i, 10s).first.ok());

  workers_[1].proc->Signal(SIGSTOP);
  const Clock::time_point frozen = Clock::now();
  // 16 requests at once, right after the freeze (some are routed to the frozen worker), then
  // one every 100 ms for 3 s.
  std::atomic<int> failed{0};
  std::atomic<double> worst{0};
  std::string last_error;
  std::mutex mu;
  auto one = [&](int i) {
    const Clock::time_point t0 = Clock::now();
    auto [s, worker] = generate(i, 15s);
    const double ms = Ms(Clock::now() - t0);
    double w = worst.load();
    while (ms > w && !worst.compare_exchange_weak(w, ms)) {
    }
    if (!s.ok() || worker == "worker-1") {
      ++failed;
      std::lock_guard<std::mutex> l(mu);
      last_error = s.error_message() + " worker " + worker;
    }
  };
  // When /healthz first shows one healthy worker (polled every 50 ms).
  std::atomic<double> unhealthy_at{-1};
  std::thread watcher([&] {
    while (Clock::now() - frozen < 6s) {
      if (HealthyWorkers() == 1) {
        unhealthy_at = Ms(Clock::now() - frozen);
        return;
      }
      std::this_thread::sleep_for(50ms);
    }
  });
  std::vector<std::thread> burst;
  for (int i = 0; i < 16; ++i) burst.emplace_back(one, 100 + i);
  int sequential = 0;
  while (Clock::now() - frozen < 3s) {
    one(200 + sequential++);
    std::this_thread::sleep_for(100ms);
  }
  for (std::thread& t : burst) t.join();
  watcher.join();
  const double unhealthy_ms = unhealthy_at.load();
  const std::string m = RouterMetrics();
  EXPECT_EQ(failed.load(), 0) << last_error;
  EXPECT_LT(worst.load(), 5000.0) << "a request took too long";
  EXPECT_GE(unhealthy_ms, 0) << "the frozen worker was never marked unhealthy";
  EXPECT_LT(unhealthy_ms, 2500.0);
  std::cerr << "frozen worker unhealthy after " << unhealthy_ms << " ms; slowest request "
            << worst.load() << " ms; " << 16 + sequential << " requests; retries (unavailable) "
            << MetricValue(m, "sparsex_router_retries_total{code=\"unavailable\"}") << "\n";

  // Thawed, it comes back and serves again.
  workers_[1].proc->Signal(SIGCONT);
  EXPECT_TRUE(WaitHealthy(2, 15s));
}

// A frozen worker, the rest of "retry what has not started": a non-streaming HTTP request sends the
// client nothing until the end, so one whose worker freezes mid-generation starts over on the
// other worker instead of failing with "failed after streaming".
TEST_F(RouterFaults, FrozenWorkerMidGenerationNonStreamingRequestsStartOver) {
  StartWorkers(2, {"--max_running", "1"});  // one sequence at a time: the rest queue
  StartRouter();
  constexpr int kRequests = 6, kTokens = 1500;  // ~0.5 s of decoding each, one at a time
  std::vector<Timed> results(kRequests);
  std::vector<std::thread> clients;
  for (int i = 0; i < kRequests; ++i) {
    clients.emplace_back([&, i] {
      results[i] = Exchange(http_port_, Request("POST", "/v1/completions", Completion(kTokens, false)),
                            60000ms);
    });
  }
  // Freeze worker-1 while a request is mid-generation: it has its first token (more first
  // tokens than finished requests), and 60 ms later the same is true of the same request, so
  // its tokens have reached the router (the worker sends every 20 ms).
  auto state = [&] {
    const std::string wm = workers_[1].Metrics();
    double finished = 0;
    for (const char* o : {"ok", "cancelled"}) {
      const double v = MetricValue(wm, std::string("sparsex_worker_requests_total{outcome=\"") + o + "\"}");
      if (!std::isnan(v)) finished += v;
    }
    return std::make_pair(MetricValue(wm, "sparsex_worker_ttft_seconds_count"), finished);
  };
  bool frozen = false;
  const Clock::time_point end = Clock::now() + 20s;
  while (!frozen && Clock::now() < end) {
    const auto a = state();
    if (a.first > a.second) {
      std::this_thread::sleep_for(60ms);
      if (state() == a) {
        workers_[1].proc->Signal(SIGSTOP);
        frozen = true;
        continue;
      }
    }
    std::this_thread::sleep_for(5ms);
  }
  for (std::thread& t : clients) t.join();
  ASSERT_TRUE(frozen) << "worker-1 never generated";
  const std::string m = RouterMetrics();
  int ok = 0;
  double worst = 0;
  for (const Timed& r : results) {
    worst = std::max(worst, r.ms);
    json j = json::parse(r.body, nullptr, false);
    if (r.status != 200 || j.is_discarded()) {
      ADD_FAILURE() << r.status << " " << r.body.substr(0, 300);
      continue;
    }
    EXPECT_EQ(j["usage"]["completion_tokens"], kTokens);
    EXPECT_EQ(j["usage"]["sparsex"]["worker"], "worker-0") << r.body.substr(0, 300);
    ++ok;
  }
  EXPECT_EQ(ok, kRequests);
  EXPECT_LT(worst, 30000.0);
  EXPECT_GE(MetricValue(m, "sparsex_router_restarts_total"), 1) << "no request was mid-generation";
  std::cerr << "restarted " << MetricValue(m, "sparsex_router_restarts_total")
            << ", retried before a token "
            << MetricValue(m, "sparsex_router_retries_total{code=\"unavailable\"}")
            << "; slowest " << worst << " ms\n";
  workers_[1].proc->Signal(SIGCONT);
}

}  // namespace
}  // namespace sparsex
