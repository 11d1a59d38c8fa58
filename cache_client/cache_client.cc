#include "cache_client/cache_client.h"

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>

#include <set>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "cache_client/key_codec.h"
#include "cache_client/transport.h"
#include "common/kv_block.h"
#include "proto/cache.grpc.pb.h"
#include "proto/grpc_status.h"

namespace sparsex::cache {

namespace pb = sparsex::cache::v1;

namespace {

// The first RPC after the server restarted finds the channel's old connection dead and fails
// with UNAVAILABLE although the new server is up. gRPC retries it (on a new connection) for
// every method except Commit, the one whose repetition could turn a success into an error.
constexpr char kRetryServiceConfig[] = R"json({"methodConfig": [{
  "name": [{"service": "sparsex.cache.v1.CacheService", "method": "Lookup"},
           {"service": "sparsex.cache.v1.CacheService", "method": "Reserve"},
           {"service": "sparsex.cache.v1.CacheService", "method": "Abort"},
           {"service": "sparsex.cache.v1.CacheService", "method": "Lease"},
           {"service": "sparsex.cache.v1.CacheService", "method": "RenewLease"},
           {"service": "sparsex.cache.v1.CacheService", "method": "ReleaseLease"},
           {"service": "sparsex.cache.v1.CacheService", "method": "Read"},
           {"service": "sparsex.cache.v1.CacheService", "method": "Evict"},
           {"service": "sparsex.cache.v1.CacheService", "method": "Stats"},
           {"service": "sparsex.cache.v1.CacheService", "method": "Health"},
           {"service": "sparsex.cache.v1.CacheService", "method": "GetEndpoint"}],
  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.02s", "maxBackoff": "0.2s",
                  "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})json";

EndpointInfo EndpointFromProto(const pb::EndpointResponse& r) {
  EndpointInfo ep;
  ep.transport = r.transport();
  ep.worker_address = r.worker_address();
  ep.rkey = r.rkey();
  ep.base_address = r.base_address();
  ep.arena_bytes = r.arena_bytes();
  return ep;
}

// Marks FetchInto's NOT_FOUND for a block that failed its checksum (FailedVerification).
constexpr char kFailedVerificationPayload[] = "type.sparsex.dev/cache.FailedVerification";

}  // namespace

bool FailedVerification(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound &&
         s.GetPayload(kFailedVerificationPayload).has_value();
}

struct CacheClient::Impl {
  CacheClientOptions opt;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::CacheService::Stub> stub;
  std::unique_ptr<ClientTransport> transport;  // null: inline gRPC
  std::mutex transport_mu;
  std::string server_id, data_plane;
  std::mutex buffers_mu;
  std::set<void*> transport_buffers;
  uint64_t max_block_bytes = 0;
  // Incarnation of the server the transport's endpoint and rkey came from (GetEndpoint), and
  // whether they must be exchanged again before the next transfer: a reply carried another
  // incarnation, or a transfer failed. Written under transport_mu.
  std::atomic<uint64_t> instance_id{0};
  std::atomic<bool> stale{false};
  std::atomic<uint64_t> reconnects{0};

  // A reply from incarnation `id`: when it is not the transport's, the endpoint is stale.
  void NoteInstance(uint64_t id) {
    if (id != 0 && id != instance_id.load()) stale.store(true);
  }

