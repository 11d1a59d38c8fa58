// sparsex-loadgen's workload generation and statistics (bench/loadgen/workloads.h, stats.h).
#include "bench/loadgen/workloads.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench/loadgen/openai_client.h"
#include "bench/loadgen/stats.h"

namespace sparsex::loadgen {
namespace {

std::unique_ptr<Workload> Make(const WorkloadConfig& c, const std::vector<std::string>& docs = {}) {
  absl::StatusOr<std::unique_ptr<Workload>> w = MakeWorkload(c, docs);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

bool SameSegment(const SegmentSpec& a, const SegmentSpec& b) {
  return a.kind == b.kind && a.is_text == b.is_text && a.ids == b.ids && a.text == b.text &&
         a.cacheable == b.cacheable && a.tokens == b.tokens && a.source == b.source;
}

bool SameRequest(const RequestSpec& a, const RequestSpec& b) {
  if (a.index != b.index || a.group != b.group || a.segments.size() != b.segments.size()) {
    return false;
  }
  for (size_t i = 0; i < a.segments.size(); ++i) {
    if (!SameSegment(a.segments[i], b.segments[i])) return false;
  }
  return true;
}

WorkloadConfig Small(const std::string& workload) {
  WorkloadConfig c;
  c.workload = workload;
  c.seed = 7;
  c.pool = 20;
  c.doc_tokens = 40;
  c.question_tokens = 8;
  c.docs_per_request = 3;
  c.sessions = 3;
  c.agents = 3;
  c.system_tokens = 16;
  c.turn_tokens = 10;
  c.reply_tokens = 6;
  c.shared_tokens = 100;
  c.instr_tokens = 12;
  c.max_history_tokens = 0;
  return c;
}

TEST(Workloads, SameSeedSameSequence) {
  for (const char* name : {"rag", "chat", "agents"}) {
    WorkloadConfig c = Small(name);
    c.max_history_tokens = 60;
    auto a = Make(c), b = Make(c);
    c.seed = 8;
    auto other = Make(c);
    bool differs = false;
    for (int i = 0; i < 50; ++i) {
      const RequestSpec ra = a->Next(), rb = b->Next(), ro = other->Next();
      EXPECT_TRUE(SameRequest(ra, rb)) << name << " request " << i;
      differs = differs || !SameRequest(ra, ro);
    }
    EXPECT_TRUE(differs) << name << ": another seed gives another sequence";
  }
}

// Prime shows every pool document `passes` times in requests of distinct documents (each
// pass grouped differently), a fresh question each, without touching Next()'s sequence; the
// workloads without a pool prime nothing.
TEST(Workloads, RagPrimeCoversThePool) {
  WorkloadConfig c = Small("rag");
  auto plain = Make(c), primed = Make(c);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(primed, nullptr);
  const std::vector<RequestSpec> prime = primed->Prime(2);
  ASSERT_EQ(prime.size(), 2u * ((c.pool + c.docs_per_request - 1) / c.docs_per_request));
  std::vector<int> seen(static_cast<size_t>(c.pool), 0);
  std::set<std::vector<int>> groups;
  for (const RequestSpec& r : prime) {
    EXPECT_LT(r.index, 0);
    ASSERT_GE(r.segments.size(), 2u);
    std::vector<int> docs;
    for (size_t i = 0; i + 1 < r.segments.size(); ++i) {
      EXPECT_EQ(r.segments[i].kind, SegmentSpec::Kind::kDocument);
      docs.push_back(r.segments[i].source);
      ++seen[static_cast<size_t>(r.segments[i].source)];
    }
    EXPECT_EQ(std::set<int>(docs.begin(), docs.end()).size(), docs.size());
    EXPECT_FALSE(r.segments.back().cacheable);
    groups.insert(docs);
  }
  for (int n : seen) EXPECT_EQ(n, 2);
  EXPECT_GT(groups.size(), prime.size() / 2);  // the second pass is grouped otherwise
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(SameRequest(plain->Next(), primed->Next()));
  for (const char* name : {"chat", "agents"}) EXPECT_TRUE(Make(Small(name))->Prime(2).empty());
}

TEST(Workloads, ZipfSkewsTowardLowRanks) {
  ZipfSampler z(100, 1.0);
  double total = 0;
  for (int r = 0; r < 100; ++r) total += z.Probability(r);
  EXPECT_NEAR(total, 1.0, 1e-9);
  EXPECT_NEAR(z.Probability(0) / z.Probability(1), 2.0, 1e-9);  // 1/1 vs 1/2
  Rng rng(3);
  std::vector<int> counts(100);
  const int n = 200000;
  for (int i = 0; i < n; ++i) ++counts[z.Sample(rng)];
  for (int r : {0, 1, 9, 49}) {
    EXPECT_NEAR(static_cast<double>(counts[r]) / n, z.Probability(r), 0.01) << "rank " << r;
  }
  int top10 = 0, bottom50 = 0;
  for (int r = 0; r < 10; ++r) top10 += counts[r];
  for (int r = 50; r < 100; ++r) bottom50 += counts[r];
  EXPECT_GT(top10, bottom50);
  EXPECT_GT(counts[0], counts[10]);
  // Exponent 0 is uniform.
  ZipfSampler flat(10, 0.0);
  EXPECT_NEAR(flat.Probability(0), 0.1, 1e-12);
  EXPECT_NEAR(flat.Probability(9), 0.1, 1e-12);
}

TEST(Workloads, RagDocsDistinctPlusQuestion) {
  WorkloadConfig c = Small("rag");
  auto w = Make(c);
  std::vector<int> popularity(c.pool);
  std::set<std::vector<int32_t>> questions;
  for (int i = 0; i < 300; ++i) {
    const RequestSpec r = w->Next();
    EXPECT_EQ(r.index, i);
    ASSERT_EQ(r.segments.size(), static_cast<size_t>(c.docs_per_request + 1));
    std::set<int> docs;
    for (int k = 0; k < c.docs_per_request; ++k) {
      const SegmentSpec& s = r.segments[k];
      EXPECT_EQ(s.kind, SegmentSpec::Kind::kDocument);
      EXPECT_TRUE(s.cacheable);
      EXPECT_EQ(s.tokens, c.doc_tokens);
      EXPECT_EQ(s.ids.size(), static_cast<size_t>(c.doc_tokens));
      ASSERT_GE(s.source, 0);
      ASSERT_LT(s.source, c.pool);
      docs.insert(s.source);
      ++popularity[s.source];
    }
    EXPECT_EQ(docs.size(), static_cast<size_t>(c.docs_per_request));
    const SegmentSpec& q = r.segments.back();
    EXPECT_EQ(q.kind, SegmentSpec::Kind::kQuestion);
    EXPECT_FALSE(q.cacheable);
    EXPECT_EQ(q.ids.size(), static_cast<size_t>(c.question_tokens));
    questions.insert(q.ids);
    EXPECT_EQ(r.prompt_tokens(), c.docs_per_request * c.doc_tokens + c.question_tokens);
  }
  EXPECT_EQ(questions.size(), 300u);  // fresh every request
  EXPECT_GT(popularity[0], popularity[c.pool - 1]);
}

TEST(Workloads, SameDocumentSameContent) {
  auto w = Make(Small("rag"));
  std::vector<std::vector<int32_t>> content(20);
  for (int i = 0; i < 200; ++i) {
    for (const SegmentSpec& s : w->Next().segments) {
      if (s.source < 0) continue;
      if (content[s.source].empty()) content[s.source] = s.ids;
      EXPECT_EQ(content[s.source], s.ids);
    }
  }
}

TEST(Workloads, RandomDocumentOrder) {
  WorkloadConfig c = Small("rag");
  c.zipf = 0;
  auto w = Make(c);
  int ascending = 0;
  for (int i = 0; i < 200; ++i) {
    const RequestSpec r = w->Next();
    if (r.segments[0].source < r.segments[1].source &&
        r.segments[1].source < r.segments[2].source) {
      ++ascending;
    }
  }
  EXPECT_LT(ascending, 100);  // 1/6 expected if the order is random
}

TEST(Workloads, TokenIdsWithinRange) {
  for (const char* name : {"rag", "chat", "agents"}) {
    WorkloadConfig c = Small(name);
    c.min_id = 500;
    c.max_id = 510;
    auto w = Make(c);
    std::set<int32_t> seen;
    for (int i = 0; i < 30; ++i) {
      for (const SegmentSpec& s : w->Next().segments) {
        EXPECT_FALSE(s.is_text);
        for (int32_t id : s.ids) {
          ASSERT_GE(id, 500) << name;
          ASSERT_LT(id, 510) << name;
          seen.insert(id);
        }
      }
    }
    EXPECT_EQ(seen.size(), 10u) << name << ": every id of the range appears";
  }
}

TEST(Workloads, ChatResendsHistoryAsGrowingPrefix) {
  WorkloadConfig c = Small("chat");
  auto w = Make(c);
  std::vector<RequestSpec> last(c.sessions);
  std::vector<int> turns(c.sessions, 0);
  for (int i = 0; i < 30; ++i) {
    const RequestSpec r = w->Next();
    ASSERT_EQ(r.group, i % c.sessions);  // round robin
    const int g = r.group;
    // system + 2 per earlier turn + the new user message
    ASSERT_EQ(r.segments.size(), static_cast<size_t>(2 + 2 * turns[g]));
    EXPECT_EQ(r.segments.front().kind, SegmentSpec::Kind::kSystem);
    EXPECT_EQ(r.segments.back().kind, SegmentSpec::Kind::kUser);
    for (size_t k = 1; k + 1 < r.segments.size(); ++k) {
      EXPECT_EQ(r.segments[k].kind,
                k % 2 == 1 ? SegmentSpec::Kind::kUser : SegmentSpec::Kind::kAssistant);
    }
    if (turns[g] > 0) {
      // The previous request of this session (all of it, its new message included) is a prefix
      // of this one, followed by the assistant's reply to it.
      const RequestSpec& prev = last[g];
      for (size_t k = 0; k < prev.segments.size(); ++k) {
        EXPECT_TRUE(SameSegment(prev.segments[k], r.segments[k])) << "segment " << k;
      }
      EXPECT_EQ(r.segments[prev.segments.size()].kind, SegmentSpec::Kind::kAssistant);
      EXPECT_EQ(r.segments[prev.segments.size()].tokens, c.reply_tokens);
    }
    // One system prompt for every session.
    if (i > 0) {
      const RequestSpec& before = last[(g + c.sessions - 1) % c.sessions];
      EXPECT_TRUE(SameSegment(r.segments[0], before.segments[0]));
    }
    last[g] = r;
    ++turns[g];
  }
}

TEST(Workloads, ChatHistoryCapDropsOldestTurns) {
  WorkloadConfig c = Small("chat");
  c.sessions = 1;
  c.max_history_tokens = 50;  // a turn pair is 10 + 6 = 16 tokens: at most 3 pairs kept
  auto w = Make(c);
  RequestSpec prev;
  for (int i = 0; i < 10; ++i) {
    const RequestSpec r = w->Next();
    int history = 0;
    for (size_t k = 1; k + 1 < r.segments.size(); ++k) history += r.segments[k].tokens;
    EXPECT_LE(history, c.max_history_tokens);
    EXPECT_EQ(r.segments[0].kind, SegmentSpec::Kind::kSystem);  // kept
    EXPECT_EQ(r.segments.size(), static_cast<size_t>(2 + 2 * std::min(i, 3)));
    if (i >= 4) {
      // The oldest pair went: the previous request's history minus its first pair, then the
      // previous user message, is this request's history start.
      EXPECT_TRUE(SameSegment(r.segments[1], prev.segments[3]));
      EXPECT_TRUE(SameSegment(r.segments[r.segments.size() - 3], prev.segments.back()));
    }
    prev = r;
  }
}

TEST(Workloads, AgentsShareContext) {
  WorkloadConfig c = Small("agents");
  auto w = Make(c);
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < 9; ++i) reqs.push_back(w->Next());
  for (const RequestSpec& r : reqs) {
    ASSERT_GE(r.segments.size(), 3u);
    EXPECT_EQ(r.segments[0].kind, SegmentSpec::Kind::kInstructions);
    EXPECT_EQ(r.segments[0].tokens, c.instr_tokens);
    EXPECT_EQ(r.segments[1].kind, SegmentSpec::Kind::kShared);
    EXPECT_EQ(r.segments[1].tokens, c.shared_tokens);
    EXPECT_TRUE(SameSegment(r.segments[1], reqs[0].segments[1]));  // one shared context
    EXPECT_EQ(r.segments.back().kind, SegmentSpec::Kind::kUser);
  }
  EXPECT_FALSE(SameSegment(reqs[0].segments[0], reqs[1].segments[0]));  // own instructions
  EXPECT_TRUE(SameSegment(reqs[0].segments[0], reqs[3].segments[0]));   // agent 0 again
  EXPECT_EQ(reqs[3].segments.size(), reqs[0].segments.size() + 2);      // its history grew

  c.shared_first = true;
  auto s = Make(c);
  const RequestSpec r = s->Next();
  EXPECT_EQ(r.segments[0].kind, SegmentSpec::Kind::kShared);
  EXPECT_EQ(r.segments[1].kind, SegmentSpec::Kind::kInstructions);
}

TEST(Workloads, RandomOrderVisitsEveryGroup) {
  WorkloadConfig c = Small("chat");
  c.random_order = true;
  auto w = Make(c);
  std::set<int> groups;
  bool not_rr = false;
  for (int i = 0; i < 60; ++i) {
    const RequestSpec r = w->Next();
    groups.insert(r.group);
    not_rr = not_rr || r.group != i % c.sessions;
  }
  EXPECT_EQ(groups.size(), static_cast<size_t>(c.sessions));
  EXPECT_TRUE(not_rr);
}

TEST(Workloads, TextContent) {
  const std::string path = ::testing::TempDir() + "/loadgen_docs.txt";
  {
    std::ofstream f(path);
    for (int p = 0; p < 12; ++p) {
      f << "Once upon a time paragraph " << p << " had a cat.\nThe cat was happy " << p << ".\n\n";
    }
  }
  const std::vector<std::string> docs = LoadTextDocs(path, 80, 0);
  ASSERT_GE(docs.size(), 4u);
  for (const std::string& d : docs) EXPECT_GE(d.size(), 80u);
  EXPECT_EQ(LoadTextDocs(path, 80, 2).size(), 2u);
  WorkloadConfig c = Small("rag");
  c.content = Content::kText;
  c.pool = 3;
  auto w = Make(c, docs);
  const RequestSpec r = w->Next();
  ASSERT_EQ(r.segments.size(), 4u);
  for (const SegmentSpec& s : r.segments) {
    EXPECT_TRUE(s.is_text);
    EXPECT_TRUE(s.ids.empty());
    EXPECT_FALSE(s.text.empty());
    EXPECT_LT(s.source, 3);
  }
  EXPECT_EQ(r.segments.back().text.rfind("Question: ", 0), 0u);
  EXPECT_EQ(r.segments.back().tokens, c.question_tokens + 2);  // words + "Question:" "Answer:"
  for (const char* name : {"chat", "agents"}) {
    WorkloadConfig cc = Small(name);
    cc.content = Content::kText;
    auto cw = Make(cc, docs);
    for (int i = 0; i < 5; ++i) {
      for (const SegmentSpec& s : cw->Next().segments) EXPECT_TRUE(s.is_text) << name;
    }
  }
  std::remove(path.c_str());
}

TEST(Workloads, InvalidConfigs) {
  WorkloadConfig c = Small("rag");
  c.docs_per_request = 21;  // > pool
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
  c = Small("nope");
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
  c = Small("chat");
  c.sessions = 0;
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
  c = Small("rag");
  c.content = Content::kText;
  EXPECT_FALSE(MakeWorkload(c, {}).ok());  // no documents
  c = Small("rag");
  c.max_id = c.min_id;
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
}

TEST(Arrivals, PoissonMeanGap) {
  for (double rate : {0.5, 4.0, 100.0}) {
    PoissonArrivals a(rate, 11);
    const int n = 100000;
    double sum = 0, sum_sq = 0;
    for (int i = 0; i < n; ++i) {
      const double g = a.NextGapS();
      ASSERT_GE(g, 0.0);
      sum += g;
      sum_sq += g * g;
    }
    const double mean = sum / n, var = sum_sq / n - mean * mean;
    EXPECT_NEAR(mean, 1.0 / rate, 0.03 / rate) << rate;
    EXPECT_NEAR(std::sqrt(var), 1.0 / rate, 0.05 / rate) << rate;  // exponential: sd = mean
  }
  PoissonArrivals a(2, 5), b(2, 5);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.NextGapS(), b.NextGapS());
}

TEST(Stats, Percentile) {
  EXPECT_TRUE(std::isnan(Percentile({}, 50)));
  EXPECT_EQ(Percentile({5}, 0), 5);
  EXPECT_EQ(Percentile({5}, 99), 5);
  const std::vector<double> v = {4, 1, 3, 2, 5};  // unsorted on purpose
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 3);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 5);
  EXPECT_DOUBLE_EQ(Percentile(v, 25), 2);
  EXPECT_DOUBLE_EQ(Percentile(v, 90), 4.6);  // numpy.percentile([1..5], 90)
  EXPECT_DOUBLE_EQ(Percentile({1, 2}, 50), 1.5);
  std::vector<double> h;
  for (int i = 1; i <= 100; ++i) h.push_back(i);
  EXPECT_DOUBLE_EQ(Percentile(h, 99), 99.01);  // numpy: 99.01
  const std::vector<double> ps = Percentiles(h, {50, 90, 99});
  EXPECT_DOUBLE_EQ(ps[0], 50.5);
  EXPECT_DOUBLE_EQ(ps[1], 90.1);
  EXPECT_DOUBLE_EQ(ps[2], 99.01);
  EXPECT_DOUBLE_EQ(Mean(v), 3);
  EXPECT_TRUE(std::isnan(Mean({})));
}

