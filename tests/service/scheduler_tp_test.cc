// Tensor parallelism in the worker without GPUs: a BatchScheduler whose engine group runs N
// CPU-backend ranks in lockstep (in-process all-reduce) streams the same greedy tokens and
// reports the same reuse figures as the single-engine scheduler, for plain prompts and for
// segment-reuse requests; bad --tp values are refused with a clear INVALID_ARGUMENT.
#include <mutex>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "common/fingerprint.h"
#include "gpu_worker/service/kv_tier.h"
#include "gpu_worker/scheduler/scheduler.h"
#include "gpu_worker/service/worker_server.h"
#include "proto/worker.grpc.pb.h"
#include "testing/server_process.h"
#include "tests/gpu_worker/test_util.h"
#include "tests/service/test_util.h"

namespace sparsex::service {
namespace {

using namespace std::chrono_literals;

using testutil::Collected;

Collected Drain(RequestHandle& h) { return testutil::Drain(h, 120s); }

class SchedulerTpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::LoadStories260K();
    ASSERT_NE(model_, nullptr);
  }
  std::vector<int32_t> Enc(const std::string& s) { return model_->tokenizer().Encode(s, false); }
  WorkItem Item(std::vector<PromptSegment> segs, int max_tokens, bool reuse) {
    WorkItem w;
    w.segments = std::move(segs);
    w.sampling.max_tokens = max_tokens;
    w.sampling.ignore_eos = true;  // long, comparable streams
    w.reuse.enable_reuse = reuse;
    return w;
  }

  // Everything one scheduler of degree tp streams for the workload below.
  struct Run {
    std::vector<Collected> plain, reuse;
    std::vector<SegmentStoreStats> stores;
    int kv_dim_rank1 = 0;
  };
  Run RunWorkload(int tp) {
    Run out;
    std::vector<std::unique_ptr<SegmentStore>> owned;
    std::vector<SegmentStore*> stores;
    for (int r = 0; r < tp; ++r) {
      owned.push_back(std::make_unique<SegmentStore>(SegmentStoreOptions{}));
      stores.push_back(owned.back().get());
    }
    SchedulerOptions o;
    o.engine.kv.num_blocks = 512;
    o.engine.tp.size = tp;
    o.prefill_chunk = 7;  // plain prefills in many chunks, interleaved with decode steps
    auto s = BatchScheduler::Start(*model_, stores, o);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return out;
    // Plain prompts, concurrent (chunked prefill + batched decode iterations).
    const std::vector<std::string> prompts = {"Once upon a time", kDocA, kDocB + kQ};
    std::vector<std::shared_ptr<RequestHandle>> hs;
    for (const auto& p : prompts) {
      auto h = (*s)->Submit(Item({{Enc(p)}}, 64, /*reuse=*/false));
      EXPECT_TRUE(h.ok()) << h.status();
      if (h.ok()) hs.push_back(*h);
    }
    for (auto& h : hs) out.plain.push_back(Drain(*h));
    // Segment reuse: the first request stores both documents (deferred stores), the second
    // sends them in the other order and reuses them with sparse recompute.
    auto h1 = (*s)->Submit(Item({{Enc(kDocA)}, {Enc(kDocB)}, {Enc(kQ), false}}, 32, true));
    EXPECT_TRUE(h1.ok());
    if (h1.ok()) out.reuse.push_back(Drain(**h1));
    testutil::WaitUntil([&] { return (*s)->load().pending_stores == 0; });
    auto h2 = (*s)->Submit(Item({{Enc(kDocB)}, {Enc(kDocA)}, {Enc(kQ), false}}, 32, true));
    EXPECT_TRUE(h2.ok());
    if (h2.ok()) out.reuse.push_back(Drain(**h2));
    (*s)->Stop();
    for (SegmentStore* st : stores) out.stores.push_back(st->stats());
    if (tp > 1) {
      auto fp = SegmentFingerprint(model_->fingerprint(), Enc(kDocA), "none");
      auto kv = stores[1]->Get(fp);
      EXPECT_NE(kv, nullptr) << "rank 1 keeps its share of every stored segment";
      if (kv) out.kv_dim_rank1 = kv->kv_dim;
    }
    return out;
  }

  std::unique_ptr<Model> model_;
  const std::string kDocA = "Lily went to the park with her mom. They saw a big red ball and played "
                            "with it all day long until the sun went down.";
  const std::string kDocB = "Tom had a little dog named Max. Max liked to run and jump in the "
                            "garden, and he barked at the birds in the tall tree.";
  const std::string kQ = " What did they do next? They";
};

