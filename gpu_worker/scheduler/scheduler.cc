#include "gpu_worker/scheduler/scheduler.h"

#include <algorithm>
#include <future>

#include "common/thread_pool.h"

namespace sparsex::service {
namespace {

using Clock = std::chrono::steady_clock;

double MsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

// ---- RequestHandle ----

bool RequestHandle::Wait(std::vector<StreamChunk>* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  if (!cv_.wait_for(l, timeout, [this] { return !q_.empty(); })) return false;
  while (!q_.empty()) {
    out->push_back(std::move(q_.front()));
    q_.pop_front();
  }
  return true;
}

void RequestHandle::Push(StreamChunk c) {
  {
    std::lock_guard<std::mutex> l(mu_);
    q_.push_back(std::move(c));
  }
  cv_.notify_all();
}

// ---- one request inside the scheduler ----

struct BatchScheduler::Active {
  enum class State { kQueued, kPrefill, kDecode, kDone };
  std::shared_ptr<RequestHandle> h;
  WorkItem w;
  State state = State::kQueued;
  bool plain = false;             // reuse disabled: chunked dense prefill
  bool reuse_running = false;     // its reuse prefill is in progress in the engines (sliced)
  std::vector<int32_t> prompt;    // plain: the whole prompt
  Sequence seq;
  bool has_seq = false;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamDecoder> dec;
  std::vector<int32_t> stops;
  int32_t last = -1;
  int generated = 0;
  int reserve = 0;
  RequestUsage usage;
  Clock::time_point t_last;
  bool first_done = false;
  int exact_tokens = 0;  // reuse: leading prompt tokens whose KV is exact
  TokenLogprobs logprobs;  // of the token being emitted (WorkItem::logprobs >= 0)
};

BatchScheduler::BatchScheduler(const Model& model, std::vector<SegmentStore*> stores,
                               const SchedulerOptions& o, SchedulerHooks hooks)
    : model_(model), stores_(std::move(stores)), opts_(o), hooks_(std::move(hooks)),
      gate_(o.gate),
      budget_(IterationBudgetOptions{.target_ms = o.tpot_target_ms}) {
  store_ = stores_[0];
  block_size_ = o.engine.kv.block_size;
  max_len_ = model.config().max_seq_len;
}

absl::StatusOr<std::unique_ptr<BatchScheduler>> BatchScheduler::Start(
    const Model& model, SegmentStore* store, const SchedulerOptions& options,
    SchedulerHooks hooks) {
  return Start(model, std::vector<SegmentStore*>{store}, options, std::move(hooks));
}

absl::StatusOr<std::unique_ptr<BatchScheduler>> BatchScheduler::Start(
    const Model& model, std::vector<SegmentStore*> stores, const SchedulerOptions& options,
    SchedulerHooks hooks) {
  RETURN_IF_ERROR(ValidateTensorParallel(model.config(), options.engine.tp.size));
  if (static_cast<int>(stores.size()) != options.engine.tp.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("scheduler: ", stores.size(), " segment stores for --tp ",
                     options.engine.tp.size, " (one per tensor-parallel rank)"));
  }
  for (SegmentStore* st : stores) {
    if (st == nullptr) return absl::InvalidArgumentError("scheduler: null segment store");
  }
  if (!(options.tpot_target_ms >= 0 && options.tpot_target_ms <= 1e6)) {
    return absl::InvalidArgumentError("scheduler: tpot_target_ms must be in [0, 1e6]");
  }
  if (options.reuse_slice_tokens < -1) {
    return absl::InvalidArgumentError("scheduler: reuse_slice_tokens must be >= -1");
  }
  if (options.max_running < 1 || options.max_queue < 0 || options.prefill_chunk < 1) {
    return absl::InvalidArgumentError(
        "scheduler: max_running and prefill_chunk must be >= 1, max_queue >= 0");
  }
  RETURN_IF_ERROR(ValidateReuseOptions(options.reuse, model.config().n_layers));
  std::unique_ptr<BatchScheduler> s(
      new BatchScheduler(model, std::move(stores), options, std::move(hooks)));
  std::promise<absl::Status> ready;
  std::future<absl::Status> f = ready.get_future();
  BatchScheduler* self = s.get();
  s->thread_ = std::thread([self, &ready] { self->Loop(&ready); });
  absl::Status st = f.get();
  if (!st.ok()) {
    s->thread_.join();
    return st;
  }
  for (int i = 0; i < std::max(1, options.fetch_threads); ++i) {
    s->fetchers_.emplace_back([self] { self->FetchLoop(); });
  }
  return s;
}

void BatchScheduler::FetchLoop() {
  for (;;) {
    std::shared_ptr<FetchJob> job;
    {
      std::unique_lock<std::mutex> l(mu_);
      fetch_cv_.wait(l, [this] { return fetch_stop_ || !fetch_jobs_.empty(); });
      if (fetch_stop_) return;
      job = std::move(fetch_jobs_.front());
      fetch_jobs_.pop_front();
    }
    // A request cancelled while it waited skips the fetch. One admitted meanwhile (its wait
    // ended) still gets its segments fetched into the store, for the requests after it.
    FetchJob* j = job.get();
    job->item.fetch_started = [this, j] {
      j->started.store(true);
      cv_.notify_all();
    };
    if (!job->h->cancelled()) job->item.remote_fetch(job->item);
    job->done.store(true);
    cv_.notify_all();
  }
}

void BatchScheduler::ReleaseFetchedLocked(bool all) {
  const Clock::time_point now = Clock::now();
  for (auto it = fetch_wait_.begin(); it != fetch_wait_.end();) {
    const bool done = it->job->done.load();
    const bool started = !done && it->job->started.load();  // streaming: counts already set
    if (!all && !done && !started && now < it->deadline && !it->a->h->cancelled()) {
      ++it;
      continue;
    }
    if (done || started) {
      it->a->w.segments_fetched = it->job->item.segments_fetched;
      it->a->w.fetch_failures = started ? 0 : it->job->item.fetch_failures;
    } else if (!all && !it->a->h->cancelled()) {
      ++fetch_timeouts_;  // admitted without its fetch: the missing segments are computed
    }
    queue_.push_back(std::move(it->a));
    it = fetch_wait_.erase(it);
  }
}

BatchScheduler::~BatchScheduler() { Stop(); }

void BatchScheduler::Stop() {
  // Fetch threads first (each finishes the fetch in hand), so that every request ends up in
  // queue_, which the engine thread fails on its way out.
  {
    std::lock_guard<std::mutex> l(mu_);
    fetch_stop_ = true;
  }
  fetch_cv_.notify_all();
  for (std::thread& t : fetchers_) {
    if (t.joinable()) t.join();
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    ReleaseFetchedLocked(/*all=*/true);
    fetch_jobs_.clear();
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int BatchScheduler::BlocksNeeded(const WorkItem& w) const {
  int prompt = (w.add_bos && model_.tokenizer().bos_id() >= 0) ? 1 : 0;
  int longest = 0;
  for (const auto& s : w.segments) {
    prompt += static_cast<int>(s.tokens.size());
    if (s.cacheable) longest = std::max(longest, static_cast<int>(s.tokens.size()));
  }
  const int gen = std::max(0, std::min(w.sampling.max_tokens, max_len_ - prompt));
  const int bs = block_size_;
  int blocks = (prompt + gen + bs - 1) / bs;
  if (w.reuse.enable_reuse && w.reuse.store_new_segments && longest > 0) {
    blocks += (longest + bs - 1) / bs + 1;  // encoding a missing segment (+ its context)
  }
  return blocks;
}

absl::Status BatchScheduler::Validate(const WorkItem& w) const {
  const ModelConfig& c = model_.config();
  int n = (w.add_bos && model_.tokenizer().bos_id() >= 0) ? 1 : 0;
  for (const auto& s : w.segments) {
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " outside the vocabulary of ", c.vocab_size));
      }
    }
    n += static_cast<int>(s.tokens.size());
  }
  if (n == 0) return absl::InvalidArgumentError("empty prompt");
  if (n > max_len_) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", n,
                                                   " tokens exceeds the context length of ",
                                                   max_len_));
  }
  RETURN_IF_ERROR(ValidateSampling(w.sampling));
  for (const auto& [id, bias] : w.sampling.logit_bias) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias: token id ", id,
                                                     " outside the vocabulary of ", c.vocab_size));
    }
  }
  if (w.sampling.max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  RETURN_IF_ERROR(ValidateReuseOptions(w.reuse, c.n_layers));
  const int need = BlocksNeeded(w);
  if (need > opts_.engine.kv.num_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("request needs ", need,
                                                   " KV blocks; this worker has ",
                                                   opts_.engine.kv.num_blocks));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<RequestHandle>> BatchScheduler::Submit(WorkItem work) {
  RETURN_IF_ERROR(Validate(work));
  auto a = std::make_unique<Active>();
  a->h = std::make_shared<RequestHandle>();
  a->h->id_ = work.id;
  a->reserve = BlocksNeeded(work);
  a->w = std::move(work);
  std::shared_ptr<RequestHandle> h = a->h;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return absl::UnavailableError("worker is stopping");
    const size_t waiting = queue_.size() + fetch_wait_.size();
    if (static_cast<int>(waiting) >= opts_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("worker queue full (", opts_.max_queue, " waiting requests)"));
    }
    if (a->w.remote_fetch && !fetch_stop_) {
      auto job = std::make_shared<FetchJob>();
      job->item = a->w;  // the fetch fills the copy's counts
      job->h = a->h;
      const Clock::time_point deadline =
          opts_.fetch_wait_ms < 0
              ? Clock::time_point::max()
              : a->w.arrival + std::chrono::milliseconds(opts_.fetch_wait_ms);
      fetch_jobs_.push_back(job);
      fetch_wait_.push_back({std::move(a), std::move(job), deadline});
      PublishWaitingLocked();
      fetch_cv_.notify_one();
      cv_.notify_all();  // the engine thread sleeps until the earliest fetch deadline
      return h;
    }
    queue_.push_back(std::move(a));
    PublishWaitingLocked();
  }
  cv_.notify_all();
  return h;
}

