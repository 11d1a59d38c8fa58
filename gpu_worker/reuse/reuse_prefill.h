// Segment reuse with single-pass sparse recompute (BRIEF section 3).
//
// A prompt is a list of segments. Leading blocks that are an exact cached prefix are used as
// they are; segments found in the segment store are assembled into the request's paged KV at
// their new positions (RoPE applied there); everything else is new. One forward pass then runs
// layers [0, F) over all non-prefix tokens with full attention, picks the Sparse-Q rows at the
// switch, and runs layers [F, L) only for those rows (selected reused tokens, every new token,
// the last token), whose fresh K/V overwrite the reused entries; each row attends over all keys
// up to its own position.
//
//   ReuseEngine re(engine.get(), &store, {});
//   ASSIGN_OR_RETURN(ReusePrefillResult r, re.Prefill({{doc1}, {doc2}, {question}}));
//   // r.logits: next-token logits; r.seq: the request's KV (continue with engine->Step).
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_worker/engine/engine.h"
#include "model/prompt.h"
#include "gpu_worker/reuse/device_tier.h"
#include "gpu_worker/reuse/host_arena.h"
#include "gpu_worker/reuse/segment_store.h"
#include "gpu_worker/reuse/selector.h"
#include "gpu_worker/reuse/streamed_segment.h"

