#include "gpu_worker/engine/engine_group.h"

#include <algorithm>
#include <condition_variable>
#include <iostream>
#include <mutex>
#include <thread>
#include <type_traits>

#include "common/logits.h"
#include "common/thread_pool.h"
#if SPARSEX_WITH_CUDA && SPARSEX_WITH_NCCL
#include "gpu_worker/engine/nccl_communicator.h"
#endif

namespace sparsex {

struct EngineGroup::Rank {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ReuseEngine> reuse;
  SegmentStore* store = nullptr;
  // Ranks >= 1: the persistent thread and its one-job mailbox.
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  const std::function<void(int)>* job = nullptr;
  bool done = false, stop = false;
};

Engine& EngineGroup::engine() { return *ranks_[0]->engine; }
ReuseEngine& EngineGroup::reuse() { return *ranks_[0]->reuse; }
bool EngineGroup::has_reuse() const { return ranks_[0]->reuse != nullptr; }
SegmentStore* EngineGroup::store(int rank) { return ranks_[rank]->store; }

absl::Status ValidateTensorParallel(const ModelConfig& c, int tp) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp must be >= 1, got ", tp));
  if (c.n_heads % tp || c.n_kv_heads % tp || c.ffn_dim % tp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tp ", tp, " must divide the model's attention heads (", c.n_heads, "), KV heads (",
        c.n_kv_heads, ") and FFN width (", c.ffn_dim, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<EngineGroup>> EngineGroup::Create(const Model& model,
                                                                  const EngineOptions& opts,
                                                                  std::vector<SegmentStore*> stores,
                                                                  const ReuseOptions& reuse,
                                                                  size_t device_tier_bytes,
                                                                  size_t host_tier_bytes) {
  const int n = opts.tp.size;
  RETURN_IF_ERROR(ValidateTensorParallel(model.config(), n));
  if (!stores.empty() && static_cast<int>(stores.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("engine group: ", stores.size(),
                                                   " segment stores for ", n, " ranks"));
  }
  for (SegmentStore* s : stores) {
    if (s == nullptr) return absl::InvalidArgumentError("engine group: null segment store");
  }
  std::unique_ptr<EngineGroup> g(new EngineGroup());
  if (n > 1) {
    if (opts.backend.kind == "cuda") {
#if SPARSEX_WITH_CUDA && SPARSEX_WITH_NCCL
      std::vector<int> devices(n);
      for (int r = 0; r < n; ++r) devices[r] = opts.backend.device + r;
      ASSIGN_OR_RETURN(g->comms_, CreateNcclGroup(devices));
#else
      return absl::UnimplementedError(
          "tensor parallelism on cuda needs a build with -DSPARSEX_WITH_NCCL=ON");
#endif
    } else {
      g->comms_ = CreateInProcessGroup(n);
    }
  }
  for (int r = 0; r < n; ++r) {
    g->ranks_.push_back(std::make_unique<Rank>());
    if (!stores.empty()) g->ranks_[r]->store = stores[r];
  }
  for (int r = 1; r < n; ++r) {
    EngineGroup* self = g.get();
    g->ranks_[r]->thread = std::thread([self, r] { self->WorkerLoop(r); });
  }
  // Each engine is made on its rank's thread: a CUDA backend makes its device current there.
  std::vector<absl::Status> st(n);
  g->RunOnAll([&](int r) {
    EngineOptions o = opts;
    if (n > 1) {
      o.tp = {.rank = r, .size = n, .comm = g->comms_[r].get()};
      if (o.backend.kind == "cuda") o.backend.device = opts.backend.device + r;
    } else {
      o.tp = {};
    }
    auto e = Engine::Create(model, o);
    if (!e.ok()) {
      st[r] = e.status();
      return;
    }
    Rank& k = *g->ranks_[r];
    k.engine = std::move(*e);
    if (k.store != nullptr) {
      // Streamed fetches go to rank 0 without tensor parallelism only (OpenStreamed).
      ReuseOptions ro = reuse;
      if (n > 1) ro.stream_pinned_bytes = 0;
      k.reuse = std::make_unique<ReuseEngine>(k.engine.get(), k.store, std::move(ro),
                                              device_tier_bytes, host_tier_bytes);
    }
  });
  for (int r = 0; r < n; ++r) {
    if (!st[r].ok()) {
      return absl::Status(st[r].code(), absl::StrCat(n > 1 ? absl::StrCat("rank ", r, ": ") : "",
                                                     st[r].message()));
    }
  }
  return g;
}

EngineGroup::~EngineGroup() {
  if (ranks_.empty()) return;  // Create failed before any rank existed
  RunOnAll([this](int r) {
    ranks_[r]->reuse.reset();
    ranks_[r]->engine.reset();
  });
  for (size_t r = 1; r < ranks_.size(); ++r) {
    Rank& k = *ranks_[r];
    {
      std::lock_guard<std::mutex> l(k.mu);
      k.stop = true;
    }
    k.cv.notify_all();
    if (k.thread.joinable()) k.thread.join();
  }
  comms_.clear();  // after the engines, whose runners hold the communicators
}

void EngineGroup::WorkerLoop(int r) {
  Rank& k = *ranks_[r];
  std::unique_lock<std::mutex> l(k.mu);
  for (;;) {
    k.cv.wait(l, [&] { return k.stop || k.job != nullptr; });
    if (k.job == nullptr) return;  // stop
    const std::function<void(int)>* job = k.job;
    l.unlock();
    (*job)(r);
    l.lock();
    k.job = nullptr;
    k.done = true;
    k.cv.notify_all();
  }
}

void EngineGroup::RunOnAll(const std::function<void(int)>& fn) {
  const int n = size();
  for (int r = 1; r < n; ++r) {
    Rank& k = *ranks_[r];
    {
      std::lock_guard<std::mutex> l(k.mu);
      k.job = &fn;
      k.done = false;
    }
    k.cv.notify_all();
  }
  fn(0);
  for (int r = 1; r < n; ++r) {
    Rank& k = *ranks_[r];
    std::unique_lock<std::mutex> l(k.mu);
    k.cv.wait(l, [&] { return k.done; });
  }
}

namespace {

// OK when every rank's outcome matches rank 0's (same(r)); else INTERNAL naming the first rank
// that differs and what the ranks were doing.
absl::Status AllAlike(int n, const std::function<bool(int)>& same, const char* what) {
  for (int r = 1; r < n; ++r) {
    if (!same(r)) {
      return absl::InternalError(absl::StrCat("tensor-parallel rank ", r, " diverged ", what));
    }
  }
  return absl::OkStatus();
}

// Rank r's copies of the sequences ended with rank 0's block tables and computed counts.
bool SameSeqs(const std::vector<Sequence>& copies, std::span<Sequence* const> seqs) {
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (copies[i].blocks != seqs[i]->blocks || copies[i].computed != seqs[i]->computed) {
      return false;
    }
  }
  return true;
}

// Same status code on rank r as on rank 0.
template <typename T>
bool SameCode(const std::vector<T>& res, int r) {
  if constexpr (std::is_same_v<T, absl::Status>) {
    return res[r].code() == res[0].code();
  } else {
    return res[r].status().code() == res[0].status().code();
  }
}

}  // namespace

absl::Status EngineGroup::Lockstep(Sequence& seq,
                                   const std::function<absl::Status(int, Sequence&)>& fn) {
  const int n = size();
  std::vector<Sequence> copies(n);
  for (int r = 1; r < n; ++r) copies[r] = seq;  // before rank 0 starts changing seq
  std::vector<absl::Status> st(n);
  RunOnAll([&](int r) { st[r] = fn(r, r == 0 ? seq : copies[r]); });
  for (int r = 1; r < n; ++r) {
    if (st[r].code() != st[0].code()) {
      return absl::InternalError(absl::StrCat("tensor-parallel rank ", r, " diverged: rank 0 ",
                                              st[0].ToString(), ", rank ", r, " ",
                                              st[r].ToString()));
    }
    if (copies[r].blocks != seq.blocks || copies[r].computed != seq.computed) {
      return absl::InternalError(
          absl::StrCat("tensor-parallel rank ", r, " diverged: different KV block table"));
    }
  }
  return st[0];
}

void EngineGroup::CheckLogits(const std::vector<std::vector<float>>& logits) {
  auto argmax = [](const std::vector<float>& v) {
    return std::max_element(v.begin(), v.end()) - v.begin();
  };
  const auto a0 = argmax(logits[0]);
  for (size_t r = 1; r < logits.size(); ++r) {
    if (logits[r].size() == logits[0].size() && argmax(logits[r]) == a0) continue;
    // Harmless for the output (every rank continues with the token sampled from rank 0's
    // logits) but a sign that the ranks do not compute alike: say so once.
    if (divergences_.fetch_add(1) == 0) {
      std::cerr << "warning: tensor-parallel rank " << r
                << " logits disagree with rank 0 on the greedy token" << std::endl;
    }
  }
}

absl::StatusOr<Sequence> EngineGroup::Admit(std::vector<int32_t> prompt, const Hash128& scope) {
  if (size() == 1) return ranks_[0]->engine->Admit(std::move(prompt), false, scope);
  const int n = size();
  std::vector<absl::StatusOr<Sequence>> res(n, absl::UnknownError(""));
  RunOnAll([&](int r) { res[r] = ranks_[r]->engine->Admit(prompt, false, scope); });
  RETURN_IF_ERROR(AllAlike(n, [&](int r) {
    return SameCode(res, r) && (!res[0].ok() || (res[r]->blocks == res[0]->blocks &&
                                                 res[r]->computed == res[0]->computed));
  }, "at admission"));
  return std::move(res[0]);
}

absl::StatusOr<std::vector<float>> EngineGroup::Prefill(Sequence& seq) {
  if (size() == 1) return ranks_[0]->engine->Prefill(seq);
  std::vector<std::vector<float>> lg(size());
  RETURN_IF_ERROR(Lockstep(seq, [&](int r, Sequence& s) -> absl::Status {
    ASSIGN_OR_RETURN(lg[r], ranks_[r]->engine->Prefill(s));
    return absl::OkStatus();
  }));
  CheckLogits(lg);
  return std::move(lg[0]);
}

absl::StatusOr<std::vector<float>> EngineGroup::Step(Sequence& seq, int32_t token) {
  if (size() == 1) return ranks_[0]->engine->Step(seq, token);
  std::vector<std::vector<float>> lg(size());
  RETURN_IF_ERROR(Lockstep(seq, [&](int r, Sequence& s) -> absl::Status {
    ASSIGN_OR_RETURN(lg[r], ranks_[r]->engine->Step(s, token));
    return absl::OkStatus();
  }));
  CheckLogits(lg);
  return std::move(lg[0]);
}

absl::StatusOr<std::vector<std::vector<float>>> EngineGroup::StepBatch(
    std::span<Sequence* const> seqs, std::span<const int32_t> tokens) {
  if (size() == 1) return ranks_[0]->engine->StepBatch(seqs, tokens);
  const int n = size();
  std::vector<std::vector<Sequence>> copies(n);
  for (int r = 1; r < n; ++r) {
    for (Sequence* s : seqs) copies[r].push_back(*s);  // before rank 0 starts changing them
  }
  using Result = absl::StatusOr<std::vector<std::vector<float>>>;
  std::vector<Result> res(n, absl::UnknownError(""));
  RunOnAll([&](int r) {
    if (r == 0) {
      res[0] = ranks_[0]->engine->StepBatch(seqs, tokens);
      return;
    }
    std::vector<Sequence*> mine;
    for (Sequence& s : copies[r]) mine.push_back(&s);
    res[r] = ranks_[r]->engine->StepBatch(mine, tokens);
  });
  RETURN_IF_ERROR(AllAlike(n, [&](int r) {
    return SameCode(res, r) && SameSeqs(copies[r], seqs);
  }, "in a batched decode step"));
  if (!res[0].ok()) return res[0].status();
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<std::vector<float>> lg(n);
    for (int r = 0; r < n; ++r) lg[r] = std::move((*res[r])[i]);
    CheckLogits(lg);
    (*res[0])[i] = std::move(lg[0]);
  }
  return std::move(res[0]);
}

