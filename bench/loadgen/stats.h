// Statistics for sparsex-loadgen: percentiles (linear interpolation between closest ranks, as
// numpy.percentile's default) and means. Empty inputs give NaN (written as JSON null).
#pragma once

#include <string>
#include <vector>

namespace sparsex::loadgen {

// p in [0, 100]. Takes a copy (sorted inside).
double Percentile(std::vector<double> values, double p);
// Several percentiles of one sample, sorting once.
std::vector<double> Percentiles(std::vector<double> values, const std::vector<double>& ps);
double Mean(const std::vector<double>& values);

// One sustained point of a sweep, as the goodput rule reads it.
struct SloPoint {
  double x = 0;  // offered rate (or concurrency)
  double ttft_p99_ms = 0, tpot_p99_ms = 0;
  long long completed = 0, errors = 0;
};
// A point meets the SLO when at least one request completed, none failed, p99 TTFT <= slo_ttft_ms
// and p99 TPOT <= slo_tpot_ms (a point without a TPOT sample, max_tokens 1, does not fail it).
bool MeetsSlo(const SloPoint& p, double slo_ttft_ms, double slo_tpot_ms);
// Goodput of a sweep: the highest x among the points that meet the SLO; NaN when none does.
double GoodputX(const std::vector<SloPoint>& points, double slo_ttft_ms, double slo_tpot_ms);

// A JSON number (NaN and infinities as null), shortest round-trip-ish formatting.
std::string JsonNumber(double v);
// A JSON string literal with escapes.
std::string JsonString(const std::string& s);

}  // namespace sparsex::loadgen