TEST(Stats, Json) {
  EXPECT_EQ(JsonNumber(3), "3");
  EXPECT_EQ(JsonNumber(2.5), "2.5");
  EXPECT_EQ(JsonNumber(std::nan("")), "null");
  EXPECT_EQ(JsonNumber(INFINITY), "null");
  EXPECT_EQ(JsonString("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\n\\u0001\"");
}


// ---- Mooncake traces -------------------------------------------------------------------------

namespace trace_test {

absl::StatusOr<std::vector<TraceEntry>> Parse(const std::string& text, int block = 4) {
  std::istringstream in(text);
  return ParseMooncakeTrace(in, "t.jsonl", block);
}

// Three requests in blocks of 4 tokens: B shares A's first block, C shares A's two blocks.
const char* kTrace =
    "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0, 1, 2]}\n"
    "\n"
    "{\"timestamp\": 3000, \"input_length\": 6, \"output_length\": 7, \"hash_ids\": [0, 3]}\n"
    "{\"timestamp\": 1000.5, \"input_length\": 8, \"output_length\": 0, \"hash_ids\": [0, 1]}\n";

}  // namespace trace_test

TEST(Trace, ParsesAndOrdersByTimestamp) {
  auto t = trace_test::Parse(trace_test::kTrace);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 3u);
  EXPECT_EQ((*t)[0].line, 1);
  EXPECT_EQ((*t)[1].line, 4);  // 1000.5 ms comes before 3000 ms
  EXPECT_EQ((*t)[2].line, 3);
  EXPECT_DOUBLE_EQ((*t)[1].timestamp_ms, 1000.5);
  EXPECT_EQ((*t)[0].input_length, 10);
  EXPECT_EQ((*t)[0].output_length, 5);
  EXPECT_EQ((*t)[0].hash_ids, (std::vector<int64_t>{0, 1, 2}));
}

