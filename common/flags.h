// A tiny command-line flag parser for the service binaries (--name=value or --name value,
// --flag, --noflag or --flag true/false/1/0 for booleans, --help; any other word is an error).
// Header-only, no dependencies beyond absl.
//
//   FlagSet flags("sparsex-worker");
//   flags.Add("port", &opts.port, "gRPC port (0 = any free)");
//   flags.Add("model", &opts.model_path, "model file or directory");
//   if (absl::Status s = flags.Parse(argc, argv); !s.ok()) { ... }
//   if (flags.help()) { std::cout << flags.Usage(); return 0; }
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace sparsex {

class FlagSet {
 public:
  explicit FlagSet(std::string program) : program_(std::move(program)) {}

  void Add(const std::string& name, std::string* dst, const std::string& help) {
    Define(name, help, *dst, false, [dst](const std::string& v) {
      *dst = v;
      return absl::OkStatus();
    });
  }
  void Add(const std::string& name, int* dst, const std::string& help) {
    Define(name, help, std::to_string(*dst), false, [dst, name](const std::string& v) {
      if (!absl::SimpleAtoi(v, dst)) return Bad(name, v);
      return absl::OkStatus();
    });
  }
  void Add(const std::string& name, int64_t* dst, const std::string& help) {
    Define(name, help, std::to_string(*dst), false, [dst, name](const std::string& v) {
      if (!absl::SimpleAtoi(v, dst)) return Bad(name, v);
      return absl::OkStatus();
    });
  }
  void Add(const std::string& name, uint64_t* dst, const std::string& help) {
    Define(name, help, std::to_string(*dst), false, [dst, name](const std::string& v) {
      if (!absl::SimpleAtoi(v, dst)) return Bad(name, v);
      return absl::OkStatus();
    });
  }
  void Add(const std::string& name, double* dst, const std::string& help) {
    std::ostringstream d;
    d << *dst;
    Define(name, help, d.str(), false, [dst, name](const std::string& v) {
      if (!absl::SimpleAtod(v, dst)) return Bad(name, v);
      return absl::OkStatus();
    });
  }
  void Add(const std::string& name, float* dst, const std::string& help) {
    std::ostringstream d;
    d << *dst;
    Define(name, help, d.str(), false, [dst, name](const std::string& v) {
      if (!absl::SimpleAtof(v, dst)) return Bad(name, v);
      return absl::OkStatus();
    });
  }
  void Add(const std::string& name, bool* dst, const std::string& help) {
    Define(name, help, *dst ? "true" : "false", true, [dst, name](const std::string& v) {
      if (v.empty() || v == "1" || v == "true" || v == "yes") *dst = true;
      else if (v == "0" || v == "false" || v == "no") *dst = false;
      else return Bad(name, v);
      return absl::OkStatus();
    });
  }
  // Comma-separated list.
  void Add(const std::string& name, std::vector<std::string>* dst, const std::string& help) {
    std::string def;
    for (const auto& s : *dst) def += (def.empty() ? "" : ",") + s;
    Define(name, help, def, false, [dst](const std::string& v) {
      dst->clear();
      for (absl::string_view p : absl::StrSplit(v, ',', absl::SkipEmpty())) dst->emplace_back(p);
      return absl::OkStatus();
    });
  }

  absl::Status Parse(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        help_ = true;
        continue;
      }
      if (a.rfind("--", 0) != 0) {
        // No program takes operands: a stray word is a mistyped flag, never ignored.
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
      }
      a = a.substr(2);
      std::string value;
      bool has_value = false;
      if (size_t eq = a.find('='); eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
        has_value = true;
      }
      std::replace(a.begin(), a.end(), '-', '_');
      auto it = flags_.find(a);
      if (it == flags_.end() && !has_value && a.rfind("no", 0) == 0) {
        auto neg = flags_.find(a.substr(2));
        if (neg != flags_.end() && neg->second.is_bool) {
          RETURN_IF_ERROR(neg->second.set("false"));
          continue;
        }
      }
      if (it == flags_.end()) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", a, " (see --help)"));
      }
      // A bool flag takes its value from the next word when that word is one
      // (`--gate 0`); it used to be set to true and the 0 dropped.
      if (!has_value && it->second.is_bool && i + 1 < argc && IsBoolWord(argv[i + 1])) {
        value = argv[++i];
        has_value = true;
      }
      if (!has_value && !it->second.is_bool) {
        if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", a, " needs a value"));
        value = argv[++i];
      }
      RETURN_IF_ERROR(it->second.set(value));
    }
    return absl::OkStatus();
  }

  bool help() const { return help_; }

  std::string Usage() const {
    std::string out = "usage: " + program_ + " [--flag=value ...]\n";
    for (const auto& [name, f] : flags_) {
      out += "  --" + name + "  " + f.help;
      if (f.help.find("default") == std::string::npos) {
        out += " (default: " + (f.def.empty() ? std::string("\"\"") : f.def) + ")";
      }
      out += "\n";
    }
    return out;
  }

 private:
  struct Flag {
    std::string help, def;
    bool is_bool = false;
    std::function<absl::Status(const std::string&)> set;
  };
  static bool IsBoolWord(const std::string& v) {
    return v == "0" || v == "1" || v == "true" || v == "false" || v == "yes" || v == "no";
  }
  static absl::Status Bad(const std::string& name, const std::string& v) {
    return absl::InvalidArgumentError(absl::StrCat("bad value '", v, "' for --", name));
  }
  void Define(const std::string& name, const std::string& help, const std::string& def,
              bool is_bool, std::function<absl::Status(const std::string&)> set) {
    flags_[name] = Flag{help, def, is_bool, std::move(set)};
  }
  std::string program_;
  std::map<std::string, Flag> flags_;
  bool help_ = false;
};

}  // namespace sparsex
