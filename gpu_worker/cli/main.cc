// sparsex: the command-line front end of the engine.
//
//   sparsex generate --model PATH --prompt TEXT --max-tokens N --temperature T [--ids]
//   sparsex fidelity --model PATH --docs FILE --json OUT [--prompts N]
//   sparsex info --model PATH
//   sparsex tokenize --model PATH [--parse-special] < text
//   sparsex --help | sparsex COMMAND --help
//
// All argument parsing lives in this one file (heavy CLI headers would slow every build). Each
// command's flags are declared once, in kCommands: the parser accepts exactly those and the help
// text is printed from the same table, so a flag cannot be accepted without being documented.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "gpu_worker/cli/commands.h"

namespace {

struct Flag {
  const char* name;
  const char* value;  // the value's placeholder; nullptr for a switch (no value)
  const char* help;
};

struct Command {
  const char* name;
  const char* summary;
  absl::Status (*run)(const sparsex::cli::Args&);
  std::vector<Flag> flags;
};

const std::vector<Command>& Commands() {
  static const std::vector<Command> kCommands = {
      {"generate",
       "Generate text from a prompt through the worker's scheduler, in process.",
       sparsex::cli::Generate,
       {
           {"model", "PATH", "model: a *.gguf file, a Hugging Face directory or synthetic:NAME "
                             "(required)"},
           {"tokenizer", "PATH", "take the tokenizer from this GGUF vocabulary or tokenizer.json "
                                 "instead of the model's"},
           {"prompt", "TEXT", "prompt text (default: empty)"},
           {"max-tokens", "N", "tokens to generate"},
           {"temperature", "T", "sampling temperature (0: greedy)"},
           {"top-k", "K", "sample among the K most likely tokens (0: all)"},
           {"top-p", "P", "nucleus sampling mass"},
           {"seed", "S", "sampling seed"},
           {"device", "cpu|cuda", "backend (default cpu)"},
           {"ids", nullptr, "print the generated token ids instead of the text"},
           {"segments", "FILE", "segment reuse: the file's blank-line separated paragraphs are "
                                "segments, the prompt a new segment after them"},
           {"runs", "N", "with --segments: repeat the request N times (every other run in "
                         "reversed order), so later runs reuse the stored segments"},
       }},
      {"fidelity",
       "Measure the quality of KV reuse against full prefill on held-out documents.",
       sparsex::cli::Fidelity,
       {
           {"model", "PATH", "model (required)"},
           {"docs", "FILE", "documents, one per line (required)"},
           {"json", "OUT", "where the results are written (required)"},
           {"prompts", "N", "prompts per seed (default 50)"},
           {"seed", "S", "the seed when --seeds is not given (default 1)"},
           {"seeds", "S,...", "seeds of the prompt draws"},
           {"full-layers", "F,...", "numbers of leading layers computed in full (default 1,2)"},
           {"encodings", "none,bos", "segment encodings to compare"},
           {"selectors", "a,b", "recompute-token selectors (default sparsex,cacheblend,epic,"
                                "random,prophetkv,a3)"},
           {"ratios", "r,...", "recompute ratios (default 0,0.05,0.10,0.15,0.30,0.50,1.0)"},
           {"sparsex-weights", "c,r,d[,product,window,weight]", "the sparsex selector's weights"},
           {"refresh-kv", "0|1", "layer F's K/V of every reused token from its exact input "
                                 "(default 1)"},
           {"context", "N", "context length of the prompts (at least 2)"},
           {"max-len", "N", "longest prompt in tokens (default 512)"},
           {"continuation", "N", "scored continuation tokens (default 32)"},
           {"bootstrap", "N", "bootstrap resamples for the intervals (default 2000)"},
           {"bootstrap-seed", "S", "bootstrap seed (default 1)"},
           {"threads", "N", "worker threads"},
           {"quality-target", "D", "also run the quality-budget setting with this target drop "
                                    "(default -1: not run)"},
           {"calibration", "FILE", "quality calibration (JSON) the quality budget uses; must be "
                                  "measured on the same model"},
           {"calibration-out", "FILE", "write the quality calibration measured by this run"},
           {"calibration-quantile", "Q", "quantile of the per-prompt drop / uncovered share that "
                                           "--calibration-out records (default 0.9)"},
           {"stats-layers", "all|last", "the selectors' attention statistics from all F full "
                                      "layers (default all) or from the last one only"},
       }},
      {"info",
       "Print a model's configuration and fingerprint.",
       sparsex::cli::Info,
       {
           {"model", "PATH", "model (required)"},
           {"tokenizer", "PATH", "take the tokenizer from this GGUF vocabulary or tokenizer.json "
                                 "(changes the fingerprint)"},
       }},
      {"tokenize",
       "Print the token ids of stdin (space separated, no BOS); a vocabulary-only GGUF or a "
       "tokenizer.json is enough.",
       sparsex::cli::Tokenize,
       {
           {"model", "PATH", "model or tokenizer file (required unless --tokenizer is given)"},
           {"tokenizer", "PATH", "tokenizer file; overrides the model's"},
           {"parse-special", nullptr, "map special-token text (\"<|eot_id|>\") to its id"},
           {"json-lines", nullptr, "stdin holds one JSON string per line; one line of ids is "
                                   "printed for each (one load for many texts)"},
       }},
  };
  return kCommands;
}

void Usage(FILE* out) {
  std::fprintf(out, "usage: sparsex COMMAND [--flag value ...]\n\ncommands:\n");
  for (const Command& c : Commands()) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out, "\n'sparsex COMMAND --help' lists a command's flags.\n");
}

