// The engines of one worker under tensor parallelism, driven in lockstep: one Engine (and
// ReuseEngine over its own SegmentStore share) per rank, each on its own persistent thread,
// because every forward pass blocks in collectives until all ranks have arrived. Every call runs
// on all ranks at once and answers with rank 0's result; the block tables, statuses and reuse
// decisions of the other ranks are checked against rank 0's (they are deterministic replicas:
// same calls, same order), so a divergence is an INTERNAL error instead of a silent hang later.
// With size 1 every call goes straight to the one engine on the caller's thread (no copies, no
// threads): the single-device worker behaves and performs as before.
//
//   EngineOptions o;  o.tp.size = 2;                  // rank and comm are set per rank here
//   ASSIGN_OR_RETURN(auto g, EngineGroup::Create(model, o, {&store0, &store1}, reuse_opts));
//   ASSIGN_OR_RETURN(Sequence seq, g->Admit(prompt));
//   ASSIGN_OR_RETURN(std::vector<float> logits, g->Prefill(seq));   // rank 0's logits
//   ...; g->Release(seq);
//
// Threading: create, use and destroy a group on one thread; rank 0 runs on that thread (its
// CUDA device stays current there), ranks 1..N-1 on threads the group owns.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "gpu_worker/engine/engine.h"
#include "gpu_worker/engine/tensor_parallel.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "gpu_worker/reuse/segment_store.h"

namespace sparsex {

// INVALID_ARGUMENT unless 1 <= tp and tp divides the model's heads, KV heads and ffn_dim.
absl::Status ValidateTensorParallel(const ModelConfig& c, int tp);

class EngineGroup {
 public:
  // opts.tp.size is the degree (1: no sharding); opts.tp.rank/comm are ignored and set per rank:
  // "cpu" ranks exchange through host memory (CreateInProcessGroup), "cuda" ranks use NCCL on
  // devices opts.backend.device + rank (needs SPARSEX_WITH_NCCL). stores: one per rank (rank
  // r's KV-head share of the segment KV, not owned), or empty for a group without segment reuse.
  // Stores of a group should have equal capacities so they evict alike.
  static absl::StatusOr<std::unique_ptr<EngineGroup>> Create(
      const Model& model, const EngineOptions& opts, std::vector<SegmentStore*> stores = {},
      const ReuseOptions& reuse = {}, size_t device_tier_bytes = 0, size_t host_tier_bytes = 0);
  ~EngineGroup();  // destroys each rank's engine on its thread, joins the threads

  int size() const { return static_cast<int>(ranks_.size()); }
  // Rank 0's engine and reuse engine: configuration, block manager (whose event hook reports
  // for the group), fingerprints. Use the group's methods for anything that computes.
  Engine& engine();
  ReuseEngine& reuse();
  bool has_reuse() const;
  SegmentStore* store(int rank = 0);

  // Engine's building blocks, run on every rank (see Engine).
  absl::StatusOr<Sequence> Admit(std::vector<int32_t> prompt, const Hash128& scope = {});
  absl::StatusOr<std::vector<float>> Prefill(Sequence& seq);
  absl::StatusOr<std::vector<float>> Step(Sequence& seq, int32_t token);
  absl::StatusOr<std::vector<std::vector<float>>> StepBatch(std::span<Sequence* const> seqs,
                                                            std::span<const int32_t> tokens);
  // Decode rows drawn where the logits are (Engine::StepBatchDraw) with one rank; under tensor
  // parallelism from rank 0's logits on the host (after the ranks' logits were compared, as
  // for StepBatch), by the same DrawToken.
  absl::StatusOr<Engine::DrawnStep> StepBatchDraw(std::span<Sequence* const> seqs,
                                                  std::span<const int32_t> tokens,
                                                  std::span<const RowDraw> draws);
  absl::StatusOr<Engine::MixedStep> StepWithChunks(std::span<Sequence* const> seqs,
                                                   std::span<const int32_t> tokens,
                                                   std::span<const Engine::ChunkRef> chunks,
                                                   std::span<const RowDraw> decode_draws = {});
  void RegisterPrefix(const Sequence& seq, int exact_upto = -1, bool approximate_rest = false);
  void Release(Sequence& seq);
  // ReuseEngine's, run on every rank over its own store (see ReuseEngine). Before a prefill,
  // a segment present in some rank stores but not all is erased from all, so every rank makes
  // the same hit/miss decision and runs the same collectives.
  absl::StatusOr<ReusePrefillResult> ReusePrefill(const std::vector<PromptSegment>& segments,
                                                  bool add_bos = true,
                                                  const ReuseOptions* override_opts = nullptr);
  // ReuseEngine's sliced prefill (BeginPrefill, PrefillStep, AbortPrefill) on every rank; a
  // rank that diverges aborts it on all.
  absl::Status BeginReusePrefill(const std::vector<PromptSegment>& segments, bool add_bos,
                                 const ReuseOptions* override_opts);
  absl::StatusOr<std::optional<ReusePrefillResult>> ReusePrefillStep(int64_t max_row_layers);
  void AbortReusePrefill();
  absl::Status EnsureStored(const std::vector<int32_t>& tokens,
                            const ReuseOptions* override_opts = nullptr);
  // ReuseEngine::StoreStep on every rank (rank 0's answer).
  absl::StatusOr<StoreProgress> StoreStep(const std::vector<int32_t>& tokens,
                                          const ReuseOptions* override_opts, int max_layers);
  // ReuseEngine::SpillOne on every rank (rank 0's answer; the ranks spill alike), and
  // ReuseEngine::Holds / unspilled on rank 0 (Holds from any thread: the ranks hold alike).
  absl::StatusOr<std::optional<std::pair<Hash128, int>>> SpillOne(int max_layers = 1 << 30);
  bool Holds(const Hash128& fp) const;
  // ReuseEngine::OfferFetched, without tensor parallelism only (a rank's share travels in the
  // fp32 store); false when the segment was not taken (then the caller stores it). Any thread.
  bool OfferFetched(const Hash128& fp, SegmentKvBf16 kv);
  bool TakesFetched() const;
  int AdoptFetched(int max_segments);  // ReuseEngine::AdoptFetched on rank 0 (tp 1 only)
  // ReuseEngine::NewStreamedSegment + OfferStreamed on rank 0 (tp 1 only): the segment a
  // streaming fetch fills, or nullptr when not taken. Any thread.
  std::shared_ptr<StreamedSegment> OpenStreamed(const Hash128& fp, int n_tokens);
  bool HasFetched() const;
  size_t unspilled();
  // Segment KV bytes held in the ranks' device (or pinned host) tiers.
  size_t device_tier_bytes();

  // Calls fn(rank) on every rank at once (rank 0 on the caller's thread) and waits for all.
  void RunOnAll(const std::function<void(int rank)>& fn);
  // Times the ranks' logits disagreed on the greedy token (rank 0's are used; should stay 0).
  int64_t divergences() const { return divergences_.load(); }

  struct Rank;

 private:
  EngineGroup() = default;
  // Runs fn on every rank with rank 0 working on *seq and rank r on a copy of its input; then
  // checks every rank ended with rank 0's status code, block table and computed count.
  absl::Status Lockstep(Sequence& seq, const std::function<absl::Status(int, Sequence&)>& fn);
  // Erases from every rank's store the segments that some ranks hold and others do not.
  void AlignStores(std::span<const Hash128> fps);
  void CheckLogits(const std::vector<std::vector<float>>& logits);
  void WorkerLoop(int rank);

  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::atomic<int64_t> divergences_{0};
};

}  // namespace sparsex
