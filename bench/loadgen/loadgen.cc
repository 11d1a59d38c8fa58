// sparsex-loadgen: the serving benchmark's load generator. Sends a seeded
// workload (workloads.h: rag, chat, agents, longdocqa, multiround, or a Mooncake trace) to the
// router's public streaming API (sparsex.v1.SparseX/Generate, or with --api openai the OpenAI
// chat API as a real client sends it), open loop (Poisson arrivals at --rate, or the
// workload's own schedule: trace timestamps, multiround's paced users) or closed loop
// (--concurrency clients), with segment reuse on or off, and reports TTFT / TPOT / E2E
// percentiles, throughput, errors by code, the Usage sums and a sweep's goodput.
// docs/benchmarks.md, "Serving load generator" and "Load generator workloads", has the flags
// and the JSON schema.
//
//   sparsex-loadgen --target 127.0.0.1:50051 --workload rag --sweep 1,2,4 --reuse on
//       --out rag_on.json
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/loadgen/openai_client.h"
#include "bench/loadgen/stats.h"
#include "bench/loadgen/workloads.h"
#include "common/flags.h"
#include "common/usage.h"
#include "proto/request_check.h"
#include "proto/sparsex.grpc.pb.h"

namespace {

namespace v1 = sparsex::v1;
namespace lg = sparsex::loadgen;
using Clock = std::chrono::steady_clock;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Options {
  std::string target = "127.0.0.1:50051", model, content = "numbers", docs_path, reuse = "on";
  std::string selector, out, records, sweep, order = "rr";
  std::string api = "grpc", trace, dump_requests, api_key;
  std::string http_host;  // --api openai: --target split
  int http_port = 0;
  int min_requests = 300;
  double min_seconds = 180;
  double rate = 0, duration_s = 0, temperature = 0, recompute_ratio = -1;
  double slo_ttft_ms = 2000, slo_tpot_ms = 50;
  int concurrency = 0, requests = -1, timeout_ms = 60000, max_tokens = 32, warmup = 0;
  int prime = 0;  // passes over the document pool before the first run (Workload::Prime)
  int store_after_misses = 0;  // reuse.store_after_misses of every request (0: the worker's)
  int channels = 4, max_inflight = 4096, wait_ready_s = 10, doc_chars = 800, dry_run = 0;
  bool ignore_eos = true, progress = true, sweep_vary_seed = false;
  lg::WorkloadConfig wc;
  bool reuse_on() const { return reuse == "on"; }
  bool closed() const { return concurrency > 0; }
  bool openai() const { return api == "openai"; }
  bool trace_mode() const { return wc.workload == "trace"; }
  // No --requests and no --duration_s: a point runs until both --min_requests requests were
  // sent and --min_seconds passed (a trace: its window).
  bool sustained_rule() const { return requests < 0; }
};

// One request's outcome.
struct Record {
  int64_t index = 0, after = -1;
  int group = -1, line = 0, http_status = 0;
  int prompt_tokens_est = 0, max_tokens = 0;
  double scheduled_ms = 0, lag_ms = 0;  // send time after the run's start; late by
  double ttft_ms = kNaN, tpot_ms = kNaN, e2e_ms = kNaN;
  double end_ms = 0;  // completion time after the run's start
  int tokens = 0;
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string error, finish_reason, worker;
  bool has_usage = false;
  v1::Usage usage;
};

const char* CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "CODE_UNKNOWN";
  }
}

v1::GenerateRequest ToProto(const lg::RequestSpec& r, const Options& o, const std::string& id) {
  v1::GenerateRequest req;
  if (!o.model.empty()) req.set_model(o.model);
  if (r.one_prompt) {
    // One prompt: the router finds the repeated spans by content-defined chunking.
    for (const lg::SegmentSpec& s : r.segments) {
      if (s.is_text) {
        req.mutable_prompt()->append(s.text);
      } else {
        req.mutable_prompt_ids()->Add(s.ids.begin(), s.ids.end());
      }
    }
  }
  for (const lg::SegmentSpec& s : r.segments) {
    if (r.one_prompt) break;
    v1::Segment* seg = req.add_segments();
    if (s.is_text) {
      seg->set_text(s.text);
    } else {
      seg->mutable_ids()->mutable_ids()->Add(s.ids.begin(), s.ids.end());
    }
    if (!s.cacheable) seg->set_cacheable(false);
  }
  v1::SamplingParams* sp = req.mutable_sampling();
  sp->set_temperature(static_cast<float>(o.temperature));
  sp->set_max_tokens(r.max_tokens > 0 ? r.max_tokens : o.max_tokens);
  if (o.temperature > 0) sp->set_seed(o.wc.seed * 1000003u + static_cast<uint64_t>(r.index));
  if (o.ignore_eos) sp->set_ignore_eos(true);
  if (!o.reuse_on()) {
    req.mutable_reuse()->set_enable(false);  // full prefill + exact prefix cache (vLLM APC)
  } else {
    if (!o.selector.empty()) req.mutable_reuse()->set_selector(o.selector);
    if (o.store_after_misses > 0) {
      req.mutable_reuse()->set_store_after_misses(o.store_after_misses);
    }
    if (o.recompute_ratio >= 0) {
      req.mutable_reuse()->set_recompute_ratio(static_cast<float>(o.recompute_ratio));
    }
  }
  req.set_request_id(id);
  req.set_return_token_ids(true);
  return req;
}

// Sends one request and reads its stream. Times are from the call's start.
void Execute(v1::SparseX::Stub* stub, const v1::GenerateRequest& req, int timeout_ms,
             const std::string& api_key, Record* rec) {
  grpc::ClientContext ctx;
  if (!api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + api_key);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  const Clock::time_point t0 = Clock::now();
  Clock::time_point first{}, last{};
  int tokens = 0;
  bool saw_ids = false;
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    int n = m.token_ids_size();
    saw_ids = saw_ids || n > 0;
    if (n == 0 && !m.text().empty()) n = 1;  // a server ignoring return_token_ids: a chunk each
    if (n > 0) {
      const Clock::time_point now = Clock::now();
      if (tokens == 0) first = now;
      last = now;
      tokens += n;
    }
    if (m.finished()) {
      if (m.has_usage()) {
        rec->usage = m.usage();
        rec->has_usage = true;
      }
      rec->finish_reason = m.finish_reason();
      rec->worker = m.worker();
    }
  }
  const grpc::Status s = reader->Finish();
  const Clock::time_point end = Clock::now();
  if (!saw_ids && rec->has_usage && tokens > 0) {
    tokens = std::max(tokens, rec->usage.completion_tokens());  // text chunks: trust the usage
  }
  rec->code = s.error_code();
  rec->error = s.error_message();
  rec->tokens = tokens;
  rec->e2e_ms = Ms(end - t0);
  if (tokens > 0) rec->ttft_ms = Ms(first - t0);
  if (tokens > 1) rec->tpot_ms = Ms(last - first) / (tokens - 1);
}

lg::ChatOptions ChatOpts(const lg::RequestSpec& r, const Options& o) {
  lg::ChatOptions c;
  c.model = o.model;
  c.max_tokens = r.max_tokens > 0 ? r.max_tokens : o.max_tokens;
  c.temperature = o.temperature;
  if (o.temperature > 0) {
    c.seed = static_cast<int64_t>((o.wc.seed * 1000003u + static_cast<uint64_t>(r.index)) >> 1);
  }
  c.ignore_eos = o.ignore_eos;
  c.reuse_enable = o.reuse_on();
  if (o.reuse_on()) {
    c.selector = o.selector;
    c.recompute_ratio = o.recompute_ratio;
    c.store_after_misses = o.store_after_misses;
  }
  return c;
}

// The gRPC code closest to an HTTP error status, so both APIs report errors alike.
grpc::StatusCode CodeOfHttp(int status) {
  switch (status) {
    case 400:
    case 413:
    case 431:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case 404:
      return grpc::StatusCode::NOT_FOUND;
    case 408:
    case 504:
      return grpc::StatusCode::DEADLINE_EXCEEDED;
    case 429:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case 501:
      return grpc::StatusCode::UNIMPLEMENTED;
    case 503:
      return grpc::StatusCode::UNAVAILABLE;
    default:
      return grpc::StatusCode::INTERNAL;
  }
}

