#include "common/etcd/etcd_client.h"

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "common/etcd/http_client.h"

namespace sparsex::etcd {
namespace {

using json = nlohmann::json;

std::string B64(const std::string& s) { return absl::Base64Escape(s); }

std::string UnB64(const std::string& s) {
  std::string out;
  absl::Base64Unescape(s, &out);
  return out;
}

// etcd's gateway renders 64-bit integers as strings; zero values are omitted.
int64_t Int(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    int64_t v = 0;
    if (absl::SimpleAtoi(it->get<std::string>(), &v)) return v;
  }
  return 0;
}

// The key just after every key with this prefix (etcd's range_end for a prefix scan).
std::string PrefixEnd(std::string p) {
  while (!p.empty()) {
    unsigned char c = static_cast<unsigned char>(p.back());
    if (c < 0xff) {
      p.back() = static_cast<char>(c + 1);
      return p;
    }
    p.pop_back();
  }
  return std::string(1, '\0');
}

absl::StatusOr<std::vector<KeyValue>> ParseKvs(const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return absl::DataLossError("etcd: malformed range reply");
  std::vector<KeyValue> out;
  if (auto it = j.find("kvs"); it != j.end() && it->is_array()) {
    for (const json& kv : *it) {
      KeyValue k;
      k.key = UnB64(kv.value("key", ""));
      k.value = UnB64(kv.value("value", ""));
      k.lease = Int(kv, "lease");
      k.mod_revision = Int(kv, "mod_revision");
      out.push_back(std::move(k));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> EtcdClient::Call(const std::string& path, const std::string& body) {
  if (opts_.endpoints.empty()) return absl::FailedPreconditionError("etcd: no endpoints");
  absl::Status last;
  for (const std::string& ep : opts_.endpoints) {
    http::HttpRequestOptions ho;
    ho.timeout_ms = opts_.timeout_ms;
    auto r = http::HttpRequest(ep, "POST", path, body, ho);
    if (!r.ok()) {
      last = r.status();
      continue;
    }
    if (r->status != 200) {
      json j = json::parse(r->body, nullptr, false);
      std::string msg = (!j.is_discarded() && j.is_object()) ? j.value("error", r->body) : r->body;
      const int code = (!j.is_discarded() && j.is_object()) ? j.value("code", 2) : 2;
      return absl::Status(static_cast<absl::StatusCode>(code),
                          absl::StrCat("etcd ", path, ": HTTP ", r->status, ": ", msg));
    }
    return std::move(r->body);
  }
  return absl::UnavailableError(absl::StrCat("etcd unreachable: ", last.message()));
}

absl::StatusOr<int64_t> EtcdClient::LeaseGrant(int ttl_s) {
  ASSIGN_OR_RETURN(std::string body, Call("/v3/lease/grant", json{{"TTL", ttl_s}}.dump()));
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return absl::DataLossError("etcd: malformed lease grant reply");
  const int64_t id = Int(j, "ID");
  if (id == 0) return absl::InternalError(absl::StrCat("etcd: lease grant failed: ", body));
  return id;
}

absl::StatusOr<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump()));
  // The gateway streams: the body is one or more newline-separated {"result": {...}} objects.
  size_t nl = body.find('\n');
  json j = json::parse(nl == std::string::npos ? body : body.substr(0, nl), nullptr, false);
  if (j.is_discarded()) return absl::DataLossError("etcd: malformed keepalive reply");
  const json& r = j.contains("result") ? j["result"] : j;
  const int64_t ttl = Int(r, "TTL");
  if (ttl <= 0) return absl::NotFoundError(absl::StrCat("etcd: lease ", lease, " expired"));
  return ttl;
}

absl::Status EtcdClient::LeaseRevoke(int64_t lease) {
  return Call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump()).status();
}

absl::Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  json j{{"key", B64(key)}, {"value", B64(value)}};
  if (lease != 0) j["lease"] = std::to_string(lease);
  return Call("/v3/kv/put", j.dump()).status();
}

absl::StatusOr<std::vector<KeyValue>> EtcdClient::RangePrefix(const std::string& prefix) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/kv/range",
                        json{{"key", B64(prefix)}, {"range_end", B64(PrefixEnd(prefix))}}.dump()));
  return ParseKvs(body);
}

absl::StatusOr<std::vector<KeyValue>> EtcdClient::Get(const std::string& key) {
  ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/range", json{{"key", B64(key)}}.dump()));
  return ParseKvs(body);
}

absl::Status EtcdClient::Delete(const std::string& key) {
  return Call("/v3/kv/deleterange", json{{"key", B64(key)}}.dump()).status();
}

absl::Status EtcdClient::Health() {
  absl::Status last = absl::UnavailableError("etcd: no endpoints");
  for (const std::string& ep : opts_.endpoints) {
    http::HttpRequestOptions ho;
    ho.timeout_ms = opts_.timeout_ms;
    auto r = http::HttpRequest(ep, "GET", "/health", "", ho);
    if (!r.ok()) {
      last = r.status();
      continue;
    }
    json j = json::parse(r->body, nullptr, false);
    if (r->status == 200 && !j.is_discarded() && j.value("health", "") == "true") {
      return absl::OkStatus();
    }
    last = absl::UnavailableError(absl::StrCat("etcd ", ep, " unhealthy: ", r->body));
  }
  return last;
}

EtcdRegistration::EtcdRegistration(EtcdClient* client, std::string key, std::string value,
                                   int ttl_s)
    : client_(client), key_(std::move(key)), value_(std::move(value)),
      ttl_s_(ttl_s < 2 ? 2 : ttl_s) {}

EtcdRegistration::~EtcdRegistration() { Stop(); }

absl::Status EtcdRegistration::Register() {
  ASSIGN_OR_RETURN(int64_t lease, client_->LeaseGrant(ttl_s_));
  std::string value;
  {
    std::lock_guard<std::mutex> l(mu_);
    value = value_;
  }
  absl::Status s = client_->Put(key_, value, lease);
  if (!s.ok()) {
    (void)client_->LeaseRevoke(lease);
    return s;
  }
  lease_ = lease;
  registered_ = true;
  return absl::OkStatus();
}

absl::Status EtcdRegistration::Start() {
  RETURN_IF_ERROR(Register());
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void EtcdRegistration::UpdateValue(const std::string& value) {
  {
    std::lock_guard<std::mutex> l(mu_);
    value_ = value;
  }
  if (registered_) (void)client_->Put(key_, value, lease_);
}

void EtcdRegistration::Loop() {
  const auto period = std::chrono::milliseconds(ttl_s_ * 1000 / 3);
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    cv_.wait_for(l, registered_ ? period : std::chrono::milliseconds(500));
    if (stop_) break;
    l.unlock();
    if (registered_) {
      auto ttl = client_->LeaseKeepAlive(lease_);
      if (!ttl.ok() && ttl.status().code() == absl::StatusCode::kNotFound) registered_ = false;
    }
    if (!registered_) (void)Register();
    l.lock();
  }
}

void EtcdRegistration::Stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (registered_) {
    (void)client_->LeaseRevoke(lease_);
    registered_ = false;
  }
}

}  // namespace sparsex::etcd