namespace sparsex {

struct ReuseOptions {
  bool enable_reuse = true;  // false: plain prefill of the concatenation. Default: true
  int full_layers = 2;       // F: layers with full attention over all tokens. Default: 2
                             // (docs/fidelity.md: lowest KL at r = 0.15 on stories260K)
  std::string selector = "sparsex";  // sparsex | cacheblend | epic | random. Default: sparsex
  SparsexWeights sparsex_weights;    // Default: see SparsexWeights
  // Full layers whose attention feeds the sparsex statistics: all F, or only the last one
  // (one statistics pass per request instead of F; on stories260K F=2 r=0.15 mean KL 0.0055
  // instead of 0.0041, docs/fidelity.md). Default: all
  bool stats_all_full_layers = true;
  BudgetOptions budget;              // Default: fixed ratio 0.15 (the worker: quality, 1%)
  // Per-F slopes of the quality budget (BudgetOptions::kQuality); empty: the budget's own
  // drop_per_uncovered. Default: empty
  QualityCalibration calibration;
  // Optional per-sparse-layer ratios for layers F, F+1, ... (non-increasing: a row dropped at
  // one layer has no exact input at the next). Empty: budget for every sparse layer.
  std::vector<float> layer_ratios;
  // Write layer F's K/V of every reused token from its exact layer-F input (the full layers
  // computed every row): the K/V projection the selection's deviation signal runs anyway, so
  // only the rows the budget leaves out of the sparse layers keep stale K/V from layer F + 1
  // on. Selectors without the deviation signal run the projection for it. Default: true
  bool refresh_first_sparse_kv = true;
  // Host memory, pinned by the backend (AllocHost) once at construction, that streaming
  // cluster fetches decode into (NewStreamedSegment): the GPU then copies a streamed layer by
  // DMA alone, with no host staging copy on the engine thread (docs/benchmarks.md, session
  // 15). A segment that does not fit gets pageable memory. Read by the constructor only; the
  // worker sets it from --cache_fetch_pinned_mb. Default: 0 (pageable memory)
  size_t stream_pinned_bytes = 0;
  // A sliced prefill (PrefillStep) may run a full layer in row chunks when it exceeds the
  // slice; false keeps whole layers (the correctness gate's replays, which run in idle time
  // only and are abandoned when a request arrives: fewer, larger slices finish more often).
  // Default: true
  bool split_full_layers = true;
  // Queue the KV assembly of every sparse layer of the device-tier segments at the selection,
  // so that the device assembles while the host ranks; false assembles each layer's just before
  // it (same kernels, same results; benchmarks compare the two). Default: true
  bool assemble_kv_ahead = true;
  // Context a segment is encoded in for storage: "none" (alone at positions 0..n-1), "bos"
  // (after BOS, only the segment part kept) or "prefix:<id> <id> ..." (after fixed tokens).
  // Default: none (stories260K: naive-reuse KL 3.6x lower than bos; docs/fidelity.md)
  std::string encoding = "none";
  bool store_new_segments = true;    // encode and store missing segments. Default: true
  // Register the request's blocks for exact-prefix reuse. Only blocks before the first token
  // whose KV is approximate (a reused token not recomputed in every layer) are exact; later
  // blocks are registered only with register_approximate_prefix, in a separate (approximate)
  // namespace which this option also lets the request match: a follow-up that extends this
  // prompt (the next chat turn) continues on exactly the KV this request used instead of
  // re-running reuse over its whole history. Requests with reuse off never match those blocks.
  // Default: true / false (the worker turns it on: --approximate_prefix)
  bool register_prefix = true;
  bool register_approximate_prefix = false;
  uint64_t seed = 0;                 // random selector seed. Default: 0
  // Wait for the device at phase boundaries and report each phase's time in ReuseStats
  // (benchmarks; costs a few synchronisations). Default: false
  bool profile = false;
  // KV scope (router/auth.h) of the request's exact-prefix blocks and of a segment given as bare
  // tokens (EnsureStored, StoreStep); PromptSegment::scope for the segments of a prefill.
  // Default: all zero (unscoped)
  Hash128 scope;
};

absl::Status ValidateReuseOptions(const ReuseOptions& o, int n_layers);

struct ReuseStats {
  int prompt_tokens = 0;
  int prefix_tokens = 0;    // exact prefix-cache hits (never recomputed)
  int reused_tokens = 0;    // tokens whose KV came from the segment store
  int new_tokens = 0;       // tokens computed from scratch
  int selected_tokens = 0;  // reused tokens recomputed at the first sparse layer
  int exact_tokens = 0;     // leading tokens whose KV equals full prefill's
  int segments_hit = 0, segments_missed = 0, segments_corrupt = 0;
  int segments_device_hit = 0;  // served from the device tier
  int segments_host_hit = 0;    // served from the pinned host tier (copied beside compute)
  int segments_streamed = 0;    // read from a cluster fetch still in progress, layer by layer
  int stream_restarts = 0;      // times the prefill started over because one did not arrive
  // Wall time the pass waited for streamed layers still in transfer (from the first time a
  // layer was asked for and missing until it was there), and host time staging the streamed
  // layers' uploads: with the fetch's own time, where a streamed request's TTFT goes.
  double stream_wait_ms = 0, stream_upload_ms = 0;
  int64_t computed_token_layers = 0;
  // Keys the sparse layers' recomputed rows attend to, summed over rows and layers (a row at
  // position p reads p + 1): their attention's unmasked work is 4 x head_dim x n_heads FLOPs
  // a key, so a kernel trace's attention time gives the achieved rate (docs/perf-notes.md).
  int64_t sparse_attended_keys = 0;
  // The selection's layer-F projection of every non-prefix row, in layers' worth of rows
  // (rows x ModelRunner::ProjectionCost()): the deviation signal and refresh_first_sparse_kv.
  double projected_token_layers = 0;
  // (computed + projected token-layers) / (L x non-prefix tokens)
  double compute_share = 1.0;
  // Share of the selector's score mass over the reused tokens left unrecomputed (1: none
  // recomputed or no reused token), and the quality budget's predicted relative drop for it
  // (calibration slope x uncovered share; 0 without a sparse layer).
  double uncovered_share = 0, predicted_drop = 0;
  // Phase times with ReuseOptions::profile (ms): lookup and staging, full layers, selection
  // (scores, KV deviation, ranking), sparse layers with their KV assembly, logits.
  double lookup_ms = 0, full_ms = 0, select_ms = 0, sparse_ms = 0, logits_ms = 0;
};

struct ReusePrefillResult {
  Sequence seq;  // holds KV blocks: continue decoding with Engine::Step, then Release
  std::vector<float> logits;
  ReuseStats stats;
  // Segments this prefill encoded and stored (store_new_segments on): fingerprint, tokens.
  std::vector<std::pair<Hash128, int>> stored;
  // With store_new_segments off (deferred stores): cacheable segments the store lacks, for
  // the caller to store later: index into the request's segments, fingerprint.
  std::vector<std::pair<int, Hash128>> missing;
};

// Where a sliced store (ReuseEngine::StoreStep) stands: still encoding; done, in the device
// tier (reported once SpillOne copied it); done, in the host store; already held (no work).
enum class StoreProgress { kRunning, kInTier, kInStore, kHeld };

class ReuseEngine {
 public:
  // device_tier_bytes: backend memory kept for segment KV across requests (the GPU tier).
  // host_tier_bytes: pinned host memory kept for segment KV in the compute dtype (bf16 on a
  // GPU); such segments are copied to the device layer by layer beside the full layers'
  // compute. Segments found only in the store go to the device tier when it has capacity, else
  // to the host tier. Defaults: 0 and 0 (copied from the host store for each request).
  ReuseEngine(Engine* engine, SegmentStore* store, ReuseOptions opts,
              size_t device_tier_bytes = 0, size_t host_tier_bytes = 0);
  ~ReuseEngine();  // ends a store in progress (its KV blocks go back to the engine)
  ReuseEngine(const ReuseEngine&) = delete;
  ReuseEngine& operator=(const ReuseEngine&) = delete;
  DeviceSegmentTier& device_tier() { return tier_; }
  DeviceSegmentTier& host_tier() { return host_tier_; }
  const ReuseOptions& options() const { return opts_; }
  Engine& engine() { return *engine_; }

