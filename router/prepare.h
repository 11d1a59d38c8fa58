// Request preparation: a public GenerateRequest becomes the worker's request plus the routing
// hints. Pure (no gRPC, no I/O): it validates the request (UTF-8, prompt or segments, token ids
// within the vocabulary, the context length, sampling and reuse ranges), tokenizes text,
// splits a plain prompt into segments by content-defined chunking, and fingerprints the
// segments and exact-prefix blocks exactly as the workers do (model/prompt.h), once the served
// identity is known.
//
//   ServedIdentity id = pool.Identity();            // learned from the workers (worker_pool.h)
//   ASSIGN_OR_RETURN(Prepared p, PrepareRequest(req, model, ChunkingOptions{}, id));
//   p.wreq;           // what the chosen worker gets
//   p.fps;            // segment and prefix-block fingerprints, for ClusterIndex::ReusableTokens
//   p.prompt_tokens;  // the prompt's length, BOS included
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "model/chunking.h"
#include "model/model_info.h"
#include "proto/sparsex.pb.h"
#include "proto/worker.pb.h"
#include "router/cluster_index.h"

namespace sparsex::router {

// What the router hashes with, learned from the first worker that serves the router's model:
// the model fingerprint (it hashes samples of the weights, which the router never reads), the
// segment encoding and the KV block size. Workers that disagree are not routed to.
struct ServedIdentity {
  bool known = false;
  Hash128 fingerprint;          // the KV identity keys are hashed with (WorkerInfo.kv_fingerprint)
  std::string fingerprint_hex;  // the model fingerprint (ListModels)
  std::string kv_hex;
  std::string encoding;
  int block_size = 0;
};

struct Prepared {
  worker::v1::WorkerGenerateRequest wreq;
  std::vector<IndexEntry> fps;  // empty while the identity is unknown
  int prompt_tokens = 0;        // BOS included
};

// INVALID_ARGUMENT naming what is wrong. An empty request_id becomes "req-" + 16 random hex
// digits. Fingerprints only when `id.known` (and segment fingerprints only with reuse on).
//
// Scopes (router/auth.h): every segment is fingerprinted in the caller's store scope, except a
// segment that `held` reports stored in one of the caller's shared read scopes, which is reused
// from there; exact-prefix blocks are in the store scope. The worker request carries the salts.
struct CallerScopes {
  Hash128 store;                  // all zero: unscoped (authentication off)
  std::vector<Hash128> read;      // shared scopes the caller may reuse from
  std::function<bool(const Hash128&)> held;  // a worker holds this segment. Default: none
};
absl::StatusOr<Prepared> PrepareRequest(const v1::GenerateRequest& req, const ModelInfo& model,
                                        const ChunkingOptions& chunking,
                                        const ServedIdentity& id,
                                        const CallerScopes& scopes = {});

}  // namespace sparsex::router
