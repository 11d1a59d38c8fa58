#include "bench/loadgen/workloads.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace sparsex::loadgen {

double UniformDouble(Rng& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

int64_t UniformInt(Rng& rng, int64_t lo, int64_t hi) {
  const uint64_t span = static_cast<uint64_t>(hi - lo);
  // Rejection keeps it exactly uniform; spans here are tiny next to 2^64, so it rarely loops.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % span;
  uint64_t x;
  do x = rng();
  while (x >= limit);
  return lo + static_cast<int64_t>(x % span);
}

ZipfSampler::ZipfSampler(int n, double s) : cdf_(static_cast<size_t>(std::max(n, 1))) {
  double sum = 0;
  for (size_t i = 0; i < cdf_.size(); ++i) {
    sum += 1.0 / std::pow(static_cast<double>(i + 1), s);
    cdf_[i] = sum;
  }
  for (double& c : cdf_) c /= sum;
  cdf_.back() = 1.0;
}

int ZipfSampler::Sample(Rng& rng) const {
  const double u = UniformDouble(rng);
  return static_cast<int>(std::upper_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
}

double ZipfSampler::Probability(int rank) const {
  return rank == 0 ? cdf_[0] : cdf_[rank] - cdf_[rank - 1];
}

PoissonArrivals::PoissonArrivals(double rate, uint64_t seed)
    : rate_(rate), rng_(seed ^ 0x5DEECE66DA3B1F27ull) {}

double PoissonArrivals::NextGapS() { return -std::log(1.0 - UniformDouble(rng_)) / rate_; }

int RequestSpec::prompt_tokens() const {
  int n = 0;
  for (const SegmentSpec& s : segments) n += s.tokens;
  return n;
}

const char* KindName(SegmentSpec::Kind kind) {
  switch (kind) {
    case SegmentSpec::Kind::kSystem:
      return "system";
    case SegmentSpec::Kind::kDocument:
      return "document";
    case SegmentSpec::Kind::kQuestion:
      return "question";
    case SegmentSpec::Kind::kShared:
      return "shared";
    case SegmentSpec::Kind::kInstructions:
      return "instructions";
    case SegmentSpec::Kind::kUser:
      return "user";
    case SegmentSpec::Kind::kAssistant:
      return "assistant";
  }
  return "?";
}

std::vector<std::string> LoadTextDocs(const std::string& path, size_t doc_chars, size_t max_docs) {
  std::ifstream in(path);
  std::vector<std::string> docs;
  std::string line, para, cur;
  auto full = [&] { return max_docs > 0 && docs.size() >= max_docs; };
  auto flush_para = [&] {
    if (para.empty()) return;
    cur += (cur.empty() ? "" : "\n") + para;
    para.clear();
    if (cur.size() >= doc_chars) {
      docs.push_back(std::move(cur));
      cur.clear();
    }
  };
  while (!full() && std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty())
      flush_para();
    else
      para += (para.empty() ? "" : " ") + line;
  }
  if (!full()) {
    flush_para();
    if (!cur.empty() && !full()) docs.push_back(std::move(cur));
  }
  return docs;
}

namespace {

int CountWords(const std::string& s) {
  int n = 0;
  bool in_word = false;
  for (char c : s) {
    const bool space = c == ' ' || c == '\n' || c == '\t' || c == '\r';
    if (!space && !in_word) ++n;
    in_word = !space;
  }
  return n;
}

// Makes segment content: random ids (numbers) or random corpus words (text).
class ContentSource {
 public:
  ContentSource(const WorkloadConfig& c, const std::vector<std::string>& docs) : c_(c) {
    if (c.content != Content::kText) return;
    std::unordered_set<std::string> seen;
    for (const std::string& d : docs) {
      std::istringstream in(d);
      std::string w;
      while (in >> w) {
        if (seen.insert(w).second) words_.push_back(w);
      }
    }
  }
  bool text() const { return c_.content == Content::kText; }
  bool has_words() const { return !words_.empty(); }

  // A segment of n tokens (numbers) or n words after `label` (text).
  SegmentSpec Make(SegmentSpec::Kind kind, int n, const std::string& label,
                   const std::string& suffix, Rng& rng) const {
    SegmentSpec s;
    s.kind = kind;
    if (!text()) {
      s.ids.resize(static_cast<size_t>(std::max(n, 0)));
      for (int32_t& id : s.ids) id = static_cast<int32_t>(UniformInt(rng, c_.min_id, c_.max_id));
      s.tokens = static_cast<int>(s.ids.size());
      return s;
    }
    s.is_text = true;
    s.text = label;
    for (int i = 0; i < n && !words_.empty(); ++i) {
      if (i > 0) s.text += ' ';
      s.text +=
          words_[static_cast<size_t>(UniformInt(rng, 0, static_cast<int64_t>(words_.size())))];
    }
    s.text += suffix;
    s.tokens = CountWords(s.text);
    return s;
  }
  SegmentSpec FromText(SegmentSpec::Kind kind, std::string text) const {
    SegmentSpec s;
    s.kind = kind;
    s.is_text = true;
    s.tokens = CountWords(text);
    s.text = std::move(text);
    return s;
  }

 private:
  const WorkloadConfig& c_;
  std::vector<std::string> words_;
};

class RagWorkload : public Workload {
 public:
  RagWorkload(const WorkloadConfig& c, const std::vector<std::string>& text_docs, int pool)
      : c_(c), content_(c_, text_docs), zipf_(pool, c.zipf), rng_(c.seed) {
    docs_.reserve(static_cast<size_t>(pool));
    Rng pool_rng(c.pool_seed != 0 ? c.pool_seed : c.seed);
    Rng& doc_rng = c.pool_seed != 0 ? pool_rng : rng_;
    for (int d = 0; d < pool; ++d) {
      SegmentSpec s = content_.text()
                          ? content_.FromText(SegmentSpec::Kind::kDocument, text_docs[d] + "\n")
                          : content_.Make(SegmentSpec::Kind::kDocument, c.doc_tokens, "", "", doc_rng);
      s.source = d;
      docs_.push_back(std::move(s));
    }
  }
  std::vector<RequestSpec> Prime(int passes) override {
    std::vector<RequestSpec> out;
    const int n = static_cast<int>(docs_.size()), k = c_.docs_per_request;
    Rng rng(c_.seed ^ 0x9e3779b97f4a7c15ULL);  // its own stream: Next() is unchanged
    for (int p = 0; p < passes; ++p) {
      std::vector<int> order(static_cast<size_t>(n));
      for (int d = 0; d < n; ++d) order[static_cast<size_t>(d)] = d;
      Shuffle(order, rng);
      for (int i = 0; i < n; i += k) {
        RequestSpec r;
        r.index = -1 - static_cast<int64_t>(out.size());  // outside the measured sequence
        for (int j = i; j < std::min(n, i + k); ++j) {
          r.segments.push_back(docs_[static_cast<size_t>(order[static_cast<size_t>(j)])]);
        }
        SegmentSpec q = content_.Make(SegmentSpec::Kind::kQuestion, c_.question_tokens,
                                      "Question: ", "?\nAnswer:", rng);
        q.cacheable = false;
        r.segments.push_back(std::move(q));
        out.push_back(std::move(r));
      }
    }
    return out;
  }
  RequestSpec Next() override {
    RequestSpec r;
    r.index = next_index_++;
    std::vector<int> chosen;
    while (static_cast<int>(chosen.size()) < c_.docs_per_request) {
      const int d = zipf_.Sample(rng_);
      if (std::find(chosen.begin(), chosen.end(), d) == chosen.end()) chosen.push_back(d);
    }
    Shuffle(chosen, rng_);
    for (int d : chosen) r.segments.push_back(docs_[static_cast<size_t>(d)]);
    SegmentSpec q = content_.Make(SegmentSpec::Kind::kQuestion, c_.question_tokens,
                                  "Question: ", "?\nAnswer:", rng_);
    q.cacheable = false;  // fresh every request
    r.segments.push_back(std::move(q));
    return r;
  }

 private:
  WorkloadConfig c_;
  ContentSource content_;
  ZipfSampler zipf_;
  Rng rng_;
  std::vector<SegmentSpec> docs_;
  int64_t next_index_ = 0;
};

// chat and agents: per-group fixed head segments, then a growing, capped turn history.
class ConversationWorkload : public Workload {
 public:
  ConversationWorkload(const WorkloadConfig& c, const std::vector<std::string>& text_docs)
      : c_(c), content_(c_, text_docs), rng_(c.seed) {
    using K = SegmentSpec::Kind;
    const bool chat = c.workload == "chat";
    groups_ = chat ? c.sessions : c.agents;
    heads_.resize(static_cast<size_t>(groups_));
    history_.resize(static_cast<size_t>(groups_));
    history_tokens_.assign(static_cast<size_t>(groups_), 0);
    if (chat) {
      // One system prompt shared by every session.
      SegmentSpec sys = content_.Make(K::kSystem, c.system_tokens, "System: ", "\n", rng_);
      for (auto& h : heads_) h.push_back(sys);
      return;
    }
    SegmentSpec shared;
    if (content_.text()) {
      // The shared context: corpus documents in order (cycled) up to shared_tokens words.
      std::string text;
      int words = 0;
      for (size_t d = 0; words < c.shared_tokens && !text_docs.empty(); ++d) {
        const std::string& doc = text_docs[d % text_docs.size()];
        text += doc + "\n";
        words += CountWords(doc);
      }
      shared = content_.FromText(K::kShared, "Shared context:\n" + text);
    } else {
      shared = content_.Make(K::kShared, c.shared_tokens, "", "", rng_);
    }
    for (int a = 0; a < groups_; ++a) {
      SegmentSpec instr = content_.Make(K::kInstructions, c.instr_tokens,
                                        absl::StrCat("Agent ", a, " instructions: "), "\n", rng_);
      auto& h = heads_[static_cast<size_t>(a)];
      if (c.shared_first) {
        h.push_back(shared);
        h.push_back(std::move(instr));
      } else {
        h.push_back(std::move(instr));
        h.push_back(shared);
      }
    }
  }

  RequestSpec Next() override {
    using K = SegmentSpec::Kind;
    RequestSpec r;
    r.index = next_index_++;
    const int g = c_.random_order ? static_cast<int>(UniformInt(rng_, 0, groups_))
                                  : static_cast<int>(r.index % groups_);
    r.group = g;
    const size_t gi = static_cast<size_t>(g);
    r.segments = heads_[gi];
    r.segments.insert(r.segments.end(), history_[gi].begin(), history_[gi].end());
    SegmentSpec user = content_.Make(K::kUser, c_.turn_tokens, "User: ", "\n", rng_);
    SegmentSpec reply = content_.Make(K::kAssistant, c_.reply_tokens, "Assistant: ", "\n", rng_);
    r.segments.push_back(user);
    // Next turn of this group: the history grows by this user turn and the (synthetic) reply,
    // then the oldest user/assistant pairs are dropped to stay within max_history_tokens.
    auto& hist = history_[gi];
    int& tokens = history_tokens_[gi];
    tokens += user.tokens + reply.tokens;
    hist.push_back(std::move(user));
    hist.push_back(std::move(reply));
    while (c_.max_history_tokens > 0 && tokens > c_.max_history_tokens && !hist.empty()) {
      for (int k = 0; k < 2 && !hist.empty(); ++k) {
        tokens -= hist.front().tokens;
        hist.pop_front();
      }
    }
    return r;
  }

 private:
  WorkloadConfig c_;
  ContentSource content_;
  Rng rng_;
  int groups_ = 0;
  std::vector<std::vector<SegmentSpec>> heads_;
  std::vector<std::deque<SegmentSpec>> history_;
  std::vector<int> history_tokens_;
  int64_t next_index_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const WorkloadConfig& c,
                                                       const std::vector<std::string>& text_docs) {
  const bool text = c.content == Content::kText;
  if (text && text_docs.empty()) {
    return absl::InvalidArgumentError("--content text needs documents (--docs FILE)");
  }
  if (!text && (c.min_id < 0 || c.max_id <= c.min_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id range [", c.min_id, ", ", c.max_id, ") is empty"));
  }
  const auto nonneg = [](int v, const char* name) -> absl::Status {
    if (v < 0) return absl::InvalidArgumentError(absl::StrCat("--", name, " must be >= 0"));
    return absl::OkStatus();
  };
  for (auto [v, n] : {std::pair{c.doc_tokens, "doc_tokens"},
                      {c.question_tokens, "question_tokens"},
                      {c.system_tokens, "system_tokens"},
                      {c.turn_tokens, "turn_tokens"},
                      {c.reply_tokens, "reply_tokens"},
                      {c.shared_tokens, "shared_tokens"},
                      {c.instr_tokens, "instr_tokens"},
                      {c.max_history_tokens, "max_history_tokens"}}) {
    if (absl::Status s = nonneg(v, n); !s.ok()) return s;
  }
  if (c.workload == "rag") {
    int pool = c.pool;
    if (text) pool = std::min<int>(pool, static_cast<int>(text_docs.size()));
    if (c.docs_per_request < 0 || pool < c.docs_per_request || pool < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("rag needs a pool of at least --docs_per_request (", c.docs_per_request,
                       ") documents, have ", pool));
    }
    if (!(c.zipf >= 0)) return absl::InvalidArgumentError("--zipf must be >= 0");
    return std::make_unique<RagWorkload>(c, text_docs, pool);
  }
  if (c.workload == "chat" || c.workload == "agents") {
    const int groups = c.workload == "chat" ? c.sessions : c.agents;
    if (groups < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", c.workload == "chat" ? "sessions" : "agents", " must be >= 1"));
    }
    return std::make_unique<ConversationWorkload>(c, text_docs);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown workload '", c.workload, "' (expected rag, chat or agents)"));
}

}  // namespace sparsex::loadgen
