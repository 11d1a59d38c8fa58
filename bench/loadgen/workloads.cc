#include "bench/loadgen/workloads.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include <nlohmann/json.hpp>

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

Role RoleOf(SegmentSpec::Kind kind) {
  switch (kind) {
    case SegmentSpec::Kind::kSystem:
      return Role::kSystem;
    case SegmentSpec::Kind::kAssistant:
      return Role::kAssistant;
    default:
      return Role::kUser;
  }
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kSystem:
      return "system";
    case Role::kAssistant:
      return "assistant";
    case Role::kUser:
      return "user";
  }
  return "user";
}

namespace {
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A JSON number that is an integer (1 and 1.0 both; 1.5 not) within [lo, hi].
bool IntegerIn(const nlohmann::json& v, int64_t lo, int64_t hi, int64_t* out) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return false;
    }
    *out = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!(d == std::floor(d)) || d < -9e15 || d > 9e15) return false;
    *out = static_cast<int64_t>(d);
  } else {
    return false;
  }
  return *out >= lo && *out <= hi;
}
}  // namespace

std::vector<int32_t> TraceBlock(uint64_t seed, int64_t hash_id, int block_tokens, int min_id,
                                int max_id) {
  Rng rng(SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(hash_id))));
  std::vector<int32_t> ids(static_cast<size_t>(std::max(block_tokens, 0)));
  for (int32_t& id : ids) id = static_cast<int32_t>(UniformInt(rng, min_id, max_id));
  return ids;
}

absl::StatusOr<std::vector<TraceEntry>> ParseMooncakeTrace(std::istream& in,
                                                           const std::string& name,
                                                           int block_tokens) {
  if (block_tokens < 1) return absl::InvalidArgumentError("--trace_block_tokens must be >= 1");
  std::vector<TraceEntry> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat(name, ":", n, ": ", why));
    };
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return bad("not valid JSON");
    if (!j.is_object()) return bad("not a JSON object");
    for (const auto& [key, value] : j.items()) {
      if (key != "timestamp" && key != "input_length" && key != "output_length" &&
          key != "hash_ids") {
        return bad(absl::StrCat("unsupported key '", key,
                                "' (a Mooncake trace line has timestamp, input_length, "
                                "output_length, hash_ids)"));
      }
    }
    for (const char* key : {"timestamp", "input_length", "output_length", "hash_ids"}) {
      if (!j.contains(key)) return bad(absl::StrCat("missing '", key, "'"));
    }
    TraceEntry e;
    e.line = n;
    const nlohmann::json& ts = j["timestamp"];
    if (!ts.is_number() || !(ts.get<double>() >= 0) || !std::isfinite(ts.get<double>())) {
      return bad("'timestamp' must be a number >= 0 (milliseconds)");
    }
    e.timestamp_ms = ts.get<double>();
    int64_t v = 0;
    if (!IntegerIn(j["input_length"], 1, 1 << 30, &v)) {
      return bad("'input_length' must be an integer >= 1");
    }
    e.input_length = static_cast<int>(v);
    if (!IntegerIn(j["output_length"], 0, 1 << 30, &v)) {
      return bad("'output_length' must be an integer >= 0");
    }
    e.output_length = static_cast<int>(v);
    const nlohmann::json& ids = j["hash_ids"];
    if (!ids.is_array()) return bad("'hash_ids' must be an array");
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!IntegerIn(ids[i], 0, INT64_MAX, &v)) {
        return bad(absl::StrCat("hash_ids[", i, "] must be an integer >= 0"));
      }
      e.hash_ids.push_back(v);
    }
    const int64_t blocks = (e.input_length + block_tokens - 1) / block_tokens;
    if (static_cast<int64_t>(e.hash_ids.size()) != blocks) {
      return bad(absl::StrCat(e.hash_ids.size(), " hash_ids for input_length ", e.input_length,
                              ": blocks of ", block_tokens, " tokens need ", blocks,
                              " (--trace_block_tokens)"));
    }
    out.push_back(std::move(e));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(name, ": read error"));
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": no requests"));
  std::stable_sort(out.begin(), out.end(), [](const TraceEntry& a, const TraceEntry& b) {
    return a.timestamp_ms < b.timestamp_ms;
  });
  return out;
}

