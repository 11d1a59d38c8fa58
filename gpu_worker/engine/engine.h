// The inference engine of one worker: a model on a backend, the paged KV cache and the
// forward passes a request loop is built from (admission with exact-prefix reuse, chunked
// prefill, single, batched and mixed decode steps). The request loop itself is the scheduler's
// (gpu_worker/scheduler/), which the worker service and the CLI both run.
//
//   ASSIGN_OR_RETURN(auto engine, Engine::Create(model, {}));
//   ASSIGN_OR_RETURN(Sequence seq, engine->Admit(prompt));
//   ASSIGN_OR_RETURN(std::vector<float> logits, engine->Prefill(seq));
//   ASSIGN_OR_RETURN(logits, engine->Step(seq, next_token));
//   engine->Release(seq);
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/engine/runner.h"
#include "gpu_worker/engine/sampler.h"
#include "gpu_worker/kv/block_manager.h"

namespace sparsex {

struct EngineOptions {
  BackendOptions backend;  // Default: cpu
  KvCacheOptions kv;       // Default: 16-token blocks, 4096 blocks
  int prefill_chunk = 4096;  // tokens per prefill forward call (bounds scratch memory).
                             // Default: 4096
  TensorParallelOptions tp;  // Default: no sharding
  // Decode steps as recorded backend scopes (Backend::BeginGraph): on CUDA one captured graph
  // per batch size and context-length bucket, replayed every step. Default: true
  bool graphs = true;
  // What every KV key (exact-prefix blocks, segments) derives from: the worker's KvIdentity
  // (model/prompt.h). All zero: the model fingerprint alone (tools and tests that serve one
  // model on one backend). Default: all zero
  Hash128 kv_identity;
};

// A request's token sequence and its KV blocks.
struct Sequence {
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;  // block table: block of positions [i*bs, (i+1)*bs)
  int computed = 0;             // leading tokens whose KV is in the cache
  int cached_prefix = 0;        // leading tokens found in the prefix cache at admission
  int exact_prefix = 0;         // of those, the leading ones whose KV is exact (the rest came
                                // from the approximate namespace, see BlockManager)
  Hash128 scope;                // KV scope of its exact-prefix blocks (all zero: unscoped)
  int32_t Slot(int pos, int bs) const { return blocks[pos / bs] * bs + pos % bs; }
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Model& model,
                                                        const EngineOptions& opts);
  ~Engine();

  const Model& model() const { return *model_; }
  ModelRunner& runner() { return *runner_; }
  BlockManager& blocks() { return *blocks_; }
  const EngineOptions& options() const { return opts_; }
  // The identity KV keys derive from: EngineOptions::kv_identity, else the model fingerprint.
  const Hash128& kv_identity() const { return kv_identity_; }

