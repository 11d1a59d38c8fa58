// Workload generation for sparsex-loadgen (issue 18 §4): seeded, reproducible request sequences
// for the serving benchmark, independent of gRPC (the unit test links this alone).
//
//   rag     a pool of documents with Zipf popularity; each request: docs_per_request distinct
//           documents in random order + a fresh question segment.
//   chat    sessions; each request re-sends the system prompt + the session's history (every
//           earlier user and assistant turn its own segment) + a new user message.
//   agents  agents sharing one large context; each request: the agent's instructions, the
//           shared context, the agent's history, a new message.
//
// Same config (seed included) => the same request sequence, whatever the arrival process or
// the server's replies: assistant turns are synthetic (seeded ids / corpus words of
// reply_tokens), not the server's output. All randomness goes through std::mt19937_64 (fully
// specified by the standard) with our own conversions, so sequences match across standard
// libraries too.
#pragma once

#include <cstdint>
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

struct WorkloadConfig {
  std::string workload = "rag";  // rag | chat | agents
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
};

// One prompt segment: token ids (numbers) or text. `tokens` is exact for ids and the number of
// words for text (text sizes are counted in words).
struct SegmentSpec {
  enum class Kind { kSystem, kDocument, kQuestion, kShared, kInstructions, kUser, kAssistant };
  Kind kind = Kind::kDocument;
  bool is_text = false;
  std::vector<int32_t> ids;
  std::string text;
  bool cacheable = true;
  int tokens = 0;
  int source = -1;  // document index (rag) or -1
};

struct RequestSpec {
  int64_t index = 0;  // position in the sequence
  int group = -1;     // session (chat) or agent (agents); -1 for rag
  std::vector<SegmentSpec> segments;
  int prompt_tokens() const;  // sum of segment sizes
};

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
};

// text_docs: the documents for --content text (LoadTextDocs); ignored for numbers.
absl::StatusOr<std::unique_ptr<Workload>> MakeWorkload(const WorkloadConfig& config,
                                                       const std::vector<std::string>& text_docs);

// Paragraphs of a text file (blank-line separated) merged to about doc_chars characters per
// document; at most max_docs documents (0: all).
std::vector<std::string> LoadTextDocs(const std::string& path, size_t doc_chars, size_t max_docs);

const char* KindName(SegmentSpec::Kind kind);

}  // namespace sparsex::loadgen
