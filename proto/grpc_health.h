// The standard gRPC health service (grpc.health.v1: Check and Watch) on every SparseX server,
// so Kubernetes gRPC probes, grpc-health-probe and other clients of that protocol work. Call
// EnableGrpcHealth() before building a grpc::ServerBuilder (it switches on grpc++'s built-in
// health service for every server of the process); SetGrpcServing() then moves the overall
// status ("" service) and each named service between SERVING and NOT_SERVING (a draining worker
// answers NOT_SERVING).
#pragma once

#include <string>
#include <vector>

#include <grpcpp/server.h>

namespace sparsex {

void EnableGrpcHealth();
void SetGrpcServing(grpc::Server* server, bool serving,
                    const std::vector<std::string>& services = {});

}  // namespace sparsex
