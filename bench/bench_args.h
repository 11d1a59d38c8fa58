// The benchmarks' flag parsing (sparsex-cache-bench, sparsex-fetch-bench): --name=value or
// --name value, read back with defaults.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

namespace sparsex::bench {

struct Args {
  std::map<std::string, std::string> kv;
  std::string Get(const std::string& k, const std::string& d) const {
    auto it = kv.find(k);
    return it == kv.end() ? d : it->second;
  }
  uint64_t U(const std::string& k, uint64_t d) const {
    auto it = kv.find(k);
    return it == kv.end() ? d : std::stoull(it->second);
  }
  // false (with the offending argument in *bad) for an argument that is not a flag or a flag
  // without its value.
  bool Parse(int argc, char** argv, std::string* bad) {
    for (int i = 1; i < argc; ++i) {
      std::string s = argv[i];
      if (s.rfind("--", 0) != 0) {
        *bad = s;
        return false;
      }
      s = s.substr(2);
      const size_t eq = s.find('=');
      if (eq != std::string::npos) {
        kv[s.substr(0, eq)] = s.substr(eq + 1);
      } else if (i + 1 < argc) {
        kv[s] = argv[++i];
      } else {
        *bad = argv[i];
        return false;
      }
    }
    return true;
  }
};

// A benchmark's main: parses the flags (exit 2 with a message on a bad one), then run(args).
template <typename Run>
int Main(int argc, char** argv, Run run) {
  Args a;
  if (std::string bad; !a.Parse(argc, argv, &bad)) {
    std::fprintf(stderr, "bad argument %s (flags: --name=value or --name value)\n", bad.c_str());
    return 2;
  }
  return run(a);
}

}  // namespace sparsex::bench
