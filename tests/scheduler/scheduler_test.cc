// The worker's continuous-batching engine loop on the real stories260K model: concurrent
// requests interleave yet each produces exactly what the unbatched reference loop produces;
// cancellation frees the KV blocks; reuse counters; validation and load shedding.
#include "gpu_worker/scheduler/scheduler.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/bf16.h"
#include "common/fingerprint.h"
#include "tests/gpu_worker/reference_generate.h"
#include "tests/gpu_worker/test_util.h"
#include "tests/scheduler/test_util.h"

namespace sparsex::service {
namespace {

using namespace std::chrono_literals;

using testutil::Collected;
using testutil::Drain;
using testutil::WaitUntil;

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::LoadStories260K();
    ASSERT_NE(model_, nullptr);
    store_ = std::make_unique<SegmentStore>(SegmentStoreOptions{});
  }
  std::unique_ptr<BatchScheduler> Start(SchedulerOptions o = {}) {
    if (o.engine.kv.num_blocks == 4096) o.engine.kv.num_blocks = 512;
    auto s = BatchScheduler::Start(*model_, store_.get(), o, hooks_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }
  std::vector<int32_t> Enc(const std::string& s) { return model_->tokenizer().Encode(s, false); }
  WorkItem Item(std::vector<PromptSegment> segs, int max_tokens, bool reuse = true) {
    WorkItem w;
    w.segments = std::move(segs);
    w.sampling.max_tokens = max_tokens;
    w.reuse.enable_reuse = reuse;
    return w;
  }
  // Runs a request to its end, then waits until the stores it queued have run: its usage.
  RequestUsage RunThenStores(BatchScheduler& s, WorkItem w) {
    auto h = s.Submit(std::move(w));
    EXPECT_TRUE(h.ok());
    if (!h.ok()) return {};
    Collected c = Drain(**h);
    EXPECT_TRUE(c.final.status.ok()) << c.final.status;
    WaitUntil([&] { return s.load().pending_stores == 0; });
    return c.final.usage;
  }
  // What a lone engine produces for this prompt (greedy).
  std::vector<int32_t> Reference(const std::vector<PromptSegment>& segs, int max_tokens) {
    EngineOptions eo;
    eo.kv.num_blocks = 512;
    auto e = Engine::Create(*model_, eo);
    EXPECT_TRUE(e.ok());
    GenerateRequest r;
    r.prompt.push_back(model_->tokenizer().bos_id());
    for (const auto& s : segs) r.prompt.insert(r.prompt.end(), s.tokens.begin(), s.tokens.end());
    r.sampling.max_tokens = max_tokens;
    auto g = sparsex::testing::Generate(**e, r, nullptr);
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? g->tokens : std::vector<int32_t>{};
  }

  // A bf16 segment of this model's shape, n_tokens long, every K value k and every V value v
  // (what a cluster fetch offers).
  SegmentKvBf16 UniformSegment(int n_tokens, float k, float v) const {
    const ModelConfig& c = model_->config();
    SegmentKvBf16 kv;
    kv.n_tokens = n_tokens;
    kv.n_layers = c.n_layers;
    kv.kv_dim = c.n_kv_heads * c.head_dim;
    const size_t n = static_cast<size_t>(n_tokens) * kv.kv_dim;
    kv.k.assign(kv.n_layers, std::vector<uint16_t>(n, ToBf16(k)));
    kv.v.assign(kv.n_layers, std::vector<uint16_t>(n, ToBf16(v)));
    return kv;
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<SegmentStore> store_;
  SchedulerHooks hooks_;
  const std::string kDocA = "Lily went to the park with her mom. They saw a big red ball and played "
                            "with it all day long until the sun went down.";
  const std::string kDocB = "Tom had a little dog named Max. Max liked to run and jump in the "
                            "garden, and he barked at the birds in the tall tree.";
  const std::string kQ = " What did they do next? They";
};

// A test whose fetch thread waits on a flag must release it however the test ends: a failed
// ASSERT returns early, and the scheduler's Stop() (which joins the fetch threads) would then
// wait forever, a ctest timeout instead of a failure. Declared after the flag, so it runs
// while the flag still lives.
struct ReleaseOnExit {
  std::atomic<bool>& flag;
  BatchScheduler& scheduler;
  ~ReleaseOnExit() {
    flag = true;
    scheduler.Stop();
  }
};

// With mix_prefill_decode (the default) a chunk and the decode step share one forward pass;
// without it they alternate. Either way every request gets a lone engine's answer.
TEST_F(SchedulerTest, ConcurrentPlainRequestsMatchALoneEngine) {
 for (bool mix : {true, false}) {
  SCOPED_TRACE(mix ? "mixed passes" : "separate passes");
  SchedulerOptions o;
  o.prefill_chunk = 7;  // many chunks: prefill chunks interleave with decode steps
  o.mix_prefill_decode = mix;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  const std::vector<std::string> prompts = {"Once upon a time", kDocA, kDocB + kQ,
                                            "The cat sat on the mat and"};
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto h = s->Submit(Item({{Enc(prompts[i])}}, 20 + static_cast<int>(i), /*reuse=*/false));
    ASSERT_TRUE(h.ok()) << h.status();
    hs.push_back(*h);
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    Collected c = Drain(*hs[i]);
    ASSERT_TRUE(c.final.status.ok()) << c.final.status;
    EXPECT_EQ(c.ids, Reference({{Enc(prompts[i])}}, 20 + static_cast<int>(i))) << prompts[i];
    EXPECT_EQ(c.final.usage.completion_tokens, static_cast<int>(c.ids.size()));
    EXPECT_GT(c.final.usage.ttft_ms, 0);
  }
  EXPECT_GT(s->load().iterations, 20);
  const double mixed_s = s->load().phase_seconds[static_cast<int>(EnginePhase::kMixed)];
  if (mix) {
    EXPECT_GT(mixed_s, 0.0);
  } else {
    EXPECT_EQ(mixed_s, 0.0);
  }
 }
}

// Short prompts queued together share one forward pass (their chunks fill prefill_chunk
// tokens): all six reach their first token in the same iteration, where one chunk per
// iteration took six, and each still gets a lone engine's answer. A first request, decoding
// meanwhile, gives the pass its decode rows under mix_prefill_decode.
TEST_F(SchedulerTest, ShortPromptsQueuedTogetherPrefillInOnePass) {
 for (bool mix : {true, false}) {
  SCOPED_TRACE(mix ? "mixed passes" : "separate passes");
  std::mutex mu;
  std::condition_variable cv;
  bool queued = false;
  int firsts = 0;
  std::vector<int64_t> first_at;  // iterations finished before each short prompt's first token
  BatchScheduler* sp = nullptr;
  // Holds the engine thread in the first request's first token until all six are queued, so
  // that one iteration admits them all.
  hooks_.on_first_token = [&](double) {
    std::unique_lock<std::mutex> l(mu);
    if (firsts++ == 0) {
      cv.notify_all();
      cv.wait(l, [&] { return queued; });
      return;
    }
    first_at.push_back(sp->load().iterations);
  };
  SchedulerOptions o;
  o.mix_prefill_decode = mix;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  sp = s.get();
  const std::vector<std::string> prompts = {
      "Once upon a time", "The cat sat on the mat and", "Tom had a little dog named Max.",
      "Lily went to the park with her mom.", "One day, a big bird flew", "The sun was hot and"};
  int total = 0;
  for (const auto& p : prompts) total += static_cast<int>(Enc(p).size()) + 1;
  ASSERT_LE(total, o.prefill_chunk);
  auto first = s->Submit(Item({{Enc(kDocA)}}, 30, /*reuse=*/false));
  ASSERT_TRUE(first.ok());
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, 30s, [&] { return firsts > 0; }));
  }
  std::vector<absl::StatusOr<std::shared_ptr<RequestHandle>>> hs;
  for (const auto& p : prompts) hs.push_back(s->Submit(Item({{Enc(p)}}, 12, /*reuse=*/false)));
  {
    std::lock_guard<std::mutex> l(mu);
    queued = true;
  }
  cv.notify_all();
  Collected c0 = Drain(**first);
  ASSERT_TRUE(c0.final.status.ok()) << c0.final.status;
  EXPECT_EQ(c0.ids, Reference({{Enc(kDocA)}}, 30));
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(hs[i].ok()) << hs[i].status();
    Collected c = Drain(**hs[i]);
    ASSERT_TRUE(c.final.status.ok()) << c.final.status;
    EXPECT_EQ(c.ids, Reference({{Enc(prompts[i])}}, 12)) << prompts[i];
  }
  std::lock_guard<std::mutex> l(mu);
  ASSERT_EQ(first_at.size(), prompts.size());
  for (int64_t it : first_at) EXPECT_EQ(it, first_at[0]) << "first tokens in different passes";
  s.reset();  // before the hook's captures go
 }
}

