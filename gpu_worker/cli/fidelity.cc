// `sparsex fidelity`: how close segment reuse gets to full prefill on a real model.
// Builds RAG-style prompts (4-6 stored document segments of 40-100 tokens in random order plus a
// new question-like suffix; several seeds pooled), runs full prefill and reuse prefill for every
// selector, ratio and number of full layers, and reports per setting: KL(full || reuse) of the
// next-token distribution, top-1 agreement, 32-token greedy agreement, the relative quality
// drop (mean log-probability of the full-prefill greedy continuation, teacher-forced, under
// reuse vs under full prefill) and the computed share of token-layers, with seeded bootstrap 95%
// intervals over prompts. Every prompt's figures are kept in the JSON so two runs or two
// settings can be compared paired.
//
// Prompts are sized so prompt + continuation fits in min(context, --max-len): a prompt that
// does not fit with all its documents is shortened (documents dropped), one that cannot fit
// even one document is skipped; both are counted in the output, never an abort.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "gpu_worker/cli/commands.h"
#include "gpu_worker/reuse/reuse_prefill.h"

namespace sparsex::cli {
namespace {

struct Prompt {
  uint64_t seed = 0;
  int index = 0;  // within its seed
  std::vector<std::vector<int32_t>> docs;
  std::vector<int32_t> question;
  int tokens = 0;  // BOS + documents + question
};

struct Reference {
  std::vector<double> logp;  // log-softmax of the full-prefill logits
  int32_t top1 = 0;
  std::vector<int32_t> greedy;  // full-prefill greedy continuation
  double cont_logp = 0;         // its mean log-probability under full prefill (teacher-forced)
};

// One prompt under one setting.
struct PromptResult {
  double kl = 0, share = 0, greedy = 0, cont_logp = 0;
  double top1 = 0;  // 1 when the next-token argmax equals full prefill's
  double uncovered = 1, predicted = 0;  // ReuseStats::uncovered_share, predicted_drop
};

std::vector<double> LogSoftmax(std::span<const float> x) {
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

// Free-running greedy continuation of n tokens from a prefilled sequence (extends it).
absl::StatusOr<std::vector<int32_t>> Greedy(Engine& e, Sequence& seq, std::vector<float> logits,
                                            int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(Argmax(logits));
    if (i + 1 == n) break;
    ASSIGN_OR_RETURN(logits, e.Step(seq, out.back()));
  }
  return out;
}

// Mean log-probability of `cont` teacher-forced after the first prompt_len tokens of seq, whose
// next-token logits are `first`: the sequence is cut back to the prompt (a free-running
// continuation may have extended it; its KV beyond the prompt is overwritten) and cont[0..n-2]
// run in one forward pass with the logits of every row.
absl::StatusOr<double> TeacherForcedLogp(Engine& e, Sequence& seq, int prompt_len,
                                         const std::vector<float>& first,
                                         const std::vector<int32_t>& cont) {
  double lp = LogSoftmax(first)[cont[0]];
  const int n = static_cast<int>(cont.size()) - 1;
  if (n > 0) {
    seq.tokens.resize(prompt_len);
    seq.tokens.insert(seq.tokens.end(), cont.begin(), cont.begin() + n);
    seq.computed = prompt_len;
    const int total = prompt_len + n;
    if (total > e.model().config().max_seq_len) {
      return absl::OutOfRangeError("continuation past the context length");
    }
    RETURN_IF_ERROR(e.EnsureCapacity(seq, total));
    const std::vector<int32_t> ctx = e.CtxSlots(seq, total);
    std::vector<int32_t> pos(n), out(n);
    for (int i = 0; i < n; ++i) {
      pos[i] = prompt_len + i;
      out[i] = i;
    }
    LayerRows rows{pos, std::span<const int32_t>(ctx.data() + prompt_len, n), ctx};
    ASSIGN_OR_RETURN(std::vector<float> logits,
                     e.runner().Forward(std::span<const int32_t>(cont.data(), n), rows, out));
    const size_t vocab = logits.size() / n;
    for (int i = 0; i < n; ++i) {
      lp += LogSoftmax(std::span<const float>(logits.data() + i * vocab, vocab))[cont[i + 1]];
    }
    seq.computed = total;
  }
  return lp / static_cast<double>(cont.size());
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

// Seeded bootstrap over prompts: the same resamples for every setting, so ratios of two
// settings' means are paired.
class Bootstrap {
 public:
  Bootstrap(size_t n, int resamples, uint64_t seed) : idx_(resamples) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<size_t> u(0, n - 1);
    for (auto& v : idx_) {
      v.resize(n);
      for (auto& i : v) i = u(rng);
    }
  }
  // 95% percentile interval of stat(resampled indices).
  template <typename F>
  std::pair<double, double> Interval(F stat) const {
    std::vector<double> s;
    s.reserve(idx_.size());
    for (const auto& v : idx_) s.push_back(stat(v));
    return {Quantile(s, 0.025), Quantile(s, 0.975)};
  }

 private:
  std::vector<std::vector<size_t>> idx_;
};

double MeanOf(const std::vector<PromptResult>& r, double PromptResult::*f,
              const std::vector<size_t>* idx = nullptr) {
  double s = 0;
  const size_t n = idx ? idx->size() : r.size();
  for (size_t i = 0; i < n; ++i) s += r[idx ? (*idx)[i] : i].*f;
  return n ? s / n : 0;
}

// Relative quality drop: (mean logp under full - mean logp under reuse) / |mean logp under full|.
double Drop(const std::vector<PromptResult>& r, const std::vector<Reference>& refs,
            const std::vector<size_t>* idx = nullptr) {
  double full = 0, reuse = 0;
  const size_t n = idx ? idx->size() : r.size();
  for (size_t i = 0; i < n; ++i) {
    const size_t j = idx ? (*idx)[i] : i;
    full += refs[j].cont_logp;
    reuse += r[j].cont_logp;
  }
  return full != 0 ? (full - reuse) / std::abs(full) : 0;
}

// One prompt's relative quality drop.
double PromptDrop(const PromptResult& r, const Reference& ref) {
  return ref.cont_logp != 0 ? (ref.cont_logp - r.cont_logp) / std::abs(ref.cont_logp) : 0;
}

std::string Join(const std::vector<double>& v, const char* fmt) {
  std::string out;
  char buf[64];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof buf, fmt, v[i]);
    if (i) out += ",";
    out += buf;
  }
  return out;
}

}  // namespace

