// The standard gRPC services every SparseX server offers besides its own:
// - health (grpc.health.v1: Check and Watch), so Kubernetes gRPC probes, grpc-health-probe and
//   other clients of that protocol work;
// - server reflection (grpc.reflection.v1alpha, the version grpc++ 1.51 implements), so grpcurl,
//   Postman and reflection clients can list the services and fetch their descriptors without a
//   copy of proto/.
// Call EnableGrpcStandardServices() before building a grpc::ServerBuilder (it switches both on
// for every server of the process: grpc++ installs them through a process-wide flag and a
// server-builder plugin); SetGrpcServing() then moves the overall status ("" service) and each
// named service between SERVING and NOT_SERVING (a draining worker answers NOT_SERVING).
#pragma once

#include <string>
#include <vector>

#include <grpcpp/server.h>

namespace sparsex {

void EnableGrpcStandardServices();
void SetGrpcServing(grpc::Server* server, bool serving,
                    const std::vector<std::string>& services = {});
// Only the named services, the overall status ("") untouched (the router's readiness: its
// service is NOT_SERVING without a worker while the process itself stays live).
void SetGrpcServiceServing(grpc::Server* server, const std::string& service, bool serving);

}  // namespace sparsex
