// A tokenizer.json (runtime/tokenizer/): vocabulary, merges, added tokens, normalizer,
// pre-tokenizer and decoder as a Hugging Face repository could hold them. What loads must encode
// and decode a fixed text with every id inside its vocabulary.
#include <cstdint>
#include <string>

#include "runtime/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  const std::string path = fuzz::write_scratch("tokenizer.json", {reinterpret_cast<const char*>(data), size});
  fuzz::expect_clean("Tokenizer::load", [&] {
    const runtime::Tokenizer tok = runtime::Tokenizer::load(path);
    const std::string text = "Hello, world! 12345 <|user|>\n\tünïcödé 你好 \xff\xfe  end";
    for (bool special : {true, false}) {
      const auto ids = tok.encode(text, special);
      for (int32_t id : ids) fuzz::require(id >= 0 && id < tok.vocab_size(), "ids are inside the vocabulary");
      tok.decode(ids, false);
      tok.decode(ids, true);
    }
  });
  return 0;
}
