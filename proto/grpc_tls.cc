#include "proto/grpc_tls.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <arpa/inet.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace sparsex {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("tls: cannot read ", what, " ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("tls: ", what, " ", path, " is not PEM"));
  }
  return s;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& f) {
  if (!f.enabled()) return absl::OkStatus();
  if (f.ca.empty() || f.cert.empty() || f.key.empty()) {
    return absl::InvalidArgumentError(
        "tls: --tls_ca, --tls_cert and --tls_key go together (all three or none)");
  }
  for (const auto& [p, what] : {std::pair{f.ca, "CA"}, {f.cert, "certificate"}, {f.key, "key"}}) {
    auto s = ReadPem(p, what);
    if (!s.ok()) return s.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsFiles& f, bool require_client_cert) {
  if (!f.enabled()) return grpc::InsecureServerCredentials();
  RETURN_IF_ERROR(CheckTlsFiles(f));
  grpc::SslServerCredentialsOptions o(
      require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(f.ca, "CA"));
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.private_key, ReadPem(f.key, "key"));
  ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(f.cert, "certificate"));
  o.pem_key_cert_pairs.push_back(std::move(pair));
  return grpc::SslServerCredentials(o);
}

void ClientChannelSecurity::Apply(grpc::ChannelArguments* args) const {
  if (!target_name.empty()) args->SetSslTargetNameOverride(target_name);
}

absl::StatusOr<ClientChannelSecurity> ClientCredentials(const TlsFiles& f) {
  ClientChannelSecurity out;
  if (!f.enabled()) {
    out.creds = grpc::InsecureChannelCredentials();
    return out;
  }
  RETURN_IF_ERROR(CheckTlsFiles(f));
  grpc::SslCredentialsOptions o;
  ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(f.ca, "CA"));
  ASSIGN_OR_RETURN(o.pem_private_key, ReadPem(f.key, "key"));
  ASSIGN_OR_RETURN(o.pem_cert_chain, ReadPem(f.cert, "certificate"));
  out.creds = grpc::SslCredentials(o);
  out.target_name = f.server_name.empty() ? kClusterTlsName : f.server_name;
  return out;
}

bool IsLoopbackAddress(const std::string& address) {
  std::string host = address;
  if (!host.empty() && host[0] == '[') {
    const size_t close = host.find(']');
    if (close == std::string::npos) return false;
    host = host.substr(1, close - 1);
    return host == "::1";
  }
  const size_t colon = host.rfind(':');
  if (colon != std::string::npos) host = host.substr(0, colon);
  if (host == "localhost") return true;
  // An IPv4 literal in 127.0.0.0/8 (a name such as "127.0.0.1.example.com" is not one).
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) != 1) return false;
  return (ntohl(a.s_addr) >> 24) == 127;
}

absl::Status CheckPlaintextAllowed(bool allowed, const std::string& flag,
                                   const std::vector<std::string>& listeners) {
  if (!allowed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no credentials configured: give them, or pass --", flag,
        " (accepted only when every listener is on loopback)"));
  }
  for (const auto& l : listeners) {
    if (l.empty()) continue;
    if (!IsLoopbackAddress(l)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--", flag, " is refused: listener ", l,
          " is not on loopback (configure TLS / API keys, docs/security.md)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace sparsex