void CommandUsage(FILE* out, const Command& c) {
  std::fprintf(out, "usage: sparsex %s [flags]\n  %s\n\nflags:\n", c.name, c.summary);
  for (const Flag& f : c.flags) {
    std::string left = std::string("--") + f.name;
    if (f.value) left += std::string(" ") + f.value;
    std::fprintf(out, "  %-28s %s\n", left.c_str(), f.help);
  }
  std::fprintf(out, "  %-28s %s\n", "--help", "print this help");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage(stderr);
    return 2;
  }
  const std::string cmd_name = argv[1];
  if (cmd_name == "--help" || cmd_name == "-h" || cmd_name == "help") {
    Usage(stdout);
    return 0;
  }
  const Command* cmd = nullptr;
  for (const Command& c : Commands())
    if (cmd_name == c.name) cmd = &c;
  if (cmd == nullptr) {
    std::fprintf(stderr, "unknown command '%s'\n", cmd_name.c_str());
    Usage(stderr);
    return 2;
  }
  sparsex::cli::Args args;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      CommandUsage(stdout, *cmd);
      return 0;
    }
    if (a.rfind("--", 0) != 0) {
      std::fprintf(stderr, "unexpected argument '%s'\n", a.c_str());
      CommandUsage(stderr, *cmd);
      return 2;
    }
    a = a.substr(2);
    const Flag* flag = nullptr;
    for (const Flag& f : cmd->flags)
      if (a == f.name) flag = &f;
    if (flag == nullptr) {
      std::fprintf(stderr, "unknown flag '--%s' for sparsex %s\n", a.c_str(), cmd->name);
      CommandUsage(stderr, *cmd);
      return 2;
    }
    if (flag->value == nullptr) {
      args[a] = "1";
    } else if (i + 1 < argc) {
      args[a] = argv[++i];
    } else {
      std::fprintf(stderr, "missing value for --%s\n", a.c_str());
      return 2;
    }
  }
  absl::Status st;
  try {
    st = cmd->run(args);
  } catch (const std::exception& e) {  // std::stoi and friends on a malformed flag value
    std::fprintf(stderr, "error: bad flag value (%s)\n", e.what());
    return 2;
  }
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
