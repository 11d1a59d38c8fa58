// Runs the fidelity harness binary over 50 RAG-style prompts and checks the ordering the
// design rests on: SparseX selection beats naive reuse and the random control at r = 0.15.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "tests/gpu_worker/test_util.h"

namespace sparsex {
namespace {

TEST(Fidelity, SparsexBeatsNaiveAndRandomOver50Prompts) {
  const char* bin = std::getenv("SPARSEX_BIN_DIR");
  ASSERT_NE(bin, nullptr) << "SPARSEX_BIN_DIR is set by ctest";
  const std::string json = ::testing::TempDir() + "/fidelity_test.json";
  const std::string cmd = std::string(bin) + "/sparsex fidelity --model " +
                          testing::Stories260KPath() + " --docs " + testing::TinyStoriesPath() +
                          " --json " + json +
                          " --prompts 50 --full-layers 2 --encodings none"
                          " --selectors sparsex,random --ratios 0.15 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(json);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::map<std::string, double> kl;
  std::regex rec(R"re("selector": "(\w+)", "full_layers": (\d+).*?"kl_mean": ([0-9.eE+-]+))re");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), rec); it != std::sregex_iterator();
       ++it) {
    kl[(*it)[1].str()] = std::stod((*it)[3].str());
  }
  ASSERT_TRUE(kl.count("naive") && kl.count("sparsex") && kl.count("random")) << text;
  EXPECT_LT(kl["sparsex"], kl["naive"]);
  EXPECT_LT(kl["sparsex"], kl["random"]);
  EXPECT_NE(text.find("\"prompts\": 50"), std::string::npos);
}

}  // namespace
}  // namespace sparsex
