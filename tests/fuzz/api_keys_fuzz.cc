// The router's credential parsing (router/auth.h): the API key file and the Authorization
// header / gRPC metadata value. Input "<key file>\0<authorization value>": the key file is parsed
// (errors are fine, crashes are not); the value is authenticated against it when it loaded, else
// against a fixed key file, and an admitted tenant takes and releases a slot.
#include <string>
#include <string_view>

#include "router/auth.h"

using sparsex::router::Authenticator;

namespace {

Authenticator& Fixed() {
  static auto a = *Authenticator::FromJson(
      R"({"shared_scopes":["public"],"keys":[{"sha256":)"
      R"("9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",)"
      R"("tenant":"t","read_scopes":["public"],"max_concurrent":1,"requests_per_s":1000}]})",
      "0123456789abcdef");
  return *a;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  std::string_view file = in.substr(0, nul);
  std::string_view header = nul == std::string_view::npos ? std::string_view() : in.substr(nul + 1);
  auto parsed = Authenticator::FromJson(file, "k");
  Authenticator& a = parsed.ok() ? **parsed : Fixed();
  auto t = a.Authenticate(header);
  if (t.ok()) {
    auto slot = a.Admit(**t);
    (void)slot;
  }
  return 0;
}
