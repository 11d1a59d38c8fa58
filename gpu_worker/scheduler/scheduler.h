// The worker's engine loop: one thread owns the engines (an EngineGroup: one Engine and
// ReuseEngine, or one per tensor-parallel rank driven in lockstep) and runs iteration-level
// continuous batching. Each iteration
//   1. drops cancelled requests (their KV blocks go back to the pool at once),
//   2. admits waiting requests while the KV reservation and max_running allow (a request
//      waiting for its remote fetch joins when the fetch is done or at fetch_wait_ms),
//   3. runs the prefill work of the oldest request still prefilling: a slice of its reuse
//      prefill (layers of its sparse-recompute pass, about reuse_slice_tokens' worth, a long
//      full layer in row chunks,
//      returned once the backend has run them: the next request's work waits for one slice),
//      or, when it is a plain one, the next chunks of the plain prefills from it on (oldest
//      first, up to the next reuse prefill) until prefill_chunk tokens are taken, all in one
//      forward pass: a long prompt takes the whole budget, several short ones share it,
//   4. runs one decode step for every sequence past its prefill, all in one batched forward
//      pass (matmuls shared, attention per sequence) — with mix_prefill_decode, the same pass
//      as 3's plain prefill chunks,
//   5. runs a slice (store_slice_layers layers) of the oldest deferred segment store,
//   6. when nothing else ran, copies 2 layers of a device-tier-only segment to the host store,
// and streams each new token to the request's RequestHandle, which the RPC thread drains.
// No gRPC here: the service (worker_server.cc) adapts handles onto server streams.
//
//   ASSIGN_OR_RETURN(auto sched, BatchScheduler::Start(model, &store, opts));
//   ASSIGN_OR_RETURN(auto h, sched->Submit(std::move(work)));
//   std::vector<StreamChunk> chunks;
//   while (h->Wait(&chunks, 50ms) ...) { ... if (chunks.back().final) break; }
//   h->Cancel();  // client went away: the engine thread releases the sequence
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/hash.h"
#include "common/status.h"
#include "common/usage.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/engine/engine_group.h"
#include "gpu_worker/reuse/reuse_prefill.h"
#include "gpu_worker/reuse/segment_store.h"
#include "gpu_worker/scheduler/iteration_budget.h"
#include "gpu_worker/scheduler/quality_gate.h"

