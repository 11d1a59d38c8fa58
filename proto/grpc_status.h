// absl::Status <-> grpc::Status. The codes are the same numbers (google.rpc.Code), so a service
// returns its absl::Status unchanged and a client gets the same code and message back.
//
//   grpc::Status Service::Lookup(...) { return ToGrpcStatus(impl_.Lookup(...)); }
//   absl::Status s = FromGrpcStatus(stub->Lookup(&ctx, req, &resp));
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace sparsex {

grpc::Status ToGrpcStatus(const absl::Status& s);
absl::Status FromGrpcStatus(const grpc::Status& s);

}  // namespace sparsex