absl::Status Fidelity(const Args& a) {
  auto get = [&](const std::string& k, const std::string& d) {
    auto it = a.find(k);
    return it == a.end() ? d : it->second;
  };
  auto list = [&](const std::string& k, const std::string& d) {
    std::vector<std::string> out;
    std::stringstream ss(get(k, d));
    std::string t;
    while (std::getline(ss, t, ',')) {
      if (!t.empty()) out.push_back(t);
    }
    return out;
  };
  const std::string model_path = get("model", ""), docs_path = get("docs", ""),
                    json_path = get("json", "");
  if (model_path.empty() || docs_path.empty() || json_path.empty()) {
    return absl::InvalidArgumentError("--model, --docs and --json are required");
  }
  const int n_prompts = std::stoi(get("prompts", "50"));  // per seed
  std::vector<uint64_t> seeds;
  for (const std::string& s : list("seeds", get("seed", "1"))) seeds.push_back(std::stoull(s));
  std::vector<int> fl_values;
  for (const std::string& f : list("full-layers", "1,2")) fl_values.push_back(std::stoi(f));
  const std::vector<std::string> encodings = list("encodings", "none,bos");
  const std::vector<std::string> selectors =
      list("selectors", "sparsex,cacheblend,epic,random,prophetkv,a3");
  std::vector<float> ratios;
  for (const std::string& r : list("ratios", "0,0.05,0.10,0.15,0.30,0.50,1.0")) {
    ratios.push_back(std::stof(r));
  }
  SparsexWeights weights;
  {
    std::vector<std::string> w = list("sparsex-weights", "");
    // cross,recv,dev[,product,successor_window,successor_weight]
    if (!w.empty() && w.size() != 3 && w.size() != 6) {
      return absl::InvalidArgumentError(
          "--sparsex-weights takes 3 or 6 values: cross,recv,dev[,product,window,weight]");
    }
    if (w.size() == 3 || w.size() == 6) {
      weights.cross = std::stof(w[0]);
      weights.recv = std::stof(w[1]);
      weights.deviation = std::stof(w[2]);
    }
    if (w.size() == 6) {
      weights.product = std::stof(w[3]);
      weights.successor_window = std::stoi(w[4]);
      weights.successor_weight = std::stof(w[5]);
    }
  }
  const int cont_len = std::stoi(get("continuation", "32"));
  const int resamples = std::stoi(get("bootstrap", "2000"));
  const uint64_t boot_seed = std::stoull(get("bootstrap-seed", "1"));
  if (n_prompts <= 0 || seeds.empty() || cont_len < 1 || resamples < 1 || encodings.empty()) {
    return absl::InvalidArgumentError(
        "--prompts, --seeds, --encodings, --continuation and --bootstrap must be non-empty/>0");
  }
  for (const std::string& s : selectors) RETURN_IF_ERROR(CreateSelector(s).status());
  // The quality budget (docs/fidelity.md): --quality-target T runs it per F (needs
  // --calibration FILE, or the built-in slope); --calibration-out FILE fits the per-F slopes
  // (predicted drop per uncovered score share) from this run's fixed-ratio settings of the
  // first selector: the --calibration-quantile (default 0.9) of per-prompt drop / uncovered.
  const double quality_target = std::stod(get("quality-target", "-1"));
  QualityCalibration calibration;
  if (a.count("calibration")) {
    ASSIGN_OR_RETURN(calibration, LoadQualityCalibration(get("calibration", "")));
  }
  const double calib_q = std::stod(get("calibration-quantile", "0.9"));

  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(model_path));
  if (!calibration.model_fingerprint.empty() &&
      calibration.model_fingerprint != model->fingerprint().Hex()) {
    return absl::InvalidArgumentError(absl::StrCat("--calibration was measured on model ",
                                                   calibration.model_fingerprint, ", not on ",
                                                   model_path));
  }
  // --context N: run as if the model's context length were N (e.g. stories260K's trained 512;
  // its GGUF says 2048).
  if (a.count("context")) {
    const int c = std::stoi(get("context", "0"));
    if (c < 2) return absl::InvalidArgumentError("--context must be at least 2");
    model->config_.max_seq_len = c;
  }
  const int context = model->config().max_seq_len;
  // Prompt + continuation stay within max_len (default 512, stories260K's trained length).
  const int max_len = std::min(context, std::stoi(get("max-len", "512")));
  const int prompt_budget = max_len - cont_len;
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

  std::vector<Prompt> prompts;
  int skipped = 0, shortened = 0;
  std::vector<std::string> skip_reasons;
  for (uint64_t seed : seeds) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < n_prompts; ++i) {
      Prompt p;
      p.seed = seed;
      p.index = i;
      const int k = std::uniform_int_distribution<int>(4, 6)(rng);
      std::vector<int> idx(docs.size());
      for (size_t j = 0; j < idx.size(); ++j) idx[j] = static_cast<int>(j);
      std::shuffle(idx.begin(), idx.end(), rng);
      // A new, question-like suffix: the opening words of another document.
      const auto& q = docs[idx[k]];
      const int qlen = std::uniform_int_distribution<int>(8, 20)(rng);
      p.question.assign(q.begin(), q.begin() + std::min<size_t>(qlen, q.size()));
      int total = 1 + static_cast<int>(p.question.size());  // BOS + question
      for (int j = 0; j < k; ++j) {
        const int d = static_cast<int>(docs[idx[j]].size());
        if (total + d > prompt_budget) continue;  // shortened: this document does not fit
        p.docs.push_back(docs[idx[j]]);
        total += d;
      }
      if (p.docs.empty()) {
        ++skipped;
        continue;
      }
      if (static_cast<int>(p.docs.size()) < k) ++shortened;
      p.tokens = total;
      prompts.push_back(std::move(p));
    }
  }

  EngineOptions eo;
  eo.kv.enable_prefix_caching = false;  // references and settings must not share KV
  eo.kv.num_blocks = std::max(256, (max_len + 15) / 16 + 8);
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(*model, eo));
  SegmentStore store({});
  ReuseEngine reuse(engine.get(), &store, {});

  // Full-prefill references. A prompt the engine refuses is skipped (counted, with the reason).
  std::vector<Reference> refs;
  {
    std::vector<Prompt> kept;
    for (Prompt& p : prompts) {
      std::vector<PromptSegment> segs;
      for (const auto& d : p.docs) segs.push_back({d, false});
      segs.push_back({p.question, false});
      ReuseOptions full;
      full.enable_reuse = false;
      auto run = [&]() -> absl::StatusOr<Reference> {
        ASSIGN_OR_RETURN(ReusePrefillResult r, reuse.Prefill(segs, true, &full));
        Reference ref;
        ref.logp = LogSoftmax(r.logits);
        ref.top1 = Argmax(r.logits);
        auto g = Greedy(*engine, r.seq, r.logits, cont_len);
        absl::StatusOr<double> lp = absl::UnknownError("no continuation");
        if (!g.ok()) lp = g.status();
        if (g.ok()) {
          ref.greedy = *g;
          lp = TeacherForcedLogp(*engine, r.seq, p.tokens, r.logits, ref.greedy);
        }
        engine->Release(r.seq);
        RETURN_IF_ERROR(lp.status());
        ref.cont_logp = *lp;
        return ref;
      };
      absl::StatusOr<Reference> ref = run();
      if (!ref.ok()) {
        ++skipped;
        skip_reasons.push_back(absl::StrCat("seed ", p.seed, " prompt ", p.index, ": ",
                                            ref.status().ToString()));
        continue;
      }
      refs.push_back(std::move(*ref));
      kept.push_back(std::move(p));
    }
    prompts = std::move(kept);
  }
  if (prompts.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no prompt fits in ", max_len, " tokens with a ", cont_len, "-token continuation"));
  }
  const size_t n = prompts.size();
  std::printf("%zu prompts (seeds %s, %d per seed; %d shortened, %d skipped), sequence limit %d "
              "(context %d), continuation %d\n",
              n, get("seeds", get("seed", "1")).c_str(), n_prompts, shortened, skipped, max_len,
              context, cont_len);

  // Settings. r = 0 and r = 1 do not depend on the selector: measured once per F and encoding
  // (under the first selector) and reported for every selector.
  std::vector<Setting> settings;
  for (const std::string& enc : encodings) {
    settings.push_back({"naive", 0, enc, 0.0f});
    for (int F : fl_values) {
      for (const std::string& sel : selectors) {
        // Encodings other than the first are compared at the default selector only.
        if (enc != encodings[0] && sel != "sparsex") continue;
        for (float r : ratios) settings.push_back({sel, F, enc, r});
      }
      // --quality-target T: the quality budget (BudgetOptions::kQuality) with the first
      // selector, labelled "quality", ratio -1.
      if (quality_target >= 0 && enc == encodings[0]) settings.push_back({"quality", F, enc, -1});
    }
  }
  std::map<std::tuple<int, std::string, float>, size_t> shared;  // (F, enc, r) -> result index
  std::vector<std::vector<PromptResult>> results(settings.size());
  std::vector<size_t> jobs, copy_from(settings.size(), settings.size());
  for (size_t si = 0; si < settings.size(); ++si) {
    const Setting& s = settings[si];
    const bool selector_free = s.selector != "naive" && (s.ratio == 0.0f || s.ratio == 1.0f);
    const auto key = std::make_tuple(s.full_layers, s.encoding, s.ratio);
    if (selector_free && shared.count(key)) {
      copy_from[si] = shared[key];
      continue;
    }
    if (selector_free) shared[key] = si;
    jobs.push_back(si);
  }
  auto print_row = [&](size_t si) {
    const Setting& s = settings[si];
    std::vector<double> kls;
    for (const PromptResult& p : results[si]) kls.push_back(p.kl);
    std::printf("%-16s %2d %-5s %5.2f  %8.5f %8.5f %8.5f  %5.3f  %6.3f  %6.3f  %7.4f\n",
                s.selector.c_str(), s.full_layers, s.encoding.c_str(), s.ratio,
                MeanOf(results[si], &PromptResult::kl), Quantile(kls, 0.5), Quantile(kls, 0.95),
                MeanOf(results[si], &PromptResult::top1),
                MeanOf(results[si], &PromptResult::greedy),
                MeanOf(results[si], &PromptResult::share), Drop(results[si], refs));
    std::fflush(stdout);
  };
  // One setting over every prompt, on an engine of its own (settings run on --threads workers;
  // the CPU backend is single-threaded per engine, and each worker has its own engine, store
  // and stored segments, so results do not depend on the thread count).
  auto run_setting = [&](Engine& eng, ReuseEngine& ru, size_t si) -> absl::Status {
    const Setting& s = settings[si];
    ReuseOptions o;
    o.encoding = s.encoding;
    o.full_layers = s.full_layers;
    o.selector = s.selector == "naive" ? "random" : s.selector;
    o.budget.ratio = s.ratio;
    if (s.selector == "quality") {
      o.selector = selectors[0];
      o.budget.ratio = 0.15f;  // unused in quality mode (the setting's -1 labels it)
      o.budget.mode = BudgetOptions::Mode::kQuality;
      o.budget.target_drop = static_cast<float>(quality_target);
      o.calibration = calibration;
    }
    o.store_new_segments = false;
    o.seed = prompts[0].seed;
    o.sparsex_weights = weights;
    o.stats_all_full_layers = get("stats-layers", "all") == "all";
    // Naive reuse recomputes nothing, layer F's K/V included.
    o.refresh_first_sparse_kv = get("refresh-kv", "1") != "0" && s.selector != "naive";
    std::vector<PromptResult> out;
    for (size_t i = 0; i < n; ++i) {
      std::vector<PromptSegment> segs;
      for (const auto& d : prompts[i].docs) {
        RETURN_IF_ERROR(ru.EnsureStored(d, &o));  // stored by an "earlier request"
        segs.push_back({d, true});
      }
      segs.push_back({prompts[i].question, false});
      ASSIGN_OR_RETURN(ReusePrefillResult r, ru.Prefill(segs, true, &o));
      PromptResult pr;
      pr.kl = Kl(refs[i].logp, LogSoftmax(r.logits));
      pr.top1 = Argmax(r.logits) == refs[i].top1 ? 1.0 : 0.0;
      pr.share = r.stats.compute_share;
      pr.uncovered = r.stats.uncovered_share;
      pr.predicted = r.stats.predicted_drop;
      auto g = Greedy(eng, r.seq, r.logits, cont_len);
      absl::StatusOr<double> lp = absl::UnknownError("no continuation");
      if (!g.ok()) lp = g.status();
      if (g.ok()) {
        int same = 0;
        for (int t = 0; t < cont_len; ++t) same += (*g)[t] == refs[i].greedy[t];
        pr.greedy = same / static_cast<double>(cont_len);
        lp = TeacherForcedLogp(eng, r.seq, prompts[i].tokens, r.logits, refs[i].greedy);
      }
      eng.Release(r.seq);
      RETURN_IF_ERROR(lp.status());
      pr.cont_logp = *lp;
      out.push_back(pr);
    }
    results[si] = std::move(out);
    return absl::OkStatus();
  };
  std::printf("%-16s %2s %-5s %5s  %8s %8s %8s  %5s  %6s  %6s  %7s\n", "selector", "F", "enc",
              "r", "kl_mean", "kl_med", "kl_p95", "top1", "greedy", "share", "drop");
  const int threads = std::max(1, std::min<int>(std::stoi(get("threads", "1")),
                                                static_cast<int>(jobs.size())));
  std::atomic<size_t> next{0};
  std::mutex mu;
  absl::Status failed;
  auto worker = [&]() {
    absl::StatusOr<std::unique_ptr<Engine>> eng = Engine::Create(*model, eo);
    if (!eng.ok()) {
      std::lock_guard<std::mutex> l(mu);
      failed.Update(eng.status());
      return;
    }
    SegmentStore st({});
    ReuseEngine ru(eng->get(), &st, {});
    for (size_t j; (j = next++) < jobs.size();) {
      absl::Status s = run_setting(**eng, ru, jobs[j]);
      std::lock_guard<std::mutex> l(mu);
      if (!s.ok()) {
        failed.Update(s);
        return;
      }
      print_row(jobs[j]);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker);
  for (std::thread& t : pool) t.join();
  RETURN_IF_ERROR(failed);
  for (size_t si = 0; si < settings.size(); ++si) {
    if (copy_from[si] < settings.size()) results[si] = results[copy_from[si]];
  }

  // ---- statistics and JSON ----
  const Bootstrap boot(n, resamples, boot_seed);
  std::map<std::string, size_t> naive_of;                        // encoding -> naive setting
  std::map<std::tuple<int, std::string, float>, size_t> sx_of;  // (F, enc, r) -> sparsex
  for (size_t si = 0; si < settings.size(); ++si) {
    const Setting& s = settings[si];
    if (s.selector == "naive") naive_of[s.encoding] = si;
    if (s.selector == "sparsex") sx_of[{s.full_layers, s.encoding, s.ratio}] = si;
  }
  auto kl_of = [&](size_t si, const std::vector<size_t>& idx) {
    return MeanOf(results[si], &PromptResult::kl, &idx);
  };

  std::FILE* js = std::fopen(json_path.c_str(), "w");
  if (js == nullptr) return absl::InternalError(absl::StrCat("cannot write ", json_path));
  std::string command = "sparsex fidelity";
  for (const auto& [k, v] : a) command += " --" + k + " " + v;
  std::fprintf(js, "{\n\"command\": \"%s\",\n", command.c_str());
  std::fprintf(js,
               "\"context\": %d, \"max_len\": %d, \"continuation\": %d, \"seeds\": [%s], "
               "\"prompts_per_seed\": %d,\n\"prompts\": %zu, \"prompts_shortened\": %d, "
               "\"prompts_skipped\": %d,\n\"bootstrap\": {\"resamples\": %d, \"seed\": %llu, "
               "\"interval\": 0.95},\n",
               context, max_len, cont_len, get("seeds", get("seed", "1")).c_str(), n_prompts, n,
               shortened, skipped, resamples, static_cast<unsigned long long>(boot_seed));
  std::fprintf(js, "\"skip_reasons\": [");
  for (size_t i = 0; i < skip_reasons.size(); ++i) {
    std::string r = skip_reasons[i];
    std::replace(r.begin(), r.end(), '"', '\'');
    std::fprintf(js, "%s\"%s\"", i ? ", " : "", r.c_str());
  }
  std::fprintf(js, "],\n\"prompt_records\": [\n");
  for (size_t i = 0; i < n; ++i) {
    std::fprintf(js,
                 "%s  {\"seed\": %llu, \"index\": %d, \"docs\": %zu, \"tokens\": %d, "
                 "\"ref_cont_logp\": %.6g}",
                 i ? ",\n" : "", static_cast<unsigned long long>(prompts[i].seed),
                 prompts[i].index, prompts[i].docs.size(), prompts[i].tokens,
                 refs[i].cont_logp);
  }
  std::fprintf(js, "\n],\n\"settings\": [\n");
  for (size_t si = 0; si < settings.size(); ++si) {
    const Setting& s = settings[si];
    const std::vector<PromptResult>& r = results[si];
    std::vector<double> kls, top1, greedy, share, lp, unc;
    for (const PromptResult& p : r) {
      unc.push_back(p.uncovered);
      kls.push_back(p.kl);
      top1.push_back(p.top1);
      greedy.push_back(p.greedy);
      share.push_back(p.share);
      lp.push_back(p.cont_logp);
    }
    const double kl_mean = MeanOf(r, &PromptResult::kl);
    const auto kl_ci = boot.Interval([&](const auto& idx) { return kl_of(si, idx); });
    const double drop = Drop(r, refs);
    const auto drop_ci = boot.Interval([&](const auto& idx) { return Drop(r, refs, &idx); });
    const size_t nv = naive_of[s.encoding];
    const double naive_mean = MeanOf(results[nv], &PromptResult::kl);
    const auto vs_naive_ci = boot.Interval([&](const auto& idx) {
      const double d = kl_of(nv, idx);
      return d > 0 ? kl_of(si, idx) / d : 0.0;
    });
    std::string paired;
    if (s.selector == "quality") {
      // Share of prompts whose own drop exceeds the target, mean share, with intervals.
      auto exceed = [&](const std::vector<size_t>* idx) {
        const size_t m = idx ? idx->size() : r.size();
        double c = 0;
        for (size_t i = 0; i < m; ++i) {
          const size_t k = idx ? (*idx)[i] : i;
          c += PromptDrop(r[k], refs[k]) > quality_target;
        }
        return m ? c / m : 0.0;
      };
      const auto ex_ci = boot.Interval([&](const auto& idx) { return exceed(&idx); });
      const auto sh_ci = boot.Interval(
          [&](const auto& idx) { return MeanOf(r, &PromptResult::share, &idx); });
      char buf[320];
      std::snprintf(buf, sizeof buf,
                    ", \"quality_target\": %.4f, \"exceed_share\": %.4f, \"exceed_share_ci\": "
                    "[%.4f, %.4f], \"compute_share_ci\": [%.4f, %.4f], \"predicted_drop_mean\": "
                    "%.5f",
                    quality_target, exceed(nullptr), ex_ci.first, ex_ci.second, sh_ci.first,
                    sh_ci.second, MeanOf(r, &PromptResult::predicted));
      paired = buf;
      std::printf("quality budget F=%d target %.4f: mean share %.4f [%.4f, %.4f], prompts over "
                  "target %.4f [%.4f, %.4f], pooled drop %.5f, mean predicted %.5f\n",
                  s.full_layers, quality_target, MeanOf(r, &PromptResult::share), sh_ci.first,
                  sh_ci.second, exceed(nullptr), ex_ci.first, ex_ci.second, Drop(r, refs),
                  MeanOf(r, &PromptResult::predicted));
    }
    auto sx = sx_of.find({s.full_layers, s.encoding, s.ratio});
    if (s.selector != "sparsex" && s.selector != "naive" && sx != sx_of.end()) {
      const double d = MeanOf(results[sx->second], &PromptResult::kl);
      const auto ci = boot.Interval([&](const auto& idx) {
        const double dd = kl_of(sx->second, idx);
        return dd > 0 ? kl_of(si, idx) / dd : 0.0;
      });
      char buf[160];
      std::snprintf(buf, sizeof buf, ", \"kl_vs_sparsex\": %.4f, \"kl_vs_sparsex_ci\": [%.4f, %.4f]",
                    d > 0 ? kl_mean / d : 0.0, ci.first, ci.second);
      paired = buf;
    }
    std::fprintf(
        js,
        "%s  {\"selector\": \"%s\", \"full_layers\": %d, \"encoding\": \"%s\", \"ratio\": %.2f, "
        "\"kl_mean\": %.6f, \"kl_mean_ci\": [%.6f, %.6f], \"kl_median\": %.6f, \"kl_p95\": %.6f, "
        "\"kl_vs_naive\": %.4f, \"kl_vs_naive_ci\": [%.4f, %.4f]%s, "
        "\"top1_agree\": %.4f, \"greedy32_agree\": %.4f, \"compute_share\": %.4f, "
        "\"quality_drop\": %.5f, \"quality_drop_ci\": [%.5f, %.5f], \"prompts\": %zu,\n"
        "   \"per_prompt\": {\"kl\": [%s],\n    \"top1\": [%s],\n    \"greedy32\": [%s],\n"
        "    \"share\": [%s],\n    \"uncovered\": [%s],\n    \"cont_logp\": [%s]}}",
        si ? ",\n" : "", s.selector.c_str(), s.full_layers, s.encoding.c_str(), s.ratio, kl_mean,
        kl_ci.first, kl_ci.second, Quantile(kls, 0.5), Quantile(kls, 0.95),
        naive_mean > 0 ? kl_mean / naive_mean : 0.0, vs_naive_ci.first, vs_naive_ci.second,
        paired.c_str(), MeanOf(r, &PromptResult::top1),
        MeanOf(r, &PromptResult::greedy), MeanOf(r, &PromptResult::share), drop, drop_ci.first,
        drop_ci.second, n, Join(kls, "%.4g").c_str(), Join(top1, "%.0f").c_str(),
        Join(greedy, "%.4g").c_str(), Join(share, "%.4g").c_str(), Join(unc, "%.4g").c_str(),
        Join(lp, "%.6g").c_str());
  }
  std::fprintf(js, "\n],\n");

  // Smallest compute share at which the relative quality drop is at most 1% (QCFuse's bar),
  // per selector, F and encoding: the first ratio whose drop is <= 1% (point estimate), the
  // share linearly interpolated between it and the ratio before, and the first ratio whose
  // interval's upper end is <= 1% (the conservative reading).
  std::fprintf(js, "\"drop_1pct\": [\n");
  std::printf("\nsmallest compute share with relative quality drop <= 1%%:\n");
  std::map<std::tuple<std::string, int, std::string>, std::vector<size_t>> curves;
  for (size_t si = 0; si < settings.size(); ++si) {
    const Setting& s = settings[si];
    if (s.selector == "naive" || s.selector == "quality") continue;
    curves[{s.selector, s.full_layers, s.encoding}].push_back(si);
  }
  bool first = true;
  for (auto& [key, idxs] : curves) {
    std::sort(idxs.begin(), idxs.end(),
              [&](size_t x, size_t y) { return settings[x].ratio < settings[y].ratio; });
    double share = -1, ratio = -1, interp = -1, share_ci = -1, ratio_ci = -1;
    double prev_share = -1, prev_drop = 0;
    for (size_t si : idxs) {
      const std::vector<PromptResult>& r = results[si];
      const double d = Drop(r, refs), sh = MeanOf(r, &PromptResult::share);
      if (share < 0 && d <= 0.01) {
        share = sh;
        ratio = settings[si].ratio;
        interp = prev_share < 0 || prev_drop == d
                     ? sh
                     : prev_share + (sh - prev_share) * (prev_drop - 0.01) / (prev_drop - d);
      }
      if (share_ci < 0 &&
          boot.Interval([&](const auto& idx) { return Drop(r, refs, &idx); }).second <= 0.01) {
        share_ci = sh;
        ratio_ci = settings[si].ratio;
      }
      prev_share = sh;
      prev_drop = d;
    }
    const auto& [sel, F, enc] = key;
    auto num = [](double v) { return v < 0 ? std::string("null") : absl::StrCat(v); };
    std::fprintf(js,
                 "%s  {\"selector\": \"%s\", \"full_layers\": %d, \"encoding\": \"%s\", "
                 "\"ratio\": %s, \"share\": %s, \"share_interpolated\": %s, "
                 "\"ratio_ci_upper\": %s, \"share_ci_upper\": %s}",
                 first ? "" : ",\n", sel.c_str(), F, enc.c_str(), num(ratio).c_str(),
                 num(share).c_str(), num(interp).c_str(), num(ratio_ci).c_str(),
                 num(share_ci).c_str());
    std::printf("  %-16s F=%d %-5s share %s (r %s, interpolated %s; upper CI <= 1%%: share %s)\n",
                sel.c_str(), F, enc.c_str(), num(share).c_str(), num(ratio).c_str(),
                num(interp).c_str(), num(share_ci).c_str());
    first = false;
  }
  std::fprintf(js, "\n]\n}\n");
  std::fclose(js);

  if (a.count("calibration-out")) {
    // Per F: the calib_q quantile of per-prompt drop / uncovered share over the fixed-ratio
    // settings (0 < r < 1) of the first selector and encoding.
    std::map<int, std::vector<double>> ratios_of;
    for (size_t si = 0; si < settings.size(); ++si) {
      const Setting& s = settings[si];
      if (s.selector != selectors[0] || s.encoding != encodings[0] || s.ratio <= 0 ||
          s.ratio >= 1) {
        continue;
      }
      for (size_t i = 0; i < n; ++i) {
        const double u = results[si][i].uncovered;
        if (u > 0.01) ratios_of[s.full_layers].push_back(PromptDrop(results[si][i], refs[i]) / u);
      }
    }
    const std::string out = get("calibration-out", "");
    std::FILE* cf = std::fopen(out.c_str(), "w");
    if (cf == nullptr) return absl::InternalError(absl::StrCat("cannot write ", out));
    std::fprintf(cf, "{\"selector\": \"%s\", \"encoding\": \"%s\", \"quantile\": %.3f, "
                 "\"prompts\": %zu,\n \"model\": \"%s\",\n \"model_fingerprint\": \"%s\",\n "
                 "\"drop_per_uncovered\": {",
                 selectors[0].c_str(), encodings[0].c_str(), calib_q, n, model_path.c_str(),
                 model->fingerprint().Hex().c_str());
    bool first_f = true;
    for (const auto& [F, v] : ratios_of) {
      const double slope = std::max(1e-4, Quantile(v, calib_q));
      std::fprintf(cf, "%s\"%d\": %.5f", first_f ? "" : ", ", F, slope);
      std::printf("calibration F=%d: drop per uncovered share %.5f (q %.2f of %zu)\n", F, slope,
                  calib_q, v.size());
      first_f = false;
    }
    std::fprintf(cf, "}}\n");
    std::fclose(cf);
  }
  return absl::OkStatus();
}

}  // namespace sparsex::cli