  // Makes the transport's endpoint that of incarnation `want` (0: whatever the server is now)
  // before a transfer whose offsets came from a reply of `want`. transport_mu held. UNAVAILABLE
  // "server_restarted" when the server is yet another incarnation (the caller starts again
  // from Lease/Reserve); never a reason to suspect the stored blocks.
  absl::Status EnsureEndpointLocked(uint64_t want) {
    if (transport == nullptr) return absl::OkStatus();
    if (!stale.load() && (want == 0 || want == instance_id.load())) return absl::OkStatus();
    pb::EndpointRequest req;
    pb::EndpointResponse resp;
    RETURN_IF_ERROR(FromGrpcStatus(stub->GetEndpoint(Ctx().get(), req, &resp)));
    if (want != 0 && resp.instance_id() != 0 && resp.instance_id() != want) {
      stale.store(true);
      return absl::UnavailableError(absl::StrCat(
          "server_restarted: ", opt.address, " is incarnation ", resp.instance_id(),
          ", the reply to use was from ", want, "; start again"));
    }
    if (resp.transport() != "ucx") {
      return absl::UnavailableError(absl::StrCat("server_restarted: ", opt.address,
                                                 " offers no UCX data plane any more"));
    }
    RETURN_IF_ERROR(transport->Reconnect(EndpointFromProto(resp)));
    instance_id.store(resp.instance_id());
    stale.store(false);
    reconnects.fetch_add(1);
    return absl::OkStatus();
  }

  std::unique_ptr<grpc::ClientContext> Ctx() const {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(opt.rpc_timeout_ms));
    return c;
  }
  Deadline TransferDeadline() const {
    return std::chrono::steady_clock::now() + std::chrono::milliseconds(opt.transfer_timeout_ms);
  }
};

CacheClient::CacheClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CacheClient::~CacheClient() = default;

absl::StatusOr<std::unique_ptr<CacheClient>> CacheClient::Connect(
    const CacheClientOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("client: empty address");
  if (options.transport != "ucx" && options.transport != "grpc") {
    return absl::InvalidArgumentError("client: transport must be ucx or grpc");
  }
  auto impl = std::make_unique<Impl>();
  impl->opt = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetServiceConfigJSON(kRetryServiceConfig);
  ASSIGN_OR_RETURN(ClientChannelSecurity sec, ClientCredentials(options.tls));
  sec.Apply(&args);
  impl->channel = grpc::CreateCustomChannel(options.address, sec.creds, args);
  impl->stub = pb::CacheService::NewStub(impl->channel);

  pb::EndpointRequest req;
  pb::EndpointResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl->stub->GetEndpoint(impl->Ctx().get(), req, &resp)));
  impl->server_id = resp.server_id();
  impl->max_block_bytes = resp.max_block_bytes();
  impl->instance_id.store(resp.instance_id());
  impl->data_plane = "grpc";
  if (options.transport == "ucx") {
    EndpointInfo ep = EndpointFromProto(resp);
    TransportOptions to;
    to.kind = "ucx";
    to.ucx_tls = options.ucx_tls;
    to.mapped_copies = options.mapped_copies;
    auto t = CreateClientTransport(to, ep);
    if (t.ok()) {
      impl->transport = std::move(*t);
      impl->data_plane = "ucx";
    } else if (!options.fallback_to_grpc) {
      return t.status();
    }
  }
  return std::unique_ptr<CacheClient>(new CacheClient(std::move(impl)));
}

absl::StatusOr<std::vector<LookupInfo>> CacheClient::Lookup(std::span<const BlockKey> keys) {
  pb::LookupRequest req;
  req.set_model_fp(EncodeFingerprint(impl_->opt.model_fp));
  req.set_layout_version(impl_->opt.layout_version);
  for (const auto& k : keys) KeyToProto(k, req.add_keys());
  pb::LookupResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->Lookup(impl_->Ctx().get(), req, &resp)));
  impl_->NoteInstance(resp.instance_id());
  if (resp.results_size() != static_cast<int>(keys.size())) {
    return absl::InternalError("lookup: reply has the wrong number of results");
  }
  std::vector<LookupInfo> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& r = resp.results(static_cast<int>(i));
    out[i].present = r.present();
    out[i].tier = static_cast<Tier>(r.tier());
    out[i].size = r.size();
    out[i].layout_version = r.layout_version();
    out[i].code = static_cast<absl::StatusCode>(r.code());
  }
  return out;
}