namespace {
// The first draws.size() rows' tokens (DrawToken) from host logits, on the pool for a large
// vocabulary; those rows leave `logits`, the others stay.
std::vector<int32_t> TakeDrawnRows(std::vector<std::vector<float>>& logits,
                                   std::span<const RowDraw> draws) {
  std::vector<int32_t> out(draws.size());
  const int64_t vocab = logits.empty() ? 1 : static_cast<int64_t>(logits[0].size());
  ParallelForIfIdle(static_cast<int64_t>(draws.size()), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = DrawToken(logits[i], draws[i]);
  }, LogitRowsPerTask(vocab));
  logits.erase(logits.begin(), logits.begin() + static_cast<int64_t>(draws.size()));
  return out;
}
}  // namespace

absl::StatusOr<Engine::DrawnStep> EngineGroup::StepBatchDraw(
    std::span<Sequence* const> seqs, std::span<const int32_t> tokens,
    std::span<const RowDraw> draws) {
  if (size() == 1) return ranks_[0]->engine->StepBatchDraw(seqs, tokens, draws);
  if (draws.size() > seqs.size()) {
    return absl::InvalidArgumentError("StepBatchDraw: more draws than sequences");
  }
  Engine::DrawnStep r;
  ASSIGN_OR_RETURN(r.logits, StepBatch(seqs, tokens));
  r.drawn = TakeDrawnRows(r.logits, draws);
  return r;
}

