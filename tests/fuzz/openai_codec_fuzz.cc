// The OpenAI JSON codec of the HTTP front end (router/openai_codec.h): the input's first byte
// picks the endpoint (bit 0: /v1/chat/completions) and the chat format (bit 1: a chat template
// on the synthetic "tiny" model's numeric tokenizer, else none); the rest is the request body.
// A parse must succeed or be INVALID_ARGUMENT (UNIMPLEMENTED only without a usable template); a
// request that parses is answered: its stop strings filter a streamed text, and the response
// and chunks are built and serialised.
#include <cstdlib>
#include <string>

#include "model/model_info.h"
#include "router/openai_codec.h"
#include "tests/fuzz/fuzz_util.h"

using namespace sparsex;
namespace oa = sparsex::router::openai;

namespace {

struct Formats {
  ModelInfo model;
  oa::ChatFormat with_template;
};

const Formats& Get() {
  static const Formats* f = [] {
    auto* out = new Formats;
    auto m = LoadModelInfo("synthetic:tiny");
    if (!m.ok()) std::abort();
    out->model = std::move(*m);
    out->model.chat_template =
        "{{ bos_token }}{% for m in messages %}"
        "{% if m.role == 'system' %}900 {% elif m.role == 'user' %}901 {% else %}902 {% endif %}"
        "{{ m.content | trim }} 903 {% endfor %}"
        "{% if add_generation_prompt %}902 {% endif %}";
    out->model.bos_token = "7 ";
    out->model.eos_token = "8 ";
    out->with_template = oa::MakeChatFormat(out->model);
    if (!out->with_template.template_error.ok()) std::abort();
    return out;
  }();
  return *f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Formats& f = Get();
  const bool chat = data[0] & 1;
  const oa::ChatFormat* format = (data[0] & 2) ? &f.with_template : nullptr;
  const std::string_view body = fuzz::AsView(data + 1, size - 1);
  absl::StatusOr<oa::Request> r =
      oa::ParseRequest(body, chat ? oa::Endpoint::kChat : oa::Endpoint::kCompletions, format);
  fuzz::Report("ParseRequest", r.status());
  if (!r.ok()) {
    const absl::StatusCode code = r.status().code();
    if (code != absl::StatusCode::kInvalidArgument &&
        !(code == absl::StatusCode::kUnimplemented && format == nullptr)) {
      std::abort();
    }
    (void)oa::ErrorParam(r.status());
    return 0;
  }
  // Stream the body back through the stop filter in 3-byte pieces.
  oa::StopFilter stop(r->stop);
  std::string out;
  for (size_t i = 0; i < body.size() && !stop.stopped(); i += 3) {
    const bool final = i + 3 >= body.size();
    out += stop.Push(std::string(body.substr(i, 3)), final);
  }
  if (out.size() > body.size()) std::abort();  // a filter only ever holds back or cuts
  oa::ResponseMeta meta{"cmpl-1", 1, "tiny", chat};
  v1::Usage usage;
  usage.set_prompt_tokens(3);
  usage.set_completion_tokens(2);
  std::string s = oa::Response(meta, out, "stop", usage, "w0").dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
  s += oa::StreamChunk(meta, out).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  s += oa::StreamRoleChunk(meta).dump();
  s += oa::StreamUsageChunk(meta, usage, "w0").dump();
  (void)r->req.SerializeAsString();
  fuzz::Sink(s.size());
  return 0;
}
