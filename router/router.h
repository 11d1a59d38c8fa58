// The router: the public API front end of SparseX. It tokenizes prompts (explicit segments,
// or a plain prompt split by content-defined chunking), fingerprints every segment exactly as
// the workers do, keeps a cluster index fed by the workers' cache events, picks a worker by
// reusable tokens weighed against load, streams the worker's tokens back, retries on another
// worker when one fails before the first token, and sheds load with RESOURCE_EXHAUSTED when
// every worker is saturated. Membership comes from etcd (polled) and/or a static list.
//
// The core (this class) is transport-neutral; the gRPC service (proto/sparsex.proto) and the
// OpenAI-compatible HTTP API are thin front ends over it (frontends.h).
//
//   RouterOptions o;
//   o.model_path = "stories260K.gguf";
//   o.etcd_endpoints = {"127.0.0.1:2379"};
//   ASSIGN_OR_RETURN(auto r, Router::Create(o));
//   RETURN_IF_ERROR(r->Generate(req, [](const v1::GenerateResponse& m) { ...; return true; },
//                               CallControl{}));
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/chunking.h"
#include "proto/sparsex.pb.h"
#include "proto/grpc_tls.h"
#include "router/auth.h"
#include "router/cluster_index.h"

namespace grpc {
class ServerContext;
}
namespace sparsex {
namespace metrics {
class Registry;
}
}  // namespace sparsex

namespace sparsex::router {
namespace openai {
struct ChatFormat;
}

struct RouterOptions {
  // The served model: config and tokenizer only (a *.gguf, a directory with config.json and
  // tokenizer.json, or synthetic:<name>); weights are never read. Default: "" (required)
  std::string model_path;
  std::string model_name;   // API name. Default: the file name without extension
  // A tokenizer in place of the model's own (a GGUF vocabulary or tokenizer.json), as the
  // workers' --tokenizer: the router tokenizes what they serve. Default: "" (the model's own)
  std::string tokenizer_path;
  std::string grpc_address = "127.0.0.1:50051";  // public gRPC API; "" disables. Default
  std::string http_address = "127.0.0.1:8000";   // OpenAI HTTP + /metrics; "" disables. Default
  // HTTP front end (frontends.h, docs/operations.md "HTTP front end limits").
  int http_threads = 64;    // completions served at once (each stream holds one); more wait
                            // in a queue, read in full. Default: 64
  size_t max_body_bytes = size_t{16} << 20;  // largest HTTP request body. Default: 16 MiB
  int http_max_connections = 1000;  // open connections; one more is answered 503 and closed
                                    // at once. Default: 1000
  int http_idle_timeout_ms = 10000;  // silence allowed while a request is read (the first byte
                                     // included); then 408 and close. Default: 10 s
  int http_read_timeout_ms = 30000;  // the whole request (head + body); then 408. Default: 30 s
  int http_write_timeout_ms = 30000;  // a response write blocked this long (the client stopped
                                      // reading): the request is cancelled. Default: 30 s
  // Abuse limits (docs/operations.md "Per-client limits and the admin listener").
  // /healthz, /livez and /metrics on a listener of their own, for probes and scrapes, so that
  // no API client can fail them; "" disables. Default: 127.0.0.1:8001
  std::string admin_address = "127.0.0.1:8001";
  // Open HTTP API connections per source address; one more is answered 429 and closed at once.
  // 0 = no per-client limit. Default: 256
  int http_max_connections_per_client = 256;
  // HTTP completions in flight (queued or running) per source address; one more is answered
  // 429. 0 = a quarter of http_threads (at least 1); -1 = no per-client limit. Default: 0
  int http_max_streams_per_client = 0;
  // Prompt text of one request (prompt, segment texts, chat message contents), checked before
  // any templating or tokenization on both APIs: more is INVALID_ARGUMENT / HTTP 400. The gRPC
  // API's largest request message is this plus 8 MiB (token ids, other fields). Default: 4 MiB
  size_t max_prompt_bytes = size_t{4} << 20;
  // Router -> worker channels: HTTP/2 keepalive pings every worker_keepalive_ms; a worker that
  // does not answer one within worker_keepalive_timeout_ms (a frozen process: SIGSTOP, a hung
  // host) loses its connection: it is marked unhealthy, and its requests that have not sent a
  // token yet are retried on another worker. Default: 250 ms, 1000 ms
  int worker_keepalive_ms = 250;
  int worker_keepalive_timeout_ms = 1000;
  std::vector<std::string> workers;          // static members (host:port). Default: none
  std::vector<std::string> etcd_endpoints;   // etcd membership. Default: none
  std::string etcd_prefix = "/sparsex";      // workers under <prefix>/workers/. Default
  int membership_poll_ms = 500;  // etcd poll period. Default: 500 ms
  RoutingWeights weights;        // Default: see RoutingWeights
  ChunkingOptions chunking;      // plain prompts. Default: ChunkingOptions{}
  // The segment encoding and KV block size the router hashes with come from the workers
  // (WorkerInfo). Set, these are expectations: workers that differ are not routed to.
  std::string segment_encoding;  // Default: "" (any; the first worker's)
  int kv_block_size = 0;         // Default: 0 (any; the first worker's)
  int max_attempts = 3;          // workers tried before the first token. Default: 3
  int request_timeout_ms = 0;    // deadline when the client sets none; 0 = none. Default: 0
  std::string ready_file;        // JSON with the ports, written once serving. Default: none
  // Security (docs/security.md). API keys of the public APIs (router/auth.h); scope salts
  // keyed by the scope key file's bytes. Default: none
  std::string api_keys_file;
  std::string scope_key_file;
  // Mutual TLS on the router -> worker channels: only workers presenting a certificate of the
  // cluster CA are routed to, whatever etcd lists. Default: none (plaintext)
  TlsFiles cluster_tls;
  // Without API keys or cluster TLS the router refuses to start unless this is set and every
  // listener is on loopback (a local test cluster). Default: false
  bool insecure_loopback = false;
};

// Cancels a Generate call from another thread: the HTTP front end calls Cancel() when the
// client's connection closes (a non-streaming request writes nothing until the end, so only the
// connection tells). The attempt in flight is cancelled at the worker (which frees the
// sequence) and no further attempt starts; Generate returns CANCELLED.
class CallCancel {
 public:
  void Cancel() {
    std::lock_guard<std::mutex> l(mu_);
    cancelled_ = true;
    if (fn_) fn_();
  }
  bool cancelled() const {
    std::lock_guard<std::mutex> l(mu_);
    return cancelled_;
  }
  // Router: what cancels the attempt in flight (nullptr: none). Runs `fn` at once when already
  // cancelled. Once Set(nullptr) returns, `fn` is never called again.
  void Set(std::function<void()> fn) {
    std::lock_guard<std::mutex> l(mu_);
    fn_ = std::move(fn);
    if (cancelled_ && fn_) fn_();
  }

