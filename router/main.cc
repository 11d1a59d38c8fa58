// sparsex-router: the public API (gRPC on 127.0.0.1:50051, OpenAI-compatible HTTP and
// /metrics on 127.0.0.1:8000 by default; /healthz, /livez and /metrics also on the admin
// listener, 127.0.0.1:8001) in front of the workers. See docs/operations.md.
//
//   sparsex-router --model stories260K.gguf --etcd 127.0.0.1:2379
//   sparsex-router --model stories260K.gguf --workers 127.0.0.1:7001,127.0.0.1:7002
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "common/flags.h"
#include "common/signals.h"
#include "router/frontends.h"
#include "router/router.h"

int main(int argc, char** argv) {
  using namespace sparsex::router;
  RouterOptions o;
  sparsex::FlagSet f("sparsex-router");
  f.Add("model", &o.model_path, "served model: GGUF file or HF directory (required)");
  f.Add("model_name", &o.model_name, "model name in the API (default: file name stem)");
  f.Add("tokenizer", &o.tokenizer_path,
        "tokenizer in place of the model's own (GGUF vocabulary or tokenizer.json); give the "
        "workers the same --tokenizer");
  f.Add("grpc_address", &o.grpc_address, "public gRPC API host:port (\"\" = off)");
  f.Add("http_address", &o.http_address, "OpenAI HTTP API + /metrics host:port (\"\" = off)");
  f.Add("http_threads", &o.http_threads,
        "HTTP completions served at once (a stream holds one; more wait, read in full)");
  f.Add("http_max_connections", &o.http_max_connections,
        "open HTTP connections; one more is answered 503 and closed at once");
  f.Add("http_idle_timeout_ms", &o.http_idle_timeout_ms,
        "HTTP: silence allowed while a request is read, then 408 and close");
  f.Add("http_read_timeout_ms", &o.http_read_timeout_ms,
        "HTTP: time to receive a whole request (head and body), then 408 and close");
  f.Add("http_write_timeout_ms", &o.http_write_timeout_ms,
        "HTTP: a response write blocked this long (client not reading) cancels the request");
  f.Add("admin_address", &o.admin_address,
        "/healthz, /livez and /metrics on a listener of their own host:port (\"\" = off); the "
        "default 127.0.0.1:8001, when taken, falls back to a free port (logged, ready file)");
  f.Add("http_max_connections_per_client", &o.http_max_connections_per_client,
        "HTTP API connections per source address; one more is answered 429 (0 = no limit)");
  f.Add("http_max_streams_per_client", &o.http_max_streams_per_client,
        "HTTP completions in flight per source address; one more is answered 429 (0 = a "
        "quarter of http_threads, -1 = no limit)");
  f.Add("max_prompt_bytes", &o.max_prompt_bytes,
        "prompt text per request (both APIs), checked before tokenizing; more is refused");
  f.Add("worker_keepalive_ms", &o.worker_keepalive_ms,
        "keepalive ping period on the router->worker channels");
  f.Add("worker_keepalive_timeout_ms", &o.worker_keepalive_timeout_ms,
        "a worker that leaves a ping unanswered this long (frozen) is disconnected: marked "
        "unhealthy, its requests without a token yet retried elsewhere");
  f.Add("workers", &o.workers, "static worker addresses host:port (comma-separated)");
  f.Add("etcd", &o.etcd_endpoints, "etcd client URLs host:port (comma-separated)");
  f.Add("etcd_prefix", &o.etcd_prefix, "etcd key prefix (workers under <prefix>/workers/)");
  f.Add("membership_poll_ms", &o.membership_poll_ms, "etcd membership poll period");
  f.Add("segment_encoding", &o.segment_encoding, "segment encoding context (must match the workers)");
  f.Add("kv_block_size", &o.kv_block_size, "workers' KV block size, for exact-prefix block hashes");
  f.Add("chunk_min_tokens", &o.chunking.min_tokens, "plain-prompt chunking: minimum chunk");
  f.Add("chunk_avg_tokens", &o.chunking.avg_tokens, "plain-prompt chunking: average chunk");
  f.Add("chunk_max_tokens", &o.chunking.max_tokens, "plain-prompt chunking: maximum chunk");
  f.Add("new_token_weight", &o.weights.new_token_weight, "routing: cost per token to compute");
  f.Add("load_token_weight", &o.weights.load_token_weight, "routing: cost per token of load");
  f.Add("request_weight", &o.weights.request_weight, "routing: cost per queued/in-flight request");
  f.Add("kv_weight", &o.weights.kv_weight, "routing: KV pressure factor");
  f.Add("max_inflight_per_worker", &o.weights.max_inflight_per_worker,
        "routing: in-flight requests per worker before it counts as saturated");
  f.Add("max_inflight_imbalance", &o.weights.max_inflight_imbalance,
        "routing: most in-flight requests above the least loaded worker");
  f.Add("max_attempts", &o.max_attempts, "workers tried before the first token");
  f.Add("request_timeout_ms", &o.request_timeout_ms, "default request deadline (0 = none)");
  f.Add("ready_file", &o.ready_file,
        "write {grpc_port, http_port, admin_port, pid} here once serving");
  f.Add("api_keys_file", &o.api_keys_file,
        "JSON file of API keys (SHA-256), tenants, scopes and limits (docs/security.md); "
        "re-read when it changes");
  f.Add("scope_key_file", &o.scope_key_file,
        "secret (>= 16 bytes) that keys the tenants' KV scope salts (HMAC-SHA256)");
  f.Add("tls_ca", &o.cluster_tls.ca, "cluster CA (PEM): workers must present a certificate it signed");
  f.Add("tls_cert", &o.cluster_tls.cert, "the router's certificate (PEM, signed by the cluster CA)");
  f.Add("tls_key", &o.cluster_tls.key, "the router's private key (PEM)");
  f.Add("insecure_loopback", &o.insecure_loopback,
        "run without API keys and/or cluster TLS; refused unless every listener is on loopback");
  if (absl::Status s = f.Parse(argc, argv); !s.ok()) {
    std::cerr << "sparsex-router: " << s.message() << "\n";
    return 2;
  }
  if (f.help()) {
    std::cout << f.Usage();
    return 0;
  }
  sparsex::InstallTerminationHandler();

  auto router = Router::Create(o);
  if (!router.ok()) {
    std::cerr << "sparsex-router: " << router.status() << "\n";
    return 1;
  }
  std::unique_ptr<GrpcFrontend> grpc;
  std::unique_ptr<HttpFrontend> http;
  if (!o.grpc_address.empty()) {
    auto g = GrpcFrontend::Start(router->get(), o.grpc_address);
    if (!g.ok()) {
      std::cerr << "sparsex-router: " << g.status() << "\n";
      return 1;
    }
    grpc = std::move(*g);
  }
  if (!o.http_address.empty()) {
    auto h = HttpFrontend::Start(router->get(), o.http_address, o.http_threads);
    if (!h.ok()) {
      std::cerr << "sparsex-router: " << h.status() << "\n";
      return 1;
    }
    http = std::move(*h);
  }
  std::unique_ptr<HttpFrontend> admin;
  if (!o.admin_address.empty()) {
    auto a = HttpFrontend::StartAdmin(router->get(), o.admin_address, http.get());
    if (!a.ok() && o.admin_address == RouterOptions{}.admin_address) {
      // Another router on this host holds the default port: a free one, said here and in the
      // ready file, rather than no probes at all. An address given explicitly must bind.
      std::cerr << "[router] admin listener: " << o.admin_address
                << " is not available; using a free port" << std::endl;
      a = HttpFrontend::StartAdmin(router->get(), "127.0.0.1:0", http.get());
    }
    if (!a.ok()) {
      std::cerr << "sparsex-router: " << a.status() << "\n";
      return 1;
    }
    admin = std::move(*a);
  }
  std::cerr << "[router] serving " << (*router)->model_name() << ": gRPC port "
            << (grpc ? grpc->port() : -1) << ", HTTP port " << (http ? http->port() : -1)
            << ", admin port " << (admin ? admin->port() : -1) << std::endl;
  if (!o.ready_file.empty()) {
    const std::string tmp = o.ready_file + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << "{\"grpc_port\":" << (grpc ? grpc->port() : -1)
          << ",\"http_port\":" << (http ? http->port() : -1)
          << ",\"admin_port\":" << (admin ? admin->port() : -1) << ",\"pid\":" << getpid()
          << "}\n";
    }
    std::filesystem::rename(tmp, o.ready_file);
  }
  sparsex::WaitForTermination();
  std::cerr << "[router] stopping" << std::endl;
  if (grpc) grpc->Shutdown();
  if (http) http->Shutdown();
  if (admin) admin->Shutdown();
  (*router)->Shutdown();
  return 0;
}
