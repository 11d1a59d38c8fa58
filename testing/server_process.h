// Child processes for tests and benchmarks: spawn the real sparsex-cache-server (or any
// binary), wait for its ready file, signal it, reap it with a bound on the wait.
//
//   ASSIGN_OR_RETURN(auto srv, ServerProcess::Start(bin_dir, {"--disk_path=/tmp/x/db"}, "/tmp/x"));
//   CacheClientOptions o; o.address = srv->address();
//   ...
//   srv->Kill(SIGKILL);             // or srv->Stop() for SIGTERM + wait
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace sparsex::cache::testing {

class ChildProcess {
 public:
  // argv[0] is the path of the binary. stdout and stderr go to `log_path` (or are inherited
  // when empty). `env`: extra "NAME=value" entries on top of this process's environment.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(
      const std::vector<std::string>& argv, const std::string& log_path = "",
      const std::vector<std::string>& env = {});
  ~ChildProcess();  // SIGKILL + reap if still running

  pid_t pid() const { return pid_; }
  bool Running();
  void Signal(int sig);
  // Waits for exit up to `timeout`; the exit status (as from waitpid) or DEADLINE_EXCEEDED.
  absl::StatusOr<int> Wait(std::chrono::milliseconds timeout);
  // SIGTERM, wait up to `grace`, then SIGKILL and reap.
  void Stop(std::chrono::milliseconds grace = std::chrono::seconds(10));

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

class ServerProcess {
 public:
  // Starts `bin_dir`/sparsex-cache-server with `args` plus --ready_file and port-0 flags (and
  // --insecure_loopback unless `args` has --tls_* flags),
  // logs to `work_dir`/server.log, and waits (up to `timeout`) for the ready file.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::string& bin_dir, const std::vector<std::string>& args,
      const std::string& work_dir, std::chrono::milliseconds timeout = std::chrono::seconds(30),
      const std::vector<std::string>& env = {});

  const std::string& address() const { return address_; }  // "127.0.0.1:port"
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return child_->pid(); }
  ChildProcess& process() { return *child_; }
  void Kill(int sig = 9) { child_->Signal(sig); (void)child_->Wait(std::chrono::seconds(10)); }
  void Stop() { child_->Stop(); }
  std::string Log() const;

 private:
  ServerProcess() = default;
  std::unique_ptr<ChildProcess> child_;
  std::string address_, log_path_;
  int grpc_port_ = 0, metrics_port_ = 0;
};

// $SPARSEX_BIN_DIR, else the directory of the running executable.
std::string BinDir();
// A fresh directory under $TMPDIR (or /tmp); removed by RemoveTree.
std::string MakeTempDir(const std::string& prefix);
void RemoveTree(const std::string& path);
// Minimal HTTP GET on 127.0.0.1:port; body of a 200 reply.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);
// Runs a command line through /bin/sh, returns (exit status, combined output), bounded.
absl::StatusOr<std::pair<int, std::string>> RunCommand(const std::string& cmd,
                                                       std::chrono::milliseconds timeout);

}  // namespace sparsex::cache::testing
