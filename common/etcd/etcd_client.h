// etcd v3 through its JSON gateway (/v3/...), over the small HTTP client: enough for service
// membership. Keys and values are plain strings here (base64 on the wire is handled inside).
//
//   EtcdClient etcd({.endpoints = {"127.0.0.1:2379"}});
//   ASSIGN_OR_RETURN(int64_t lease, etcd.LeaseGrant(10));
//   RETURN_IF_ERROR(etcd.Put("/sparsex/workers/w1", json, lease));
//   ASSIGN_OR_RETURN(auto kvs, etcd.RangePrefix("/sparsex/workers/"));
//
//   // Keeps a key registered under a lease (re-granted and re-put if it ever expires).
//   EtcdRegistration reg(&etcd, "/sparsex/workers/w1", json, /*ttl_s=*/10);
//   reg.Start();  ...  reg.Stop();  // revokes the lease: the key disappears at once
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace sparsex::etcd {

struct EtcdOptions {
  // Client URLs "host:port" (an "http://" prefix is accepted); tried in order. Default: none.
  std::vector<std::string> endpoints;
  int timeout_ms = 3000;  // per HTTP request. Default: 3000
};

struct KeyValue {
  std::string key, value;
  int64_t lease = 0;
  int64_t mod_revision = 0;
};

class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions options) : opts_(std::move(options)) {}

  absl::StatusOr<int64_t> LeaseGrant(int ttl_s);
  // Returns the remaining TTL; NOT_FOUND when the lease has expired.
  absl::StatusOr<int64_t> LeaseKeepAlive(int64_t lease);
  absl::Status LeaseRevoke(int64_t lease);
  absl::Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  absl::StatusOr<std::vector<KeyValue>> RangePrefix(const std::string& prefix);
  absl::StatusOr<std::vector<KeyValue>> Get(const std::string& key);
  absl::Status Delete(const std::string& key);
  // OK when some endpoint answers /health with health "true".
  absl::Status Health();

  const EtcdOptions& options() const { return opts_; }

 private:
  // POSTs JSON to path on the first endpoint that answers; returns the reply body.
  absl::StatusOr<std::string> Call(const std::string& path, const std::string& body);
  EtcdOptions opts_;
};

// A key kept alive under a lease by a background thread (keepalive every ttl/3). A lost lease
// (etcd restarted, partition longer than the TTL) is re-granted and the key put again.
class EtcdRegistration {
 public:
  EtcdRegistration(EtcdClient* client, std::string key, std::string value, int ttl_s);
  ~EtcdRegistration();  // Stop()

  // Registers once synchronously (error if etcd is unreachable), then keeps it alive.
  absl::Status Start();
  // Stops the keepalive and revokes the lease (the key is deleted at once).
  void Stop();
  void UpdateValue(const std::string& value);
  bool registered() const { return registered_.load(); }

 private:
  absl::Status Register();
  void Loop();
  EtcdClient* client_;
  std::string key_, value_;
  int ttl_s_;
  int64_t lease_ = 0;
  std::atomic<bool> registered_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace sparsex::etcd
