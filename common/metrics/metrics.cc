#include "common/metrics/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace sparsex::metrics {
namespace {

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "metrics: %s\n", msg.c_str());
  std::abort();
}

void AppendLabels(std::string* out, const std::vector<std::string>& names,
                  const LabelValues& values, const char* extra_name = nullptr,
                  const std::string& extra_value = {}) {
  if (names.empty() && extra_name == nullptr) return;
  out->push_back('{');
  bool first = true;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!first) out->push_back(',');
    first = false;
    out->append(names[i]).append("=\"").append(EscapeLabelValue(values[i])).append("\"");
  }
  if (extra_name != nullptr) {
    if (!first) out->push_back(',');
    out->append(extra_name).append("=\"").append(extra_value).append("\"");
  }
  out->push_back('}');
}

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
  }
  return "untyped";
}

template <typename T>
void RenderScalar(const std::string& name, const std::vector<std::string>& label_names,
                  const LabelValues& values, const T& m, std::string* out) {
  out->append(name);
  AppendLabels(out, label_names, values);
  out->push_back(' ');
  out->append(FormatValue(m.Value()));
  out->push_back('\n');
}

}  // namespace

std::string EscapeHelp(std::string_view s) {
  std::string r;
  for (char c : s) {
    if (c == '\\') r += "\\\\";
    else if (c == '\n') r += "\\n";
    else r.push_back(c);
  }
  return r;
}

std::string EscapeLabelValue(std::string_view s) {
  std::string r;
  for (char c : s) {
    if (c == '\\') r += "\\\\";
    else if (c == '\n') r += "\\n";
    else if (c == '"') r += "\\\"";
    else r.push_back(c);
  }
  return r;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.17g", v);
  }
  return buf;
}

bool IsValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
              (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool IsValidLabelName(std::string_view name) {
  if (name.empty() || name.substr(0, 2) == "__") return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
              (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return name != "le";
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (!std::isfinite(bounds_[i]) || (i > 0 && bounds_[i] <= bounds_[i - 1])) {
      Die("histogram bounds must be finite and strictly increasing");
    }
  }
  counts_ = std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  std::vector<double> b;
  for (int i = 0; i < count; ++i) b.push_back(start + i * width);
  return b;
}

template <typename T>
T& Family<T>::Get(const LabelValues& values) {
  if (values.size() != label_names_.size()) {
    Die("metric " + name_ + ": wrong number of label values");
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  if (it != children_.end()) return *it->second;
  std::unique_ptr<T> child;
  if constexpr (std::is_same_v<T, Histogram>) {
    child = std::make_unique<Histogram>(bounds_);
  } else {
    child = std::make_unique<T>();
  }
  T& ref = *child;
  children_.emplace(values, std::move(child));
  return ref;
}

template <typename T>
void Family<T>::Render(std::string* out) const {
  out->append("# HELP ").append(name_).append(" ").append(EscapeHelp(help_)).append("\n");
  out->append("# TYPE ").append(name_).append(" ").append(TypeName(type_)).append("\n");
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [values, child] : children_) {
    if constexpr (std::is_same_v<T, Histogram>) {
      uint64_t cum = 0;
      const auto& b = child->bounds();
      for (size_t i = 0; i <= b.size(); ++i) {
        cum += child->BucketCount(i);
        out->append(name_).append("_bucket");
        AppendLabels(out, label_names_, values, "le",
                     i < b.size() ? FormatValue(b[i]) : std::string("+Inf"));
        out->append(" ").append(FormatValue(static_cast<double>(cum))).append("\n");
      }
      out->append(name_).append("_sum");
      AppendLabels(out, label_names_, values);
      out->append(" ").append(FormatValue(child->Sum())).append("\n");
      out->append(name_).append("_count");
      AppendLabels(out, label_names_, values);
      // The +Inf bucket and _count must agree; both come from the same cumulative sum.
      out->append(" ").append(FormatValue(static_cast<double>(cum))).append("\n");
    } else {
      RenderScalar(name_, label_names_, values, *child, out);
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

FamilyBase* Registry::Find(const std::string& name) const {
  for (const auto& f : families_) {
    if (f->name() == name) return f.get();
  }
  return nullptr;
}

namespace {
void CheckNames(const std::string& name, const std::vector<std::string>& labels) {
  if (!IsValidMetricName(name)) Die("invalid metric name '" + name + "'");
  for (const auto& l : labels) {
    if (!IsValidLabelName(l)) Die("metric " + name + ": invalid label name '" + l + "'");
  }
}
}  // namespace

Family<Counter>& Registry::AddCounter(const std::string& name, const std::string& help,
                                      const std::vector<std::string>& label_names) {
  CheckNames(name, label_names);
  std::lock_guard<std::mutex> lock(mu_);
  if (FamilyBase* f = Find(name)) {
    if (f->type() != MetricType::kCounter || f->label_names() != label_names) {
      Die("metric " + name + " registered twice with different type or labels");
    }
    return *static_cast<Family<Counter>*>(f);
  }
  auto f = std::make_unique<Family<Counter>>(name, help, label_names, MetricType::kCounter);
  auto& ref = *f;
  families_.push_back(std::move(f));
  return ref;
}

Family<Gauge>& Registry::AddGauge(const std::string& name, const std::string& help,
                                  const std::vector<std::string>& label_names) {
  CheckNames(name, label_names);
  std::lock_guard<std::mutex> lock(mu_);
  if (FamilyBase* f = Find(name)) {
    if (f->type() != MetricType::kGauge || f->label_names() != label_names) {
      Die("metric " + name + " registered twice with different type or labels");
    }
    return *static_cast<Family<Gauge>*>(f);
  }
  auto f = std::make_unique<Family<Gauge>>(name, help, label_names, MetricType::kGauge);
  auto& ref = *f;
  families_.push_back(std::move(f));
  return ref;
}

Family<Histogram>& Registry::AddHistogram(const std::string& name, const std::string& help,
                                          const std::vector<std::string>& label_names,
                                          std::vector<double> bounds) {
  CheckNames(name, label_names);
  std::lock_guard<std::mutex> lock(mu_);
  if (FamilyBase* f = Find(name)) {
    if (f->type() != MetricType::kHistogram || f->label_names() != label_names) {
      Die("metric " + name + " registered twice with different type or labels");
    }
    return *static_cast<Family<Histogram>*>(f);
  }
  Histogram check(bounds);  // validates the bounds now rather than at first use
  auto f = std::make_unique<Family<Histogram>>(name, help, label_names, MetricType::kHistogram,
                                               std::move(bounds));
  auto& ref = *f;
  families_.push_back(std::move(f));
  return ref;
}

void Registry::AddCollector(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  collectors_.push_back(std::move(fn));
}

std::string Registry::Render() const {
  std::vector<std::function<void()>> collectors;
  {
    std::lock_guard<std::mutex> lock(mu_);
    collectors = collectors_;
  }
  for (auto& c : collectors) c();
  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& f : families_) f->Render(&out);
  return out;
}

}  // namespace sparsex::metrics
