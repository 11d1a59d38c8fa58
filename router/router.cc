#include "router/router.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/metrics/metrics.h"
#include "common/utf8.h"
#include "model/model_info.h"
#include "proto/grpc_status.h"
#include "proto/worker.grpc.pb.h"
#include "router/openai_codec.h"
#include "router/prepare.h"
#include "router/router_metrics.h"
#include "router/worker_pool.h"

namespace sparsex::router {
namespace {

using Clock = std::chrono::steady_clock;

// The prompt-size bound (RouterOptions::max_prompt_bytes) on a request's raw text, before any
// tokenization: a tokenizer's time and memory grow with the text (tokenizing a 30 MB prompt
// takes 26 s of CPU and 1.8 GB, only for the context-length check to refuse it).
absl::Status CheckPromptBytes(const std::string& field, size_t bytes, size_t limit) {
  if (bytes <= limit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": prompt text of ", bytes,
                                                 " bytes exceeds this router's limit of ", limit,
                                                 " bytes (max_prompt_bytes)"));
}
// Bytes of a request's prompt text (prompt and segment texts); its token ids apart, 4 bytes each.
size_t PromptTextBytes(const v1::GenerateRequest& req) {
  size_t bytes = req.prompt().size();
  for (const v1::Segment& s : req.segments()) bytes += s.text().size();
  return bytes;
}
size_t PromptIdBytes(const v1::GenerateRequest& req) {
  size_t ids = static_cast<size_t>(req.prompt_ids_size());
  for (const v1::Segment& s : req.segments()) ids += s.ids().ids_size();
  return 4 * ids;
}
absl::Status CheckPromptBytes(const v1::GenerateRequest& req, size_t limit) {
  return CheckPromptBytes(req.segments_size() > 0 ? "segments" : "prompt", PromptTextBytes(req),
                          limit);
}

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool Retryable(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         c == grpc::StatusCode::ABORTED;
}

}  // namespace

// The wiring: the model (config and tokenizer), the index the worker pool feeds, the metrics;
// and the proxy itself: prepare, route, stream, retry on another worker before the first token.
struct Router::Impl {
  RouterOptions opts;
  ModelInfo model;
  openai::ChatFormat chat;
  std::string model_name;
  ClusterIndex index;  // declared before `pool`, whose threads feed it, so it outlives them
  metrics::Registry registry;
  std::unique_ptr<RouterMetrics> m;
  std::unique_ptr<WorkerPool> pool;
  std::unique_ptr<Authenticator> auth;

  ~Impl() { Stop(); }

  void Stop() {
    if (pool) pool->Stop();
  }

  ServedIdentity Identity() const { return pool ? pool->Identity() : ServedIdentity{}; }
  std::vector<std::shared_ptr<WorkerConn>> Conns() {
    return pool ? pool->Conns() : std::vector<std::shared_ptr<WorkerConn>>{};
  }

  // ---- routing ----

  struct Pick {
    std::shared_ptr<WorkerConn> conn;
    int reusable = 0;
    std::string reason;
    bool all_saturated = false;
  };

  Pick Route(const Prepared& p, const std::vector<std::string>& excluded) {
    std::vector<std::shared_ptr<WorkerConn>> all = Conns();
    std::vector<std::shared_ptr<WorkerConn>> cands;
    std::vector<RouteCandidate> rc;
    for (auto& c : all) {
      if (!c->healthy || !c->model_ok) continue;
      if (std::find(excluded.begin(), excluded.end(), c->address) != excluded.end()) continue;
      RouteCandidate x;
      x.id = c->address;
      x.reusable_tokens = index.ReusableTokens(c->address, p.fps);
      x.inflight = c->inflight.load();
      x.inflight_tokens = c->inflight_tokens.load();
      x.load = index.Load(c->address);
      cands.push_back(c);
      rc.push_back(x);
    }
    Pick pick;
    RouteDecision d = ChooseWorker(rc, p.prompt_tokens, opts.weights);
    pick.all_saturated = d.all_saturated;
    if (d.index >= 0) {
      pick.conn = cands[d.index];
      pick.reusable = rc[d.index].reusable_tokens;
      pick.reason = d.reason;
    }
    return pick;
  }

  absl::Status Generate(const v1::GenerateRequest& req, const GenerateSink& sink,
                        const CallControl& ctl) {
    const Clock::time_point t0 = Clock::now();
    absl::Status st = GenerateImpl(req, sink, ctl, t0);
    std::string outcome =
        st.ok() ? "ok" : absl::AsciiStrToLower(absl::StatusCodeToString(st.code()));
    m->requests->Get({ctl.api, outcome}).Inc();
    return st;
  }