absl::StatusOr<Reservation> CacheClient::Reserve(const BlockKey& key, uint64_t size,
                                                 double cost) {
  pb::ReserveRequest req;
  req.set_model_fp(EncodeFingerprint(impl_->opt.model_fp));
  req.set_layout_version(impl_->opt.layout_version);
  KeyToProto(key, req.mutable_key());
  req.set_size(size);
  req.set_cost(cost);
  pb::ReserveResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->Reserve(impl_->Ctx().get(), req, &resp)));
  impl_->NoteInstance(resp.instance_id());
  return Reservation{resp.reservation_id(), resp.offset(), resp.deadline_unix_ms(),
                     resp.instance_id()};
}

absl::Status CacheClient::Write(const Reservation& r, std::span<const uint8_t> bytes,
                                uint64_t at) {
  if (impl_->transport == nullptr) {
    return absl::FailedPreconditionError("no data plane: commit the block inline");
  }
  RemoteOp op{r.offset + at, const_cast<uint8_t*>(bytes.data()), bytes.size()};
  std::lock_guard<std::mutex> lock(impl_->transport_mu);
  RETURN_IF_ERROR(impl_->EnsureEndpointLocked(r.instance_id));
  absl::Status s = impl_->transport->Put({&op, 1}, impl_->TransferDeadline());
  if (!s.ok()) impl_->stale.store(true);  // exchange endpoints before the next transfer
  return s;
}

absl::Status CacheClient::Commit(const Reservation& r, uint64_t checksum,
                                 std::span<const uint8_t> inline_block) {
  pb::CommitRequest req;
  req.set_reservation_id(r.id);
  req.set_checksum(checksum);
  if (!inline_block.empty()) {
    req.set_inline_data(reinterpret_cast<const char*>(inline_block.data()), inline_block.size());
  }
  pb::CommitResponse resp;
  return FromGrpcStatus(impl_->stub->Commit(impl_->Ctx().get(), req, &resp));
}

absl::Status CacheClient::Abort(const Reservation& r) {
  pb::AbortRequest req;
  req.set_reservation_id(r.id);
  pb::AbortResponse resp;
  return FromGrpcStatus(impl_->stub->Abort(impl_->Ctx().get(), req, &resp));
}

absl::Status CacheClient::Put(const BlockKey& key, std::span<const uint8_t> block, double cost) {
  const uint64_t checksum = KvBlockWireChecksum(block);
  for (int attempt = 0;; ++attempt) {
    ASSIGN_OR_RETURN(Reservation r, Reserve(key, block.size(), cost));
    if (impl_->transport == nullptr) return Commit(r, checksum, block);
    if (absl::Status s = Write(r, block); !s.ok()) {
      (void)Abort(r);
      return s;
    }
    absl::Status s = Commit(r, checksum);
    // The checksum is of our own bytes: a mismatch after an RMA write means the write did not
    // land in this server's arena (an endpoint of a previous incarnation that the reply could
    // not reveal). Exchange endpoints and put once more; the failed commit freed the space.
    if (s.code() == absl::StatusCode::kDataLoss && attempt == 0) {
      impl_->stale.store(true);
      continue;
    }
    return s;
  }
}

