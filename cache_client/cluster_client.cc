#include "cache_client/cluster_client.h"

#include <algorithm>
#include <map>

namespace sparsex::cache {

uint64_t RendezvousWeight(const Hash128& segment, std::string_view member) {
  Hasher h;
  h.Str("sparsex.rendezvous").Str(member).U64(segment.hi).U64(segment.lo);
  return h.Finish().lo;
}

std::vector<size_t> RendezvousOrder(const Hash128& segment,
                                    std::span<const std::string> members) {
  std::vector<std::pair<uint64_t, size_t>> w;
  w.reserve(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    w.emplace_back(RendezvousWeight(segment, members[i]), i);
  }
  // Ties (practically impossible) break by member name for determinism.
  std::sort(w.begin(), w.end(), [&](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    return members[a.second] < members[b.second];
  });
  std::vector<size_t> out;
  out.reserve(w.size());
  for (const auto& [weight, i] : w) out.push_back(i);
  return out;
}

ClusterClient::~ClusterClient() = default;

absl::StatusOr<std::unique_ptr<ClusterClient>> ClusterClient::Connect(
    const ClusterClientOptions& options) {
  if (options.members.empty()) return absl::InvalidArgumentError("cluster: no members");
  if (options.replication == 0) return absl::InvalidArgumentError("cluster: replication 0");
  std::unique_ptr<ClusterClient> c(new ClusterClient());
  c->opt_ = options;
  c->opt_.replication =
      std::min<uint32_t>(options.replication, static_cast<uint32_t>(options.members.size()));
  c->clients_.resize(options.members.size());
  bool any = false;
  absl::Status last;
  for (size_t i = 0; i < options.members.size(); ++i) {
    auto m = c->Member(i);
    if (m.ok()) any = true;
    else last = m.status();
  }
  if (!any) return absl::UnavailableError(absl::StrCat("cluster: no member answers: ",
                                                       last.message()));
  return c;
}

absl::StatusOr<CacheClient*> ClusterClient::Member(size_t i) {
  if (i >= clients_.size()) return absl::InvalidArgumentError("cluster: bad member index");
  std::lock_guard<std::mutex> l(members_mu_);
  if (clients_[i] == nullptr) {
    CacheClientOptions o = opt_.client;
    o.address = opt_.members[i];
    ASSIGN_OR_RETURN(clients_[i], CacheClient::Connect(o));
  }
  return clients_[i].get();
}

std::vector<size_t> ClusterClient::Owners(const Hash128& segment) const {
  auto order = RendezvousOrder(segment, opt_.members);
  order.resize(opt_.replication);
  return order;
}

const std::vector<std::string>& ClusterClient::members() const { return opt_.members; }

absl::StatusOr<std::vector<LookupInfo>> ClusterClient::Lookup(std::span<const BlockKey> keys) {
  std::vector<LookupInfo> out(keys.size());
  // Round r asks the r-th owner about every key still absent.
  std::vector<size_t> todo(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) todo[i] = i;
  for (uint32_t r = 0; r < opt_.replication && !todo.empty(); ++r) {
    std::map<size_t, std::vector<size_t>> by_member;
    for (size_t i : todo) by_member[Owners(keys[i].segment)[r]].push_back(i);
    std::vector<size_t> still;
    for (auto& [m, idx] : by_member) {
      auto client = Member(m);
      if (!client.ok()) {
        still.insert(still.end(), idx.begin(), idx.end());
        continue;
      }
      std::vector<BlockKey> ks;
      for (size_t i : idx) ks.push_back(keys[i]);
      auto res = (*client)->Lookup(ks);
      if (!res.ok()) {
        if (res.status().code() == absl::StatusCode::kUnavailable ||
            res.status().code() == absl::StatusCode::kDeadlineExceeded) {
          still.insert(still.end(), idx.begin(), idx.end());
          continue;
        }
        return res.status();
      }
      for (size_t j = 0; j < idx.size(); ++j) {
        if ((*res)[j].present) out[idx[j]] = (*res)[j];
        else still.push_back(idx[j]);
      }
    }
    todo = std::move(still);
  }
  return out;
}

absl::Status ClusterClient::Put(const BlockKey& key, std::span<const uint8_t> block,
                                double cost) {
  absl::Status first_error;
  bool stored = false;
  for (size_t m : Owners(key.segment)) {
    auto client = Member(m);
    absl::Status s = client.ok() ? (*client)->Put(key, block, cost) : client.status();
    if (s.ok() || s.code() == absl::StatusCode::kAlreadyExists) stored = true;
    else if (first_error.ok()) first_error = s;
  }
  return stored ? absl::OkStatus() : first_error;
}

absl::StatusOr<std::vector<absl::Status>> ClusterClient::FetchInto(
    std::span<const BlockKey> keys, const CacheClient::Allocator& alloc,
    const CacheClient::OnBlock& on_block) {
  std::vector<absl::Status> status(keys.size(),
                                   absl::NotFoundError("miss: no owner holds the block"));
  std::vector<size_t> todo(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) todo[i] = i;
  const uint32_t rounds = opt_.replication;
  for (uint32_t r = 0; r < rounds && !todo.empty(); ++r) {
    const bool last_round = r + 1 == rounds;
    std::map<size_t, std::vector<size_t>> by_member;
    for (size_t i : todo) by_member[Owners(keys[i].segment)[r]].push_back(i);
    std::vector<size_t> still;
    for (auto& [m, idx] : by_member) {
      auto client = Member(m);
      std::vector<BlockKey> ks;
      for (size_t i : idx) ks.push_back(keys[i]);
      absl::StatusOr<std::vector<absl::Status>> res =
          client.ok() ? (*client)->FetchInto(
                            ks, [&](size_t j, uint64_t size) { return alloc(idx[j], size); },
                            [&](size_t j, const absl::Status& s, std::span<const uint8_t> b) {
                              // Misses are reported only once no owner is left to ask.
                              if (on_block && (s.ok() || last_round)) on_block(idx[j], s, b);
                            })
                      : absl::StatusOr<std::vector<absl::Status>>(client.status());
      if (!res.ok()) {
        for (size_t i : idx) {
          status[i] = res.status();
          if (last_round && on_block) on_block(i, res.status(), {});
        }
        still.insert(still.end(), idx.begin(), idx.end());
        continue;
      }
      for (size_t j = 0; j < idx.size(); ++j) {
        status[idx[j]] = (*res)[j];
        if (!(*res)[j].ok()) still.push_back(idx[j]);
      }
    }
    todo = std::move(still);
  }
  return status;
}

absl::StatusOr<uint32_t> ClusterClient::Evict(std::span<const BlockKey> keys) {
  uint32_t n = 0;
  std::map<size_t, std::vector<BlockKey>> by_member;
  for (const auto& k : keys) {
    for (size_t m : Owners(k.segment)) by_member[m].push_back(k);
  }
  for (auto& [m, ks] : by_member) {
    auto client = Member(m);
    if (!client.ok()) continue;
    auto r = (*client)->Evict(ks);
    if (r.ok()) n += *r;
  }
  return n;
}

}  // namespace sparsex::cache