 private:
  mutable std::mutex mu_;
  bool cancelled_ = false;
  std::function<void()> fn_;
};

struct CallControl {
  // Absolute deadline of the whole request. Default: none
  std::chrono::system_clock::time_point deadline = std::chrono::system_clock::time_point::max();
  // gRPC front end: the server call; cancellation and deadline propagate to the worker call.
  grpc::ServerContext* grpc_parent = nullptr;
  std::string api = "grpc";  // metrics label. Default: grpc
  // Cancellation from another thread (the HTTP front end). Default: none
  std::shared_ptr<CallCancel> cancel;
  // The caller, from its API key (Router::auth()). Required when authentication is on: a call
  // without one is UNAUTHENTICATED. Default: none (authentication off)
  std::shared_ptr<const Tenant> tenant;
  // Called when a worker fails (UNAVAILABLE: died, frozen) after it streamed tokens: true when
  // nothing has reached the client yet (a non-streaming HTTP request buffers the whole answer)
  // and the front end has dropped what it buffered; the request then starts over on another
  // worker. Unset or false: the client gets UNAVAILABLE "failed after streaming". Default: none
  std::function<bool()> restart;
};

using GenerateSink = std::function<bool(const v1::GenerateResponse&)>;  // false: client gone

class Router {
 public:
  static absl::StatusOr<std::unique_ptr<Router>> Create(const RouterOptions& options);
  ~Router();

  // Streams the response chunks to `sink`; the last one has finished = true and the usage.
  absl::Status Generate(const v1::GenerateRequest& req, const GenerateSink& sink,
                        const CallControl& ctl);
  absl::StatusOr<v1::TokenizeResponse> Tokenize(const v1::TokenizeRequest& req);
  // Model fingerprints and worker addresses only for an admin tenant (or authentication off):
  // they are what a direct attack on the cluster's tiers would start from.
  v1::ListModelsResponse ListModels(const Tenant* caller = nullptr);
  v1::HealthResponse Health(const Tenant* caller = nullptr);
  // INVALID_ARGUMENT "unknown model" unless `model` is "" or the served model's name.
  absl::Status CheckModel(const std::string& model) const;

  const std::string& model_name() const;
  // How the OpenAI chat endpoint renders messages: the model's chat template (openai_codec.h).
  const openai::ChatFormat& chat_format() const;
  metrics::Registry& registry();
  const RouterOptions& options() const;
  // The API keys (router/auth.h); Disabled() when none are configured.
  Authenticator& auth();
  void Shutdown();

  struct Impl;

 private:
  Router();
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsex::router
