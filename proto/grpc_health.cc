#include "proto/grpc_health.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

namespace sparsex {

void EnableGrpcStandardServices() {
  grpc::EnableDefaultHealthCheckService(true);
  // Registers the reflection plugin with every ServerBuilder created from now on. Calling it
  // also keeps the linker from dropping libgrpc++_reflection (it otherwise registers itself
  // from a static initializer nothing references).
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
}

void SetGrpcServing(grpc::Server* server, bool serving, const std::vector<std::string>& services) {
  if (server == nullptr) return;
  grpc::HealthCheckServiceInterface* h = server->GetHealthCheckService();
  if (h == nullptr) return;  // EnableGrpcStandardServices was not called before the build
  h->SetServingStatus(serving);
  for (const std::string& s : services) h->SetServingStatus(s, serving);
}

void SetGrpcServiceServing(grpc::Server* server, const std::string& service, bool serving) {
  if (server == nullptr) return;
  grpc::HealthCheckServiceInterface* h = server->GetHealthCheckService();
  if (h != nullptr) h->SetServingStatus(service, serving);
}

}  // namespace sparsex
