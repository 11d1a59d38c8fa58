// The GPU worker process in one object: model, continuously batched engine (scheduler.h),
// local segment store (host tier), cache-cluster tier (kv_tier.h), cache events
// (event_log.h), the gRPC Worker service (proto/worker.proto), Prometheus metrics, and etcd
// registration under a lease. `sparsex-worker` is a thin main around it.
//
//   WorkerOptions o;
//   o.model_path = "stories260K.gguf";
//   o.cluster.servers = {"127.0.0.1:50070"};
//   o.etcd_endpoints = {"127.0.0.1:2379"};
//   ASSIGN_OR_RETURN(auto w, WorkerServer::Start(o));
//   ...                 // SIGTERM:
//   w->Drain();         // deregister, refuse new requests, finish running ones, stop
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "gpu_worker/service/kv_tier.h"
#include "gpu_worker/scheduler/scheduler.h"

namespace sparsex::service {

struct WorkerOptions {
  std::string model_path;   // GGUF file or HF directory. Default: "" (required)
  // Tokenizer used instead of the model's (LoadOptions::tokenizer_path: a GGUF vocabulary or a
  // tokenizer.json); enters the model fingerprint. Default: "" (the model's own)
  std::string tokenizer_path;
  std::string model_name;   // name in the API. Default: the file name without extension
  std::string device = "cpu";  // cpu | cuda. Default: cpu
  int cuda_device = 0;         // CUDA ordinal. Default: 0
  std::string address = "127.0.0.1";  // gRPC/metrics bind address. Default: 127.0.0.1
  int port = 0;           // gRPC port; 0 picks a free one. Default: 0
  int metrics_port = 0;   // /metrics and /healthz; 0 picks a free one, -1 disables. Default: 0
  // Address the router dials (host:port). Default: address:port
  std::string advertise_address;
  std::string worker_id;  // name in etcd, metrics and logs. Default: "worker-<port>"
  // Engine, batching and default reuse options. Default: SchedulerOptions{} with a KV pool of
  // 4096 16-token blocks
  SchedulerOptions scheduler;
  // Pick the reuse budget for the served model: the quality budget where a calibration of this
  // model is known (scheduler.reuse.calibration, or the built-in one when the model is
  // stories260K), else the fixed budget at scheduler.reuse.budget.ratio, with a log line.
  // Another model's slope picks the wrong share: on the synthetic Llama-3-8B the stories260K
  // slope recomputed ~80% of the reused tokens. false: scheduler.reuse.budget.mode as given
  // (kQuality then needs a calibration of this model). Default: false (sparsex-worker: true
  // unless --budget is given)
  bool auto_budget = false;
  size_t host_store_bytes = size_t{1} << 30;  // host segment store. Default: 1 GiB
  ClusterTierOptions cluster;  // cache servers; empty: no cluster tier. Default: none
  bool write_back = true;      // write newly computed segments to the cluster. Default: true
  std::vector<std::string> etcd_endpoints;  // empty: no registration. Default: none
  std::string etcd_prefix = "/sparsex";     // keys: <prefix>/workers/<worker_id>. Default
  int etcd_ttl_s = 10;          // registration lease TTL. Default: 10 s
  int drain_timeout_ms = 30000; // Drain() waits this long for running requests. Default: 30 s
  int load_report_ms = 200;     // load reports on the Subscribe stream. Default: 200 ms
  size_t event_buffer = 65536;  // cache events kept for resuming subscribers. Default: 65536
  std::string ready_file;       // JSON with the ports, written once serving. Default: none
  // Mutual TLS (proto/grpc_tls.h): the gRPC listener serves only peers with a certificate of
  // the cluster CA (the router), and the same certificate opens the cache-server channels.
  // Default: none (plaintext)
  TlsFiles tls;
  // Plaintext is refused unless this is set and `address` is on loopback. Default: false
  bool insecure_loopback = false;
};

class WorkerServer {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(const WorkerOptions& options);
  ~WorkerServer();  // Shutdown()

  // Deregisters from etcd, refuses new requests (UNAVAILABLE "draining"), waits up to
  // drain_timeout_ms for queued and running requests, then Shutdown().
  void Drain();
  // Stops serving at once (running requests fail with UNAVAILABLE). Idempotent.
  void Shutdown();
  void Wait();

  int port() const;
  int metrics_port() const;
  const std::string& worker_id() const;
  const std::string& instance_id() const;
  // What this worker's KV keys derive from (KvIdentity, model/prompt.h; WorkerInfo.kv_fingerprint).
  const Hash128& kv_identity() const;

  struct State;

 private:
  WorkerServer();
  std::unique_ptr<State> s_;
};

}  // namespace sparsex::service
