// The Prometheus registry and its HTTP endpoint; `promtool check metrics` on the page.
#include "common/metrics/metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "testing/server_process.h"
#include "common/metrics/http_server.h"

namespace sparsex::metrics {
namespace {

namespace ct = sparsex::cache::testing;

TEST(MetricsTest, RendersHelpTypeAndLabels) {
  Registry r;
  auto& c = r.AddCounter("sparsex_test_requests_total", "Requests.\nSecond line \\ done.",
                         {"method", "code"});
  c.Get({"get", "OK"}).Inc();
  c.Get({"get", "OK"}).Inc(2);
  c.Get({"put", "say \"hi\"\n"}).Inc();
  auto& g = r.AddGauge("sparsex_test_used_bytes", "Bytes used.");
  g.Get().Set(1.5);
  std::string page = r.Render();
  EXPECT_NE(page.find("# HELP sparsex_test_requests_total Requests.\\nSecond line \\\\ done.\n"),
            std::string::npos);
  EXPECT_NE(page.find("# TYPE sparsex_test_requests_total counter\n"), std::string::npos);
  EXPECT_NE(page.find("sparsex_test_requests_total{method=\"get\",code=\"OK\"} 3\n"),
            std::string::npos);
  EXPECT_NE(page.find("sparsex_test_requests_total{method=\"put\",code=\"say \\\"hi\\\"\\n\"} 1\n"),
            std::string::npos);
  EXPECT_NE(page.find("# TYPE sparsex_test_used_bytes gauge\nsparsex_test_used_bytes 1.5\n"),
            std::string::npos);
}

TEST(MetricsTest, HistogramIsCumulative) {
  Registry r;
  auto& h = r.AddHistogram("sparsex_test_seconds", "Latency.", {"m"}, {0.1, 1, 10});
  auto& x = h.Get({"a"});
  x.Observe(0.05);
  x.Observe(0.5);
  x.Observe(0.5);
  x.Observe(100);
  EXPECT_EQ(x.Count(), 4u);
  std::string page = r.Render();
  EXPECT_NE(page.find("sparsex_test_seconds_bucket{m=\"a\",le=\"0.10000000000000001\"} 1\n"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("sparsex_test_seconds_bucket{m=\"a\",le=\"1\"} 3\n"), std::string::npos);
  EXPECT_NE(page.find("sparsex_test_seconds_bucket{m=\"a\",le=\"10\"} 3\n"), std::string::npos);
  EXPECT_NE(page.find("sparsex_test_seconds_bucket{m=\"a\",le=\"+Inf\"} 4\n"), std::string::npos);
  EXPECT_NE(page.find("sparsex_test_seconds_count{m=\"a\"} 4\n"), std::string::npos);
  EXPECT_NE(page.find("sparsex_test_seconds_sum{m=\"a\"} 101.05"), std::string::npos);
}

TEST(MetricsTest, SameNameTwiceReturnsSameFamily) {
  Registry r;
  auto& a = r.AddCounter("sparsex_test_total", "x", {"l"});
  auto& b = r.AddCounter("sparsex_test_total", "x", {"l"});
  EXPECT_EQ(&a, &b);
  EXPECT_DEATH(r.AddGauge("sparsex_test_total", "x", {"l"}), "registered twice");
  EXPECT_DEATH(r.AddCounter("bad name", "x"), "invalid metric name");
  EXPECT_DEATH(a.Get({}), "wrong number of label values");
}

TEST(MetricsTest, CollectorsRunAtRender) {
  Registry r;
  auto& g = r.AddGauge("sparsex_test_live", "Live value.").Get();
  int calls = 0;
  r.AddCollector([&] { g.Set(++calls); });
  EXPECT_NE(r.Render().find("sparsex_test_live 1\n"), std::string::npos);
  EXPECT_NE(r.Render().find("sparsex_test_live 2\n"), std::string::npos);
}

TEST(MetricsTest, FormatValue) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(42), "42");
  EXPECT_EQ(FormatValue(-3), "-3");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(1.0 / 0.0), "+Inf");
  EXPECT_EQ(FormatValue(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(FormatValue(0.0 / 0.0), "NaN");
}

TEST(MetricsTest, HttpServerServesMetricsAndHealth) {
  Registry r;
  r.AddCounter("sparsex_test_hits_total", "Hits.", {"tier"}).Get({"memory"}).Inc(5);
  r.AddHistogram("sparsex_test_latency_seconds", "Latency.", {}, ExponentialBuckets(1e-4, 10, 4))
      .Get()
      .Observe(0.002);
  std::atomic<bool> healthy{true};
  HttpServerOptions o;
  auto http = HttpServer::Start(o, &r, [&] { return healthy.load(); });
  ASSERT_TRUE(http.ok()) << http.status();
  ASSERT_GT((*http)->port(), 0);
  auto page = ct::HttpGet((*http)->port(), "/metrics");
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_NE(page->find("sparsex_test_hits_total{tier=\"memory\"} 5"), std::string::npos);
  auto h = ct::HttpGet((*http)->port(), "/healthz");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, "ok\n");
  healthy = false;
  EXPECT_EQ(ct::HttpGet((*http)->port(), "/healthz").status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(ct::HttpGet((*http)->port(), "/nothing").ok());

  // promtool accepts the page.
  const std::string dir = ct::MakeTempDir("sparsex-metrics-");
  {
    std::ofstream f(dir + "/page.txt");
    f << *page;
  }
  if (access("/usr/bin/promtool", X_OK) == 0) {
    auto res = ct::RunCommand("/usr/bin/promtool check metrics < " + dir + "/page.txt",
                              std::chrono::seconds(30));
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->first, 0) << res->second;
  } else {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  ct::RemoveTree(dir);
}

}  // namespace
}  // namespace sparsex::metrics
