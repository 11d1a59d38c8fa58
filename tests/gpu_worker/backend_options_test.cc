// CudaBackendOptionsFromEnv: the SPX_* switches (docs/operations.md, "GPU kernel switches")
// parsed into CudaBackendOptions; a value it cannot take leaves the default.
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "gpu_worker/backend/backend.h"
#include "gtest/gtest.h"

namespace sparsex {
namespace {

// Sets variables for one test and restores the environment after it.
class Env {
 public:
  ~Env() {
    // Newest first: a variable set twice gets back its value from before the first Set.
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      const auto& [name, old] = *it;
      if (old.has_value) {
        setenv(name.c_str(), old.value.c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }
  void Set(const std::string& name, const std::string& value) {
    const char* old = std::getenv(name.c_str());
    saved_.push_back({name, {old != nullptr, old != nullptr ? old : ""}});
    setenv(name.c_str(), value.c_str(), 1);
  }

 private:
  struct Old {
    bool has_value;
    std::string value;
  };
  std::vector<std::pair<std::string, Old>> saved_;
};

TEST(CudaBackendOptionsFromEnv, CudnnStatisticsSwitchAndShare) {
  const CudaBackendOptions d;
  EXPECT_TRUE(d.cudnn_statistics);  // on: measured faster on an H100
  EXPECT_DOUBLE_EQ(d.cudnn_statistics_max_share, 0.5);
  {
    Env e;
    e.Set("SPX_CUDNN_STATS", "1");
    e.Set("SPX_CUDNN_STATS_MAX_SHARE", "0.25");
    const CudaBackendOptions o = CudaBackendOptionsFromEnv();
    EXPECT_TRUE(o.cudnn_statistics);
    EXPECT_DOUBLE_EQ(o.cudnn_statistics_max_share, 0.25);
  }
  for (const char* bad : {"yes", "2", ""}) {
    Env e;
    e.Set("SPX_CUDNN_STATS", bad);
    EXPECT_TRUE(CudaBackendOptionsFromEnv().cudnn_statistics)
        << "'" << bad << "' kept the default";
  }
  for (const char* bad : {"1.5", "-0.1", "half", "0.3x", ""}) {
    Env e;
    e.Set("SPX_CUDNN_STATS", "0");
    e.Set("SPX_CUDNN_STATS_MAX_SHARE", bad);
    const CudaBackendOptions o = CudaBackendOptionsFromEnv();
    EXPECT_FALSE(o.cudnn_statistics);
    EXPECT_DOUBLE_EQ(o.cudnn_statistics_max_share, 0.5) << "'" << bad << "' kept the default";
  }
}

// The Hopper attention switches: bulk K/V copies in the ws-128 attention kernel and the statistics by
// complement on wgmma, both on by default; 0 turns each off, other values keep the default.
TEST(CudaBackendOptionsFromEnv, BulkKvAndWgmmaStatistics) {
  const CudaBackendOptions d;
  EXPECT_TRUE(d.attn_bulk_kv);
  EXPECT_TRUE(d.wgmma_statistics);
  {
    Env e;
    e.Set("SPX_ATTN_BULK_KV", "0");
    e.Set("SPX_WGMMA_STATS", "0");
    const CudaBackendOptions o = CudaBackendOptionsFromEnv();
    EXPECT_FALSE(o.attn_bulk_kv);
    EXPECT_FALSE(o.wgmma_statistics);
  }
  for (const char* bad : {"no", "2", ""}) {
    Env e;
    e.Set("SPX_ATTN_BULK_KV", bad);
    e.Set("SPX_WGMMA_STATS", bad);
    const CudaBackendOptions o = CudaBackendOptionsFromEnv();
    EXPECT_TRUE(o.attn_bulk_kv) << "'" << bad << "' kept the default";
    EXPECT_TRUE(o.wgmma_statistics) << "'" << bad << "' kept the default";
  }
}

// The first graph segment's launch count, 8 by default, 1-64 accepted; anything
// else is reported and keeps the default.
TEST(CudaBackendOptionsFromEnv, GraphFirstSegment) {
  EXPECT_EQ(CudaBackendOptions{}.graph_first_segment, 8);
  for (auto [text, want] : {std::pair{"64", 64}, std::pair{"1", 1}, std::pair{"16", 16}}) {
    Env e;
    e.Set("SPX_GRAPH_FIRST_SEGMENT", text);
    EXPECT_EQ(CudaBackendOptionsFromEnv().graph_first_segment, want) << text;
  }
  for (const char* bad : {"0", "65", "-8", "8x", "", "many"}) {
    Env e;
    e.Set("SPX_GRAPH_FIRST_SEGMENT", bad);
    EXPECT_EQ(CudaBackendOptionsFromEnv().graph_first_segment, 8)
        << "'" << bad << "' kept the default";
  }
}

TEST(CudaBackendOptionsFromEnv, SmallNAutoRows) {
  EXPECT_EQ(CudaBackendOptions{}.small_n_auto_rows, 1);
  for (auto [text, want] : {std::pair{"0", 0}, std::pair{"2", 2}, std::pair{"8", 8}}) {
    Env e;
    e.Set("SPX_SMALL_N_ROWS", text);
    EXPECT_EQ(CudaBackendOptionsFromEnv().small_n_auto_rows, want) << text;
  }
  for (const char* bad : {"-1", "9", "1x", "", "one"}) {
    Env e;
    e.Set("SPX_SMALL_N_ROWS", bad);
    EXPECT_EQ(CudaBackendOptionsFromEnv().small_n_auto_rows, 1) << "'" << bad << "' kept the default";
  }
}

// On/off switches: "1" turns each on, "0" off, anything else keeps the default.
// decode_early_kv: on (measured faster on an H100; the decode fusions measured slower,
// SPX_EPILOGUE_NORM and SPX_QKV_ROPE, were removed with their options). sm90_gemm_swiglu: off
// (no faster than cuBLASLt then SwiGLU; a memory saving).
TEST(CudaBackendOptionsFromEnv, Switches) {
  struct Switch {
    const char* var;
    bool CudaBackendOptions::*field;
    bool default_on;
    const char* bad;
  };
  const Switch switches[] = {
      {"SPX_DECODE_EARLY_KV", &CudaBackendOptions::decode_early_kv, true, "yes"},
      {"SPX_GEMM_SWIGLU", &CudaBackendOptions::sm90_gemm_swiglu, false, "yes"}};
  for (const Switch& s : switches) {
    SCOPED_TRACE(s.var);
    EXPECT_EQ(CudaBackendOptions{}.*s.field, s.default_on);
    Env e;
    e.Set(s.var, "1");
    EXPECT_TRUE(CudaBackendOptionsFromEnv().*s.field);
    e.Set(s.var, "0");
    EXPECT_FALSE(CudaBackendOptionsFromEnv().*s.field);
    e.Set(s.var, s.bad);
    EXPECT_EQ(CudaBackendOptionsFromEnv().*s.field, s.default_on) << "not 0 or 1: default kept";
  }
}

TEST(CudaBackendOptionsFromEnv, GemmSwiGluVariant) {
  EXPECT_EQ(CudaBackendOptions{}.sm90_gemm_swiglu_variant, 0);
  {
    Env e;
    e.Set("SPX_GEMM_SWIGLU_VARIANT", "1");
    EXPECT_EQ(CudaBackendOptionsFromEnv().sm90_gemm_swiglu_variant, 1);
  }
  for (const char* bad : {"2", "-1", "1x", ""}) {
    Env e;
    e.Set("SPX_GEMM_SWIGLU_VARIANT", bad);
    EXPECT_EQ(CudaBackendOptionsFromEnv().sm90_gemm_swiglu_variant, 0)
        << "'" << bad << "' kept the default";
  }
}

TEST(CudaBackendOptionsFromEnv, StatisticsReceivedAttentionSplit) {
  EXPECT_TRUE(CudaBackendOptions{}.stats_recv_split);  // on: measured faster on an H100
  {
    Env e;
    e.Set("SPX_STATS_RECV_SPLIT", "1");
    EXPECT_TRUE(CudaBackendOptionsFromEnv().stats_recv_split);
    e.Set("SPX_STATS_RECV_SPLIT", "0");
    EXPECT_FALSE(CudaBackendOptionsFromEnv().stats_recv_split);
  }
  for (const char* bad : {"on", "2", ""}) {
    Env e;
    e.Set("SPX_STATS_RECV_SPLIT", bad);
    EXPECT_TRUE(CudaBackendOptionsFromEnv().stats_recv_split)
        << "'" << bad << "' kept the default";
  }
}

TEST(CudaBackendOptionsFromEnv, OtherSwitches) {
  Env e;
  e.Set("SPX_DEVICE_SAMPLING", "0");
  e.Set("SPX_ATTN_IMPL", "wgmma");
  e.Set("SPX_CUDNN_ATTENTION", "require");
  e.Set("SPX_CUDNN_MIN_TOKENS", "64");
  const CudaBackendOptions o = CudaBackendOptionsFromEnv();
  EXPECT_FALSE(o.device_sampling);
  EXPECT_EQ(o.attn_impl, CudaBackendOptions::AttentionImpl::kWgmma);
  EXPECT_EQ(o.cudnn_attention, CudaBackendOptions::Cudnn::kRequired);
  EXPECT_EQ(o.cudnn_min_tokens, 64);
  using Impl = CudaBackendOptions::AttentionImpl;
  Env ws;
  for (const auto& [value, impl] : {std::pair{"wgmma-ws", Impl::kWgmmaWarpSpecialized},
                                    std::pair{"wgmma-ws-pp", Impl::kWgmmaWsPingPong},
                                    std::pair{"wgmma-ws-pipe", Impl::kWgmmaWsPipelined},
                                    std::pair{"wgmma-ws-128", Impl::kWgmmaWs128},
                                    std::pair{"wgmma-ws-128-lsum", Impl::kWgmmaWs128RowSum}}) {
    ws.Set("SPX_ATTN_IMPL", value);
    EXPECT_EQ(CudaBackendOptionsFromEnv().attn_impl, impl) << value;
  }
  Env bad;
  // Removed values mean the automatic choice: a 128-key kernel and attention variants measured
  // slower (docs/perf-notes.md).
  for (const char* value : {"wgmma-128", "wgmma-ws-qreg", "wgmma-ws-128-pipe"}) {
    bad.Set("SPX_ATTN_IMPL", value);
    EXPECT_EQ(CudaBackendOptionsFromEnv().attn_impl, Impl::kAuto) << value;
  }
}

}  // namespace
}  // namespace sparsex