// Sends one chat completion (stream with usage) and reads its events. TTFT: the first chunk
// carrying content; the token count is the usage's completion_tokens (chunks may carry several).
void ExecuteOpenAI(const Options& o, const std::string& body, Record* rec) {
  const Clock::time_point t0 = Clock::now();
  Clock::time_point first{}, last{};
  int chunks = 0;
  bool saw_done = false;
  std::string err_body, stream_error;
  absl::Status parse_error;
  lg::SseDecoder sse;
  auto on_body = [&](int http, absl::string_view b) {
    if (http != 200) {
      if (err_body.size() < (64 << 10)) err_body.append(b.data(), b.size());
      return;
    }
    for (const std::string& ev : sse.Feed(b)) {
      absl::StatusOr<lg::ChatChunk> c = lg::ParseChatChunk(ev);
      if (!c.ok()) {
        if (parse_error.ok()) parse_error = c.status();
        continue;
      }
      if (c->done) {
        saw_done = true;
        continue;
      }
      if (!c->error.empty()) stream_error = c->error;
      if (!c->content.empty()) {
        const Clock::time_point now = Clock::now();
        if (chunks == 0) first = now;
        last = now;
        ++chunks;
      }
      if (!c->finish_reason.empty()) rec->finish_reason = c->finish_reason;
      if (c->has_usage) {
        rec->has_usage = true;
        rec->worker = c->worker;
#define SPX_SET_USAGE(name, type, def)                                           \
  if (auto it = c->usage.find(#name); it != c->usage.end()) {                    \
    rec->usage.set_##name(static_cast<type>(it->second));                        \
  }
        SPARSEX_USAGE_FIELDS(SPX_SET_USAGE)
#undef SPX_SET_USAGE
        // A server without SparseX's figures (vLLM, SGLang) reports its prefix-cache hits as
        // cached_tokens only: counted as prefix tokens, so its runs compare with ours.
        if (!c->usage.count("prefix_tokens") && !c->usage.count("reused_tokens")) {
          if (auto it = c->usage.find("cached_tokens"); it != c->usage.end()) {
            rec->usage.set_prefix_tokens(static_cast<int>(it->second));
          }
        }
      }
    }
  };
  int http = 0;
  const absl::Status s = lg::PostStream(o.http_host, o.http_port, "/v1/chat/completions", body,
                                        o.timeout_ms, o.api_key, on_body, &http);
  const Clock::time_point end = Clock::now();
  rec->http_status = http;
  if (!s.ok()) {
    rec->code = s.code() == absl::StatusCode::kDeadlineExceeded
                    ? grpc::StatusCode::DEADLINE_EXCEEDED
                    : s.code() == absl::StatusCode::kUnavailable ? grpc::StatusCode::UNAVAILABLE
                                                                 : grpc::StatusCode::DATA_LOSS;
    rec->error = std::string(s.message());
  } else if (http != 200) {
    rec->code = CodeOfHttp(http);
    rec->error = absl::StrCat("HTTP ", http, ": ", lg::HttpErrorMessage(err_body));
  } else if (!stream_error.empty()) {
    rec->code = grpc::StatusCode::UNKNOWN;
    rec->error = absl::StrCat("error event in the stream: ", stream_error);
  } else if (!parse_error.ok()) {
    rec->code = grpc::StatusCode::DATA_LOSS;
    rec->error = std::string(parse_error.message());
  } else if (!saw_done) {
    rec->code = grpc::StatusCode::DATA_LOSS;
    rec->error = "the stream ended without data: [DONE]";
  }
  int tokens = chunks;
  if (rec->has_usage && tokens > 0) tokens = std::max(tokens, rec->usage.completion_tokens());
  rec->tokens = tokens;
  rec->e2e_ms = Ms(end - t0);
  if (chunks > 0) rec->ttft_ms = Ms(first - t0);
  if (chunks > 1 && tokens > 1) rec->tpot_ms = Ms(last - first) / (tokens - 1);
}

// Runs submitted tasks at once: a worker thread per task in flight, reused when idle, at most
// max_threads (beyond that tasks wait, which shows as launch lag in the records).
class Launcher {
 public:
  explicit Launcher(int max_threads) : max_(std::max(1, max_threads)) {}
  ~Launcher() { Join(); }
  void Submit(std::function<void()> f) {
    std::lock_guard<std::mutex> l(mu_);
    q_.push_back(std::move(f));
    if (static_cast<int>(q_.size()) > idle_ && static_cast<int>(threads_.size()) < max_) {
      threads_.emplace_back([this] { Loop(); });
    } else {
      cv_.notify_one();
    }
  }
  // Finishes every queued task, then joins the threads.
  void Join() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(l, [this] { return stop_ || !q_.empty(); });
      --idle_;
      if (q_.empty()) return;
      std::function<void()> f = std::move(q_.front());
      q_.pop_front();
      l.unlock();
      f();
      l.lock();
    }
  }
  const int max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  std::vector<std::thread> threads_;
  int idle_ = 0;
  bool stop_ = false;
};

// Small JSON object writer.
class JsonObj {
 public:
  JsonObj& Num(const std::string& k, double v) { return Raw(k, lg::JsonNumber(v)); }
  JsonObj& Str(const std::string& k, const std::string& v) { return Raw(k, lg::JsonString(v)); }
  JsonObj& Bool(const std::string& k, bool v) { return Raw(k, v ? "true" : "false"); }
  JsonObj& Raw(const std::string& k, const std::string& v) {
    s_ += (s_.size() > 1 ? "," : "") + lg::JsonString(k) + ":" + v;
    return *this;
  }
  std::string Done() const { return s_ + "}"; }

 private:
  std::string s_ = "{";
};

std::string UsageJson(const v1::Usage& u) {
  return JsonObj()
      .Num("prompt_tokens", u.prompt_tokens())
      .Num("completion_tokens", u.completion_tokens())
      .Num("prefix_tokens", u.prefix_tokens())
      .Num("reused_tokens", u.reused_tokens())
      .Num("recomputed_tokens", u.recomputed_tokens())
      .Num("new_tokens", u.new_tokens())
      .Num("segments_hit", u.segments_hit())
      .Num("segments_fetched", u.segments_fetched())
      .Num("fetch_failures", u.fetch_failures())
      .Num("segments_streamed", u.segments_streamed())
      .Num("stream_restarts", u.stream_restarts())
      .Num("stream_wait_ms", u.stream_wait_ms())
      .Num("stream_upload_ms", u.stream_upload_ms())
      .Num("worker_ttft_ms", u.ttft_ms())
      .Num("queue_ms", u.queue_ms())
      .Num("compute_share", u.compute_share())
      .Done();
}

struct Summary {
  std::string json;
  // For the table.
  double x = 0;  // rate or concurrency
  int64_t sent = 0, completed = 0, errors = 0;
  double rps = 0, tok_s = 0, ttft50 = kNaN, ttft90 = kNaN, ttft99 = kNaN, tpot50 = kNaN,
         tpot99 = kNaN, e2e50 = kNaN, e2e99 = kNaN, reused_share = kNaN, prefix_share = kNaN;
  bool goodput_ok = false, sustained = false;
  std::map<std::string, int64_t> by_code;
  std::string last_error;
};