absl::StatusOr<Engine::MixedStep> EngineGroup::StepWithChunks(
    std::span<Sequence* const> seqs, std::span<const int32_t> tokens,
    std::span<const Engine::ChunkRef> chunks, std::span<const RowDraw> decode_draws) {
  if (size() == 1) return ranks_[0]->engine->StepWithChunks(seqs, tokens, chunks, decode_draws);
  if (!decode_draws.empty()) {
    if (decode_draws.size() > seqs.size()) {
      return absl::InvalidArgumentError("StepWithChunks: more draws than sequences");
    }
    ASSIGN_OR_RETURN(Engine::MixedStep m, StepWithChunks(seqs, tokens, chunks));
    m.decode_drawn = TakeDrawnRows(m.decode, decode_draws);
    return m;
  }
  const int n = size();
  std::vector<std::vector<Sequence>> copies(n), pf_copies(n);
  for (int r = 1; r < n; ++r) {
    for (Sequence* s : seqs) copies[r].push_back(*s);  // before rank 0 starts changing them
    for (const Engine::ChunkRef& c : chunks) pf_copies[r].push_back(*c.seq);
  }
  std::vector<Sequence*> pfs;
  for (const Engine::ChunkRef& c : chunks) pfs.push_back(c.seq);
  std::vector<absl::StatusOr<Engine::MixedStep>> res(n, absl::UnknownError(""));
  RunOnAll([&](int r) {
    if (r == 0) {
      res[0] = ranks_[0]->engine->StepWithChunks(seqs, tokens, chunks);
      return;
    }
    std::vector<Sequence*> mine;
    for (Sequence& s : copies[r]) mine.push_back(&s);
    std::vector<Engine::ChunkRef> my_chunks;
    for (size_t j = 0; j < chunks.size(); ++j) my_chunks.push_back({&pf_copies[r][j], chunks[j].end});
    res[r] = ranks_[r]->engine->StepWithChunks(mine, tokens, my_chunks);
  });
  RETURN_IF_ERROR(AllAlike(n, [&](int r) {
    return SameCode(res, r) && SameSeqs(pf_copies[r], pfs) && SameSeqs(copies[r], seqs);
  }, "in a mixed prefill/decode step"));
  if (!res[0].ok()) return res[0].status();
  // Every rank's logits of each decode row and completed chunk against rank 0's.
  for (auto field : {&Engine::MixedStep::decode, &Engine::MixedStep::prefill}) {
    std::vector<std::vector<float>>& out = (*res[0]).*field;
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].empty()) continue;  // a chunk that did not complete its prompt
      std::vector<std::vector<float>> lg(n);
      for (int r = 0; r < n; ++r) lg[r] = std::move(((*res[r]).*field)[i]);
      CheckLogits(lg);
      out[i] = std::move(lg[0]);
    }
  }
  return std::move(res[0]);
}

