// WorkerServer::Start's checks of its options against the model it serves.
#include "gpu_worker/service/worker_server.h"

#include "gtest/gtest.h"
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

}  // namespace
}  // namespace sparsex::service
