// config.json and tokenizer_config.json (model/safetensors.cc: ParseConfig, ReadHfChatTemplate),
// through LoadHfInfo on a directory whose tokenizer.json is fixed (hf_fixture.h). The input is
// "<config.json>\0<tokenizer_config.json>" (no second part: no tokenizer_config.json). A model
// that loads is validated as every loader does, and its chat template (when it has one) is
// parsed and rendered as the router does for /v1/chat/completions.
#include <sys/stat.h>

#include <string>
#include <vector>

#include "model/chat_template.h"
#include "model/model_info.h"
#include "tests/fuzz/hf_fixture.h"

using namespace sparsex;

namespace {

const std::string& Dir() {
  static const std::string dir = [] {
    const std::string d = fuzz::ScratchDir() + "/hf";
    mkdir(d.c_str(), 0700);
    fuzz::WriteFile(d + "/tokenizer.json", fuzz::TinyTokenizerJson());
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = Dir();
  std::vector<std::string_view> parts =
      fuzz::Split(fuzz::AsView(data, size), std::string_view("\0", 1), 2);
  fuzz::WriteFile(dir + "/config.json", parts[0]);
  const bool has_tc = parts[0].size() < size;
  if (has_tc) {
    fuzz::WriteFile(dir + "/tokenizer_config.json", parts[1]);
  } else {
    fuzz::RemoveFile(dir + "/tokenizer_config.json");
  }
  absl::StatusOr<ModelInfo> info = LoadHfInfo(dir);
  fuzz::Report("LoadHfInfo", info.status());
  if (!info.ok()) return 0;
  const ModelConfig& c = info->config;
  if (!ValidateConfig(c).ok()) return 0;
  (void)CheckTokenizerFits(info->tokenizer.get(), c);
  if (info->chat_template.empty()) return 0;
  ChatTemplateLimits limits;
  limits.max_iterations = 1 << 16;
  limits.max_output_bytes = 1 << 20;
  absl::StatusOr<std::shared_ptr<const ChatTemplate>> t =
      ChatTemplate::Parse(info->chat_template, limits);
  fuzz::Report("ChatTemplate::Parse", t.status());
  if (!t.ok()) return 0;
  const ChatMessage messages[] = {{"system", "Be brief."}, {"user", "Hi"},
                                  {"assistant", "Hello"}, {"user", "Bye"}};
  ChatTemplateVars vars;
  vars.add_generation_prompt = true;
  vars.bos_token = info->bos_token;
  vars.eos_token = info->eos_token;
  fuzz::Report("Render", (*t)->Render(messages, vars).status());
  (void)RenderChatSpans(**t, messages, vars);
  return 0;
}