TEST_F(SchedulerTest, SecondRequestWithReorderedDocumentsReusesThem) {
  std::mutex mu;  // the hook runs on the engine thread
  std::vector<std::pair<Hash128, int>> stored;
  auto n_stored = [&] {
    std::lock_guard<std::mutex> l(mu);
    return stored.size();
  };
  hooks_.on_segments_stored = [&](const std::vector<std::pair<Hash128, int>>& s) {
    std::lock_guard<std::mutex> l(mu);
    stored.insert(stored.end(), s.begin(), s.end());
  };
  auto s = Start();
  ASSERT_NE(s, nullptr);
  auto h1 = s->Submit(Item({{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}}, 8));
  ASSERT_TRUE(h1.ok());
  Collected c1 = Drain(**h1);
  ASSERT_TRUE(c1.final.status.ok()) << c1.final.status;
  EXPECT_EQ(c1.final.usage.reused_tokens, 0);
  // Both documents are stored after the first token (deferred); the question is not cacheable.
  WaitUntil([&] { return s->load().pending_stores == 0; });
  EXPECT_EQ(s->load().pending_stores, 0);
  EXPECT_EQ(n_stored(), 2u);

  auto h2 = s->Submit(Item({{Enc(kDocB)}, {Enc(kDocA)}, {Enc(kQ), false}}, 8));
  ASSERT_TRUE(h2.ok());
  Collected c2 = Drain(**h2);
  ASSERT_TRUE(c2.final.status.ok()) << c2.final.status;
  const int docs = static_cast<int>(Enc(kDocA).size() + Enc(kDocB).size());
  EXPECT_EQ(c2.final.usage.reused_tokens, docs);
  EXPECT_EQ(c2.final.usage.segments_hit, 2);
  EXPECT_GT(c2.final.usage.recomputed_tokens, 0);
  EXPECT_LT(c2.final.usage.recomputed_tokens, docs);
  EXPECT_LT(c2.final.usage.compute_share, 0.8);
  EXPECT_EQ(n_stored(), 2u);  // nothing new stored
}

// With a device tier (the GPU's setup) a deferred store runs in slices of store_slice_layers
// layers between decode steps and keeps the KV in backend memory; the host copy (where the
// write-back and the router's events take it from) is made once the engine is idle, and only
// then is the segment reported. The answers equal those of a worker without the tier.
TEST_F(SchedulerTest, SlicedStoresFillTheDeviceTierAndSpillWhenIdle) {
  std::mutex mu;
  std::vector<std::pair<Hash128, int>> stored;
  hooks_.on_segments_stored = [&](const std::vector<std::pair<Hash128, int>>& st) {
    std::lock_guard<std::mutex> l(mu);
    stored.insert(stored.end(), st.begin(), st.end());
  };
  std::vector<std::vector<int32_t>> answers[2];
  for (int tiered = 1; tiered >= 0; --tiered) {
    store_ = std::make_unique<SegmentStore>(SegmentStoreOptions{});
    SchedulerOptions o;
    o.device_tier_bytes = tiered ? size_t{64} << 20 : 0;
    o.store_slice_layers = 1;  // stories260K's 5 layers: 5 iterations per store
    auto s = Start(o);
    ASSERT_NE(s, nullptr);
    auto h1 = s->Submit(Item({{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}}, 8));
    ASSERT_TRUE(h1.ok());
    Collected c1 = Drain(**h1);
    ASSERT_TRUE(c1.final.status.ok()) << c1.final.status;
    WaitUntil([&] { return s->load().pending_stores == 0 && s->load().unspilled_segments == 0; });
    EXPECT_EQ(s->load().pending_stores, 0);
    EXPECT_EQ(s->load().unspilled_segments, 0);
    // The worker exports these as sparsex_worker_kv_bytes{tier="device"}.
    if (tiered) EXPECT_GT(s->load().device_tier_bytes, 0u);
    else EXPECT_EQ(s->load().device_tier_bytes, 0u);
    {
      std::lock_guard<std::mutex> l(mu);
      EXPECT_EQ(stored.size(), 2u) << "tiered " << tiered;
      stored.clear();
    }
    EXPECT_TRUE(store_->Contains(SegmentFingerprint(model_->fingerprint(), Enc(kDocA), "none")));
    EXPECT_TRUE(store_->Contains(SegmentFingerprint(model_->fingerprint(), Enc(kDocB), "none")));
    auto h2 = s->Submit(Item({{Enc(kDocB)}, {Enc(kDocA)}, {Enc(kQ), false}}, 8));
    ASSERT_TRUE(h2.ok());
    Collected c2 = Drain(**h2);
    ASSERT_TRUE(c2.final.status.ok()) << c2.final.status;
    EXPECT_EQ(c2.final.usage.segments_hit, 2);
    answers[tiered] = {c1.ids, c2.ids};
    s->Stop();
  }
  EXPECT_EQ(answers[0], answers[1]);
}