TEST(Trace, BadLinesNameTheLine) {
  const std::string ok = "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [7]}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{not json\n", "t.jsonl:2: not valid JSON"},
      {"[1, 2]\n", "t.jsonl:2: not a JSON object"},
      {"{\"timestamp\": 0, \"input_length\": 4, \"hash_ids\": [7]}\n", "missing 'output_length'"},
      {"{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [7], "
       "\"session_id\": 3}\n",
       "t.jsonl:2: unsupported key 'session_id'"},
      {"{\"timestamp\": -1, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [7]}\n",
       "'timestamp' must be a number >= 0"},
      {"{\"timestamp\": 0, \"input_length\": 4.5, \"output_length\": 1, \"hash_ids\": [7]}\n",
       "'input_length' must be an integer >= 1"},
      {"{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}\n",
       "'input_length' must be an integer >= 1"},
      {"{\"timestamp\": 0, \"input_length\": 4, \"output_length\": \"3\", \"hash_ids\": [7]}\n",
       "'output_length' must be an integer >= 0"},
      {"{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [-7]}\n",
       "hash_ids[0] must be an integer >= 0"},
      {"{\"timestamp\": 0, \"input_length\": 9, \"output_length\": 1, \"hash_ids\": [1, 2]}\n",
       "t.jsonl:2: 2 hash_ids for input_length 9: blocks of 4 tokens need 3"},
  };
  for (const auto& [line, want] : cases) {
    auto t = trace_test::Parse(ok + line);
    ASSERT_FALSE(t.ok()) << line;
    EXPECT_NE(std::string(t.status().message()).find(want), std::string::npos)
        << t.status() << " for " << line;
  }
  EXPECT_FALSE(trace_test::Parse("\n\n").ok());  // no request
}

