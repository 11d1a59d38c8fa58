// sparsex-loadgen: the serving benchmark's load generator (issue 18 §4). Sends a seeded
// rag / chat / agents workload (workloads.h) to the router's public streaming API
// (sparsex.v1.SparseX/Generate), open loop (Poisson arrivals at --rate) or closed loop
// (--concurrency clients), with segment reuse on or off, and reports TTFT / TPOT / E2E
// percentiles, throughput, errors by gRPC code and the Usage sums. docs/benchmarks.md,
// "Serving load generator", has the flags and the JSON schema.
//
//   sparsex-loadgen --target 127.0.0.1:50051 --workload rag --rate 2 --requests 200
//       --reuse on --out rag_on.json
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
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/loadgen/stats.h"
#include "bench/loadgen/workloads.h"
#include "common/flags.h"
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
};

// One request's outcome.
struct Record {
  int64_t index = 0;
  int group = -1;
  int prompt_tokens_est = 0;
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
  for (const lg::SegmentSpec& s : r.segments) {
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
  sp->set_max_tokens(o.max_tokens);
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
void Execute(v1::SparseX::Stub* stub, const v1::GenerateRequest& req, int timeout_ms, Record* rec) {
  grpc::ClientContext ctx;
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
  bool goodput_ok = false;
  std::map<std::string, int64_t> by_code;
  std::string last_error;
};

Summary Summarize(const Options& o, double x, const std::vector<Record>& recs, double send_s,
                  int max_inflight) {
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
  // No TPOT sample (max_tokens 1) does not fail the SLO; no completed request does.
  s.goodput_ok = s.completed > 0 && s.errors == 0 && s.ttft99 <= o.slo_ttft_ms &&
                 (std::isnan(s.tpot99) || s.tpot99 <= o.slo_tpot_ms);

  JsonObj codes;
  for (const auto& [k, v] : by_code) codes.Num(k, static_cast<double>(v));
  const lg::WorkloadConfig& c = o.wc;
  JsonObj cfg;
  cfg.Num("seed", static_cast<double>(c.seed)).Str("target", o.target).Str("model", o.model);
  if (c.content == lg::Content::kNumbers) {
    cfg.Num("min_id", c.min_id).Num("max_id", c.max_id);
  } else {
    cfg.Str("docs", o.docs_path).Num("doc_chars", o.doc_chars);
  }
  if (c.workload == "rag") {
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
      .Num("warmup", o.warmup);
  if (!o.selector.empty()) cfg.Str("selector", o.selector);
  if (o.recompute_ratio >= 0) cfg.Num("recompute_ratio", o.recompute_ratio);
  if (o.store_after_misses > 0) cfg.Num("store_after_misses", o.store_after_misses);

  JsonObj j;
  j.Str("workload", c.workload)
      .Str("content", o.content)
      .Str("mode", o.reuse_on() ? "reuse_on" : "reuse_off")
      .Bool("reuse", o.reuse_on())
      .Str("arrival", o.closed() ? "closed" : "poisson")
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
      .Num("scheduled_ms", r.scheduled_ms)
      .Num("lag_ms", r.lag_ms)
      .Num("ttft_ms", r.ttft_ms)
      .Num("tpot_ms", r.tpot_ms)
      .Num("e2e_ms", r.e2e_ms)
      .Num("tokens", r.tokens)
      .Str("code", CodeName(r.code));
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
      grpc::ClientContext ctx;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      ctx.set_deadline(
          std::chrono::system_clock::now() +
          std::clamp(left, std::chrono::milliseconds(100), std::chrono::milliseconds(2000)));
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
  std::vector<Record> records;
  std::vector<double> ttft;  // completed requests, for the progress line
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
    std::lock_guard<std::mutex> l(mu);
    if (r.code == grpc::StatusCode::OK) {
      if (!std::isnan(r.ttft_ms)) ttft.push_back(r.ttft_ms);
    } else {
      ++errors;
    }
    records.push_back(std::move(r));
    ++done;
    --inflight;
  }
};

// A request ready to send.
struct Prepared {
  int64_t index = 0;
  int group = -1, prompt_tokens_est = 0;
  v1::GenerateRequest req;
};

Prepared Prepare(const Options& o, int run, const lg::RequestSpec& spec, bool warmup) {
  Prepared p;
  p.index = spec.index;
  p.group = spec.group;
  p.prompt_tokens_est = spec.prompt_tokens();
  p.req = ToProto(spec, o, absl::StrCat("lg-", run, warmup ? "-w" : "-", spec.index));
  return p;
}

// Sends one request of the run (on the calling thread) and records it.
void SendOne(Client& client, const Options& o, RunState& st, const Prepared& p,
             Clock::time_point scheduled) {
  Record rec;
  rec.index = p.index;
  rec.group = p.group;
  rec.prompt_tokens_est = p.prompt_tokens_est;
  rec.scheduled_ms = Ms(scheduled - st.start);
  rec.lag_ms = std::max(0.0, Ms(Clock::now() - scheduled));
  st.Begin();
  Execute(client.stub(p.index), p.req, o.timeout_ms, &rec);
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

// One measured run at rate (open loop) or concurrency (closed loop) x.
absl::StatusOr<Summary> RunOnce(Client& client, const Options& o, int run, double x,
                                const std::vector<std::string>& docs, std::ofstream* records) {
  lg::WorkloadConfig wc = o.wc;
  if (o.sweep_vary_seed) wc.seed += static_cast<uint64_t>(run);
  absl::StatusOr<std::unique_ptr<lg::Workload>> gen = lg::MakeWorkload(wc, docs);
  if (!gen.ok()) return gen.status();
  const std::string label =
      o.closed() ? absl::StrCat("concurrency ", x) : absl::StrCat("rate ", x, "/s");

  // Warmup: the sequence's first requests, one at a time, not measured.
  if (o.warmup > 0) {
    RunState w;
    w.start = Clock::now();
    for (int i = 0; i < o.warmup; ++i) {
      SendOne(client, o, w, Prepare(o, run, (*gen)->Next(), true), Clock::now());
    }
    std::fprintf(stderr, "[%s] warmup: %d requests, %lld errors\n", label.c_str(), o.warmup,
                 static_cast<long long>(w.errors.load()));
  }

  const int64_t limit = o.requests;  // 0: until --duration_s
  const auto duration =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_s));
  RunState st;
  st.start = Clock::now() + std::chrono::milliseconds(10);
  std::atomic<bool> stop_progress{false};
  std::thread progress;
  if (o.progress) progress = std::thread([&] { Progress(o, st, label, stop_progress); });
  Clock::time_point last_send = st.start;

  if (o.closed()) {
    std::mutex gen_mu;
    int64_t issued = 0;
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
            if ((limit > 0 && issued >= limit) ||
                (o.duration_s > 0 && now - st.start >= duration)) {
              break;
            }
            ++issued;
            ++st.sent;
            spec = (*gen)->Next();
            last_send = now;
          }
          const Prepared p = Prepare(o, run, spec, false);
          SendOne(client, o, st, p, Clock::now());
        }
      });
    }
    for (std::thread& t : clients) t.join();
  } else {
    lg::PoissonArrivals arrivals(x, wc.seed);
    Launcher launcher(o.max_inflight);
    Clock::time_point t = st.start;
    for (int64_t i = 0;; ++i) {
      if (limit > 0 && i >= limit) break;
      if (o.duration_s > 0 && t - st.start >= duration) break;
      auto p = std::make_shared<const Prepared>(Prepare(o, run, (*gen)->Next(), false));
      std::this_thread::sleep_until(t);
      ++st.sent;
      last_send = t;
      launcher.Submit([&client, &o, &st, p, t] { SendOne(client, o, st, *p, t); });
      t += std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(arrivals.NextGapS()));
    }
    launcher.Join();
  }
  stop_progress = true;
  if (progress.joinable()) progress.join();

  std::sort(st.records.begin(), st.records.end(),
            [](const Record& a, const Record& b) { return a.index < b.index; });
  if (records != nullptr) {
    for (const Record& r : st.records) *records << RecordJson(o, run, x, r) << "\n";
    records->flush();
  }
  return Summarize(o, x, st.records, Ms(last_send - st.start) / 1000.0, st.max_inflight.load());
}

