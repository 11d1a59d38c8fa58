// sparsex: the command-line front end of the engine.
//
//   sparsex generate --model PATH --prompt TEXT --max-tokens N --temperature T [--ids]
//   sparsex fidelity --model PATH --docs FILE --json OUT [--prompts N]
//   sparsex info --model PATH
//   sparsex tokenize --model PATH [--parse-special] < text
//
// All argument parsing lives in this one file (heavy CLI headers would slow every build).
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "gpu_worker/cli/commands.h"

namespace {

void Usage() {
  std::fprintf(stderr,
               "usage:\n"
               "  sparsex generate --model PATH [--prompt TEXT] [--max-tokens N]\n"
               "                   [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
               "                   [--device cpu|cuda] [--ids] [--segments FILE [--runs N]]\n"
               "  sparsex fidelity --model PATH --docs FILE --json OUT [--prompts N]\n"
               "                   [--seeds S,...] [--full-layers F,...] [--encodings none,bos]\n"
               "                   [--selectors a,b] [--ratios r,...]\n"
               "                   [--sparsex-weights c,r,d[,product,window,weight]]\n"
               "                   [--refresh-kv 0|1] (layer F's K/V of every reused token\n"
               "                   from its exact input; default 1)\n"
               "                   [--context N] [--max-len N] [--continuation N]\n"
               "                   [--bootstrap N] [--bootstrap-seed S] [--threads N]\n"
               "  sparsex info --model PATH\n"
               "  sparsex tokenize --model PATH [--parse-special] < TEXT\n"
               "      (token ids of stdin, space separated, no BOS; a vocabulary-only GGUF\n"
               "      or tokenizer.json is enough)\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage();
    return 2;
  }
  const std::string cmd = argv[1];
  std::map<std::string, std::string> args;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      std::fprintf(stderr, "unexpected argument '%s'\n", a.c_str());
      Usage();
      return 2;
    }
    a = a.substr(2);
    if (a == "ids" || a == "help" || a == "parse-special") {
      args[a] = "1";
    } else if (i + 1 < argc) {
      args[a] = argv[++i];
    } else {
      std::fprintf(stderr, "missing value for --%s\n", a.c_str());
      return 2;
    }
  }
  if (args.count("help")) {
    Usage();
    return 0;
  }
  absl::Status st;
  if (cmd == "generate") {
    st = sparsex::cli::Generate(args);
  } else if (cmd == "fidelity") {
    st = sparsex::cli::Fidelity(args);
  } else if (cmd == "info") {
    st = sparsex::cli::Info(args);
  } else if (cmd == "tokenize") {
    st = sparsex::cli::Tokenize(args);
  } else {
    std::fprintf(stderr, "unknown command '%s'\n", cmd.c_str());
    Usage();
    return 2;
  }
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
