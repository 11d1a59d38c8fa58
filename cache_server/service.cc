#include "cache_server/service.h"

#include "cache_client/key_codec.h"

#include <array>

#include "common/metrics/metrics.h"
#include "proto/grpc_status.h"

namespace sparsex::cache {

namespace pb = sparsex::cache::v1;

namespace {

enum Method { kLookup, kReserve, kCommit, kAbort, kLease, kRenew, kRelease, kRead, kEvict,
              kStats, kHealth, kEndpoint, kNumMethods };
constexpr std::array<const char*, kNumMethods> kMethodNames = {
    "lookup", "reserve", "commit", "abort", "lease", "renew_lease", "release_lease",
    "read", "evict", "stats", "health", "get_endpoint"};

const char* CodeName(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kOk: return "OK";
    case absl::StatusCode::kCancelled: return "CANCELLED";
    case absl::StatusCode::kUnknown: return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound: return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted: return "ABORTED";
    case absl::StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal: return "INTERNAL";
    case absl::StatusCode::kUnavailable: return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss: return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

pb::Tier TierToProto(Tier t) {
  switch (t) {
    case Tier::kMemory: return pb::TIER_MEMORY;
    case Tier::kDisk: return pb::TIER_DISK;
    case Tier::kNone: break;
  }
  return pb::TIER_NONE;
}

absl::StatusOr<std::vector<BlockKey>> KeysFromProto(
    const google::protobuf::RepeatedPtrField<pb::BlockKey>& in) {
  std::vector<BlockKey> keys;
  keys.reserve(in.size());
  for (const auto& k : in) {
    ASSIGN_OR_RETURN(BlockKey key, KeyFromProto(k));
    keys.push_back(key);
  }
  return keys;
}

}  // namespace

struct CacheServiceImpl::Metrics {
  std::array<metrics::Histogram*, kNumMethods> latency{};
  metrics::Family<metrics::Counter>* requests = nullptr;
};

CacheServiceImpl::CacheServiceImpl(BlockCache* cache, EndpointInfo endpoint,
                                   std::string server_id, uint32_t layout_version,
                                   uint64_t max_block_bytes, uint64_t instance_id,
                                   metrics::Registry* registry)
    : cache_(cache),
      endpoint_(std::move(endpoint)),
      server_id_(std::move(server_id)),
      layout_version_(layout_version),
      max_block_bytes_(max_block_bytes),
      instance_id_(instance_id),
      start_(std::chrono::steady_clock::now()),
      m_(std::make_unique<Metrics>()) {
  if (registry != nullptr) {
    auto& lat = registry->AddHistogram("sparsex_cache_request_duration_seconds",
                                       "Latency of control-plane RPCs, by method.", {"method"},
                                       metrics::ExponentialBuckets(2.5e-5, 2, 16));
    for (int i = 0; i < kNumMethods; ++i) m_->latency[i] = &lat.Get({kMethodNames[i]});
    m_->requests = &registry->AddCounter("sparsex_cache_requests_total",
                                         "Control-plane RPCs, by method and status code.",
                                         {"method", "code"});
  }
}

CacheServiceImpl::~CacheServiceImpl() = default;

void CacheServiceImpl::SetServing(bool serving) { serving_.store(serving); }
void CacheServiceImpl::SetServerId(std::string id) {
  std::lock_guard<std::mutex> lock(id_mu_);
  server_id_ = std::move(id);
}
bool CacheServiceImpl::serving() const { return serving_.load(); }

template <typename Fn>
grpc::Status CacheServiceImpl::Run(int method, Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s;
  if (!serving_.load() && method != kHealth) {
    s = absl::UnavailableError("shutting_down: cache server is shutting down");
  } else {
    s = fn();
  }
  if (m_->requests != nullptr) {
    m_->latency[method]->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    m_->requests->Get({kMethodNames[method], CodeName(s.code())}).Inc();
  }
  return ToGrpcStatus(s);
}

grpc::Status CacheServiceImpl::Lookup(Ctx*, const pb::LookupRequest* req,
                                      pb::LookupResponse* resp) {
  return Run(kLookup, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(Hash128 model, DecodeFingerprint(req->model_fp()));
    ASSIGN_OR_RETURN(std::vector<BlockKey> keys, KeysFromProto(req->keys()));
    ASSIGN_OR_RETURN(auto results, cache_->Lookup(model, req->layout_version(), keys));
    resp->set_instance_id(instance_id_);
    for (const auto& r : results) {
      auto* out = resp->add_results();
      out->set_present(r.code == absl::StatusCode::kOk);
      out->set_tier(r.code == absl::StatusCode::kOk ? TierToProto(r.tier) : pb::TIER_NONE);
      out->set_size(r.size);
      out->set_layout_version(r.layout_version);
      out->set_code(static_cast<int32_t>(r.code));
    }
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::Reserve(Ctx* ctx, const pb::ReserveRequest* req,
                                       pb::ReserveResponse* resp) {
  return Run(kReserve, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(Hash128 model, DecodeFingerprint(req->model_fp()));
    if (!req->has_key()) return absl::InvalidArgumentError("no_keys: reserve without a key");
    ASSIGN_OR_RETURN(BlockKey key, KeyFromProto(req->key()));
    // The client is the peer connection (address and port): its reserved bytes are bounded.
    ASSIGN_OR_RETURN(Reservation r, cache_->Reserve(model, req->layout_version(), key,
                                                    req->size(), req->cost(), ctx->peer()));
    resp->set_reservation_id(r.id);
    resp->set_offset(r.offset);
    resp->set_deadline_unix_ms(r.deadline_unix_ms);
    resp->set_instance_id(instance_id_);
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::Commit(Ctx*, const pb::CommitRequest* req, pb::CommitResponse*) {
  return Run(kCommit, [&]() -> absl::Status {
    const std::string& d = req->inline_data();
    return cache_->Commit(req->reservation_id(), req->checksum(),
                          {reinterpret_cast<const uint8_t*>(d.data()), d.size()}, !d.empty());
  });
}

grpc::Status CacheServiceImpl::Abort(Ctx*, const pb::AbortRequest* req, pb::AbortResponse*) {
  return Run(kAbort, [&] { return cache_->Abort(req->reservation_id()); });
}

grpc::Status CacheServiceImpl::Lease(Ctx*, const pb::LeaseRequest* req,
                                     pb::LeaseResponse* resp) {
  return Run(kLease, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(Hash128 model, DecodeFingerprint(req->model_fp()));
    ASSIGN_OR_RETURN(std::vector<BlockKey> keys, KeysFromProto(req->keys()));
    ASSIGN_OR_RETURN(LeaseGrant g, cache_->Lease(model, req->layout_version(), keys,
                                                 req->ttl_ms(), req->partial()));
    resp->set_lease_id(g.id);
    resp->set_expires_unix_ms(g.expires_unix_ms);
    resp->set_instance_id(instance_id_);
    for (const auto& b : g.blocks) {
      auto* out = resp->add_blocks();
      out->set_code(static_cast<int32_t>(b.code));
      out->set_offset(b.offset);
      out->set_size(b.size);
      out->set_checksum(b.checksum);
      out->set_tier(TierToProto(b.tier));
    }
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::RenewLease(Ctx*, const pb::RenewLeaseRequest* req,
                                          pb::RenewLeaseResponse* resp) {
  return Run(kRenew, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(uint64_t t, cache_->RenewLease(req->lease_id(), req->ttl_ms()));
    resp->set_expires_unix_ms(t);
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::ReleaseLease(Ctx*, const pb::ReleaseLeaseRequest* req,
                                            pb::ReleaseLeaseResponse*) {
  return Run(kRelease, [&] { return cache_->ReleaseLease(req->lease_id()); });
}

grpc::Status CacheServiceImpl::Read(Ctx*, const pb::ReadRequest* req, pb::ReadResponse* resp) {
  return Run(kRead, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string data, cache_->Read(req->lease_id(), req->index()));
    *resp->mutable_data() = std::move(data);
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::Evict(Ctx*, const pb::EvictRequest* req, pb::EvictResponse* resp) {
  return Run(kEvict, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::vector<BlockKey> keys, KeysFromProto(req->keys()));
    if (keys.empty() && !req->all()) {
      return absl::InvalidArgumentError("no_keys: evict needs keys or all=true");
    }
    ASSIGN_OR_RETURN(uint32_t n, cache_->Evict(keys, req->all(), req->corrupt()));
    resp->set_evicted(n);
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::Stats(Ctx*, const pb::StatsRequest*, pb::StatsResponse* resp) {
  return Run(kStats, [&]() -> absl::Status {
    CacheStats s = cache_->Stats();
    resp->set_memory_capacity_bytes(s.memory_capacity_bytes);
    resp->set_memory_used_bytes(s.memory_used_bytes);
    resp->set_memory_blocks(s.memory_blocks);
    resp->set_disk_used_bytes(s.disk_used_bytes);
    resp->set_disk_blocks(s.disk_blocks);
    resp->set_hits_memory(s.hits_memory);
    resp->set_hits_disk(s.hits_disk);
    resp->set_misses(s.misses);
    resp->set_evictions(s.evictions);
    resp->set_corrupt_blocks(s.corrupt_blocks);
    resp->set_active_leases(s.active_leases);
    resp->set_active_reservations(s.active_reservations);
    resp->set_reclaimed_reservations(s.reclaimed_reservations);
    resp->set_bytes_in(s.bytes_in);
    resp->set_bytes_out(s.bytes_out);
    resp->set_disk_degraded(s.disk_degraded);
    resp->set_memory_only_commits(s.memory_only_commits);
    resp->set_corrupt_reports_refuted(s.corrupt_reports_refuted);
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::Health(Ctx*, const pb::HealthRequest*, pb::HealthResponse* resp) {
  return Run(kHealth, [&]() -> absl::Status {
    resp->set_serving(serving_.load());
    {
      std::lock_guard<std::mutex> lock(id_mu_);
      resp->set_server_id(server_id_);
    }
    resp->set_uptime_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - start_)
                            .count());
    resp->set_instance_id(instance_id_);
    DiskHealth d = cache_->disk_health();
    resp->set_disk_degraded(d.degraded);
    resp->set_disk_status(d.status);
    return absl::OkStatus();
  });
}

grpc::Status CacheServiceImpl::GetEndpoint(Ctx*, const pb::EndpointRequest*,
                                           pb::EndpointResponse* resp) {
  return Run(kEndpoint, [&]() -> absl::Status {
    resp->set_transport(endpoint_.transport);
    resp->set_worker_address(endpoint_.worker_address);
    resp->set_rkey(endpoint_.rkey);
    resp->set_base_address(endpoint_.base_address);
    resp->set_arena_bytes(endpoint_.arena_bytes);
    {
      std::lock_guard<std::mutex> lock(id_mu_);
      resp->set_server_id(server_id_);
    }
    resp->set_layout_version(layout_version_);
    resp->set_max_block_bytes(max_block_bytes_);
    resp->set_instance_id(instance_id_);
    return absl::OkStatus();
  });
}

}  // namespace sparsex::cache