void EngineGroup::RegisterPrefix(const Sequence& seq, int exact_upto, bool approximate_rest) {
  if (size() == 1) return ranks_[0]->engine->RegisterPrefix(seq, exact_upto, approximate_rest);
  RunOnAll([&](int r) {  // reads only
    ranks_[r]->engine->RegisterPrefix(seq, exact_upto, approximate_rest);
  });
}

void EngineGroup::Release(Sequence& seq) {
  if (size() == 1) return ranks_[0]->engine->Release(seq);
  (void)Lockstep(seq, [&](int r, Sequence& s) {
    ranks_[r]->engine->Release(s);
    return absl::OkStatus();
  });
}

void EngineGroup::AlignStores(std::span<const Hash128> fps) {
  // Every rank must decide hit or miss alike (a hit on one rank and a recompute on another run
  // different collectives: a hang). The stores are replicas in lockstep, so this only fires
  // after something outside the group changed one of them, e.g. a block corrupted on one rank
  // (Verify checks the checksums now, so the reuse prefill's own check cannot split the ranks).
  for (const Hash128& fp : fps) {
    const bool first = ranks_[0]->store->Verify(fp);
    bool same = true;
    for (int r = 1; r < size(); ++r) same = ranks_[r]->store->Verify(fp) == first && same;
    if (same) continue;
    for (int r = 0; r < size(); ++r) ranks_[r]->store->Erase(fp);
    std::cerr << "warning: tensor-parallel segment stores disagreed on segment " << fp.Hex()
              << "; dropped it on every rank" << std::endl;
  }
}