  absl::Status GenerateImpl(const v1::GenerateRequest& req, const GenerateSink& sink,
                            const CallControl& ctl, Clock::time_point t0) {
    RETURN_IF_ERROR(CheckModel(req.model()));
    RETURN_IF_ERROR(CheckPromptBytes(req, opts.max_prompt_bytes));
    // The tenant comes from the front end's credential check, never from the request.
    std::shared_ptr<const Tenant> tenant = ctl.tenant;
    if (!tenant) {
      if (auth->enabled()) return absl::UnauthenticatedError("missing API key");
      ASSIGN_OR_RETURN(tenant, auth->Authenticate(""));
    }
    if (tenant->limits.max_prompt_bytes > 0) {
      const size_t bytes = PromptTextBytes(req) + PromptIdBytes(req);
      if (bytes > tenant->limits.max_prompt_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompt of ", bytes, " bytes exceeds this API key's limit of ",
                         tenant->limits.max_prompt_bytes));
      }
    }
    ASSIGN_OR_RETURN(AdmissionSlot slot, auth->Admit(*tenant));
    CallerScopes scopes;
    scopes.store = tenant->store_scope().salt;
    for (const Scope& r : tenant->read_scopes) scopes.read.push_back(r.salt);
    if (!scopes.read.empty()) {
      scopes.held = [this](const Hash128& fp) { return index.HeldAnywhere(fp); };
    }
    ASSIGN_OR_RETURN(Prepared p, PrepareRequest(req, model, opts.chunking, Identity(), scopes));
    std::chrono::system_clock::time_point deadline = ctl.deadline;
    if (opts.request_timeout_ms > 0) {
      deadline = std::min(deadline, std::chrono::system_clock::now() +
                                        std::chrono::milliseconds(opts.request_timeout_ms));
    }
    std::vector<std::string> excluded;
    absl::Status last = absl::UnavailableError("no worker is serving " + model_name);
    bool saw_saturated = false;
    for (int attempt = 0; attempt < std::max(1, opts.max_attempts); ++attempt) {
      if (ctl.cancel && ctl.cancel->cancelled()) return absl::CancelledError("client went away");
      Pick pick = Route(p, excluded);
      if (!pick.conn) {
        if (pick.all_saturated || saw_saturated) {
          m->shed->Inc();
          return absl::ResourceExhaustedError(
              absl::StrCat("every worker is saturated; retry later (", last.message(), ")"));
        }
        if (attempt == 0) {
          return absl::UnavailableError("no healthy worker is serving " + model_name);
        }
        return last;
      }
      WorkerConn& c = *pick.conn;
      m->decisions->Get({c.Name(), pick.reason}).Inc();
      m->predicted_reuse->Inc(pick.reusable);

      std::unique_ptr<grpc::ClientContext> ctx;
      if (ctl.grpc_parent != nullptr) {
        ctx = grpc::ClientContext::FromServerContext(*ctl.grpc_parent);
      } else {
        ctx = std::make_unique<grpc::ClientContext>();
      }
      if (deadline != std::chrono::system_clock::time_point::max()) ctx->set_deadline(deadline);
      c.inflight++;
      c.inflight_tokens += p.prompt_tokens;
      struct Release {
        WorkerConn& c;
        int64_t n;
        ~Release() {
          c.inflight--;
          c.inflight_tokens -= n;
        }
      } release{c, p.prompt_tokens};

      // The front end may cancel from another thread (the client's connection closed) until
      // the attempt ends; CallCancel::Set(nullptr) below waits out a concurrent cancel.
      struct CancelHook {
        CallCancel* cc;
        ~CancelHook() {
          if (cc) cc->Set(nullptr);
        }
      } hook{ctl.cancel.get()};
      if (hook.cc) {
        grpc::ClientContext* raw = ctx.get();
        hook.cc->Set([raw] { raw->TryCancel(); });
      }
      auto reader = c.stub->Generate(ctx.get(), p.wreq);
      v1::GenerateResponse msg;
      bool sent_any = false, client_gone = false;
      int chunks = 0;
      Clock::time_point t_last = t0;
      while (reader->Read(&msg)) {
        const Clock::time_point now = Clock::now();
        if (!sent_any) m->ttft->Observe(std::chrono::duration<double>(now - t0).count());
        else m->inter_token->Observe(std::chrono::duration<double>(now - t_last).count());
        t_last = now;
        sent_any = true;
        ++chunks;
        msg.set_request_id(p.wreq.request_id());
        if (msg.finished()) {
          msg.set_model(model_name);
          const v1::Usage& u = msg.usage();
          m->prompt_tokens->Inc(u.prompt_tokens());
          m->prefix_tokens->Inc(u.prefix_tokens());
          m->reused_tokens->Inc(u.reused_tokens());
          m->recomputed_tokens->Inc(u.recomputed_tokens());
          m->new_tokens->Inc(u.new_tokens());
          m->generated_tokens->Inc(u.completion_tokens());
          m->fetch_failures->Inc(u.fetch_failures());
          m->e2e->Observe(SecondsSince(t0));
        }
        if (!sink(msg)) {
          client_gone = true;
          ctx->TryCancel();  // the worker sees the cancellation and frees the KV
          break;
        }
      }
      grpc::Status gs = reader->Finish();
      if (hook.cc) {
        hook.cc->Set(nullptr);
        hook.cc = nullptr;
        client_gone = client_gone || (ctl.cancel->cancelled() && !gs.ok());
      }
      if (client_gone) return absl::CancelledError("client went away");
      if (gs.ok()) return absl::OkStatus();
      if (gs.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        return absl::DeadlineExceededError("request deadline exceeded");
      }
      if (gs.error_code() == grpc::StatusCode::CANCELLED) {
        return absl::CancelledError(absl::StrCat("cancelled: ", gs.error_message()));
      }
      if (sent_any && gs.error_code() == grpc::StatusCode::UNAVAILABLE && ctl.restart &&
          ctl.restart()) {
        // Nothing reached the client: start over on another worker, as before a first token.
        c.healthy = false;
        m->restarts->Inc();
        last = absl::UnavailableError(absl::StrCat("worker ", c.Name(), " failed after ", chunks,
                                                   " chunk(s): ", gs.error_message()));
        excluded.push_back(c.address);
        continue;
      }
      if (sent_any) {
        c.healthy = gs.error_code() != grpc::StatusCode::UNAVAILABLE ? c.healthy.load() : false;
        return absl::Status(
            gs.error_code() == grpc::StatusCode::UNAVAILABLE ? absl::StatusCode::kUnavailable
                                                             : FromGrpcStatus(gs).code(),
            absl::StrCat("worker ", c.Name(), " (", c.address, ") failed after streaming ",
                         chunks, " chunk(s): ", gs.error_message(),
                         "; the partial output is incomplete, retry the request"));
      }
      if (!Retryable(gs.error_code())) return FromGrpcStatus(gs);
      // Before the first token: try another worker.
      if (gs.error_code() == grpc::StatusCode::UNAVAILABLE) c.healthy = false;
      if (gs.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) saw_saturated = true;
      m->retries->Get({absl::AsciiStrToLower(absl::StatusCodeToString(
                          static_cast<absl::StatusCode>(gs.error_code())))})
          .Inc();
      last = absl::Status(static_cast<absl::StatusCode>(gs.error_code()),
                          absl::StrCat("worker ", c.Name(), ": ", gs.error_message()));
      excluded.push_back(c.address);
    }
    if (saw_saturated && last.code() == absl::StatusCode::kResourceExhausted) m->shed->Inc();
    return last;
  }

  absl::Status CheckModel(const std::string& name) const {
    if (name.empty() || name == model_name ||
        (Identity().known && name == Identity().fingerprint_hex)) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat("unknown model '", SanitizeUtf8(name),
                                                   "'; this router serves '", model_name, "'"));
  }

  void Collect() {
    int healthy = 0, unhealthy = 0;
    for (auto& c : Conns()) {
      (c->healthy && c->model_ok ? healthy : unhealthy)++;
      const std::string n = c->Name();
      for (const char* reason : {"reuse", "load", "only"}) m->decisions->Get({n, reason});
      WorkerLoadInfo l = index.Load(c->address);
      m->w_inflight->Get({n}).Set(c->inflight.load());
      m->w_queue->Get({n}).Set(l.queue_depth);
      m->w_running->Get({n}).Set(static_cast<double>(l.running_tokens));
      m->w_kv->Get({n}).Set(l.kv_usage());
      m->w_segments->Get({n}).Set(static_cast<double>(index.Segments(c->address)));
    }
    m->workers->Get({"healthy"}).Set(healthy);
    m->workers->Get({"unhealthy"}).Set(unhealthy);
  }
};

