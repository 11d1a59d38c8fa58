// `sparsex fidelity`: how close segment reuse gets to full prefill on a real model.
// Builds RAG-style prompts (4-6 stored document segments of 40-100 tokens in random order plus a
// new question-like suffix), runs full prefill and reuse prefill for every selector, ratio and
// number of full layers, and reports KL(full || reuse) of the next-token distribution, top-1
// agreement, 32-token greedy agreement and the computed share of token-layers.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include "gpu_worker/cli/commands.h"
#include "gpu_worker/reuse/reuse_prefill.h"

namespace sparsex::cli {
namespace {

struct Prompt {
  std::vector<std::vector<int32_t>> docs;
  std::vector<int32_t> question;
};

struct Reference {
  std::vector<double> logp;  // log-softmax of the full-prefill logits
  int32_t top1;
  std::vector<int32_t> greedy;
};

std::vector<double> LogSoftmax(const std::vector<float>& x) {
  double mx = *std::max_element(x.begin(), x.end()), s = 0;
  for (float v : x) s += std::exp(v - mx);
  const double lse = mx + std::log(s);
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] - lse;
  return out;
}

double Kl(const std::vector<double>& lp, const std::vector<double>& lq) {
  double kl = 0;
  for (size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(0.0, kl);
}

// Greedy continuation of n tokens from a prefilled sequence; releases it.
absl::StatusOr<std::vector<int32_t>> Greedy(Engine& e, Sequence& seq, std::vector<float> logits,
                                            int n) {
  std::vector<int32_t> out;
  absl::Status st;
  for (int i = 0; i < n; ++i) {
    out.push_back(Argmax(logits));
    if (i + 1 == n) break;
    auto lg = e.Step(seq, out.back());
    if (!lg.ok()) {
      st = lg.status();
      break;
    }
    logits = std::move(*lg);
  }
  e.Release(seq);
  RETURN_IF_ERROR(st);
  return out;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = q * (v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(idx)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - lo);
}

struct Setting {
  std::string selector;
  int full_layers;
  std::string encoding;
  float ratio;
};

}  // namespace

absl::Status Fidelity(const Args& a) {
  auto get = [&](const std::string& k, const std::string& d) {
    auto it = a.find(k);
    return it == a.end() ? d : it->second;
  };
  const std::string model_path = get("model", ""), docs_path = get("docs", ""),
                    json_path = get("json", "");
  if (model_path.empty() || docs_path.empty() || json_path.empty()) {
    return absl::InvalidArgumentError("--model, --docs and --json are required");
  }
  const int n_prompts = std::stoi(get("prompts", "50"));
  const uint64_t seed = std::stoull(get("seed", "1"));
  std::vector<int> fl_values;
  {
    std::stringstream ss(get("full-layers", "1,2"));
    std::string t;
    while (std::getline(ss, t, ',')) fl_values.push_back(std::stoi(t));
  }
  std::vector<std::string> encodings;
  {
    std::stringstream ss(get("encodings", "none,bos"));
    std::string t;
    while (std::getline(ss, t, ',')) encodings.push_back(t);
  }
  auto list = [&](const std::string& k, const std::string& d) {
    std::vector<std::string> out;
    std::stringstream ss(get(k, d));
    std::string t;
    while (std::getline(ss, t, ',')) out.push_back(t);
    return out;
  };
  const std::vector<std::string> selectors = list("selectors", "sparsex,cacheblend,epic,random");
  std::vector<float> ratios;
  for (const std::string& r : list("ratios", "0,0.05,0.10,0.15,0.30,0.50,1.0")) {
    ratios.push_back(std::stof(r));
  }
  SparsexWeights weights;
  {
    std::vector<std::string> w = list("sparsex-weights", "");
    if (w.size() == 3) weights = {std::stof(w[0]), std::stof(w[1]), std::stof(w[2])};
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(model_path));
  const Tokenizer& tok = model->tokenizer();

  // Documents: paragraphs of 40-100 tokens (longer ones cut at 100).
  std::ifstream in(docs_path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", docs_path));
  std::vector<std::vector<int32_t>> docs;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::vector<int32_t> ids = tok.Encode(line, /*add_bos=*/false);
    if (ids.size() < 40) continue;
    if (ids.size() > 100) ids.resize(100);
    docs.push_back(std::move(ids));
  }
  if (docs.size() < 12) return absl::FailedPreconditionError("too few documents of 40-100 tokens");
  const int max_len = std::min(model->config().max_seq_len, 512);  // stories260K trained at 512

  std::mt19937_64 rng(seed);
  std::vector<Prompt> prompts;
  for (int i = 0; i < n_prompts; ++i) {
    Prompt p;
    const int k = std::uniform_int_distribution<int>(4, 6)(rng);
    std::vector<int> idx(docs.size());
    for (size_t j = 0; j < idx.size(); ++j) idx[j] = static_cast<int>(j);
    std::shuffle(idx.begin(), idx.end(), rng);
    int total = 1;
    for (int j = 0; j < k; ++j) {
      if (total + static_cast<int>(docs[idx[j]].size()) + 24 > max_len) break;
      p.docs.push_back(docs[idx[j]]);
      total += static_cast<int>(docs[idx[j]].size());
    }
    // A new, question-like suffix: the opening words of another document.
    const auto& q = docs[idx[k]];
    const int qlen = std::uniform_int_distribution<int>(8, 20)(rng);
    p.question.assign(q.begin(), q.begin() + std::min<size_t>(qlen, q.size()));
    prompts.push_back(std::move(p));
  }

  EngineOptions eo;
  eo.kv.enable_prefix_caching = false;  // references and settings must not share KV
  eo.kv.num_blocks = 256;
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(*model, eo));
  SegmentStore store({});
  ReuseEngine reuse(engine.get(), &store, {});

