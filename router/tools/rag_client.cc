// sparsex-rag: a RAG workload over the public gRPC API (the demo's client).
//
// Documents come from a text file (paragraphs merged to about --doc_chars characters); each
// request takes --docs_per_request distinct documents drawn with Zipf popularity (exponent
// --zipf) from a pool of --pool documents, in random order, followed by a question segment.
// Every request runs with segment reuse; a sample of them (--fidelity_every) runs again with
// reuse disabled (the baseline: full prefill, exact prefix cache only) and its greedy output
// is compared token by token. Prints a progress line, then a table.
//
//   sparsex-rag --target 127.0.0.1:50051 --requests 60 --docs $SPARSEX_MODELS/tinystories-text/tinystories_sample.txt
//
// A router with API keys needs one: --api_key, or $SPARSEX_API_KEY (which keeps it out of the
// process list); it goes out as gRPC metadata "authorization: Bearer <key>" on every call.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "proto/sparsex.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = sparsex::v1;

struct Result {
  bool ok = false;
  std::string error;
  double ttft_ms = 0, total_ms = 0;
  std::vector<int32_t> ids;
  v1::Usage usage;
  std::string worker;
};

// The router's credential on every call; "" sends none (a router without API keys).
std::string g_authorization;

void Authorize(grpc::ClientContext* ctx) {
  if (!g_authorization.empty()) ctx->AddMetadata("authorization", g_authorization);
}

Result Run(v1::SparseX::Stub* stub, const v1::GenerateRequest& req, int timeout_ms) {
  Result r;
  grpc::ClientContext ctx;
  Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  const Clock::time_point t0 = Clock::now();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse m;
  bool first = true;
  while (reader->Read(&m)) {
    if (first) {
      r.ttft_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      first = false;
    }
    r.ids.insert(r.ids.end(), m.token_ids().begin(), m.token_ids().end());
    if (m.finished()) {
      r.usage = m.usage();
      r.worker = m.worker();
    }
  }
  grpc::Status s = reader->Finish();
  r.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  r.ok = s.ok();
  if (!s.ok()) r.error = s.error_message();
  return r;
}

std::vector<std::string> LoadDocs(const std::string& path, size_t doc_chars, size_t max_docs) {
  std::ifstream in(path);
  std::vector<std::string> docs;
  std::string line, para, cur;
  auto flush_para = [&] {
    if (para.empty()) return;
    cur += (cur.empty() ? "" : "\n") + para;
    para.clear();
    if (cur.size() >= doc_chars) {
      docs.push_back(cur);
      cur.clear();
    }
  };
  while (std::getline(in, line) && docs.size() < max_docs) {
    if (line.empty()) flush_para();
    else para += (para.empty() ? "" : " ") + line;
  }
  flush_para();
  return docs;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p * (v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(idx)), hi = static_cast<size_t>(std::ceil(idx));
  return v[lo] + (v[hi] - v[lo]) * (idx - lo);
}

double Mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
}

}  // namespace