Router::Router() : impl_(std::make_unique<Impl>()) {}
Router::~Router() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Router>> Router::Create(const RouterOptions& options) {
  std::unique_ptr<Router> r(new Router());
  Impl& s = *r->impl_;
  s.opts = options;
  if (options.model_path.empty()) return absl::InvalidArgumentError("router: --model is required");
  // Config and tokenizer only: the router never maps weight files.
  ASSIGN_OR_RETURN(s.model, LoadModelInfo(options.model_path, options.tokenizer_path));
  s.chat = openai::MakeChatFormat(s.model);
  if (!s.chat.template_error.ok()) {
    std::cerr << "[router] the model's chat template cannot be rendered; chat requests will be "
                 "refused: " << s.chat.template_error.message() << "\n";
  }
  s.model_name = options.model_name.empty()
                     ? std::filesystem::path(options.model_path).stem().string()
                     : options.model_name;
  // Without credentials the router serves only a local test cluster (docs/security.md).
  if (options.api_keys_file.empty() || !options.cluster_tls.enabled()) {
    absl::Status ok = CheckPlaintextAllowed(options.insecure_loopback, "insecure_loopback",
                                            {options.grpc_address, options.http_address,
                                             options.admin_address});
    if (!ok.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "router: ", options.api_keys_file.empty() ? "no --api_keys_file" : "no cluster TLS",
          ": ", ok.message()));
    }
  }
  RETURN_IF_ERROR(CheckTlsFiles(options.cluster_tls));
  if (options.api_keys_file.empty()) {
    s.auth = Authenticator::Disabled();
  } else {
    ASSIGN_OR_RETURN(s.auth, Authenticator::FromFile(options.api_keys_file, options.scope_key_file));
  }
  s.m = std::make_unique<RouterMetrics>(s.registry);
  Impl* sp = &s;
  s.registry.AddCollector([sp] { sp->Collect(); });
  if (options.workers.empty() && options.etcd_endpoints.empty()) {
    return absl::InvalidArgumentError("router: no workers: set --workers and/or --etcd");
  }
  s.pool = std::make_unique<WorkerPool>(options, s.model.config, s.model_name, &s.index);
  s.pool->Start();
  return r;
}

