// API keys and tenants of the public API. The operator lists keys in a JSON file (a Kubernetes
// Secret mounted as a file, or deploy/local/cluster.sh's), each stored as the SHA-256 of the key,
// never the key itself. A request's tenant comes from its key only (never from the request
// body); the tenant decides the KV scopes its segments are fingerprinted in, and its limits.
//
//   {
//     "shared_scopes": ["public"],
//     "keys": [
//       {"sha256": "<64 hex digits>", "tenant": "acme", "name": "acme-1",
//        "read_scopes": ["public"], "max_concurrent": 16, "requests_per_s": 20,
//        "max_prompt_bytes": 1048576},
//       {"sha256": "...", "tenant": "corpus-loader", "write_scope": "public"},
//       {"sha256": "...", "tenant": "ops", "admin": true}
//     ]
//   }
//
// Scopes. Every segment and exact-prefix block is fingerprinted under a 128-bit scope salt
// (model/prompt.h): a tenant's private scope by default, so that another tenant's identical
// document hashes to a different key and can never be found, leased or counted as reused by it.
// An operator can declare shared scopes (a public corpus, a common system prompt): a key with
// "read_scopes" reuses segments stored there; a key with "write_scope" stores its segments there.
// Salts are HMAC-SHA256(scope key, name) truncated to 128 bits when a scope key file is given
// (secret: nobody without it can compute a fingerprint of a scope), else SHA-256(name).
//
// The file is re-read when it changes (checked at most once a second), so keys rotate without a
// restart; a file that fails to parse keeps the previous keys and is logged.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/hash.h"
#include "common/status.h"

namespace sparsex::router {

struct KeyLimits {
  int max_concurrent = 0;        // generations in flight; 0: unlimited. Default: 0
  double requests_per_s = 0;     // token bucket rate (burst: max(1, rate)); 0: none. Default: 0
  size_t max_prompt_bytes = 0;   // prompt text bytes before tokenizing; 0: the router's. Default
};

struct Scope {
  std::string name;
  Hash128 salt;  // all zero: the unscoped namespace (authentication off)
};

struct KeyUsage;  // a key's counters (concurrency, rate), kept across reloads

struct Tenant {
  std::string name;       // tenant from the key file; "" with authentication off
  std::string key_name;   // the key's "name" (logs, metrics); "" when none
  bool admin = false;     // sees model fingerprints and worker addresses (ListModels, Health)
  Scope private_scope;    // where its segments go unless write_scope is set
  std::vector<Scope> read_scopes;  // shared scopes it may reuse from
  bool has_write_scope = false;
  Scope write_scope;      // a shared scope it stores into instead of private_scope
  KeyLimits limits;
  std::shared_ptr<KeyUsage> usage;  // nullptr with authentication off (no limits)
  // Prefix blocks and newly stored segments of this tenant are fingerprinted under this scope.
  const Scope& store_scope() const { return has_write_scope ? write_scope : private_scope; }
};

// Slot held while a generation runs; releases the tenant's concurrency count when destroyed.
class AdmissionSlot {
 public:
  AdmissionSlot() = default;
  explicit AdmissionSlot(std::shared_ptr<std::atomic<int>> c) : count_(std::move(c)) {}
  AdmissionSlot(AdmissionSlot&& o) noexcept = default;
  AdmissionSlot& operator=(AdmissionSlot&& o) noexcept {
    Release();
    count_ = std::move(o.count_);
    return *this;
  }
  ~AdmissionSlot() { Release(); }

 private:
  void Release() {
    if (count_) count_->fetch_sub(1);
    count_.reset();
  }
  std::shared_ptr<std::atomic<int>> count_;
};

// The scope salt of `name`: HMAC-SHA256(scope_key, "sparsex/scope/v1/" + name)[0:16] with a key,
// SHA-256 of the same string without one.
Hash128 ScopeSalt(std::string_view scope_key, std::string_view name);

class Authenticator {
 public:
  // Authentication off: every request is the unnamed admin tenant in the unscoped namespace.
  static std::unique_ptr<Authenticator> Disabled();
  // Keys from `keys_file`; scope salts keyed by the bytes of `scope_key_file` ("" = unkeyed).
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& keys_file,
                                                                 const std::string& scope_key_file);
  // Parses a key file's text (tests, the fuzz target).
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromJson(std::string_view json,
                                                                 std::string scope_key);
  ~Authenticator();

  bool enabled() const { return enabled_; }

  // `authorization`: the HTTP Authorization header or the gRPC "authorization" metadata value,
  // "Bearer <key>". UNAUTHENTICATED for a missing, malformed or unknown key (the message never
  // echoes the key).
  absl::StatusOr<std::shared_ptr<const Tenant>> Authenticate(std::string_view authorization);

  // Takes a concurrency slot and a rate token of the tenant's key. RESOURCE_EXHAUSTED naming
  // the limit when either is used up.
  absl::StatusOr<AdmissionSlot> Admit(const Tenant& t);

 private:
  Authenticator() = default;
  absl::Status Parse(std::string_view json);
  void MaybeReload();

  bool enabled_ = false;
  std::string keys_file_;
  std::string scope_key_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point last_check_{};
  int64_t file_mtime_ns_ = -1;
  std::shared_ptr<const Tenant> open_tenant_;
  // SHA-256 (hex) of a key -> its tenant. A reload keeps the usage of keys it keeps.
  absl::flat_hash_map<std::string, std::shared_ptr<const Tenant>> keys_;
};

}  // namespace sparsex::router
