// sparsex-router: the public API (gRPC on 127.0.0.1:50051, OpenAI-compatible HTTP and
// /metrics on 127.0.0.1:8000 by default) in front of the workers. See docs/operations.md.
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
  f.Add("ready_file", &o.ready_file, "write {grpc_port, http_port, pid} here once serving");
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
  std::cerr << "[router] serving " << (*router)->model_name() << ": gRPC port "
            << (grpc ? grpc->port() : -1) << ", HTTP port " << (http ? http->port() : -1)
            << std::endl;
  if (!o.ready_file.empty()) {
    const std::string tmp = o.ready_file + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << "{\"grpc_port\":" << (grpc ? grpc->port() : -1)
          << ",\"http_port\":" << (http ? http->port() : -1) << ",\"pid\":" << getpid() << "}\n";
    }
    std::filesystem::rename(tmp, o.ready_file);
  }
  sparsex::WaitForTermination();
  std::cerr << "[router] stopping" << std::endl;
  if (grpc) grpc->Shutdown();
  if (http) http->Shutdown();
  (*router)->Shutdown();
  return 0;
}