// HoldsLocally (what the worker asks, from its RPC threads, before a cache-cluster fetch) sees
// every local tier: a stored segment is local whether it sits in the device tier or the host
// store; an unknown one is not; after Stop nothing is.
TEST_F(SchedulerTest, HoldsLocallySeesEveryTier) {
  for (size_t tier : {size_t{64} << 20, size_t{0}}) {
    SCOPED_TRACE(tier ? "device tier" : "host store only");
    store_ = std::make_unique<SegmentStore>(SegmentStoreOptions{});
    SchedulerOptions o;
    o.device_tier_bytes = tier;
    o.defer_segment_stores = false;
    auto s = Start(o);
    ASSERT_NE(s, nullptr);
    const Hash128 fa = SegmentFingerprint(model_->fingerprint(), Enc(kDocA), "none");
    EXPECT_FALSE(s->HoldsLocally(fa));
    auto h = s->Submit(Item({{Enc(kDocA)}, {Enc(kQ), false}}, 4));
    ASSERT_TRUE(h.ok());
    Collected c = Drain(**h);
    ASSERT_TRUE(c.final.status.ok()) << c.final.status;
    EXPECT_TRUE(s->HoldsLocally(fa));
    EXPECT_FALSE(s->HoldsLocally(SegmentFingerprint(model_->fingerprint(), Enc(kDocB), "none")));
    s->Stop();
    EXPECT_FALSE(s->HoldsLocally(fa));
  }
}

// A segment a cluster fetch offers (OfferFetched, on the fetch's thread) goes into the device
// tier at the engine thread's next iteration, with no request asking for it (so a fetch's
// segments upload while its later ones still transfer), then to the host store when idle,
// reported like a segment the worker stored itself.
TEST_F(SchedulerTest, OfferedSegmentsAreAdoptedBetweenIterations) {
  std::mutex mu;
  std::vector<std::pair<Hash128, int>> stored;
  hooks_.on_segments_stored = [&](const std::vector<std::pair<Hash128, int>>& st) {
    std::lock_guard<std::mutex> l(mu);
    stored.insert(stored.end(), st.begin(), st.end());
  };
  SchedulerOptions o;
  o.device_tier_bytes = size_t{64} << 20;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->TakesFetched());
  const ModelConfig& c = model_->config();
  const Hash128 fp{77, 7};
  ASSERT_TRUE(s->OfferFetched(fp, UniformSegment(10, 0.25f, -0.5f)));
  EXPECT_TRUE(s->HoldsLocally(fp));
  EXPECT_TRUE(WaitUntil([&] {
    std::lock_guard<std::mutex> l(mu);
    return stored.size() == 1 && stored[0] == std::pair<Hash128, int>{fp, 10};
  }));
  EXPECT_GT(s->load().device_tier_bytes, 0u);
  auto kv = store_->Get(fp);
  ASSERT_NE(kv, nullptr);
  EXPECT_EQ(kv->k[c.n_layers - 1][3], 0.25f);
  EXPECT_EQ(kv->v[0][0], -0.5f);
  s->Stop();
  EXPECT_FALSE(s->OfferFetched(Hash128{77, 8}, UniformSegment(10, 0.25f, -0.5f)));  // no engine
}

// While a request waits for its cluster fetch, segments the fetch already delivered are
// uploaded into the tier but not spilled to the host store (the fetch and the uploads need the
// host); the spill runs once no request waits.
TEST_F(SchedulerTest, NoSpillWhileARequestWaitsForItsFetch) {
  SchedulerOptions o;
  o.device_tier_bytes = size_t{64} << 20;
  o.fetch_threads = 1;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  SegmentKvBf16 kv = UniformSegment(8, 0.125f, 0.125f);
  std::atomic<bool> offered{false}, release{false};
  WorkItem w = Item({{Enc(kDocA)}, {Enc(kQ), false}}, 4);
  BatchScheduler* sp = s.get();
  w.remote_fetch = [&, sp](WorkItem& item) {
    offered = sp->OfferFetched(Hash128{91, 1}, std::move(kv));
    while (!release.load()) std::this_thread::sleep_for(1ms);
    item.segments_fetched = 1;
  };
  ReleaseOnExit guard{release, *s};
  auto h = s->Submit(std::move(w));
  ASSERT_TRUE(h.ok()) << h.status();
  WaitUntil([&] { return offered.load() && s->load().device_tier_bytes > 0; });
  ASSERT_TRUE(offered.load());
  EXPECT_GT(s->load().device_tier_bytes, 0u);  // uploaded while the fetch goes on
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(s->load().unspilled_segments, 1);  // but not spilled
  EXPECT_FALSE(store_->Contains(Hash128{91, 1}));
  release = true;
  Collected r = Drain(**h);
  ASSERT_TRUE(r.final.status.ok()) << r.final.status;
  WaitUntil([&] { return s->load().unspilled_segments == 0; });
  EXPECT_EQ(s->load().unspilled_segments, 0);
  EXPECT_TRUE(store_->Contains(Hash128{91, 1}));
  s->Stop();
}