int64_t BatchScheduler::ReuseSliceRows() const {
  // About the work of a plain chunk: reuse_slice_tokens (0: prefill_chunk) through every layer.
  if (opts_.reuse_slice_tokens < 0) return INT64_MAX;
  const int64_t tokens =
      opts_.reuse_slice_tokens > 0 ? opts_.reuse_slice_tokens : opts_.prefill_chunk;
  return tokens * model_.config().n_layers;
}

bool BatchScheduler::HoldsLocally(const Hash128& fp) const {
  // group_ is set before Start returns and taken away under mu_ when the engine thread ends.
  std::lock_guard<std::mutex> l(mu_);
  return group_ != nullptr && group_->Holds(fp);
}

bool BatchScheduler::OfferFetched(const Hash128& fp, SegmentKvBf16 kv) {
  bool taken = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    taken = group_ != nullptr && group_->OfferFetched(fp, std::move(kv));
  }
  if (taken) cv_.notify_all();  // the engine thread uploads it at its next iteration
  return taken;
}

std::shared_ptr<StreamedSegment> BatchScheduler::OpenStreamed(const Hash128& fp, int n_tokens) {
  std::lock_guard<std::mutex> l(mu_);
  return group_ != nullptr ? group_->OpenStreamed(fp, n_tokens) : nullptr;
}