absl::StatusOr<std::vector<TraceEntry>> LoadMooncakeTrace(const std::string& path,
                                                          int block_tokens) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read trace ", path));
  return ParseMooncakeTrace(in, path, block_tokens);
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
    case SegmentSpec::Kind::kMissPrefix:
      return "miss_prefix";
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

// LMCache's long_doc_qa: documents asked about again and again; the order within a round
// decides how far apart the repeats of one document come (interleave: back to back; tile: a
// whole round apart; random: shuffled).
class LongDocQaWorkload : public Workload {
 public:
  LongDocQaWorkload(const WorkloadConfig& c, const std::vector<std::string>& text_docs)
      : c_(c), content_(c_, text_docs), rng_(c.seed) {
    Rng pool_rng(c.pool_seed != 0 ? c.pool_seed : c.seed ^ 0x6c6f6e67646f6371ULL);
    for (int d = 0; d < c.documents; ++d) {
      SegmentSpec s =
          content_.text()
              ? content_.FromText(SegmentSpec::Kind::kDocument,
                                  "Document:\n" + text_docs[static_cast<size_t>(d)] + "\n")
              : content_.Make(SegmentSpec::Kind::kDocument, c.document_tokens, "", "", pool_rng);
      s.source = d;
      docs_.push_back(std::move(s));
    }
  }
  std::vector<RequestSpec> Prime(int passes) override {
    // LMCache's warm-up round: every document once, in order.
    std::vector<RequestSpec> out;
    Rng rng(c_.seed ^ 0x9e3779b97f4a7c15ULL);
    for (int p = 0; p < passes; ++p) {
      for (int d = 0; d < c_.documents; ++d) {
        RequestSpec r = Request(d, rng);
        r.index = -1 - static_cast<int64_t>(out.size());
        out.push_back(std::move(r));
      }
    }
    return out;
  }
  RequestSpec Next() override {
    if (pos_ == order_.size()) NewRound();
    RequestSpec r = Request(order_[pos_++], rng_);
    r.index = next_index_++;
    if (misses_ > 0 && r.index % (hits_ + misses_) >= hits_) {
      SegmentSpec miss = content_.Make(SegmentSpec::Kind::kMissPrefix, 8,
                                       absl::StrCat("Request ", r.index, ": "), "\n", rng_);
      miss.cacheable = false;
      r.segments.insert(r.segments.begin(), std::move(miss));
    }
    return r;
  }
  // "H:M" (validated by MakeWorkload).
  void SetHitMiss(int hits, int misses) {
    hits_ = hits;
    misses_ = misses;
  }

 private:
  void NewRound() {
    order_.clear();
    pos_ = 0;
    const int n = c_.documents, k = c_.repeat;
    if (c_.repeat_mode == "interleave") {
      for (int d = 0; d < n; ++d)
        for (int i = 0; i < k; ++i) order_.push_back(d);
    } else {
      for (int i = 0; i < k; ++i)
        for (int d = 0; d < n; ++d) order_.push_back(d);
      if (c_.repeat_mode == "random") Shuffle(order_, rng_);
    }
  }
  RequestSpec Request(int d, Rng& rng) const {
    RequestSpec r;
    r.group = d;
    r.segments.push_back(docs_[static_cast<size_t>(d)]);
    if (c_.question_tokens > 0) {
      SegmentSpec q = content_.Make(SegmentSpec::Kind::kQuestion, c_.question_tokens,
                                    "Question: ", "?\nAnswer:", rng);
      q.cacheable = false;
      r.segments.push_back(std::move(q));
    }
    return r;
  }
  WorkloadConfig c_;
  ContentSource content_;
  Rng rng_;
  std::vector<SegmentSpec> docs_;
  std::vector<int> order_;
  size_t pos_ = 0;
  int64_t next_index_ = 0;
  int hits_ = 1, misses_ = 0;
};