// store_after_misses = 2 (the GPU default): content seen once is never stored; a segment is
// stored the second time a request misses it and reused from the third.
TEST_F(SchedulerTest, SegmentsAreStoredOnTheirSecondMiss) {
  SchedulerOptions o;
  o.store_after_misses = 2;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  const Hash128 fa = SegmentFingerprint(model_->fingerprint(), Enc(kDocA), "none");
  const Hash128 fb = SegmentFingerprint(model_->fingerprint(), Enc(kDocB), "none");
  auto run = [&](std::vector<PromptSegment> segs) {
    return RunThenStores(*s, Item(std::move(segs), 4));
  };
  RequestUsage u1 = run({{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}});
  EXPECT_EQ(u1.segments_hit, 0);
  EXPECT_FALSE(store_->Contains(fa));  // missed once: not stored
  RequestUsage u2 = run({{Enc(kDocB)}, {Enc(kDocA)}, {Enc(kQ), false}});
  EXPECT_EQ(u2.segments_hit, 0);
  EXPECT_TRUE(store_->Contains(fa));  // missed twice: stored
  EXPECT_TRUE(store_->Contains(fb));
  RequestUsage u3 = run({{Enc(kDocA)}, {Enc(kQ), false}, {Enc(kDocB)}});
  EXPECT_GE(u3.segments_hit, 1);
  EXPECT_GT(u3.reused_tokens, 0);
}

// A request's own reuse.store_after_misses overrides the worker's: a chat client asks for its
// turns to be stored at their first miss, on a worker that waits for the second; a request
// asking for a third miss is not stored at the worker's second.
TEST_F(SchedulerTest, ARequestsStoreAfterMissesOverridesTheWorkers) {
  SchedulerOptions o;
  o.store_after_misses = 2;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  const Hash128 fa = SegmentFingerprint(model_->fingerprint(), Enc(kDocA), "none");
  const Hash128 fb = SegmentFingerprint(model_->fingerprint(), Enc(kDocB), "none");
  auto run = [&](std::vector<PromptSegment> segs, int after_misses) {
    WorkItem w = Item(std::move(segs), 4);
    w.store_after_misses = after_misses;
    return RunThenStores(*s, std::move(w));
  };
  RequestUsage u1 = run({{Enc(kDocA)}, {Enc(kQ), false}}, 1);
  EXPECT_EQ(u1.segments_hit, 0);
  EXPECT_TRUE(store_->Contains(fa));  // stored at its first miss
  RequestUsage u2 = run({{Enc(kQ), false}, {Enc(kDocA)}}, 0);  // not an exact prefix
  EXPECT_EQ(u2.segments_hit, 1);  // and reused by the next request
  run({{Enc(kDocB)}, {Enc(kQ), false}}, 3);
  run({{Enc(kDocB)}, {Enc(kQ), false}}, 3);
  EXPECT_FALSE(store_->Contains(fb));  // two misses: the worker's 2 would have stored it
  run({{Enc(kDocB)}, {Enc(kQ), false}}, 3);
  EXPECT_TRUE(store_->Contains(fb));
}

// store_while_busy = false: deferred stores wait while a sequence decodes,
// run once the engine is idle, and a backlog beyond max_pending_stores is dropped and counted.
TEST_F(SchedulerTest, StoresWaitForIdleWithoutStoreWhileBusy) {
  SchedulerOptions o;
  o.store_while_busy = false;
  o.max_pending_stores = 1;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  // A long plain request keeps a sequence decoding while the reuse request's stores queue.
  WorkItem long_plain = Item({{Enc("Once upon a time")}}, 400, /*reuse=*/false);
  long_plain.sampling.ignore_eos = true;
  auto busy = s->Submit(std::move(long_plain));
  ASSERT_TRUE(busy.ok());
  auto h = s->Submit(Item({{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}}, 2));
  ASSERT_TRUE(h.ok());
  Collected c = Drain(**h);
  ASSERT_TRUE(c.final.status.ok()) << c.final.status;
  // Two stores queued behind a busy engine with room for one: one dropped, none run yet.
  EXPECT_TRUE(store_->Contains(SegmentFingerprint(model_->fingerprint(), Enc(kDocB), "none")) ==
              false);
  Collected b = Drain(**busy);
  ASSERT_TRUE(b.final.status.ok());
  WaitUntil([&] { return s->load().pending_stores == 0; });
  EXPECT_EQ(s->load().pending_stores, 0);
  EXPECT_EQ(s->load().stores_dropped, 1);
  // The newer of the two (kDocB) survived the backlog and was stored once idle.
  EXPECT_TRUE(store_->Contains(SegmentFingerprint(model_->fingerprint(), Enc(kDocB), "none")));
  EXPECT_FALSE(store_->Contains(SegmentFingerprint(model_->fingerprint(), Enc(kDocA), "none")));
}

// The cluster fetch as a scheduler state: a request whose remote fetch is slow waits in
// "waiting for remote KV" without delaying a request that needs none, then runs with what the
// fetch reported; stopping the scheduler fails a waiting request instead of hanging it.
TEST_F(SchedulerTest, SlowRemoteFetchDelaysOnlyItsOwnRequest) {
  SchedulerOptions o;
  o.fetch_threads = 1;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  std::atomic<bool> release{false};
  ReleaseOnExit guard{release, *s};
  WorkItem slow = Item({{Enc(kDocA)}, {Enc(kQ), false}}, 4);
  slow.remote_fetch = [&release](WorkItem& w) {
    while (!release.load()) std::this_thread::sleep_for(1ms);
    w.segments_fetched = 1;
  };
  auto h_slow = s->Submit(std::move(slow));
  ASSERT_TRUE(h_slow.ok()) << h_slow.status();
  WaitUntil([&] { return s->load().waiting_remote > 0; });
  EXPECT_EQ(s->load().waiting_remote, 1);
  auto h_fast = s->Submit(Item({{Enc(kDocB)}}, 4));
  ASSERT_TRUE(h_fast.ok());
  Collected fast = Drain(**h_fast);  // finishes while the other still waits for its fetch
  ASSERT_TRUE(fast.final.status.ok()) << fast.final.status;
  EXPECT_EQ(s->load().waiting_remote, 1);
  release = true;
  Collected c = Drain(**h_slow);
  ASSERT_TRUE(c.final.status.ok()) << c.final.status;
  EXPECT_EQ(c.final.usage.segments_fetched, 1);
  EXPECT_EQ(c.ids, Reference({{Enc(kDocA)}, {Enc(kQ), false}}, 4));

  // Stop with requests still waiting: the fetch in hand finishes (its request may still run),
  // the one not yet fetched fails with UNAVAILABLE; nothing hangs.
  std::atomic<bool> release2{false};
  WorkItem stuck = Item({{Enc(kDocB)}}, 4);
  stuck.remote_fetch = [&release2](WorkItem&) {
    for (int i = 0; i < 2000 && !release2.load(); ++i) std::this_thread::sleep_for(1ms);
  };
  WorkItem waiting = Item({{Enc(kDocA)}}, 4);
  waiting.remote_fetch = [](WorkItem&) {};
  auto h1 = s->Submit(std::move(stuck));
  ASSERT_TRUE(h1.ok());
  WaitUntil([&] { return s->load().waiting_remote > 0; });
  auto h2 = s->Submit(std::move(waiting));  // queued behind the only fetch thread
  ASSERT_TRUE(h2.ok());
  std::thread stopper([&] { s->Stop(); });
  std::this_thread::sleep_for(20ms);
  release2 = true;
  stopper.join();
  Collected r1 = Drain(**h1);
  EXPECT_TRUE(r1.final.final);
  EXPECT_TRUE(r1.final.status.ok() || r1.final.status.code() == absl::StatusCode::kUnavailable)
      << r1.final.status;
  Collected r2 = Drain(**h2);
  EXPECT_EQ(r2.final.status.code(), absl::StatusCode::kUnavailable) << r2.final.status;
  EXPECT_EQ(s->Submit(Item({{Enc(kDocA)}}, 4)).status().code(), absl::StatusCode::kUnavailable);
}

