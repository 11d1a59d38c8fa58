// The router's Prometheus metrics (served on the HTTP front end's /metrics): request outcomes,
// latency (TTFT, inter-token, end to end), routing decisions and predicted reuse, retries and
// shed load, token accounting from the workers' usage, and per-worker gauges that Router's
// collector refreshes at scrape time. One instance per Router, registered in its Registry.
//
//   metrics::Registry registry;
//   RouterMetrics m(registry);
//   m.requests->Get({"http", "ok"}).Inc();
//   m.ttft->Observe(0.012);
#pragma once

#include "common/metrics/metrics.h"

namespace sparsex::router {

struct RouterMetrics {
  explicit RouterMetrics(metrics::Registry& r) {
    const auto lat = metrics::ExponentialBuckets(0.0005, 2, 16);
    requests = &r.AddCounter("sparsex_router_requests_total",
                             "Generate requests, by API and outcome.", {"api", "outcome"});
    ttft = &r.AddHistogram("sparsex_router_ttft_seconds",
                           "Time from request arrival at the router to the first token.", {}, lat)
                .Get();
    inter_token = &r.AddHistogram("sparsex_router_inter_token_seconds",
                                  "Time between consecutive streamed chunks.", {},
                                  metrics::ExponentialBuckets(0.0001, 2, 16))
                       .Get();
    e2e = &r.AddHistogram("sparsex_router_e2e_seconds", "Time from arrival to the final chunk.",
                          {}, lat)
               .Get();
    decisions = &r.AddCounter("sparsex_router_routing_decisions_total",
                              "Routing decisions, by worker and reason (reuse, load, only).",
                              {"worker", "reason"});
    predicted_reuse = &r.AddCounter("sparsex_router_predicted_reusable_tokens_total",
                                    "Reusable tokens the index predicted at the chosen worker.")
                           .Get();
    retries = &r.AddCounter("sparsex_router_retries_total",
                            "Requests retried on another worker before the first token, by code.",
                            {"code"});
    restarts = &r.AddCounter("sparsex_router_restarts_total",
                             "Requests started over on another worker after theirs failed "
                             "mid-generation with nothing sent to the client yet "
                             "(non-streaming HTTP).")
                   .Get();
    shed = &r.AddCounter("sparsex_router_shed_total",
                         "Requests refused with RESOURCE_EXHAUSTED (every worker saturated).")
                .Get();
    auto c = [&r](const char* n, const char* h) { return &r.AddCounter(n, h).Get(); };
    prompt_tokens = c("sparsex_router_prompt_tokens_total", "Prompt tokens of completed requests.");
    prefix_tokens =
        c("sparsex_router_prefix_tokens_total", "Prompt tokens hit in the exact prefix cache.");
    reused_tokens = c("sparsex_router_reused_tokens_total", "Prompt tokens whose KV was reused.");
    recomputed_tokens =
        c("sparsex_router_recomputed_tokens_total", "Reused tokens recomputed (sparse recompute).");
    new_tokens = c("sparsex_router_new_tokens_total", "Prompt tokens computed from scratch.");
    generated_tokens = c("sparsex_router_generated_tokens_total", "Tokens generated.");
    fetch_failures = c("sparsex_router_fetch_failures_total",
                       "Cache-cluster fetch failures reported by workers (recomputed).");
    workers = &r.AddGauge("sparsex_router_workers", "Known workers, by state.", {"state"});
    w_inflight = &r.AddGauge("sparsex_router_worker_inflight",
                             "Requests in flight from this router, per worker.", {"worker"});
    w_queue = &r.AddGauge("sparsex_router_worker_queue_depth",
                          "Queue depth reported by each worker.", {"worker"});
    w_running = &r.AddGauge("sparsex_router_worker_running_tokens",
                            "Tokens held by running sequences, per worker.", {"worker"});
    w_kv = &r.AddGauge("sparsex_router_worker_kv_usage_ratio",
                       "Paged-KV usage reported by each worker.", {"worker"});
    w_segments = &r.AddGauge("sparsex_router_index_segments",
                             "Segments the cluster index holds for each worker.", {"worker"});
    // Series exist from the start (dashboards and rate() see zeros, not gaps).
    for (const char* api : {"grpc", "http"}) {
      for (const char* o : {"ok", "cancelled", "invalid_argument", "resource_exhausted",
                            "unavailable", "deadline_exceeded"}) {
        requests->Get({api, o});
      }
    }
    for (const char* c : {"unavailable", "resource_exhausted"}) retries->Get({c});
  }
  metrics::Family<metrics::Counter>*requests, *decisions, *retries;
  metrics::Histogram *ttft, *inter_token, *e2e;
  metrics::Counter *predicted_reuse, *restarts, *shed, *prompt_tokens, *prefix_tokens, *reused_tokens,
      *recomputed_tokens, *new_tokens, *generated_tokens, *fetch_failures;
  metrics::Family<metrics::Gauge>*workers, *w_inflight, *w_queue, *w_running, *w_kv, *w_segments;
};

}  // namespace sparsex::router
