// The planner of a reuse prefill: pure host code that decides, before any layer runs, the token
// layout of the prompt, which segments come from which tier, which positions reuse stored KV and
// which segments are missing (to be stored). The executor (ReuseEngine::Prefill) then runs the
// full layers, the selection and the sparse layers over this plan. No backend is touched here:
// the tiers are consulted through a lookup callback, so the plan is unit-testable alone.
//
//   ReusePlan plan = PlanReuse(segments, bos_id, prefix, block_size, options, model_fp,
//       [&](size_t s, const Hash128& fp, int n) { return tiers.Find(fp, n); });
//   plan.reused[p];          // position p's KV comes from a stored segment
//   plan.segments[s].tier;   // where segment s was found (or why it was not looked up)
//   plan.missing;            // cacheable segments to store after the pass
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/hash.h"
#include "model/prompt.h"

namespace sparsex {

struct ReuseOptions;

// Where a segment's KV comes from.
enum class SegmentTier {
  kNone,        // not looked up (reuse off, uncacheable, empty) or not found: computed
  kInPrefix,    // wholly inside the exact cached prefix: nothing to do
  kShortTail,   // partly inside the exact prefix, the short rest computed (keeps it exact)
  kDevice,      // the device tier (GPU memory)
  kPinnedHost,  // the pinned host tier (copied to the device beside the full layers)
  kHostStore,   // the host segment store (uploaded into a tier for this request)
};
const char* SegmentTierName(SegmentTier t);
inline bool Reused(SegmentTier t) {
  return t == SegmentTier::kDevice || t == SegmentTier::kPinnedHost || t == SegmentTier::kHostStore;
}

struct SegmentPlan {
  int begin = 0, end = 0;  // positions [begin, end) in the prompt
  Hash128 fp;              // its fingerprint (cacheable, non-empty segments)
  bool cacheable = false;  // looked up / stored at all
  SegmentTier tier = SegmentTier::kNone;
  // Reused positions [reuse_begin, end) (reused rows are contiguous; the prompt's last
  // position is never reused: its logits are the answer).
  int reuse_begin = 0;
};

struct ReusePlan {
  std::vector<int32_t> tokens;  // BOS (when added) + every segment's tokens
  std::vector<int32_t> group;   // segment index of every position, -1 for BOS (shared sink)
  int prefix = 0;               // exact cached prefix (from admission)
  std::vector<SegmentPlan> segments;
  std::vector<char> reused;               // per position
  int reused_tokens = 0, new_tokens = 0;  // over the non-prefix positions
  int segments_hit = 0, segments_missed = 0;
  // Cacheable segments not found in any tier (kNone); the executor or the caller stores them.
  std::vector<int> missing;
};

// Looks segment s (fingerprint fp, n tokens) up in the tiers, in order; kNone when absent.
using SegmentLookup = std::function<SegmentTier(size_t s, const Hash128& fp, int n_tokens)>;

// bos_id < 0: no BOS. Segments are looked up only with options.enable_reuse; a segment the
// prefix covers in part is reused only when its rest is long (more than two blocks and a
// quarter of the segment).
ReusePlan PlanReuse(const std::vector<PromptSegment>& segments, int32_t bos_id, int prefix,
                    int block_size, const ReuseOptions& options, const Hash128& model_fp,
                    const SegmentLookup& lookup);

// The layout alone (tokens and groups): what admission needs before the prefix is known.
std::vector<int32_t> PromptTokens(const std::vector<PromptSegment>& segments, int32_t bos_id);

}  // namespace sparsex
