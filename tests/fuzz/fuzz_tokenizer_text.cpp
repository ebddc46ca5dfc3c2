// Text through DeepSeek-V3's byte-level BPE tokenizer (GLM-5's is the same kind): any bytes,
// valid UTF-8 or not, with and without special-token parsing. The tokenizer promises
// decode(encode(s)) == s for any byte string, ids inside the vocabulary, and append_decoded id by
// id joining to decode's bytes (what streaming relies on). The tokenizer is loaded once, so its word
// cache carries over between inputs, as in a server (a finding may then need the inputs before it
// to repeat; run the target over the corpus it was found with).
#include <cstdint>
#include <string>
#include <string_view>

#include "runtime/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  static const runtime::Tokenizer tok = runtime::Tokenizer::load(fuzz::kData + "/tokenizer/deepseek_v3");
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean("Tokenizer::encode", [&] {
    for (bool special : {false, true}) {
      const auto ids = tok.encode(text, special);
      for (int32_t id : ids) fuzz::require(id >= 0 && id < tok.vocab_size(), "ids are inside the vocabulary");
      const std::string back = tok.decode(ids);
      if (!special) fuzz::require(back == text, "decode(encode(s)) == s");
      std::string joined;
      bool first = true;
      for (int32_t id : ids) first = !tok.append_decoded(joined, id, false, first) && first;
      fuzz::require(joined == back, "append_decoded id by id joins to decode");
    }
  });
  return 0;
}
