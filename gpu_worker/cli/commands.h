// CLI subcommands; args are --key value pairs already split by main.cc.
#pragma once

#include <map>
#include <string>

#include "common/status.h"

namespace sparsex::cli {

using Args = std::map<std::string, std::string>;
absl::Status Generate(const Args& args);
absl::Status Fidelity(const Args& args);
absl::Status Info(const Args& args);
// Reads UTF-8 text from stdin (all of it, byte for byte: a trailing newline is text) and prints
// its token ids on one line, each preceded by a space, no BOS: llama.cpp's .out format. With
// --json-lines each stdin line is a JSON string and gets its own output line.
absl::Status Tokenize(const Args& args);

}  // namespace sparsex::cli
