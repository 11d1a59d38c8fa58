// The per-request usage figures, defined once. Each is X(name, type, default); the name is the
// field of the wire message (proto/sparsex.proto `Usage`) and of the OpenAI JSON. Expanded by
// the scheduler's RequestUsage (gpu_worker/scheduler/scheduler.h), the worker's conversion to
// the wire message (worker_service.cc) and the router's JSON (router/openai_codec.cc), so a
// figure added here reaches all three (a name the proto lacks does not compile).
//
//   struct Usage {
//   #define SPX_FIELD(name, type, def) type name = def;
//     SPARSEX_USAGE_FIELDS(SPX_FIELD)
//   #undef SPX_FIELD
//   };
#pragma once

// OpenAI's own figures: the top level of the JSON "usage" object.
#define SPARSEX_USAGE_OPENAI(X) X(prompt_tokens, int, 0) X(completion_tokens, int, 0)

// SparseX's figures: the JSON usage's "sparsex" object. Token counts partition the prompt
// (prefix + reused + new = prompt; recomputed counts reused tokens recomputed); times are the
// worker's (arrival to first token, arrival to the end, waiting for admission); compute_share
// is the prefill's computed token-layers over a full prefill's.
#define SPARSEX_USAGE_DETAIL(X)                                                              \
  X(prefix_tokens, int, 0) X(reused_tokens, int, 0) X(recomputed_tokens, int, 0)             \
  X(new_tokens, int, 0) X(segments_hit, int, 0) X(segments_fetched, int, 0)                  \
  X(fetch_failures, int, 0) X(ttft_ms, double, 0.0) X(total_ms, double, 0.0)                 \
  X(queue_ms, double, 0.0) X(compute_share, double, 1.0) X(segments_streamed, int, 0)      \
  X(stream_restarts, int, 0) X(stream_wait_ms, double, 0.0) X(stream_upload_ms, double, 0.0)

#define SPARSEX_USAGE_FIELDS(X) SPARSEX_USAGE_OPENAI(X) SPARSEX_USAGE_DETAIL(X)
