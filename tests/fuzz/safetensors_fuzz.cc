// safetensors headers and the shard index (model/safetensors.cc), through LoadHfDirectory on a
// directory whose config.json and tokenizer.json are fixed (hf_fixture.h: one layer, hidden 4,
// vocabulary 256). The input is either one model.safetensors file, or, when it starts with '{',
// "<model.safetensors.index.json>\n--shard--\n<model-00001.safetensors>\n--shard--\n
// <model-00002.safetensors>". A model that loads has every tensor view read whole.
#include <sys/stat.h>

#include <string>
#include <vector>

#include "model/model.h"
#include "tests/fuzz/hf_fixture.h"
#include "tests/fuzz/weights.h"

using namespace sparsex;

namespace {

const std::string& Dir() {
  static const std::string dir = [] {
    const std::string d = fuzz::ScratchDir() + "/hf";
    mkdir(d.c_str(), 0700);
    fuzz::WriteFile(d + "/config.json", fuzz::kTinyConfigJson);
    fuzz::WriteFile(d + "/tokenizer.json", fuzz::TinyTokenizerJson());
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = Dir();
  const std::string_view in = fuzz::AsView(data, size);
  const std::string single = dir + "/model.safetensors", index = dir + "/model.safetensors.index.json";
  const std::string shard1 = dir + "/model-00001.safetensors", shard2 = dir + "/model-00002.safetensors";
  if (!in.empty() && in[0] == '{') {
    std::vector<std::string_view> parts = fuzz::Split(in, "\n--shard--\n", 3);
    fuzz::RemoveFile(single);
    fuzz::WriteFile(index, parts[0]);
    fuzz::WriteFile(shard1, parts[1]);
    fuzz::WriteFile(shard2, parts[2]);
  } else {
    fuzz::RemoveFile(index);
    fuzz::WriteFile(single, in);
  }
  absl::StatusOr<std::unique_ptr<Model>> m = LoadHfDirectory(dir);
  fuzz::Report("LoadHfDirectory", m.status());
  if (m.ok()) {
    const ModelWeights& w = (*m)->weights();
    const uint64_t sum = fuzz::TouchWeights(w);
    std::vector<float> row(static_cast<size_t>(w.tok_embeddings.numel()));
    w.tok_embeddings.ToF32(row.data());
    fuzz::Sink(sum);
  }
  return 0;
}
