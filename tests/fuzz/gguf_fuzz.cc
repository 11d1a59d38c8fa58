// The GGUF parser (model/gguf.cc): the input is a .gguf file, loaded both ways a process reads
// one: LoadGgufInfo (the router: metadata and tensor infos from a prefix, tokenizer, chat
// template) and LoadGguf (the worker: mapped weights, shapes, finiteness, fingerprint). A model
// that loads is then used: its tokenizer encodes and decodes text, and FinalizeModel's views are
// read whole (ASan checks that every view lies inside the mapping).
#include <string>
#include <vector>

#include "model/model.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/weights.h"

using namespace sparsex;

namespace {

void UseTokenizer(const Tokenizer& tok) {
  static const char* const kTexts[] = {"Once upon a time", " hello\n\nworld ",
                                       "\xff\xfe bad utf8 \xe2\x96", "<s></s><unk>", ""};
  for (const char* text : kTexts) {
    for (bool special : {false, true}) {
      std::vector<int32_t> ids = tok.Encode(text, /*add_bos=*/true, special);
      (void)tok.Decode(ids);
    }
  }
  const int32_t n = tok.vocab_size();
  std::vector<int32_t> all;
  for (int32_t id = -1; id <= n && id < 4096; ++id) {
    all.push_back(id);
    (void)tok.TokenPiece(id);
    (void)tok.IsSpecial(id);
  }
  (void)tok.Decode(all);
  (void)tok.StopIds();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::ScratchDir() + "/model.gguf";
  fuzz::WriteFile(path, fuzz::AsView(data, size));
  absl::StatusOr<ModelInfo> info = LoadGgufInfo(path);
  fuzz::Report("LoadGgufInfo", info.status());
  if (info.ok()) UseTokenizer(*info->tokenizer);
  absl::StatusOr<std::unique_ptr<Model>> m = LoadGguf(path);
  fuzz::Report("LoadGguf", m.status());
  if (m.ok()) {
    const ModelWeights& w = (*m)->weights();
    const uint64_t sum = fuzz::TouchWeights(w);
    std::vector<float> row(static_cast<size_t>(w.final_norm.numel()));
    w.final_norm.ToF32(row.data());
    UseTokenizer((*m)->tokenizer());
    fuzz::Sink(sum);
  }
  return 0;
}
