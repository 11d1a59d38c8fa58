#include "router/auth.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/json_depth.h"

namespace sparsex::router {

struct KeyUsage {
  std::shared_ptr<std::atomic<int>> inflight = std::make_shared<std::atomic<int>>(0);
  std::mutex mu;
  double tokens = -1;  // < 0: full bucket on first use
  std::chrono::steady_clock::time_point last{};
};

namespace {

constexpr size_t kMaxKeyBytes = 512;
constexpr size_t kMaxFileBytes = size_t{4} << 20;

std::string Hex(const unsigned char* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = d[p[i] >> 4];
    s[2 * i + 1] = d[p[i] & 15];
  }
  return s;
}

std::string Sha256Hex(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr);
  return Hex(md, n);
}

Hash128 FromDigest(const unsigned char* md) {
  Hash128 h;
  for (int i = 0; i < 8; ++i) h.hi = (h.hi << 8) | md[i];
  for (int i = 8; i < 16; ++i) h.lo = (h.lo << 8) | md[i];
  return h;
}

int64_t MtimeNs(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return -1;
  return (static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec) ^
         (static_cast<int64_t>(st.st_size) << 1);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (ss.str().size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is larger than 4 MiB"));
  }
  return ss.str();
}

std::string_view Trim(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t' || v.back() == '\r' ||
                        v.back() == '\n')) {
    v.remove_suffix(1);
  }
  return v;
}

bool IsScopeName(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.')
      return false;
  }
  return true;
}

}  // namespace

Hash128 ScopeSalt(std::string_view scope_key, std::string_view name) {
  const std::string msg = "sparsex/scope/v1/" + std::string(name);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (scope_key.empty()) {
    EVP_Digest(msg.data(), msg.size(), md, &n, EVP_sha256(), nullptr);
  } else {
    HMAC(EVP_sha256(), scope_key.data(), static_cast<int>(scope_key.size()),
         reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), md, &n);
  }
  return FromDigest(md);
}

Authenticator::~Authenticator() = default;

std::unique_ptr<Authenticator> Authenticator::Disabled() {
  std::unique_ptr<Authenticator> a(new Authenticator());
  auto t = std::make_shared<Tenant>();
  t->admin = true;
  a->open_tenant_ = std::move(t);
  return a;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromJson(std::string_view json,
                                                                       std::string scope_key) {
  std::unique_ptr<Authenticator> a(new Authenticator());
  a->enabled_ = true;
  a->scope_key_ = std::move(scope_key);
  RETURN_IF_ERROR(a->Parse(json));
  return a;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(
    const std::string& keys_file, const std::string& scope_key_file) {
  std::string scope_key;
  if (!scope_key_file.empty()) {
    ASSIGN_OR_RETURN(scope_key, ReadSmallFile(scope_key_file, "scope key file"));
    if (scope_key.size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scope key file ", scope_key_file, " holds ", scope_key.size(),
          " bytes; at least 16 random bytes are needed (openssl rand -hex 32)"));
    }
  }
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(keys_file, "API key file"));
  const int64_t mtime = MtimeNs(keys_file);
  auto a = FromJson(text, std::move(scope_key));
  if (!a.ok()) {
    return absl::Status(a.status().code(), absl::StrCat(keys_file, ": ", a.status().message()));
  }
  (*a)->keys_file_ = keys_file;
  (*a)->file_mtime_ns_ = mtime;
  (*a)->last_check_ = std::chrono::steady_clock::now();
  return a;
}