Summary Summarize(const Options& o, double x, const std::vector<Record>& recs, double send_s,
                  int max_inflight, const lg::WorkloadConfig& wc) {
  Summary s;
  s.x = x;
  s.sent = static_cast<int64_t>(recs.size());
  std::vector<double> ttft, tpot, e2e, wttft, queue, lag;
  std::map<std::string, int64_t> by_code;
  int64_t out_tokens = 0, prompt = 0, completion = 0, prefix = 0, reused = 0, recomputed = 0,
          fresh = 0, hit = 0, fetched = 0, fetch_fail = 0;
  double end_ms = 0;
  for (const Record& r : recs) {
    lag.push_back(r.lag_ms);
    end_ms = std::max(end_ms, r.end_ms);
    if (r.code != grpc::StatusCode::OK) {
      ++by_code[CodeName(r.code)];
      s.last_error = absl::StrCat(CodeName(r.code), ": ", r.error);
      continue;
    }
    ++s.completed;
    out_tokens += r.tokens;
    if (!std::isnan(r.ttft_ms)) ttft.push_back(r.ttft_ms);
    if (!std::isnan(r.tpot_ms)) tpot.push_back(r.tpot_ms);
    e2e.push_back(r.e2e_ms);
    if (r.has_usage) {
      const v1::Usage& u = r.usage;
      prompt += u.prompt_tokens();
      completion += u.completion_tokens();
      prefix += u.prefix_tokens();
      reused += u.reused_tokens();
      recomputed += u.recomputed_tokens();
      fresh += u.new_tokens();
      hit += u.segments_hit();
      fetched += u.segments_fetched();
      fetch_fail += u.fetch_failures();
      wttft.push_back(u.ttft_ms());
      queue.push_back(u.queue_ms());
    }
  }
  s.errors = s.sent - s.completed;
  const double duration_s = end_ms / 1000.0;
  s.rps = duration_s > 0 ? static_cast<double>(s.completed) / duration_s : kNaN;
  s.tok_s = duration_s > 0 ? static_cast<double>(out_tokens) / duration_s : kNaN;
  const std::vector<double> t = lg::Percentiles(ttft, {50, 90, 99});
  s.ttft50 = t[0], s.ttft90 = t[1], s.ttft99 = t[2];
  const std::vector<double> p = lg::Percentiles(tpot, {50, 99});
  s.tpot50 = p[0], s.tpot99 = p[1];
  const std::vector<double> e = lg::Percentiles(e2e, {50, 99});
  s.e2e50 = e[0], s.e2e99 = e[1];
  const std::vector<double> w = lg::Percentiles(wttft, {50, 99});
  s.reused_share = prompt > 0 ? static_cast<double>(reused) / prompt : kNaN;
  s.prefix_share = prompt > 0 ? static_cast<double>(prefix) / prompt : kNaN;
  s.goodput_ok = lg::MeetsSlo({x, s.ttft99, s.tpot99, s.completed, s.errors}, o.slo_ttft_ms,
                              o.slo_tpot_ms);
  // A sustained point: enough requests over enough time for p99 to mean something.
  s.sustained = s.sent >= o.min_requests && duration_s >= o.min_seconds;

  JsonObj codes;
  for (const auto& [k, v] : by_code) codes.Num(k, static_cast<double>(v));
  const lg::WorkloadConfig& c = wc;
  JsonObj cfg;
  cfg.Num("seed", static_cast<double>(c.seed)).Str("target", o.target).Str("model", o.model);
  if (c.content == lg::Content::kNumbers) {
    cfg.Num("min_id", c.min_id).Num("max_id", c.max_id);
  } else {
    cfg.Str("docs", o.docs_path).Num("doc_chars", o.doc_chars);
  }
  if (c.workload == "trace") {
    cfg.Str("trace", o.trace)
        .Num("trace_block_tokens", c.trace_block_tokens)
        .Num("time_scale", c.time_scale)
        .Num("start_s", c.trace_start_s)
        .Num("duration_s", c.trace_duration_s)
        .Num("max_output_tokens", c.max_output_tokens)
        .Num("max_input_tokens", c.max_input_tokens)
        .Num("trace_token_scale", c.trace_token_scale)
        .Bool("trace_segments", c.trace_segments);
  } else if (c.workload == "longdocqa") {
    cfg.Num("documents", c.documents)
        .Num("document_tokens", c.document_tokens)
        .Num("repeat", c.repeat)
        .Str("repeat_mode", c.repeat_mode)
        .Str("hit_miss", c.hit_miss)
        .Num("question_tokens", c.question_tokens);
  } else if (c.workload == "multiround") {
    cfg.Num("users", c.users)
        .Num("rounds", c.rounds)
        .Num("shared_system_tokens", c.shared_system_tokens)
        .Num("user_history_tokens", c.user_history_tokens)
        .Num("round_tokens", c.round_tokens)
        .Num("answer_tokens", c.answer_tokens);
  } else if (c.workload == "rag" || c.workload == "textrag") {
    cfg.Num("pool", c.pool)
        .Num("zipf", c.zipf)
        .Num("docs_per_request", c.docs_per_request)
        .Num("doc_tokens", c.doc_tokens)
        .Num("question_tokens", c.question_tokens);
  } else {
    if (c.workload == "chat") {
      cfg.Num("sessions", c.sessions).Num("system_tokens", c.system_tokens);
    } else {
      cfg.Num("agents", c.agents)
          .Num("shared_tokens", c.shared_tokens)
          .Num("instr_tokens", c.instr_tokens)
          .Bool("shared_first", c.shared_first);
    }
    cfg.Str("order", c.random_order ? "random" : "rr")
        .Num("turn_tokens", c.turn_tokens)
        .Num("reply_tokens", c.reply_tokens)
        .Num("max_history_tokens", c.max_history_tokens);
  }
  cfg.Num("max_tokens", o.max_tokens)
      .Num("temperature", o.temperature)
      .Bool("ignore_eos", o.ignore_eos)
      .Num("timeout_ms", o.timeout_ms)
      .Num("warmup", o.warmup)
      .Str("api", o.api)
      .Num("min_requests", o.min_requests)
      .Num("min_seconds", o.min_seconds);
  if (!o.selector.empty()) cfg.Str("selector", o.selector);
  if (o.recompute_ratio >= 0) cfg.Num("recompute_ratio", o.recompute_ratio);
  if (o.store_after_misses > 0) cfg.Num("store_after_misses", o.store_after_misses);

  JsonObj j;
  j.Str("workload", c.workload)
      .Str("content", o.content)
      .Str("mode", o.reuse_on() ? "reuse_on" : "reuse_off")
      .Bool("reuse", o.reuse_on())
      .Str("arrival", o.closed()                 ? "closed"
                      : c.workload == "trace"      ? "trace"
                      : c.workload == "multiround" ? "paced"
                                                   : "poisson")
      .Num("rate", o.closed() ? kNaN : x)
      .Num("concurrency", o.closed() ? x : kNaN)
      .Num("seed", static_cast<double>(c.seed))
      .Num("requests", static_cast<double>(s.sent))
      .Num("completed", static_cast<double>(s.completed))
      .Num("errors", static_cast<double>(s.errors))
      .Raw("errors_by_code", codes.Done())
      .Num("duration_s", duration_s)
      .Num("send_duration_s", send_s)
      .Num("throughput_rps", s.rps)
      .Num("output_tokens", static_cast<double>(out_tokens))
      .Num("output_tokens_per_s", s.tok_s)
      .Num("ttft_mean_ms", lg::Mean(ttft))
      .Num("ttft_p50_ms", s.ttft50)
      .Num("ttft_p90_ms", s.ttft90)
      .Num("ttft_p99_ms", s.ttft99)
      .Num("tpot_p50_ms", s.tpot50)
      .Num("tpot_p99_ms", s.tpot99)
      .Num("e2e_p50_ms", s.e2e50)
      .Num("e2e_p99_ms", s.e2e99)
      .Num("worker_ttft_p50_ms", w[0])
      .Num("worker_ttft_p99_ms", w[1])
      .Num("queue_p99_ms", lg::Percentile(queue, 99))
      .Num("launch_lag_p99_ms", lg::Percentile(lag, 99))
      .Num("max_inflight", max_inflight)
      .Num("slo_ttft_ms", o.slo_ttft_ms)
      .Num("slo_tpot_ms", o.slo_tpot_ms)
      .Bool("goodput_ok", s.goodput_ok)
      .Bool("sustained", s.sustained)
      .Num("prompt_tokens", static_cast<double>(prompt))
      .Num("completion_tokens", static_cast<double>(completion))
      .Num("prefix_tokens", static_cast<double>(prefix))
      .Num("reused_tokens", static_cast<double>(reused))
      .Num("recomputed_tokens", static_cast<double>(recomputed))
      .Num("new_tokens", static_cast<double>(fresh))
      .Num("segments_hit", static_cast<double>(hit))
      .Num("segments_fetched", static_cast<double>(fetched))
      .Num("fetch_failures", static_cast<double>(fetch_fail))
      .Num("reused_share", s.reused_share)
      .Num("prefix_share", s.prefix_share)
      .Raw("config", cfg.Done());
  s.json = j.Done();
  s.by_code = std::move(by_code);
  return s;
}

