#include "gpu_worker/cli/commands.h"

#include <cstdio>
#include <iostream>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "gpu_worker/backend/backend.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "gpu_worker/scheduler/scheduler.h"

namespace sparsex::cli {
namespace {

absl::StatusOr<std::string> Need(const Args& a, const std::string& k) {
  auto it = a.find(k);
  if (it == a.end()) return absl::InvalidArgumentError(absl::StrCat("--", k, " is required"));
  return it->second;
}

template <typename T>
absl::Status Opt(const Args& a, const std::string& k, T* out) {
  auto it = a.find(k);
  if (it == a.end()) return absl::OkStatus();
  try {
    if constexpr (std::is_same_v<T, int>) *out = std::stoi(it->second);
    else if constexpr (std::is_same_v<T, float>) *out = std::stof(it->second);
    else if constexpr (std::is_same_v<T, uint64_t>) *out = std::stoull(it->second);
    else *out = it->second;
  } catch (...) {
    return absl::InvalidArgumentError(absl::StrCat("bad value for --", k, ": ", it->second));
  }
  return absl::OkStatus();
}

}  // namespace

// Generation runs through the worker's own scheduler (in process, no RPC): the CLI and the
// service share one decode loop, sampling, stop handling and usage figures.
absl::Status Generate(const Args& a) {
  ASSIGN_OR_RETURN(std::string path, Need(a, "model"));
  std::string prompt, device = "cpu";
  SamplingParams sp;
  RETURN_IF_ERROR(Opt(a, "prompt", &prompt));
  RETURN_IF_ERROR(Opt(a, "max-tokens", &sp.max_tokens));
  RETURN_IF_ERROR(Opt(a, "temperature", &sp.temperature));
  RETURN_IF_ERROR(Opt(a, "top-k", &sp.top_k));
  RETURN_IF_ERROR(Opt(a, "top-p", &sp.top_p));
  RETURN_IF_ERROR(Opt(a, "seed", &sp.seed));
  RETURN_IF_ERROR(Opt(a, "device", &device));
  const bool ids = a.count("ids") > 0;
  // Quantized GGUF weights are dequantized into the backend's dtype (bf16 on CUDA).
  LoadOptions lo;
  if (device == "cuda") lo.dequantize_to = DType::kBF16;
  RETURN_IF_ERROR(Opt(a, "tokenizer", &lo.tokenizer_path));
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(path, lo));
  service::SchedulerOptions so;
  so.engine.backend.kind = device;
  so.engine.backend.cuda = CudaBackendOptionsFromEnv();  // the SPX_* kernel switches
  // A run's missing segments are stored before its first token, so the next run finds them.
  so.defer_segment_stores = false;
  SegmentStore store({});
  ASSIGN_OR_RETURN(auto sched, service::BatchScheduler::Start(*model, &store, so));