absl::Status Authenticator::Parse(std::string_view text) {
  RETURN_IF_ERROR(CheckJsonDepth(text, 16));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("API key file: not a JSON object");
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "keys" && it.key() != "shared_scopes") {
      return absl::InvalidArgumentError(
          absl::StrCat("API key file: unknown field '", it.key(), "'"));
    }
  }
  absl::flat_hash_map<std::string, bool> shared;
  if (j.contains("shared_scopes")) {
    if (!j["shared_scopes"].is_array()) {
      return absl::InvalidArgumentError("API key file: shared_scopes must be an array");
    }
    for (const auto& s : j["shared_scopes"]) {
      if (!s.is_string() || !IsScopeName(s.get<std::string>())) {
        return absl::InvalidArgumentError(
            "API key file: a shared scope is a name of letters, digits, '-', '_' or '.'");
      }
      shared[s.get<std::string>()] = true;
    }
  }
  if (!j.contains("keys") || !j["keys"].is_array()) {
    return absl::InvalidArgumentError("API key file: \"keys\" must be an array");
  }
  absl::flat_hash_map<std::string, std::shared_ptr<const Tenant>> keys;
  int i = 0;
  for (const auto& k : j["keys"]) {
    const std::string where = absl::StrCat("API key file: keys[", i++, "]");
    if (!k.is_object()) return absl::InvalidArgumentError(where + ": not an object");
    static const char* kFields[] = {"sha256",         "tenant",         "name",
                                    "admin",          "read_scopes",    "write_scope",
                                    "max_concurrent", "requests_per_s", "max_prompt_bytes"};
    for (auto it = k.begin(); it != k.end(); ++it) {
      bool known = false;
      for (const char* f : kFields) known = known || it.key() == f;
      if (!known) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": unknown field '", it.key(), "'"));
      }
    }
    if (!k.contains("sha256") || !k["sha256"].is_string()) {
      return absl::InvalidArgumentError(where + ": sha256 (hex SHA-256 of the key) is required");
    }
    std::string digest = absl::AsciiStrToLower(k["sha256"].get<std::string>());
    bool hex = digest.size() == 64;
    for (char c : digest) hex = hex && absl::ascii_isxdigit(static_cast<unsigned char>(c));
    if (!hex) return absl::InvalidArgumentError(where + ": sha256 must be 64 hex digits");
    if (!k.contains("tenant") || !k["tenant"].is_string() ||
        !IsScopeName(k["tenant"].get<std::string>())) {
      return absl::InvalidArgumentError(
          where + ": tenant (letters, digits, '-', '_' or '.') is required");
    }
    auto t = std::make_shared<Tenant>();
    t->name = k["tenant"].get<std::string>();
    if (shared.contains(t->name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tenant '", t->name, "' has the name of a shared scope"));
    }
    if (k.contains("name")) {
      if (!k["name"].is_string()) return absl::InvalidArgumentError(where + ": name: a string");
      t->key_name = k["name"].get<std::string>();
    }
    if (k.contains("admin")) {
      if (!k["admin"].is_boolean()) return absl::InvalidArgumentError(where + ": admin: a bool");
      t->admin = k["admin"].get<bool>();
    }
    t->private_scope = {"tenant/" + t->name, ScopeSalt(scope_key_, "tenant/" + t->name)};
    auto shared_scope = [&](const nlohmann::json& v, const char* field) -> absl::StatusOr<Scope> {
      if (!v.is_string() || !shared.contains(v.get<std::string>())) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", field, " names a scope not listed in shared_scopes"));
      }
      const std::string n = v.get<std::string>();
      return Scope{"shared/" + n, ScopeSalt(scope_key_, "shared/" + n)};
    };
    if (k.contains("read_scopes")) {
      if (!k["read_scopes"].is_array()) {
        return absl::InvalidArgumentError(where + ": read_scopes must be an array");
      }
      for (const auto& s : k["read_scopes"]) {
        ASSIGN_OR_RETURN(Scope sc, shared_scope(s, "read_scopes"));
        t->read_scopes.push_back(std::move(sc));
      }
    }
    if (k.contains("write_scope")) {
      ASSIGN_OR_RETURN(t->write_scope, shared_scope(k["write_scope"], "write_scope"));
      t->has_write_scope = true;
    }
    auto number = [&](const char* f, double lo, double hi) -> absl::StatusOr<double> {
      if (!k.contains(f)) return 0.0;
      if (!k[f].is_number()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", f, ": a number"));
      const double v = k[f].get<double>();
      if (!(v >= lo && v <= hi)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": ", f, " must be ", lo, " to ", hi));
      }
      return v;
    };
    ASSIGN_OR_RETURN(double mc, number("max_concurrent", 0, 1e6));
    ASSIGN_OR_RETURN(double rps, number("requests_per_s", 0, 1e6));
    ASSIGN_OR_RETURN(double mpb, number("max_prompt_bytes", 0, 1e12));
    t->limits.max_concurrent = static_cast<int>(mc);
    t->limits.requests_per_s = rps;
    t->limits.max_prompt_bytes = static_cast<size_t>(mpb);
    // A key kept across a reload keeps its counters (in-flight slots stay accounted).
    auto old = keys_.find(digest);
    t->usage = old != keys_.end() && old->second->usage ? old->second->usage
                                                        : std::make_shared<KeyUsage>();
    if (keys.contains(digest)) {
      return absl::InvalidArgumentError(where + ": the same key is listed twice");
    }
    keys[digest] = std::move(t);
  }
  keys_ = std::move(keys);
  return absl::OkStatus();
}