bool BatchScheduler::TakesFetched() const {
  std::lock_guard<std::mutex> l(mu_);
  return group_ != nullptr && group_->TakesFetched();
}

SchedulerLoad BatchScheduler::load() const {
  std::lock_guard<std::mutex> l(mu_);
  return load_;
}

void BatchScheduler::Loop(std::promise<absl::Status>* ready) {
  {
    // tp = 1: one engine on this thread, as before; tp > 1: rank 0 here, the others on the
    // group's threads, all in lockstep.
    auto g = EngineGroup::Create(model_, opts_.engine, stores_, opts_.reuse,
                                 opts_.device_tier_bytes, opts_.host_tier_bytes);
    if (!g.ok()) {
      ready->set_value(g.status());
      return;
    }
    group_ = std::move(*g);
    block_size_ = group_->engine().blocks().block_size();
    if (hooks_.on_block_event) {
      // Rank 0's block manager speaks for the group: every rank caches the same blocks.
      auto hook = hooks_.on_block_event;
      const int bs = block_size_;
      group_->engine().blocks().SetEventHook(
          [hook, bs](const Hash128& h, bool stored) { hook(h, bs, stored); });
    }
    PublishLoad();
    ready->set_value(absl::OkStatus());  // `ready` dies with Start's frame: not used again
  }
  for (;;) {
    {
      std::unique_lock<std::mutex> l(mu_);
      // A new waiting request also wakes the thread: its deadline may be the earliest.
      const size_t waiting = fetch_wait_.size();
      auto ready = [this, waiting] {
        bool fetched = false;
        for (const auto& w : fetch_wait_) {
          fetched = fetched || w.job->done.load() || w.job->started.load();
        }
        return stop_ || !queue_.empty() || !active_.empty() || !pending_stores_.empty() ||
               fetched || fetch_wait_.size() > waiting || group_->HasFetched() ||
               // Idle-time work waits while a request waits for its fetch (see Iteration).
               ((group_->unspilled() > 0 || !gate_queue_.empty()) && fetch_wait_.empty());
      };
      // A request waiting for its fetch is admitted at its deadline at the latest.
      Clock::time_point wake = Clock::time_point::max();
      for (const auto& w : fetch_wait_) wake = std::min(wake, w.deadline);
      if (wake == Clock::time_point::max()) {
        cv_.wait(l, ready);
      } else {
        cv_.wait_until(l, wake, ready);
      }
      if (stop_) break;
    }
    Iteration();
    PublishLoad();
  }
  // Shutting down: fail everything still here.
  std::deque<std::unique_ptr<Active>> rest;
  {
    std::lock_guard<std::mutex> l(mu_);
    rest.swap(queue_);
  }
  for (auto& a : active_) Finish(*a, "", absl::UnavailableError("worker stopped"));
  for (auto& a : rest) Finish(*a, "", absl::UnavailableError("worker stopped"));
  active_.clear();
  PublishLoad();
  std::unique_ptr<EngineGroup> group;
  {
    std::lock_guard<std::mutex> l(mu_);  // HoldsLocally reads group_ under mu_
    group = std::move(group_);
  }
  group.reset();
}

