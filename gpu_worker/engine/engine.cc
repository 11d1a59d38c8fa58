#include "gpu_worker/engine/engine.h"

#include "common/thread_pool.h"

namespace sparsex {
namespace {

// Length of the longest prefix of s that does not end inside a UTF-8 character.
size_t CompleteUtf8Prefix(const std::string& s) {
  size_t n = s.size();
  size_t i = n;
  int back = 0;
  while (i > 0 && back < 4) {
    unsigned char c = static_cast<unsigned char>(s[i - 1]);
    if ((c & 0xC0) != 0x80) {  // lead or ASCII byte
      int need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
      return (back + 1 >= need) ? n : i - 1;
    }
    --i;
    ++back;
  }
  return n;
}

}  // namespace

std::string StreamDecoder::Push(int32_t id) {
  ids_.push_back(id);
  std::string all = tok_.Decode(ids_);
  size_t end = CompleteUtf8Prefix(all);
  if (end <= emitted_) return "";
  std::string out = all.substr(emitted_, end - emitted_);
  emitted_ = end;
  return out;
}

std::string StreamDecoder::Flush() {
  std::string all = tok_.Decode(ids_);
  std::string out = all.size() > emitted_ ? all.substr(emitted_) : "";
  emitted_ = all.size();
  return out;
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Model& model,
                                                       const EngineOptions& opts) {
  std::unique_ptr<Engine> e(new Engine());
  e->model_ = &model;
  e->opts_ = opts;
  if (opts.kv.block_size <= 0 || opts.kv.num_blocks <= 0) {
    return absl::InvalidArgumentError("kv block_size and num_blocks must be positive");
  }
  ASSIGN_OR_RETURN(e->backend_, CreateBackend(opts.backend));
  const Model* weights = &model;
  if (opts.tp.size > 1) {
    if (opts.tp.comm == nullptr || opts.tp.comm->size() != opts.tp.size ||
        opts.tp.comm->rank() != opts.tp.rank) {
      return absl::InvalidArgumentError("tensor parallelism needs a communicator of its size");
    }
    if (!model.synthetic_) {
      ASSIGN_OR_RETURN(e->shard_, ShardModel(model, opts.tp.rank, opts.tp.size));
      weights = e->shard_.get();
    }
  }
  if (model.synthetic_) {
    // Speed work: each rank generates its shard's shapes directly (values are random anyway).
    ModelConfig cfg = model.config();
    const int n = opts.tp.size > 1 ? opts.tp.size : 1;
    if (cfg.n_heads % n || cfg.n_kv_heads % n || cfg.ffn_dim % n) {
      return absl::InvalidArgumentError("tensor-parallel degree must divide heads and ffn_dim");
    }
    cfg.n_heads /= n;
    cfg.n_kv_heads /= n;
    cfg.ffn_dim /= n;
    ASSIGN_OR_RETURN(e->runner_,
                     ModelRunner::CreateRandom(cfg, model.synthetic_seed_ + opts.tp.rank,
                                               e->backend_.get(), opts.kv,
                                               n > 1 ? opts.tp.comm : nullptr));
  } else {
    ASSIGN_OR_RETURN(e->runner_,
                     ModelRunner::Create(*weights, e->backend_.get(), opts.kv, opts.tp.comm));
  }
  e->kv_identity_ = opts.kv_identity == Hash128{} ? model.fingerprint() : opts.kv_identity;
  e->blocks_ = std::make_unique<BlockManager>(opts.kv, e->kv_identity_);
  return e;
}

Engine::~Engine() {
  runner_.reset();  // frees backend memory before the backend goes
  backend_.reset();
}

absl::StatusOr<Sequence> Engine::Admit(std::vector<int32_t> prompt, bool allow_approximate,
                                       const Hash128& scope) {
  const ModelConfig& c = model_->config();
  if (prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  if (static_cast<int>(prompt.size()) > c.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", prompt.size(),
                                                   " tokens exceeds the context length of ",
                                                   c.max_seq_len));
  }
  for (int32_t t : prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", t, " outside vocabulary of ",
                                                     c.vocab_size));
    }
  }
  Sequence seq;
  seq.tokens = std::move(prompt);
  seq.scope = scope;
  const int bs = blocks_->block_size();
  std::span<const int32_t> matchable(seq.tokens.data(), seq.tokens.size() - 1);
  PrefixMatch m = blocks_->MatchPrefix(matchable, allow_approximate, scope);
  seq.blocks = std::move(m.blocks);
  seq.computed = seq.cached_prefix = static_cast<int>(seq.blocks.size()) * bs;
  seq.exact_prefix = m.exact_blocks * bs;
  absl::Status s = EnsureCapacity(seq, static_cast<int>(seq.tokens.size()));
  if (!s.ok()) {
    Release(seq);
    return s;
  }
  return seq;
}

