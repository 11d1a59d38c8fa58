// Internal to the worker service (gpu_worker/service/): the server's shared state, its metric
// handles and the pieces the files below share. worker_server.cc wires it (Start, Drain,
// Shutdown); worker_service.cc is the gRPC adapter; cluster_fetch.cc the cache-cluster fetch and
// write-back; worker_metrics.cc the metric registration.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/etcd/etcd_client.h"
#include "common/fingerprint.h"
#include "common/metrics/http_server.h"
#include "common/metrics/metrics.h"
#include "gpu_worker/service/event_log.h"
#include "gpu_worker/service/kv_tier.h"
#include "gpu_worker/scheduler/scheduler.h"
#include "gpu_worker/service/worker_server.h"
#include "model/model.h"
#include "proto/worker.grpc.pb.h"

namespace sparsex::service {
namespace internal {

using Clock = std::chrono::steady_clock;
namespace wpb = sparsex::worker::v1;

wpb::CacheTier ToProtoTier(EventTier t);
void LogLine(const std::string& id, const std::string& msg);

// WorkerOptions::auto_budget for the model of this fingerprint: sets reuse.calibration (the
// built-in one for stories260K when none is given) and, with auto_budget, reuse.budget.mode;
// returns the log line saying which budget serves (empty without auto_budget).
// INVALID_ARGUMENT: the quality budget asked for without a calibration of this model.
absl::StatusOr<std::string> ResolveReuseBudget(const std::string& model_fingerprint,
                                               bool auto_budget, ReuseOptions& reuse);

}  // namespace internal

// Metric handles (children resolved once; registered in worker_metrics.cc).
struct WorkerMetrics {
  explicit WorkerMetrics(metrics::Registry& r);
  metrics::Histogram *ttft, *inter_token, *e2e, *queue, *fetch;
  metrics::Family<metrics::Counter>* requests;
  metrics::Counter *prompt_tokens, *prefix_tokens, *reused_tokens, *recomputed_tokens, *new_tokens,
      *generated_tokens, *fetched, *fetch_bytes, *fetch_in_place_bytes, *streamed,
      *stream_restarts;
  metrics::Family<metrics::Counter>* stream_seconds;  // {part}: wait, upload
  metrics::Family<metrics::Counter>* stream_memory;   // {memory}: pinned, pageable
  metrics::Family<metrics::Counter>*segments, *fetch_failures, *writeback, *fetch_phase;
  metrics::Family<metrics::Gauge>* iteration_cost;
  metrics::Gauge *queue_depth, *running, *running_tokens, *host_entries, *draining, *iterations,
      *pending_stores, *stores_dropped, *waiting_remote, *unspilled_segments,
      *fetch_timeouts;
  // The correctness gate (quality_gate.h).
  metrics::Histogram* gate_kl;
  metrics::Family<metrics::Counter>* gate_replays;
  metrics::Gauge *gate_rolling_top1, *gate_rolling_kl, *gate_rolling_median_kl, *gate_level,
      *reuse_disabled, *gate_dropped, *gate_preempted, *gate_breaches;
  metrics::Family<metrics::Gauge>*kv_usage, *kv_bytes, *kv_blocks, *info, *engine_seconds,
      *engine_longest;
};

struct WorkerServer::State {
  WorkerOptions opts;
  std::string worker_id, instance_id, model_name;
  std::unique_ptr<Model> model;
  // What every KV key of this worker derives from (KvIdentity, model/prompt.h): the model, its
  // tokenizer and chat template, the backend's KV dtype. Sent to the router in WorkerInfo.
  Hash128 kv_identity;
  std::unique_ptr<SegmentStore> store;                     // rank 0's share (all of it without TP)
  std::vector<std::unique_ptr<SegmentStore>> rank_stores;  // ranks 1..tp-1
  std::unique_ptr<CacheEventLog> events;
  std::unique_ptr<ClusterKvTier> tier;
  std::unique_ptr<BatchScheduler> scheduler;
  metrics::Registry registry;
  std::unique_ptr<WorkerMetrics> m;
  std::unique_ptr<metrics::HttpServer> http;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<etcd::EtcdClient> etcd;
  std::unique_ptr<etcd::EtcdRegistration> registration;

  std::atomic<bool> draining{false}, stopping{false};
  std::atomic<int> inflight{0};

  // Write-back queue (engine thread -> writer thread).
  std::mutex wb_mu;
  std::condition_variable wb_cv;
  std::deque<Hash128> wb_queue;
  // Segments the cluster fetch handed to the engine's tier (under wb_mu): the cluster holds
  // them, so their idle-time spill to the host store queues no write-back (it encoded every
  // layer only to hear ALREADY_EXISTS). The newest kFetchedRemembered are kept.
  static constexpr size_t kFetchedRemembered = 4096;
  std::deque<Hash128> fetched_to_tier;
  bool wb_stop = false;
  std::thread wb_thread;

  std::mutex done_mu;
  std::condition_variable done_cv;
  bool done = false;

  internal::wpb::LoadReport Load() const {
    SchedulerLoad l = scheduler->load();
    internal::wpb::LoadReport r;
    r.set_queue_depth(l.queue_depth);
    r.set_running(l.running);
    r.set_running_tokens(l.running_tokens);
    r.set_kv_blocks_total(l.kv_blocks_total);
    r.set_kv_blocks_free(l.kv_blocks_free);
    r.set_draining(draining.load());
    r.set_max_running(opts.scheduler.max_running);
    r.set_max_queue(opts.scheduler.max_queue);
    r.set_reuse_disabled(l.gate.reuse_disabled);
    r.set_reuse_gate_level(l.gate.level);
    return r;
  }

  internal::wpb::ReplayResponse Snapshot() const {
    internal::wpb::ReplayResponse r;
    uint64_t seq = 0;
    std::vector<CacheEntryRecord> entries = events->Snapshot(&seq);
    r.set_instance_id(instance_id);
    r.set_seq(seq);
    for (const auto& e : entries) {
      internal::wpb::CacheEntry* c = r.add_entries();
      c->set_fingerprint(FingerprintToBytes(e.fp));
      c->set_num_tokens(e.num_tokens);
      c->set_tier(internal::ToProtoTier(e.tier));
    }
    return r;
  }

  // The write-back thread: segments queued by the engine go to the cache cluster, every rank's
  // share (cluster_fetch.cc).
  void WriteBackLoop();
};

namespace internal {

// The cluster fetch of a request's missing segments (WorkItem::remote_fetch, run on a scheduler
// fetch thread): every rank's share, metrics, events, a rate-limited log line on failure.
void FetchRemote(WorkerServer::State& st, const std::vector<SegmentRef>& refs, WorkItem& item);

// The gRPC Worker service over the state (worker.proto).
std::unique_ptr<grpc::Service> NewWorkerService(WorkerServer::State* s);

}  // namespace internal
}  // namespace sparsex::service
