// The attacks of docs/security.md ("Attacks and their tests") against a real local cluster with
// its default credentials (deploy/local/cluster.sh: a CA, mutual TLS between router, workers and
// cache servers, API keys for tenants alice and bob), played as an attacker on 127.0.0.1 with
// network access and no credentials, or as another tenant. Each of these attacks worked against
// a cluster without credentials; each test asserts the attack fails, plus a positive control
// showing the same path works for the rightful caller.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cache_client/cache_client.h"
#include "common/etcd/etcd_client.h"
#include "common/etcd/http_client.h"
#include "gtest/gtest.h"
#include "proto/cache.grpc.pb.h"
#include "proto/grpc_tls.h"
#include "proto/sparsex.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "testing/server_process.h"

namespace sparsex {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;
namespace ct = cache::testing;

std::string Env(const char* name, const std::string& def = "") {
  const char* v = std::getenv(name);
  return v && *v ? v : def;
}
std::string SourceDir() { return Env("SPARSEX_SOURCE_DIR", SPARSEX_SOURCE_DIR); }
std::string BinDir() { return Env("SPARSEX_BIN_DIR", ct::BinDir()); }
std::string ModelsDir() { return Env("SPARSEX_MODELS", SourceDir() + "/../shared/models"); }
std::string Model() { return ModelsDir() + "/stories260K/stories260K.gguf"; }

std::pair<int, std::string> Shell(const std::string& cmd, std::chrono::milliseconds t = 120s) {
  auto r = ct::RunCommand(cmd, t);
  if (!r.ok()) return {-1, std::string(r.status().message())};
  return *r;
}

double MetricSum(const std::string& page, const std::string& name) {
  std::istringstream in(page);
  std::string line;
  double sum = 0;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) != 0) continue;
    const size_t sp = line.rfind(' ');
    sum += std::stod(line.substr(sp + 1));
  }
  return sum;
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    run_dir_ = ct::MakeTempDir("sparsex-security");
    const std::string cmd = "SPARSEX_RUN_DIR=" + run_dir_ + " SPARSEX_BIN_DIR=" + BinDir() +
                            " SPARSEX_MODELS=" + ModelsDir() + " " + SourceDir() +
                            "/deploy/local/cluster.sh up --workers 1 --cache-servers 1 "
                            "--grpc-port 0 --http-port 0 --tenants 'alice bob' "
                            "--worker-args '--load_report_ms 100' 2>&1";
    auto [rc, out] = Shell(cmd, 180s);
    ASSERT_EQ(rc, 0) << "cluster.sh up failed:\n" << out;
    std::ifstream in(run_dir_ + "/cluster.env");
    std::string line;
    while (std::getline(in, line)) {
      const size_t eq = line.find('=');
      if (eq != std::string::npos) env_[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  static void TearDownTestSuite() {
    if (impostor_) impostor_->Stop(5s);
    impostor_.reset();
    Shell("SPARSEX_RUN_DIR=" + run_dir_ + " " + SourceDir() +
              "/deploy/local/cluster.sh down --clean 2>&1",
          120s);
    ct::RemoveTree(run_dir_);
  }

  static std::string Cred(const std::string& rel) { return env_["CREDENTIALS"] + "/" + rel; }
  static TlsFiles ClusterTls(const std::string& role) {
    return {Cred("tls/ca.pem"), Cred("tls/" + role + ".pem"), Cred("tls/" + role + "-key.pem")};
  }
  // A second CA with certificates that look the same (same names, same cluster DNS name): a
  // stranger's, which the cluster must not trust.
  static TlsFiles RogueTls() {
    const std::string d = run_dir_ + "/rogue";
    if (!std::filesystem::exists(d + "/tls/worker.pem")) {
      auto [rc, out] = Shell(SourceDir() + "/deploy/local/make-credentials.sh " + d + " x 2>&1");
      EXPECT_EQ(rc, 0) << out;
    }
    return {d + "/tls/ca.pem", d + "/tls/worker.pem", d + "/tls/worker-key.pem"};
  }

  static std::shared_ptr<grpc::Channel> Channel(const std::string& addr, const TlsFiles& tls) {
    auto sec = ClientCredentials(tls);
    EXPECT_TRUE(sec.ok()) << sec.status();
    grpc::ChannelArguments args;
    sec->Apply(&args);
    return grpc::CreateCustomChannel(addr, sec->creds, args);
  }

  static http::HttpResponse Post(const std::string& path, const std::string& body,
                                 const std::string& key) {
    http::HttpRequestOptions o;
    o.timeout_ms = 60000;
    if (!key.empty()) o.headers.push_back({"Authorization", "Bearer " + key});
    auto r = http::HttpRequest(env_["ROUTER_HTTP"], "POST", path, body, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : http::HttpResponse{};
  }

  // Generate over the public gRPC API with `key` (none: no metadata); the final usage.
  static grpc::Status Generate(const std::string& key, const v1::GenerateRequest& req,
                               v1::Usage* usage) {
    auto stub = v1::SparseX::NewStub(
        grpc::CreateChannel(env_["ROUTER_GRPC"], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 60s);
    if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
      if (m.finished() && usage) *usage = m.usage();
    }
    return reader->Finish();
  }

  static v1::GenerateRequest DocRequest(const std::string& doc,
                                        const std::string& question = " Then she said") {
    v1::GenerateRequest req;
    req.add_segments()->set_text(doc);
    req.add_segments()->set_text(question);
    req.mutable_sampling()->set_max_tokens(1);
    return req;
  }

  static inline std::string run_dir_;
  static inline std::map<std::string, std::string> env_;
  static inline std::unique_ptr<ct::ChildProcess> impostor_;
};

TEST_F(SecurityTest, ApiRefusesMissingAndWrongKeys) {
  const std::string body = R"({"prompt":"Once upon a time","max_tokens":2})";
  http::HttpResponse none = Post("/v1/completions", body, "");
  EXPECT_EQ(none.status, 401) << none.body;
  EXPECT_EQ(none.Header("www-authenticate"), "Bearer");
  EXPECT_NE(none.body.find("invalid_api_key"), std::string::npos) << none.body;
  EXPECT_EQ(Post("/v1/completions", body, "sk-spx-not-a-key").status, 401);
  EXPECT_EQ(Post("/v1/chat/completions",
                 R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2})", "")
                .status,
            401);
  auto models = http::HttpRequest(env_["ROUTER_HTTP"], "GET", "/v1/models");
  ASSERT_TRUE(models.ok());
  EXPECT_EQ(models->status, 401);
  // Probes need no key.
  auto health = http::HttpRequest(env_["ROUTER_HTTP"], "GET", "/healthz");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
  // The rightful caller.
  http::HttpResponse ok = Post("/v1/completions", body, env_["API_KEY_ALICE"]);
  EXPECT_EQ(ok.status, 200) << ok.body;

  v1::Usage u;
  EXPECT_EQ(Generate("", DocRequest("Lily had a red ball."), &u).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Generate("wrong", DocRequest("Lily had a red ball."), &u).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Generate(env_["API_KEY_BOB"], DocRequest("Lily had a red ball."), &u).ok());
}

// ListModels and Health named the model fingerprint and every worker's address.
TEST_F(SecurityTest, TenantsSeeNoFingerprintsOrAddresses) {
  auto stub = v1::SparseX::NewStub(
      grpc::CreateChannel(env_["ROUTER_GRPC"], grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    v1::ListModelsResponse r;
    EXPECT_EQ(stub->ListModels(&ctx, {}, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer " + env_["API_KEY_ALICE"]);
  v1::ListModelsResponse r;
  ASSERT_TRUE(stub->ListModels(&ctx, {}, &r).ok());
  ASSERT_EQ(r.models_size(), 1);
  EXPECT_EQ(r.models(0).fingerprint(), "");
  grpc::ClientContext hctx;
  hctx.AddMetadata("authorization", "Bearer " + env_["API_KEY_ALICE"]);
  v1::HealthResponse h;
  ASSERT_TRUE(stub->Health(&hctx, {}, &h).ok());
  ASSERT_GE(h.workers_size(), 1);
  for (const auto& w : h.workers()) EXPECT_EQ(w.address(), "");
}

// the cache server answered Lease, Read, Reserve, Commit and Evict to anyone.
TEST_F(SecurityTest, CacheServerServesOnlyClusterMembers) {
  const std::string addr = env_["CACHE0_GRPC"];
  auto try_connect = [&](const TlsFiles& tls) {
    cache::CacheClientOptions o;
    o.address = addr;
    o.tls = tls;
    o.rpc_timeout_ms = 3000;
    return cache::CacheClient::Connect(o).status();
  };
  EXPECT_FALSE(try_connect({}).ok()) << "plaintext";
  EXPECT_FALSE(try_connect(RogueTls()).ok()) << "another CA's certificate";
  // TLS to the right server but no client certificate of the cluster's CA.
  TlsFiles server_only = RogueTls();
  server_only.ca = Cred("tls/ca.pem");
  EXPECT_FALSE(try_connect(server_only).ok()) << "a client certificate of another CA";
  EXPECT_TRUE(try_connect(ClusterTls("worker")).ok()) << "a cluster member";

  for (const TlsFiles& tls : {TlsFiles{}, RogueTls()}) {
    auto stub = cache::v1::CacheService::NewStub(Channel(addr, tls));
    auto ctx = [] {
      auto c = std::make_unique<grpc::ClientContext>();
      c->set_deadline(std::chrono::system_clock::now() + 3s);
      return c;
    };
    cache::v1::EvictRequest ev;
    ev.set_all(true);
    cache::v1::EvictResponse evr;
    EXPECT_FALSE(stub->Evict(ctx().get(), ev, &evr).ok()) << "Evict";
    cache::v1::ReserveRequest rs;
    cache::v1::ReserveResponse rsr;
    EXPECT_FALSE(stub->Reserve(ctx().get(), rs, &rsr).ok()) << "Reserve";
    cache::v1::LeaseRequest ls;
    cache::v1::LeaseResponse lsr;
    EXPECT_FALSE(stub->Lease(ctx().get(), ls, &lsr).ok()) << "Lease";
    cache::v1::ReadRequest rd;
    cache::v1::ReadResponse rdr;
    EXPECT_FALSE(stub->Read(ctx().get(), rd, &rdr).ok()) << "Read";
    cache::v1::EndpointRequest ep;
    cache::v1::EndpointResponse epr;
    EXPECT_FALSE(stub->GetEndpoint(ctx().get(), ep, &epr).ok()) << "GetEndpoint (UCX rkey)";
  }
}

// a worker's Replay listed every cached fingerprint to anyone.
TEST_F(SecurityTest, WorkerServesOnlyClusterMembers) {
  for (const TlsFiles& tls : {TlsFiles{}, RogueTls()}) {
    auto stub = worker::v1::Worker::NewStub(Channel(env_["WORKER0_GRPC"], tls));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 3s);
    worker::v1::ReplayResponse r;
    EXPECT_FALSE(stub->Replay(&ctx, {}, &r).ok());
  }
  auto stub = worker::v1::Worker::NewStub(Channel(env_["WORKER0_GRPC"], ClusterTls("router")));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  worker::v1::ReplayResponse r;
  EXPECT_TRUE(stub->Replay(&ctx, {}, &r).ok()) << "a cluster member";
}

// usage (reused tokens) told tenant B which document tenant A had sent.
TEST_F(SecurityTest, UsageNeverCountsAnotherTenantsSegments) {
  const std::string secret =
      "Tom's secret word is marigold. He kept it in a small box under his bed and told no one "
      "about it, not even his sister Sue, who liked to look for hidden things.";
  // Questions nobody sent before: only the document can be found.
  const std::string q = " The box was blue and";
  v1::Usage u;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(Generate(env_["API_KEY_ALICE"], DocRequest(secret, q), &u).ok());
  }
  EXPECT_GT(u.reused_tokens() + u.prefix_tokens(), 0) << "alice's own document is reused";
  v1::Usage b;
  ASSERT_TRUE(Generate(env_["API_KEY_BOB"], DocRequest(secret, q), &b).ok());
  EXPECT_EQ(b.reused_tokens(), 0) << "bob must not reuse alice's segment";
  EXPECT_EQ(b.prefix_tokens(), 0) << "bob must not hit alice's prefix blocks";
  EXPECT_EQ(b.segments_hit(), 0);
  // Bob's own copy is his to reuse.
  ASSERT_TRUE(Generate(env_["API_KEY_BOB"], DocRequest(secret, q), &b).ok());
  EXPECT_GT(b.reused_tokens() + b.prefix_tokens(), 0);
}

// a worker written into etcd by anyone received the users' requests.
TEST_F(SecurityTest, ImpostorWorkerInEtcdIsNeverRouted) {
  // The impostor is a real worker (it would answer correctly), without a cluster certificate.
  const std::string ready = run_dir_ + "/impostor.ready";
  auto p = ct::ChildProcess::Spawn({BinDir() + "/sparsex-worker", "--model", Model(), "--port",
                                    "0", "--metrics_port", "0", "--insecure_loopback",
                                    "--worker_id", "impostor", "--ready_file", ready},
                                   run_dir_ + "/impostor.log");
  ASSERT_TRUE(p.ok()) << p.status();
  impostor_ = std::move(*p);
  json info;
  for (int i = 0; i < 300 && info.is_null(); ++i) {
    std::ifstream in(ready);
    if (in) info = json::parse(in, nullptr, false);
    if (info.is_discarded()) info = json();
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(info.is_object()) << "impostor did not start";
  const std::string addr = "127.0.0.1:" + std::to_string(info["grpc_port"].get<int>());
  // Registered as the real worker registers itself (no lease: the attack as it was run).
  etcd::EtcdClient etcd(etcd::EtcdOptions{{env_["ETCD"]}, 2000});
  auto kvs = etcd.RangePrefix("/sparsex/workers/");
  ASSERT_TRUE(kvs.ok() && !kvs->empty());
  json real = json::parse((*kvs)[0].value);
  real["id"] = "worker-0b";
  real["address"] = addr;
  real["metrics_port"] = info["metrics_port"];
  ASSERT_TRUE(etcd.Put("/sparsex/workers/worker-0b", real.dump()).ok());
  std::this_thread::sleep_for(3s);  // the router polls membership every 200 ms

  for (int i = 0; i < 9; ++i) {
    http::HttpResponse r = Post("/v1/completions",
                                R"({"prompt":"Once upon a time )" + std::to_string(i) +
                                    R"(","max_tokens":2})",
                                env_["API_KEY_ALICE"]);
    EXPECT_EQ(r.status, 200) << r.body;
  }
  auto page = http::HttpRequest("127.0.0.1:" + std::to_string(info["metrics_port"].get<int>()),
                                "GET", "/metrics");
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(MetricSum(page->body, "sparsex_worker_requests_total"), 0)
      << "the impostor received requests";
  etcd.Put("/sparsex/workers/worker-0b", "{}").IgnoreError();
}

// Plaintext (or an API without keys) is for a loopback test cluster only.
TEST_F(SecurityTest, NoCredentialsRefusedOffLoopback) {
  auto run = [](const std::string& args) {
    return Shell("timeout 30 " + BinDir() + "/" + args + " 2>&1", 40s);
  };
  auto [rc1, out1] = run("sparsex-cache-server --address 0.0.0.0 --insecure_loopback "
                         "--disk_backend none --metrics_port -1");
  EXPECT_NE(rc1, 0) << out1;
  EXPECT_NE(out1.find("not on loopback"), std::string::npos) << out1;
  auto [rc2, out2] = run("sparsex-worker --model " + Model() +
                         " --address 0.0.0.0 --insecure_loopback --metrics_port -1");
  EXPECT_NE(rc2, 0) << out2;
  EXPECT_NE(out2.find("not on loopback"), std::string::npos) << out2;
  auto [rc3, out3] = run("sparsex-router --model " + Model() +
                         " --workers 127.0.0.1:1 --http_address 0.0.0.0:0 --insecure_loopback");
  EXPECT_NE(rc3, 0) << out3;
  EXPECT_NE(out3.find("not on loopback"), std::string::npos) << out3;
  // Without the flag even loopback needs it said.
  auto [rc4, out4] = run("sparsex-router --model " + Model() + " --workers 127.0.0.1:1");
  EXPECT_NE(rc4, 0) << out4;
  EXPECT_NE(out4.find("insecure_loopback"), std::string::npos) << out4;
}

}  // namespace
}  // namespace sparsex
