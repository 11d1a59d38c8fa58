#include "proto/grpc_health.h"

#include <grpcpp/health_check_service_interface.h>

namespace sparsex {

void EnableGrpcHealth() { grpc::EnableDefaultHealthCheckService(true); }

void SetGrpcServing(grpc::Server* server, bool serving, const std::vector<std::string>& services) {
  if (server == nullptr) return;
  grpc::HealthCheckServiceInterface* h = server->GetHealthCheckService();
  if (h == nullptr) return;  // EnableGrpcHealth was not called before the server was built
  h->SetServingStatus(serving);
  for (const std::string& s : services) h->SetServingStatus(s, serving);
}

}  // namespace sparsex