std::string RecordJson(const Options& o, int run, double x, const Record& r) {
  JsonObj j;
  j.Num("run", run)
      .Num(o.closed() ? "concurrency" : "rate", x)
      .Num("index", static_cast<double>(r.index))
      .Num("group", r.group)
      .Num("prompt_tokens_est", r.prompt_tokens_est)
      .Num("max_tokens", r.max_tokens)
      .Num("scheduled_ms", r.scheduled_ms)
      .Num("lag_ms", r.lag_ms)
      .Num("ttft_ms", r.ttft_ms)
      .Num("tpot_ms", r.tpot_ms)
      .Num("e2e_ms", r.e2e_ms)
      .Num("tokens", r.tokens)
      .Str("code", CodeName(r.code));
  if (r.line > 0) j.Num("line", r.line);
  if (r.after >= 0) j.Num("after", static_cast<double>(r.after));
  if (r.http_status > 0) j.Num("http_status", r.http_status);
  if (r.code != grpc::StatusCode::OK) j.Str("error", r.error);
  if (!r.finish_reason.empty()) j.Str("finish_reason", r.finish_reason);
  if (!r.worker.empty()) j.Str("worker", r.worker);
  if (r.has_usage) j.Raw("usage", UsageJson(r.usage));
  return j.Done();
}

