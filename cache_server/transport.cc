#include "cache_server/transport.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <thread>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace sparsex::cache {

namespace internal {

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
  static absl::StatusOr<std::unique_ptr<ServerTransport>> Create(uint64_t n, bool prefault) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map an arena of ", n, " bytes"));
    }
    auto t = std::unique_ptr<NoneServerTransport>(new NoneServerTransport());
    t->arena_ = static_cast<uint8_t*>(p);
    t->n_ = n;
    if (prefault) t->prefault_ = std::make_unique<internal::Prefaulter>(p, n);
    return std::unique_ptr<ServerTransport>(std::move(t));
  }
  ~NoneServerTransport() override {
    prefault_.reset();
    munmap(arena_, n_);
  }
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
  std::unique_ptr<internal::Prefaulter> prefault_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ServerTransport>> CreateServerTransport(
    const TransportOptions& options, uint64_t arena_bytes) {
  if (arena_bytes == 0) return absl::InvalidArgumentError("arena of 0 bytes");
  if (options.kind == "none") {
    return NoneServerTransport::Create(arena_bytes, options.prefault_arena);
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