namespace sparsex::service {

struct SchedulerOptions {
  // Backend and KV pool (per rank), and the tensor-parallel degree engine.tp.size (rank and
  // comm are set by EngineGroup). Default: cpu, 16-token blocks, 4096 blocks, tp 1
  EngineOptions engine;
  // Sequences admitted at once (prefilling or decoding). Default: 32
  int max_running = 32;
  // Requests waiting for admission before Submit answers RESOURCE_EXHAUSTED. Default: 256
  int max_queue = 256;
  // Tokens of plain (reuse disabled) prefills run per iteration, so long prompts do not stall
  // the decoding sequences: one chunk of a long prompt, or the chunks of several short ones
  // (oldest first) in one forward pass. Default: 256
  int prefill_chunk = 256;
  // When plain prefill chunks and decode steps are due in the same iteration, run them as one
  // forward pass (the chunks' rows share every matmul with the decode rows, as vLLM v1 does):
  // the decode step then costs little more than the weights the chunks read anyway. A reuse
  // prefill's slices still alternate with decode steps. Default: true
  bool mix_prefill_decode = true;
  // Prefill work of a reuse prefill per iteration, in tokens through every layer: its layers
  // run in slices of about reuse_slice_tokens x n_layers rows (a full layer's rows are all its
  // non-prefix tokens, in row chunks when they exceed the slice; a sparse layer's the
  // recomputed ones, whole), so decoding
  // sequences wait for a slice instead of the whole pass. 0: prefill_chunk (a slice costs
  // about what a plain chunk does); -1: the whole pass in one iteration. Default: 0
  int reuse_slice_tokens = 0;
  // Target time of an iteration in which sequences decode (about the TPOT they see, the decode
  // step included): plain prefill chunks, reuse prefill slices and deferred store slices beside
  // decode steps are cut to what fits, from the measured costs (iteration_budget.h; at least 64
  // plain tokens, 64 rows of a full layer or one sparse layer per iteration); iterations
  // without decoding sequences still run
  // prefill_chunk / reuse_slice_tokens. Trades TTFT for TPOT. 0: off. Default: 0
  double tpot_target_ms = 0;
  // Defaults for every request's reuse; requests override fields. Default: ReuseOptions{}
  ReuseOptions reuse;
  // Encode and store a request's missing segments after its first token instead of before it
  // (they run as deferred engine work, one per iteration), so storing never adds to TTFT.
  // Default: true
  bool defer_segment_stores = true;
  // A missing segment is stored the n-th time a request misses it (1: at once). A store costs
  // an encoding pass of the segment (and on a GPU its host copy), which content seen once never
  // repays: a chat turn is missed when it is new and is then served as an exact prefix (on the
  // H200, storing every turn made chat TTFT p50 0.3-1 s instead of 45 ms; docs/benchmarks.md).
  // Recurring documents are stored on their second sighting. Default: 1 (the worker: 2 on a GPU)
  int store_after_misses = 1;
  // Layers of a deferred store's encoding pass run per iteration (the rest in later ones), so
  // a store delays the decoding sequences by a slice, not a whole pass; 0: the whole pass.
  // On the H200 an 8B model's 2000-token segment is ~2 ms per layer. Default: 8
  int store_slice_layers = 8;
  // Threads that run WorkItem::remote_fetch (the "waiting for remote KV" state). Default: 2
  int fetch_threads = 2;
  // Longest a request waits for its remote fetch, from its arrival; then it is admitted without
  // it (its missing segments are computed) while the fetch completes into the store for later
  // requests. A cluster lookup under write-back load took 0.26-0.44 s on the H200 (mean over a
  // run), longer than computing a 2000-token segment of an 8B model. -1: until the fetch ends.
  // Default: -1 (the worker: 100 ms on a GPU)
  int fetch_wait_ms = -1;
  // Deferred stores waiting beyond this many run even in iterations that prefill (or, without
  // store_while_busy, are dropped oldest first). Default: 16
  int max_pending_stores = 16;
  // Run deferred stores in iterations that decode. A store encodes the segment alone; with a
  // device tier its KV stays in backend memory (the host copy waits for an idle iteration), so
  // on an H200 a 2000-token segment of an 8B model costs one ~70 ms encoding pass; without
  // one it also downloads fp32 KV (~0.45 s there: chat p50 TPOT 585 ms vs 7.5 ms without
  // reuse, docs/benchmarks.md). false: stores run only when nothing decodes or prefills, and a
  // backlog beyond max_pending_stores is dropped (counted in SchedulerLoad::stores_dropped;
  // the segment is computed again when it recurs). Default: true
  bool store_while_busy = true;
  // Backend memory kept for segment KV across requests (ReuseEngine's device tier: assembly
  // without a host round trip on a GPU); 0 copies from the host store per request. Default: 0
  size_t device_tier_bytes = 0;
  // Pinned host memory kept for segment KV in the compute dtype (bf16 on a GPU), per rank;
  // used when the device tier has no capacity, copied to the GPU layer by layer beside the
  // full layers' compute (ReuseEngine). Default: 0
  size_t host_tier_bytes = 0;
  // The online correctness gate (quality_gate.h): sampled reuse requests are replayed with
  // full prefill in idle iterations (never while a user request is queued, admitted or being
  // fetched; abandoned when one arrives, so a user request waits for at most one slice of it)
  // and their first-token distributions compared; rolling quality below the thresholds steps
  // reuse up, then disables it. Default: QualityGateOptions{} (off; the worker turns it on:
  // 1% of reuse requests and the first 32)
  QualityGateOptions gate;
};

// Per-request figures reported with the final chunk.
// The fields are common/usage.h's list (one definition for the scheduler, the wire and JSON).
struct RequestUsage {
#define SPX_USAGE_FIELD(name, type, def) type name = def;
  SPARSEX_USAGE_FIELDS(SPX_USAGE_FIELD)
#undef SPX_USAGE_FIELD
};

struct StreamChunk {
  std::vector<int32_t> ids;  // new tokens
  std::string text;          // new text
  bool final = false;
  std::string finish_reason;  // "stop" | "length" | "cancelled" (final only)
  RequestUsage usage;         // final only
  absl::Status status;        // non-OK: the request failed (final)
  // WorkItem::logprobs >= 0: one entry per token of `ids`, in order.
  std::vector<TokenLogprobs> logprobs;
};

struct WorkItem {
  std::string id;
  std::vector<PromptSegment> segments;
  bool add_bos = true;
  SamplingParams sampling;
  ReuseOptions reuse;  // complete options for this request (defaults already merged)
  // >= 0: report each generated token's log-probability and this many top alternatives
  // (StreamChunk::logprobs; ComputeLogprobs over the raw logits). Default: -1 (off)
  int logprobs = -1;
  std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();
  // Work to run before admission, on one of the scheduler's fetch threads: the cluster fetch of
  // segments this worker lacks (it sets segments_fetched / fetch_failures). The request waits
  // in the "waiting for remote KV" state meanwhile, so a slow cache server blocks neither the
  // caller's (RPC) thread nor requests that need no fetch. Default: none (queued at once)
  std::function<void(WorkItem&)> remote_fetch;
  // > 0: this request's missing segments are stored at their n-th miss instead of
  // SchedulerOptions::store_after_misses (the API's reuse.store_after_misses). Default: 0
  int store_after_misses = 0;
  // Set by remote_fetch, reported in the usage.
  int segments_fetched = 0, fetch_failures = 0;
  // Given to remote_fetch by the scheduler: a streaming fetch calls it once its segments are
  // offered (BatchScheduler::OfferStreamed), with segments_fetched set and not written again;
  // the request then joins the admission queue while the transfer goes on.
  std::function<void()> fetch_started;
};

// The consumer side of one request's token stream.
class RequestHandle {
 public:
  // Waits up to `timeout` for chunks; appends what is there to *out. false on timeout.
  bool Wait(std::vector<StreamChunk>* out, std::chrono::milliseconds timeout);
  // Asks the engine thread to stop the request and free its KV (idempotent).
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  const std::string& id() const { return id_; }