class Client {
 public:
  Client(const Options& o) : o_(o) {
    for (int i = 0; i < std::max(1, o.channels); ++i) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection per channel
      args.SetMaxReceiveMessageSize(-1);
      args.SetMaxSendMessageSize(-1);
      stubs_.push_back(v1::SparseX::NewStub(
          grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), args)));
    }
  }
  v1::SparseX::Stub* stub(int64_t i) {
    return stubs_[static_cast<size_t>(i) % stubs_.size()].get();
  }

  absl::Status WaitReady() {
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(o_.wait_ready_s);
    std::string last = "no answer";
    for (;;) {
      if (o_.openai()) {
        int http = 0;
        std::string body;
        const absl::Status s =
            lg::HttpGet(o_.http_host, o_.http_port, "/healthz", 2000, &http, &body);
        if (s.ok() && http == 200) return absl::OkStatus();
        last = s.ok() ? absl::StrCat("/healthz ", http, ": ", body) : std::string(s.message());
        if (Clock::now() + std::chrono::milliseconds(200) >= deadline) {
          return absl::UnavailableError(absl::StrCat("no serving cluster at http://", o_.target,
                                                     " within ", o_.wait_ready_s, " s (last: ",
                                                     last, ")"));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        continue;
      }
      grpc::ClientContext ctx;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      ctx.set_deadline(
          std::chrono::system_clock::now() +
          std::clamp(left, std::chrono::milliseconds(100), std::chrono::milliseconds(2000)));
      if (!o_.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + o_.api_key);
      v1::HealthResponse h;
      const grpc::Status s = stubs_[0]->Health(&ctx, v1::HealthRequest(), &h);
      if (s.ok() && h.serving()) return absl::OkStatus();
      last = s.ok() ? std::string("router answers but no worker is serving")
                    : absl::StrCat(CodeName(s.error_code()), ": ", s.error_message());
      if (Clock::now() + std::chrono::milliseconds(200) >= deadline) {
        return absl::UnavailableError(absl::StrCat("no serving cluster at ", o_.target, " within ",
                                                   o_.wait_ready_s, " s (last: ", last, ")"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

 private:
  const Options& o_;
  std::vector<std::unique_ptr<v1::SparseX::Stub>> stubs_;
};

// State shared by a run's threads.
struct RunState {
  std::mutex mu;
  std::condition_variable finished_cv;
  std::vector<Record> records;
  std::vector<double> ttft;  // completed requests, for the progress line
  std::vector<std::string> dumps;  // --dump_requests lines
  std::set<int64_t> finished;       // indexes of finished requests (dependencies)
  int64_t first_index = 0;          // requests before it (warmup) finished before the run
  std::atomic<int64_t> sent{0}, done{0}, errors{0};
  std::atomic<int> inflight{0}, max_inflight{0};
  Clock::time_point start;

  void Begin() {
    const int n = ++inflight;
    int m = max_inflight.load();
    while (n > m && !max_inflight.compare_exchange_weak(m, n)) {
    }
  }
  void Finish(Record&& r) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (r.code == grpc::StatusCode::OK) {
        if (!std::isnan(r.ttft_ms)) ttft.push_back(r.ttft_ms);
      } else {
        ++errors;
      }
      finished.insert(r.index);
      records.push_back(std::move(r));
      ++done;
      --inflight;
    }
    finished_cv.notify_all();
  }
  // Blocks until request `index` finished (failed counts: the user moves on).
  void WaitFinished(int64_t index) {
    if (index < first_index) return;
    std::unique_lock<std::mutex> l(mu);
    finished_cv.wait(l, [&] { return finished.count(index) > 0; });
  }
};

// A request ready to send.
struct Prepared {
  int64_t index = 0, after = -1;
  int group = -1, prompt_tokens_est = 0, max_tokens = 0, line = 0;
  double arrival_s = kNaN;
  v1::GenerateRequest req;
  std::string body;  // --api openai: the JSON body
};

// The request as --dump_requests writes it: what was sent (chat messages, or segments),
// for offline analyses (bench/chunk_reuse.py) of the same requests.
std::string DumpJson(const Options& o, int run, const lg::RequestSpec& r, bool warmup) {
  JsonObj j;
  j.Num("run", run).Num("index", static_cast<double>(r.index)).Bool("warmup", warmup);
  std::string items = "[";
  if (o.openai()) {
    for (const auto& [role, text] : lg::ChatMessages(r)) {
      items += (items.size() > 1 ? "," : "") +
               JsonObj().Str("role", lg::RoleName(role)).Str("content", text).Done();
    }
    j.Raw("messages", items + "]");
  } else {
    for (const lg::SegmentSpec& sg : r.segments) {
      JsonObj seg;
      seg.Str("kind", lg::KindName(sg.kind)).Bool("cacheable", sg.cacheable);
      if (sg.is_text) {
        seg.Str("text", sg.text);
      } else {
        std::string ids = "[";
        for (size_t i = 0; i < sg.ids.size(); ++i) {
          ids += (i > 0 ? "," : "") + std::to_string(sg.ids[i]);
        }
        seg.Raw("ids", ids + "]");
      }
      items += (items.size() > 1 ? "," : "") + seg.Done();
    }
    j.Raw("segments", items + "]").Bool("one_prompt", r.one_prompt);
  }
  return j.Done();
}

Prepared Prepare(const Options& o, int run, const lg::RequestSpec& spec, bool warmup,
                 RunState* dump_to = nullptr) {
  Prepared p;
  p.index = spec.index;
  p.after = spec.after;
  p.group = spec.group;
  p.line = spec.line;
  p.arrival_s = spec.arrival_s;
  p.prompt_tokens_est = spec.prompt_tokens();
  p.max_tokens = spec.max_tokens > 0 ? spec.max_tokens : o.max_tokens;
  if (o.openai()) {
    p.body = lg::ChatBody(spec, ChatOpts(spec, o));
  } else {
    p.req = ToProto(spec, o, absl::StrCat("lg-", run, warmup ? "-w" : "-", spec.index));
  }
  if (dump_to != nullptr && !o.dump_requests.empty()) {
    std::string line = DumpJson(o, run, spec, warmup);
    std::lock_guard<std::mutex> l(dump_to->mu);
    dump_to->dumps.push_back(std::move(line));
  }
  return p;
}

// Sends one request of the run (on the calling thread) and records it. A request that
// follows another (multiround: the user's previous round) first waits for it; the wait shows
// as launch lag.
void SendOne(Client& client, const Options& o, RunState& st, const Prepared& p,
             Clock::time_point scheduled) {
  if (p.after >= 0) st.WaitFinished(p.after);
  Record rec;
  rec.index = p.index;
  rec.after = p.after;
  rec.group = p.group;
  rec.line = p.line;
  rec.prompt_tokens_est = p.prompt_tokens_est;
  rec.max_tokens = p.max_tokens;
  rec.scheduled_ms = Ms(scheduled - st.start);
  rec.lag_ms = std::max(0.0, Ms(Clock::now() - scheduled));
  st.Begin();
  if (o.openai()) {
    ExecuteOpenAI(o, p.body, &rec);
  } else {
    Execute(client.stub(p.index), p.req, o.timeout_ms, o.api_key, &rec);
  }
  rec.end_ms = Ms(Clock::now() - st.start);
  st.Finish(std::move(rec));
}

void Progress(const Options& o, RunState& st, const std::string& label, std::atomic<bool>& stop) {
  const bool tty = isatty(STDERR_FILENO);
  while (!stop.load()) {
    for (int i = 0; i < 10 && !stop.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::vector<double> ttft;
    {
      std::lock_guard<std::mutex> l(st.mu);
      ttft = st.ttft;
    }
    char p50[32] = "-";
    if (!ttft.empty()) std::snprintf(p50, sizeof p50, "%.1f ms", lg::Percentile(ttft, 50));
    std::fprintf(stderr, "%s[%s] %5.0fs sent %lld done %lld errors %lld inflight %d ttft p50 %s%s",
                 tty ? "\r" : "", label.c_str(), Ms(Clock::now() - st.start) / 1000.0,
                 static_cast<long long>(st.sent.load()), static_cast<long long>(st.done.load()),
                 static_cast<long long>(st.errors.load()), st.inflight.load(), p50,
                 tty ? "   " : "\n");
    std::fflush(stderr);
  }
  if (tty) std::fprintf(stderr, "\n");
}

// Whether a run sends another request: the workload has one (a trace window ends), and the
// stopping rule (--requests N, --duration_s S, or by default at least --min_requests sent and
// --min_seconds passed, whichever is longer) has not been met. next_s: when the next request
// would go out; last_s: when the last one went out (the sustained rule ends only once a
// request was sent at --min_seconds or later, so the point spans at least that long).
bool KeepSending(const Options& o, lg::Workload& gen, int64_t sent, double next_s, double last_s) {
  if (!gen.HasNext()) return false;
  if (o.requests > 0 && sent >= o.requests) return false;
  if (o.trace_mode()) return true;  // the window bounds it (and --requests when given)
  if (o.duration_s > 0 && next_s >= o.duration_s) return false;
  if (o.sustained_rule()) return sent < o.min_requests || last_s < o.min_seconds;
  return true;
}

// One measured run at rate (open loop) or concurrency (closed loop) x. A trace's x is the
// speed-up of its timestamps (--sweep) and the summary's rate the offered rate.
absl::StatusOr<Summary> RunOnce(Client& client, const Options& o, int run, double x,
                                const std::vector<std::string>& docs, std::ofstream* records,
                                std::ofstream* dumps) {
  lg::WorkloadConfig wc = o.wc;
  if (o.sweep_vary_seed) wc.seed += static_cast<uint64_t>(run);
  if (!o.closed()) wc.rate = x;
  if (o.trace_mode() && !o.closed()) wc.time_scale = o.wc.time_scale / x;
  absl::StatusOr<std::unique_ptr<lg::Workload>> gen = lg::MakeWorkload(wc, docs);
  if (!gen.ok()) return gen.status();
  const std::string label = o.closed()       ? absl::StrCat("concurrency ", x)
                            : o.trace_mode() ? absl::StrCat("trace x", x)
                                             : absl::StrCat("rate ", x, "/s");
  RunState st;

  // Warmup: the sequence's first requests, one at a time, not measured.
  if (o.warmup > 0) {
    RunState w;
    w.start = Clock::now();
    int n = 0;
    for (; n < o.warmup && (*gen)->HasNext(); ++n) {
      SendOne(client, o, w, Prepare(o, run, (*gen)->Next(), true, &st), Clock::now());
    }
    std::fprintf(stderr, "[%s] warmup: %d requests, %lld errors\n", label.c_str(), n,
                 static_cast<long long>(w.errors.load()));
    st.first_index = n;
  }

  st.start = Clock::now() + std::chrono::milliseconds(10);
  std::atomic<bool> stop_progress{false};
  std::thread progress;
  if (o.progress) progress = std::thread([&] { Progress(o, st, label, stop_progress); });
  Clock::time_point last_send = st.start;
  double first_arrival = kNaN, last_arrival = kNaN;
  auto elapsed_s = [&](Clock::time_point t) { return Ms(t - st.start) / 1000.0; };

  if (o.closed()) {
    std::mutex gen_mu;
    std::vector<std::thread> clients;
    std::this_thread::sleep_until(st.start);
    for (int c = 0; c < static_cast<int>(x); ++c) {
      clients.emplace_back([&] {
        for (;;) {
          lg::RequestSpec spec;
          Clock::time_point now;
          {
            std::lock_guard<std::mutex> l(gen_mu);
            now = Clock::now();
            if (!KeepSending(o, **gen, st.sent.load(), elapsed_s(now), elapsed_s(now))) break;
            ++st.sent;
            spec = (*gen)->Next();
            last_send = now;
          }
          const Prepared p = Prepare(o, run, spec, false, &st);
          SendOne(client, o, st, p, Clock::now());
        }
      });
    }
    for (std::thread& t : clients) t.join();
  } else {
    // Poisson gaps, unless the workload schedules its requests itself (trace timestamps,
    // multiround's paced users): then each goes out at its arrival_s after the first's.
    lg::PoissonArrivals arrivals(x, wc.seed);
    Launcher launcher(o.max_inflight);
    Clock::time_point t = st.start;
    for (;;) {
      if (!KeepSending(o, **gen, st.sent.load(), elapsed_s(t), elapsed_s(last_send))) break;
      lg::RequestSpec spec = (*gen)->Next();
      if (!std::isnan(spec.arrival_s)) {
        if (std::isnan(first_arrival)) first_arrival = spec.arrival_s;
        last_arrival = spec.arrival_s;
        t = st.start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(spec.arrival_s - first_arrival));
        if (!o.trace_mode() && o.duration_s > 0 && elapsed_s(t) >= o.duration_s) break;
      }
      auto p = std::make_shared<const Prepared>(Prepare(o, run, spec, false, &st));
      std::this_thread::sleep_until(t);
      ++st.sent;
      last_send = t;
      launcher.Submit([&client, &o, &st, p, t] { SendOne(client, o, st, *p, t); });
      if (std::isnan(spec.arrival_s)) {
        t += std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(arrivals.NextGapS()));
      }
    }
    launcher.Join();
  }
  stop_progress = true;
  if (progress.joinable()) progress.join();

  std::sort(st.records.begin(), st.records.end(),
            [](const Record& a, const Record& b) { return a.index < b.index; });
  // A trace's point is its offered rate: the measured requests over the scaled time from the
  // first of them to the window's end (to the last of them when the window runs to the trace's
  // end). arrival_s counts from the window's start.
  double point = x;
  if (o.trace_mode() && !o.closed()) {
    const double span = wc.trace_duration_s > 0
                            ? wc.trace_duration_s * wc.time_scale - first_arrival
                            : last_arrival - first_arrival;
    point = span > 0 ? static_cast<double>(st.sent.load()) / span : kNaN;
  }
  if (records != nullptr) {
    for (const Record& r : st.records) *records << RecordJson(o, run, point, r) << "\n";
    records->flush();
  }
  if (dumps != nullptr) {
    for (const std::string& d : st.dumps) *dumps << d << "\n";
    dumps->flush();
  }
  Summary sum = Summarize(o, point, st.records, Ms(last_send - st.start) / 1000.0,
                          st.max_inflight.load(), wc);
  return sum;
}

void PrintTable(const Options& o, const std::vector<Summary>& rows) {
  const std::string& w = o.wc.workload;
  const std::string max_tokens = w == "trace"        ? "output lengths of the trace"
                                 : w == "multiround" ? absl::StrCat("max_tokens ", o.wc.answer_tokens)
                                                     : absl::StrCat("max_tokens ", o.max_tokens);
  std::printf(
      "\nsparsex-loadgen: workload %s (%s, %s API), reuse %s, %s, %s, SLO TTFT p99 <= %g ms, "
      "TPOT p99 <= %g ms\n",
      w.c_str(), o.content.c_str(), o.api.c_str(), o.reuse.c_str(),
      o.closed()            ? "closed loop"
      : w == "trace"        ? "arrivals at the trace's timestamps (rate: offered)"
      : w == "multiround"   ? "paced users"
                            : "Poisson arrivals",
      max_tokens.c_str(), o.slo_ttft_ms, o.slo_tpot_ms);
  const char* line =
      "+--------+-------+-------+------+--------+---------+-----------------------------+"
      "-----------------+-----------------+--------+--------+------+\n";
  std::printf("%s", line);
  std::printf("| %6s | %5s | %5s | %4s | %6s | %7s | %27s | %15s | %15s | %6s | %6s | %4s |\n",
              o.closed() ? "conc" : "rate", "sent", "ok", "err", "req/s", "tok/s",
              "TTFT p50 / p90 / p99 ms", "TPOT p50/p99 ms", "E2E p50/p99 ms", "reused", "prefix",
              "SLO");
  std::printf("%s", line);
  // NaN (no sample) as "-".
  auto f = [](double v, int prec, const char* suffix = "") {
    if (std::isnan(v)) return std::string("-");
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.*f%s", prec, v, suffix);
    return std::string(buf);
  };
  for (const Summary& s : rows) {
    std::printf(
        "| %6g | %5lld | %5lld | %4lld | %6s | %7s | %8s %8s %9s | %7s %7s |"
        " %7s %7s | %6s | %6s | %4s |\n",
        s.x, static_cast<long long>(s.sent), static_cast<long long>(s.completed),
        static_cast<long long>(s.errors), f(s.rps, 2).c_str(), f(s.tok_s, 1).c_str(),
        f(s.ttft50, 1).c_str(), f(s.ttft90, 1).c_str(), f(s.ttft99, 1).c_str(),
        f(s.tpot50, 2).c_str(), f(s.tpot99, 2).c_str(), f(s.e2e50, 0).c_str(),
        f(s.e2e99, 0).c_str(), f(100 * s.reused_share, 1, "%").c_str(),
        f(100 * s.prefix_share, 1, "%").c_str(), s.goodput_ok ? "ok" : "MISS");
  }
  std::printf("%s", line);
  for (const Summary& s : rows) {
    if (s.errors == 0) continue;
    std::printf("%s %g errors:", o.closed() ? "concurrency" : "rate", s.x);
    for (const auto& [code, n] : s.by_code)
      std::printf(" %s %lld", code.c_str(), static_cast<long long>(n));
    std::printf(" (last: %s)\n", s.last_error.c_str());
  }
}

// Prints the first requests' layout; with --dump_requests also writes them (no server needed).
int DryRun(const Options& o, lg::Workload& gen) {
  std::ofstream dump;
  if (!o.dump_requests.empty()) {
    dump.open(o.dump_requests);
    if (!dump) {
      std::cerr << "sparsex-loadgen: cannot write " << o.dump_requests << "\n";
      return 1;
    }
  }
  for (int i = 0; i < o.dry_run && gen.HasNext(); ++i) {
    const lg::RequestSpec r = gen.Next();
    if (dump.is_open()) dump << DumpJson(o, 0, r, false) << "\n";
    std::printf("request %lld group %d prompt ~%d tokens", static_cast<long long>(r.index),
                r.group, r.prompt_tokens());
    if (!std::isnan(r.arrival_s)) std::printf(" at %.3f s", r.arrival_s);
    if (r.after >= 0) std::printf(" after %lld", static_cast<long long>(r.after));
    if (r.max_tokens > 0) std::printf(" max_tokens %d", r.max_tokens);
    if (r.line > 0) std::printf(" line %d", r.line);
    std::printf(":");
    for (const lg::SegmentSpec& s : r.segments) {
      std::printf(" %s", lg::KindName(s.kind));
      if (s.source >= 0) std::printf("#%d", s.source);
      std::printf("(%d%s)", s.tokens, s.cacheable ? "" : ",nocache");
    }
    std::printf("\n");
  }
  return dump ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  lg::WorkloadConfig& c = o.wc;
  sparsex::FlagSet f("sparsex-loadgen");
  f.Add("target", &o.target, "router gRPC address host:port");
  f.Add("model", &o.model, "model name (\"\" = the router's only/first model)");
  f.Add("rate", &o.rate, "open loop: Poisson arrivals at this many requests/s");
  f.Add("concurrency", &o.concurrency,
        "closed loop: this many clients, each sending its next "
        "request when the last finishes (overrides --rate)");
  f.Add("sweep", &o.sweep,
        "comma-separated rates (or concurrencies with --concurrency) run in "
        "sequence, same seed each; --out gets a JSON array");
  f.Add("sweep_vary_seed", &o.sweep_vary_seed, "use seed + run index for each sweep point");
  f.Add("requests", &o.requests,
        "measured requests per run, exactly (0 = until --duration_s; default: the sustained "
        "rule, --min_requests and --min_seconds)");
  f.Add("duration_s", &o.duration_s,
        "stop sending after this many seconds (0 = off); trace: the window's length in trace "
        "seconds from --start_s (0 = to the end)");
  f.Add("min_requests", &o.min_requests,
        "sustained rule (without --requests / --duration_s): a point sends at least this many "
        "measured requests ...");
  f.Add("min_seconds", &o.min_seconds, "... and runs at least this many seconds, whichever is longer");
  f.Add("api", &o.api,
        "grpc (sparsex.v1.SparseX/Generate, segments) | openai (POST /v1/chat/completions on "
        "--target host:port, the router's HTTP port: the request's text pasted into chat "
        "messages, no segment marks; --content text)");
  f.Add("api_key", &o.api_key,
        "the router's API key, sent as \"authorization: Bearer KEY\" (default: "
        "$SPARSEX_API_KEY; none against a router started with --insecure_loopback)");
  f.Add("dump_requests", &o.dump_requests,
        "write every request sent (chat messages or segments) as JSON lines here, for "
        "bench/chunk_reuse.py");
  f.Add("trace", &o.trace,
        "replay a Mooncake trace (JSON lines: timestamp ms, input_length, output_length, "
        "hash_ids); a bare file name is looked up in $SPARSEX_TRACES, then ../shared/traces");
  f.Add("trace_block_tokens", &c.trace_block_tokens, "trace: tokens per hash id (Mooncake: 512)");
  f.Add("time_scale", &c.time_scale,
        "trace: arrival gaps multiplied by this (0.5: twice the rate); --sweep values multiply "
        "the rate further");
  f.Add("start_s", &c.trace_start_s, "trace: window start, seconds of trace time");
  f.Add("max_output_tokens", &c.max_output_tokens,
        "trace: cap on each request's recorded output_length (0 = as recorded; generated "
        "with ignore_eos)");
  f.Add("max_input_tokens", &c.max_input_tokens, "trace: cut prompts to this many tokens (0 = off)");
  f.Add("trace_token_scale", &c.trace_token_scale,
        "trace: prompt sizes times this, in (0, 1] (blocks of round(block * scale) tokens): the "
        "trace's reuse structure at a size a small model serves");
  f.Add("trace_segments", &c.trace_segments,
        "trace: send each block as its own ids segment (--notrace_segments: one prompt_ids "
        "prompt, chunked by the router)");
  f.Add("documents", &c.documents, "longdocqa: documents");
  f.Add("document_tokens", &c.document_tokens, "longdocqa, numbers: tokens per document");
  f.Add("repeat", &c.repeat, "longdocqa: times each document is asked about per round");
  f.Add("repeat_mode", &c.repeat_mode,
        "longdocqa: random (a round shuffled) | tile (documents in order, round after round) | "
        "interleave (each document's repeats back to back)");
  f.Add("hit_miss", &c.hit_miss,
        "longdocqa: H:M, of every H + M requests the last M start with a fresh prefix (a miss "
        "for a prefix cache; LMCache's --hit-miss-ratio; \"\" = none)");
  f.Add("users", &c.users, "multiround: concurrent users (each sends every users / rate s)");
  f.Add("rounds", &c.rounds, "multiround: rounds per user, then a new user takes its place");
  f.Add("shared_system_tokens", &c.shared_system_tokens,
        "multiround: the system prompt all users share");
  f.Add("user_history_tokens", &c.user_history_tokens,
        "multiround: each user's own context, in its first message");
  f.Add("round_tokens", &c.round_tokens, "multiround: each round's new question");
  f.Add("answer_tokens", &c.answer_tokens,
        "multiround: each round's answer (max_tokens; synthetic answers of this size in the "
        "history)");
  f.Add("warmup", &o.warmup, "requests sent first, one at a time, not measured");
  f.Add("prime", &o.prime,
        "rag: send every pool document this many times (docs_per_request a request, one at a "
        "time, not measured) before the first run, so a worker that stores a segment at its "
        "n-th miss holds them all (0 = off)");
  f.Add("seed", &c.seed, "workload and arrival seed");
  f.Add("pool_seed", &c.pool_seed, "rag: document pool seed (0: from --seed; fixed: same pool across sweep points)");
  f.Add("timeout_ms", &o.timeout_ms, "per-request deadline");
  f.Add("max_tokens", &o.max_tokens, "tokens generated per request");
  f.Add("temperature", &o.temperature, "sampling temperature (0 = greedy)");
  f.Add("ignore_eos", &o.ignore_eos, "generate exactly --max_tokens (--noignore_eos: stop at EOS)");
  f.Add("reuse", &o.reuse,
        "on: segment reuse; off: ReuseOptions.enable=false (exact prefix "
        "cache only, as vLLM's automatic prefix caching)");
  f.Add("selector", &o.selector,
        "reuse selector (sparsex|cacheblend|epic|random; \"\" = worker's)");
  f.Add("recompute_ratio", &o.recompute_ratio, "reuse recompute ratio (< 0 = worker's)");
  f.Add("store_after_misses", &o.store_after_misses,
        "reuse.store_after_misses of every request: store a missing segment at its n-th miss "
        "(1: at once, e.g. chat turns that come back; 0 = the worker's)");
  f.Add("workload", &c.workload,
        "rag | textrag (rag through the OpenAI chat API: --api openai --content text, --docs "
        "default ../shared/models/tinystories-text/tinystories_sample.txt, --target default "
        "127.0.0.1:8000) | chat | agents | longdocqa | multiround | trace (implied by --trace)");
  f.Add("content", &o.content,
        "numbers (random token ids as ids segments, for synthetic models) "
        "| text (--docs file; *_tokens sizes count words)");
  f.Add("docs", &o.docs_path, "text file (paragraphs) for --content text");
  f.Add("doc_chars", &o.doc_chars, "text: paragraphs merged to about this many characters per doc");
  f.Add("min_id", &c.min_id, "numbers: smallest token id");
  f.Add("max_id", &c.max_id, "numbers: token ids are < this");
  f.Add("pool", &c.pool, "rag: documents in the pool");
  f.Add("zipf", &c.zipf, "rag: Zipf exponent of document popularity");
  f.Add("docs_per_request", &c.docs_per_request, "rag: distinct documents per request");
  f.Add("doc_tokens", &c.doc_tokens, "rag, numbers: tokens per document");
  f.Add("question_tokens", &c.question_tokens,
        "rag, longdocqa: tokens of the fresh question segment (longdocqa: 0 = none)");
  f.Add("sessions", &c.sessions, "chat: conversations");
  f.Add("order", &o.order, "chat/agents: rr (round robin) | random session / agent per request");
  f.Add("system_tokens", &c.system_tokens, "chat: system prompt tokens (one prompt, all sessions)");
  f.Add("turn_tokens", &c.turn_tokens, "chat/agents: tokens of each new user message");
  f.Add("reply_tokens", &c.reply_tokens,
        "chat/agents: tokens of each synthetic assistant turn "
        "(default: --max_tokens)");
  f.Add("max_history_tokens", &c.max_history_tokens,
        "chat/agents: history cap, oldest turns "
        "dropped (0 = no cap)");
  f.Add("agents", &c.agents, "agents: agents sharing the context");
  f.Add("shared_tokens", &c.shared_tokens, "agents: tokens of the shared context");
  f.Add("instr_tokens", &c.instr_tokens, "agents: tokens of each agent's instructions");
  f.Add("shared_first", &c.shared_first, "agents: put the shared context before the instructions");
  f.Add("slo_ttft_ms", &o.slo_ttft_ms, "goodput SLO on p99 TTFT");
  f.Add("slo_tpot_ms", &o.slo_tpot_ms, "goodput SLO on p99 TPOT");
  f.Add("out", &o.out, "write the summary JSON here (an array with --sweep)");
  f.Add("records", &o.records, "write one JSON line per request here");
  f.Add("channels", &o.channels, "gRPC connections to the router (requests round robin)");
  f.Add("max_inflight", &o.max_inflight, "open loop: most requests in flight (threads)");
  f.Add("wait_ready_s", &o.wait_ready_s, "wait this long for a serving cluster (Health)");
  f.Add("progress", &o.progress, "print a progress line to stderr every second");
  f.Add("dry_run", &o.dry_run, "print the first N requests' segment layout and exit");
  c.reply_tokens = -1;
  auto fail = [&](const std::string& msg) {
    std::cerr << "sparsex-loadgen: " << msg
              << (msg.find("--help") == std::string::npos ? " (see --help)\n" : "\n");
    return 2;
  };
  if (absl::Status s = f.Parse(argc, argv); !s.ok()) return fail(std::string(s.message()));
  if (f.help()) {
    std::cout << f.Usage();
    return 0;
  }
  if (o.content == "numbers")
    c.content = lg::Content::kNumbers;
  else if (o.content == "text")
    c.content = lg::Content::kText;
  else
    return fail("--content must be numbers or text");
  if (o.reuse != "on" && o.reuse != "off") return fail("--reuse must be on or off");
  if (o.order != "rr" && o.order != "random") return fail("--order must be rr or random");
  c.random_order = o.order == "random";
  if (c.reply_tokens < 0) c.reply_tokens = o.max_tokens;
  if (c.workload == "textrag") {
    // Text RAG as a real client sends it: chat messages over HTTP, documents pasted in.
    o.api = "openai";
    o.content = "text";
    c.content = lg::Content::kText;
    if (o.docs_path.empty()) o.docs_path = "../shared/models/tinystories-text/tinystories_sample.txt";
    if (o.target == "127.0.0.1:50051") o.target = "127.0.0.1:8000";
  }
  if (!o.trace.empty()) {
    if (c.workload != "rag" && c.workload != "trace") {
      return fail(absl::StrCat("--trace replays a trace; it does not combine with --workload ",
                               c.workload));
    }
    c.workload = "trace";
  } else if (c.workload == "trace") {
    return fail("--workload trace needs --trace FILE");
  }
  if (o.trace_mode()) {
    // The window is in trace time; the run ends with it.
    c.trace_duration_s = o.duration_s;
    o.duration_s = 0;
    if (o.requests < 0) o.requests = 0;
    if (c.content != lg::Content::kNumbers) return fail("a trace is token ids: --content numbers");
  } else if (o.requests < 0 && o.duration_s > 0) {
    o.requests = 0;  // until --duration_s
  }
  if (o.requests == 0 && o.duration_s <= 0 && !o.trace_mode()) {
    return fail("--requests 0 needs --duration_s");
  }
  if (o.min_requests < 1 || !(o.min_seconds >= 0)) {
    return fail("--min_requests must be >= 1 and --min_seconds >= 0");
  }
  if (o.api != "grpc" && o.api != "openai") return fail("--api must be grpc or openai");
  if (o.api_key.empty() && std::getenv("SPARSEX_API_KEY") != nullptr) {
    o.api_key = std::getenv("SPARSEX_API_KEY");
  }
  if (o.openai()) {
    if (c.content != lg::Content::kText) {
      return fail("--api openai sends chat messages of text: give --content text --docs FILE");
    }
    const size_t colon = o.target.rfind(':');
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(o.target.substr(colon + 1), &o.http_port) || o.http_port < 1 ||
        o.http_port > 65535) {
      return fail(absl::StrCat("--api openai needs --target host:port (the router's HTTP "
                               "address), not '", o.target, "'"));
    }
    o.http_host = o.target.substr(0, colon);
    if (o.http_host.size() > 2 && o.http_host.front() == '[') {
      o.http_host = o.http_host.substr(1, o.http_host.size() - 2);
    }
  }
  if (o.max_tokens < 1) return fail("--max_tokens must be >= 1");
  if (o.timeout_ms < 1) return fail("--timeout_ms must be >= 1");
  if (o.warmup < 0 || o.concurrency < 0) return fail("--warmup and --concurrency must be >= 0");
  if (o.prime < 0 || o.prime > 16) return fail("--prime must be 0-16");
  if (o.store_after_misses < 0 || o.store_after_misses > sparsex::kMaxStoreAfterMisses) {
    return fail(absl::StrCat("--store_after_misses must be 0-", sparsex::kMaxStoreAfterMisses));
  }
  std::vector<double> xs;
  if (!o.sweep.empty()) {
    for (absl::string_view p : absl::StrSplit(o.sweep, ',', absl::SkipEmpty())) {
      double v;
      if (!absl::SimpleAtod(p, &v) || !(v > 0))
        return fail(absl::StrCat("bad --sweep value '", p, "'"));
      if (o.closed() && v != std::floor(v)) return fail("--sweep concurrencies must be integers");
      xs.push_back(v);
    }
    if (xs.empty()) return fail("--sweep is empty");
  } else if (o.closed()) {
    xs.push_back(o.concurrency);
  } else if (o.trace_mode()) {
    xs.push_back(1);  // the trace's own rate at --time_scale
  } else {
    if (!(o.rate > 0) && o.dry_run == 0)
      return fail("give --rate R (open loop) or --concurrency C");
    xs.push_back(o.rate);
  }

  c.rate = xs.empty() || o.closed() || !(xs[0] > 0) ? 1 : xs[0];  // multiround's pacing (per point in RunOnce)
  std::vector<lg::TraceEntry> trace;
  if (o.trace_mode()) {
    // A bare name is looked up where the shared traces live (docs/benchmarks.md).
    std::string path = o.trace;
    if (path.find('/') == std::string::npos && !std::ifstream(path).good()) {
      const char* env = std::getenv("SPARSEX_TRACES");
      for (const std::string& dir : {env != nullptr ? std::string(env) : std::string(),
                                     std::string("../shared/traces")}) {
        if (!dir.empty() && std::ifstream(dir + "/" + path).good()) {
          path = dir + "/" + path;
          break;
        }
      }
    }
    absl::StatusOr<std::vector<lg::TraceEntry>> t =
        lg::LoadMooncakeTrace(path, c.trace_block_tokens);
    if (!t.ok()) {
      std::cerr << "sparsex-loadgen: " << t.status().message()
                << (path == o.trace && o.trace.find('/') == std::string::npos
                        ? " (nor in $SPARSEX_TRACES or ../shared/traces)"
                        : "")
                << "\n";
      return 1;
    }
    trace = std::move(*t);
    o.trace = path;
    c.trace = &trace;
  }
  std::vector<std::string> docs;
  if (c.content == lg::Content::kText) {
    if (o.docs_path.empty()) return fail("--content text needs --docs FILE");
    docs = lg::LoadTextDocs(o.docs_path, static_cast<size_t>(std::max(o.doc_chars, 1)), 0);
    if (docs.empty()) {
      std::cerr << "sparsex-loadgen: no documents in " << o.docs_path << "\n";
      return 1;
    }
    if ((c.workload == "rag" || c.workload == "textrag") && static_cast<int>(docs.size()) < c.pool) {
      std::cerr << "sparsex-loadgen: " << o.docs_path << " has " << docs.size() << " documents of ~"
                << o.doc_chars << " chars; the pool is " << docs.size() << "\n";
    }
  }
  {
    absl::StatusOr<std::unique_ptr<lg::Workload>> gen = lg::MakeWorkload(c, docs);
    if (!gen.ok()) return fail(std::string(gen.status().message()));
    if (o.dry_run > 0) return DryRun(o, **gen);
  }

  std::ofstream records, dumps;
  if (!o.records.empty()) {
    records.open(o.records);
    if (!records) {
      std::cerr << "sparsex-loadgen: cannot write " << o.records << "\n";
      return 1;
    }
  }
  if (!o.dump_requests.empty()) {
    dumps.open(o.dump_requests);
    if (!dumps) {
      std::cerr << "sparsex-loadgen: cannot write " << o.dump_requests << "\n";
      return 1;
    }
  }
  Client client(o);
  if (o.wait_ready_s > 0) {
    if (absl::Status s = client.WaitReady(); !s.ok()) {
      std::cerr << "sparsex-loadgen: " << s.message() << "\n";
      return 1;
    }
  }
  if (o.prime > 0) {
    absl::StatusOr<std::unique_ptr<lg::Workload>> gen = lg::MakeWorkload(o.wc, docs);
    if (!gen.ok()) return fail(std::string(gen.status().message()));
    const std::vector<lg::RequestSpec> prime = (*gen)->Prime(o.prime);
    RunState p;
    p.start = Clock::now();
    for (const lg::RequestSpec& spec : prime) {
      if (dumps.is_open()) dumps << DumpJson(o, -1, spec, true) << "\n";
      SendOne(client, o, p, Prepare(o, -1, spec, true), Clock::now());
    }
    if (prime.empty()) std::fprintf(stderr, "prime: workload %s has nothing to prime\n", c.workload.c_str());
    std::fprintf(stderr, "prime: %zu requests (%d passes over the pool), %lld errors\n",
                 prime.size(), o.prime, static_cast<long long>(p.errors.load()));
  }
  std::vector<Summary> rows;
  for (size_t i = 0; i < xs.size(); ++i) {
    absl::StatusOr<Summary> s =
        RunOnce(client, o, static_cast<int>(i), xs[i], docs,
                records.is_open() ? &records : nullptr, dumps.is_open() ? &dumps : nullptr);
    if (!s.ok()) return fail(std::string(s.status().message()));
    rows.push_back(std::move(*s));
  }
  PrintTable(o, rows);
  // Goodput of the sweep: the highest offered rate whose point met the SLO; each point's record
  // carries it, so one record read alone tells the sweep's result.
  std::vector<lg::SloPoint> points;
  for (const Summary& s : rows) {
    points.push_back({s.x, s.ttft99, s.tpot99, s.completed, s.errors});
  }
  const double goodput = lg::GoodputX(points, o.slo_ttft_ms, o.slo_tpot_ms);
  int unsustained = 0;
  for (Summary& s : rows) {
    s.json.insert(s.json.size() - 1, absl::StrCat(",\"sweep_goodput\":", lg::JsonNumber(goodput)));
    unsustained += s.sustained ? 0 : 1;
  }
  if (std::isnan(goodput)) {
    std::printf("goodput: no point met the SLO (p99 TTFT <= %g ms, p99 TPOT <= %g ms, no error)\n",
                o.slo_ttft_ms, o.slo_tpot_ms);
  } else {
    std::printf("goodput: %g %s (the highest point with p99 TTFT <= %g ms, p99 TPOT <= %g ms, "
                "no error)\n",
                goodput, o.closed() ? "clients" : "requests/s", o.slo_ttft_ms, o.slo_tpot_ms);
  }
  if (unsustained > 0) {
    std::printf("%d point(s) below the sustained rule (%d requests, %g s): \"sustained\": false\n",
                unsustained, o.min_requests, o.min_seconds);
  }
  int64_t completed = 0;
  for (const Summary& s : rows) completed += s.completed;
  if (!o.out.empty()) {
    std::ofstream out(o.out);
    if (o.sweep.empty()) {
      out << rows[0].json << "\n";
    } else {
      out << "[\n";
      for (size_t i = 0; i < rows.size(); ++i)
        out << rows[i].json << (i + 1 < rows.size() ? ",\n" : "\n");
      out << "]\n";
    }
    if (!out) {
      std::cerr << "sparsex-loadgen: cannot write " << o.out << "\n";
      return 1;
    }
    std::printf("wrote %s\n", o.out.c_str());
  }
  return completed > 0 ? 0 : 1;
}