  // Runs one request to its end, streaming its text to stdout; the final chunk's usage.
  auto run = [&](std::vector<PromptSegment> segments, bool reuse,
                 std::vector<int32_t>* tokens) -> absl::StatusOr<service::StreamChunk> {
    service::WorkItem w;
    w.segments = std::move(segments);
    w.sampling = sp;
    w.reuse = so.reuse;
    w.reuse.enable_reuse = reuse;
    ASSIGN_OR_RETURN(std::shared_ptr<service::RequestHandle> h, sched->Submit(std::move(w)));
    std::vector<service::StreamChunk> chunks;
    for (;;) {
      chunks.clear();
      h->Wait(&chunks, std::chrono::milliseconds(100));
      for (service::StreamChunk& c : chunks) {
        tokens->insert(tokens->end(), c.ids.begin(), c.ids.end());
        if (!ids && !c.text.empty()) {
          std::fwrite(c.text.data(), 1, c.text.size(), stdout);
          std::fflush(stdout);
        }
        if (c.final) {
          RETURN_IF_ERROR(c.status);
          return std::move(c);
        }
      }
    }
  };
  std::vector<int32_t> tokens;
  service::StreamChunk last;
  if (a.count("segments")) {
    // Segment reuse: paragraphs of the file (blank-line separated) are segments, the prompt
    // text is appended as a new segment. --runs N repeats the request (reversed order on every
    // other run) so later runs reuse the stored segments.
    std::ifstream in(a.at("segments"));
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", a.at("segments")));
    std::vector<PromptSegment> segs;
    std::string line, para;
    auto flush = [&] {
      if (!para.empty()) segs.push_back({model->tokenizer().Encode(para, false), true});
      para.clear();
    };
    while (std::getline(in, line)) {
      if (line.empty()) flush();
      else para += (para.empty() ? "" : "\n") + line;
    }
    flush();
    int runs = 1;
    RETURN_IF_ERROR(Opt(a, "runs", &runs));
    for (int i = 0; i < runs; ++i) {
      std::vector<PromptSegment> req = segs;
      if (i % 2 == 1) std::reverse(req.begin(), req.end());
      if (!prompt.empty()) req.push_back({model->tokenizer().Encode(prompt, false), false});
      tokens.clear();
      ASSIGN_OR_RETURN(last, run(std::move(req), /*reuse=*/true, &tokens));
      const service::RequestUsage& u = last.usage;
      std::fprintf(stderr,
                   "\n[run %d: %d prompt tokens: %d prefix, %d reused (%d segments), %d new, "
                   "%d recomputed; compute share %.3f]\n",
                   i + 1, u.prompt_tokens, u.prefix_tokens, u.reused_tokens, u.segments_hit,
                   u.new_tokens, u.recomputed_tokens, u.compute_share);
    }
  } else {
    ASSIGN_OR_RETURN(last, run({{model->tokenizer().Encode(prompt, false), false}},
                               /*reuse=*/false, &tokens));
  }
  if (ids) {
    for (size_t i = 0; i < tokens.size(); ++i) std::printf(i ? " %d" : "%d", tokens[i]);
  }
  std::printf("\n");
  std::fprintf(stderr, "[%d prompt tokens, %zu generated, finish=%s, ttft %.1f ms, %.1f ms total]\n",
               last.usage.prompt_tokens, tokens.size(), last.finish_reason.c_str(),
               last.usage.ttft_ms, last.usage.total_ms);
  return absl::OkStatus();
}

absl::Status Info(const Args& a) {
  ASSIGN_OR_RETURN(std::string path, Need(a, "model"));
  LoadOptions lo;
  RETURN_IF_ERROR(Opt(a, "tokenizer", &lo.tokenizer_path));
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(path, lo));
  const ModelConfig& c = model->config();
  std::printf("model %s\nlayers %d dim %d ffn %d heads %d kv_heads %d head_dim %d vocab %d\n"
              "max_seq_len %d rope_theta %g layout %s\nfingerprint %s\n",
              path.c_str(), c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim,
              c.vocab_size, c.max_seq_len, c.rope_theta,
              c.rope_layout == RopeLayout::kHalves ? "halves" : "adjacent",
              model->fingerprint().Hex().c_str());
  const Tokenizer& t = model->tokenizer();
  std::printf("tokenizer %s: %d tokens, bos %d, eos %d, identity %s\n",
              lo.tokenizer_path.empty() ? "built in" : lo.tokenizer_path.c_str(), t.vocab_size(),
              t.bos_id(), t.eos_id(), TokenizerFingerprint(t).Hex().c_str());
  return absl::OkStatus();
}

absl::Status Tokenize(const Args& a) {
  // --tokenizer names the tokenizer file outright; --model alone is read for its tokenizer.
  std::string path;
  RETURN_IF_ERROR(Opt(a, "tokenizer", &path));
  if (path.empty()) {
    ASSIGN_OR_RETURN(path, Need(a, "model"));
  }
  // The tokenizer alone: vocabulary-only GGUF files (any architecture) load too.
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, LoadTokenizer(path));
  std::string text;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, stdin)) > 0;) text.append(buf, n);
  if (std::ferror(stdin)) return absl::DataLossError("error reading stdin");
  const bool special = a.count("parse-special") > 0;
  auto line_of = [&](std::string_view t) {
    std::string out;
    for (int32_t id : tok->Encode(t, /*add_bos=*/false, special)) absl::StrAppend(&out, " ", id);
    out += '\n';
    return out;
  };
  if (a.count("json-lines") == 0) {
    const std::string out = line_of(text);
    std::fwrite(out.data(), 1, out.size(), stdout);
    return absl::OkStatus();
  }
  // One JSON string per line: texts with newlines or any byte sequence (JSON \u escapes) in one
  // run, so a test of many strings loads a large tokenizer once.
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    std::string t;
    try {
      t = nlohmann::json::parse(line).get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("stdin line ", n, ": not a JSON string (",
                                                     e.what(), ")"));
    }
    const std::string out = line_of(t);
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  return absl::OkStatus();
}

}  // namespace sparsex::cli
