// A small Prometheus client: counters, gauges and histograms with labels, rendered in the text
// exposition format 0.0.4 (every family has HELP and TYPE lines), plus an HTTP server exposing
// /metrics and /healthz (metrics/http_server.h). Thread-safe; updates are lock-free atomics,
// only the first use of a label combination takes a mutex.
//
//   metrics::Registry reg;
//   auto& hits = reg.AddCounter("sparsex_cache_hits_total", "Block hits.", {"tier"});
//   hits.Get({"memory"}).Inc();
//   auto& lat = reg.AddHistogram("sparsex_cache_request_seconds", "RPC latency.", {"method"},
//                                metrics::ExponentialBuckets(1e-5, 4, 10));
//   lat.Get({"lookup"}).Observe(0.00012);
//   std::string page = reg.Render();
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace sparsex::metrics {

using LabelValues = std::vector<std::string>;

class Counter {
 public:
  void Inc(double v = 1.0) { v_.fetch_add(v, std::memory_order_relaxed); }  // v >= 0
  double Value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0.0};
};

class Gauge {
 public:
  void Set(double v) { v_.store(v, std::memory_order_relaxed); }
  void Inc(double v = 1.0) { v_.fetch_add(v, std::memory_order_relaxed); }
  void Dec(double v = 1.0) { v_.fetch_sub(v, std::memory_order_relaxed); }
  double Value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0.0};
};

class Histogram {
 public:
  // `bounds`: strictly increasing finite upper bounds; +Inf is implicit.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Non-cumulative count of bucket i (i == bounds().size() is the +Inf bucket).
  uint64_t BucketCount(size_t i) const { return counts_[i].load(std::memory_order_relaxed); }
  uint64_t Count() const { return count_.load(std::memory_order_relaxed); }
  double Sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

// `count` bounds start, start*factor, ...
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// `count` bounds start, start+width, ...
std::vector<double> LinearBuckets(double start, double width, int count);

enum class MetricType { kCounter, kGauge, kHistogram };

class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, std::vector<std::string> label_names,
             MetricType type)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)),
        type_(type) {}
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  MetricType type() const { return type_; }
  virtual void Render(std::string* out) const = 0;

 protected:
  std::string name_, help_;
  std::vector<std::string> label_names_;
  MetricType type_;
};

// All children of one metric name, one per combination of label values.
template <typename T>
class Family final : public FamilyBase {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         MetricType type, std::vector<double> bounds = {})
      : FamilyBase(std::move(name), std::move(help), std::move(label_names), type),
        bounds_(std::move(bounds)) {}

  // The child for these label values (one per label name, in order); created on first use.
  // The reference stays valid for the registry's lifetime. Aborts on a wrong arity.
  T& Get(const LabelValues& values = {});

  void Render(std::string* out) const override;

 private:
  std::vector<double> bounds_;  // histograms only
  mutable std::mutex mu_;
  std::map<LabelValues, std::unique_ptr<T>> children_;
};

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Registering a name twice returns the first family when type and labels agree, and aborts
  // otherwise. Names must match [a-zA-Z_:][a-zA-Z0-9_:]*; counters should end in _total.
  Family<Counter>& AddCounter(const std::string& name, const std::string& help,
                              const std::vector<std::string>& label_names = {});
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help,
                          const std::vector<std::string>& label_names = {});
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help,
                                  const std::vector<std::string>& label_names,
                                  std::vector<double> bounds);

  // Called at the start of every Render (e.g. to set gauges from live state).
  void AddCollector(std::function<void()> fn);

  // Text exposition format 0.0.4.
  std::string Render() const;

 private:
  FamilyBase* Find(const std::string& name) const;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<FamilyBase>> families_;
  std::vector<std::function<void()>> collectors_;
};

// Escaping helpers (exposed for tests).
std::string EscapeHelp(std::string_view s);
std::string EscapeLabelValue(std::string_view s);
std::string FormatValue(double v);
bool IsValidMetricName(std::string_view name);
bool IsValidLabelName(std::string_view name);

}  // namespace sparsex::metrics
