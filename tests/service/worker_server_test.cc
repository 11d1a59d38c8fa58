// WorkerServer::Start's checks of its options against the model it serves.
#include "gpu_worker/service/worker_server.h"
#include "gpu_worker/service/worker_state.h"

#include "gtest/gtest.h"
#include "testing/server_process.h"
#include "tests/gpu_worker/test_util.h"

namespace sparsex::service {
namespace {

// A quality calibration (sparsex fidelity --calibration-out) records the model it was measured
// on; a worker serving another model refuses it instead of budgeting every request from the
// wrong slope.
TEST(WorkerServer, RefusesAQualityCalibrationOfAnotherModel) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  WorkerOptions o;
  o.insecure_loopback = true;  // a loopback test cluster
  o.model_path = testing::Stories260KPath();
  o.metrics_port = -1;
  o.scheduler.engine.kv.num_blocks = 64;
  o.scheduler.reuse.calibration.drop_per_uncovered = {-1, 0.08f, 0.06f};
  o.scheduler.reuse.calibration.model_fingerprint = "0123456789abcdef0123456789abcdef";
  auto w = WorkerServer::Start(o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("--quality_calibration"), std::string::npos) << w.status();
  o.scheduler.reuse.calibration.model_fingerprint = model->fingerprint().Hex();
  w = WorkerServer::Start(o);
  ASSERT_TRUE(w.ok()) << w.status();
  (*w)->Shutdown();
}

// The worker's default budget (--budget not given): quality only where the served model has a
// calibration (a file of this model, or the built-in stories260K one), else fixed, said in a
// log line. The quality budget asked for without a calibration is refused: another model's
// slope recomputed ~80% of the reused tokens of the synthetic Llama-3-8B on the H200.
TEST(WorkerServer, AutoBudgetIsQualityOnlyForACalibratedModel) {
  auto model = testing::LoadStories260K();
  ASSERT_NE(model, nullptr);
  const std::string stories = model->fingerprint().Hex();
  const std::string other = "0123456789abcdef0123456789abcdef";

  ReuseOptions r;  // stories260K: the built-in calibration
  auto note = internal::ResolveReuseBudget(stories, /*auto_budget=*/true, r);
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(r.budget.mode, BudgetOptions::Mode::kQuality);
  EXPECT_EQ(r.calibration.model_fingerprint, stories);
  EXPECT_NE(note->find("quality"), std::string::npos) << *note;

  r = ReuseOptions{};  // another model without a calibration: fixed, and the line says why
  note = internal::ResolveReuseBudget(other, true, r);
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(r.budget.mode, BudgetOptions::Mode::kFixed);
  EXPECT_TRUE(r.calibration.drop_per_uncovered.empty());
  EXPECT_NE(note->find("no quality calibration"), std::string::npos) << *note;

  r = ReuseOptions{};  // ... with its own calibration: quality
  r.calibration.model_fingerprint = other;
  r.calibration.drop_per_uncovered = {-1, 0.2f, 0.1f};
  note = internal::ResolveReuseBudget(other, true, r);
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(r.budget.mode, BudgetOptions::Mode::kQuality);
  EXPECT_FLOAT_EQ(r.calibration.drop_per_uncovered[2], 0.1f);

  r = ReuseOptions{};  // --budget quality on an uncalibrated model: refused
  r.budget.mode = BudgetOptions::Mode::kQuality;
  note = internal::ResolveReuseBudget(other, false, r);
  EXPECT_EQ(note.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(note.status().message().find("--budget fixed"), std::string::npos);

  r = ReuseOptions{};  // --budget fixed: as given, no line
  r.budget.ratio = 0.3f;
  note = internal::ResolveReuseBudget(other, false, r);
  ASSERT_TRUE(note.ok());
  EXPECT_EQ(r.budget.mode, BudgetOptions::Mode::kFixed);
  EXPECT_TRUE(note->empty());
}

// The worker binary run with `flags` on a model that does not exist: an option check must
// refuse them (exit 2, a message naming `want`) before anything is loaded.
void ExpectRefused(const std::string& flags, const std::string& want) {
  auto r = cache::testing::RunCommand(
      cache::testing::BinDir() + "/sparsex-worker --model /nonexistent " + flags + " 2>&1",
      std::chrono::seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->first, 2) << flags << ": " << r->second;
  EXPECT_NE(r->second.find(want), std::string::npos) << flags << ": " << r->second;
}

TEST(WorkerCli, RefusesAnOutOfRangeFetchRoundSize) {
  for (const char* mb : {"0", "-5", "16385"}) {
    ExpectRefused(std::string("--cache_fetch_batch_mb ") + mb,
                  "--cache_fetch_batch_mb must be 1-16384");
  }
}

TEST(WorkerCli, RefusesAnOutOfRangeTpotTarget) {
  for (const char* ms : {"-1", "nan", "2e6"}) {
    ExpectRefused(std::string("--tpot_target_ms ") + ms, "--tpot_target_ms");
  }
}

}  // namespace
}  // namespace sparsex::service