  // add_bos prepends the tokenizer's BOS (a shared sink, never part of a segment).
  absl::StatusOr<ReusePrefillResult> Prefill(const std::vector<PromptSegment>& segments,
                                             bool add_bos = true,
                                             const ReuseOptions* override_opts = nullptr);
  // Prefill in slices, for a caller that interleaves it with other work (the scheduler between
  // decode steps): BeginPrefill admits the sequence, plans and looks up (ending a prefill in
  // progress); each PrefillStep runs layers until their rows add up to max_row_layers (a full
  // layer's rows are every non-prefix token, a sparse layer's the recomputed ones) and returns
  // the result after the last layer. A full layer whose rows exceed what is left of the budget
  // runs in row chunks (in position order, each attending over the keys written before it; at
  // least kMinFullLayerRows rows), so a long prompt's full layers do not hold decode steps for
  // a whole layer; sparse layers run whole. An error ends the prefill;
  // AbortPrefill drops it (a cancelled request): either way its KV blocks go back to the pool.
  // A step that leaves work returns once the backend has run its slice, so that work queued
  // next (another request's) waits for one slice, not the whole pass.
  // Prefill() is BeginPrefill + PrefillStep(unbounded).
  absl::Status BeginPrefill(const std::vector<PromptSegment>& segments, bool add_bos = true,
                            const ReuseOptions* override_opts = nullptr);
  absl::StatusOr<std::optional<ReusePrefillResult>> PrefillStep(int64_t max_row_layers);
  static constexpr int64_t kMinFullLayerRows = 64;
  void AbortPrefill();
  // Rows x layers the prefill in progress has computed so far (0 without one): what a slice
  // cost, for the scheduler's iteration budget.
  int64_t prefill_row_layers() const;
  bool prefilling() const { return prefill_ != nullptr; }
  // Encodes one segment in the configured context and stores its KV (idempotent). With a
  // device tier (capacity > 0) the KV goes there straight from the encoding pass, in the
  // compute dtype, and reaches the host store only through SpillOne: on a GPU a store then
  // costs the encoding pass alone instead of downloading and checksumming fp32 KV (measured on
  // the H200: ~0.45 s per 2000-token segment of an 8B model, docs/benchmarks.md).
  absl::Status EnsureStored(const std::vector<int32_t>& tokens,
                            const ReuseOptions* override_opts = nullptr);
  // EnsureStored in slices of at most max_layers layers, for a caller that interleaves it with
  // other work (the scheduler between decode steps): starts the segment's encoding (ending
  // one of another segment in progress) or continues it. kRunning until the last slice (each
  // returned once the backend has run it).
  absl::StatusOr<StoreProgress> StoreStep(const std::vector<int32_t>& tokens,
                                          const ReuseOptions* override_opts, int max_layers);
  // Copies the oldest segment stored only in the device tier into the host store (where the
  // cluster write-back and the router's events take it from), at most max_layers layers per
  // call so that a caller between requests never holds the engine long (on the H200 a
  // 2000-token segment of an 8B model is ~0.4 s of download and checksums in all). Returns its
  // fingerprint and tokens once the copy is complete; nullopt when it is not yet, or none
  // waits (a segment evicted from the tier before its copy started is skipped).
  absl::StatusOr<std::optional<std::pair<Hash128, int>>> SpillOne(int max_layers = 1 << 30);
  // Segments stored in the device tier whose host copy is not complete.
  size_t unspilled() const { return unspilled_.size() + (spill_ ? 1 : 0); }
  // In any tier or the host store: the worker's one "is it local?" (the planner's lookup
  // consults the same tiers in the same order). Callable from any thread.
  bool Holds(const Hash128& fp) const;
  // Whether fetched segments can go straight to a tier (device or pinned host capacity).
  bool TakesFetched() const { return tier_.capacity() > 0 || host_tier_.capacity() > 0; }
  // A segment a cluster fetch delivered in bf16 (any thread): kept in an inbox the engine
  // thread empties into the device tier (else the pinned host tier) by AdoptFetched, so the
  // fp32 host store, its checksums and the conversion at first use are skipped (a fetched 32K
  // prompt's first prefill paid ~0.7 s for them on the H200). Holds() counts it.
  void OfferFetched(const Hash128& fp, SegmentKvBf16 kv);
  // Uploads up to max_segments of the inbox into the tiers (engine thread; BeginPrefill takes
  // all that wait). The scheduler calls it between iterations, so a fetch's segments upload
  // while its later ones still transfer. Returns how many it took from the inbox.
  int AdoptFetched(int max_segments = 1 << 30);
  bool HasFetched() const;  // whether the inbox holds any (any thread)
  // A segment a streaming cluster fetch is filling (any thread): a reuse prefill that finds it
  // plans it as a hit and waits, at each sparse layer l, only for its layer l (uploaded into
  // the tier's memory then), so the prefill runs beside the fetch; afterwards the tier keeps
  // it. Complete and unused, it goes into the tier like an offered one (AdoptFetched). One
  // that fails is dropped, and a prefill reading it starts over without it (its tokens are
  // recomputed). Holds() counts it until it fails.
  void OfferStreamed(const Hash128& fp, std::shared_ptr<StreamedSegment> seg);
  // A segment for a streaming fetch to fill (any thread), n_tokens of this model: in the
  // pinned block (ReuseOptions::stream_pinned_bytes) when a range fits, else pageable.
  std::shared_ptr<StreamedSegment> NewStreamedSegment(int n_tokens);
  // Bytes of the pinned block: its capacity (0 without one) and what segments hold now.
  size_t stream_pinned_capacity() const { return arena_ ? arena_->capacity() : 0; }
  size_t stream_pinned_used() const { return arena_ ? arena_->used() : 0; }
  Hash128 Fingerprint(const std::vector<int32_t>& tokens, const std::string& encoding,
                      const Hash128& scope = {}) const;