void PrintTable(const Options& o, const std::vector<Summary>& rows) {
  std::printf(
      "\nsparsex-loadgen: workload %s (%s), reuse %s, %s, max_tokens %d, SLO TTFT p99 <= %g ms, "
      "TPOT p99 <= %g ms\n",
      o.wc.workload.c_str(), o.content.c_str(), o.reuse.c_str(),
      o.closed() ? "closed loop" : "Poisson arrivals", o.max_tokens, o.slo_ttft_ms, o.slo_tpot_ms);
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

void DryRun(const Options& o, lg::Workload& gen) {
  for (int i = 0; i < o.dry_run; ++i) {
    const lg::RequestSpec r = gen.Next();
    std::printf("request %lld group %d prompt ~%d tokens:", static_cast<long long>(r.index),
                r.group, r.prompt_tokens());
    for (const lg::SegmentSpec& s : r.segments) {
      std::printf(" %s", lg::KindName(s.kind));
      if (s.source >= 0) std::printf("#%d", s.source);
      std::printf("(%d%s)", s.tokens, s.cacheable ? "" : ",nocache");
    }
    std::printf("\n");
  }
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
        "measured requests per run (default 100 without --duration_s; "
        "0 = until --duration_s)");
  f.Add("duration_s", &o.duration_s, "stop sending after this many seconds (0 = off)");
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
  f.Add("workload", &c.workload, "rag | chat | agents");
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
  f.Add("question_tokens", &c.question_tokens, "rag: tokens of the fresh question segment");
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
  if (o.requests < 0) o.requests = o.duration_s > 0 ? 0 : 100;
  if (o.requests == 0 && o.duration_s <= 0) return fail("--requests 0 needs --duration_s");
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
  } else {
    if (!(o.rate > 0) && o.dry_run == 0)
      return fail("give --rate R (open loop) or --concurrency C");
    xs.push_back(o.rate);
  }

  std::vector<std::string> docs;
  if (c.content == lg::Content::kText) {
    if (o.docs_path.empty()) return fail("--content text needs --docs FILE");
    docs = lg::LoadTextDocs(o.docs_path, static_cast<size_t>(std::max(o.doc_chars, 1)), 0);
    if (docs.empty()) {
      std::cerr << "sparsex-loadgen: no documents in " << o.docs_path << "\n";
      return 1;
    }
    if (c.workload == "rag" && static_cast<int>(docs.size()) < c.pool) {
      std::cerr << "sparsex-loadgen: " << o.docs_path << " has " << docs.size() << " documents of ~"
                << o.doc_chars << " chars; the pool is " << docs.size() << "\n";
    }
  }
  {
    absl::StatusOr<std::unique_ptr<lg::Workload>> gen = lg::MakeWorkload(c, docs);
    if (!gen.ok()) return fail(std::string(gen.status().message()));
    if (o.dry_run > 0) {
      DryRun(o, **gen);
      return 0;
    }
  }

  std::ofstream records;
  if (!o.records.empty()) {
    records.open(o.records);
    if (!records) {
      std::cerr << "sparsex-loadgen: cannot write " << o.records << "\n";
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
      SendOne(client, o, p, Prepare(o, -1, spec, true), Clock::now());
    }
    std::fprintf(stderr, "prime: %zu requests (%d passes over the pool), %lld errors\n",
                 prime.size(), o.prime, static_cast<long long>(p.errors.load()));
  }
  std::vector<Summary> rows;
  for (size_t i = 0; i < xs.size(); ++i) {
    absl::StatusOr<Summary> s = RunOnce(client, o, static_cast<int>(i), xs[i], docs,
                                        records.is_open() ? &records : nullptr);
    if (!s.ok()) return fail(std::string(s.status().message()));
    rows.push_back(std::move(*s));
  }
  PrintTable(o, rows);
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
