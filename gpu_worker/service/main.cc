// sparsex-worker: a GPU (or CPU) worker serving the router over gRPC (proto/worker.proto).
// Every WorkerOptions field is a flag; see docs/operations.md.
//
//   sparsex-worker --model stories260K.gguf --device cpu --port 0 --ready_file /tmp/w.json
//                  --cache_servers 127.0.0.1:50070 --etcd 127.0.0.1:2379
//
// SIGTERM / SIGINT drain: deregister from etcd, refuse new requests, finish the running ones
// (up to --drain_timeout_ms), exit 0. The GPU kernel switches (SPX_* environment variables,
// docs/operations.md) are read here, once, into the backend options.
#include <algorithm>
#include <signal.h>

#include <iostream>

#include "common/flags.h"
#include "common/signals.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/service/worker_server.h"

int main(int argc, char** argv) {
  using sparsex::service::WorkerOptions;
  WorkerOptions o;
  int kv_blocks = o.scheduler.engine.kv.num_blocks;
  int block_size = o.scheduler.engine.kv.block_size;
  bool prefix_caching = o.scheduler.engine.kv.enable_prefix_caching;
  int64_t host_store_mb = -1;  // per device below
  int prefill_chunk = -1;      // per device below
  int store_while_busy = 1;
  int approximate_prefix = -1;  // per device below
  int store_after_misses = -1;  // per device below
  int fetch_wait_ms = -2;  // per device below
  int reuse_slice_tokens = -2;  // per device below
  int64_t device_tier_mb = -1;
  int64_t host_tier_mb = 0;
  int replication = static_cast<int>(o.cluster.replication);
  int cache_rpc_timeout_ms = static_cast<int>(o.cluster.rpc_timeout_ms);
  int64_t cache_fetch_batch_mb = static_cast<int64_t>(o.cluster.fetch_batch_bytes >> 20);
  int64_t cache_fetch_pinned_mb = -1;  // per device below
  float recompute_ratio = o.scheduler.reuse.budget.ratio;
  std::string budget;  // empty: o.auto_budget
  float quality_target = o.scheduler.reuse.budget.target_drop;
  std::string quality_calibration;
  sparsex::service::QualityGateOptions& gate = o.scheduler.gate;
  gate.enabled = true;  // the worker checks reuse by default
  sparsex::FlagSet f("sparsex-worker");
  f.Add("model", &o.model_path, "GGUF file or HF model directory (required)");
  f.Add("tokenizer", &o.tokenizer_path,
        "tokenizer instead of the model's: a GGUF vocabulary or a tokenizer.json (enters the "
        "model fingerprint; refused when larger than the model's vocabulary)");
  f.Add("model_name", &o.model_name, "model name in the API (default: file name stem)");
  f.Add("device", &o.device, "cpu | cuda");
  f.Add("cuda_device", &o.cuda_device,
        "CUDA device ordinal (with --tp N: rank r runs on cuda_device + r)");
  f.Add("tp", &o.scheduler.engine.tp.size,
        "tensor-parallel degree: ranks the model's heads and FFN are split over (cpu: threads "
        "of this process; cuda: one GPU each, over NCCL); must divide the heads, KV heads and "
        "FFN width");
  f.Add("address", &o.address, "bind address for gRPC and metrics");
  f.Add("port", &o.port, "gRPC port, 0 = any free");
  f.Add("metrics_port", &o.metrics_port, "metrics port, 0 = any free, -1 = off");
  f.Add("advertise_address", &o.advertise_address, "host:port the router dials (default: address:port)");
  f.Add("worker_id", &o.worker_id, "worker name (default: worker-<port>)");
  f.Add("kv_blocks", &kv_blocks, "paged KV blocks");
  f.Add("block_size", &block_size, "tokens per KV block");
  f.Add("prefix_caching", &prefix_caching, "exact prefix caching in the paged KV");
  f.Add("max_running", &o.scheduler.max_running, "sequences admitted at once");
  f.Add("max_queue", &o.scheduler.max_queue, "waiting requests before RESOURCE_EXHAUSTED");
  f.Add("prefill_chunk", &prefill_chunk,
        "tokens per plain prefill chunk per iteration (default -1: 256 on cpu, 2048 on cuda)");
  f.Add("mix_prefill_decode", &o.scheduler.mix_prefill_decode,
        "run a plain prefill chunk and the decode step in one forward pass");
  f.Add("reuse_slice_tokens", &reuse_slice_tokens,
        "reuse prefill work per iteration, in tokens through every layer (0: prefill_chunk; -1: "
        "the whole pass at once; default -2: 1024 on cuda, 0 on cpu)");
  f.Add("tpot_target_ms", &o.scheduler.tpot_target_ms,
        "target time of an iteration with decoding sequences (about their TPOT): prefill chunks "
        "and reuse slices beside decode steps are cut to what fits, from measured costs "
        "(0: off, the fixed --prefill_chunk / --reuse_slice_tokens; default 0)");
  f.Add("defer_segment_stores", &o.scheduler.defer_segment_stores,
        "store missing segments after the first token (off the TTFT path)");
  f.Add("store_while_busy", &store_while_busy,
        "1: deferred segment stores also run while sequences decode; 0: only when idle, an "
        "overflowing backlog is dropped (default 1; with a device tier a store costs one "
        "encoding pass)");
  f.Add("full_layers", &o.scheduler.reuse.full_layers, "reuse: layers with full attention (F)");
  f.Add("selector", &o.scheduler.reuse.selector, "reuse: sparsex | cacheblend | epic | random");
  f.Add("refresh_first_sparse_kv", &o.scheduler.reuse.refresh_first_sparse_kv,
        "reuse: write layer F's K/V of every reused token from its exact input (the selection's "
        "projection; default 1)");
  f.Add("budget", &budget,
        "reuse: how many reused tokens are recomputed: quality (the fewest whose predicted "
        "relative quality drop is at most --quality_target, docs/fidelity.md) | fixed "
        "(--recompute_ratio) | adaptive (default: quality where the served model has a "
        "calibration, --quality_calibration or the built-in stories260K one, else fixed)");
  f.Add("recompute_ratio", &recompute_ratio,
        "reuse, --budget fixed: share of reused tokens recomputed (default 0.15)");
  f.Add("quality_target", &quality_target,
        "reuse, --budget quality: predicted relative quality drop per request (default 0.01)");
  f.Add("quality_calibration", &quality_calibration,
        "reuse, --budget quality: the model's calibration JSON written by `sparsex fidelity "
        "--calibration-out` (default: none; stories260K's is built in)");
  f.Add("gate", &gate.enabled,
        "correctness gate: replay sampled reuse requests with full prefill in idle time, step "
        "reuse up or disable it when quality drops (docs/reliability.md) (default 1)");
  f.Add("gate_sample_rate", &gate.sample_rate,
        "correctness gate: share of reuse requests replayed after the warm-up (default 0.01)");
  f.Add("gate_warmup", &gate.warmup_requests,
        "correctness gate: first reuse requests all replayed, also after a step-up (default 32)");
  f.Add("gate_window", &gate.window, "correctness gate: rolling window in replays (default 32)");
  f.Add("gate_min_samples", &gate.min_samples,
        "correctness gate: replays in the window before it is judged (default 16)");
  f.Add("gate_min_top1", &gate.min_top1_agreement,
        "correctness gate: rolling first-token agreement below this fails (default 0.9)");
  f.Add("gate_max_median_kl", &gate.max_median_kl,
        "correctness gate: rolling median first-token KL above this fails (default 0.001)");
  f.Add("gate_max_kl", &gate.max_mean_kl,
        "correctness gate: rolling mean first-token KL above this fails (default 0.02)");
  f.Add("gate_max_steps", &gate.max_steps,
        "correctness gate: step-ups (F +1, r +0.15 or target / 4) before reuse is disabled "
        "(default 2)");
  f.Add("gate_max_pending", &gate.max_pending,
        "correctness gate: replays waiting for idle time; more are dropped (default 8)");
  f.Add("segment_encoding", &o.scheduler.reuse.encoding, "reuse: none | bos | prefix:<ids>");
  f.Add("fetch_wait_ms", &fetch_wait_ms,
        "longest a request waits for the cache-cluster fetch of its missing segments before it "
        "is served without them (they are computed; the fetch still completes for later "
        "requests); -1: until the fetch ends (default -2: 100 with --device cuda, else -1)");
  f.Add("store_after_misses", &store_after_misses,
        "store a missing segment the n-th time a request misses it (1: at once; content seen "
        "once never repays its encoding pass) (default -1: 2 with --device cuda, else 1)");
  f.Add("approximate_prefix", &approximate_prefix,
        "reuse: register a reuse request's blocks past its exact KV (generated ones too) in an "
        "approximate prefix namespace that later reuse requests match, so a chat turn continues "
        "on the previous turn's KV; requests with reuse off never match them (default -1: 1 "
        "with --device cuda, else 0)");
  f.Add("host_store_mb", &host_store_mb,
        "host segment store capacity in MiB (with --tp N: split evenly over the ranks; default "
        "-1: 1024 on cpu, 8192 on cuda, where one 2000-token segment of an 8B model is 512 MiB "
        "of fp32 KV)");
  f.Add("device_tier_mb", &device_tier_mb,
        "segment KV kept in device memory, MiB per GPU (default -1: 8192 with --device cuda, "
        "else 0)");
  f.Add("host_tier_mb", &host_tier_mb,
        "segment KV kept in pinned host memory (bf16 on a GPU), MiB per rank; used when "
        "--device_tier_mb is 0 (default 0)");
  f.Add("cache_servers", &o.cluster.servers,
        "cache server gRPC addresses (comma-separated); with --tp N each rank moves its share");
  f.Add("cache_replication", &replication, "copies of each segment in the cache cluster");
  f.Add("cache_transport", &o.cluster.transport, "cache data plane: ucx | grpc");
  f.Add("ucx_tls", &o.cluster.ucx_tls, "UCX transports (as UCX_TLS)");
  f.Add("cache_wire_dtype", &o.cluster.wire_dtype,
        "K/V element type written to the cache cluster: f32 | bf16 (default: bf16 with "
        "--device cuda, whose KV is bf16 already, else f32); fetches read both");
  f.Add("cache_fetch_to_tier", &o.cluster.fetch_to_tier,
        "fetched segments go to the device (or pinned host) tier in bf16, not the fp32 host "
        "store (not with --tp)");
  f.Add("cache_rpc_timeout_ms", &cache_rpc_timeout_ms, "cache control RPC deadline");
  f.Add("cache_fetch_stream", &o.cluster.stream_fetch,
        "with --cache_fetch_to_tier: fetch in layer order and start the prefill while the "
        "transfer goes on, each sparse layer waiting for its own blocks");
  f.Add("cache_fetch_pinned_mb", &cache_fetch_pinned_mb,
        "pinned host memory, MiB, that streamed cache fetches decode into so the GPU copies "
        "each layer without a host staging copy; a fetch that does not fit uses pageable "
        "memory (0-1048576; default -1: 8192 with --device cuda, cache servers and "
        "--cache_fetch_stream, where a 32K-token prompt of an 8B model is 4 GiB, else 0)");
  f.Add("cache_fetch_batch_mb", &cache_fetch_batch_mb,
        "MiB leased and transferred per cache fetch round (1-16384; capped at a quarter of the "
        "smallest cache server's memory); two staging buffers of this size are kept");
  f.Add("write_back", &o.write_back, "write computed segments to the cache cluster");
  f.Add("etcd", &o.etcd_endpoints, "etcd client URLs host:port (comma-separated); empty = no registration");
  f.Add("etcd_prefix", &o.etcd_prefix, "etcd key prefix");
  f.Add("etcd_ttl_s", &o.etcd_ttl_s, "registration lease TTL in seconds");
  f.Add("drain_timeout_ms", &o.drain_timeout_ms, "how long SIGTERM waits for running requests");
  f.Add("load_report_ms", &o.load_report_ms, "load report period on the event stream");
  f.Add("ready_file", &o.ready_file, "write {grpc_port, metrics_port, pid} here once serving");
  f.Add("tls_ca", &o.tls.ca,
        "cluster CA (PEM): the router must present a certificate it signed; also verifies the "
        "cache servers");
  f.Add("tls_cert", &o.tls.cert, "this worker's certificate (PEM, signed by the cluster CA)");
  f.Add("tls_key", &o.tls.key, "this worker's private key (PEM)");
  f.Add("kv_mac_key_file", &o.cluster.mac_key_file,
        "the cluster's KV MAC key (64 hex digits): blocks written to the cache cluster are sealed "
        "with it, fetched blocks used only when their MAC verifies (docs/security.md)");
  f.Add("insecure_loopback", &o.insecure_loopback,
        "serve plaintext without client certificates; refused unless --address is loopback");
  if (absl::Status s = f.Parse(argc, argv); !s.ok()) {
    std::cerr << "sparsex-worker: " << s.message() << "\n";
    return 2;
  }
  if (f.help()) {
    std::cout << f.Usage();
    return 0;
  }
  if (!(o.scheduler.tpot_target_ms >= 0 && o.scheduler.tpot_target_ms <= 1e6)) {
    std::cerr << "sparsex-worker: --tpot_target_ms must be 0 (off) to 1e6, not "
              << o.scheduler.tpot_target_ms << "\n";
    return 2;
  }
  if (cache_fetch_batch_mb < 1 || cache_fetch_batch_mb > 16384) {
    std::cerr << "sparsex-worker: --cache_fetch_batch_mb must be 1-16384, not "
              << cache_fetch_batch_mb << "\n";
    return 2;
  }
  o.cluster.fetch_batch_bytes = static_cast<uint64_t>(cache_fetch_batch_mb) << 20;
  if (cache_fetch_pinned_mb < -1 || cache_fetch_pinned_mb > (int64_t{1} << 20)) {
    std::cerr << "sparsex-worker: --cache_fetch_pinned_mb must be -1 (per device) or "
                 "0-1048576, not "
              << cache_fetch_pinned_mb << "\n";
    return 2;
  }
  o.scheduler.engine.backend.cuda = sparsex::CudaBackendOptionsFromEnv();
  o.scheduler.engine.kv.num_blocks = kv_blocks;
  o.scheduler.engine.kv.block_size = block_size;
  o.scheduler.engine.kv.enable_prefix_caching = prefix_caching;
  o.scheduler.reuse.budget.ratio = recompute_ratio;
  o.scheduler.reuse.budget.target_drop = quality_target;
  o.auto_budget = budget.empty();
  if (budget == "quality") {
    o.scheduler.reuse.budget.mode = sparsex::BudgetOptions::Mode::kQuality;
  } else if (budget == "fixed") {
    o.scheduler.reuse.budget.mode = sparsex::BudgetOptions::Mode::kFixed;
  } else if (budget == "adaptive") {
    o.scheduler.reuse.budget.mode = sparsex::BudgetOptions::Mode::kAdaptive;
  } else if (!o.auto_budget) {
    std::cerr << "sparsex-worker: --budget must be quality, fixed or adaptive\n";
    return 2;
  }
  if (!quality_calibration.empty()) {
    auto c = sparsex::LoadQualityCalibration(quality_calibration);
    if (!c.ok()) {
      std::cerr << "sparsex-worker: " << c.status() << "\n";
      return 2;
    }
    o.scheduler.reuse.calibration = *c;
  }
  // GPU defaults sized for an 8B model (the CPU ones for the small test models).
  const bool cuda = o.device == "cuda";
  if (host_store_mb < 0) host_store_mb = cuda ? 8192 : static_cast<int64_t>(o.host_store_bytes >> 20);
  if (prefill_chunk < 0) prefill_chunk = cuda ? 2048 : o.scheduler.prefill_chunk;
  o.scheduler.prefill_chunk = prefill_chunk;
  // On the H200, slices of 1024 tokens' work held RAG's p99 TPOT under 50 ms at 8-12 req/s
  // where whole reuse prefills (one slice of prefill_chunk) missed it.
  if (reuse_slice_tokens < -1) reuse_slice_tokens = cuda ? 1024 : 0;
  o.scheduler.reuse_slice_tokens = reuse_slice_tokens;
  o.scheduler.store_while_busy = store_while_busy != 0;
  if (store_after_misses < 0) store_after_misses = cuda ? 2 : 1;
  if (fetch_wait_ms < -1) fetch_wait_ms = cuda ? 100 : -1;
  o.scheduler.fetch_wait_ms = fetch_wait_ms;
  o.scheduler.store_after_misses = store_after_misses;
  if (approximate_prefix < 0) approximate_prefix = cuda ? 1 : 0;
  o.scheduler.reuse.register_approximate_prefix = approximate_prefix != 0;
  o.host_store_bytes = static_cast<size_t>(host_store_mb) << 20;
  if (device_tier_mb < 0) device_tier_mb = cuda ? 8192 : 0;
  o.scheduler.device_tier_bytes = static_cast<size_t>(device_tier_mb) << 20;
  o.scheduler.host_tier_bytes = static_cast<size_t>(std::max<int64_t>(host_tier_mb, 0)) << 20;
  // Only a streaming fetch to the tier (bf16, without tensor parallelism) reads the block.
  const bool streams = !o.cluster.servers.empty() && o.cluster.stream_fetch &&
                       o.cluster.fetch_to_tier && o.scheduler.engine.tp.size <= 1;
  if (cache_fetch_pinned_mb < 0) cache_fetch_pinned_mb = cuda && streams ? 8192 : 0;
  o.scheduler.reuse.stream_pinned_bytes =
      streams ? static_cast<size_t>(cache_fetch_pinned_mb) << 20 : 0;
  o.cluster.replication = static_cast<uint32_t>(replication);
  o.cluster.rpc_timeout_ms = static_cast<uint32_t>(cache_rpc_timeout_ms);

  sparsex::InstallTerminationHandler();

  auto w = sparsex::service::WorkerServer::Start(o);
  if (!w.ok()) {
    std::cerr << "sparsex-worker: " << w.status() << "\n";
    return 1;
  }
  sparsex::WaitForTermination();
  (*w)->Drain();
  return 0;
}