 private:
  // A segment's encoding pass (after its encoding context), run layer by layer.
  struct EncodeJob {
    Hash128 fp;
    int n_tokens = 0, ctx = 0;  // the segment's tokens; encoding-context rows before them
    Sequence seq;               // KV blocks of the pass (released when it ends)
    std::vector<int32_t> pos, slots;
    Tensor x;  // residual stream
    bool has_x = false;
    KvCapture cap;  // on_backend with a device tier
    int next_layer = 0;
  };
  // Starts job_ (ending any other): blocks, embedding.
  absl::Status BeginEncoding(const Hash128& fp, const std::vector<int32_t>& tokens,
                             const std::string& encoding);
  absl::Status StepEncoding(int max_layers);  // ends the job on an error
  // Stores the finished job's KV: the device tier when it fits (false: waits for SpillOne),
  // else the host store (true when it is there now, reportable). Ends the job.
  absl::StatusOr<bool> FinishEncoding();
  void EndEncoding();  // frees what the job holds
  absl::StatusOr<bool> StoreSegment(const Hash128& fp, const std::vector<int32_t>& tokens,
                                    const std::string& encoding);
  std::unique_ptr<EncodeJob> job_;
  struct PrefillJob;  // a reuse prefill between slices (reuse_prefill.cc)
  absl::StatusOr<bool> RunPrefillLayers(int64_t max_row_layers);  // true after the last layer
  absl::Status Select(PrefillJob& j);  // ranks the reused rows at the switch (layer F)
  // Per reused row: squared distance of layer F's K and V (qkv_r: their projection from the
  // exact input) from the stored ones (the CacheBlend deviation signal).
  absl::Status KvDeviation(PrefillJob& j, const Tensor& qkv_r, std::vector<float>* out);
  absl::StatusOr<ReusePrefillResult> FinishPrefill();
  std::unique_ptr<PrefillJob> prefill_;
  std::deque<std::pair<Hash128, int>> unspilled_;
  struct SpillJob {  // the host copy in progress
    Hash128 fp;
    std::shared_ptr<const DeviceSegment> seg;
    SegmentKv kv;
    int next_layer = 0;
  };
  std::optional<SpillJob> spill_;
  Engine* engine_;
  SegmentStore* store_;
  ReuseOptions opts_;
  DeviceSegmentTier tier_, host_tier_;
  mutable std::mutex fetched_mu_;
  std::vector<std::pair<Hash128, SegmentKvBf16>> fetched_;  // the inbox
  // Taken from the inbox by AdoptFetched, upload in progress (Holds still says yes).
  std::vector<Hash128> adopting_;
  struct Streamed {
    std::shared_ptr<StreamedSegment> seg;
    bool claimed = false;  // read by the running prefill
  };
  std::vector<std::pair<Hash128, Streamed>> streamed_;  // under fetched_mu_
  // The pinned block streamed segments are carved from, and its allocator: shared with the
  // segments, which may outlive the engine (a fetch still holding one at shutdown).
  Tensor arena_mem_;
  std::shared_ptr<HostArena> arena_;
  // The streamed segment fp (n tokens of this model), marked claimed; nullptr if none usable.
  std::shared_ptr<StreamedSegment> ClaimStreamed(const Hash128& fp, int n);
  void UnclaimStreamed(const std::vector<Hash128>& fps);
  // Layer l of the job's streamed segments: uploaded when all have it (waiting up to 5 ms
  // when `wait`); false when not yet, ABORTED when one failed.
  absl::StatusOr<bool> StreamedLayer(PrefillJob& j, int l, bool wait);
  // After the last layer: the streamed segments' other layers uploaded and the tier keeps
  // them (a segment not complete yet is left to AdoptFetched).
  void KeepStreamed(PrefillJob& j);
};

}  // namespace sparsex
