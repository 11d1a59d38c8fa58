#include <algorithm>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "proto/grpc_health.h"
#include "proto/grpc_status.h"
#include "proto/sparsex.grpc.pb.h"
#include "router/frontends.h"
#include "router/router.h"

namespace sparsex::router {
namespace {

class SparseXService final : public v1::SparseX::Service {
 public:
  explicit SparseXService(Router* r) : r_(r) {}

  // The caller's tenant from the "authorization" metadata ("Bearer <key>"); UNAUTHENTICATED
  // without a valid key when keys are configured.
  absl::StatusOr<std::shared_ptr<const Tenant>> Caller(grpc::ServerContext* ctx) {
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    std::string_view v;
    if (it != md.end()) v = std::string_view(it->second.data(), it->second.size());
    return r_->auth().Authenticate(v);
  }

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    auto tenant = Caller(ctx);
    if (!tenant.ok()) return ToGrpcStatus(tenant.status());
    CallControl ctl;
    ctl.tenant = *tenant;
    ctl.grpc_parent = ctx;
    ctl.deadline = ctx->deadline();
    ctl.api = "grpc";
    absl::Status s = r_->Generate(
        *req, [writer](const v1::GenerateResponse& m) { return writer->Write(m); }, ctl);
    return ToGrpcStatus(s);
  }

  grpc::Status Tokenize(grpc::ServerContext* ctx, const v1::TokenizeRequest* req,
                        v1::TokenizeResponse* resp) override {
    auto tenant = Caller(ctx);
    if (!tenant.ok()) return ToGrpcStatus(tenant.status());
    auto r = r_->Tokenize(*req);
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = std::move(*r);
    return grpc::Status::OK;
  }

  grpc::Status ListModels(grpc::ServerContext* ctx, const v1::ListModelsRequest*,
                          v1::ListModelsResponse* resp) override {
    auto tenant = Caller(ctx);
    if (!tenant.ok()) return ToGrpcStatus(tenant.status());
    *resp = r_->ListModels(tenant->get());
    return grpc::Status::OK;
  }

  grpc::Status Health(grpc::ServerContext* ctx, const v1::HealthRequest*,
                      v1::HealthResponse* resp) override {
    auto tenant = Caller(ctx);
    if (!tenant.ok()) return ToGrpcStatus(tenant.status());
    *resp = r_->Health(tenant->get());
    return grpc::Status::OK;
  }

 private:
  Router* r_;
};

}  // namespace

struct GrpcFrontend::Impl {
  std::unique_ptr<SparseXService> service;
  std::unique_ptr<grpc::Server> server;
  // grpc.health.v1 status of "sparsex.v1.SparseX": SERVING while at least one healthy worker
  // serves the model (what /healthz says), so a gRPC readiness probe takes a router without
  // workers out of rotation; "" (liveness) stays SERVING until shutdown, so losing every
  // worker never restarts routers. Worker health changes inside Router (etcd, keepalive,
  // failed calls) without a notification, so this thread follows it.
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread watcher;
};

namespace {
constexpr char kServiceName[] = "sparsex.v1.SparseX";
constexpr auto kHealthFollowPeriod = std::chrono::milliseconds(100);  // well under probe periods

// The largest request gRPC reads: the prompt text bound plus 8 MiB for token ids (a context's
// worth at a few bytes each) and the other fields, so a huge message is refused by gRPC before
// it is even parsed.
int MaxRequestBytes(const RouterOptions& o) {
  const size_t bytes = o.max_prompt_bytes + (size_t{8} << 20);
  return static_cast<int>(std::min<size_t>(bytes, std::numeric_limits<int>::max()));
}
}  // namespace

absl::StatusOr<std::unique_ptr<GrpcFrontend>> GrpcFrontend::Start(Router* router,
                                                                  const std::string& address) {
  std::unique_ptr<GrpcFrontend> f(new GrpcFrontend());
  f->impl_ = std::make_unique<Impl>();
  f->impl_->service = std::make_unique<SparseXService>(router);
  EnableGrpcStandardServices();
  grpc::ServerBuilder b;
  b.AddListeningPort(address, grpc::InsecureServerCredentials(), &f->port_);
  b.RegisterService(f->impl_->service.get());
  b.SetMaxReceiveMessageSize(MaxRequestBytes(router->options()));
  f->impl_->server = b.BuildAndStart();
  if (!f->impl_->server || f->port_ == 0) {
    return absl::UnavailableError("router: cannot listen on " + address + " (gRPC)");
  }
  Impl* impl = f->impl_.get();
  bool serving = router->Health().serving();
  SetGrpcServiceServing(impl->server.get(), kServiceName, serving);
  impl->watcher = std::thread([impl, router, serving]() mutable {
    std::unique_lock<std::mutex> l(impl->mu);
    while (!impl->cv.wait_for(l, kHealthFollowPeriod, [impl] { return impl->stop; })) {
      const bool now = router->Health().serving();
      if (now != serving) SetGrpcServiceServing(impl->server.get(), kServiceName, now);
      serving = now;
    }
  });
  return f;
}

GrpcFrontend::~GrpcFrontend() { Shutdown(); }

void GrpcFrontend::Shutdown() {
  if (impl_ && impl_->watcher.joinable()) {
    {
      std::lock_guard<std::mutex> l(impl_->mu);
      impl_->stop = true;
    }
    impl_->cv.notify_all();
    impl_->watcher.join();
  }
  if (impl_ && impl_->server) {
    SetGrpcServing(impl_->server.get(), false, {kServiceName});
    impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    impl_->server.reset();
  }
}

}  // namespace sparsex::router