  // ---- building blocks (of the scheduler's request loop and the segment-reuse prefill) ----
  // Admits a prompt: matches the cached prefix (never the last token, whose logits are needed)
  // and allocates blocks for the rest. Clear error when the prompt exceeds the context length.
  // allow_approximate: the match may continue into reuse-computed (approximate) blocks.
  // scope: the request's KV scope; prefix blocks are matched and registered under it.
  absl::StatusOr<Sequence> Admit(std::vector<int32_t> prompt, bool allow_approximate = false,
                                 const Hash128& scope = {});
  // Makes room for positions up to n_tokens (allocating blocks).
  absl::Status EnsureCapacity(Sequence& seq, int n_tokens);
  // Dense forward over tokens [seq.computed, size); returns the last row's logits.
  absl::StatusOr<std::vector<float>> Prefill(Sequence& seq);
  // Appends a token and runs it; returns its logits.
  absl::StatusOr<std::vector<float>> Step(Sequence& seq, int32_t token);
  // One decode step for several sequences in one forward pass (every matmul shared, attention
  // per sequence): appends tokens[i] to *seqs[i], each of which must be fully computed, and
  // returns each one's logits. On an error no sequence is changed.
  absl::StatusOr<std::vector<std::vector<float>>> StepBatch(std::span<Sequence* const> seqs,
                                                            std::span<const int32_t> tokens);
  // StepBatch whose first draws.size() sequences have their next token drawn on the backend
  // (Sampler::BackendDraw: greedy or plain temperature; Backend::DrawRows), so their logits
  // never leave the device: `drawn` (-1 for a sequence whose logits no token can be drawn
  // from: NaN, +Inf, all -Inf, which its caller fails), and the other sequences' logits as
  // StepBatch gives them. On an error no sequence is changed.
  struct DrawnStep {
    std::vector<int32_t> drawn;
    std::vector<std::vector<float>> logits;
  };
  absl::StatusOr<DrawnStep> StepBatchDraw(std::span<Sequence* const> seqs,
                                          std::span<const int32_t> tokens,
                                          std::span<const RowDraw> draws);
  // StepBatch and the next prefill chunks of other sequences in one forward pass: chunk j
  // runs chunks[j].seq's tokens [computed, end). The chunks' rows share every matmul with the
  // decode rows and with each other, so the decoding sequences' step costs little more than the
  // chunks alone (the weights are read once), and several short prompts prefill in one pass.
  // Attention stays per sequence. `decode` holds the StepBatch logits (seqs may be empty),
  // `prefill[j]` chunk j's next-token logits when its end is its sequence's whole prompt, else
  // empty; with decode_draws the first decode_draws.size() decode rows come back as
  // `decode_drawn` instead (as StepBatchDraw gives them) and `decode` holds the others'. On an
  // error no sequence is changed (blocks taken stay with their sequence).
  struct ChunkRef {
    Sequence* seq;
    int end;
  };
  struct MixedStep {
    std::vector<std::vector<float>> decode;
    std::vector<int32_t> decode_drawn;
    std::vector<std::vector<float>> prefill;
  };
  absl::StatusOr<MixedStep> StepWithChunks(std::span<Sequence* const> seqs,
                                           std::span<const int32_t> tokens,
                                           std::span<const ChunkRef> chunks,
                                           std::span<const RowDraw> decode_draws = {});
  // Registers the sequence's full, computed blocks for exact-prefix reuse; only blocks that end
  // at or before `exact_upto` tokens (default: all computed tokens) are registered, unless
  // approximate_rest registers the later ones too, in the approximate namespace.
  void RegisterPrefix(const Sequence& seq, int exact_upto = -1, bool approximate_rest = false);
  void Release(Sequence& seq);
  std::vector<int32_t> CtxSlots(const Sequence& seq, int len) const;

 private:
  Engine() = default;
  struct BatchRows {  // rows of a batched step and the storage their spans point into
    std::vector<int32_t> pos, slots;
    std::vector<std::vector<int32_t>> ctx;
    std::vector<RowGroup> groups;
  };
  absl::Status DecodeRows(std::span<Sequence* const> seqs, BatchRows& r);
  absl::StatusOr<ModelRunner::HeadOut> DecodeStep(std::span<Sequence* const> seqs,
                                                  std::span<const int32_t> tokens,
                                                  std::span<const RowDraw> draws);
  static void AppendTokens(std::span<Sequence* const> seqs, std::span<const int32_t> tokens);
  std::vector<std::vector<float>> TakeDecodeLogits(std::span<Sequence* const> seqs,
                                                   std::span<const int32_t> tokens,
                                                   const std::vector<float>& lg);
  const Model* model_ = nullptr;
  std::unique_ptr<Model> shard_;  // this rank's weights under tensor parallelism
  EngineOptions opts_;
  Hash128 kv_identity_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<BlockManager> blocks_;
};

// Incremental detokenizer: emits text only once its UTF-8 characters are complete.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string Push(int32_t id);
  std::string Flush();  // whatever bytes are left (possibly invalid UTF-8)

 private:
  const Tokenizer& tok_;
  std::vector<int32_t> ids_;
  size_t emitted_ = 0;
};

}  // namespace sparsex
