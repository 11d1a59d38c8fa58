// Shared by the model-loading fuzz targets (gguf_fuzz, safetensors_fuzz); apart from
// fuzz_util.h so the other targets do not see model.h's names.
#pragma once

#include <cstdint>

#include "model/model.h"

namespace sparsex::fuzz {

// Reads every tensor view of a loaded model (a sample of bytes of each, and its last byte), so
// a view that points outside its file shows up under ASan.
inline uint64_t TouchWeights(const ModelWeights& w) {
  auto touch = [](const TensorView& t) {
    uint64_t sum = 0;
    const auto* p = static_cast<const uint8_t*>(t.data);
    for (size_t i = 0; i < t.nbytes; i += 61) sum += p[i];
    if (t.nbytes > 0) sum += p[t.nbytes - 1];
    return sum;
  };
  uint64_t sum = touch(w.tok_embeddings) + touch(w.final_norm) + touch(w.output);
  for (const LayerWeights& l : w.layers) {
    for (const TensorView* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate,
                                &l.w_up, &l.w_down}) {
      sum += touch(*t);
    }
  }
  return sum;
}

}  // namespace sparsex::fuzz