absl::StatusOr<ReusePrefillResult> EngineGroup::ReusePrefill(
    const std::vector<PromptSegment>& segments, bool add_bos, const ReuseOptions* override_opts) {
  if (!has_reuse()) return absl::FailedPreconditionError("engine group has no segment stores");
  if (size() == 1) return ranks_[0]->reuse->Prefill(segments, add_bos, override_opts);
  RETURN_IF_ERROR(BeginReusePrefill(segments, add_bos, override_opts));
  for (;;) {
    ASSIGN_OR_RETURN(std::optional<ReusePrefillResult> r, ReusePrefillStep(INT64_MAX));
    if (r) return std::move(*r);
  }
}

absl::Status EngineGroup::BeginReusePrefill(const std::vector<PromptSegment>& segments,
                                            bool add_bos, const ReuseOptions* override_opts) {
  if (!has_reuse()) return absl::FailedPreconditionError("engine group has no segment stores");
  if (size() == 1) return ranks_[0]->reuse->BeginPrefill(segments, add_bos, override_opts);
  const int n = size();
  const ReuseOptions& o = override_opts ? *override_opts : ranks_[0]->reuse->options();
  if (o.enable_reuse) {
    std::vector<Hash128> fps;
    for (const PromptSegment& s : segments) {
      if (s.cacheable && !s.tokens.empty()) {
        fps.push_back(ranks_[0]->reuse->Fingerprint(s.tokens, o.encoding, s.scope));
      }
    }
    AlignStores(fps);
  }
  std::vector<absl::Status> st(n);
  RunOnAll([&](int r) { st[r] = ranks_[r]->reuse->BeginPrefill(segments, add_bos, override_opts); });
  absl::Status alike = AllAlike(n, [&](int r) { return SameCode(st, r); },
                                "starting a reuse prefill");
  if (!alike.ok()) AbortReusePrefill();
  RETURN_IF_ERROR(alike);
  return st[0];
}

absl::StatusOr<std::optional<ReusePrefillResult>> EngineGroup::ReusePrefillStep(
    int64_t max_row_layers) {
  if (!has_reuse()) return absl::FailedPreconditionError("engine group has no segment stores");
  if (size() == 1) return ranks_[0]->reuse->PrefillStep(max_row_layers);
  const int n = size();
  std::vector<absl::StatusOr<std::optional<ReusePrefillResult>>> res(n, absl::UnknownError(""));
  RunOnAll([&](int r) { res[r] = ranks_[r]->reuse->PrefillStep(max_row_layers); });
  absl::Status alike = AllAlike(n, [&](int r) {
    if (!SameCode(res, r)) return false;
    if (!res[0].ok()) return true;
    if (res[r]->has_value() != res[0]->has_value()) return false;
    if (!res[0]->has_value()) return true;
    const ReusePrefillResult &a = **res[0], &b = **res[r];
    return a.seq.blocks == b.seq.blocks && a.seq.computed == b.seq.computed &&
           a.stats.segments_hit == b.stats.segments_hit &&
           a.stats.reused_tokens == b.stats.reused_tokens &&
           a.stats.selected_tokens == b.stats.selected_tokens &&
           a.stats.computed_token_layers == b.stats.computed_token_layers;
  }, "in the reuse prefill");
  if (!alike.ok()) AbortReusePrefill();
  RETURN_IF_ERROR(alike);
  if (!res[0].ok() || !res[0]->has_value()) return std::move(res[0]);
  std::vector<std::vector<float>> lg(n);
  for (int r = 0; r < n; ++r) lg[r] = std::move((*res[r])->logits);
  CheckLogits(lg);
  (*res[0])->logits = std::move(lg[0]);
  return std::move(res[0]);
}