TEST(Trace, LoadsTheRecordedTraceWhenPresent) {
  // The shared Mooncake trace (not in the repository); skipped where it is absent.
  std::string dir = std::getenv("SPARSEX_TRACES") != nullptr ? std::getenv("SPARSEX_TRACES")
                                                             : "../shared/traces";
  const std::string path = dir + "/mooncake_conversation_trace.jsonl";
  if (!std::ifstream(path).good()) GTEST_SKIP() << path << " not found";
  auto t = LoadMooncakeTrace(path, 512);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 12031u);
}

WorkloadConfig TraceConfig(const std::vector<TraceEntry>* t) {
  WorkloadConfig c;
  c.workload = "trace";
  c.trace = t;
  c.trace_block_tokens = 4;
  c.min_id = 3;
  c.max_id = 500;
  return c;
}

TEST(Trace, EqualHashIdsGiveEqualBlocks) {
  auto t = trace_test::Parse(trace_test::kTrace);
  ASSERT_TRUE(t.ok());
  WorkloadConfig c = TraceConfig(&*t);
  auto w = Make(c);
  std::vector<RequestSpec> rs;
  while (w->HasNext()) rs.push_back(w->Next());
  ASSERT_EQ(rs.size(), 3u);
  // Request 0: blocks 0, 1, 2 with the last cut to 10 - 8 = 2 tokens.
  ASSERT_EQ(rs[0].segments.size(), 3u);
  EXPECT_EQ(rs[0].segments[0].tokens, 4);
  EXPECT_EQ(rs[0].segments[2].tokens, 2);
  EXPECT_EQ(rs[0].prompt_tokens(), 10);
  EXPECT_EQ(rs[0].max_tokens, 5);
  EXPECT_EQ(rs[1].max_tokens, 1);  // output_length 0: the API's minimum
  EXPECT_EQ(rs[2].max_tokens, 7);
  // Shared ids: same tokens; another id: other tokens.
  EXPECT_EQ(rs[0].segments[0].ids, rs[1].segments[0].ids);
  EXPECT_EQ(rs[0].segments[1].ids, rs[1].segments[1].ids);
  EXPECT_EQ(rs[0].segments[0].ids, rs[2].segments[0].ids);
  EXPECT_NE(rs[2].segments[1].ids, rs[0].segments[1].ids);
  EXPECT_EQ(rs[0].segments[1].source, 1);
  // The cut block is the full block's prefix.
  const std::vector<int32_t> full = TraceBlock(c.seed, 2, 4, 3, 500);
  EXPECT_EQ(rs[0].segments[2].ids, std::vector<int32_t>(full.begin(), full.begin() + 2));
  for (const RequestSpec& r : rs) {
    for (const SegmentSpec& s : r.segments) {
      for (int32_t id : s.ids) {
        EXPECT_GE(id, 3);
        EXPECT_LT(id, 500);
      }
    }
  }
  // Lines and arrival times (ms -> s).
  EXPECT_EQ(rs[1].line, 4);
  EXPECT_DOUBLE_EQ(rs[1].arrival_s, 1.0005);
  EXPECT_DOUBLE_EQ(rs[2].arrival_s, 3.0);
  // Another seed, other tokens.
  c.seed = 99;
  EXPECT_NE(Make(c)->Next().segments[0].ids, rs[0].segments[0].ids);
}