TEST_F(SchedulerTpTest, Tp2And4StreamTheSameTokensAsTp1) {
  const Run ref = RunWorkload(1);
  ASSERT_EQ(ref.plain.size(), 3u);
  ASSERT_EQ(ref.reuse.size(), 2u);
  for (const Collected& c : ref.plain) {
    ASSERT_TRUE(c.final.status.ok()) << c.final.status;
    EXPECT_EQ(c.ids.size(), 64u);
  }
  // The reuse path really ran: kDocA from the store (kDocB's start is an exact prefix of the
  // plain "kDocB + kQ" request, so its short rest is computed, not reused: planner.h).
  ASSERT_GE(ref.reuse[1].final.usage.segments_hit, 1);
  ASSERT_GT(ref.reuse[1].final.usage.recomputed_tokens, 0);
  const ModelConfig& c = model_->config();
  for (int tp : {2, 4}) {
    const Run got = RunWorkload(tp);
    ASSERT_EQ(got.plain.size(), ref.plain.size()) << "tp " << tp;
    ASSERT_EQ(got.reuse.size(), ref.reuse.size()) << "tp " << tp;
    for (size_t i = 0; i < ref.plain.size(); ++i) {
      EXPECT_TRUE(got.plain[i].final.status.ok()) << got.plain[i].final.status;
      EXPECT_EQ(got.plain[i].ids, ref.plain[i].ids) << "tp " << tp << " plain prompt " << i;
    }
    for (size_t i = 0; i < ref.reuse.size(); ++i) {
      const RequestUsage &a = ref.reuse[i].final.usage, &b = got.reuse[i].final.usage;
      EXPECT_TRUE(got.reuse[i].final.status.ok()) << got.reuse[i].final.status;
      EXPECT_EQ(got.reuse[i].ids, ref.reuse[i].ids) << "tp " << tp << " reuse request " << i;
      EXPECT_EQ(b.reused_tokens, a.reused_tokens);
      EXPECT_EQ(b.recomputed_tokens, a.recomputed_tokens) << "selection is rank-identical";
      EXPECT_EQ(b.segments_hit, a.segments_hit);
    }
    // Every rank stored the same segments, each with its KV heads only.
    ASSERT_EQ(static_cast<int>(got.stores.size()), tp);
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(got.stores[r].entries, ref.stores[0].entries) << "rank " << r;
      EXPECT_EQ(got.stores[r].bytes, got.stores[0].bytes) << "rank " << r;
    }
    EXPECT_EQ(got.kv_dim_rank1, c.n_kv_heads / tp * c.head_dim);
  }
}