void EngineGroup::AbortReusePrefill() {
  if (!has_reuse()) return;
  RunOnAll([&](int r) { ranks_[r]->reuse->AbortPrefill(); });
}

absl::Status EngineGroup::EnsureStored(const std::vector<int32_t>& tokens,
                                       const ReuseOptions* override_opts) {
  if (!has_reuse()) return absl::FailedPreconditionError("engine group has no segment stores");
  if (size() == 1) return ranks_[0]->reuse->EnsureStored(tokens, override_opts);
  const int n = size();
  const ReuseOptions& o = override_opts ? *override_opts : ranks_[0]->reuse->options();
  const Hash128 fp = ranks_[0]->reuse->Fingerprint(tokens, o.encoding, o.scope);
  AlignStores({&fp, 1});
  std::vector<absl::Status> st(n);
  RunOnAll([&](int r) { st[r] = ranks_[r]->reuse->EnsureStored(tokens, override_opts); });
  RETURN_IF_ERROR(AllAlike(n, [&](int r) { return SameCode(st, r); }, "storing a segment"));
  return st[0];
}

absl::StatusOr<StoreProgress> EngineGroup::StoreStep(const std::vector<int32_t>& tokens,
                                                     const ReuseOptions* override_opts,
                                                     int max_layers) {
  if (!has_reuse()) return absl::FailedPreconditionError("engine group has no segment stores");
  if (size() == 1) return ranks_[0]->reuse->StoreStep(tokens, override_opts, max_layers);
  std::vector<absl::StatusOr<StoreProgress>> res(size(), StoreProgress::kHeld);
  RunOnAll([&](int r) { res[r] = ranks_[r]->reuse->StoreStep(tokens, override_opts, max_layers); });
  RETURN_IF_ERROR(AllAlike(size(), [&](int r) {
    return SameCode(res, r) && (!res[r].ok() || *res[r] == *res[0]);
  }, "storing a segment"));
  return res[0];
}

absl::StatusOr<std::optional<std::pair<Hash128, int>>> EngineGroup::SpillOne(int max_layers) {
  if (!has_reuse()) return std::optional<std::pair<Hash128, int>>();
  if (size() == 1) return ranks_[0]->reuse->SpillOne(max_layers);
  std::vector<absl::StatusOr<std::optional<std::pair<Hash128, int>>>> res(size());
  RunOnAll([&](int r) { res[r] = ranks_[r]->reuse->SpillOne(max_layers); });
  RETURN_IF_ERROR(AllAlike(size(), [&](int r) { return SameCode(res, r); }, "spilling a segment"));
  return std::move(res[0]);
}

bool EngineGroup::Holds(const Hash128& fp) const {
  return has_reuse() && ranks_[0]->reuse->Holds(fp);
}

bool EngineGroup::TakesFetched() const {
  return ranks_.size() == 1 && has_reuse() && ranks_[0]->reuse->TakesFetched();
}

bool EngineGroup::OfferFetched(const Hash128& fp, SegmentKvBf16 kv) {
  if (!TakesFetched()) return false;
  ranks_[0]->reuse->OfferFetched(fp, std::move(kv));
  return true;
}

std::shared_ptr<StreamedSegment> EngineGroup::OpenStreamed(const Hash128& fp, int n_tokens) {
  if (!TakesFetched()) return nullptr;
  std::shared_ptr<StreamedSegment> seg = ranks_[0]->reuse->NewStreamedSegment(n_tokens);
  ranks_[0]->reuse->OfferStreamed(fp, seg);
  return seg;
}

int EngineGroup::AdoptFetched(int max_segments) {
  return TakesFetched() ? ranks_[0]->reuse->AdoptFetched(max_segments) : 0;
}

bool EngineGroup::HasFetched() const { return TakesFetched() && ranks_[0]->reuse->HasFetched(); }

size_t EngineGroup::unspilled() { return has_reuse() ? ranks_[0]->reuse->unspilled() : 0; }

size_t EngineGroup::device_tier_bytes() {
  size_t bytes = 0;
  if (!has_reuse()) return 0;
  for (auto& r : ranks_) bytes += r->reuse->device_tier().bytes();
  return bytes;
}

}  // namespace sparsex