absl::Status Router::Generate(const v1::GenerateRequest& req, const GenerateSink& sink,
                              const CallControl& ctl) {
  return impl_->Generate(req, sink, ctl);
}

absl::StatusOr<v1::TokenizeResponse> Router::Tokenize(const v1::TokenizeRequest& req) {
  RETURN_IF_ERROR(CheckModel(req.model()));
  RETURN_IF_ERROR(CheckPromptBytes("text", req.text().size(), impl_->opts.max_prompt_bytes));
  if (!IsValidUtf8(req.text())) return absl::InvalidArgumentError("text: invalid UTF-8");
  const Tokenizer& tok = *impl_->model.tokenizer;
  std::vector<int32_t> ids = tok.Encode(req.text(), req.has_add_bos() && req.add_bos());
  v1::TokenizeResponse resp;
  for (int32_t id : ids) {
    resp.add_ids(id);
    resp.add_pieces(SanitizeUtf8(tok.TokenPiece(id)));
  }
  return resp;
}

v1::ListModelsResponse Router::ListModels(const Tenant* caller) {
  v1::ListModelsResponse resp;
  v1::ModelInfo* mi = resp.add_models();
  const ModelConfig& c = impl_->model.config;
  mi->set_id(impl_->model_name);
  mi->set_context_length(c.max_seq_len);
  // Unset when the model's metadata states no context: max_seq_len is then the loader's
  // default, which a client must not take for the length the model was trained for.
  if (c.trained_context_length > 0) mi->set_trained_context_length(c.trained_context_length);
  mi->set_vocab_size(c.vocab_size);
  if (caller == nullptr || caller->admin) {
    mi->set_fingerprint(impl_->Identity().fingerprint_hex);  // "" until a worker reported it
  }
  int n = 0;
  for (auto& w : impl_->Conns()) n += (w->healthy && w->model_ok) ? 1 : 0;
  mi->set_workers(n);
  return resp;
}

v1::HealthResponse Router::Health(const Tenant* caller) {
  const bool admin = caller == nullptr || caller->admin;
  v1::HealthResponse resp;
  bool any = false;
  for (auto& c : impl_->Conns()) {
    v1::WorkerHealth* h = resp.add_workers();
    const bool ok = c->healthy && c->model_ok;
    any = any || ok;
    WorkerLoadInfo l = impl_->index.Load(c->address);
    h->set_id(admin ? c->Name() : absl::StrCat("worker-", resp.workers_size()));
    if (admin) h->set_address(c->address);
    h->set_healthy(ok);
    h->set_queue_depth(l.queue_depth);
    h->set_running(l.running);
    h->set_kv_usage(l.kv_usage());
    h->set_reuse_disabled(l.reuse_disabled);
    h->set_indexed_segments(static_cast<int>(impl_->index.Segments(c->address)));
  }
  resp.set_serving(any);
  return resp;
}

absl::Status Router::CheckModel(const std::string& model) const {
  return impl_->CheckModel(model);
}

const std::string& Router::model_name() const { return impl_->model_name; }
const openai::ChatFormat& Router::chat_format() const { return impl_->chat; }
metrics::Registry& Router::registry() { return impl_->registry; }
const RouterOptions& Router::options() const { return impl_->opts; }
Authenticator& Router::auth() { return *impl_->auth; }
void Router::Shutdown() { impl_->Stop(); }

}  // namespace sparsex::router