 private:
  friend class BatchScheduler;
  void Push(StreamChunk c);
  std::string id_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamChunk> q_;
};

// The parts of an engine iteration, timed separately (SchedulerLoad::phase_seconds).
// kMixed: plain prefill chunks and the decode step in one forward pass (mix_prefill_decode).
enum class EnginePhase { kAdmission, kPrefill, kDecode, kStore, kSpill, kMixed };
inline constexpr int kEnginePhases = 6;
inline constexpr const char* kEnginePhaseNames[kEnginePhases] = {"admission", "prefill", "decode",
                                                                 "store", "spill", "mixed"};

// A snapshot of the scheduler's load (updated by the engine thread every iteration).
struct SchedulerLoad {
  int queue_depth = 0, running = 0;
  int waiting_remote = 0;  // requests whose remote KV fetch has not finished
  int64_t fetch_timeouts = 0;  // requests admitted at their fetch deadline, without the fetch
  int64_t running_tokens = 0;
  int kv_blocks_total = 0, kv_blocks_free = 0;
  int64_t iterations = 0;
  int pending_stores = 0;  // deferred segment stores not yet run
  int64_t stores_dropped = 0;  // deferred stores dropped (store_while_busy off, backlog full)
  int unspilled_segments = 0;  // stored in the device tier, not yet in the host store
  size_t device_tier_bytes = 0;  // segment KV held in the device (or pinned host) tier, all ranks
  // Engine-thread seconds per EnginePhase since start, and the longest single phase run.
  double phase_seconds[kEnginePhases] = {};
  double phase_longest_s[kEnginePhases] = {};
  // The iteration budget's cost estimates (ms; negative: not measured; IterationBudget): a
  // decode step, a plain prefill token beside it, a reuse prefill row-layer.
  double cost_decode_ms = -1, cost_token_ms = -1, cost_row_layer_ms = -1;
  QualityGateState gate;  // the correctness gate's figures and state
  int64_t gate_slices = 0;  // replay slices run (each in an iteration with no user request)
  int gate_pending = 0;     // replays waiting for idle time
};

// Observer hooks, called on the engine thread (keep them short).
struct SchedulerHooks {
  // Segments a reuse prefill encoded and stored into the local store (write-back, events).
  std::function<void(const std::vector<std::pair<Hash128, int>>& stored)> on_segments_stored;
  // The first token of a request (ttft), every later token (gap since the previous one).
  std::function<void(double ttft_s)> on_first_token;
  std::function<void(double gap_s)> on_token;
  // An exact-prefix KV block became findable (stored) or stopped being findable (evicted),
  // with the tokens it holds; called on the engine thread.
  std::function<void(const Hash128& hash, int num_tokens, bool stored)> on_block_event;
  // A request finished (any reason, also failures).
  std::function<void(const RequestUsage&, const std::string& finish_reason,
                     const absl::Status& status)>
      on_finished;
  // A gate replay compared (KL of the first-token distribution, argmax agreement), and a gate
  // state change (a step up or reuse disabled) with its log line.
  std::function<void(double kl, bool top1_agree)> on_gate_replay;
  std::function<void(const std::string& line, const QualityGateState&)> on_gate_event;
};

class BatchScheduler {
 public:
  // Creates the engines on the engine thread; returns once they are ready (or failed).
  // INVALID_ARGUMENT for bad options, including an engine.tp.size that is < 1 or does not
  // divide the model's heads, KV heads and FFN width.
  static absl::StatusOr<std::unique_ptr<BatchScheduler>> Start(const Model& model,
                                                               SegmentStore* store,
                                                               const SchedulerOptions& options,
                                                               SchedulerHooks hooks = {});
  // Tensor parallelism: one segment store per rank (rank r's KV-head share of every segment;
  // equal capacities). stores[0] is the one whose contents the scheduler reports (events,
  // on_segments_stored); the ranks keep theirs in step.
  static absl::StatusOr<std::unique_ptr<BatchScheduler>> Start(const Model& model,
                                                               std::vector<SegmentStore*> stores,
                                                               const SchedulerOptions& options,
                                                               SchedulerHooks hooks = {});
  ~BatchScheduler();  // Stop()