absl::Status Engine::EnsureCapacity(Sequence& seq, int n_tokens) {
  const int bs = blocks_->block_size();
  const int need = (n_tokens + bs - 1) / bs - static_cast<int>(seq.blocks.size());
  if (need <= 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<int32_t> nb, blocks_->AllocateN(need));
  seq.blocks.insert(seq.blocks.end(), nb.begin(), nb.end());
  return absl::OkStatus();
}

std::vector<int32_t> Engine::CtxSlots(const Sequence& seq, int len) const {
  const int bs = blocks_->block_size();
  std::vector<int32_t> s(len);
  // Block by block (no division per position: every decode step rebuilds each sequence's
  // table, 32 x 8K positions at batch 32, 0.5 -> 0.17 ms on the CI machine).
  int p = 0;
  for (size_t b = 0; p < len; ++b) {
    const int32_t base = seq.blocks[b] * bs;
    for (int o = 0; o < bs && p < len; ++o, ++p) s[p] = base + o;
  }
  return s;
}

absl::StatusOr<std::vector<float>> Engine::Prefill(Sequence& seq) {
  const int total = static_cast<int>(seq.tokens.size());
  RETURN_IF_ERROR(EnsureCapacity(seq, total));
  if (seq.computed >= total) return absl::FailedPreconditionError("nothing to prefill");
  const std::vector<int32_t> ctx = CtxSlots(seq, total);
  std::vector<float> logits;
  // Chunked prefill: each chunk's rows attend over everything before them through the cache.
  while (seq.computed < total) {
    const int b = seq.computed, e = std::min(total, b + opts_.prefill_chunk);
    std::vector<int32_t> pos(e - b);
    for (int i = 0; i < e - b; ++i) pos[i] = b + i;
    std::span<const int32_t> ids(seq.tokens.data() + b, e - b);
    LayerRows rows{pos, std::span<const int32_t>(ctx.data() + b, e - b),
                   std::span<const int32_t>(ctx.data(), e)};
    const int32_t last = e - b - 1;
    std::span<const int32_t> out;
    if (e == total) out = std::span<const int32_t>(&last, 1);
    ASSIGN_OR_RETURN(logits, runner_->Forward(ids, rows, out));
    seq.computed = e;
  }
  return logits;
}

absl::StatusOr<std::vector<float>> Engine::Step(Sequence& seq, int32_t token) {
  if (static_cast<int>(seq.tokens.size()) >= model_->config().max_seq_len) {
    return absl::OutOfRangeError("context length reached");
  }
  if (seq.computed == static_cast<int>(seq.tokens.size())) {
    // A decode step: the batched path (one sequence), whose launches a backend can replay.
    Sequence* one[] = {&seq};
    ASSIGN_OR_RETURN(auto out, StepBatch(one, std::span<const int32_t>(&token, 1)));
    return std::move(out[0]);
  }
  seq.tokens.push_back(token);
  return Prefill(seq);
}

// The rows of a batched decode step (StepBatch, StepWithChunks): checks every sequence is fully
// computed and within the context, makes room for one more token each (capacity first: a
// failure leaves every sequence as it was; blocks taken stay with their sequence), and fills
// row i's position, slot, context and group for the first rows of `r`.
absl::Status Engine::DecodeRows(std::span<Sequence* const> seqs, BatchRows& r) {
  const int64_t B = static_cast<int64_t>(seqs.size());
  const int max_len = model_->config().max_seq_len;
  const int bs = blocks_->block_size();
  for (Sequence* s : seqs) {
    if (static_cast<int>(s->tokens.size()) >= max_len) {
      return absl::OutOfRangeError("context length reached");
    }
    if (s->computed != static_cast<int>(s->tokens.size())) {
      return absl::FailedPreconditionError("batched step: a sequence is not fully computed");
    }
  }
  for (Sequence* s : seqs) RETURN_IF_ERROR(EnsureCapacity(*s, static_cast<int>(s->tokens.size()) + 1));
  r.pos.resize(B);
  r.slots.resize(B);
  r.ctx.resize(B);
  r.groups.resize(B);
  for (int64_t i = 0; i < B; ++i) {
    const int p = static_cast<int>(seqs[i]->tokens.size());
    r.pos[i] = p;
    r.slots[i] = seqs[i]->Slot(p, bs);
    r.ctx[i] = CtxSlots(*seqs[i], p + 1);
    r.groups[i] = {i, i + 1, r.ctx[i]};
  }
  return absl::OkStatus();
}

