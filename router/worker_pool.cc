#include "router/worker_pool.h"

#include <algorithm>
#include <iostream>

#include <nlohmann/json.hpp>

#include "common/etcd/etcd_client.h"
#include "common/fingerprint.h"

namespace sparsex::router {
namespace {

namespace wpb = sparsex::worker::v1;

void Log(const std::string& msg) { std::cerr << "[router] " << msg << std::endl; }

}  // namespace

WorkerPool::WorkerPool(const RouterOptions& opts, const ModelConfig& model,
                       std::string model_name, ClusterIndex* index)
    : opts_(opts), model_(model), model_name_(std::move(model_name)), index_(*index) {
  if (!opts_.etcd_endpoints.empty()) {
    etcd_ = std::make_unique<etcd::EtcdClient>(etcd::EtcdOptions{opts_.etcd_endpoints, 2000});
  }
}

WorkerPool::~WorkerPool() { Stop(); }

void WorkerPool::Start() {
  PollMembers();  // once synchronously, then polled
  if (etcd_) membership_ = std::thread([this] { MembershipLoop(); });
}

ServedIdentity WorkerPool::Identity() const {
  std::lock_guard<std::mutex> l(id_mu_);
  return id_;
}

std::string WorkerPool::Accept(const wpb::WorkerInfo& info) {
  const ModelConfig& c = model_;
  if (info.vocab_size() != c.vocab_size || info.context_length() != c.max_seq_len) {
    return absl::StrCat("its model has vocabulary ", info.vocab_size(), " and context ",
                        info.context_length(), ", this router's ", c.vocab_size, " and ",
                        c.max_seq_len);
  }
  const int bs = info.kv_block_size() > 0 ? info.kv_block_size() : 16;  // older workers: 16
  if (!opts_.segment_encoding.empty() && info.segment_encoding() != opts_.segment_encoding) {
    return absl::StrCat("its segment encoding is ", info.segment_encoding(),
                        ", --segment_encoding ", opts_.segment_encoding);
  }
  if (opts_.kv_block_size > 0 && bs != opts_.kv_block_size) {
    return absl::StrCat("its KV block size is ", bs, ", --kv_block_size ", opts_.kv_block_size);
  }
  std::lock_guard<std::mutex> l(id_mu_);
  // The KV identity (model, tokenizer, chat template, KV dtype) when the worker reports one.
  const std::string& kv_hex =
      info.kv_fingerprint().empty() ? info.model_fingerprint() : info.kv_fingerprint();
  if (!id_.known) {
    auto fp = Hash128::FromHex(kv_hex);
    if (!fp.has_value()) return "its model fingerprint is malformed";
    id_.known = true;
    id_.fingerprint = *fp;
    id_.kv_hex = kv_hex;
    id_.fingerprint_hex = info.model_fingerprint();
    id_.encoding = info.segment_encoding();
    id_.block_size = bs;
    Log(absl::StrCat("serving model ", model_name_, " fingerprint ", id_.fingerprint_hex,
                     ", segment encoding ", id_.encoding, ", KV block size ", bs, " (from worker ",
                     info.worker_id(), ")"));
    return "";
  }
  if (info.model_fingerprint() != id_.fingerprint_hex) {
    return absl::StrCat("it serves model fingerprint ", info.model_fingerprint(), ", the cluster ",
                        id_.fingerprint_hex);
  }
  if (kv_hex != id_.kv_hex) {
    return absl::StrCat("its KV identity (tokenizer, chat template or KV dtype) is ", kv_hex,
                        ", the cluster's ", id_.kv_hex);
  }
  if (info.segment_encoding() != id_.encoding || bs != id_.block_size) {
    return absl::StrCat("its segment encoding / block size are ", info.segment_encoding(), " / ",
                        bs, ", the cluster's ", id_.encoding, " / ", id_.block_size);
  }
  return "";
}

void WorkerPool::Stop() {
  {
    std::lock_guard<std::mutex> l(stop_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (membership_.joinable()) membership_.join();
  std::map<std::string, std::shared_ptr<WorkerConn>> all;
  {
    std::lock_guard<std::mutex> l(mu_);
    all.swap(conns_);
  }
  for (auto& [a, c] : all) StopConn(*c);
}

void WorkerPool::SetMembers(
    const std::map<std::string, std::string>& members /* address -> name */) {
  std::vector<std::shared_ptr<WorkerConn>> removed;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (!members.contains(it->first)) {
        removed.push_back(it->second);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
    for (const auto& [addr, name] : members) {
      if (conns_.contains(addr)) continue;
      auto c = std::make_shared<WorkerConn>();
      c->address = addr;
      c->name = name.empty() ? addr : name;
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      // Keepalive is how a frozen worker (SIGSTOP, a hung host: the kernel still ACKs, so
      // TCP sees nothing) is found: an unanswered ping closes the connection, which fails the
      // Subscribe stream (the worker is marked unhealthy) and every call in flight with
      // UNAVAILABLE (retried elsewhere before the first token). Pings go out whether or not
      // the router sends data (the event stream only receives). Workers accept them
      // (worker_server.cc).
      args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, std::max(100, opts_.worker_keepalive_ms));
      args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, std::max(100, opts_.worker_keepalive_timeout_ms));
      args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
      args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
      args.SetMaxReceiveMessageSize(64 << 20);
      // Mutual TLS: a worker is reachable only with a certificate of the cluster CA; an address
      // in etcd without one fails the handshake and is never healthy (never routed to).
      auto sec = ClientCredentials(opts_.cluster_tls);
      if (!sec.ok()) {
        Log(absl::StrCat("worker ", addr, " skipped: ", sec.status().message()));
        continue;
      }
      sec->Apply(&args);
      c->channel = grpc::CreateCustomChannel(addr, sec->creds, args);
      c->stub = wpb::Worker::NewStub(c->channel);
      WorkerConn* raw = c.get();
      c->thread = std::thread([this, raw] { Subscribe(*raw); });
      conns_[addr] = c;
      Log(absl::StrCat("worker added: ", c->name, " at ", addr));
    }
  }
  for (auto& c : removed) {
    Log(absl::StrCat("worker removed: ", c->Name(), " at ", c->address));
    StopConn(*c);
    index_.RemoveWorker(c->address);
  }
}

void WorkerPool::StopConn(WorkerConn& c) {
  c.stop = true;
  {
    std::lock_guard<std::mutex> l(c.mu);
    if (c.sub_ctx) c.sub_ctx->TryCancel();
  }
  if (c.thread.joinable()) c.thread.join();
  c.healthy = false;
}

bool WorkerPool::WaitStop(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> l(stop_mu_);
  return stop_cv_.wait_for(l, d, [this] { return stopping_; });
}

void WorkerPool::PollMembers() {
  std::map<std::string, std::string> members;
  for (const std::string& a : opts_.workers) members[a] = "";
  if (etcd_) {
    auto kvs = etcd_->RangePrefix(opts_.etcd_prefix + "/workers/");
    if (!kvs.ok()) return;  // etcd unreachable: keep what we had
    for (const auto& kv : *kvs) {
      nlohmann::json j = nlohmann::json::parse(kv.value, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("address")) continue;
      members[j.value("address", "")] = j.value("id", "");
    }
  }
  SetMembers(members);
}

void WorkerPool::MembershipLoop() {
  while (!WaitStop(std::chrono::milliseconds(opts_.membership_poll_ms))) PollMembers();
}

// The subscription: the worker's events feed the index.
void WorkerPool::Subscribe(WorkerConn& c) {
  int backoff_ms = 100;
  bool force_snapshot = true;
  bool warned_model = false;
  while (!c.stop) {
    wpb::WorkerInfo info;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      grpc::Status s = c.stub->Info(&ctx, wpb::InfoRequest(), &info);
      if (!s.ok()) {
        c.healthy = false;
        std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
        backoff_ms = std::min(1000, backoff_ms * 2);
        continue;
      }
    }
    {
      std::lock_guard<std::mutex> l(c.mu);
      c.name = info.worker_id();
    }
    if (const std::string why = Accept(info); !why.empty()) {
      c.model_ok = false;
      if (!warned_model) {
        Log(absl::StrCat("worker ", info.worker_id(), " (model ", info.model(), "): ", why,
                         ": not routing to it"));
        warned_model = true;
      }
      for (int i = 0; i < 20 && !c.stop; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      continue;
    }
    c.model_ok = true;
    backoff_ms = 100;

    grpc::ClientContext ctx;
    {
      std::lock_guard<std::mutex> l(c.mu);
      if (c.stop) break;
      c.sub_ctx = &ctx;
    }
    wpb::SubscribeRequest req;
    if (!force_snapshot) {
      req.set_instance_id(index_.Instance(c.address));
      req.set_after_seq(index_.LastSeq(c.address));
    }
    force_snapshot = false;
    auto reader = c.stub->Subscribe(&ctx, req);
    wpb::WorkerEvent ev;
    while (reader->Read(&ev)) {
      if (ev.has_snapshot()) {
        std::vector<IndexEntry> entries;
        for (const auto& e : ev.snapshot().entries()) {
          auto fp = FingerprintFromBytes(e.fingerprint());
          if (fp.ok()) entries.push_back({*fp, e.num_tokens(), e.tier() == wpb::TIER_GPU});
        }
        index_.ApplySnapshot(c.address, ev.instance_id(), ev.snapshot().seq(), entries);
        c.healthy = true;
      } else if (ev.has_cache()) {
        const wpb::CacheEvent& ce = ev.cache();
        ClusterIndex::EventKind k = ce.kind() == wpb::CacheEvent::SEGMENT_REMOVED ||
                                            ce.kind() == wpb::CacheEvent::BLOCK_REMOVED
                                        ? ClusterIndex::EventKind::kRemoved
                                    : ce.kind() == wpb::CacheEvent::ALL_CLEARED
                                        ? ClusterIndex::EventKind::kCleared
                                        : ClusterIndex::EventKind::kStored;
        Hash128 fp;
        if (k != ClusterIndex::EventKind::kCleared) {
          auto d = FingerprintFromBytes(ce.fingerprint());
          if (!d.ok()) continue;
          fp = *d;
        }
        const bool block = ce.kind() == wpb::CacheEvent::BLOCK_STORED ||
                           ce.kind() == wpb::CacheEvent::BLOCK_REMOVED;
        if (!index_.ApplyEvent(c.address, ev.instance_id(), ce.seq(), k, fp, ce.num_tokens(),
                              block)) {
          force_snapshot = true;  // gap or restart: start over from a snapshot
          ctx.TryCancel();
          break;
        }
      } else if (ev.has_load()) {
        const wpb::LoadReport& lr = ev.load();
        WorkerLoadInfo li;
        li.queue_depth = lr.queue_depth();
        li.running = lr.running();
        li.running_tokens = lr.running_tokens();
        li.kv_blocks_total = lr.kv_blocks_total();
        li.kv_blocks_free = lr.kv_blocks_free();
        li.draining = lr.draining();
        li.max_queue = lr.max_queue();
        li.reuse_disabled = lr.reuse_disabled();
        index_.UpdateLoad(c.address, li);
        c.healthy = !lr.draining();
      }
    }
    reader->Finish();
    {
      std::lock_guard<std::mutex> l(c.mu);
      c.sub_ctx = nullptr;
    }
    c.healthy = false;
    if (!c.stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::vector<std::shared_ptr<WorkerConn>> WorkerPool::Conns() {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::shared_ptr<WorkerConn>> out;
  for (auto& [a, c] : conns_) out.push_back(c);
  return out;
}

}  // namespace sparsex::router
