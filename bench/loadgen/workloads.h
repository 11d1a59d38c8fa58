// Workload generation for sparsex-loadgen: seeded, reproducible request sequences
// for the serving benchmark, independent of gRPC (the unit test links this alone).
//
//   rag     a pool of documents with Zipf popularity; each request: docs_per_request distinct
//           documents in random order + a fresh question segment.
//   textrag rag over text, as sparsex-loadgen sends it through the OpenAI chat API: the
//           documents pasted into one user message (another order each time), no segments.
//   chat    sessions; each request re-sends the system prompt + the session's history (every
//           earlier user and assistant turn its own segment) + a new user message.
//   agents  agents sharing one large context; each request: the agent's instructions, the
//           shared context, the agent's history, a new message.
//   longdocqa  LMCache's benchmarks/long_doc_qa: `documents` long documents, each asked about
//           `repeat` times per round, the rounds ordered random / tile / interleave; each
//           request: one document + a fresh question.
//   multiround LMCache's benchmarks/multi_round_qa: `users` concurrent users, each a
//           conversation of `rounds` rounds paced at users / rate seconds; each request: the
//           shared system prompt, the user's own context, the earlier rounds (question and
//           answer), a new question. A finished user is replaced by a new one.
//   trace   a Mooncake trace (ParseMooncakeTrace): each hash id a fixed seeded block of token
//           ids, requests at the trace's timestamps.
//
// Same config (seed included) => the same request sequence, whatever the arrival process or
// the server's replies: assistant turns are synthetic (seeded ids / corpus words of
// reply_tokens), not the server's output. All randomness goes through std::mt19937_64 (fully
// specified by the standard) with our own conversions, so sequences match across standard
// libraries too.
#pragma once

#include <cstdint>
#include <istream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace sparsex::loadgen {

using Rng = std::mt19937_64;

// Uniform in [0, 1) from 53 random bits.
double UniformDouble(Rng& rng);
// Uniform in [lo, hi), hi > lo.
int64_t UniformInt(Rng& rng, int64_t lo, int64_t hi);
// Fisher-Yates shuffle with UniformInt (std::shuffle's output is implementation-defined).
template <typename T>
void Shuffle(std::vector<T>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(UniformInt(rng, 0, static_cast<int64_t>(i)));
    std::swap(v[i - 1], v[j]);
  }
}

// Zipf popularity over ranks 0..n-1: P(rank r) proportional to 1 / (r + 1)^s.
class ZipfSampler {
 public:
  ZipfSampler(int n, double s);
  int Sample(Rng& rng) const;
  double Probability(int rank) const;
  int size() const { return static_cast<int>(cdf_.size()); }

 private:
  std::vector<double> cdf_;
};

// Poisson arrivals: exponential inter-arrival gaps with mean 1 / rate seconds.
class PoissonArrivals {
 public:
  PoissonArrivals(double rate, uint64_t seed);
  double NextGapS();

 private:
  double rate_;
  Rng rng_;
};

enum class Content { kNumbers, kText };

struct TraceEntry;

struct WorkloadConfig {
  std::string workload = "rag";  // rag | textrag | chat | agents | longdocqa | multiround | trace
  Content content = Content::kNumbers;
  uint64_t seed = 1;
  // Seed of the document pool's content (rag) when nonzero; 0: derived from `seed`. A fixed pool
  // seed keeps the same documents across sweep points that vary `seed` (new orderings and
  // questions over one warm pool). Default: 0
  uint64_t pool_seed = 0;
  // numbers: token ids drawn uniformly from [min_id, max_id).
  int min_id = 1000, max_id = 100000;
  // rag
  int pool = 100;
  double zipf = 1.0;
  int docs_per_request = 4;
  int doc_tokens = 512;  // numbers (text: the documents given to MakeWorkload)
  int question_tokens = 32;
  // chat / agents
  int sessions = 16;
  bool random_order = false;  // pick the session / agent at random instead of round robin
  int system_tokens = 256;
  int turn_tokens = 64;
  int reply_tokens = 32;  // synthetic assistant turn
  int max_history_tokens = 4096;
  // agents
  int agents = 8;
  int shared_tokens = 4096;
  int instr_tokens = 256;
  bool shared_first = false;  // [shared, instructions, ...] instead of [instructions, shared, ...]
  // longdocqa (LMCache long_doc_qa: 8 documents in its examples, 20,000 tokens in vLLM's
  // original; 12,000 here). question_tokens is the fresh question after the document (0: none,
  // as LMCache).
  int documents = 8;
  int document_tokens = 12000;
  int repeat = 2;                       // times each document is asked about per round
  std::string repeat_mode = "random";   // random | tile | interleave
  // "H:M": of every H + M requests the last M start with a fresh 8-token prefix (LMCache's
  // --hit-miss-ratio: misses for a prefix cache; segment reuse still finds the document).
  std::string hit_miss;
  // multiround (LMCache multi_round_qa: --shared-system-prompt 1000 --user-history-prompt 2000
  // --answer-len 100). Requests of user slot s go out every users / rate seconds.
  int users = 10;
  int rounds = 5;
  int shared_system_tokens = 1000;
  int user_history_tokens = 2000;  // the user's own context, in its first message
  int round_tokens = 20;           // each round's new question
  int answer_tokens = 100;         // each round's answer (synthetic in the history; max_tokens)
  double rate = 1;                 // requests/s over all users (the sweep point)
  // trace: parsed entries (in arrival order) and how they become requests.
  const std::vector<TraceEntry>* trace = nullptr;
  int trace_block_tokens = 512;  // tokens per hash id (Mooncake: 512)
  double time_scale = 1;         // arrival gaps multiplied by this (0.5: twice the rate)
  double trace_start_s = 0;      // window start in trace time
  double trace_duration_s = 0;   // window length in trace time (0: to the end)
  int max_output_tokens = 0;     // cap on a request's recorded output_length (0: none)
  int max_input_tokens = 0;      // prompts cut to their first N tokens (0: none)
  // Prompt sizes multiplied by this (blocks of round(block_tokens * scale) tokens, the last
  // block scaled alike): the trace's reuse structure at a size a small model can serve.
  double trace_token_scale = 1;
  bool trace_segments = true;    // each block its own segment; false: one prompt (chunked)
};

