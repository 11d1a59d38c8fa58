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

// A JSON number (NaN and infinities as null), shortest round-trip-ish formatting.
std::string JsonNumber(double v);
// A JSON string literal with escapes.
std::string JsonString(const std::string& s);

}  // namespace sparsex::loadgen