void BatchScheduler::Iteration() {
  // Engine time per phase (SchedulerLoad::phase_seconds): where the time goes at saturation.
  Clock::time_point mark = Clock::now();
  auto charge = [&](EnginePhase p) {
    const Clock::time_point now = Clock::now();
    const double s = std::chrono::duration<double>(now - mark).count();
    phase_seconds_[static_cast<int>(p)] += s;
    double& longest = phase_longest_[static_cast<int>(p)];
    longest = std::max(longest, s);
    mark = now;
  };
  // 0. One segment a cluster fetch delivered goes into the tier (an upload: ~50 ms for a
  // 4000-token segment of an 8B model on the H200), so a fetch's segments upload one per
  // iteration while the rest transfer, instead of all at the prefill that needs them.
  if (group_->AdoptFetched(1) > 0) charge(EnginePhase::kStore);
  // 1. Cancelled requests free their KV now.
  for (auto& a : active_) {
    if (a->state != Active::State::kDone && a->h->cancelled()) Finish(*a, "cancelled");
  }
  std::erase_if(active_, [](const auto& a) { return a->state == Active::State::kDone; });

  // 2. Admission: FIFO, bounded by max_running and the KV reservation.
  const int total_blocks = group_->engine().blocks().num_blocks();
  std::vector<std::unique_ptr<Active>> admitted, dropped;
  {
    std::lock_guard<std::mutex> l(mu_);
    ReleaseFetchedLocked(/*all=*/false);
    while (!queue_.empty() &&
           static_cast<int>(active_.size() + admitted.size()) < opts_.max_running) {
      Active& a = *queue_.front();
      if (a.h->cancelled()) {
        dropped.push_back(std::move(queue_.front()));
        queue_.pop_front();
        continue;
      }
      if (reserved_blocks_ + a.reserve > total_blocks && !(active_.empty() && admitted.empty())) {
        break;
      }
      reserved_blocks_ += a.reserve;
      admitted.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
  }
  for (auto& a : dropped) Finish(*a, "cancelled");
  if (gate_running_ && !(active_.empty() && admitted.empty())) GatePreempt();
  const Tokenizer& tok = model_.tokenizer();
  for (auto& a : admitted) {
    gate_.Apply(a->w.reuse, model_.config().n_layers);  // its step, or reuse off
    const Clock::time_point now = Clock::now();
    a->usage.queue_ms = MsBetween(a->w.arrival, now);
    a->usage.segments_fetched = a->w.segments_fetched;
    a->usage.fetch_failures = a->w.fetch_failures;
    a->state = Active::State::kPrefill;
    a->plain = !a->w.reuse.enable_reuse;
    if (a->plain) {
      if (a->w.add_bos && tok.bos_id() >= 0) a->prompt.push_back(tok.bos_id());
      for (const auto& s : a->w.segments) {
        a->prompt.insert(a->prompt.end(), s.tokens.begin(), s.tokens.end());
      }
    }
    a->sampler = std::make_unique<Sampler>(a->w.sampling);
    a->dec = std::make_unique<StreamDecoder>(tok);
    a->stops = a->w.sampling.stop_ids;
    if (!a->w.sampling.ignore_eos) {
      for (int32_t s : tok.StopIds()) a->stops.push_back(s);
      if (tok.bos_id() >= 0) a->stops.push_back(tok.bos_id());  // a new document starts
    }
    active_.push_back(std::move(a));
  }

  // 3. Prefill work: when the oldest request still prefilling is a plain one, the next chunks
  // of the plain prefills (PlainChunks), else a slice of its reuse prefill. 4. One decode step
  // for every sequence that was decoding when the iteration started (with mix_prefill_decode
  // in the plain chunks' forward pass).
  std::vector<Active*> decoding;
  for (auto& a : active_) {
    if (a->state == Active::State::kDecode) decoding.push_back(a.get());
  }
  charge(EnginePhase::kAdmission);
  bool prefilled = false;
  Active* pf = nullptr;
  for (auto& a : active_) {
    if (a->state == Active::State::kPrefill) {
      pf = a.get();
      break;
    }
  }
  // With a TPOT target the prefill work beside decode steps is what fits (budget_).
  const int n_decoding = static_cast<int>(decoding.size());
  auto since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  // The plain prefills' chunks that fit, in one pass with the decode rows of `step` (if any).
  auto plain_chunks = [&](const std::vector<Active*>& step) {
    const auto due = PlainChunks(budget_.PlainTokens(n_decoding, opts_.prefill_chunk));
    const int tokens = DueTokens(due);
    const Clock::time_point t0 = Clock::now();
    PrefillChunks(due, step);
    budget_.ObservePlain(tokens, static_cast<int>(step.size()), since(t0));
  };
  if (pf != nullptr && pf->plain && opts_.mix_prefill_decode && !decoding.empty()) {
    plain_chunks(decoding);
    prefilled = true;
    std::erase_if(active_, [](const auto& a) { return a->state == Active::State::kDone; });
    charge(EnginePhase::kMixed);
  } else {
    if (pf != nullptr && pf->plain) {
      plain_chunks({});
    } else if (pf != nullptr) {
      ReusePrefillSlice(*pf, budget_.ReuseRowLayers(n_decoding, ReuseSliceRows()));
    }
    prefilled = pf != nullptr;
    if (prefilled) charge(EnginePhase::kPrefill);
    std::erase_if(decoding, [](Active* a) { return a->state != Active::State::kDecode; });
    const Clock::time_point t0 = Clock::now();
    DecodeAll(decoding);
    if (!decoding.empty()) budget_.ObserveDecode(static_cast<int>(decoding.size()), since(t0));
    std::erase_if(active_, [](const auto& a) { return a->state == Active::State::kDone; });
    charge(EnginePhase::kDecode);
  }
  // 5. One deferred segment store, unless a prefill already ran (then only when many wait).
  // Without store_while_busy: only when idle, and an overflowing backlog loses its oldest.
  if (!opts_.store_while_busy) {
    while (static_cast<int>(pending_stores_.size()) > opts_.max_pending_stores) {
      DropOldestStore();
    }
    if (!prefilled && decoding.empty() && active_.empty()) StoreOne();
  } else if (!prefilled || static_cast<int>(pending_stores_.size()) > opts_.max_pending_stores) {
    StoreOne(n_decoding);
  }
  charge(EnginePhase::kStore);
  // 6. Idle: copy one segment the device tier holds alone to the host store (download and
  // checksums: too slow for an iteration that decodes), then report it (write-back, events).
  // Not while a request waits for its cluster fetch: the host's memory bandwidth and threads
  // go to that fetch and to uploading its segments (on the H200 spilling the first fetched
  // segments during the rest of a 4 GB fetch left ~0.3 s of uploads to the request's prefill).
  auto fetch_awaited = [this] {
    std::lock_guard<std::mutex> l(mu_);
    return !fetch_wait_.empty();
  };
  if (!prefilled && decoding.empty() && active_.empty() && pending_stores_.empty() &&
      !fetch_awaited()) {
    SpillOne();
    charge(EnginePhase::kSpill);
    // 7. Lowest priority: a slice of a correctness-gate replay, when nothing else waits.
    if (group_->unspilled() == 0 && !gate_queue_.empty()) {
      GateStep();
      charge(EnginePhase::kSpill);
    }
  }
}

void BatchScheduler::GateOffer(const Active& a, const std::vector<float>& logits) {
  if (!gate_.ShouldSample()) return;
  if (static_cast<int>(gate_queue_.size()) >= gate_.options().max_pending) {
    gate_.CountDropped();
    return;
  }
  GateReplay g;
  g.segments = a.w.segments;
  g.add_bos = a.w.add_bos;
  g.opts = a.w.reuse;
  g.opts.enable_reuse = false;
  g.opts.register_prefix = false;
  g.opts.register_approximate_prefix = false;
  g.opts.store_new_segments = false;
  g.opts.split_full_layers = false;
  g.logits = logits;
  gate_queue_.push_back(std::move(g));
}

void BatchScheduler::GatePreempt() {
  if (!gate_running_) return;
  group_->AbortReusePrefill();  // its KV blocks go back to the pool
  gate_running_ = false;
  GateReplay& g = gate_queue_.front();
  reserved_blocks_ -= g.reserve;
  g.reserve = 0;
  gate_.CountPreempted();
  if (++g.tries > 3) {  // a busy worker: the sample is dropped rather than retried forever
    gate_queue_.pop_front();
    gate_.CountDropped();
  }
}

void BatchScheduler::GateStep() {
  {
    // Never beside a user request: one queued or waiting for its fetch goes first.
    std::lock_guard<std::mutex> l(mu_);
    if (!queue_.empty() || !fetch_wait_.empty()) return;
  }
  GateReplay& g = gate_queue_.front();
  if (!gate_running_) {
    int tokens = 1;
    for (const auto& s : g.segments) tokens += static_cast<int>(s.tokens.size());
    g.reserve = tokens / block_size_ + 2;
    const int total = group_->engine().blocks().num_blocks();
    absl::Status b = reserved_blocks_ + g.reserve > total
                         ? absl::ResourceExhaustedError("no KV blocks for the replay")
                         : group_->BeginReusePrefill(g.segments, g.add_bos, &g.opts);
    if (!b.ok()) {
      g.reserve = 0;
      gate_queue_.pop_front();
      gate_.CountDropped();
      return;
    }
    reserved_blocks_ += g.reserve;
    gate_running_ = true;
  }
  ++gate_slices_;
  auto step = group_->ReusePrefillStep(ReuseSliceRows());
  if (step.ok() && !step->has_value()) return;  // more slices in later idle iterations
  gate_running_ = false;
  reserved_blocks_ -= g.reserve;
  if (!step.ok()) {
    gate_queue_.pop_front();
    gate_.CountDropped();
    return;
  }
  ReusePrefillResult& r = **step;
  group_->Release(r.seq);
  const double kl = FirstTokenKl(r.logits, g.logits);
  const bool agree = !r.logits.empty() && !g.logits.empty() &&
                     std::max_element(r.logits.begin(), r.logits.end()) - r.logits.begin() ==
                         std::max_element(g.logits.begin(), g.logits.end()) - g.logits.begin();
  gate_queue_.pop_front();
  const std::string line = gate_.Record(kl, agree);
  if (hooks_.on_gate_replay) hooks_.on_gate_replay(kl, agree);
  if (!line.empty() && hooks_.on_gate_event) hooks_.on_gate_event(line, gate_.state());
  if (gate_.state().reuse_disabled) {
    // Samples taken under reuse that is now off judge nothing.
    gate_queue_.clear();
  }
}

void BatchScheduler::SpillOne() {
  // A couple of layers per iteration: a request arriving meanwhile waits for those only.
  auto r = group_->SpillOne(/*max_layers=*/2);
  if (r.ok() && r->has_value() && hooks_.on_segments_stored) {
    hooks_.on_segments_stored({**r});
  }
}

bool BatchScheduler::StoreOne(int n_decoding) {
  while (!pending_stores_.empty()) {
    PendingStore& p = pending_stores_.front();
    if (!p.started) {
      if (group_->Holds(p.fp)) {  // stored meanwhile (another request)
        pending_stores_.pop_front();
        continue;
      }
      // The encoding pass holds KV blocks across iterations: admission counts them.
      p.started = true;
      p.reserve = static_cast<int>(p.tokens.size()) / block_size_ + 2;
      reserved_blocks_ += p.reserve;
    }
    // Under a TPOT target, the layers that fit beside the decode step (at least one).
    const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(p.tokens.size()));
    const int slice = opts_.store_slice_layers > 0 ? opts_.store_slice_layers : 1 << 30;
    const int64_t fit =
        budget_.ReuseRowLayers(n_decoding, static_cast<int64_t>(slice) * rows) / rows;
    auto r = group_->StoreStep(p.tokens, &p.opts,
                               static_cast<int>(std::clamp<int64_t>(fit, 1, slice)));
    if (r.ok() && *r == StoreProgress::kRunning) return true;
    // Done, or failed (e.g. no free KV blocks for the encoding pass: only the store is lost).
    // A segment in the device tier is reported once SpillOne copied it to the host store.
    const Hash128 fp = p.fp;
    const int n = static_cast<int>(p.tokens.size());
    reserved_blocks_ -= p.reserve;
    pending_stores_.pop_front();
    if (r.ok() && *r == StoreProgress::kInStore && hooks_.on_segments_stored) {
      hooks_.on_segments_stored({{fp, n}});
    }
    return true;
  }
  return false;
}