// A streaming fetch (WorkItem::fetch_started) admits its request as soon as it says so: the
// request runs to the end while the fetch is still going on, and reports what the fetch had
// counted by then.
TEST_F(SchedulerTest, AStartedStreamingFetchAdmitsItsRequest) {
  SchedulerOptions o;
  o.fetch_threads = 1;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  std::atomic<bool> release{false};
  ReleaseOnExit guard{release, *s};
  WorkItem w = Item({{Enc(kDocA)}, {Enc(kQ), false}}, 4);
  w.remote_fetch = [&release](WorkItem& item) {
    item.segments_fetched = 1;
    ASSERT_TRUE(item.fetch_started);
    item.fetch_started();
    while (!release.load()) std::this_thread::sleep_for(1ms);
  };
  auto h = s->Submit(std::move(w));
  ASSERT_TRUE(h.ok()) << h.status();
  Collected c = Drain(**h);  // completes while the fetch thread still waits
  ASSERT_TRUE(c.final.status.ok()) << c.final.status;
  EXPECT_EQ(c.final.usage.segments_fetched, 1);
  EXPECT_EQ(c.ids, Reference({{Enc(kDocA)}, {Enc(kQ), false}}, 4));
  release = true;
  s->Stop();
}

// With a TPOT target (tpot_target_ms) a long prompt that arrives while another request decodes
// is prefilled in chunks cut to the target (at least 64 tokens) instead of one prefill_chunk,
// so the decoding request keeps getting tokens meanwhile; its answer is unchanged.
TEST_F(SchedulerTest, ATpotTargetCutsPrefillChunksBesideDecodeSteps) {
  std::vector<int32_t> long_prompt;
  while (long_prompt.size() < 400) {
    for (const std::string& d : {kDocA, kDocB}) {
      for (int32_t t : Enc(d)) long_prompt.push_back(t);
    }
  }
  long_prompt.resize(400);
  const std::vector<int32_t> want = Reference({{long_prompt}}, 1);
  for (double target : {0.0, 0.001}) {
    SCOPED_TRACE(target > 0 ? "target" : "no target");
    std::atomic<int> tokens{0}, first_tokens{0}, at_long_first{-1};
    hooks_.on_token = [&](double) { tokens.fetch_add(1); };
    hooks_.on_first_token = [&](double) {
      if (first_tokens.fetch_add(1) == 1) at_long_first = tokens.load();  // the long prompt's
    };
    SchedulerOptions o;
    o.prefill_chunk = 512;  // the whole prompt in one chunk without a target
    o.tpot_target_ms = target;
    auto s = Start(o);
    ASSERT_NE(s, nullptr);
    WorkItem decoding = Item({{Enc("Once upon a time")}}, 300, /*reuse=*/false);
    decoding.sampling.ignore_eos = true;
    auto hd = s->Submit(std::move(decoding));
    ASSERT_TRUE(hd.ok()) << hd.status();
    std::vector<StreamChunk> got;
    while (tokens.load() < 2) (*hd)->Wait(&got, 50ms);  // decoding, costs measured
    const int before = tokens.load();
    auto hl = s->Submit(Item({{long_prompt}}, 1, /*reuse=*/false));
    ASSERT_TRUE(hl.ok()) << hl.status();
    Collected c = Drain(**hl);
    ASSERT_TRUE(c.final.status.ok()) << c.final.status;
    EXPECT_EQ(c.ids, want);
    const int during = at_long_first.load() - before;  // decode steps during its prefill
    if (target > 0) {
      EXPECT_GE(during, 400 / 64 - 1);
    } else {
      EXPECT_LE(during, 3);
    }
    (*hd)->Cancel();
    s->Stop();
  }
  hooks_ = {};
}