absl::StatusOr<std::vector<absl::Status>> CacheClient::FetchInto(std::span<const BlockKey> keys,
                                                                 const Allocator& alloc,
                                                                 const OnBlock& on_block) {
  pb::LeaseRequest req;
  req.set_model_fp(EncodeFingerprint(impl_->opt.model_fp));
  req.set_layout_version(impl_->opt.layout_version);
  req.set_ttl_ms(impl_->opt.lease_ttl_ms);
  req.set_partial(true);
  for (const auto& k : keys) KeyToProto(k, req.add_keys());
  pb::LeaseResponse lease;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->Lease(impl_->Ctx().get(), req, &lease)));
  impl_->NoteInstance(lease.instance_id());
  if (lease.blocks_size() != static_cast<int>(keys.size())) {
    return absl::InternalError("lease: reply has the wrong number of blocks");
  }

  std::vector<absl::Status> status(keys.size());
  std::vector<uint8_t*> dst(keys.size(), nullptr);
  std::vector<size_t> present;  // key indices leased OK, in order
  std::vector<RemoteOp> ops;
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& b = lease.blocks(static_cast<int>(i));
    if (b.code() != 0) {
      status[i] = absl::NotFoundError(absl::StrCat("miss: ", keys[i].ToString()));
      continue;
    }
    dst[i] = alloc(i, b.size());
    if (dst[i] == nullptr) {
      status[i] = absl::ResourceExhaustedError("allocator returned no memory");
      continue;
    }
    present.push_back(i);
    ops.push_back({b.offset(), dst[i], b.size()});
  }

  std::vector<size_t> mismatched;  // key indices whose bytes arrived and failed the checksum
  size_t next_report = 0;  // next key index to report through on_block (key order)
  auto report_until = [&](size_t end) {
    for (; next_report < end; ++next_report) {
      if (on_block) {
        const auto& b = lease.blocks(static_cast<int>(next_report));
        on_block(next_report, status[next_report],
                 status[next_report].ok() ? std::span<const uint8_t>(dst[next_report], b.size())
                                          : std::span<const uint8_t>());
      }
    }
  };
  std::mutex mismatched_mu;  // check() runs on several verifier threads
  auto check = [&](size_t j) {
    const size_t i = present[j];
    const auto& b = lease.blocks(static_cast<int>(i));
    if (impl_->opt.verify &&
        KvBlockWireChecksum({dst[i], static_cast<size_t>(b.size())}) != b.checksum()) {
      status[i] = absl::NotFoundError(absl::StrCat("miss: ", keys[i].ToString(),
                                                   " failed checksum verification"));
      status[i].SetPayload(kFailedVerificationPayload, absl::Cord());
      std::lock_guard<std::mutex> l(mismatched_mu);
      mismatched.push_back(i);
    }
  };
  auto landed = [&](size_t j) {
    check(j);
    report_until(present[j] + 1);
  };

  absl::Status transfer;
  if (!ops.empty()) {
    if (impl_->transport != nullptr && impl_->opt.verify && impl_->opt.verify_in_background &&
        present.size() > 1) {
      // Pipeline: this thread drives the transfer while helpers verify the blocks that have
      // landed, each taking the next one (several at once: one thread's checksum held a
      // cross-worker fetch on the H200 at ~4.4 GB/s); blocks are reported in key order as the
      // verified prefix grows, one at a time.
      std::mutex qm;
      std::condition_variable qcv;
      size_t arrived = 0;
      bool finished = false;
      std::atomic<size_t> next_j{0};
      std::mutex report_mu;
      std::vector<char> verified(present.size(), 0);
      size_t reported_j = 0;  // present[0, reported_j) reported
      auto verify_loop = [&] {
        for (;;) {
          const size_t j = next_j.fetch_add(1);
          if (j >= present.size()) return;
          {
            std::unique_lock<std::mutex> l(qm);
            qcv.wait(l, [&] { return arrived > j || finished; });
            if (arrived <= j) return;  // the transfer ended before block j landed
          }
          check(j);
          std::lock_guard<std::mutex> l(report_mu);
          verified[j] = 1;
          for (; reported_j < present.size() && verified[reported_j]; ++reported_j) {
            report_until(present[reported_j] + 1);
          }
        }
      };
      const size_t n_verifiers = std::min<size_t>(
          present.size(), std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 1, 8));
      std::vector<std::thread> verifiers;
      for (size_t v = 0; v < n_verifiers; ++v) verifiers.emplace_back(verify_loop);
      {
        std::lock_guard<std::mutex> lock(impl_->transport_mu);
        transfer = impl_->EnsureEndpointLocked(lease.instance_id());
        if (transfer.ok()) {
          transfer = impl_->transport->Get(
              ops,
              [&](size_t j) {
                {
                  std::lock_guard<std::mutex> l(qm);
                  arrived = j + 1;
                }
                qcv.notify_all();
              },
              impl_->TransferDeadline());
        }
      }
      {
        std::lock_guard<std::mutex> l(qm);
        finished = true;
      }
      qcv.notify_all();
      for (std::thread& v : verifiers) v.join();
    } else if (impl_->transport != nullptr) {
      std::lock_guard<std::mutex> lock(impl_->transport_mu);
      transfer = impl_->EnsureEndpointLocked(lease.instance_id());
      if (transfer.ok()) transfer = impl_->transport->Get(ops, landed, impl_->TransferDeadline());
    } else {
      for (size_t j = 0; j < present.size() && transfer.ok(); ++j) {
        pb::ReadRequest rr;
        rr.set_lease_id(lease.lease_id());
        rr.set_index(static_cast<uint32_t>(present[j]));
        pb::ReadResponse data;
        transfer = FromGrpcStatus(impl_->stub->Read(impl_->Ctx().get(), rr, &data));
        if (transfer.code() == absl::StatusCode::kNotFound) {  // dropped as corrupt
          status[present[j]] = transfer;
          transfer = absl::OkStatus();
          report_until(present[j] + 1);
          continue;
        }
        if (transfer.ok()) {
          if (data.data().size() != ops[j].size) {
            transfer = absl::InternalError("read: wrong size");
            break;
          }
          std::memcpy(dst[present[j]], data.data().data(), ops[j].size);
          landed(j);
        }
      }
    }
  }
  absl::Status released;
  if (lease.lease_id() != 0) {
    pb::ReleaseLeaseRequest rel;
    rel.set_lease_id(lease.lease_id());
    pb::ReleaseLeaseResponse rr;
    released = FromGrpcStatus(impl_->stub->ReleaseLease(impl_->Ctx().get(), rel, &rr));
  }
  if (!transfer.ok()) {
    // A failed or incomplete transfer is a transport error, never evidence against the
    // stored blocks: nothing is reported, and the endpoint is exchanged before the next one.
    if (impl_->transport != nullptr) impl_->stale.store(true);
    return transfer;
  }
  if (!released.ok() && !impl_->opt.verify) {
    // Without verification an expired lease means the bytes may have been overwritten.
    return released;
  }
  report_until(keys.size());
  if (!mismatched.empty()) {
    if (released.ok()) {
      // The lease held for the whole transfer, so the server's bytes could not change under
      // us: report the blocks. A hint only: the server re-verifies its copy and drops it only
      // when its own checksum fails (the damage may have been on the way).
      pb::EvictRequest ev;
      for (size_t i : mismatched) KeyToProto(keys[i], ev.add_keys());
      ev.set_corrupt(true);
      pb::EvictResponse er;
      (void)impl_->stub->Evict(impl_->Ctx().get(), ev, &er);
    } else {
      // The lease was lost (expired, or the server restarted and no longer knows it): what
      // was read may not be what the lease described. A transport failure, not corruption.
      if (impl_->transport != nullptr) impl_->stale.store(true);
      for (size_t i : mismatched) {
        status[i] = absl::UnavailableError(absl::StrCat(
            "transfer_unverified: ", keys[i].ToString(),
            " did not verify and the lease was lost: ", released.message()));
      }
    }
  }
  return status;
}

