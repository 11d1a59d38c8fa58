// FlagSet: every word on a command line is a flag or a flag's value; nothing is dropped.
#include "common/flags.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace sparsex {
namespace {

absl::Status ParseWords(FlagSet& f, std::vector<std::string> words) {
  std::vector<char*> argv;
  std::string prog = "prog";
  argv.push_back(prog.data());
  for (auto& w : words) argv.push_back(w.data());
  return f.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(Flags, BoolTakesAValueFromTheNextWord) {
  // `--gate 0` once set the flag to true and dropped the 0 (a "gate off" benchmark worker ran
  // with the gate on).
  for (const char* word : {"0", "false", "no"}) {
    bool gate = true;
    int port = 0;
    FlagSet f("prog");
    f.Add("gate", &gate, "");
    f.Add("port", &port, "");
    ASSERT_TRUE(ParseWords(f, {"--gate", word, "--port", "7"}).ok()) << word;
    EXPECT_FALSE(gate) << word;
    EXPECT_EQ(port, 7);
  }
  bool gate = false, other = true;
  FlagSet f("prog");
  f.Add("gate", &gate, "");
  f.Add("other", &other, "");
  ASSERT_TRUE(ParseWords(f, {"--gate", "--noother"}).ok());  // bare and negated forms
  EXPECT_TRUE(gate);
  EXPECT_FALSE(other);
  ASSERT_TRUE(ParseWords(f, {"--gate=false", "--other", "1"}).ok());
  EXPECT_FALSE(gate);
  EXPECT_TRUE(other);
}

TEST(Flags, AStrayWordIsAnError) {
  bool gate = true;
  FlagSet f("prog");
  f.Add("gate", &gate, "");
  absl::Status s = ParseWords(f, {"--gate", "maybe"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'maybe'"), std::string::npos) << s;
  EXPECT_EQ(ParseWords(f, {"--nosuch=1"}).code(), absl::StatusCode::kInvalidArgument);
  int n = 0;
  f.Add("n", &n, "");
  EXPECT_EQ(ParseWords(f, {"--n", "x"}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sparsex
