// Cluster transport security for every gRPC channel inside SparseX: mutual TLS under one
// cluster CA. Each process holds a certificate signed by that CA; a server asks for and verifies
// the peer's certificate, a client verifies the server's. Certificates name the cluster
// (kClusterTlsName as a DNS subject alternative name), not hosts, so that membership written in
// etcd (an address) never decides trust: a process at any address is a member only when it
// presents a certificate of the cluster CA (docs/security.md).
//
//   TlsFiles tls{.ca = "ca.pem", .cert = "worker.pem", .key = "worker-key.pem"};
//   ASSIGN_OR_RETURN(auto creds, ServerCredentials(tls, /*require_client_cert=*/true));
//   builder.AddListeningPort(addr, creds, &port);
//   ASSIGN_OR_RETURN(ClientChannelSecurity sec, ClientCredentials(tls));
//   sec.Apply(&args);  channel = grpc::CreateCustomChannel(addr, sec.creds, args);
//
// Empty TlsFiles means plaintext. Plaintext is allowed only where the operator said so and
// every listener is on loopback (CheckPlaintextAllowed); the binaries refuse to start otherwise.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace grpc {
class ServerCredentials;
class ChannelCredentials;
class ChannelArguments;
}  // namespace grpc

namespace sparsex {

// The DNS name every cluster certificate carries; clients check the server against it
// (whatever address they dialled). Default certificates from deploy/local/cluster.sh use it.
inline constexpr char kClusterTlsName[] = "sparsex.cluster";

struct TlsFiles {
  std::string ca;    // PEM: the cluster CA (trust anchor for peers). Default: "" (plaintext)
  std::string cert;  // PEM: this process's certificate chain. Default: ""
  std::string key;   // PEM: this process's private key. Default: ""
  // The name a client expects in the server's certificate. Default: kClusterTlsName
  std::string server_name = kClusterTlsName;
  bool enabled() const { return !ca.empty() || !cert.empty() || !key.empty(); }
};

// INVALID_ARGUMENT unless all three files are named and readable (or none is).
absl::Status CheckTlsFiles(const TlsFiles& f);

// Server side. With TLS files: TLS with this process's certificate, and (require_client_cert)
// a client certificate verified against the CA, else the handshake fails. Without: plaintext.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsFiles& f, bool require_client_cert);

struct ClientChannelSecurity {
  std::shared_ptr<grpc::ChannelCredentials> creds;
  std::string target_name;  // "" for plaintext
  // Sets the expected server name (kClusterTlsName) on the channel arguments.
  void Apply(grpc::ChannelArguments* args) const;
};
// Client side: TLS presenting this process's certificate and verifying the server against the
// CA and server_name. Without TLS files: plaintext.
absl::StatusOr<ClientChannelSecurity> ClientCredentials(const TlsFiles& f);

// "host:port" is on loopback: 127.0.0.0/8, [::1] or localhost. Port-only or wildcard
// addresses ("0.0.0.0:80", ":80", "[::]:80") are not.
bool IsLoopbackAddress(const std::string& address);

// A process that runs without TLS (or an API without keys) does so only when the operator asked
// for it (`allowed`) and every listed listener is on loopback. FAILED_PRECONDITION naming the
// first non-loopback listener, or the missing flag (`flag`), otherwise.
absl::Status CheckPlaintextAllowed(bool allowed, const std::string& flag,
                                   const std::vector<std::string>& listeners);

}  // namespace sparsex