absl::StatusOr<std::vector<absl::StatusOr<std::string>>> CacheClient::Fetch(
    std::span<const BlockKey> keys) {
  std::vector<std::string> bufs(keys.size());
  ASSIGN_OR_RETURN(auto st, FetchInto(keys, [&](size_t i, uint64_t size) {
    bufs[i].resize(size);
    return reinterpret_cast<uint8_t*>(bufs[i].data());
  }));
  std::vector<absl::StatusOr<std::string>> out;
  out.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (st[i].ok()) out.emplace_back(std::move(bufs[i]));
    else out.emplace_back(st[i]);
  }
  return out;
}

absl::StatusOr<uint32_t> CacheClient::Evict(std::span<const BlockKey> keys, bool all) {
  pb::EvictRequest req;
  for (const auto& k : keys) KeyToProto(k, req.add_keys());
  req.set_all(all);
  pb::EvictResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->Evict(impl_->Ctx().get(), req, &resp)));
  return resp.evicted();
}

absl::StatusOr<CacheStats> CacheClient::Stats() {
  pb::StatsRequest req;
  pb::StatsResponse r;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->Stats(impl_->Ctx().get(), req, &r)));
  CacheStats s;
  s.memory_capacity_bytes = r.memory_capacity_bytes();
  s.memory_used_bytes = r.memory_used_bytes();
  s.memory_blocks = r.memory_blocks();
  s.disk_used_bytes = r.disk_used_bytes();
  s.disk_blocks = r.disk_blocks();
  s.hits_memory = r.hits_memory();
  s.hits_disk = r.hits_disk();
  s.misses = r.misses();
  s.evictions = r.evictions();
  s.corrupt_blocks = r.corrupt_blocks();
  s.active_leases = r.active_leases();
  s.active_reservations = r.active_reservations();
  s.reclaimed_reservations = r.reclaimed_reservations();
  s.bytes_in = r.bytes_in();
  s.bytes_out = r.bytes_out();
  s.disk_degraded = r.disk_degraded();
  s.memory_only_commits = r.memory_only_commits();
  s.corrupt_reports_refuted = r.corrupt_reports_refuted();
  return s;
}