// LMCache's multi_round_qa: `users` user slots served round robin at `rate` requests/s, so one
// user's rounds are users / rate seconds apart and each waits for the previous round's answer.
// A user runs `rounds` rounds and is then replaced by a new user (own context, empty history).
// Slot s's first user starts at round s * rounds / users (a shorter first conversation, its
// history complete), so users are replaced at staggered times, as LMCache's ramp-up staggers
// them, instead of all at once.
class MultiRoundWorkload : public Workload {
 public:
  MultiRoundWorkload(const WorkloadConfig& c, const std::vector<std::string>& text_docs)
      : c_(c), content_(c_, text_docs), rng_(c.seed), slots_(static_cast<size_t>(c.users)) {
    system_ = content_.Make(SegmentSpec::Kind::kSystem, c.shared_system_tokens,
                            "System: ", "\n", rng_);
    for (int s = 0; s < c.users; ++s) {
      Slot& slot = slots_[static_cast<size_t>(s)];
      slot.round = static_cast<int>(static_cast<int64_t>(s) * c.rounds / c.users);
      slot.first_round = slot.round;
      slot.user = -1;
    }
  }
  RequestSpec Next() override {
    using K = SegmentSpec::Kind;
    RequestSpec r;
    r.index = next_index_++;
    const int s = static_cast<int>(r.index % c_.users);
    Slot& slot = slots_[static_cast<size_t>(s)];
    if (slot.user < 0 || slot.round >= c_.rounds) {
      slot.user = next_user_++;
      if (slot.round >= c_.rounds) slot.round = slot.first_round = 0;
      slot.history.clear();
      slot.context = content_.Make(K::kUser, c_.user_history_tokens,
                                   absl::StrCat("For user ", slot.user, ", here is some context: "),
                                   "\n", rng_);
    }
    r.group = s;
    r.arrival_s = static_cast<double>(r.index) / c_.rate;
    r.after = slot.round > slot.first_round ? r.index - c_.users : -1;
    r.max_tokens = c_.answer_tokens;
    r.segments.push_back(system_);
    r.segments.push_back(slot.context);
    r.segments.insert(r.segments.end(), slot.history.begin(), slot.history.end());
    SegmentSpec q = content_.Make(K::kUser, c_.round_tokens,
                                  absl::StrCat("Question #", slot.round + 1, ": "), "\n", rng_);
    r.segments.push_back(q);
    slot.history.push_back(std::move(q));
    slot.history.push_back(
        content_.Make(K::kAssistant, c_.answer_tokens, "Answer: ", "\n", rng_));
    ++slot.round;
    return r;
  }

 private:
  struct Slot {
    int user = -1, round = 0, first_round = 0;
    SegmentSpec context;
    std::vector<SegmentSpec> history;
  };
  WorkloadConfig c_;
  ContentSource content_;
  Rng rng_;
  SegmentSpec system_;
  std::vector<Slot> slots_;
  int next_user_ = 0;
  int64_t next_index_ = 0;
};

// A Mooncake trace window: every hash id a fixed block of seeded token ids, so requests share
// exactly the prefix blocks the trace says they share.
class TraceWorkload : public Workload {
 public:
  TraceWorkload(const WorkloadConfig& c, std::vector<const TraceEntry*> entries)
      : c_(c), entries_(std::move(entries)) {}
  bool HasNext() const override { return next_ < entries_.size(); }
  RequestSpec Next() override {
    RequestSpec r;
    r.index = static_cast<int64_t>(next_);
    if (next_ >= entries_.size()) return r;  // callers check HasNext()
    const TraceEntry& e = *entries_[next_++];
    r.line = e.line;
    r.arrival_s = (e.timestamp_ms / 1000.0 - c_.trace_start_s) * c_.time_scale;
    r.max_tokens = std::max(e.output_length, 1);
    if (c_.max_output_tokens > 0) r.max_tokens = std::min(r.max_tokens, c_.max_output_tokens);
    r.one_prompt = !c_.trace_segments;
    const int B = c_.trace_block_tokens;
    const int scaled_b = std::max(1, static_cast<int>(std::lround(B * c_.trace_token_scale)));
    const uint64_t seed = c_.pool_seed != 0 ? c_.pool_seed : c_.seed;
    int total = 0;
    const size_t n = e.hash_ids.size();
    for (size_t j = 0; j < n; ++j) {
      int len = scaled_b;
      if (j + 1 == n) {
        const int last = e.input_length - static_cast<int>(n - 1) * B;
        len = std::max(1, static_cast<int>(std::lround(last * c_.trace_token_scale)));
        len = std::min(len, scaled_b);
      }
      if (c_.max_input_tokens > 0) len = std::min(len, c_.max_input_tokens - total);
      if (len <= 0) break;
      SegmentSpec s;
      s.kind = SegmentSpec::Kind::kDocument;
      s.ids = TraceBlock(seed, e.hash_ids[j], scaled_b, c_.min_id, c_.max_id);
      s.ids.resize(static_cast<size_t>(len));
      s.tokens = len;
      s.source = static_cast<int>(std::min<int64_t>(e.hash_ids[j], INT32_MAX));
      total += len;
      r.segments.push_back(std::move(s));
    }
    return r;
  }