// With register_approximate_prefix a reuse request's blocks past its exact KV, its generated
// tokens included, are registered in the approximate namespace when it ends: the next chat turn
// (its prompt, the reply, a new message) starts from them; a plain request does not.
TEST_F(SchedulerTest, NextTurnContinuesOnTheApproximatePrefixWithTheReply) {
  SchedulerOptions o;
  o.reuse.register_approximate_prefix = true;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  // Store the documents first, so the turn reuses them (approximate KV).
  auto warm = s->Submit(Item({{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}}, 2));
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE(Drain(**warm).final.status.ok());
  WaitUntil([&] { return s->load().pending_stores == 0; });
  std::vector<PromptSegment> turn1 = {{Enc(kDocB)}, {Enc(kDocA)}, {Enc(kQ), false}};
  WorkItem w1 = Item(turn1, 24);
  w1.reuse.register_approximate_prefix = true;
  w1.sampling.ignore_eos = true;
  auto h1 = s->Submit(std::move(w1));
  ASSERT_TRUE(h1.ok());
  Collected c1 = Drain(**h1);
  ASSERT_TRUE(c1.final.status.ok()) << c1.final.status;
  ASSERT_GT(c1.final.usage.reused_tokens, 0);
  ASSERT_EQ(c1.ids.size(), 24u);
  std::vector<PromptSegment> turn2 = turn1;
  turn2.push_back({c1.ids, false});
  turn2.push_back({Enc(" The end."), false});
  WorkItem w2 = Item(turn2, 2);
  w2.reuse.register_approximate_prefix = true;
  auto h2 = s->Submit(std::move(w2));
  ASSERT_TRUE(h2.ok());
  Collected c2 = Drain(**h2);
  ASSERT_TRUE(c2.final.status.ok()) << c2.final.status;
  // BOS + turn 1's prompt + all but the last reply token were computed in turn 1 (the last one
  // was sampled, never fed back): every full block of those is a prefix hit now.
  const int computed1 = c1.final.usage.prompt_tokens + 23;
  EXPECT_EQ(c2.final.usage.prefix_tokens, computed1 / 16 * 16);
  EXPECT_EQ(c2.final.usage.reused_tokens, 0);
  // Reuse off: only the exact blocks (none past the first reused token) match.
  auto h3 = s->Submit(Item(turn2, 2, /*reuse=*/false));
  ASSERT_TRUE(h3.ok());
  Collected c3 = Drain(**h3);
  ASSERT_TRUE(c3.final.status.ok());
  EXPECT_LT(c3.final.usage.prefix_tokens, 32);
  EXPECT_EQ(c3.ids, Reference(turn2, 2));
}

// fetch_wait_ms bounds the wait: a request whose fetch is slower is admitted at its deadline
// without it (counted), and the fetch still runs to its end for the requests after it.
TEST_F(SchedulerTest, SlowRemoteFetchIsNotWaitedForBeyondTheDeadline) {
  SchedulerOptions o;
  o.fetch_threads = 1;
  o.fetch_wait_ms = 50;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  std::atomic<bool> release{false}, finished{false};
  WorkItem slow = Item({{Enc(kDocA)}, {Enc(kQ), false}}, 4);
  slow.remote_fetch = [&](WorkItem& w) {
    for (int i = 0; i < 5000 && !release.load(); ++i) std::this_thread::sleep_for(1ms);
    w.segments_fetched = 1;
    finished = true;
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto h = s->Submit(std::move(slow));
  ASSERT_TRUE(h.ok()) << h.status();
  Collected c = Drain(**h);  // the fetch is still running
  ASSERT_TRUE(c.final.status.ok()) << c.final.status;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_FALSE(finished.load());
  EXPECT_EQ(c.final.usage.segments_fetched, 0);
  EXPECT_GE(c.final.usage.queue_ms, 45);
  EXPECT_EQ(s->load().fetch_timeouts, 1);
  EXPECT_EQ(c.ids, Reference({{Enc(kDocA)}, {Enc(kQ), false}}, 4));
  release = true;
  WaitUntil([&] { return finished.load(); });
  EXPECT_TRUE(finished.load());
  // A fast fetch is waited for and reported.
  WorkItem quick = Item({{Enc(kDocB)}}, 2);
  quick.remote_fetch = [](WorkItem& w) { w.segments_fetched = 1; };
  auto hq = s->Submit(std::move(quick));
  ASSERT_TRUE(hq.ok());
  Collected q = Drain(**hq);
  ASSERT_TRUE(q.final.status.ok());
  EXPECT_EQ(q.final.usage.segments_fetched, 1);
  EXPECT_EQ(s->load().fetch_timeouts, 1);
}

// The pinned host tier (CPU: plain host memory) in front of the store: the second request is
// served from it, with the same tokens as a scheduler without tiers.
TEST_F(SchedulerTest, HostTierServesRepeatedSegmentsAlike) {
  auto run = [&](size_t host_tier) {
    store_ = std::make_unique<SegmentStore>(SegmentStoreOptions{});
    SchedulerOptions o;
    o.host_tier_bytes = host_tier;
    o.defer_segment_stores = false;
    auto s = Start(o);
    std::vector<Collected> out;
    if (s == nullptr) return out;
    for (auto segs : {std::vector<PromptSegment>{{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}},
                      std::vector<PromptSegment>{{Enc(kDocB)}, {Enc(kDocA)}, {Enc(kQ), false}}}) {
      auto h = s->Submit(Item(segs, 12));
      EXPECT_TRUE(h.ok());
      if (!h.ok()) break;
      out.push_back(Drain(**h));
    }
    return out;
  };
  auto plain = run(0);
  auto tiered = run(size_t{16} << 20);
  ASSERT_EQ(plain.size(), 2u);
  ASSERT_EQ(tiered.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(tiered[i].final.status.ok()) << tiered[i].final.status;
    EXPECT_EQ(tiered[i].ids, plain[i].ids) << "request " << i;
  }
  EXPECT_EQ(tiered[1].final.usage.segments_hit, 2);
}

// A reuse prefill runs in slices of whole layers (reuse_slice_tokens x n_layers rows per
// iteration) between other sequences' decode steps: the same answer as the whole pass, spread
// over one iteration per layer at the smallest slice, and a request cancelled between slices
// gives its blocks back.
TEST_F(SchedulerTest, ReusePrefillRunsInLayerSlicesWithTheSameAnswer) {
  const std::vector<PromptSegment> first = {{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}};
  const std::vector<PromptSegment> second = {{Enc(kDocB)}, {Enc(kDocA)}, {Enc(kQ), false}};
  std::vector<int32_t> answer[2];
  int64_t iterations[2] = {0, 0};
  for (int sliced = 0; sliced < 2; ++sliced) {
    store_ = std::make_unique<SegmentStore>(SegmentStoreOptions{});
    SchedulerOptions o;
    o.reuse_slice_tokens = sliced ? 1 : -1;
    o.engine.kv.enable_prefix_caching = false;
    auto s = Start(o);
    ASSERT_NE(s, nullptr);
    auto h1 = s->Submit(Item(first, 4));
    ASSERT_TRUE(h1.ok());
    ASSERT_TRUE(Drain(**h1).final.status.ok());
    WaitUntil([&] { return s->load().pending_stores == 0; });
    // Alone first (an idle engine counts only this request's iterations), then again beside a
    // long decode (the slices interleave with its steps): the same answer every time.
    const int64_t it0 = s->load().iterations;
    auto h2 = s->Submit(Item(second, 1));
    ASSERT_TRUE(h2.ok());
    Collected c2 = Drain(**h2);
    ASSERT_TRUE(c2.final.status.ok()) << c2.final.status;
    EXPECT_GT(c2.final.usage.reused_tokens, 0);
    iterations[sliced] = s->load().iterations - it0;
    answer[sliced] = c2.ids;
    WorkItem bg = Item({{Enc("Once upon a time")}}, 60, /*reuse=*/false);
    bg.sampling.ignore_eos = true;
    auto hb = s->Submit(std::move(bg));
    ASSERT_TRUE(hb.ok());
    std::vector<StreamChunk> got;
    for (int i = 0; i < 200 && got.empty(); ++i) (*hb)->Wait(&got, 10ms);
    auto h2b = s->Submit(Item(second, 1));
    ASSERT_TRUE(h2b.ok());
    Collected c2b = Drain(**h2b);
    ASSERT_TRUE(c2b.final.status.ok()) << c2b.final.status;
    EXPECT_EQ(c2b.ids, c2.ids);
    // Wait hands over every chunk queued: on a loaded machine the whole decode, final chunk
    // included, can be done by the first wait (CI once waited 60 s here for a final chunk
    // already taken).
    const auto final_chunk = std::find_if(got.begin(), got.end(),
                                          [](const StreamChunk& c) { return c.final; });
    if (final_chunk != got.end()) {
      ASSERT_TRUE(final_chunk->status.ok()) << final_chunk->status;
    } else {
      ASSERT_TRUE(Drain(**hb).final.status.ok());
    }
    if (sliced) {
      // Cancelled at once, likely between slices: every block comes back.
      const int total = s->load().kv_blocks_total;
      auto h3 = s->Submit(Item(second, 8));
      ASSERT_TRUE(h3.ok());
      (*h3)->Cancel();
      Drain(**h3);
      WaitUntil([&] { return s->load().kv_blocks_free == total; });
      EXPECT_EQ(s->load().kv_blocks_free, total);
    }
  }
  EXPECT_EQ(answer[1], answer[0]);
  // One layer per iteration when sliced, one iteration for the whole pass (the counter is read
  // after the final chunk arrived: the last iteration may not be counted yet).
  EXPECT_GE(iterations[1], model_->config().n_layers - 1);
  EXPECT_LE(iterations[0], 2);
}

TEST_F(SchedulerTest, CancellationFreesKvBlocks) {
  SchedulerOptions o;
  o.engine.kv.enable_prefix_caching = false;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  const int total = s->load().kv_blocks_total;
  ASSERT_EQ(s->load().kv_blocks_free, total);
  WorkItem w = Item({{Enc(kDocA + kDocB)}}, 1000);
  w.sampling.ignore_eos = true;
  auto h = s->Submit(std::move(w));
  ASSERT_TRUE(h.ok());
  // Wait for a few tokens: the sequence holds blocks.
  std::vector<StreamChunk> got;
  int tokens = 0;
  for (int i = 0; i < 200 && tokens < 5; ++i) {
    (*h)->Wait(&got, 50ms);
    tokens = static_cast<int>(got.size());
  }
  ASSERT_GE(tokens, 5);
  // Wait hands over every queued chunk: a test thread descheduled for the whole decode (a
  // loaded machine) finds it finished, with nothing left to cancel.
  if (std::any_of(got.begin(), got.end(), [](const StreamChunk& c) { return c.final; })) {
    GTEST_SKIP() << "the decode finished before the cancel";
  }
  EXPECT_LT(s->load().kv_blocks_free, total);
  (*h)->Cancel();
  Collected c = Drain(**h);
  EXPECT_EQ(c.final.finish_reason, "cancelled");
  WaitUntil([&] { return s->load().kv_blocks_free == total; });
  EXPECT_EQ(s->load().kv_blocks_free, total);
  EXPECT_EQ(s->load().running, 0);
}

TEST_F(SchedulerTest, ValidationAndLoadShedding) {
  SchedulerOptions o;
  o.max_queue = 0;  // nothing may wait
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  auto bad_token = s->Submit(Item({{{1, 2, 99999}}}, 4));
  EXPECT_EQ(bad_token.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_token.status().message().find("vocabulary"), std::string::npos);
  std::vector<int32_t> huge(model_->config().max_seq_len + 1, 100);
  auto too_long = s->Submit(Item({{huge}}, 4));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("context length"), std::string::npos);
  WorkItem bad_sampling = Item({{Enc(kDocA)}}, 4);
  bad_sampling.sampling.top_p = 0;
  EXPECT_EQ(s->Submit(bad_sampling).status().code(), absl::StatusCode::kInvalidArgument);
  WorkItem empty_item = Item({}, 4);
  empty_item.add_bos = false;
  auto empty = s->Submit(empty_item);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  auto full = s->Submit(Item({{Enc(kDocA)}}, 4));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
}