TEST_F(SchedulerTpTest, BadTensorParallelDegreesAreRefused) {
  SegmentStore a({}), b({}), c({});
  auto start = [&](int tp, std::vector<SegmentStore*> stores) {
    SchedulerOptions o;
    o.engine.kv.num_blocks = 64;
    o.engine.tp.size = tp;
    return BatchScheduler::Start(*model_, std::move(stores), o).status();
  };
  // stories260K: 8 heads, 4 KV heads, FFN 172 (tp 3 and 8 do not divide them).
  for (int tp : {0, -1, 3, 8}) {
    std::vector<SegmentStore*> stores;
    for (int r = 0; r < std::max(tp, 1); ++r) stores.push_back(&a);
    absl::Status st = start(tp, stores);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << tp;
    EXPECT_NE(st.message().find("--tp"), std::string::npos) << st;
  }
  // One store per rank.
  EXPECT_EQ(start(2, {&a}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(start(2, {&a, &b, &c}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(start(2, {&a, &b}).ok());
}

TEST_F(SchedulerTpTest, WorkerRefusesBadTpAndServesTp2) {
  WorkerOptions o;
  o.insecure_loopback = true;  // a loopback test cluster
  o.model_path = testing::Stories260KPath();
  o.metrics_port = -1;
  o.scheduler.engine.kv.num_blocks = 64;
  for (int tp : {0, 3}) {
    o.scheduler.engine.tp.size = tp;
    auto w = WorkerServer::Start(o);
    ASSERT_FALSE(w.ok()) << tp;
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(w.status().message().find("--tp"), std::string::npos) << w.status();
  }
  o.scheduler.engine.tp.size = 2;
  auto w = WorkerServer::Start(o);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_GT((*w)->port(), 0);
  (*w)->Shutdown();
}

// Two tensor-parallel workers share segments through a real cache server: the first computes
// the documents and writes back each rank's share; the second fetches both ranks' shares,
// reuses them, and answers with the same tokens as the first.
// One Generate on a worker's gRPC port: the documents cacheable, the last segment (the
// question) not; greedy, 12 tokens.
struct Reply {
  std::vector<int32_t> ids;
  v1::Usage usage;
};
Reply GenerateOn(int port, const std::vector<std::vector<int32_t>>& docs) {
  auto ch = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                grpc::InsecureChannelCredentials());
  auto stub = worker::v1::Worker::NewStub(ch);
  worker::v1::WorkerGenerateRequest req;
  req.set_request_id("tp-cluster");
  req.set_add_bos(true);
  req.set_return_token_ids(true);
  for (size_t i = 0; i < docs.size(); ++i) {
    auto* seg = req.add_segments();
    seg->mutable_tokens()->Add(docs[i].begin(), docs[i].end());
    seg->set_cacheable(i + 1 < docs.size());  // the question is not cached
  }
  req.mutable_sampling()->set_max_tokens(12);
  req.mutable_sampling()->set_temperature(0.0f);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  auto reader = stub->Generate(&ctx, req);
  Reply r;
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    r.ids.insert(r.ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    if (msg.has_usage()) r.usage = msg.usage();
  }
  grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  return r;
}

// Whether the cluster holds every ref (each rank's share under tp), polled for up to 4 s: the
// write-back runs in the background.
// `kv_identity`: the worker's (WorkerServer::kv_identity()), which its cluster keys derive from.
bool ClusterHolds(const WorkerOptions& o, const Model& model, const Hash128& kv_identity,
                  const std::vector<SegmentRef>& refs, int tp) {
  ClusterTierOptions t;
  t.servers = o.cluster.servers;
  const ModelConfig& c = model.config();
  auto probe = ClusterKvTier::Connect(t, kv_identity, c.n_layers,
                                      c.n_kv_heads * c.head_dim);
  EXPECT_TRUE(probe.ok()) << probe.status();
  if (!probe.ok()) return false;
  for (int i = 0; i < 200; ++i) {
    bool all = true;
    for (int r = 0; r < tp; ++r) {
      SegmentStore probe_store(SegmentStoreOptions{});
      all = all && (*probe)->FetchMissing(refs, &probe_store, r, tp).fetched ==
                       static_cast<int>(refs.size());
    }
    if (all) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

TEST_F(SchedulerTpTest, Tp2WorkersShareSegmentsThroughTheCacheCluster) {
  auto server = testutil::StartMemoryCacheServer();
  ASSERT_TRUE(server.ok()) << server.status();
  WorkerOptions o;
  o.insecure_loopback = true;  // a loopback test cluster
  o.model_path = testing::Stories260KPath();
  o.metrics_port = -1;
  o.scheduler.engine.kv.num_blocks = 256;
  o.scheduler.engine.tp.size = 2;
  o.cluster.servers = {(*server)->grpc_address()};
  auto a = WorkerServer::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  const Tokenizer& tok = model->tokenizer();
  const std::vector<int32_t> d1 = tok.Encode("Lily went to the park with her mom.", false);
  const std::vector<int32_t> d2 = tok.Encode("Tom had a little dog named Max.", false);
  const std::vector<int32_t> q = tok.Encode(" What did they do next?", false);

  Reply first = GenerateOn((*a)->port(), {d1, d2, q});
  ASSERT_FALSE(first.ids.empty());
  // Both ranks' shares of both documents reach the cache server (background write-back).
  std::vector<SegmentRef> refs;
  for (const auto* d : {&d1, &d2}) {
    refs.push_back({SegmentFingerprint((*a)->kv_identity(), *d, "none"),
                    static_cast<int>(d->size())});
  }
  ASSERT_TRUE(ClusterHolds(o, *model, (*a)->kv_identity(), refs, 2)) << "the worker did not write both ranks' shares back";

  auto b = WorkerServer::Start(o);
  ASSERT_TRUE(b.ok()) << b.status();
  Reply from_a = GenerateOn((*a)->port(), {d2, d1, q});  // reordered: local hits on A
  Reply from_b = GenerateOn((*b)->port(), {d2, d1, q});  // fetched from the cluster on B
  EXPECT_EQ(from_b.usage.segments_fetched(), 2);
  EXPECT_EQ(from_b.usage.fetch_failures(), 0);
  EXPECT_EQ(from_b.usage.segments_hit(), 2);
  EXPECT_EQ(from_a.usage.segments_hit(), 2);
  EXPECT_EQ(from_b.ids, from_a.ids) << "A: " << from_a.usage.ShortDebugString()
                                    << "\nB: " << from_b.usage.ShortDebugString();
  (*b)->Shutdown();
  (*a)->Shutdown();
}

// Without tensor parallelism, a worker with a device tier and a bf16 wire (the CUDA worker's;
// here the CPU backend) takes fetched segments into its tier (ClusterTierOptions::
// fetch_to_tier, the default; whole, or streamed into its prefill with stream_fetch), serves
// them, spills them to its host store when idle, and writes none of them back: the cluster has
// them (write-back result "fetched").
TEST_F(SchedulerTpTest, FetchedSegmentsGoToTheTierAndAreNotWrittenBack) {
  auto server = testutil::StartMemoryCacheServer();
  ASSERT_TRUE(server.ok()) << server.status();
  WorkerOptions o;
  o.insecure_loopback = true;  // a loopback test cluster
  o.model_path = testing::Stories260KPath();
  o.scheduler.engine.kv.num_blocks = 256;
  o.scheduler.device_tier_bytes = size_t{64} << 20;
  o.cluster.servers = {(*server)->grpc_address()};
  o.cluster.wire_dtype = "bf16";
  ASSERT_TRUE(o.cluster.fetch_to_tier);
  auto a = WorkerServer::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::vector<int32_t> d1 = Enc(kDocA), d2 = Enc(kDocB), q = Enc(kQ);
  ASSERT_FALSE(GenerateOn((*a)->port(), {d1, d2, q}).ids.empty());
  std::vector<SegmentRef> refs;
  for (const auto* d : {&d1, &d2}) {
    refs.push_back({SegmentFingerprint((*a)->kv_identity(), *d, "none"),
                    static_cast<int>(d->size())});
  }
  ASSERT_TRUE(ClusterHolds(o, *model_, (*a)->kv_identity(), refs, 1)) << "A did not write the documents back";

  // Fetched whole, then the prefill; and streamed (--cache_fetch_stream): the prefill reads
  // each layer as it arrives, from pageable memory or from the engine's block
  // (--cache_fetch_pinned_mb; pinned on a GPU). The same answer every way.
  std::vector<std::vector<int32_t>> answers;
  for (int mode : {0, 1, 2}) {
    const bool stream = mode > 0, block = mode == 2;
    SCOPED_TRACE(!stream ? "fetch, then prefill"
                         : block ? "streaming fetch into the block" : "streaming fetch");
    WorkerOptions ob = o;
    ob.cluster.stream_fetch = stream;
    if (block) ob.scheduler.reuse.stream_pinned_bytes = size_t{16} << 20;
    auto b = WorkerServer::Start(ob);
    ASSERT_TRUE(b.ok()) << b.status();
    Reply from_b = GenerateOn((*b)->port(), {d2, d1, q});
    EXPECT_EQ(from_b.usage.segments_fetched(), 2);
    EXPECT_EQ(from_b.usage.fetch_failures(), 0);
    EXPECT_EQ(from_b.usage.segments_hit(), 2) << from_b.usage.ShortDebugString();
    EXPECT_GT(from_b.usage.reused_tokens(), 0);
    EXPECT_EQ(from_b.ids.size(), 12u);
    answers.push_back(from_b.ids);
    // B spills both to its host store when idle; neither is written back.
    auto metric = [&](const std::string& sample) {
      auto body = cache::testing::HttpGet((*b)->metrics_port(), "/metrics");
      if (!body.ok()) return -1.0;
      // A sample's line, not its # HELP line.
      const size_t at = body->find("\n" + sample + " ");
      return at == std::string::npos ? -1.0 : std::stod(body->substr(at + sample.size() + 2));
    };
    double fetched = 0;
    testutil::WaitUntil([&] {
      fetched = metric("sparsex_worker_writeback_total{result=\"fetched\"}");
      return fetched >= 2;
    });
    EXPECT_EQ(fetched, 2);
    EXPECT_EQ(metric("sparsex_worker_writeback_total{result=\"ok\"}"), 0);
    // Streamed segments (read while their transfer went on; one that arrived before the
    // prefill planned is served whole) are reported in the usage and the metrics.
    if (!stream) EXPECT_EQ(from_b.usage.segments_streamed(), 0);
    EXPECT_LE(from_b.usage.segments_streamed(), 2);
    EXPECT_EQ(from_b.usage.stream_restarts(), 0);
    EXPECT_EQ(metric("sparsex_worker_streamed_segments_total"), from_b.usage.segments_streamed());
    EXPECT_EQ(metric("sparsex_worker_stream_restarts_total"), 0);
    // Where the streamed segments' memory came from (the metric is absent before its first).
    const double pinned = metric("sparsex_worker_stream_memory_segments_total{memory=\"pinned\"}");
    const double pageable =
        metric("sparsex_worker_stream_memory_segments_total{memory=\"pageable\"}");
    EXPECT_EQ(pinned, block ? 2 : -1);
    EXPECT_EQ(pageable, stream && !block ? 2 : -1);
    // A third order on B: both from its own tiers now, nothing fetched.
    Reply again = GenerateOn((*b)->port(), {d1, d2, q});
    EXPECT_EQ(again.usage.segments_fetched(), 0);
    EXPECT_EQ(again.usage.segments_hit(), 2);
    (*b)->Shutdown();
  }
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_EQ(answers[0], answers[1]);
  EXPECT_EQ(answers[0], answers[2]);
  (*a)->Shutdown();
}

}  // namespace
}  // namespace sparsex::service
