// Helpers shared by the fuzz targets: a private scratch directory (loaders read paths), and
// splitting one input into parts.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace sparsex::fuzz {

// A directory of this process's own, in /dev/shm when it exists (no disk traffic), removed at
// exit.
inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    std::string base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    if (const char* t = std::getenv("SPARSEX_FUZZ_TMP")) base = t;
    std::string tmpl = base + "/sparsex-fuzz-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) std::abort();
    static std::string keep = tmpl;
    std::atexit([] { std::system(("rm -rf '" + keep + "'").c_str()); });
    return tmpl;
  }();
  return dir;
}

inline void WriteFile(const std::string& path, std::string_view bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

inline void RemoveFile(const std::string& path) { unlink(path.c_str()); }

// Splits at each occurrence of sep into at most max_parts parts (the last takes the rest);
// missing parts are empty.
inline std::vector<std::string_view> Split(std::string_view in, std::string_view sep,
                                           size_t max_parts) {
  std::vector<std::string_view> out;
  while (out.size() + 1 < max_parts) {
    size_t at = in.find(sep);
    if (at == std::string_view::npos) break;
    out.push_back(in.substr(0, at));
    in.remove_prefix(at + sep.size());
  }
  out.push_back(in);
  out.resize(max_parts);
  return out;
}

// Keeps a value computed from memory reads (so the reads are not optimised away).
inline void Sink(uint64_t v) {
  static volatile uint64_t sink;
  sink = v;
}

// SPARSEX_FUZZ_VERBOSE=1: print what each load or parse returned (to check that seeds load).
inline void Report(const char* what, const absl::Status& s) {
  static const bool on = std::getenv("SPARSEX_FUZZ_VERBOSE") != nullptr;
  if (on) std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
}

inline std::string_view AsView(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace sparsex::fuzz