// Log-probabilities ride along with their tokens: one entry per generated token, of the raw
// model distribution (the logit bias that forces another token does not change them).
TEST_F(SchedulerTest, LogprobsOfEachTokenOfTheRawDistribution) {
  auto s = Start();
  ASSERT_NE(s, nullptr);
  const std::vector<PromptSegment> prompt = {{Enc("Once upon a time")}};
  WorkItem w = Item(prompt, 12, /*reuse=*/false);
  w.logprobs = 3;
  auto h = s->Submit(w);
  ASSERT_TRUE(h.ok()) << h.status();
  Collected c = Drain(**h);
  ASSERT_TRUE(c.final.status.ok()) << c.final.status;
  EXPECT_EQ(c.ids, Reference(prompt, 12));  // logprobs change nothing about the tokens
  ASSERT_EQ(c.logprobs.size(), c.ids.size());
  for (size_t i = 0; i < c.ids.size(); ++i) {
    const TokenLogprobs& lp = c.logprobs[i];
    EXPECT_EQ(lp.token, c.ids[i]);
    ASSERT_EQ(lp.top.size(), 3u);
    // Greedy: the token is the most likely one.
    EXPECT_EQ(lp.top[0].first, c.ids[i]);
    EXPECT_FLOAT_EQ(lp.top[0].second, lp.logprob);
    EXPECT_LE(lp.logprob, 0.0f);
    EXPECT_GE(lp.top[0].second, lp.top[1].second);
    EXPECT_GE(lp.top[1].second, lp.top[2].second);
  }

  // A +100 bias on another token forces it; its reported log-probability is the model's own
  // (low), and the model's favourite stays first among the alternatives.
  const int32_t forced = c.logprobs[0].top[2].first;
  WorkItem b = Item(prompt, 1, /*reuse=*/false);
  b.logprobs = 2;
  b.sampling.logit_bias = {{forced, 100.0f}};
  b.sampling.ignore_eos = true;
  auto hb = s->Submit(b);
  ASSERT_TRUE(hb.ok()) << hb.status();
  Collected cb = Drain(**hb);
  ASSERT_TRUE(cb.final.status.ok()) << cb.final.status;
  ASSERT_EQ(cb.ids, std::vector<int32_t>{forced});
  ASSERT_EQ(cb.logprobs.size(), 1u);
  // (The prompt's blocks now come from the prefix cache: equal up to rounding.)
  EXPECT_NEAR(cb.logprobs[0].logprob, c.logprobs[0].top[2].second, 1e-4);
  EXPECT_EQ(cb.logprobs[0].top[0].first, c.logprobs[0].top[0].first);
  EXPECT_LT(cb.logprobs[0].logprob, cb.logprobs[0].top[0].second);

  // Not asked for: none.
  auto hn = s->Submit(Item(prompt, 4, /*reuse=*/false));
  ASSERT_TRUE(hn.ok());
  Collected cn = Drain(**hn);
  EXPECT_TRUE(cn.logprobs.empty());
  EXPECT_FALSE(cn.ids.empty());
}