bool BatchScheduler::AdmitStore(const Hash128& fp, int after_misses) {
  if (after_misses <= 1) {
    miss_counts_.erase(fp);  // stored now: an earlier request's count is spent
    return true;
  }
  auto [it, inserted] = miss_counts_.try_emplace(fp, 0);
  if (inserted) {
    miss_order_.push_back(fp);
    // Bounded memory: the oldest counts are forgotten (such a segment starts over).
    while (miss_order_.size() > 65536) {
      miss_counts_.erase(miss_order_.front());
      miss_order_.pop_front();
    }
  }
  if (++it->second < after_misses) return false;
  miss_counts_.erase(fp);  // its entry in miss_order_ ages out harmlessly
  return true;
}

void BatchScheduler::DropOldestStore() {
  PendingStore& p = pending_stores_.front();
  if (p.started) reserved_blocks_ -= p.reserve;  // its pass ends with the next store's start
  pending_stores_.pop_front();
  ++stores_dropped_;
}

void BatchScheduler::ReusePrefillSlice(Active& a, int64_t max_row_layers) {
  const ReuseOptions& o = a.w.reuse;
  ReuseOptions po = a.w.reuse;
  const bool defer = opts_.defer_segment_stores && o.enable_reuse && o.store_new_segments;
  if (defer) po.store_new_segments = false;  // the prefill reports them as missing instead
  if (!a.reuse_running) {
    absl::Status b = group_->BeginReusePrefill(a.w.segments, a.w.add_bos, &po);
    if (!b.ok()) {
      Finish(a, "", b);
      return;
    }
    a.reuse_running = true;
  }
  const int64_t before = group_->reuse().prefill_row_layers();
  const Clock::time_point t0 = Clock::now();
  auto step = group_->ReusePrefillStep(max_row_layers);
  if (step.ok()) {
    const int64_t after = step->has_value() ? (*step)->stats.computed_token_layers
                                            : group_->reuse().prefill_row_layers();
    budget_.ObserveReuse(after - before,
                         std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (!step.ok() || step->has_value()) a.reuse_running = false;  // ended either way
  if (!step.ok()) {
    Finish(a, "", step.status());
    return;
  }
  if (!step->has_value()) return;  // more slices in later iterations
  ReusePrefillResult* r = &**step;
  a.seq = std::move(r->seq);
  a.has_seq = true;
  const ReuseStats& st = r->stats;
  a.usage.prompt_tokens = st.prompt_tokens;
  a.usage.prefix_tokens = st.prefix_tokens;
  a.usage.reused_tokens = st.reused_tokens;
  a.usage.recomputed_tokens = st.selected_tokens;
  a.usage.new_tokens = st.new_tokens;
  a.usage.segments_hit = st.segments_hit;
  a.usage.compute_share = st.compute_share;
  a.usage.segments_streamed = st.segments_streamed;
  a.usage.stream_restarts = st.stream_restarts;
  a.usage.stream_wait_ms = st.stream_wait_ms;
  a.usage.stream_upload_ms = st.stream_upload_ms;
  a.exact_tokens = st.exact_tokens;
  if (defer) {
    const int after =
        a.w.store_after_misses > 0 ? a.w.store_after_misses : opts_.store_after_misses;
    for (const auto& [i, fp] : r->missing) {
      if (!AdmitStore(fp, after)) continue;
      bool queued = false;
      for (const auto& p : pending_stores_) queued = queued || p.fp == fp;
      if (!queued) {
        // A bare-token store is fingerprinted in its options' scope: the segment's own.
        ReuseOptions so = o;
        so.scope = a.w.segments[i].scope;
        pending_stores_.push_back({fp, a.w.segments[i].tokens, so});
      }
    }
  }
  const std::vector<std::pair<Hash128, int>>& stored = r->stored;
  if (!stored.empty() && hooks_.on_segments_stored) hooks_.on_segments_stored(stored);
  std::vector<float> logits = std::move(r->logits);
  if (st.reused_tokens > 0) GateOffer(a, logits);
  a.state = Active::State::kDecode;
  SampleAndEmit(a, logits);
}

void BatchScheduler::PlainChunk(Active& a, int end) {
  const int total = static_cast<int>(a.prompt.size());
  // The engine prefills [computed, size): show it the prompt up to `end`.
  std::vector<int32_t> full = std::move(a.seq.tokens);
  a.seq.tokens.assign(full.begin(), full.begin() + end);
  auto lg = group_->Prefill(a.seq);
  a.seq.tokens = std::move(full);
  if (!lg.ok()) {
    Finish(a, "", lg.status());
    return;
  }
  if (end == total) FinishPlainPrefill(a, *lg);  // else more chunks in later iterations
}

bool BatchScheduler::EnsurePlainSeq(Active& a) {
  if (a.has_seq) return true;
  auto s = group_->Admit(a.prompt, a.w.reuse.scope);
  if (!s.ok()) {
    Finish(a, "", s.status());
    return false;
  }
  a.seq = std::move(*s);
  a.has_seq = true;
  a.usage.prefix_tokens = a.seq.cached_prefix;
  return true;
}

void BatchScheduler::FinishPlainPrefill(Active& a, std::span<const float> logits) {
  const int total = static_cast<int>(a.prompt.size());
  a.usage.prompt_tokens = total;
  a.usage.new_tokens = total - a.usage.prefix_tokens;
  a.usage.compute_share = 1.0;
  a.state = Active::State::kDecode;
  SampleAndEmit(a, logits);
}

int BatchScheduler::DueTokens(const std::vector<PlainChunkDue>& due) {
  int n = 0;
  for (const PlainChunkDue& c : due) n += c.end - c.a->seq.computed;
  return n;
}

std::vector<BatchScheduler::PlainChunkDue> BatchScheduler::PlainChunks(int budget) {
  std::vector<PlainChunkDue> due;
  for (auto& p : active_) {
    if (budget == 0) break;
    Active& a = *p;
    if (a.state != Active::State::kPrefill) continue;
    // A reuse prefill runs alone (its slices hold engine state); the plain prefills admitted
    // after it wait for it, so each request's prefill still starts in admission order.
    if (!a.plain) break;
    if (!EnsurePlainSeq(a)) continue;  // failed (finished) at admission
    const int end = std::min(static_cast<int>(a.prompt.size()), a.seq.computed + budget);
    budget -= end - a.seq.computed;
    due.push_back({&a, end});
  }
  return due;
}

void BatchScheduler::PrefillChunks(const std::vector<PlainChunkDue>& due,
                                   const std::vector<Active*>& step) {
  if (due.empty()) {  // every one failed at admission: a plain decode step
    DecodeAll(step);
    return;
  }
  if (due.size() == 1 && step.empty()) {  // a chunk alone: the engine's plain prefill pass
    PlainChunk(*due[0].a, due[0].end);
    return;
  }
  std::vector<Engine::ChunkRef> chunks;
  for (const PlainChunkDue& c : due) chunks.push_back({&c.a->seq, c.end});
  const StepOrder o = DrawableFirst(step);
  const auto [seqs, toks] = DecodeInputs(o.step);
  auto m = group_->StepWithChunks(seqs, toks, chunks, o.draws);
  if (!m.ok()) {  // nothing changed: each part separately, where errors stay per request
    for (const PlainChunkDue& c : due) PlainChunk(*c.a, c.end);
    DecodeAll(step);
    return;
  }
  // The prefilled requests' first tokens first, as when their last chunks run alone.
  for (size_t j = 0; j < due.size(); ++j) {
    if (!m->prefill[j].empty()) FinishPlainPrefill(*due[j].a, m->prefill[j]);
  }
  EmitStep(o, m->decode_drawn, m->decode);
}

BatchScheduler::StepOrder BatchScheduler::DrawableFirst(const std::vector<Active*>& step) {
  StepOrder o;
  std::vector<Active*> host;
  for (Active* a : step) {
    std::optional<RowDraw> d = a->sampler->BackendDraw();
    if (d.has_value() && a->w.logprobs < 0) {
      o.step.push_back(a);
      o.draws.push_back(*d);
    } else {
      host.push_back(a);
    }
  }
  o.step.insert(o.step.end(), host.begin(), host.end());
  return o;
}

void BatchScheduler::EmitStep(const StepOrder& o, const std::vector<int32_t>& drawn,
                              const std::vector<std::vector<float>>& logits) {
  const size_t k = o.draws.size();
  for (size_t i = 0; i < k; ++i) {
    Active& a = *o.step[i];
    if (drawn[i] >= 0) {
      a.sampler->Drew(drawn[i]);
      Emit(a, drawn[i]);
    } else {  // as Sampler::TrySample's CheckLogits failure: the request fails, never a token
      Finish(a, "", absl::InternalError(
          "non-finite logits: no token can be drawn from this step's logits (NaN, +Inf or all "
          "-Inf; broken weights or kernel)"));
    }
  }
  if (k < o.step.size()) {
    SampleAndEmitAll(std::vector<Active*>(o.step.begin() + static_cast<int64_t>(k), o.step.end()),
                     logits);
  }
}

// Each decoding request's sequence and the token it feeds next (a batched step's inputs).
std::pair<std::vector<Sequence*>, std::vector<int32_t>> BatchScheduler::DecodeInputs(
    const std::vector<Active*>& step) {
  std::pair<std::vector<Sequence*>, std::vector<int32_t>> in;
  for (Active* a : step) {
    in.first.push_back(&a->seq);
    in.second.push_back(a->last);
  }
  return in;
}

void BatchScheduler::DecodeAll(const std::vector<Active*>& step) {
  if (step.empty()) return;
  // One forward pass for every decoding sequence: the weights are read once per step instead
  // of once per sequence. Greedy and plain-temperature requests take only their tokens back
  // from the device; the others' logits come to the host.
  const StepOrder o = DrawableFirst(step);
  if (o.draws.empty() && step.size() == 1) {
    DecodeOne(*step[0]);
    return;
  }
  const auto [seqs, toks] = DecodeInputs(o.step);
  auto r = group_->StepBatchDraw(seqs, toks, o.draws);
  if (!r.ok()) {
    // e.g. no KV block left for one of them: one at a time, so only that request fails.
    for (Active* a : step) DecodeOne(*a);
    return;
  }
  EmitStep(o, r->drawn, r->logits);
}

bool BatchScheduler::DecodeOne(Active& a) {
  auto lg = group_->Step(a.seq, a.last);
  if (!lg.ok()) {
    Finish(a, "", lg.status());
    return false;
  }
  return SampleAndEmit(a, *lg);
}

absl::StatusOr<int32_t> BatchScheduler::Sample(Active& a, std::span<const float> logits) {
  absl::StatusOr<int32_t> t = a.sampler->TrySample(logits);
  // Of the raw logits (before bias, penalties and temperature: sampler.h TokenLogprobs).
  if (t.ok() && a.w.logprobs >= 0) a.logprobs = ComputeLogprobs(logits, *t, a.w.logprobs);
  return t;
}

bool BatchScheduler::EmitSampled(Active& a, const absl::StatusOr<int32_t>& t) {
  if (!t.ok()) {  // non-finite logits: the request fails with the reason, never a token
    Finish(a, "", t.status());
    return false;
  }
  return Emit(a, *t);
}

bool BatchScheduler::SampleAndEmit(Active& a, std::span<const float> logits) {
  return EmitSampled(a, Sample(a, logits));
}

void BatchScheduler::SampleAndEmitAll(const std::vector<Active*>& step,
                                      const std::vector<std::vector<float>>& logits) {
  // Sampling reads every logit of a row several times (the finiteness check, the argmax or the
  // sort, logprobs): at batch 32 with a 128K vocabulary that is 16 MB per pass, ~5 ms of one
  // core per step (this repository's CI machine), which the GPU would wait out. Each request's
  // sampler is its own, so rows go to the pool (when no other loop holds it: a cluster fetch's
  // decode of a round would hold the step longer); small vocabularies stay on this thread.
  const size_t n = step.size();
  std::vector<absl::StatusOr<int32_t>> tok(n, absl::UnknownError("not sampled"));
  const int64_t vocab = logits.empty() ? 0 : static_cast<int64_t>(logits[0].size());
  ParallelForIfIdle(static_cast<int64_t>(n), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) tok[i] = Sample(*step[i], logits[i]);
  }, LogitRowsPerTask(vocab));
  for (size_t i = 0; i < n; ++i) EmitSampled(*step[i], tok[i]);
}

