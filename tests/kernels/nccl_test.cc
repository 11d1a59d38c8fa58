// Tensor parallelism over NCCL: a one-GPU group's all-reduces are the identity (runs on any
// CUDA machine); with two or more GPUs, ranks on two devices sum correctly and the
// stories260K model at TP=2 generates the same 64 greedy tokens as TP=1. Skips without CUDA
// devices (and the multi-GPU cases with fewer than two).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "testing/models_dir.h"
#include "gpu_worker/engine/engine_group.h"
#include "gtest/gtest.h"
#include "tests/gpu_worker/engine_group_util.h"

#if SPARSEX_WITH_NCCL
#include "gpu_worker/engine/nccl_communicator.h"
#endif

namespace sparsex {
namespace {

#if SPARSEX_WITH_NCCL

int DeviceCount() {
  int n = 0;
  return CudaAvailable() && cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Rank r of `comms` on its own backend (device devices[r]): uploads `in`, all-reduces it on the
// backend stream and through the host path, returns both results.
void RankAllReduce(Communicator& comm, int device, const std::vector<float>& in,
                   std::vector<float>* dev_out, std::vector<float>* host_out) {
  auto be = CreateCudaBackend(device);
  ASSERT_TRUE(be.ok()) << be.status();
  auto t = (*be)->Alloc(2, static_cast<int64_t>(in.size() / 2));
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*be)->Upload(in, *t).ok());
  absl::Status st = comm.AllReduceSum(**be, *t);
  ASSERT_TRUE(st.ok()) << st;
  dev_out->resize(in.size());
  ASSERT_TRUE((*be)->Download(*t, *dev_out).ok());
  (*be)->Free(*t);
  *host_out = in;
  st = comm.AllReduceSumHost(*host_out);
  ASSERT_TRUE(st.ok()) << st;
}

TEST(Nccl, SizeOneGroupAllReduceIsTheIdentity) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device in this process";
  auto comms = CreateNcclGroup(std::vector<int>{0});
  ASSERT_TRUE(comms.ok()) << comms.status();
  ASSERT_EQ(comms->size(), 1u);
  EXPECT_EQ((*comms)[0]->rank(), 0);
  EXPECT_EQ((*comms)[0]->size(), 1);
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  ASSERT_NE(nvls, nullptr);  // set (to 0) by CreateNcclGroup unless the environment had it
  const std::vector<float> in = {1, -2, 3.5, 4, 0.25, -8};  // exact in bf16
  std::vector<float> dev, host;
  RankAllReduce(*(*comms)[0], 0, in, &dev, &host);
  EXPECT_EQ(dev, in);
  EXPECT_EQ(host, in);
  EXPECT_FALSE(CreateNcclGroup(std::vector<int>{DeviceCount()}).ok()) << "no such device";
}

TEST(Nccl, TwoDevicesSum) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << DeviceCount();
  auto comms = CreateNcclGroup(std::vector<int>{0, 1});
  ASSERT_TRUE(comms.ok()) << comms.status();
  const std::vector<std::vector<float>> in = {{1, 2, 3, 4}, {10, 20, 30, 40}};
  std::vector<std::vector<float>> dev(2), host(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] { RankAllReduce(*(*comms)[r], r, in[r], &dev[r], &host[r]); });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(dev[r], (std::vector<float>{11, 22, 33, 44})) << "rank " << r;
    EXPECT_EQ(host[r], (std::vector<float>{11, 22, 33, 44})) << "rank " << r;
  }
}

using testing::Greedy;

TEST(Nccl, Stories260KTp2GreedyEqualsTp1For64Tokens) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << DeviceCount();
  auto model = LoadModel(sparsex::testing::ModelsDir() + "/stories260K/stories260K.gguf");
  ASSERT_TRUE(model.ok()) << model.status();
  EngineOptions o;
  o.backend.kind = "cuda";
  o.kv.num_blocks = 256;
  auto tp1 = EngineGroup::Create(**model, o);
  ASSERT_TRUE(tp1.ok()) << tp1.status();
  o.tp.size = 2;
  auto tp2 = EngineGroup::Create(**model, o);
  ASSERT_TRUE(tp2.ok()) << tp2.status();
  for (const char* text : {"", "Once upon a time, there was a little dog named Max. He"}) {
    const std::vector<int32_t> prompt = (*model)->tokenizer().Encode(text, true);
    const std::vector<int32_t> a = Greedy(**tp1, prompt, 64);
    ASSERT_EQ(a.size(), 64u);
    EXPECT_EQ(Greedy(**tp2, prompt, 64), a) << "prompt '" << text << "'";
  }
  EXPECT_EQ((*tp2)->divergences(), 0);
}

#else

TEST(Nccl, NotBuilt) { GTEST_SKIP() << "built without SPARSEX_WITH_NCCL"; }

#endif

}  // namespace
}  // namespace sparsex