// Appends each decode row's token to its sequence: the step computed it.
void Engine::AppendTokens(std::span<Sequence* const> seqs, std::span<const int32_t> tokens) {
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i]->tokens.push_back(tokens[i]);
    seqs[i]->computed = static_cast<int>(seqs[i]->tokens.size());
  }
}

// The decode rows' logits (the first seqs.size() rows of lg), and the tokens appended.
std::vector<std::vector<float>> Engine::TakeDecodeLogits(std::span<Sequence* const> seqs,
                                                         std::span<const int32_t> tokens,
                                                         const std::vector<float>& lg) {
  const int64_t V = model_->config().vocab_size;
  std::vector<std::vector<float>> out(seqs.size());
  // Rows of a large vocabulary copied on the pool (16 MB at batch 32 of a 128K vocabulary).
  ParallelForIfIdle(static_cast<int64_t>(seqs.size()), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      out[i].assign(lg.begin() + i * V, lg.begin() + (i + 1) * V);
    }
  }, LogitRowsPerTask(V));
  AppendTokens(seqs, tokens);
  return out;
}

// One batched decode pass (tokens not yet appended): every row's logits, or with `draws`
// every row's token drawn on the backend.
absl::StatusOr<ModelRunner::HeadOut> Engine::DecodeStep(std::span<Sequence* const> seqs,
                                                        std::span<const int32_t> tokens,
                                                        std::span<const RowDraw> draws) {
  const int64_t B = static_cast<int64_t>(seqs.size());
  if (static_cast<int64_t>(tokens.size()) != B) {
    return absl::InvalidArgumentError("StepBatch: one token per sequence required");
  }
  if (static_cast<int64_t>(draws.size()) > B) {
    return absl::InvalidArgumentError("StepBatch: more draws than sequences");
  }
  if (B == 0) return ModelRunner::HeadOut{};
  BatchRows br;
  RETURN_IF_ERROR(DecodeRows(seqs, br));
  LayerRows rows{br.pos, br.slots, {}, br.groups};
  std::vector<int32_t> all(B);
  for (int64_t i = 0; i < B; ++i) all[i] = static_cast<int32_t>(i);
  return runner_->ForwardHead(tokens, rows, all, opts_.graphs, draws);
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::StepBatch(
    std::span<Sequence* const> seqs, std::span<const int32_t> tokens) {
  ASSIGN_OR_RETURN(ModelRunner::HeadOut h, DecodeStep(seqs, tokens, {}));
  return TakeDecodeLogits(seqs, tokens, h.logits);
}

absl::StatusOr<Engine::DrawnStep> Engine::StepBatchDraw(std::span<Sequence* const> seqs,
                                                        std::span<const int32_t> tokens,
                                                        std::span<const RowDraw> draws) {
  ASSIGN_OR_RETURN(ModelRunner::HeadOut h, DecodeStep(seqs, tokens, draws));
  const size_t k = draws.size();
  DrawnStep r;
  r.drawn = std::move(h.drawn);
  r.logits = TakeDecodeLogits(seqs.subspan(k), tokens.subspan(k), h.logits);
  AppendTokens(seqs.first(k), tokens.first(k));
  return r;
}

absl::StatusOr<Engine::MixedStep> Engine::StepWithChunks(std::span<Sequence* const> seqs,
                                                         std::span<const int32_t> tokens,
                                                         std::span<const ChunkRef> chunks,
                                                         std::span<const RowDraw> decode_draws) {
  const int64_t B = static_cast<int64_t>(seqs.size());
  if (static_cast<int64_t>(tokens.size()) != B) {
    return absl::InvalidArgumentError("StepWithChunks: one token per sequence required");
  }
  const int64_t K = static_cast<int64_t>(decode_draws.size());
  if (K > B) return absl::InvalidArgumentError("StepWithChunks: more draws than sequences");
  // Every check before anything changes: a sequence in two places would have its rows run twice.
  for (size_t j = 0; j < chunks.size(); ++j) {
    const Sequence* pf = chunks[j].seq;
    if (chunks[j].end <= pf->computed || chunks[j].end > static_cast<int>(pf->tokens.size())) {
      return absl::InvalidArgumentError("StepWithChunks: a chunk must end in (computed, size]");
    }
    for (Sequence* s : seqs) {
      if (s == pf) return absl::InvalidArgumentError("StepWithChunks: a chunk's sequence decodes");
    }
    for (size_t k = 0; k < j; ++k) {
      if (chunks[k].seq == pf) {
        return absl::InvalidArgumentError("StepWithChunks: two chunks of one sequence");
      }
    }
  }
  if (B == 0 && chunks.empty()) return MixedStep{};
  BatchRows br;
  RETURN_IF_ERROR(DecodeRows(seqs, br));
  for (const ChunkRef& c : chunks) RETURN_IF_ERROR(EnsureCapacity(*c.seq, c.end));
  // Rows: one per decoding sequence, then each chunk's in order (the decode rows stay one
  // batched attention launch on the GPU; a long chunk gets its own).
  std::vector<int32_t> ids(tokens.begin(), tokens.end());
  std::vector<int32_t> out(B);
  for (int64_t i = 0; i < B; ++i) out[i] = static_cast<int32_t>(i);
  for (const ChunkRef& c : chunks) {
    const int b = c.seq->computed, n = c.end - b;
    const int64_t first = static_cast<int64_t>(br.pos.size());
    ids.insert(ids.end(), c.seq->tokens.begin() + b, c.seq->tokens.begin() + c.end);
    br.ctx.push_back(CtxSlots(*c.seq, c.end));
    for (int i = 0; i < n; ++i) {
      br.pos.push_back(b + i);
      br.slots.push_back(br.ctx.back()[b + i]);
    }
    br.groups.push_back({first, first + n, {}});
    if (c.end == static_cast<int>(c.seq->tokens.size())) {
      out.push_back(static_cast<int32_t>(first + n - 1));
    }
  }
  // The contexts' spans point into br.ctx, which grew: set them once it is final.
  for (size_t g = 0; g < br.groups.size(); ++g) br.groups[g].ctx_slots = br.ctx[g];
  LayerRows rows{br.pos, br.slots, {}, br.groups};
  ASSIGN_OR_RETURN(ModelRunner::HeadOut h,
                   runner_->ForwardHead(ids, rows, out, false, decode_draws));
  const std::vector<float>& lg = h.logits;
  MixedStep r;
  // lg: the undrawn decode rows' logits, then the completed chunks'.
  r.decode_drawn = std::move(h.drawn);
  r.decode = TakeDecodeLogits(seqs.subspan(K), tokens.subspan(K), lg);
  AppendTokens(seqs.first(K), tokens.first(K));
  int64_t next = B - K;  // the next output row (in lg) of a completed chunk
  const int64_t V = model_->config().vocab_size;
  r.prefill.resize(chunks.size());
  for (size_t j = 0; j < chunks.size(); ++j) {
    Sequence& pf = *chunks[j].seq;
    pf.computed = chunks[j].end;
    if (pf.computed < static_cast<int>(pf.tokens.size())) continue;
    r.prefill[j].assign(lg.begin() + next * V, lg.begin() + (next + 1) * V);
    ++next;
  }
  return r;
}

void Engine::RegisterPrefix(const Sequence& seq, int exact_upto, bool approximate_rest) {
  const int bs = blocks_->block_size();
  const int upto = exact_upto < 0 ? seq.computed : std::min(exact_upto, seq.computed);
  const int exact_full = upto / bs;
  const int full = approximate_rest ? seq.computed / bs : exact_full;
  std::span<const int32_t> toks(seq.tokens.data(), static_cast<size_t>(full) * bs);
  std::vector<Hash128> hashes =
      blocks_->BlockHashes(toks, approximate_rest ? exact_full : -1, seq.scope);
  for (int i = 0; i < full; ++i) blocks_->Register(seq.blocks[i], hashes[i]);
}

void Engine::Release(Sequence& seq) {
  blocks_->ReleaseAll(seq.blocks);
  seq.blocks.clear();
  seq.computed = 0;
}

}  // namespace sparsex