bool BatchScheduler::Emit(Active& a, int32_t token) {
  const Clock::time_point now = Clock::now();
  if (!a.first_done) {
    a.first_done = true;
    a.usage.ttft_ms = MsBetween(a.w.arrival, now);
    if (hooks_.on_first_token) hooks_.on_first_token(a.usage.ttft_ms / 1000.0);
  } else if (hooks_.on_token) {
    hooks_.on_token(MsBetween(a.t_last, now) / 1000.0);
  }
  a.t_last = now;
  if (std::find(a.stops.begin(), a.stops.end(), token) != a.stops.end()) {
    Finish(a, "stop");
    return false;
  }
  ++a.generated;
  a.last = token;
  StreamChunk c;
  c.ids.push_back(token);
  c.text = a.dec->Push(token);
  if (a.w.logprobs >= 0) c.logprobs.push_back(std::move(a.logprobs));
  a.h->Push(std::move(c));
  if (a.generated >= a.w.sampling.max_tokens ||
      static_cast<int>(a.seq.tokens.size()) >= max_len_) {
    Finish(a, "length");
    return false;
  }
  return true;
}

void BatchScheduler::Finish(Active& a, const std::string& reason, absl::Status status) {
  if (a.state == Active::State::kDone) return;
  if (a.reuse_running) {  // cancelled between slices: the engines hold its blocks
    group_->AbortReusePrefill();
    a.reuse_running = false;
  }
  if (a.has_seq) {
    // A plain prefill is exact: its blocks (generated ones too) serve later exact prefixes.
    // After a reuse prefill the blocks past its exact tokens (generated ones too) go to the
    // approximate namespace when the request allows it: the next chat turn continues on them.
    if (status.ok() && a.state == Active::State::kDecode && a.w.reuse.register_prefix) {
      if (a.plain || a.exact_tokens >= a.usage.prompt_tokens) {
        group_->RegisterPrefix(a.seq);
      } else if (a.w.reuse.register_approximate_prefix) {
        group_->RegisterPrefix(a.seq, a.exact_tokens, /*approximate_rest=*/true);
      }
    }
    group_->Release(a.seq);
    a.has_seq = false;
  }
  if (a.state != Active::State::kQueued) reserved_blocks_ -= a.reserve;
  a.state = Active::State::kDone;
  StreamChunk c;
  c.final = true;
  c.status = status;
  a.usage.completion_tokens = a.generated;
  a.usage.total_ms = MsBetween(a.w.arrival, Clock::now());
  if (status.ok()) {
    c.finish_reason = reason;
    if (a.dec) c.text = a.dec->Flush();
  }
  c.usage = a.usage;
  a.h->Push(std::move(c));
  if (hooks_.on_finished) hooks_.on_finished(a.usage, reason, status);
}

