// The router's workers: membership (a static list and/or etcd, polled), one gRPC channel per
// worker, and per worker a subscription thread that asks the worker's Info, admits it or not
// (Accept: same model, segment encoding and KV block size as the cluster; the first acceptable
// worker fixes the served identity the router hashes with) and feeds its cache events and load
// reports into the ClusterIndex. Routing and the proxy (router.cc) read Conns() and the index;
// nothing here decides where a request goes.
//
//   ClusterIndex index;
//   WorkerPool pool(options, model.config, "stories260K", &index);
//   pool.Start();                        // one membership poll now, then every poll period
//   for (auto& w : pool.Conns()) if (w->healthy && w->model_ok) ...;
//   ServedIdentity id = pool.Identity(); // known once a worker was accepted
//   pool.Stop();
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/model_info.h"
#include "proto/worker.grpc.pb.h"
#include "router/cluster_index.h"
#include "router/prepare.h"
#include "router/router.h"

namespace sparsex {
namespace etcd {
class EtcdClient;
}
}  // namespace sparsex

namespace sparsex::router {

// One worker: channel, stub and the subscription thread that feeds the index.
struct WorkerConn {
  std::string address;  // also its key in the index
  std::string name;     // worker_id from Info (address until known)
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<worker::v1::Worker::Stub> stub;
  std::atomic<bool> healthy{false};
  std::atomic<bool> model_ok{false};
  std::atomic<int> inflight{0};
  std::atomic<int64_t> inflight_tokens{0};
  std::atomic<bool> stop{false};
  std::mutex mu;  // guards sub_ctx, name
  grpc::ClientContext* sub_ctx = nullptr;
  std::thread thread;

  std::string Name() {
    std::lock_guard<std::mutex> l(mu);
    return name;
  }
};

class WorkerPool {
 public:
  // Reads opts.workers, etcd_endpoints, etcd_prefix, membership_poll_ms, segment_encoding and
  // kv_block_size. `model` and `index` must outlive the pool.
  WorkerPool(const RouterOptions& opts, const ModelConfig& model, std::string model_name,
             ClusterIndex* index);
  ~WorkerPool();  // Stop()

  // Polls the membership once, synchronously, then (with etcd) every membership_poll_ms.
  void Start();
  // Stops polling and every subscription; idempotent.
  void Stop();

  std::vector<std::shared_ptr<WorkerConn>> Conns();
  ServedIdentity Identity() const;

  // "" when the worker may serve this router's requests, else why not. The first acceptable
  // worker fixes the identity.
  std::string Accept(const worker::v1::WorkerInfo& info);

 private:
  void SetMembers(const std::map<std::string, std::string>& members /* address -> name */);
  void StopConn(WorkerConn& c);
  bool WaitStop(std::chrono::milliseconds d);
  void PollMembers();
  void MembershipLoop();
  void Subscribe(WorkerConn& c);

  const RouterOptions opts_;
  const ModelConfig& model_;
  const std::string model_name_;
  ClusterIndex& index_;

  mutable std::mutex id_mu_;
  ServedIdentity id_;  // guarded by id_mu_

  std::mutex mu_;                                             // conns_
  std::map<std::string, std::shared_ptr<WorkerConn>> conns_;  // by address

  std::unique_ptr<etcd::EtcdClient> etcd_;
  std::thread membership_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
};

}  // namespace sparsex::router