  // Validates and queues. INVALID_ARGUMENT: bad tokens, empty or over-long prompt, bad
  // sampling/reuse options, a request bigger than the whole KV pool. RESOURCE_EXHAUSTED: queue
  // full. UNAVAILABLE: stopped.
  absl::StatusOr<std::shared_ptr<RequestHandle>> Submit(WorkItem work);
  // Checks a request without queueing it (what Submit checks).
  absl::Status Validate(const WorkItem& work) const;

  SchedulerLoad load() const;
  // Whether a segment's KV is local (device tier, pinned host tier or host store): what the
  // worker asks before it fetches the segment from the cache cluster. Any thread.
  bool HoldsLocally(const Hash128& fp) const;
  // A fetched bf16 segment for the engine's tiers (EngineGroup::OfferFetched); false when not
  // taken (no tier, tensor parallelism, engine stopped). Any thread.
  bool OfferFetched(const Hash128& fp, SegmentKvBf16 kv);
  // The segment a streaming cluster fetch fills (EngineGroup::OpenStreamed: in the engine's
  // pinned block when it has room); nullptr when not taken (tensor parallelism, no tier,
  // stopped). Any thread.
  std::shared_ptr<StreamedSegment> OpenStreamed(const Hash128& fp, int n_tokens);
  bool TakesFetched() const;
  // Fails every queued and running request with UNAVAILABLE and joins the engine thread.
  void Stop();
  const SchedulerOptions& options() const { return opts_; }
  // Blocks the KV pool needs for a request (prompt + max_tokens + the largest segment, which
  // may be encoded for storage), in blocks.
  int BlocksNeeded(const WorkItem& w) const;

