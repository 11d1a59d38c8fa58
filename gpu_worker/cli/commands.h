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

}  // namespace sparsex::cli