TEST(Trace, WindowTimeScaleAndCaps) {
  auto t = trace_test::Parse(trace_test::kTrace);
  ASSERT_TRUE(t.ok());
  WorkloadConfig c = TraceConfig(&*t);
  c.trace_start_s = 1;
  c.trace_duration_s = 2.5;  // [1 s, 3.5 s): the requests at 1.0005 s and 3 s
  c.time_scale = 0.5;
  c.max_output_tokens = 6;
  auto w = Make(c);
  RequestSpec a = w->Next(), b = w->Next();
  EXPECT_FALSE(w->HasNext());
  EXPECT_EQ(a.line, 4);
  EXPECT_EQ(b.line, 3);
  EXPECT_NEAR(a.arrival_s, 0.00025, 1e-12);  // (1.0005 - 1) * 0.5
  EXPECT_NEAR(b.arrival_s, 1.0, 1e-12);      // (3 - 1) * 0.5
  EXPECT_EQ(b.max_tokens, 6);                // 7 capped

  c.trace_start_s = 10;  // empty window
  EXPECT_FALSE(MakeWorkload(c, {}).ok());

  // Token scale 1/2: blocks of 2 tokens, request 0 = 2 + 2 + 1 tokens, its blocks the scaled
  // blocks of the same ids; max_input_tokens cuts the prompt.
  c = TraceConfig(&*t);
  c.trace_token_scale = 0.5;
  RequestSpec s = Make(c)->Next();
  ASSERT_EQ(s.segments.size(), 3u);
  EXPECT_EQ(s.prompt_tokens(), 5);
  EXPECT_EQ(s.segments[0].ids, TraceBlock(c.seed, 0, 2, 3, 500));
  c.max_input_tokens = 3;
  s = Make(c)->Next();
  EXPECT_EQ(s.prompt_tokens(), 3);
  ASSERT_EQ(s.segments.size(), 2u);
  EXPECT_EQ(s.segments[1].tokens, 1);
  c.trace_segments = false;
  EXPECT_TRUE(Make(c)->Next().one_prompt);

  c = TraceConfig(&*t);
  c.time_scale = 0;
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
  c = TraceConfig(nullptr);
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
}

