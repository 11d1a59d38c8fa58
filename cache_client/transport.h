// Data plane behind two small interfaces. The server side owns the memory-tier arena and
// makes it remotely readable/writable; the client side moves bytes between local memory and
// that arena by one-sided RMA. Which wire is used (shm, cma, tcp, rc, cuda) is configuration
// (TransportOptions::ucx_tls / UCX_TLS), not code.
//
//   server:  ASSIGN_OR_RETURN(auto t, CreateServerTransport(opts, 1 << 30));
//            uint8_t* arena = t->arena();  EndpointInfo ep = t->endpoint();  // -> GetEndpoint
//   client:  ASSIGN_OR_RETURN(auto c, CreateClientTransport(opts, ep));
//            RemoteOp ops[] = {{offset, dst, size}};
//            RETURN_IF_ERROR(c->Get(ops, [](size_t i) { /* op i (and all before) done */ },
//                                   deadline));
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"

namespace sparsex::cache {

struct TransportOptions {
  // Data plane: "ucx" (RMA to/from the registered arena) or "none" (bytes only inline through
  // gRPC: Commit.inline_data / Read). Default: "ucx" ("none" in a build without UCX).
  std::string kind = SPARSEX_WITH_UCX ? "ucx" : "none";
  // UCX transports, as UCX_TLS (e.g. "sysv,posix,cma,self" or "tcp" or "rc,cuda_copy").
  // Empty: the UCX_TLS environment variable, else UCX's own choice. Default: "".
  std::string ucx_tls;
  // Let UCX allocate the arena (shared-memory segments remote peers on the same host map
  // directly); false: mmap + register. Default: true.
  bool ucx_allocate_arena = true;
  // Fault the whole arena in (MADV_POPULATE_WRITE) in the background at startup, so that the
  // first puts do not pay a page fault per 4 KiB on the server side. Default: true.
  bool prefault_arena = true;
  // Page-lock the arena for the GPU (cudaHostRegister, loaded at runtime from libcudart, so the
  // server does not link CUDA): "auto" when a CUDA device is visible, "on" (fail without
  // one), "off". Default: "auto".
  std::string cuda_pin = "auto";
  // Client: when the server's arena is mapped into this process (UCX on one host: shared
  // memory), gets and puts copy through that mapping on up to 8 threads instead of UCX's one
  // progress thread (single-threaded copies held a cross-worker fetch on the H200 at ~4 GB/s).
  // false: always UCX's gets and puts. Default: true.
  bool mapped_copies = true;
};


// What a client needs to reach a server's arena (the GetEndpoint reply).
struct EndpointInfo {
  std::string transport;       // "ucx" or "none"
  std::string worker_address;  // packed ucp worker address
  std::string rkey;            // packed remote key of the arena
  uint64_t base_address = 0;   // remote virtual address of arena offset 0
  uint64_t arena_bytes = 0;
};

class ServerTransport {
 public:
  virtual ~ServerTransport() = default;
  virtual std::string name() const = 0;
  virtual uint8_t* arena() const = 0;
  virtual uint64_t arena_bytes() const = 0;
  virtual EndpointInfo endpoint() const = 0;
  // True when the arena is page-locked for CUDA (TransportOptions::cuda_pin).
  virtual bool cuda_pinned() const { return false; }
};

// kind "ucx": UCX context + worker with a progress thread, arena registered with ucp_mem_map.
// kind "none": an anonymous mapping; clients must use inline gRPC transfers.
absl::StatusOr<std::unique_ptr<ServerTransport>> CreateServerTransport(
    const TransportOptions& options, uint64_t arena_bytes);

using Deadline = std::chrono::steady_clock::time_point;

// One transfer between local memory and the remote arena.
struct RemoteOp {
  uint64_t remote_offset = 0;
  uint8_t* local = nullptr;
  uint64_t size = 0;
};

// A connection to one server's arena. Not thread-safe: one caller at a time.
class ClientTransport {
 public:
  virtual ~ClientTransport() = default;
  virtual std::string name() const = 0;
  // Reads every op (issued together, in order). `on_done(i)` runs for i = 0, 1, 2, ... once
  // op i and all ops before it have landed, so a consumer can start on layer 0 while later
  // layers are in flight. DEADLINE_EXCEEDED (connection then unusable) or UNAVAILABLE on error.
  virtual absl::Status Get(std::span<const RemoteOp> ops,
                           const std::function<void(size_t)>& on_done, Deadline deadline) = 0;
  // Writes every op and returns once they are remotely complete (visible to the server).
  virtual absl::Status Put(std::span<const RemoteOp> ops, Deadline deadline) = 0;
  // Drops the connection to the old endpoint (its remote key too) and connects to `ep`, e.g.
  // the same server after a restart (a new process: new worker address, new arena, new
  // rkey). Local registrations and memory from AllocateMemory stay valid. Also clears the
  // broken state an earlier timeout left.
  virtual absl::Status Reconnect(const EndpointInfo& ep) = 0;
  // Registers local memory used for transfers (zero-copy on RDMA NICs). Optional.
  virtual absl::Status RegisterMemory(void* p, size_t n) { return absl::OkStatus(); }
  virtual void UnregisterMemory(void* p) {}
  // Memory allocated and registered by the transport (for UCX on one host: shared memory,
  // which takes the zero-copy paths). nullptr when unsupported. Freed by FreeMemory.
  virtual void* AllocateMemory(size_t n) { return nullptr; }
  virtual void FreeMemory(void* p) {}
  // True when gets and puts copy through a local mapping of the arena
  // (TransportOptions::mapped_copies and a same-host server).
  virtual bool mapped() const { return false; }
};

namespace internal {
// Page-locks [p, p + n) with cudaHostRegister via dlopen'ed libcudart according to `mode`
// ("auto", "on", "off"). Returns whether it is pinned; FAILED_PRECONDITION for "on" without a
// usable CUDA runtime/device. CudaUnpin undoes it.
absl::StatusOr<bool> CudaPin(void* p, uint64_t n, const std::string& mode);
void CudaUnpin(void* p);

// Prefaults [p, p + n) page by page range in a detached-safe background thread; the returned
// object joins it on destruction (before the memory goes away).
class Prefaulter {
 public:
  Prefaulter(void* p, uint64_t n);
  ~Prefaulter();
  Prefaulter(const Prefaulter&) = delete;
  Prefaulter& operator=(const Prefaulter&) = delete;

 private:
  struct State;
  std::unique_ptr<State> s_;
};
}  // namespace internal

// UNAVAILABLE when `ep.transport` is "none" (use inline transfers) or unreachable.
absl::StatusOr<std::unique_ptr<ClientTransport>> CreateClientTransport(
    const TransportOptions& options, const EndpointInfo& ep);

}  // namespace sparsex::cache
