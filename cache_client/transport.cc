#include "cache_client/transport.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <thread>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace sparsex::cache {

namespace internal {

namespace {
struct CudaApi {
  int (*get_device_count)(int*) = nullptr;
  int (*host_register)(void*, size_t, unsigned) = nullptr;
  int (*host_unregister)(void*) = nullptr;
  bool ok = false;
};

const CudaApi& Cuda() {
  static const CudaApi api = [] {
    CudaApi a;
    for (const char* name : {"libcudart.so", "libcudart.so.13", "libcudart.so.12"}) {
      void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (h == nullptr) continue;
      a.get_device_count = reinterpret_cast<int (*)(int*)>(dlsym(h, "cudaGetDeviceCount"));
      a.host_register =
          reinterpret_cast<int (*)(void*, size_t, unsigned)>(dlsym(h, "cudaHostRegister"));
      a.host_unregister = reinterpret_cast<int (*)(void*)>(dlsym(h, "cudaHostUnregister"));
      a.ok = a.get_device_count && a.host_register && a.host_unregister;
      if (a.ok) break;
    }
    return a;
  }();
  return api;
}
}  // namespace

absl::StatusOr<bool> CudaPin(void* p, uint64_t n, const std::string& mode) {
  if (mode == "off") return false;
  if (mode != "auto" && mode != "on") {
    return absl::InvalidArgumentError("cuda_pin must be auto, on or off");
  }
  const CudaApi& api = Cuda();
  int devices = 0;
  if (!api.ok || api.get_device_count(&devices) != 0 || devices == 0) {
    if (mode == "on") return absl::FailedPreconditionError("cuda_pin=on: no CUDA runtime/device");
    return false;
  }
  constexpr unsigned kPortable = 1;  // cudaHostRegisterPortable
  if (api.host_register(p, n, kPortable) != 0) {
    if (mode == "on") return absl::UnavailableError("cudaHostRegister of the arena failed");
    return false;
  }
  return true;
}

void CudaUnpin(void* p) {
  if (Cuda().ok) Cuda().host_unregister(p);
}

struct Prefaulter::State {
  std::atomic<bool> stop{false};
  std::thread thread;
};

Prefaulter::Prefaulter(void* p, uint64_t n) : s_(std::make_unique<State>()) {
  s_->thread = std::thread([p, n, st = s_.get()] {
    constexpr uint64_t kChunk = 64ull << 20;
    auto* base = static_cast<uint8_t*>(p);
    for (uint64_t off = 0; off < n && !st->stop.load(); off += kChunk) {
      const uint64_t len = std::min(kChunk, n - off);
      if (madvise(base + off, len, MADV_POPULATE_WRITE) != 0) {
        // Older kernels: touch one byte per page (reads keep the content intact).
        volatile uint8_t* v = base + off;
        for (uint64_t i = 0; i < len; i += 4096) (void)v[i];
      }
    }
  });
}

Prefaulter::~Prefaulter() {
  s_->stop.store(true);
  if (s_->thread.joinable()) s_->thread.join();
}

absl::StatusOr<std::unique_ptr<ServerTransport>> CreateUcxServerTransport(
    const TransportOptions& options, uint64_t arena_bytes);
absl::StatusOr<std::unique_ptr<ClientTransport>> CreateUcxClientTransport(
    const TransportOptions& options, const EndpointInfo& ep);
}  // namespace internal

namespace {

// Arena without a data plane: plain anonymous memory, reachable only through inline gRPC.
class NoneServerTransport final : public ServerTransport {
 public:
  static absl::StatusOr<std::unique_ptr<ServerTransport>> Create(uint64_t n, bool prefault,
                                                                 const std::string& cuda_pin) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map an arena of ", n, " bytes"));
    }
    auto t = std::unique_ptr<NoneServerTransport>(new NoneServerTransport());
    t->arena_ = static_cast<uint8_t*>(p);
    t->n_ = n;
    ASSIGN_OR_RETURN(t->pinned_, internal::CudaPin(p, n, cuda_pin));
    if (prefault && !t->pinned_) t->prefault_ = std::make_unique<internal::Prefaulter>(p, n);
    return std::unique_ptr<ServerTransport>(std::move(t));
  }
  ~NoneServerTransport() override {
    prefault_.reset();
    if (pinned_) internal::CudaUnpin(arena_);
    munmap(arena_, n_);
  }
  bool cuda_pinned() const override { return pinned_; }
  std::string name() const override { return "none"; }
  uint8_t* arena() const override { return arena_; }
  uint64_t arena_bytes() const override { return n_; }
  EndpointInfo endpoint() const override {
    EndpointInfo e;
    e.transport = "none";
    e.arena_bytes = n_;
    return e;
  }

 private:
  NoneServerTransport() = default;
  uint8_t* arena_ = nullptr;
  uint64_t n_ = 0;
  bool pinned_ = false;
  std::unique_ptr<internal::Prefaulter> prefault_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ServerTransport>> CreateServerTransport(
    const TransportOptions& options, uint64_t arena_bytes) {
  if (arena_bytes == 0) return absl::InvalidArgumentError("arena of 0 bytes");
  if (options.kind == "none") {
    return NoneServerTransport::Create(arena_bytes, options.prefault_arena, options.cuda_pin);
  }
  if (options.kind == "ucx") {
#if SPARSEX_WITH_UCX
    return internal::CreateUcxServerTransport(options, arena_bytes);
#else
    return absl::UnimplementedError("built without UCX (SPARSEX_WITH_UCX=OFF)");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport '", options.kind, "' (ucx, none)"));
}

absl::StatusOr<std::unique_ptr<ClientTransport>> CreateClientTransport(
    const TransportOptions& options, const EndpointInfo& ep) {
  if (ep.transport == "ucx") {
#if SPARSEX_WITH_UCX
    return internal::CreateUcxClientTransport(options, ep);
#else
    return absl::UnimplementedError("built without UCX (SPARSEX_WITH_UCX=OFF)");
#endif
  }
  return absl::UnavailableError(
      absl::StrCat("server offers no data plane (transport '", ep.transport, "')"));
}

}  // namespace sparsex::cache