void BatchScheduler::PublishWaitingLocked() {
  load_.queue_depth = static_cast<int>(queue_.size());
  load_.waiting_remote = static_cast<int>(fetch_wait_.size());
  load_.fetch_timeouts = fetch_timeouts_;
}

void BatchScheduler::PublishLoad() {
  int64_t tokens = 0;
  for (const auto& a : active_) {
    tokens += a->has_seq ? static_cast<int64_t>(a->seq.tokens.size())
                         : static_cast<int64_t>(a->prompt.size());
  }
  std::lock_guard<std::mutex> l(mu_);
  PublishWaitingLocked();
  load_.running = static_cast<int>(active_.size());
  load_.running_tokens = tokens;
  load_.pending_stores = static_cast<int>(pending_stores_.size());
  load_.stores_dropped = stores_dropped_;
  // budget_ is the engine thread's (PublishWaitingLocked also runs on Submit's thread).
  load_.cost_decode_ms = budget_.decode_ms();
  load_.cost_token_ms = budget_.token_ms();
  load_.cost_row_layer_ms = budget_.row_layer_ms();
  if (group_) load_.unspilled_segments = static_cast<int>(group_->unspilled());
  if (group_) load_.device_tier_bytes = group_->device_tier_bytes();
  for (int p = 0; p < kEnginePhases; ++p) {
    load_.phase_seconds[p] = phase_seconds_[p];
    load_.phase_longest_s[p] = phase_longest_[p];
  }
  if (group_) {
    load_.kv_blocks_total = group_->engine().blocks().num_blocks();
    load_.kv_blocks_free = group_->engine().blocks().available();
  }
  ++load_.iterations;
  load_.gate = gate_.state();
  load_.gate_slices = gate_slices_;
  load_.gate_pending = static_cast<int>(gate_queue_.size());
}

}  // namespace sparsex::service
