#include "bench/loadgen/stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

namespace sparsex::loadgen {

namespace {
double SortedPercentile(const std::vector<double>& v, double p) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  p = std::clamp(p, 0.0, 100.0);
  const double idx = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(idx));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
}
}  // namespace

double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return SortedPercentile(values, p);
}

std::vector<double> Percentiles(std::vector<double> values, const std::vector<double>& ps) {
  std::sort(values.begin(), values.end());
  std::vector<double> out;
  out.reserve(ps.size());
  for (double p : ps) out.push_back(SortedPercentile(values, p));
  return out;
}

double Mean(const std::vector<double>& values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

bool MeetsSlo(const SloPoint& p, double slo_ttft_ms, double slo_tpot_ms) {
  return p.completed > 0 && p.errors == 0 && p.ttft_p99_ms <= slo_ttft_ms &&
         (std::isnan(p.tpot_p99_ms) || p.tpot_p99_ms <= slo_tpot_ms);
}

double GoodputX(const std::vector<SloPoint>& points, double slo_ttft_ms, double slo_tpot_ms) {
  double best = std::numeric_limits<double>::quiet_NaN();
  for (const SloPoint& p : points) {
    if (MeetsSlo(p, slo_ttft_ms, slo_tpot_ms) && !(p.x <= best)) best = p.x;
  }
  return best;
}

}  // namespace sparsex::loadgen