  // Full-prefill references.
  std::vector<Reference> refs;
  for (const Prompt& p : prompts) {
    std::vector<PromptSegment> segs;
    for (const auto& d : p.docs) segs.push_back({d, false});
    segs.push_back({p.question, false});
    ReuseOptions full;
    full.enable_reuse = false;
    ASSIGN_OR_RETURN(ReusePrefillResult r, reuse.Prefill(segs, true, &full));
    Reference ref;
    ref.logp = LogSoftmax(r.logits);
    ref.top1 = Argmax(r.logits);
    ASSIGN_OR_RETURN(ref.greedy, Greedy(*engine, r.seq, r.logits, 32));
    refs.push_back(std::move(ref));
  }

  std::vector<Setting> settings;
  for (const std::string& enc : encodings) {
    settings.push_back({"naive", 0, enc, 0.0f});
    for (int F : fl_values) {
      for (const std::string& sel : selectors) {
        // Encodings other than the first are compared at the default selector only.
        if (enc != encodings[0] && sel != "sparsex") continue;
        for (float r : ratios) settings.push_back({sel, F, enc, r});
      }
    }
  }

  std::FILE* js = std::fopen(json_path.c_str(), "w");
  if (js == nullptr) return absl::InternalError(absl::StrCat("cannot write ", json_path));
  std::fprintf(js, "[\n");
  std::printf("%-10s %2s %-5s %5s  %8s %8s %8s  %5s  %6s  %6s\n", "selector", "F", "enc", "r",
              "kl_mean", "kl_med", "kl_p95", "top1", "greedy", "share");
  bool first = true;
  for (const Setting& s : settings) {
    ReuseOptions o;
    o.encoding = s.encoding;
    o.full_layers = s.full_layers;
    o.selector = s.selector == "naive" ? "random" : s.selector;
    o.budget.ratio = s.ratio;
    o.store_new_segments = false;
    o.seed = seed;
    o.sparsex_weights = weights;
    o.stats_all_full_layers = get("stats-layers", "all") == "all";
    std::vector<double> kls, shares;
    double top1 = 0, greedy = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::vector<PromptSegment> segs;
      for (const auto& d : prompts[i].docs) {
        RETURN_IF_ERROR(reuse.EnsureStored(d, &o));  // stored by an "earlier request"
        segs.push_back({d, true});
      }
      segs.push_back({prompts[i].question, false});
      ASSIGN_OR_RETURN(ReusePrefillResult r, reuse.Prefill(segs, true, &o));
      kls.push_back(Kl(refs[i].logp, LogSoftmax(r.logits)));
      top1 += Argmax(r.logits) == refs[i].top1;
      shares.push_back(r.stats.compute_share);
      ASSIGN_OR_RETURN(std::vector<int32_t> g, Greedy(*engine, r.seq, r.logits, 32));
      int same = 0;
      for (int t = 0; t < 32; ++t) same += g[t] == refs[i].greedy[t];
      greedy += same / 32.0;
    }
    const double n = static_cast<double>(prompts.size());
    double kl_mean = 0, share = 0;
    for (double k : kls) kl_mean += k / n;
    for (double v : shares) share += v / n;
    std::printf("%-10s %2d %-5s %5.2f  %8.5f %8.5f %8.5f  %5.3f  %6.3f  %6.3f\n",
                s.selector.c_str(), s.full_layers, s.encoding.c_str(), s.ratio, kl_mean,
                Quantile(kls, 0.5), Quantile(kls, 0.95), top1 / n, greedy / n, share);
    std::fflush(stdout);
    std::fprintf(js,
                 "%s  {\"selector\": \"%s\", \"full_layers\": %d, \"encoding\": \"%s\", "
                 "\"ratio\": %.2f, \"kl_mean\": %.6f, \"kl_median\": %.6f, \"kl_p95\": %.6f, "
                 "\"top1_agree\": %.4f, \"greedy32_agree\": %.4f, \"compute_share\": %.4f, "
                 "\"prompts\": %zu}",
                 first ? "" : ",\n", s.selector.c_str(), s.full_layers, s.encoding.c_str(),
                 s.ratio, kl_mean, Quantile(kls, 0.5), Quantile(kls, 0.95), top1 / n, greedy / n,
                 share, prompts.size());
    first = false;
  }
  std::fprintf(js, "\n]\n");
  std::fclose(js);
  return absl::OkStatus();
}

}  // namespace sparsex::cli