// Greedy requests decode with their rows drawn on the backend (Engine::StepBatchDraw) beside
// requests that need their logits (logprobs, a logit bias), whose rows of the same steps come
// to the host: each request gets a lone engine's tokens either way.
TEST_F(SchedulerTest, GreedyStepsAndStepsThatNeedLogitsGiveTheSameTokens) {
  auto s = Start();
  ASSERT_NE(s, nullptr);
  const std::vector<std::string> prompts = {"Once upon a time", "The cat sat on the mat and",
                                            kDocA};
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    WorkItem w = Item({{Enc(prompts[i])}}, 24, /*reuse=*/false);
    if (i == 1) w.logprobs = 2;
    if (i == 2) w.sampling.logit_bias = {{0, -1.0f}};  // a bias on one token: no BackendDraw
    auto h = s->Submit(w);
    ASSERT_TRUE(h.ok()) << h.status();
    hs.push_back(*h);
  }
  auto plain = s->Submit(Item({{Enc("Tom had a dog named Max. One day")}}, 30, false));
  ASSERT_TRUE(plain.ok());
  for (size_t i = 0; i < prompts.size(); ++i) {
    Collected c = Drain(*hs[i]);
    ASSERT_TRUE(c.final.status.ok()) << c.final.status;
    EXPECT_EQ(c.ids, Reference({{Enc(prompts[i])}}, 24)) << prompts[i];
    EXPECT_EQ(c.logprobs.size(), i == 1 ? c.ids.size() : 0u);
  }
  Collected c = Drain(**plain);
  ASSERT_TRUE(c.final.status.ok()) << c.final.status;
  EXPECT_EQ(c.ids, Reference({{Enc("Tom had a dog named Max. One day")}}, 30));
}

// A seeded request at a temperature (plain: no top-k or top-p) draws its first token on the
// host (the prefill's logits) and the rest on the backend (Sampler::BackendDraw, Gumbel-max
// from its seed and draw count): the same tokens alone and beside a request with logprobs
// (whose rows of the shared steps come to the host), other tokens with another seed.
TEST_F(SchedulerTest, SeededTemperatureDrawsAlikeOnTheBackendAndTheHost) {
  auto s = Start();
  ASSERT_NE(s, nullptr);
  auto hot = [&](uint64_t seed) {
    WorkItem w = Item({{Enc("Once upon a time")}}, 40, /*reuse=*/false);
    w.sampling.temperature = 1.0f;
    w.sampling.seed = seed;
    w.sampling.ignore_eos = true;
    return w;
  };
  auto alone = s->Submit(hot(7));
  ASSERT_TRUE(alone.ok());
  Collected a = Drain(**alone);
  ASSERT_TRUE(a.final.status.ok()) << a.final.status;
  ASSERT_EQ(a.ids.size(), 40u);
  // The same request beside one with logprobs that decodes as long (a shared step downloads
  // every row and samples on the host).
  WorkItem lp = Item({{Enc("The cat sat on the mat and")}}, 60, /*reuse=*/false);
  lp.logprobs = 1;
  lp.sampling.ignore_eos = true;
  auto with_lp = s->Submit(std::move(lp));
  ASSERT_TRUE(with_lp.ok());
  auto beside = s->Submit(hot(7));
  ASSERT_TRUE(beside.ok());
  Collected b = Drain(**beside);
  ASSERT_TRUE(b.final.status.ok()) << b.final.status;
  EXPECT_EQ(b.ids, a.ids);
  ASSERT_TRUE(Drain(**with_lp).final.status.ok());
  auto other = s->Submit(hot(8));
  ASSERT_TRUE(other.ok());
  Collected c = Drain(**other);
  ASSERT_TRUE(c.final.status.ok());
  EXPECT_NE(c.ids, a.ids);
}

TEST_F(SchedulerTest, ManyConcurrentReuseRequestsAllFinish) {
  SchedulerOptions o;
  o.max_running = 4;
  auto s = Start(o);
  ASSERT_NE(s, nullptr);
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (int i = 0; i < 12; ++i) {
    std::vector<PromptSegment> segs = {{Enc(i % 2 ? kDocA : kDocB)}, {Enc(i % 3 ? kDocB : kDocA)},
                                       {Enc(kQ + std::to_string(i)), false}};
    auto h = s->Submit(Item(segs, 6));
    ASSERT_TRUE(h.ok()) << h.status();
    hs.push_back(*h);
  }
  for (auto& h : hs) {
    Collected c = Drain(*h);
    EXPECT_TRUE(c.final.status.ok()) << c.final.status;
    EXPECT_GE(c.final.usage.completion_tokens, 1);
  }
  // The load snapshot is published at the end of the iteration that finished the last one.
  WaitUntil([&] { return s->load().running == 0; });
  EXPECT_EQ(s->load().running, 0);
  EXPECT_EQ(s->load().kv_blocks_free, s->load().kv_blocks_total);
}

}  // namespace
}  // namespace sparsex::service
