// sparsex-loadgen's workload generation and statistics (bench/loadgen/workloads.h, stats.h).
#include "bench/loadgen/workloads.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace sparsex::loadgen