// One prompt segment: token ids (numbers) or text. `tokens` is exact for ids and the number of
// words for text (text sizes are counted in words).
struct SegmentSpec {
  enum class Kind {
    kSystem, kDocument, kQuestion, kShared, kInstructions, kUser, kAssistant,
    kMissPrefix  // longdocqa --hit_miss: a fresh prefix that defeats the exact prefix cache
  };
  Kind kind = Kind::kDocument;
  bool is_text = false;
  std::vector<int32_t> ids;
  std::string text;
  bool cacheable = true;
  int tokens = 0;
  int source = -1;  // document index (rag, longdocqa), hash id (trace) or -1
};

// The chat role a segment belongs to when a request is sent as OpenAI chat messages:
// system prompts are `system`, assistant turns `assistant`, everything else the user's
// (documents, questions, instructions, shared context are pasted into user messages).
enum class Role { kSystem, kUser, kAssistant };
Role RoleOf(SegmentSpec::Kind kind);
const char* RoleName(Role role);

struct RequestSpec {
  int64_t index = 0;  // position in the sequence
  int group = -1;     // session (chat), agent (agents), user slot (multiround); -1 otherwise
  std::vector<SegmentSpec> segments;
  // Send time in seconds on the workload's own clock (trace: scaled trace time; multiround:
  // index / rate); NaN: the arrival process decides (Poisson or closed loop).
  double arrival_s = std::numeric_limits<double>::quiet_NaN();
  // Index of a request that must have finished before this one is sent (multiround: the
  // user's previous round, as a person waits for the answer); -1: none.
  int64_t after = -1;
  int max_tokens = -1;   // tokens to generate (trace, multiround, longdocqa); -1: --max_tokens
  bool one_prompt = false;  // send as one prompt (the router chunks it), not as segments
  int line = 0;             // trace: the line of the trace file
  int prompt_tokens() const;  // sum of segment sizes
};

// One request of a Mooncake trace (github.com/kvcache-ai/Mooncake, FAST25-release/traces):
// {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}, one a line.
struct TraceEntry {
  double timestamp_ms = 0;
  int input_length = 0;
  int output_length = 0;
  std::vector<int64_t> hash_ids;
  int line = 0;  // 1-based line in the file
};

// Parses a Mooncake trace. Every non-empty line must be one JSON object with exactly these four
// keys (another key is refused by name: a field this replayer does not implement is never
// ignored), integer lengths (input >= 1, output >= 0), non-negative integer hash ids, and as
// many hash ids as input_length needs blocks of block_tokens. Errors name `name` and the line.
// Entries come back in arrival order (stable by timestamp).
absl::StatusOr<std::vector<TraceEntry>> ParseMooncakeTrace(std::istream& in,
                                                           const std::string& name,
                                                           int block_tokens);
absl::StatusOr<std::vector<TraceEntry>> LoadMooncakeTrace(const std::string& path,
                                                          int block_tokens);
// The token ids of one hash id's block: block_tokens ids from a stream seeded by (seed,
// hash_id), uniform in [min_id, max_id). Equal ids give equal blocks.
std::vector<int32_t> TraceBlock(uint64_t seed, int64_t hash_id, int block_tokens, int min_id,
                                int max_id);

class Workload {
 public:
  virtual ~Workload() = default;
  virtual RequestSpec Next() = 0;
  // Requests that show the server every cacheable document `passes` times before a
  // measurement (rag: the whole pool, docs_per_request documents a request, each pass in
  // another grouping; a worker stores a segment at its n-th miss, --store_after_misses), so
  // the first sweep point does not measure cold documents. Not part of Next()'s sequence.
  // Empty for workloads without a pool. Default: none
  virtual std::vector<RequestSpec> Prime(int /*passes*/) { return {}; }
  // False once a finite workload (a trace window) has no more requests. Default: endless
  virtual bool HasNext() const { return true; }
};

// text_docs: the documents for --content text (LoadTextDocs); ignored for numbers.
absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const WorkloadConfig& config,
                                                       const std::vector<std::string>& text_docs);

// Paragraphs of a text file (blank-line separated) merged to about doc_chars characters per
// document; at most max_docs documents (0: all).
std::vector<std::string> LoadTextDocs(const std::string& path, size_t doc_chars, size_t max_docs);

const char* KindName(SegmentSpec::Kind kind);

}  // namespace sparsex::loadgen
