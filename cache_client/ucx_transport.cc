// UCX data plane. The server maps its arena with ucp_mem_map (letting UCX allocate it, by
// default, so that on one host the segment is shared memory a peer maps directly) and packs
// one rkey for it. Clients connect to the server's worker address (exchanged over gRPC) and
// issue ucp_get_nbx / ucp_put_nbx; the server's progress thread only serves transports that
// need the target's CPU (tcp emulation, wireup).
#include "cache_client/transport.h"

#if SPARSEX_WITH_UCX
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace sparsex::cache::internal {
namespace {

absl::Status UcsError(ucs_status_t s, const char* what) {
  return absl::UnavailableError(absl::StrCat("ucx ", what, ": ", ucs_status_string(s)));
}

// One ucp context per (process, TLS setting), shared by all client connections.
class UcxContext {
 public:
  static absl::StatusOr<std::shared_ptr<UcxContext>> Create(const std::string& tls,
                                                            bool wakeup) {
    ucp_config_t* cfg = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
    if (s != UCS_OK) return UcsError(s, "config read");
    if (!tls.empty()) {
      s = ucp_config_modify(cfg, "TLS", tls.c_str());
      if (s != UCS_OK) {
        ucp_config_release(cfg);
        return absl::InvalidArgumentError(absl::StrCat("ucx: bad TLS '", tls, "': ",
                                                       ucs_status_string(s)));
      }
    }
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    p.features = UCP_FEATURE_RMA | (wakeup ? UCP_FEATURE_WAKEUP : 0);
    p.mt_workers_shared = 1;
    auto c = std::shared_ptr<UcxContext>(new UcxContext());
    s = ucp_init(&p, cfg, &c->ctx_);
    ucp_config_release(cfg);
    if (s != UCS_OK) return UcsError(s, "init");
    return c;
  }
  ~UcxContext() {
    if (ctx_ != nullptr) ucp_cleanup(ctx_);
  }
  ucp_context_h get() const { return ctx_; }

 private:
  UcxContext() = default;
  ucp_context_h ctx_ = nullptr;
};

absl::StatusOr<ucp_worker_h> NewWorker(ucp_context_h ctx, ucs_thread_mode_t mode) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = mode;
  ucp_worker_h w = nullptr;
  ucs_status_t s = ucp_worker_create(ctx, &wp, &w);
  if (s != UCS_OK) return UcsError(s, "worker create");
  return w;
}

class UcxServerTransport final : public ServerTransport {
 public:
  static absl::StatusOr<std::unique_ptr<ServerTransport>> Create(const TransportOptions& o,
                                                                 uint64_t n) {
    auto t = std::unique_ptr<UcxServerTransport>(new UcxServerTransport());
    // No UCP_FEATURE_WAKEUP: it excludes transports without event support (cma among them),
    // and then one-sided RMA falls back to emulation through the target's CPU.
    ASSIGN_OR_RETURN(t->ctx_, UcxContext::Create(o.ucx_tls, /*wakeup=*/false));
    ASSIGN_OR_RETURN(t->worker_, NewWorker(t->ctx_->get(), UCS_THREAD_MODE_MULTI));

    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = n;
    if (o.ucx_allocate_arena) {
      mp.address = nullptr;
      mp.flags = UCP_MEM_MAP_ALLOCATE;
    } else {
      void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return absl::ResourceExhaustedError("cannot map the arena");
      t->own_mapping_ = p;
      mp.address = p;
      mp.flags = 0;
    }
    ucs_status_t s = ucp_mem_map(t->ctx_->get(), &mp, &t->memh_);
    if (s != UCS_OK) return UcsError(s, "mem_map of the arena");
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    s = ucp_mem_query(t->memh_, &attr);
    if (s != UCS_OK) return UcsError(s, "mem_query");
    if (attr.length < n) return absl::InternalError("ucx mapped a shorter arena than asked");
    t->arena_ = static_cast<uint8_t*>(attr.address);
    t->n_ = n;
    // Page-locking faults every page in; prefault only what is not pinned.
    ASSIGN_OR_RETURN(t->cuda_pinned_, CudaPin(t->arena_, n, o.cuda_pin));
    if (o.prefault_arena && !t->cuda_pinned_) {
      t->prefault_ = std::make_unique<Prefaulter>(t->arena_, n);
    }

    void* rkey = nullptr;
    size_t rkey_len = 0;
    s = ucp_rkey_pack(t->ctx_->get(), t->memh_, &rkey, &rkey_len);
    if (s != UCS_OK) return UcsError(s, "rkey_pack");
    t->rkey_.assign(static_cast<const char*>(rkey), rkey_len);
    ucp_rkey_buffer_release(rkey);

    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    s = ucp_worker_get_address(t->worker_, &addr, &addr_len);
    if (s != UCS_OK) return UcsError(s, "worker address");
    t->address_.assign(reinterpret_cast<const char*>(addr), addr_len);
    ucp_worker_release_address(t->worker_, addr);

    t->stop_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    t->thread_ = std::thread([p = t.get()] { p->ProgressLoop(); });
    return std::unique_ptr<ServerTransport>(std::move(t));
  }

  ~UcxServerTransport() override {
    if (thread_.joinable()) {
      stop_.store(true);
      uint64_t one = 1;
      (void)!write(stop_fd_, &one, sizeof one);
      thread_.join();
    }
    if (stop_fd_ >= 0) close(stop_fd_);
    prefault_.reset();
    if (cuda_pinned_) CudaUnpin(arena_);
    if (memh_ != nullptr) ucp_mem_unmap(ctx_->get(), memh_);
    if (own_mapping_ != nullptr) munmap(own_mapping_, n_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
  }

  std::string name() const override { return "ucx"; }
  uint8_t* arena() const override { return arena_; }
  uint64_t arena_bytes() const override { return n_; }
  bool cuda_pinned() const override { return cuda_pinned_; }
  EndpointInfo endpoint() const override {
    EndpointInfo e;
    e.transport = "ucx";
    e.worker_address = address_;
    e.rkey = rkey_;
    e.base_address = reinterpret_cast<uint64_t>(arena_);
    e.arena_bytes = n_;
    return e;
  }

 private:
  UcxServerTransport() = default;

  // Serves wireup and transports that need the target's CPU (tcp's emulated RMA). Spins
  // while there is work, then backs off to sleeping up to 1 ms between polls: the one-sided
  // paths (shared memory, cma, RDMA) never wait for it.
  void ProgressLoop() {
    uint32_t idle_us = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      unsigned n = 0;
      while (ucp_worker_progress(worker_) != 0) ++n;
      if (n > 0) {
        idle_us = 0;
        continue;
      }
      idle_us = std::min<uint32_t>(idle_us == 0 ? 10 : idle_us * 2, 1000);
      pollfd fd = {stop_fd_, POLLIN, 0};
      ppoll_us(&fd, idle_us);
    }
  }

  static void ppoll_us(pollfd* fd, uint32_t us) {
    timespec ts{0, static_cast<long>(us) * 1000};
    ppoll(fd, 1, &ts, nullptr);
  }

  std::shared_ptr<UcxContext> ctx_;
  ucp_worker_h worker_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  void* own_mapping_ = nullptr;
  uint8_t* arena_ = nullptr;
  uint64_t n_ = 0;
  std::string rkey_, address_;
  int stop_fd_ = -1;
  bool cuda_pinned_ = false;
  std::unique_ptr<Prefaulter> prefault_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::shared_ptr<UcxContext> SharedClientContext(const std::string& tls,
                                                absl::Status* status) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<UcxContext>> contexts;
  std::lock_guard<std::mutex> lock(mu);
  if (auto c = contexts[tls].lock()) return c;
  auto c = UcxContext::Create(tls, /*wakeup=*/false);
  if (!c.ok()) {
    *status = c.status();
    return nullptr;
  }
  contexts[tls] = *c;
  return *c;
}

class UcxClientTransport final : public ClientTransport {
 public:
  static absl::StatusOr<std::unique_ptr<ClientTransport>> Create(const TransportOptions& o,
                                                                 const EndpointInfo& ep) {
    auto t = std::unique_ptr<UcxClientTransport>(new UcxClientTransport());
    t->mapped_copies_ = o.mapped_copies;
    absl::Status st;
    t->ctx_ = SharedClientContext(o.ucx_tls, &st);
    if (t->ctx_ == nullptr) return st;
    ASSIGN_OR_RETURN(t->worker_, NewWorker(t->ctx_->get(), UCS_THREAD_MODE_SERIALIZED));
    RETURN_IF_ERROR(t->Connect(ep));
    return std::unique_ptr<ClientTransport>(std::move(t));
  }

  ~UcxClientTransport() override {
    CloseEndpoint(/*force=*/broken_);
    for (auto& [p, m] : memh_) ucp_mem_unmap(ctx_->get(), m.second);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
  }

  absl::Status Reconnect(const EndpointInfo& ep) override {
    // The old peer is usually gone (a restarted server): do not wait for it to flush.
    CloseEndpoint(/*force=*/true);
    broken_ = false;
    absl::Status s = Connect(ep);
    if (!s.ok()) {
      CloseEndpoint(/*force=*/true);
      broken_ = true;  // no usable endpoint until the next successful Reconnect
    }
    return s;
  }

  std::string name() const override { return "ucx"; }

  absl::Status Get(std::span<const RemoteOp> ops, const std::function<void(size_t)>& on_done,
                   Deadline deadline) override {
    RETURN_IF_ERROR(Usable(ops));
    if (mapped_ != nullptr) {
      CopyMapped(ops, /*to_arena=*/false, on_done);
      return absl::OkStatus();
    }
    std::deque<std::pair<size_t, void*>> pending;  // (op index, request or nullptr = done)
    absl::Status err;
    for (size_t i = 0; i < ops.size(); ++i) {
      ucp_request_param_t prm{};
      SetMemh(ops[i].local, ops[i].size, &prm);
      void* req = ucp_get_nbx(ep_, ops[i].local, ops[i].size, base_ + ops[i].remote_offset,
                              rkey_, &prm);
      if (UCS_PTR_IS_ERR(req)) {
        err = UcsError(UCS_PTR_STATUS(req), "get");
        break;
      }
      pending.emplace_back(i, req);
      DeliverCompleted(&pending, on_done, &err);
    }
    return Drain(&pending, on_done, deadline, err);
  }

  absl::Status Put(std::span<const RemoteOp> ops, Deadline deadline) override {
    RETURN_IF_ERROR(Usable(ops));
    if (mapped_ != nullptr) {
      // Stores to the shared segment are visible to the server once they retire; it reads the
      // blocks only after the Commit RPC that follows.
      CopyMapped(ops, /*to_arena=*/true, {});
      std::atomic_thread_fence(std::memory_order_seq_cst);
      return absl::OkStatus();
    }
    std::deque<std::pair<size_t, void*>> pending;
    absl::Status err;
    for (size_t i = 0; i < ops.size() && err.ok(); ++i) {
      ucp_request_param_t prm{};
      SetMemh(ops[i].local, ops[i].size, &prm);
      void* req = ucp_put_nbx(ep_, ops[i].local, ops[i].size, base_ + ops[i].remote_offset,
                              rkey_, &prm);
      if (UCS_PTR_IS_ERR(req)) {
        err = UcsError(UCS_PTR_STATUS(req), "put");
        break;
      }
      pending.emplace_back(i, req);
    }
    if (err.ok()) {
      // Remote completion: the bytes are in the server's memory when the flush completes.
      ucp_request_param_t prm{};
      void* req = ucp_ep_flush_nbx(ep_, &prm);
      if (UCS_PTR_IS_ERR(req)) {
        err = UcsError(UCS_PTR_STATUS(req), "flush");
      } else {
        pending.emplace_back(ops.size(), req);
      }
    }
    return Drain(&pending, {}, deadline, err);
  }

  absl::Status RegisterMemory(void* p, size_t n) override {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = p;
    mp.length = n;
    ucp_mem_h m = nullptr;
    ucs_status_t s = ucp_mem_map(ctx_->get(), &mp, &m);
    if (s != UCS_OK) return UcsError(s, "mem_map");
    memh_[reinterpret_cast<uintptr_t>(p)] = {n, m};
    return absl::OkStatus();
  }

  void* AllocateMemory(size_t n) override {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = nullptr;
    mp.length = n;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h m = nullptr;
    if (ucp_mem_map(ctx_->get(), &mp, &m) != UCS_OK) return nullptr;
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    if (ucp_mem_query(m, &attr) != UCS_OK) {
      ucp_mem_unmap(ctx_->get(), m);
      return nullptr;
    }
    memh_[reinterpret_cast<uintptr_t>(attr.address)] = {attr.length, m};
    return attr.address;
  }

  void FreeMemory(void* p) override { UnregisterMemory(p); }

  bool mapped() const override { return mapped_ != nullptr; }

  void UnregisterMemory(void* p) override {
    auto it = memh_.find(reinterpret_cast<uintptr_t>(p));
    if (it == memh_.end()) return;
    ucp_mem_unmap(ctx_->get(), it->second.second);
    memh_.erase(it);
  }

 private:
  UcxClientTransport() = default;

  // An endpoint to the server's worker and its arena's remote key (unpacked on that endpoint:
  // on one host this maps the server's shared-memory segment).
  absl::Status Connect(const EndpointInfo& ep) {
    ucp_ep_params_t epp{};
    epp.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    epp.address = reinterpret_cast<const ucp_address_t*>(ep.worker_address.data());
    epp.err_mode = UCP_ERR_HANDLING_MODE_NONE;  // PEER mode would drop shm transports
    ucs_status_t s = ucp_ep_create(worker_, &epp, &ep_);
    if (s != UCS_OK) {
      ep_ = nullptr;
      return UcsError(s, "ep_create");
    }
    s = ucp_ep_rkey_unpack(ep_, ep.rkey.data(), &rkey_);
    if (s != UCS_OK) {
      rkey_ = nullptr;
      return UcsError(s, "rkey_unpack");
    }
    base_ = ep.base_address;
    arena_bytes_ = ep.arena_bytes;
    // On one host the server's arena is a shared-memory segment that unpacking its key mapped
    // into this process, and UCX's gets and puts go through that mapping. It is fresh here, so
    // the first access to each 4 KiB page faults: a worker fetching blocks another worker wrote
    // moved 0.13-0.28 GB/s on this VM against 6-8 GB/s through pages it had touched. Its pages
    // are mapped in the background from the start (content untouched; shared memory, so this
    // adds to the process's RSS, not to the machine's use), which doubled that first fetch
    // and took write-backs from ~0.37 to ~0.5 GB/s here (docs/benchmarks.md).
    void* mapped = nullptr;
    if (ucp_rkey_ptr(rkey_, base_, &mapped) == UCS_OK && mapped != nullptr) {
      prefault_ = std::make_unique<Prefaulter>(mapped, arena_bytes_);
      if (mapped_copies_) mapped_ = static_cast<uint8_t*>(mapped);
    }
    return absl::OkStatus();
  }

  // Gets (to_arena false) or puts through the mapping: windows of up to kWindow bytes, each
  // cut into kChunk pieces copied on up to kThreads threads (this one included); on_done(i)
  // runs, in order, for the ops of a window once it has landed, so a consumer (the cache
  // client's checksum check) works on one window while the next copies.
  void CopyMapped(std::span<const RemoteOp> ops, bool to_arena,
                  const std::function<void(size_t)>& on_done) {
    constexpr uint64_t kChunk = uint64_t{4} << 20, kWindow = uint64_t{128} << 20;
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    const unsigned threads = std::min(8u, hw);
    struct Piece {
      uint8_t* dst;
      const uint8_t* src;
      size_t n;
    };
    std::vector<Piece> pieces;
    for (size_t i = 0; i < ops.size();) {
      size_t j = i;
      uint64_t bytes = 0;
      while (j < ops.size() && (j == i || bytes + ops[j].size <= kWindow)) bytes += ops[j++].size;
      pieces.clear();
      for (size_t k = i; k < j; ++k) {
        uint8_t* remote = mapped_ + ops[k].remote_offset;
        for (uint64_t off = 0; off < ops[k].size; off += kChunk) {
          const size_t n = static_cast<size_t>(std::min(kChunk, ops[k].size - off));
          if (to_arena) pieces.push_back({remote + off, ops[k].local + off, n});
          else pieces.push_back({ops[k].local + off, remote + off, n});
        }
      }
      std::atomic<size_t> next{0};
      auto work = [&] {
        for (size_t p; (p = next.fetch_add(1)) < pieces.size();) {
          std::memcpy(pieces[p].dst, pieces[p].src, pieces[p].n);
        }
      };
      std::vector<std::thread> helpers;
      const size_t want = std::min<size_t>(threads, pieces.size());
      for (size_t t = 1; t < want; ++t) helpers.emplace_back(work);
      work();
      for (std::thread& t : helpers) t.join();
      if (on_done) {
        for (size_t k = i; k < j; ++k) on_done(k);
      }
      i = j;
    }
  }

  // Destroys the remote key (unmapping the peer's segment) and closes the endpoint; `force`
  // does not flush outstanding operations to the peer (it may be dead).
  void CloseEndpoint(bool force) {
    prefault_.reset();  // joined before the mapping goes with the remote key
    mapped_ = nullptr;
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    rkey_ = nullptr;
    if (ep_ == nullptr) return;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = ucp_ep_close_nbx(ep_, &prm);
    if (UCS_PTR_IS_PTR(req)) {
      auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (ucp_request_check_status(req) == UCS_INPROGRESS &&
             std::chrono::steady_clock::now() < until) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(req);
    }
    ep_ = nullptr;
  }

  absl::Status Usable(std::span<const RemoteOp> ops) const {
    if (broken_ || ep_ == nullptr || rkey_ == nullptr) {
      return absl::UnavailableError("ucx connection broken by an earlier error; reconnect");
    }
    for (const auto& op : ops) {
      if (op.remote_offset + op.size > arena_bytes_ || op.remote_offset + op.size < op.size) {
        return absl::InvalidArgumentError("remote range outside the arena");
      }
    }
    return absl::OkStatus();
  }

  void SetMemh(const void* p, size_t n, ucp_request_param_t* prm) const {
    if (memh_.empty()) return;
    auto a = reinterpret_cast<uintptr_t>(p);
    auto it = memh_.upper_bound(a);
    if (it == memh_.begin()) return;
    --it;
    if (a + n <= it->first + it->second.first) {
      prm->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      prm->memh = it->second.second;
    }
  }

  // Completes the in-order prefix of `pending`, calling on_done for data ops.
  void DeliverCompleted(std::deque<std::pair<size_t, void*>>* pending,
                        const std::function<void(size_t)>& on_done, absl::Status* err) {
    while (!pending->empty()) {
      auto [i, req] = pending->front();
      if (req != nullptr && UCS_PTR_IS_PTR(req)) {
        ucs_status_t s = ucp_request_check_status(req);
        if (s == UCS_INPROGRESS) return;
        ucp_request_free(req);
        if (s != UCS_OK && err->ok()) *err = UcsError(s, "transfer");
      }
      pending->pop_front();
      if (on_done && err->ok()) on_done(i);
    }
  }

  absl::Status Drain(std::deque<std::pair<size_t, void*>>* pending,
                     const std::function<void(size_t)>& on_done, Deadline deadline,
                     absl::Status err) {
    uint32_t spins = 0;
    while (!pending->empty()) {
      ucp_worker_progress(worker_);
      DeliverCompleted(pending, on_done, &err);
      if ((++spins & 1023) == 0 && std::chrono::steady_clock::now() > deadline) {
        // RMA cannot be cancelled: force-close the endpoint so the requests complete with an
        // error before the caller's buffers go away.
        broken_ = true;
        prefault_.reset();
        mapped_ = nullptr;
        if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
        rkey_ = nullptr;
        ucp_request_param_t prm{};
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
        void* req = ucp_ep_close_nbx(ep_, &prm);
        while (UCS_PTR_IS_PTR(req) && ucp_request_check_status(req) == UCS_INPROGRESS) {
          ucp_worker_progress(worker_);
        }
        if (UCS_PTR_IS_PTR(req)) ucp_request_free(req);
        ep_ = nullptr;
        for (auto& [i, r] : *pending) {
          if (r != nullptr && UCS_PTR_IS_PTR(r)) {
            ucp_request_cancel(worker_, r);
            ucp_request_free(r);
          }
        }
        pending->clear();
        return absl::DeadlineExceededError("ucx transfer did not complete in time");
      }
    }
    return err;
  }

  std::shared_ptr<UcxContext> ctx_;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
  uint64_t base_ = 0, arena_bytes_ = 0;
  // Maps the server's arena into this process (one host); joined before the key is destroyed.
  std::unique_ptr<Prefaulter> prefault_;
  // That mapping, when gets and puts copy through it (TransportOptions::mapped_copies).
  bool mapped_copies_ = true;
  uint8_t* mapped_ = nullptr;
  bool broken_ = false;
  std::map<uintptr_t, std::pair<size_t, ucp_mem_h>> memh_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ServerTransport>> CreateUcxServerTransport(
    const TransportOptions& options, uint64_t arena_bytes) {
  return UcxServerTransport::Create(options, arena_bytes);
}

absl::StatusOr<std::unique_ptr<ClientTransport>> CreateUcxClientTransport(
    const TransportOptions& options, const EndpointInfo& ep) {
  return UcxClientTransport::Create(options, ep);
}

}  // namespace sparsex::cache::internal
#endif  // SPARSEX_WITH_UCX
