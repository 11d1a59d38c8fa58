// The cache-cluster tier of the worker: fetch before admission (FetchRemote, on a scheduler
// fetch thread) and write-back after the engine stored a segment (the write-back thread).
#include <map>

#include "gpu_worker/service/log_limiter.h"
#include "gpu_worker/service/worker_state.h"

namespace sparsex::service {
namespace internal {

void FetchRemote(WorkerServer::State& st, const std::vector<SegmentRef>& refs, WorkItem& item) {
  const Clock::time_point t0 = Clock::now();
  // Tensor parallelism: every rank fetches its own share; a segment counts as fetched only
  // when every rank has it (a partial one is dropped before the prefill).
  const int tp = static_cast<int>(st.rank_stores.size()) + 1;
  // Without tensor parallelism, and with a device (or pinned host) tier, the segments go to
  // the engine's tier in bf16, skipping the fp32 host store: the first prefill then finds them
  // where a local segment would be (on the H200 it paid ~0.7 s for a 32K prompt's store
  // checksums, conversion and upload). They reach the host store, and the router's index, by
  // the idle-time spill, like segments this worker encoded. Only on a bf16 wire (the CUDA
  // worker's): an f32 wire means a backend that keeps fp32 KV, which rounding would degrade.
  // Each segment is handed over as soon as it is complete; the engine thread uploads it into
  // its tier between iterations while the next one transfers.
  const bool bf16 = tp == 1 && st.opts.cluster.fetch_to_tier &&
                    st.tier->wire_dtype() == KvDtype::kBF16 && st.scheduler->TakesFetched();
  auto remember = [&st](const Hash128& fp) {  // not written back once spilled
    std::lock_guard<std::mutex> l(st.wb_mu);
    st.fetched_to_tier.push_back(fp);
    if (st.fetched_to_tier.size() > WorkerServer::State::kFetchedRemembered) {
      st.fetched_to_tier.pop_front();
    }
  };
  ClusterKvTier::ToTier to_tier;
  if (bf16 && !st.opts.cluster.stream_fetch) {
    to_tier = [&st, &remember](const SegmentRef& ref, SegmentKvBf16&& kv) {
      if (!st.scheduler->OfferFetched(ref.fp, std::move(kv))) return false;  // engine stopped
      remember(ref.fp);
      return true;
    };
  }
  // Streaming (--cache_fetch_stream): blocks in layer order into segments the engine reads as
  // they fill; the request is admitted once they are offered, and its prefill waits only for
  // each sparse layer's own blocks. Its usage counts what was offered.
  ClusterKvTier::StreamTo stream;
  bool started = false;
  if (bf16 && st.opts.cluster.stream_fetch) {
    stream.open = [&](const SegmentRef& ref) -> std::shared_ptr<StreamedSegment> {
      std::shared_ptr<StreamedSegment> seg = st.scheduler->OpenStreamed(ref.fp, ref.num_tokens);
      if (seg == nullptr) return nullptr;
      st.m->stream_memory->Get({seg->in_block() ? "pinned" : "pageable"}).Inc();
      remember(ref.fp);
      ++item.segments_fetched;
      return seg;
    };
    stream.started = [&] {
      started = true;
      if (item.fetch_started) item.fetch_started();
    };
  }
  FetchOutcome f = st.tier->FetchMissing(refs, st.store.get(), 0, tp, to_tier,
                                         stream.open ? &stream : nullptr);
  for (size_t r = 0; r < st.rank_stores.size(); ++r) {
    FetchOutcome fr =
        st.tier->FetchMissing(refs, st.rank_stores[r].get(), static_cast<int>(r) + 1, tp);
    f.failures += fr.failures;
    f.phases += fr.phases;
    f.failure_reasons.insert(f.failure_reasons.end(), fr.failure_reasons.begin(),
                             fr.failure_reasons.end());
    std::erase_if(f.stored,
                  [&](const SegmentRef& sr) { return !st.rank_stores[r]->Contains(sr.fp); });
  }
  if (!st.rank_stores.empty()) f.fetched = static_cast<int>(f.stored.size());
  if (f.fetched + f.failures + f.absent > 0) {  // a lookup ran: its time counts too
    st.m->fetch->Observe(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (!bf16) {
    for (const SegmentRef& r : f.stored) st.events->Stored(r.fp, r.num_tokens);
    if (!f.stored.empty()) st.events->Reconcile(*st.store);
  }
  for (auto [phase, ms] : {std::pair{"lookup", f.phases.lookup_ms}, {"lock", f.phases.lock_ms},
                           {"transfer", f.phases.transfer_ms}, {"decode", f.phases.decode_ms},
                           {"put", f.phases.put_ms}}) {
    st.m->fetch_phase->Get({phase}).Inc(ms / 1000.0);
  }
  st.m->fetched->Inc(f.fetched);
  for (const std::string& why : f.failure_reasons) st.m->fetch_failures->Get({why}).Inc();
  st.m->fetch_bytes->Inc(static_cast<double>(f.bytes));
  st.m->fetch_in_place_bytes->Inc(static_cast<double>(f.in_place_bytes));
  if (f.failures > 0) {
    // Say why at once (rate-limited): a fetch that cannot succeed is recomputed, and only
    // this line and the metric tell the operator.
    static LogLimiter limit(std::chrono::seconds(5));
    if (uint64_t held = 0; limit.Admit(Clock::now(), &held)) {
      std::map<std::string, int> by;
      for (const std::string& why : f.failure_reasons) ++by[why];
      std::string reasons;
      for (const auto& [why, n] : by)
        absl::StrAppend(&reasons, reasons.empty() ? "" : ", ", n, " ", why);
      LogLine(st.worker_id, absl::StrCat("cache cluster: ", f.failures, " of ", refs.size(),
                                         " segments not fetched (", reasons,
                                         "); recomputed. 'incomplete': the server holds only "
                                         "some layers (evicted: its memory/disk capacity is "
                                         "too small for this model's segments)",
                                         held > 0 ? absl::StrCat(" [", held, " more fetches "
                                                                 "with failures since the last "
                                                                 "line]")
                                                  : std::string()));
    }
  }
  if (!started) {  // else set before fetch_started, and read by the scheduler since
    item.segments_fetched = f.fetched;
    item.fetch_failures = f.failures;
  }
}

}  // namespace internal

void WorkerServer::State::WriteBackLoop() {
  std::unique_lock<std::mutex> l(wb_mu);
  for (;;) {
    wb_cv.wait(l, [this] { return wb_stop || !wb_queue.empty(); });
    if (wb_queue.empty() && wb_stop) return;
    Hash128 fp = wb_queue.front();
    wb_queue.pop_front();
    l.unlock();
    // Every tensor-parallel rank writes its own share (one share without TP).
    const int tp = static_cast<int>(rank_stores.size()) + 1;
    for (int r = 0; r < tp; ++r) {
      SegmentStore* st = r == 0 ? store.get() : rank_stores[r - 1].get();
      std::shared_ptr<const SegmentKv> kv = st->Get(fp);
      if (kv) {
        absl::Status s = tier->Put(fp, *kv, r, tp);
        m->writeback->Get({s.ok() ? "ok" : "error"}).Inc();
        // One line per 5 s (a cache outage fails every write-back); the metric counts all.
        static internal::LogLimiter limit(std::chrono::seconds(5));
        if (uint64_t held = 0; !s.ok() && limit.Admit(internal::Clock::now(), &held)) {
          internal::LogLine(worker_id,
                            absl::StrCat("write-back failed: ", s.ToString(),
                                         held > 0 ? absl::StrCat(" [", held,
                                                                 " more write-backs failed since "
                                                                 "the last line]")
                                                  : std::string()));
        }
      } else {
        m->writeback->Get({"evicted"}).Inc();
      }
    }
    l.lock();
  }
}

}  // namespace sparsex::service
