// The online correctness gate (docs/reliability.md): its sampling and escalation logic, and the
// worker's scheduler with it on stories260K: a broken reuse configuration (segments encoded
// after BOS, no full layer, nothing recomputed) is caught and reuse disabled while exact
// prefix caching still serves; the default configuration is left alone; and a replay never
// runs while user requests wait.
#include "gpu_worker/scheduler/quality_gate.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <random>
#include <thread>

#include "gpu_worker/scheduler/scheduler.h"
#include "tests/gpu_worker/test_util.h"
#include "tests/scheduler/test_util.h"

namespace sparsex::service {
namespace {

using testutil::Collected;
using testutil::Drain;
using testutil::WaitUntil;

TEST(QualityGate, ReplaysTheWarmupThenOneInAHundred) {
  QualityGateOptions o;
  o.enabled = true;
  o.warmup_requests = 5;
  o.sample_rate = 0.01;
  QualityGate g(o);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(g.ShouldSample()) << i;
  int sampled = 0;
  for (int i = 0; i < 1000; ++i) sampled += g.ShouldSample();
  EXPECT_EQ(sampled, 10);
  o.enabled = false;
  QualityGate off(o);
  EXPECT_FALSE(off.ShouldSample());
}

TEST(QualityGate, StepsUpThenDisablesReuse) {
  QualityGateOptions o;
  o.enabled = true;
  o.window = 4;
  o.min_samples = 4;
  o.max_steps = 2;
  o.warmup_requests = 0;
  QualityGate g(o);
  ReuseOptions base;
  base.full_layers = 1;
  base.budget.ratio = 0.15f;
  // Good figures: nothing changes.
  for (int i = 0; i < 20; ++i) EXPECT_EQ(g.Record(0.0005, true), "");
  EXPECT_EQ(g.state().level, 0);
  EXPECT_NEAR(g.state().rolling_top1, 1.0, 1e-9);
  // One disagreement in the full window of 4 (agreement 0.75 < 0.85): step 1; then 2, each
  // judged on a fresh window.
  std::string line = g.Record(0.0005, false);
  EXPECT_EQ(g.state().level, 1);
  EXPECT_NE(line.find("stepped up to level 1"), std::string::npos) << line;
  ReuseOptions r = base;
  g.Apply(r, 5);
  EXPECT_EQ(r.full_layers, 2);
  EXPECT_NEAR(r.budget.ratio, 0.30f, 1e-6);
  EXPECT_TRUE(r.enable_reuse);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(g.Record(0.2, false), "");  // window not full yet
  EXPECT_NE(g.Record(0.2, false), "");
  EXPECT_EQ(g.state().level, 2);
  // A high KL with agreement also fails; after the last step reuse is disabled.
  for (int i = 0; i < 3; ++i) g.Record(0.3, true);
  line = g.Record(0.3, true);
  EXPECT_TRUE(g.state().reuse_disabled);
  EXPECT_NE(line.find("DISABLED"), std::string::npos) << line;
  EXPECT_EQ(g.state().breaches, 3);
  r = base;
  g.Apply(r, 5);
  EXPECT_FALSE(r.enable_reuse);
  EXPECT_FALSE(g.ShouldSample());
  // The quality budget steps by tightening its target.
  QualityGate q(o);
  for (int i = 0; i < 4; ++i) q.Record(1.0, false);
  ReuseOptions qo = base;
  qo.budget.mode = BudgetOptions::Mode::kQuality;
  qo.budget.target_drop = 0.01f;
  q.Apply(qo, 5);
  EXPECT_NEAR(qo.budget.target_drop, 0.0025f, 1e-6);
}

TEST(QualityGate, FirstTokenKl) {
  const std::vector<float> a = {1, 2, 3}, b = {1, 2, 3}, c = {3, 2, 1};
  EXPECT_NEAR(FirstTokenKl(a, b), 0.0, 1e-9);
  EXPECT_GT(FirstTokenKl(a, c), 0.5);
}

// RAG-style requests on stories260K from TinyStories paragraphs: 4 of a pool of documents in a
// random order, then a new question-like suffix (the opening of another paragraph).
class GateOnStories : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::LoadStories260K();
    ASSERT_NE(model_, nullptr);
    std::ifstream in(testing::TinyStoriesPath());
    ASSERT_TRUE(in) << testing::TinyStoriesPath();
    std::string line;
    while (std::getline(in, line) && docs_.size() < 40) {
      std::vector<int32_t> ids = model_->tokenizer().Encode(line, false);
      if (ids.size() < 40) continue;
      ids.resize(std::min<size_t>(ids.size(), 80));
      docs_.push_back(std::move(ids));
    }
    ASSERT_GE(docs_.size(), 40u);
  }
  WorkItem Request(std::mt19937_64& rng, int pool) const {
    std::vector<int> idx(pool);
    for (int i = 0; i < pool; ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), rng);
    WorkItem w;
    w.reuse = reuse_;  // what the service merges from the worker's defaults
    for (int j = 0; j < 4; ++j) w.segments.push_back({docs_[idx[j]], true});
    const auto& q = docs_[pool + rng() % (docs_.size() - pool)];
    w.segments.push_back({{q.begin(), q.begin() + 8 + rng() % 12}, false});
    w.sampling.max_tokens = 1;
    w.sampling.temperature = 0;
    return w;
  }
  // Every pool document stored (by plain "earlier requests" of one document each).
  void StorePool(BatchScheduler& s, int pool) const {
    for (int d = 0; d < pool; ++d) {
      WorkItem w;
      w.reuse = reuse_;
      w.segments.push_back({docs_[d], true});
      w.sampling.max_tokens = 1;
      auto h = s.Submit(std::move(w));
      ASSERT_TRUE(h.ok()) << h.status();
      ASSERT_TRUE(Drain(**h).final.status.ok());
    }
    // Their deferred stores done (the requests below then reuse all four documents).
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    WaitUntil([&] { return s.load().pending_stores == 0; });
  }
  // The pool stored, then 48 requests of it one after the other: the gate's state afterwards
  // (printed under `label`).
  QualityGateState StoreAndRun(BatchScheduler& s, std::mt19937_64& rng, int pool,
                               const char* label) const {
    StorePool(s, pool);
    RunSequential(s, 48, rng, pool);
    const QualityGateState g = s.load().gate;
    std::printf("%s: replays %lld, level %d, disabled %d, breaches %lld, agree %lld, mean KL "
                "%.5f, rolling median %.5f\n",
                label, static_cast<long long>(g.replays), g.level, g.reuse_disabled,
                static_cast<long long>(g.breaches), static_cast<long long>(g.top1_agree),
                g.replays ? g.kl_sum / g.replays : 0.0, g.rolling_median_kl);
    return g;
  }
  // Runs n requests one after the other (replays run in the idle time between them), then
  // waits until the replays queued are done.
  void RunSequential(BatchScheduler& s, int n, std::mt19937_64& rng, int pool) const {
    for (int i = 0; i < n; ++i) {
      auto h = s.Submit(Request(rng, pool));
      ASSERT_TRUE(h.ok()) << h.status();
      Collected c = Drain(**h);
      ASSERT_TRUE(c.final.status.ok()) << c.final.status;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    for (int i = 0; i < 2000; ++i) {
      if (s.load().gate_pending == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  std::unique_ptr<Model> model_;
  SegmentStore store_{{}};
  ReuseOptions reuse_;
  std::vector<std::vector<int32_t>> docs_;
};

SchedulerOptions GateOptions() {
  SchedulerOptions o;
  o.engine.kv.num_blocks = 512;
  o.gate.enabled = true;
  o.gate.warmup_requests = 1000;  // judge every request
  o.gate.window = 16;
  o.gate.min_samples = 16;
  o.gate.max_steps = 1;
  o.gate.max_pending = 64;
  return o;
}

TEST_F(GateOnStories, CatchesBrokenReuseAndDisablesIt) {
  // Broken: segments encoded after BOS (stories260K reads BOS as "a new story starts"), no full
  // layer and nothing recomputed, i.e. naive reuse of mis-encoded KV, and a selector that
  // recomputes random tokens, so that one step up (F = 1, r = 0.15) does not restore it.
  SchedulerOptions o = GateOptions();
  o.reuse.encoding = "bos";
  o.reuse.selector = "random";
  o.reuse.full_layers = 0;
  o.reuse.budget.ratio = 0.0f;
  reuse_ = o.reuse;
  std::vector<std::string> lines;
  SchedulerHooks hooks;
  hooks.on_gate_event = [&](const std::string& line, const QualityGateState&) {
    lines.push_back(line);
  };
  auto s = BatchScheduler::Start(*model_, &store_, o, hooks);
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937_64 rng(3);
  const int pool = 12;
  const QualityGateState g = StoreAndRun(**s, rng, pool, "broken");
  for (const auto& l : lines) std::printf("  %s\n", l.c_str());
  ASSERT_TRUE(g.reuse_disabled);
  EXPECT_EQ(g.level, 1);
  EXPECT_EQ(g.breaches, 2);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[1].find("DISABLED"), std::string::npos);
  // Reuse is off: the same request twice is served by plain prefill, the second time from the
  // exact prefix cache, with full prefill's answer.
  WorkItem w = Request(rng, pool);
  WorkItem ref = w;
  ref.reuse.enable_reuse = false;
  ref.reuse.register_prefix = false;
  auto h1 = (*s)->Submit(w);
  Collected c1 = Drain(**h1);
  auto h2 = (*s)->Submit(w);
  Collected c2 = Drain(**h2);
  EXPECT_EQ(c1.final.usage.reused_tokens, 0);
  EXPECT_EQ(c2.final.usage.reused_tokens, 0);
  EXPECT_GT(c2.final.usage.prefix_tokens, 0);
  SchedulerOptions po;
  po.engine.kv.num_blocks = 512;
  po.engine.kv.enable_prefix_caching = false;
  SegmentStore other({});
  auto plain = BatchScheduler::Start(*model_, &other, po);
  ASSERT_TRUE(plain.ok());
  auto h3 = (*plain)->Submit(ref);
  EXPECT_EQ(c2.ids, Drain(**h3).ids);
}

TEST_F(GateOnStories, LeavesTheDefaultConfigurationAlone) {
  SchedulerOptions o = GateOptions();  // F = 2, r = 0.15, encoding none
  auto s = BatchScheduler::Start(*model_, &store_, o);
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937_64 rng(3);
  const QualityGateState g = StoreAndRun(**s, rng, 12, "default");
  EXPECT_GE(g.replays, 40);
  EXPECT_EQ(g.level, 0);
  EXPECT_FALSE(g.reuse_disabled);
  EXPECT_EQ(g.breaches, 0);
}

TEST_F(GateOnStories, ReplaysNeverRunWhileUserRequestsWait) {
  SchedulerOptions o = GateOptions();
  o.max_running = 1;  // the others wait in the queue
  std::atomic<int64_t> slices_seen{0};
  std::atomic<int> finished{0};
  std::atomic<BatchScheduler*> sched{nullptr};
  SchedulerHooks hooks;
  hooks.on_finished = [&](const RequestUsage&, const std::string&, const absl::Status&) {
    // Engine thread: every replay slice so far, published at the end of the iteration before.
    if (BatchScheduler* p = sched.load()) {
      slices_seen = std::max<int64_t>(slices_seen, p->load().gate_slices);
    }
    ++finished;
  };
  auto s = BatchScheduler::Start(*model_, &store_, o, hooks);
  ASSERT_TRUE(s.ok()) << s.status();
  const int pool = 12;
  StorePool(**s, pool);
  // Stores are done, no replay is due (no reuse request yet).
  WaitUntil([&] { return (*s)->load().pending_stores == 0; });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ((*s)->load().gate_slices, 0);
  sched = s->get();
  const int before = finished.load();
  std::mt19937_64 rng(5);
  constexpr int kRequests = 12;
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (int i = 0; i < kRequests; ++i) {
    WorkItem w = Request(rng, pool);
    w.sampling.max_tokens = 4;
    auto h = (*s)->Submit(std::move(w));
    ASSERT_TRUE(h.ok()) << h.status();
    hs.push_back(*h);
  }
  for (auto& h : hs) ASSERT_TRUE(Drain(*h).final.status.ok());
  // on_finished runs just after the final chunk is pushed.
  WaitUntil([&] { return finished.load() - before >= kRequests; });
  EXPECT_EQ(finished.load() - before, kRequests);
  // While any of them was queued or running, no replay slice ran.
  EXPECT_EQ(slices_seen.load(), 0);
  // Afterwards, in idle time, every sampled request was replayed.
  WaitUntil([&] { return (*s)->load().gate.replays >= kRequests; });
  EXPECT_EQ((*s)->load().gate.replays, kRequests);
  EXPECT_GT((*s)->load().gate_slices, 0);
  // A user request arriving while replays wait goes first: replays are abandoned (preempted)
  // or wait, and the request is served.
  for (int i = 0; i < 8; ++i) {
    auto h = (*s)->Submit(Request(rng, pool));
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(Drain(**h).final.status.ok());
  }
  sched = nullptr;
}

}  // namespace
}  // namespace sparsex::service