int main(int argc, char** argv) {
  std::string target = "127.0.0.1:50051", docs_path, json_path, ids_path, model, api_key;
  if (const char* k = std::getenv("SPARSEX_API_KEY")) api_key = k;
  int requests = 60, pool = 40, per_request = 3, max_tokens = 24, fidelity_every = 3;
  int doc_chars = 500, timeout_ms = 60000, wait_ready_s = 60;
  uint64_t seed = 1;
  double zipf = 1.1;
  bool progress = true;
  sparsex::FlagSet f("sparsex-rag");
  f.Add("target", &target, "router gRPC address");
  f.Add("api_key", &api_key,
        "API key sent as \"authorization: Bearer <key>\" (default: $SPARSEX_API_KEY; \"\" = none)");
  f.Add("model", &model, "model name (\"\" = the router's)");
  f.Add("docs", &docs_path, "document text file (paragraphs)");
  f.Add("requests", &requests, "requests to send");
  f.Add("pool", &pool, "documents in the pool");
  f.Add("docs_per_request", &per_request, "documents per request");
  f.Add("doc_chars", &doc_chars, "characters per document (paragraphs are merged)");
  f.Add("zipf", &zipf, "Zipf exponent of document popularity");
  f.Add("max_tokens", &max_tokens, "tokens generated per request (greedy)");
  f.Add("fidelity_every", &fidelity_every, "run the no-reuse baseline on every n-th request");
  f.Add("seed", &seed, "workload seed");
  f.Add("timeout_ms", &timeout_ms, "per-request deadline");
  f.Add("wait_ready_s", &wait_ready_s, "wait this long for a healthy cluster");
  f.Add("json", &json_path, "also write the summary as JSON here");
  f.Add("ids_out", &ids_path,
        "also write every request's greedy token ids here, one line each: <index> reuse|base "
        "<ids...> (compares clusters, e.g. the GPU's full prefill with the CPU's)");
  f.Add("progress", &progress, "show a progress line on stderr");
  if (auto s = f.Parse(argc, argv); !s.ok() || docs_path.empty()) {
    std::cerr << "sparsex-rag: " << (s.ok() ? "--docs is required" : std::string(s.message()))
              << "\n" << f.Usage();
    return 2;
  }
  if (f.help()) {
    std::cout << f.Usage();
    return 0;
  }
  // Whitespace around a key read from a file (a trailing newline) is not part of it.
  api_key.erase(0, api_key.find_first_not_of(" \t\r\n"));
  api_key.erase(api_key.find_last_not_of(" \t\r\n") + 1);
  if (api_key.find_first_of(" \t\r\n") != std::string::npos) {
    std::cerr << "sparsex-rag: --api_key contains whitespace\n";
    return 2;
  }
  if (!api_key.empty()) g_authorization = "Bearer " + api_key;
  std::vector<std::string> docs = LoadDocs(docs_path, static_cast<size_t>(doc_chars),
                                           static_cast<size_t>(pool));
  if (static_cast<int>(docs.size()) < per_request) {
    std::cerr << "sparsex-rag: only " << docs.size() << " documents in " << docs_path << "\n";
    return 1;
  }
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = v1::SparseX::NewStub(channel);
  // Wait for a serving cluster.
  const Clock::time_point ready_deadline = Clock::now() + std::chrono::seconds(wait_ready_s);
  for (;;) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::HealthResponse h;
    grpc::Status hs = stub->Health(&ctx, v1::HealthRequest(), &h);
    if (hs.ok() && h.serving()) break;
    // A wrong or missing key does not get better by waiting.
    if (hs.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
        hs.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      std::cerr << "sparsex-rag: " << target << " refused the credentials: "
                << hs.error_message()
                << (api_key.empty() ? " (no key given: --api_key or $SPARSEX_API_KEY)" : "")
                << "\n";
      return 1;
    }
    if (Clock::now() > ready_deadline) {
      std::cerr << "sparsex-rag: no healthy cluster at " << target << "\n";
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }

  // Zipf popularity over the pool (rank r has weight 1 / r^s).
  std::vector<double> w(docs.size());
  for (size_t i = 0; i < w.size(); ++i) w[i] = 1.0 / std::pow(static_cast<double>(i + 1), zipf);
  std::mt19937_64 rng(seed);
  std::discrete_distribution<int> pick(w.begin(), w.end());
  static const char* kQuestions[] = {
      "Question: What did they learn?\nAnswer:", "Question: Who was happy and why?\nAnswer:",
      "Question: What happened at the end?\nAnswer:", "Question: Where did they go?\nAnswer:",
      "Question: What did the little girl find?\nAnswer:", "Question: Why was everyone sad?\nAnswer:"};

  std::vector<double> ttft_reuse, ttft_reuse_sampled, ttft_base, worker_ttft_reuse, worker_ttft_base;
  int64_t reused = 0, recomputed = 0, fresh = 0, prefix = 0, prompt = 0, fetched = 0, fetch_fail = 0;
  int ok = 0, failed = 0, samples = 0, exact = 0, first_agree = 0;
  double agree_sum = 0, position_sum = 0;
  std::string last_error;
  std::ofstream ids_out;
  if (!ids_path.empty()) ids_out.open(ids_path);
  auto write_ids = [&](int i, const char* kind, const std::vector<int32_t>& ids) {
    if (!ids_out.is_open()) return;
    ids_out << i << ' ' << kind;
    for (int32_t t : ids) ids_out << ' ' << t;
    ids_out << '\n';
  };
  for (int i = 0; i < requests; ++i) {
    std::vector<int> chosen;
    while (static_cast<int>(chosen.size()) < per_request) {
      int d = pick(rng);
      if (std::find(chosen.begin(), chosen.end(), d) == chosen.end()) chosen.push_back(d);
    }
    std::shuffle(chosen.begin(), chosen.end(), rng);
    v1::GenerateRequest req;
    req.set_model(model);
    for (int d : chosen) req.add_segments()->set_text(docs[d] + "\n");
    v1::Segment* q = req.add_segments();
    q->set_text(kQuestions[rng() % (sizeof kQuestions / sizeof *kQuestions)]);
    q->set_cacheable(false);
    req.mutable_sampling()->set_temperature(0);
    req.mutable_sampling()->set_max_tokens(max_tokens);
    req.set_return_token_ids(true);
    req.set_request_id("rag-" + std::to_string(i));
    Result r = Run(stub.get(), req, timeout_ms);
    if (!r.ok) {
      ++failed;
      last_error = r.error;
    } else {
      ++ok;
      write_ids(i, "reuse", r.ids);
      ttft_reuse.push_back(r.ttft_ms);
      reused += r.usage.reused_tokens();
      recomputed += r.usage.recomputed_tokens();
      fresh += r.usage.new_tokens();
      prefix += r.usage.prefix_tokens();
      prompt += r.usage.prompt_tokens();
      fetched += r.usage.segments_fetched();
      fetch_fail += r.usage.fetch_failures();
      if (fidelity_every > 0 && i % fidelity_every == fidelity_every - 1) {
        v1::GenerateRequest base = req;
        base.mutable_reuse()->set_enable(false);
        base.mutable_reuse()->set_register_prefix(false);  // leave no trace for later requests
        base.set_request_id("rag-" + std::to_string(i) + "-base");
        Result b = Run(stub.get(), base, timeout_ms);
        if (b.ok) {
          ++samples;
          write_ids(i, "base", b.ids);
          ttft_base.push_back(b.ttft_ms);
          worker_ttft_base.push_back(b.usage.ttft_ms());
          ttft_reuse_sampled.push_back(r.ttft_ms);
          worker_ttft_reuse.push_back(r.usage.ttft_ms());
          size_t n = std::max(r.ids.size(), b.ids.size()), same = 0;
          while (same < std::min(r.ids.size(), b.ids.size()) && r.ids[same] == b.ids[same]) ++same;
          exact += (r.ids == b.ids) ? 1 : 0;
          first_agree += (!r.ids.empty() && !b.ids.empty() && r.ids[0] == b.ids[0]) ? 1 : 0;
          agree_sum += n > 0 ? static_cast<double>(same) / n : 1.0;
          size_t pos_same = 0;
          for (size_t k = 0; k < std::min(r.ids.size(), b.ids.size()); ++k) pos_same += r.ids[k] == b.ids[k];
          position_sum += n > 0 ? static_cast<double>(pos_same) / n : 1.0;
        }
      }
    }
    if (progress) {
      std::fprintf(stderr, "\r[%3d/%d] ok %d failed %d | ttft %.1f ms (reuse) | reused %lld new %lld | fidelity samples %d   ",
                   i + 1, requests, ok, failed, Mean(ttft_reuse), static_cast<long long>(reused),
                   static_cast<long long>(fresh), samples);
      std::fflush(stderr);
    }
  }
  if (progress) std::fprintf(stderr, "\n");

  auto pct = [](int64_t a, int64_t b) { return b > 0 ? 100.0 * a / b : 0.0; };
  std::printf("\nSparseX RAG workload: %d requests (%d ok, %d failed), %d documents in the pool, "
              "%d per request, Zipf s=%.2f, greedy %d tokens\n",
              requests, ok, failed, static_cast<int>(docs.size()), per_request, zipf, max_tokens);
  std::printf("+----------------------------------------+--------------+--------------+\n");
  std::printf("| %-38s | %12s | %12s |\n", "TTFT (client, ms)", "with reuse", "no reuse");
  std::printf("+----------------------------------------+--------------+--------------+\n");
  std::printf("| %-38s | %12.2f | %12s |\n", "mean, all requests", Mean(ttft_reuse), "-");
  std::printf("| %-38s | %12.2f | %12.2f |\n", "mean, fidelity sample (same prompts)",
              Mean(ttft_reuse_sampled), Mean(ttft_base));
  std::printf("| %-38s | %12.2f | %12.2f |\n", "p50, fidelity sample",
              Percentile(ttft_reuse_sampled, 0.5), Percentile(ttft_base, 0.5));
  std::printf("| %-38s | %12.2f | %12.2f |\n", "p90, fidelity sample",
              Percentile(ttft_reuse_sampled, 0.9), Percentile(ttft_base, 0.9));
  std::printf("| %-38s | %12.2f | %12.2f |\n", "worker-side mean, fidelity sample",
              Mean(worker_ttft_reuse), Mean(worker_ttft_base));
  std::printf("+----------------------------------------+--------------+--------------+\n");
  std::printf("| %-38s | %12lld | %11.1f%% |\n", "prompt tokens", static_cast<long long>(prompt), 100.0);
  std::printf("| %-38s | %12lld | %11.1f%% |\n", "exact prefix-cache tokens", static_cast<long long>(prefix), pct(prefix, prompt));
  std::printf("| %-38s | %12lld | %11.1f%% |\n", "reused tokens (segment KV)", static_cast<long long>(reused), pct(reused, prompt));
  std::printf("| %-38s | %12lld | %11.1f%% |\n", "  of which recomputed (sparse)", static_cast<long long>(recomputed), pct(recomputed, reused));
  std::printf("| %-38s | %12lld | %11.1f%% |\n", "new tokens (computed)", static_cast<long long>(fresh), pct(fresh, prompt));
  std::printf("| %-38s | %12lld | %12s |\n", "segments fetched from cache servers", static_cast<long long>(fetched), "");
  std::printf("| %-38s | %12lld | %12s |\n", "fetch failures (recomputed)", static_cast<long long>(fetch_fail), "");
  std::printf("+----------------------------------------+--------------+--------------+\n");
  std::printf("| %-38s | %12d | %12s |\n", "fidelity sample (vs full prefill)", samples, "");
  std::printf("| %-38s | %11.1f%% | %12s |\n", "first token agrees", pct(first_agree, samples), "");
  std::printf("| %-38s | %11.1f%% | %12s |\n", "greedy output identical", pct(exact, samples), "");
  std::printf("| %-38s | %11.1f%% | %12s |\n", "greedy tokens agreeing (position-wise)",
              samples > 0 ? 100.0 * position_sum / samples : 0.0, "");
  std::printf("| %-38s | %11.1f%% | %12s |\n", "agreeing prefix (until first diff)",
              samples > 0 ? 100.0 * agree_sum / samples : 0.0, "");
  std::printf("+----------------------------------------+--------------+--------------+\n");
  if (failed > 0) std::printf("last error: %s\n", last_error.c_str());
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "{\"requests\":" << requests << ",\"ok\":" << ok << ",\"failed\":" << failed
        << ",\"ttft_reuse_mean_ms\":" << Mean(ttft_reuse)
        << ",\"ttft_reuse_sample_mean_ms\":" << Mean(ttft_reuse_sampled)
        << ",\"ttft_baseline_mean_ms\":" << Mean(ttft_base) << ",\"prompt_tokens\":" << prompt
        << ",\"prefix_tokens\":" << prefix << ",\"reused_tokens\":" << reused
        << ",\"recomputed_tokens\":" << recomputed << ",\"new_tokens\":" << fresh
        << ",\"segments_fetched\":" << fetched << ",\"fetch_failures\":" << fetch_fail
        << ",\"fidelity_samples\":" << samples << ",\"first_token_agree\":" << first_agree
        << ",\"exact\":" << exact
        << ",\"agreeing_prefix\":" << (samples > 0 ? agree_sum / samples : 0.0)
        << ",\"positionwise_agreement\":" << (samples > 0 ? position_sum / samples : 0.0) << "}\n";
  }
  return failed > 0 ? 1 : 0;
}