  struct Active;

 private:
  BatchScheduler(const Model& model, std::vector<SegmentStore*> stores,
                 const SchedulerOptions& o, SchedulerHooks hooks);
  void Loop(std::promise<absl::Status>* ready);
  void FetchLoop();
  void Iteration();
  // One slice of a's reuse prefill of about max_row_layers (its first token when it is the
  // last); its cost goes to budget_.
  void ReusePrefillSlice(Active& a, int64_t max_row_layers);
  // The plain prefills' chunks due this iteration: the prefilling requests from the oldest on,
  // up to the first reuse prefill, each's next tokens until `budget` tokens in all are taken
  // (several short prompts share the pass; a long one takes the whole budget).
  struct PlainChunkDue {
    Active* a;
    int end;  // its chunk is a->seq's tokens [computed, end)
  };
  std::vector<PlainChunkDue> PlainChunks(int budget);
  static int DueTokens(const std::vector<PlainChunkDue>& due);
  // The chunks and a decode step of `step` (may be empty) in one forward pass (a lone chunk
  // without decode rows: the engine's plain Prefill); when the pass fails (e.g. no KV block
  // left for one of them), each chunk alone and then DecodeAll.
  void PrefillChunks(const std::vector<PlainChunkDue>& due, const std::vector<Active*>& step);
  // One chunk of a plain prefill, ending at prompt position `end`, in a pass of its own.
  void PlainChunk(Active& a, int end);
  static std::pair<std::vector<Sequence*>, std::vector<int32_t>> DecodeInputs(
      const std::vector<Active*>& step);
  // The plain prefill's sequence (admitted on its first chunk): false when it failed.
  bool EnsurePlainSeq(Active& a);
  // After a plain prefill's last chunk: usage, the decode state, the first token.
  void FinishPlainPrefill(Active& a, std::span<const float> logits);
  bool DecodeOne(Active& a);
  // One decode step for all of them in one batched forward pass (StepBatch); on an error, one
  // at a time so that only the failing request fails.
  void DecodeAll(const std::vector<Active*>& step);
  // Rows one slice of a reuse prefill (a request's or a gate replay's) may spend.
  int64_t ReuseSliceRows() const;
  // Runs one slice of the oldest deferred segment store (under a TPOT target, the layers that
  // fit beside the decode step of n_decoding sequences); false when there was none.
  bool StoreOne(int n_decoding = 0);
  // Copies one device-tier-only segment to the host store and reports it (idle iterations).
  void SpillOne();
  // The request's next token from its row of logits (and its logprobs when asked for); any
  // thread, one request per thread at a time.
  absl::StatusOr<int32_t> Sample(Active& a, std::span<const float> logits);
  // Emits a sampled token, or fails the request with the sampler's error; returns false when
  // the request finished.
  bool EmitSampled(Active& a, const absl::StatusOr<int32_t>& t);
  // Emits a sampled token; returns false when the request finished.
  bool SampleAndEmit(Active& a, std::span<const float> logits);
  // SampleAndEmit for every decoding request of a batched step: the samples (and logprobs) on
  // the thread pool, one request's row per task, then the tokens emitted in order here.
  void SampleAndEmitAll(const std::vector<Active*>& step,
                        const std::vector<std::vector<float>>& logits);
  // A decode step's requests in the order its rows run: first those whose token the backend
  // can draw where the logits are (Sampler::BackendDraw: greedy or plain temperature, no
  // logprobs), with their draws, then those whose logits come to the host (top-k, top-p,
  // bias, penalties, logprobs), each group in the step's order.
  struct StepOrder {
    std::vector<Active*> step;
    std::vector<RowDraw> draws;  // one per request of the first group
  };
  static StepOrder DrawableFirst(const std::vector<Active*>& step);
  // Emits the tokens of a step run in StepOrder: the drawn ones (counted by their samplers;
  // -1, logits no token can be drawn from, fails the request), then the others sampled from
  // their logits.
  void EmitStep(const StepOrder& o, const std::vector<int32_t>& drawn,
                const std::vector<std::vector<float>>& logits);
  bool Emit(Active& a, int32_t token);
  void Finish(Active& a, const std::string& reason, absl::Status status = absl::OkStatus());
  void PublishLoad();
  // The correctness gate: queue a replay of a finished reuse prefill; run one slice of the
  // oldest replay (idle iterations only); abandon the running one (a user request arrived).
  void GateOffer(const Active& a, const std::vector<float>& logits);
  void GateStep();
  void GatePreempt();
  // Queue depth and waiting-for-remote-KV count into load_ (mu_ held): Submit updates them at
  // once, the engine thread each iteration.
  void PublishWaitingLocked();

