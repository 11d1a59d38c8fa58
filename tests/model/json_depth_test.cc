// CheckJsonDepth / CheckJsonLimits (common/json_depth.h): the pre-scan every JSON
// parse of outside input runs, so that deeply nested text is an error, never a stack overflow.
#include "common/json_depth.h"

#include <gtest/gtest.h>

#include <string>

namespace sparsex {
namespace {

std::string Arrays(int n) { return std::string(n, '[') + std::string(n, ']'); }
std::string Objects(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += "{\"a\":";
  s += "1";
  for (int i = 0; i < n; ++i) s += "}";
  return s;
}

TEST(JsonDepthTest, AcceptsUpToTheLimit) {
  EXPECT_TRUE(CheckJsonDepth("", 64).ok());
  EXPECT_TRUE(CheckJsonDepth("1", 64).ok());
  EXPECT_TRUE(CheckJsonDepth("{\"a\": [1, 2, {\"b\": []}]}", 4).ok());
  EXPECT_FALSE(CheckJsonDepth("{\"a\": [1, 2, {\"b\": []}]}", 3).ok());
  EXPECT_TRUE(CheckJsonDepth(Arrays(64), 64).ok());
  EXPECT_TRUE(CheckJsonDepth(Objects(64), 64).ok());
  // Siblings do not add up: depth is the deepest path, not the number of brackets.
  std::string wide;
  for (int i = 0; i < 1000; ++i) wide += Arrays(10) + ",";
  EXPECT_TRUE(CheckJsonDepth("[" + wide + "1]", 11).ok());
}

TEST(JsonDepthTest, RefusesDeeperNesting) {
  for (const std::string& text : {Arrays(65), Objects(65), "{\"x\": " + Arrays(64) + "}"}) {
    absl::Status s = CheckJsonDepth(text, 64);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text.substr(0, 80);
    EXPECT_NE(s.message().find("deeper than 64"), std::string::npos) << s;
  }
  // The request body: messages[].content nested 10,000 arrays deep (~20 KB).
  const std::string body = "{\"messages\":[{\"role\":\"user\",\"content\":" + Arrays(10000) + "}]}";
  absl::Status s = CheckJsonDepth(body, kMaxJsonDepth);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("at byte"), std::string::npos) << s;
  // Unbalanced text is left to the parser, but an open run still counts.
  EXPECT_FALSE(CheckJsonDepth(std::string(100, '['), 64).ok());
  EXPECT_TRUE(CheckJsonDepth(std::string(100, ']'), 64).ok());
}

TEST(JsonDepthTest, BracketsInsideStringsDoNotCount) {
  EXPECT_TRUE(CheckJsonDepth("[\"" + std::string(1000, '[') + "\"]", 1).ok());
  EXPECT_TRUE(CheckJsonDepth("{\"" + std::string(1000, '{') + "\": 1}", 1).ok());
  // An escaped quote does not end the string: the brackets after it are still inside.
  EXPECT_TRUE(CheckJsonDepth("[\"\\\"" + std::string(1000, '[') + "\"]", 1).ok());
  // An escaped backslash does not escape the quote after it: the string ends there, and the
  // brackets after it count.
  EXPECT_FALSE(CheckJsonDepth("[\"\\\\\", " + Arrays(5) + "]", 5).ok());
  EXPECT_TRUE(CheckJsonDepth("[\"\\\\\", " + Arrays(5) + "]", 6).ok());
  // A string cut by the end of the text (malformed) is not a depth error.
  EXPECT_TRUE(CheckJsonDepth("[\"[[[[[[[[", 1).ok());
}

TEST(JsonDepthTest, LimitsCheckSizeThenDepth) {
  EXPECT_TRUE(CheckJsonLimits("[1, 2]", 6).ok());
  absl::Status s = CheckJsonLimits("[1, 2]", 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("exceeds the limit of 5"), std::string::npos) << s;
  EXPECT_FALSE(CheckJsonLimits(Arrays(65), 1 << 20).ok());
  EXPECT_TRUE(CheckJsonLimits(Arrays(65), 1 << 20, 65).ok());
}

}  // namespace
}  // namespace sparsex
