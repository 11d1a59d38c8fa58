#include <iostream>

#include "gpu_worker/service/worker_state.h"

namespace sparsex::service {
namespace internal {

wpb::CacheTier ToProtoTier(EventTier t) {
  switch (t) {
    case EventTier::kGpu:
      return wpb::TIER_GPU;
    case EventTier::kHost:
      return wpb::TIER_HOST;
    case EventTier::kCluster:
      return wpb::TIER_CLUSTER;
  }
  return wpb::TIER_UNSPECIFIED;
}

void LogLine(const std::string& id, const std::string& msg) {
  std::cerr << "[" << id << "] " << msg << std::endl;
}

}  // namespace internal

WorkerMetrics::WorkerMetrics(metrics::Registry& r) {
  const auto lat = metrics::ExponentialBuckets(0.0005, 2, 16);  // 0.5 ms .. 16 s
  ttft = &r.AddHistogram("sparsex_worker_ttft_seconds",
                         "Time from request arrival at the worker to its first token.", {}, lat)
              .Get();
  inter_token = &r.AddHistogram("sparsex_worker_inter_token_seconds",
                                "Time between consecutive tokens of a request.", {},
                                metrics::ExponentialBuckets(0.0001, 2, 16))
                     .Get();
  e2e = &r.AddHistogram("sparsex_worker_e2e_seconds",
                        "Time from request arrival to its last token.", {}, lat)
             .Get();
  queue = &r.AddHistogram("sparsex_worker_queue_seconds", "Time a request waited for admission.",
                          {}, lat)
               .Get();
  fetch = &r.AddHistogram("sparsex_worker_fetch_seconds",
                          "Time of the cache-cluster lookup and fetch before a prefill.", {},
                          metrics::ExponentialBuckets(0.0001, 2, 16))
               .Get();
  requests =
      &r.AddCounter("sparsex_worker_requests_total", "Requests finished, by outcome.", {"outcome"});
  auto tok = [&r](const char* name, const char* help) { return &r.AddCounter(name, help).Get(); };
  prompt_tokens = tok("sparsex_worker_prompt_tokens_total", "Prompt tokens of finished prefills.");
  prefix_tokens = tok("sparsex_worker_prefix_tokens_total",
                      "Prompt tokens served from the exact prefix cache.");
  reused_tokens = tok("sparsex_worker_reused_tokens_total",
                      "Prompt tokens whose KV was reused from the segment caches.");
  recomputed_tokens = tok("sparsex_worker_recomputed_tokens_total",
                          "Reused tokens recomputed by sparse recompute.");
  new_tokens = tok("sparsex_worker_new_tokens_total", "Prompt tokens computed from scratch.");
  generated_tokens = tok("sparsex_worker_generated_tokens_total", "Tokens generated.");
  segments = &r.AddCounter("sparsex_worker_segments_total",
                           "Cacheable segments looked up, by result (hit, miss).", {"result"});
  fetched = tok("sparsex_worker_fetched_segments_total",
                "Segments fetched from the cache cluster into the host store.");
  fetch_bytes = tok("sparsex_worker_fetch_bytes_total",
                    "Bytes of segment KV transferred from the cache cluster.");
  fetch_in_place_bytes = tok("sparsex_worker_fetch_in_place_bytes_total",
                             "Of the fetched bytes: blocks written by the transfer straight into "
                             "a streamed segment's pinned memory (no decode copy).");
  streamed = tok("sparsex_worker_streamed_segments_total",
                 "Fetched segments a prefill read layer by layer while their transfer went on "
                 "(--cache_fetch_stream).");
  stream_restarts = tok("sparsex_worker_stream_restarts_total",
                        "Prefills started over because a streamed segment failed (it is "
                        "recomputed).");
  stream_seconds = &r.AddCounter(
      "sparsex_worker_stream_seconds_total",
      "Streamed fetches: prefill time waiting for layers still in transfer (wait) and host time "
      "staging arrived layers for upload (upload).",
      {"part"});
  stream_memory = &r.AddCounter(
      "sparsex_worker_stream_memory_segments_total",
      "Segments a streamed fetch decoded, by memory: pinned (the engine's block, "
      "--cache_fetch_pinned_mb; copied to the GPU by DMA alone) or pageable (the block was full "
      "or off; each layer staged through a host copy).",
      {"memory"});
  fetch_failures = &r.AddCounter(
      "sparsex_worker_fetch_failures_total",
      "Cluster fetches that could not be used (recomputed instead), by reason.", {"reason"});
  fetch_phase = &r.AddCounter(
      "sparsex_worker_fetch_phase_seconds_total",
      "Cache-cluster fetch time by phase: lookup (metadata), lock (waiting for the data plane), "
      "transfer (leases, copies, checksums), decode (block checks, K/V copies), put (local "
      "store).",
      {"phase"});
  writeback = &r.AddCounter("sparsex_worker_writeback_total",
                            "Segments written back to the cache cluster, by result.", {"result"});
  queue_depth = &r.AddGauge("sparsex_worker_queue_depth", "Requests waiting for admission.").Get();
  running = &r.AddGauge("sparsex_worker_running", "Sequences admitted (prefill or decode).").Get();
  running_tokens =
      &r.AddGauge("sparsex_worker_running_tokens", "Tokens held by running sequences.").Get();
  kv_usage = &r.AddGauge("sparsex_worker_kv_usage_ratio",
                         "Used share of each KV tier (gpu: paged KV pool, host: segment store).",
                         {"tier"});
  kv_bytes = &r.AddGauge("sparsex_worker_kv_bytes", "Bytes held by each KV tier.", {"tier"});
  kv_blocks = &r.AddGauge("sparsex_worker_kv_blocks", "Paged KV blocks (total, free).", {"state"});
  host_entries = &r.AddGauge("sparsex_worker_host_segments", "Segments in the host store.").Get();
  draining = &r.AddGauge("sparsex_worker_draining", "1 while draining.").Get();
  iterations = &r.AddGauge("sparsex_worker_iterations", "Engine iterations run.").Get();
  pending_stores =
      &r.AddGauge("sparsex_worker_pending_stores", "Deferred segment stores waiting.").Get();
  engine_seconds = &r.AddGauge("sparsex_worker_engine_seconds",
                              "Engine-thread seconds per iteration phase since start "
                              "(admission, prefill, decode, store, spill).",
                              {"phase"});
  engine_longest = &r.AddGauge("sparsex_worker_engine_longest_seconds",
                              "Longest single run of each iteration phase since start.",
                              {"phase"});
  fetch_timeouts = &r.AddGauge("sparsex_worker_fetch_timeouts",
                              "Requests served without their cache-cluster fetch (it outlasted "
                              "--fetch_wait_ms; the segments were computed).").Get();
  iteration_cost = &r.AddGauge("sparsex_worker_iteration_cost_seconds",
                               "The scheduler's measured costs that size prefill work beside "
                               "decode steps under --tpot_target_ms (moving averages; -1 before "
                               "the first measurement), by part: decode_step, prefill_token, "
                               "reuse_row_layer.",
                               {"part"});
  unspilled_segments = &r.AddGauge("sparsex_worker_unspilled_segments",
                                   "Segments stored in the device tier only (host copy waits "
                                   "for an idle iteration).").Get();
  waiting_remote = &r.AddGauge("sparsex_worker_waiting_remote",
                               "Requests waiting for their cache-cluster fetch.")
                        .Get();
  stores_dropped = &r.AddGauge("sparsex_worker_stores_dropped",
                               "Deferred segment stores dropped (backlog full while busy).")
                        .Get();
  gate_kl = &r.AddHistogram("sparsex_worker_gate_kl",
                            "Correctness gate: KL(full prefill || reuse) of the first-token "
                            "distribution of each replayed reuse request.",
                            {}, std::vector<double>(kGateKlBuckets.begin(), kGateKlBuckets.end()))
                 .Get();
  gate_replays = &r.AddCounter("sparsex_worker_gate_replays_total",
                               "Correctness gate: reuse requests replayed with full prefill, by "
                               "first-token result (agree, disagree).",
                               {"result"});
  gate_rolling_top1 = &r.AddGauge("sparsex_worker_gate_rolling_top1_agreement",
                                  "Correctness gate: first-token agreement over the rolling "
                                  "window (1 while empty).")
                           .Get();
  gate_rolling_kl = &r.AddGauge("sparsex_worker_gate_rolling_kl",
                                "Correctness gate: mean first-token KL over the rolling window.")
                         .Get();
  gate_rolling_median_kl =
      &r.AddGauge("sparsex_worker_gate_rolling_median_kl",
                  "Correctness gate: median first-token KL over the rolling window.")
           .Get();
  gate_level = &r.AddGauge("sparsex_worker_gate_level",
                           "Correctness gate: step-ups applied to F and r (0: as configured).")
                    .Get();
  reuse_disabled = &r.AddGauge("sparsex_worker_reuse_disabled",
                               "1 when the correctness gate disabled segment reuse for the model "
                               "(exact prefix caching still serves).")
                        .Get();
  gate_dropped = &r.AddGauge("sparsex_worker_gate_dropped",
                             "Correctness gate: samples dropped (backlog full, no KV).")
                      .Get();
  gate_preempted = &r.AddGauge("sparsex_worker_gate_preempted",
                               "Correctness gate: replays abandoned for a user request.")
                        .Get();
  gate_breaches = &r.AddGauge("sparsex_worker_gate_breaches",
                              "Correctness gate: rolling windows judged below the thresholds.")
                       .Get();
  for (const char* res : {"agree", "disagree"}) gate_replays->Get({res});
  info = &r.AddGauge("sparsex_worker_info", "Static worker information (value 1).",
                     {"worker", "model", "device", "instance"});
  // Series exist from the start (dashboards and rate() see zeros, not gaps).
  for (const char* o :
       {"ok", "cancelled", "invalid_argument", "resource_exhausted", "unavailable"}) {
    requests->Get({o});
  }
  for (const char* why : {"transport", "corrupt", "incomplete"}) fetch_failures->Get({why});
  for (const char* res : {"ok", "error", "evicted", "fetched"}) writeback->Get({res});
  for (const char* ph : {"lookup", "lock", "transfer", "decode", "put"}) fetch_phase->Get({ph});
  segments->Get({"hit"});
}

}  // namespace sparsex::service