// ---- longdocqa and multiround ------------------------------------------------------------------

WorkloadConfig LongDoc(const std::string& mode) {
  WorkloadConfig c;
  c.workload = "longdocqa";
  c.documents = 4;
  c.document_tokens = 30;
  c.repeat = 3;
  c.repeat_mode = mode;
  c.question_tokens = 5;
  return c;
}

TEST(LongDocQa, RepeatModes) {
  auto docs_of = [](const std::string& mode, int n) {
    auto w = Make(LongDoc(mode));
    std::vector<int> out;
    for (int i = 0; i < n; ++i) {
      RequestSpec r = w->Next();
      EXPECT_EQ(r.index, i);
      EXPECT_EQ(r.segments.size(), 2u);
      EXPECT_EQ(r.segments[0].tokens, 30);
      EXPECT_FALSE(r.segments[1].cacheable);
      out.push_back(r.segments[0].source);
    }
    return out;
  };
  EXPECT_EQ(docs_of("tile", 12), (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(docs_of("interleave", 12), (std::vector<int>{0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3}));
  // random: each round holds every document `repeat` times, and two rounds differ.
  const std::vector<int> r = docs_of("random", 24);
  std::vector<int> round1(r.begin(), r.begin() + 12), round2(r.begin() + 12, r.end());
  EXPECT_NE(round1, round2);
  for (auto round : {round1, round2}) {
    for (int d = 0; d < 4; ++d) EXPECT_EQ(std::count(round.begin(), round.end(), d), 3);
  }
  EXPECT_NE(round1, docs_of("tile", 12));
}

TEST(LongDocQa, SameDocumentSameTokensAndPrime) {
  auto w = Make(LongDoc("random"));
  std::map<int, std::vector<int32_t>> seen;
  std::set<std::vector<int32_t>> questions;
  for (int i = 0; i < 24; ++i) {
    RequestSpec r = w->Next();
    auto [it, fresh] = seen.emplace(r.segments[0].source, r.segments[0].ids);
    if (!fresh) {
      EXPECT_EQ(it->second, r.segments[0].ids);
    }
    questions.insert(r.segments[1].ids);
  }
  EXPECT_EQ(seen.size(), 4u);
  EXPECT_NE(seen[0], seen[1]);
  EXPECT_EQ(questions.size(), 24u);  // a fresh question each time
  // LMCache's warm-up round: every document once, in order, outside the sequence.
  const std::vector<RequestSpec> prime = Make(LongDoc("random"))->Prime(1);
  ASSERT_EQ(prime.size(), 4u);
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(prime[static_cast<size_t>(d)].segments[0].ids, seen[d]);
    EXPECT_LT(prime[static_cast<size_t>(d)].index, 0);
  }
  WorkloadConfig c = LongDoc("random");
  c.question_tokens = 0;  // as LMCache: the document alone
  EXPECT_EQ(Make(c)->Next().segments.size(), 1u);
  c.repeat_mode = "sorted";
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
  // --hit_miss 2:1: every third request starts with a fresh, uncacheable prefix before the
  // same document.
  c = LongDoc("tile");
  c.hit_miss = "2:1";
  auto hm = Make(c), plain = Make(LongDoc("tile"));
  for (int i = 0; i < 9; ++i) {
    RequestSpec a = hm->Next(), b = plain->Next();
    if (i % 3 == 2) {
      ASSERT_EQ(a.segments.size(), 3u) << i;
      EXPECT_EQ(a.segments[0].kind, SegmentSpec::Kind::kMissPrefix);
      EXPECT_FALSE(a.segments[0].cacheable);
      EXPECT_EQ(a.segments[1].ids, b.segments[0].ids);
    } else {
      ASSERT_EQ(a.segments.size(), 2u) << i;
      EXPECT_EQ(a.segments[0].ids, b.segments[0].ids);
    }
  }
  for (const char* bad : {"3", "a:1", "0:0", "-1:2"}) {
    c.hit_miss = bad;
    EXPECT_FALSE(MakeWorkload(c, {}).ok()) << bad;
  }
}

WorkloadConfig MultiRound() {
  WorkloadConfig c;
  c.workload = "multiround";
  c.users = 3;
  c.rounds = 3;
  c.shared_system_tokens = 20;
  c.user_history_tokens = 12;
  c.round_tokens = 4;
  c.answer_tokens = 6;
  c.rate = 2;
  return c;
}

TEST(MultiRound, PacedUsersWithGrowingHistory) {
  WorkloadConfig c = MultiRound();
  auto w = Make(c);
  std::vector<RequestSpec> rs;
  for (int i = 0; i < 30; ++i) rs.push_back(w->Next());
  for (const RequestSpec& r : rs) {
    EXPECT_EQ(r.group, r.index % 3);
    EXPECT_DOUBLE_EQ(r.arrival_s, static_cast<double>(r.index) / 2.0);  // index / rate
    EXPECT_EQ(r.max_tokens, 6);
    EXPECT_EQ(r.segments[0].kind, SegmentSpec::Kind::kSystem);
    EXPECT_EQ(r.segments[0].ids, rs[0].segments[0].ids);  // one system prompt for every user
    EXPECT_EQ(r.segments[1].tokens, 12);
  }
  // Slot 0's first user starts at round 0, slot 1's at round 1, slot 2's at round 2: first
  // conversations of 3, 2 and 1 rounds, so users are replaced at staggered times.
  auto rounds_of = [&](const RequestSpec& r) {
    return static_cast<int>(r.segments.size() - 3) / 2;  // earlier rounds in the history
  };
  EXPECT_EQ(rounds_of(rs[0]), 0);
  EXPECT_EQ(rounds_of(rs[3]), 1);
  EXPECT_EQ(rounds_of(rs[6]), 2);
  EXPECT_EQ(rounds_of(rs[9]), 0);  // slot 0's second user
  EXPECT_EQ(rounds_of(rs[4]), 1);  // slot 1: rounds 1, 2 then a new user
  EXPECT_EQ(rounds_of(rs[7]), 0);
  EXPECT_EQ(rounds_of(rs[2]), 0);  // slot 2: one round (round 2), then a new user
  EXPECT_EQ(rounds_of(rs[5]), 0);
  EXPECT_EQ(rounds_of(rs[8]), 1);
  EXPECT_EQ(rounds_of(rs[11]), 2);
  EXPECT_EQ(rounds_of(rs[14]), 0);
  // A round follows the user's previous one (index - users) and re-sends it as a prefix:
  // context, earlier questions and synthetic answers; a new user follows nothing.
  for (const RequestSpec& r : rs) {
    if (rounds_of(r) == 0) {
      EXPECT_EQ(r.after, -1) << r.index;
      continue;
    }
    ASSERT_EQ(r.after, r.index - 3) << r.index;
    const RequestSpec& prev = rs[static_cast<size_t>(r.after)];
    ASSERT_EQ(r.segments.size(), prev.segments.size() + 2);
    for (size_t k = 0; k < prev.segments.size(); ++k) {
      EXPECT_TRUE(SameSegment(r.segments[k], prev.segments[k])) << r.index << " segment " << k;
    }
    // Then the previous round's synthetic answer and this round's question.
    EXPECT_EQ(r.segments[prev.segments.size()].kind, SegmentSpec::Kind::kAssistant);
    EXPECT_EQ(r.segments[prev.segments.size()].tokens, 6);
    EXPECT_EQ(r.segments.back().kind, SegmentSpec::Kind::kUser);
    EXPECT_EQ(r.segments.back().tokens, 4);
  }
  // Users differ in their own context.
  EXPECT_NE(rs[0].segments[1].ids, rs[1].segments[1].ids);
  EXPECT_NE(rs[0].segments[1].ids, rs[9].segments[1].ids);
  c.rate = 0;
  EXPECT_FALSE(MakeWorkload(c, {}).ok());
}

// ---- the OpenAI chat client's pieces -------------------------------------------------------------

TEST(OpenAi, ChatMessagesPasteSegmentsByRole) {
  WorkloadConfig c = Small("rag");
  c.content = Content::kText;
  std::vector<std::string> docs;
  for (int i = 0; i < 20; ++i) docs.push_back("Document " + std::to_string(i) + " says hello.");
  RequestSpec r = Make(c, docs)->Next();
  auto msgs = ChatMessages(r);
  ASSERT_EQ(msgs.size(), 1u);  // documents and question: one user message, no marks
  EXPECT_EQ(msgs[0].first, Role::kUser);
  std::string joined;
  for (const SegmentSpec& s : r.segments) joined += s.text;
  EXPECT_EQ(msgs[0].second, joined);

  c = Small("chat");
  c.content = Content::kText;
  auto chat = Make(c, docs);
  for (int i = 0; i < 3; ++i) chat->Next();  // one turn of each session
  msgs = ChatMessages(chat->Next());           // session 0's second turn
  ASSERT_EQ(msgs.size(), 4u);
  EXPECT_EQ(msgs[0].first, Role::kSystem);
  EXPECT_EQ(msgs[1].first, Role::kUser);
  EXPECT_EQ(msgs[2].first, Role::kAssistant);
  EXPECT_EQ(msgs[3].first, Role::kUser);

  ChatOptions o;
  o.max_tokens = 9;
  o.reuse_enable = false;
  const std::string body = ChatBody(r, o);
  for (const char* want : {"\"messages\":[{\"content\":", "\"role\":\"user\"", "\"max_tokens\":9",
                           "\"stream\":true", "\"include_usage\":true", "\"ignore_eos\":true",
                           "\"reuse\":{\"enable\":false}"}) {
    EXPECT_NE(body.find(want), std::string::npos) << want << " in " << body;
  }
  EXPECT_EQ(ChatBody(r, ChatOptions()).find("reuse"), std::string::npos);
}

TEST(OpenAi, DecodesChunkedEventStreamFedByteByByte) {
  const std::string events =
      "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"
      "data: {\"choices\":[{\"delta\":{\"content\":\"Once\"}}]}\r\n\r\n"
      ": a comment\n"
      "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}\n\n"
      "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":4,"
      "\"prompt_tokens_details\":{\"cached_tokens\":70},\"sparsex\":{\"prefix_tokens\":10,"
      "\"reused_tokens\":60,\"new_tokens\":30,\"worker\":\"w0\"}}}\n\n"
      "data: [DONE]\n\n";
  // Chunked in pieces of 7 bytes, with a chunk extension and a trailer.
  std::string wire = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n";
  for (size_t i = 0; i < events.size(); i += 7) {
    const std::string piece = events.substr(i, 7);
    char size[16];
    std::snprintf(size, sizeof size, "%zx", piece.size());
    wire += std::string(size) + (i == 0 ? ";ext=1" : "") + "\r\n" + piece + "\r\n";
  }
  wire += "0\r\nX-Trailer: 1\r\n\r\n";
  std::string body;
  HttpResponseDecoder dec([&](absl::string_view b) { body.append(b.data(), b.size()); });
  for (char ch : wire) ASSERT_TRUE(dec.Feed(std::string(1, ch)).ok());
  EXPECT_TRUE(dec.done());
  EXPECT_EQ(dec.status(), 200);
  EXPECT_EQ(dec.headers().at("content-type"), "text/event-stream");
  EXPECT_EQ(body, events);

  SseDecoder sse;
  std::vector<std::string> data;
  for (char ch : body) {
    for (std::string& d : sse.Feed(std::string(1, ch))) data.push_back(std::move(d));
  }
  ASSERT_EQ(data.size(), 5u);
  auto c0 = ParseChatChunk(data[0]);
  ASSERT_TRUE(c0.ok());
  EXPECT_EQ(c0->content, "");
  auto c1 = ParseChatChunk(data[1]);
  EXPECT_EQ(c1->content, "Once");
  EXPECT_EQ(ParseChatChunk(data[2])->finish_reason, "length");
  auto u = ParseChatChunk(data[3]);
  ASSERT_TRUE(u.ok());
  ASSERT_TRUE(u->has_usage);
  EXPECT_EQ(u->usage.at("prompt_tokens"), 100);
  EXPECT_EQ(u->usage.at("completion_tokens"), 4);
  EXPECT_EQ(u->usage.at("reused_tokens"), 60);
  EXPECT_EQ(u->usage.at("prefix_tokens"), 10);
  EXPECT_EQ(u->usage.at("cached_tokens"), 70);
  EXPECT_EQ(u->worker, "w0");
  EXPECT_TRUE(ParseChatChunk(data[4])->done);
  EXPECT_EQ(ParseChatChunk("{\"error\":{\"message\":\"worker failed\"}}")->error, "worker failed");
  EXPECT_FALSE(ParseChatChunk("{oops").ok());
}

TEST(OpenAi, HttpErrorsAndBodies) {
  std::string body;
  HttpResponseDecoder dec([&](absl::string_view b) { body.append(b.data(), b.size()); });
  const std::string err = "{\"error\":{\"message\":\"too long\",\"type\":\"invalid_request_error\"}}";
  ASSERT_TRUE(dec.Feed("HTTP/1.1 400 Bad Request\r\nContent-Length: " +
                       std::to_string(err.size()) + "\r\n\r\n" + err + "extra")
                  .ok());
  EXPECT_TRUE(dec.done());
  EXPECT_EQ(dec.status(), 400);
  EXPECT_EQ(body, err);  // bytes past Content-Length are not body
  EXPECT_EQ(HttpErrorMessage(body), "too long");

  HttpResponseDecoder cut([](absl::string_view) {});
  ASSERT_TRUE(cut.Feed("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab").ok());
  EXPECT_FALSE(cut.Finish().ok());  // closed mid-chunk
  HttpResponseDecoder bad([](absl::string_view) {});
  EXPECT_FALSE(bad.Feed("SPDY/3 200 OK\r\n\r\n").ok());
  HttpResponseDecoder badchunk([](absl::string_view) {});
  EXPECT_FALSE(badchunk.Feed("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").ok());
  HttpResponseDecoder gzip([](absl::string_view) {});
  EXPECT_FALSE(gzip.Feed("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n").ok());
}

// ---- goodput ---------------------------------------------------------------------------------------

TEST(Stats, GoodputIsTheHighestPointMeetingTheSlo) {
  const double nan = std::nan("");
  std::vector<SloPoint> pts = {
      {1, 300, 20, 300, 0},     // ok
      {2, 900, 45, 300, 0},     // ok
      {4, 2500, 30, 300, 0},    // TTFT p99 over 2 s
      {3, 1000, 60, 300, 0},    // TPOT p99 over 50 ms
      {8, 100, 10, 299, 1},     // a failed request
  };
  EXPECT_DOUBLE_EQ(GoodputX(pts, 2000, 50), 2);
  EXPECT_DOUBLE_EQ(GoodputX(pts, 3000, 50), 4);   // thresholds are flags
  EXPECT_DOUBLE_EQ(GoodputX(pts, 2000, 100), 3);
  EXPECT_TRUE(std::isnan(GoodputX({{1, 5000, 10, 10, 0}}, 2000, 50)));
  EXPECT_TRUE(MeetsSlo({1, 100, nan, 10, 0}, 2000, 50));  // no TPOT sample (max_tokens 1)
  EXPECT_FALSE(MeetsSlo({1, nan, nan, 0, 0}, 2000, 50));  // nothing completed
}

}  // namespace
}  // namespace sparsex::loadgen