absl::StatusOr<ServerHealth> CacheClient::GetHealth() {
  pb::HealthRequest req;
  pb::HealthResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->stub->Health(impl_->Ctx().get(), req, &resp)));
  impl_->NoteInstance(resp.instance_id());
  ServerHealth h;
  h.serving = resp.serving();
  h.server_id = resp.server_id();
  h.uptime_ms = resp.uptime_ms();
  h.instance_id = resp.instance_id();
  h.disk_degraded = resp.disk_degraded();
  h.disk_status = resp.disk_status();
  return h;
}

absl::Status CacheClient::Health() {
  ASSIGN_OR_RETURN(ServerHealth h, GetHealth());
  if (!h.serving) return absl::UnavailableError("cache server not serving");
  return absl::OkStatus();
}

absl::Status CacheClient::RegisterMemory(void* p, size_t n) {
  if (impl_->transport == nullptr) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(impl_->transport_mu);
  return impl_->transport->RegisterMemory(p, n);
}

void CacheClient::UnregisterMemory(void* p) {
  if (impl_->transport == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->transport_mu);
  impl_->transport->UnregisterMemory(p);
}

uint8_t* CacheClient::AllocateBuffer(size_t n) {
  if (impl_->transport != nullptr) {
    std::lock_guard<std::mutex> lock(impl_->transport_mu);
    if (void* p = impl_->transport->AllocateMemory(n)) {
      std::lock_guard<std::mutex> l(impl_->buffers_mu);
      impl_->transport_buffers.insert(p);
      return static_cast<uint8_t*>(p);
    }
  }
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

void CacheClient::FreeBuffer(uint8_t* p, size_t n) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> l(impl_->buffers_mu);
    if (impl_->transport_buffers.erase(p) > 0) {
      std::lock_guard<std::mutex> lock(impl_->transport_mu);
      impl_->transport->FreeMemory(p);
      return;
    }
  }
  munmap(p, n);
}

const std::string& CacheClient::server_id() const { return impl_->server_id; }
uint64_t CacheClient::instance_id() const { return impl_->instance_id.load(); }
uint64_t CacheClient::reconnects() const { return impl_->reconnects.load(); }
const std::string& CacheClient::address() const { return impl_->opt.address; }
const std::string& CacheClient::data_plane() const { return impl_->data_plane; }

bool CacheClient::mapped_copies() const {
  std::lock_guard<std::mutex> lock(impl_->transport_mu);
  return impl_->transport != nullptr && impl_->transport->mapped();
}

}  // namespace sparsex::cache