 private:
  WorkloadConfig c_;
  std::vector<const TraceEntry*> entries_;
  size_t next_ = 0;
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
  if (c.workload == "rag" || c.workload == "textrag") {
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
  if (c.workload == "longdocqa") {
    if (c.documents < 1) return absl::InvalidArgumentError("--documents must be >= 1");
    if (c.repeat < 1) return absl::InvalidArgumentError("--repeat must be >= 1");
    if (c.repeat_mode != "random" && c.repeat_mode != "tile" && c.repeat_mode != "interleave") {
      return absl::InvalidArgumentError(absl::StrCat(
          "--repeat_mode must be random, tile or interleave, not '", c.repeat_mode, "'"));
    }
    if (!text && c.document_tokens < 1) {
      return absl::InvalidArgumentError("--document_tokens must be >= 1");
    }
    if (text && static_cast<int>(text_docs.size()) < c.documents) {
      return absl::InvalidArgumentError(
          absl::StrCat("longdocqa needs --documents (", c.documents, ") documents, the text has ",
                       text_docs.size(), " (lower --doc_chars or --documents)"));
    }
    int hits = 1, misses = 0;
    if (!c.hit_miss.empty()) {
      const size_t colon = c.hit_miss.find(':');
      if (colon == std::string::npos ||
          !absl::SimpleAtoi(c.hit_miss.substr(0, colon), &hits) ||
          !absl::SimpleAtoi(c.hit_miss.substr(colon + 1), &misses) || hits < 0 || misses < 0 ||
          hits + misses < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--hit_miss must be H:M with H, M >= 0 and H + M >= 1, not '", c.hit_miss, "'"));
      }
    }
    auto w = std::make_unique<LongDocQaWorkload>(c, text_docs);
    w->SetHitMiss(hits, misses);
    return w;
  }
  if (c.workload == "multiround") {
    if (c.users < 1 || c.rounds < 1) {
      return absl::InvalidArgumentError("--users and --rounds must be >= 1");
    }
    if (c.answer_tokens < 1) return absl::InvalidArgumentError("--answer_tokens must be >= 1");
    for (auto [v, n] : {std::pair{c.shared_system_tokens, "shared_system_tokens"},
                        {c.user_history_tokens, "user_history_tokens"},
                        {c.round_tokens, "round_tokens"}}) {
      if (absl::Status s = nonneg(v, n); !s.ok()) return s;
    }
    if (!(c.rate > 0)) return absl::InvalidArgumentError("multiround needs a rate > 0");
    return std::make_unique<MultiRoundWorkload>(c, text_docs);
  }
  if (c.workload == "trace") {
    if (c.trace == nullptr) return absl::InvalidArgumentError("--workload trace needs --trace FILE");
    if (text) return absl::InvalidArgumentError("a trace is token ids: --content text is not supported");
    if (!(c.time_scale > 0)) return absl::InvalidArgumentError("--time_scale must be > 0");
    if (!(c.trace_token_scale > 0) || c.trace_token_scale > 1) {
      return absl::InvalidArgumentError("--trace_token_scale must be in (0, 1]");
    }
    if (c.trace_start_s < 0 || c.trace_duration_s < 0) {
      return absl::InvalidArgumentError("--start_s and --duration_s must be >= 0");
    }
    if (c.max_output_tokens < 0 || c.max_input_tokens < 0) {
      return absl::InvalidArgumentError("--max_output_tokens and --max_input_tokens must be >= 0");
    }
    std::vector<const TraceEntry*> window;
    for (const TraceEntry& e : *c.trace) {
      const double t = e.timestamp_ms / 1000.0;
      if (t < c.trace_start_s) continue;
      if (c.trace_duration_s > 0 && t >= c.trace_start_s + c.trace_duration_s) continue;
      window.push_back(&e);
    }
    if (window.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the trace has no request in the window [", c.trace_start_s, " s, ",
          c.trace_duration_s > 0 ? absl::StrCat(c.trace_start_s + c.trace_duration_s, " s)")
                                 : std::string("end)")));
    }
    return std::make_unique<TraceWorkload>(c, std::move(window));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown workload '", c.workload,
      "' (expected rag, textrag, chat, agents, longdocqa, multiround or trace)"));
}

}  // namespace sparsex::loadgen