  const Model& model_;
  std::vector<SegmentStore*> stores_;  // one per tensor-parallel rank
  SegmentStore* store_;                // rank 0's
  SchedulerOptions opts_;
  SchedulerHooks hooks_;
  int block_size_ = 16;
  int max_len_ = 0;

  // Engine state: touched by the engine thread only.
  std::unique_ptr<EngineGroup> group_;
  std::vector<std::unique_ptr<Active>> active_;
  int reserved_blocks_ = 0;
  struct PendingStore {
    Hash128 fp;
    std::vector<int32_t> tokens;
    ReuseOptions opts;
    bool started = false;  // its encoding pass is in progress (holds KV blocks)
    int reserve = 0;       // blocks counted in reserved_blocks_ while started
  };
  void DropOldestStore();
  // Counts a miss of a cacheable segment; true when it should be stored now
  // (SchedulerOptions::store_after_misses).
  bool AdmitStore(const Hash128& fp, int after_misses);
  absl::flat_hash_map<Hash128, int> miss_counts_;
  std::deque<Hash128> miss_order_;
  std::deque<PendingStore> pending_stores_;
  int64_t stores_dropped_ = 0;
  double phase_seconds_[kEnginePhases] = {};
  double phase_longest_[kEnginePhases] = {};
  QualityGate gate_;
  IterationBudget budget_;  // SchedulerOptions::tpot_target_ms
  struct GateReplay {
    std::vector<PromptSegment> segments;
    bool add_bos = true;
    ReuseOptions opts;           // full prefill: reuse off, nothing registered or stored
    std::vector<float> logits;   // the reuse pass's first-token logits
    int reserve = 0;             // blocks counted in reserved_blocks_ while running
    int tries = 0;               // times abandoned for a user request
  };
  std::deque<GateReplay> gate_queue_;
  bool gate_running_ = false;  // gate_queue_.front()'s prefill is in the engines
  int64_t gate_slices_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Active>> queue_;
  // Waiting for remote KV (guarded by mu_): each request beside its fetch job, which a fetch
  // thread runs on a copy of the work item; the request is queued when the job is done or at
  // its deadline (SchedulerOptions::fetch_wait_ms), whichever comes first.
  struct FetchJob {
    WorkItem item;
    std::shared_ptr<RequestHandle> h;
    std::atomic<bool> done{false};
    std::atomic<bool> started{false};  // item.fetch_started ran: admissible
  };
  struct FetchWait {
    std::unique_ptr<Active> a;
    std::shared_ptr<FetchJob> job;
    std::chrono::steady_clock::time_point deadline;
  };
  // Moves the waiting requests whose fetch is done or whose deadline passed (all: every one)
  // to queue_, in arrival order (mu_ held).
  void ReleaseFetchedLocked(bool all);
  std::deque<FetchWait> fetch_wait_;
  std::deque<std::shared_ptr<FetchJob>> fetch_jobs_;  // not yet taken by a fetch thread
  int64_t fetch_timeouts_ = 0;
  bool fetch_stop_ = false;
  std::condition_variable fetch_cv_;
  std::vector<std::thread> fetchers_;
  bool stop_ = false;
  SchedulerLoad load_;
  std::thread thread_;
};

}  // namespace sparsex::service
