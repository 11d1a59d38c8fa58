// The gRPC request validation: a public v1::GenerateRequest (proto/sparsex.proto) decoded from the
// wire bytes, then the range checks shared by router and worker (proto/request_check.h) and the
// router's whole preparation (router/prepare.h: UTF-8, prompt or segments, ids within the
// vocabulary, context length, tokenizing, chunking, fingerprints) on the synthetic "tiny"
// model (vocabulary 1000, 4 layers). Every refusal must be INVALID_ARGUMENT.
#include <cstdlib>

#include "model/model_info.h"
#include "proto/request_check.h"
#include "proto/sparsex.pb.h"
#include "router/prepare.h"
#include "tests/fuzz/fuzz_util.h"

using namespace sparsex;

namespace {

const ModelInfo& Model() {
  static const ModelInfo* m = [] {
    auto info = LoadModelInfo("synthetic:tiny");
    if (!info.ok()) std::abort();
    return new ModelInfo(std::move(*info));
  }();
  return *m;
}

void ExpectInvalidArgument(const absl::Status& s) {
  if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const ModelInfo& model = Model();
  ExpectInvalidArgument(CheckSamplingRequest(req.sampling(), model.config.vocab_size));
  ExpectInvalidArgument(CheckSamplingRequest(req.sampling(), 0));
  ExpectInvalidArgument(CheckReuseRequest(req.reuse(), model.config.n_layers));
  ExpectInvalidArgument(CheckReuseRequest(req.reuse(), 0));
  // Without and with the served identity (the second also fingerprints segments and blocks).
  router::ServedIdentity unknown;
  router::ServedIdentity known;
  known.known = true;
  known.fingerprint = Hash128{0x1234, 0x5678};
  known.fingerprint_hex = "00000000000012340000000000005678";
  known.encoding = "none";
  known.block_size = 4;
  for (const router::ServedIdentity* id : {&unknown, &known}) {
    absl::StatusOr<router::Prepared> p = router::PrepareRequest(req, model, ChunkingOptions{}, *id);
    fuzz::Report("PrepareRequest", p.status());
    ExpectInvalidArgument(p.status());
    if (p.ok() && p->prompt_tokens < 0) std::abort();
  }
  return 0;
}