void Authenticator::MaybeReload() {
  if (keys_file_.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_check_ < std::chrono::seconds(1)) return;
  last_check_ = now;
  const int64_t m = MtimeNs(keys_file_);
  if (m == file_mtime_ns_) return;
  auto text = ReadSmallFile(keys_file_, "API key file");
  absl::Status s = text.ok() ? Parse(*text) : text.status();
  if (s.ok()) {
    file_mtime_ns_ = m;
    std::cerr << "[router] API keys reloaded from " << keys_file_ << " (" << keys_.size()
              << " keys)" << std::endl;
  } else {
    std::cerr << "[router] API key file " << keys_file_ << " not reloaded, previous keys kept: "
              << s.message() << std::endl;
    file_mtime_ns_ = m;  // logged once per change
  }
}

absl::StatusOr<std::shared_ptr<const Tenant>> Authenticator::Authenticate(
    std::string_view authorization) {
  if (!enabled_) return open_tenant_;
  std::string_view v = Trim(authorization);
  if (v.empty()) {
    return absl::UnauthenticatedError(
        "missing API key: send \"Authorization: Bearer <key>\" (gRPC: \"authorization\" metadata)");
  }
  if (v.size() < 7 || absl::AsciiStrToLower(std::string(v.substr(0, 7))) != "bearer ") {
    return absl::UnauthenticatedError("the Authorization header must be \"Bearer <key>\"");
  }
  std::string_view key = Trim(v.substr(7));
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::UnauthenticatedError("invalid API key");
  }
  for (char c : key) {
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      return absl::UnauthenticatedError("invalid API key");
    }
  }
  // The table is looked up by the key's SHA-256: comparison time depends on the digest, which
  // a caller cannot steer towards a stored one.
  const std::string digest = Sha256Hex(key);
  std::lock_guard<std::mutex> l(mu_);
  MaybeReload();
  auto it = keys_.find(digest);
  if (it == keys_.end()) return absl::UnauthenticatedError("invalid API key");
  return it->second;
}

absl::StatusOr<AdmissionSlot> Authenticator::Admit(const Tenant& t) {
  if (!t.usage) return AdmissionSlot();
  KeyUsage& u = *t.usage;
  if (t.limits.requests_per_s > 0) {
    std::lock_guard<std::mutex> l(u.mu);
    const auto now = std::chrono::steady_clock::now();
    const double burst = std::max(1.0, t.limits.requests_per_s);
    if (u.tokens < 0) {
      u.tokens = burst;
    } else {
      const double dt = std::chrono::duration<double>(now - u.last).count();
      u.tokens = std::min(burst, u.tokens + dt * t.limits.requests_per_s);
    }
    u.last = now;
    if (u.tokens < 1.0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "rate limit: this API key may send ", t.limits.requests_per_s, " requests a second"));
    }
    u.tokens -= 1.0;
  }
  const int now_inflight = u.inflight->fetch_add(1) + 1;
  AdmissionSlot slot(u.inflight);
  if (t.limits.max_concurrent > 0 && now_inflight > t.limits.max_concurrent) {
    return absl::ResourceExhaustedError(
        absl::StrCat("concurrency limit: this API key may run ", t.limits.max_concurrent,
                     " requests at once"));
  }
  return slot;
}

}  // namespace sparsex::router
