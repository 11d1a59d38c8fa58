// tokenizer.json (model/tokenizer/hf_tokenizer.cc): the input is "<tokenizer.json>\0<text>"; the
// JSON is parsed (ParseHfTokenizer: size and depth limits, vocabulary, merges, added tokens,
// pre-tokenizer regexes) and, when it loads, the text is encoded with and without special
// tokens and the ids decoded again, piece by piece too.
#include <string>
#include <vector>

#include "model/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

using namespace sparsex;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string_view> parts = fuzz::Split(fuzz::AsView(data, size), std::string_view("\0", 1), 2);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = ParseHfTokenizer(parts[0]);
  fuzz::Report("ParseHfTokenizer", tok.status());
  if (!tok.ok()) return 0;
  const Tokenizer& t = **tok;
  const std::string_view text = parts[1].substr(0, 4096);
  for (bool special : {false, true}) {
    for (bool bos : {false, true}) {
      std::vector<int32_t> ids = t.Encode(text, bos, special);
      for (int32_t id : ids) {
        if (id < 0 || id >= t.vocab_size()) std::abort();  // Encode never yields a bad id
        (void)t.TokenPiece(id);
      }
      (void)t.Decode(ids);
    }
  }
  std::vector<int32_t> some = {-1, 0, t.bos_id(), t.eos_id(), t.vocab_size() - 1, t.vocab_size()};
  (void)t.Decode(some);
  for (int32_t id : some) (void)t.IsSpecial(id);
  (void)t.StopIds();
  return 0;
}
