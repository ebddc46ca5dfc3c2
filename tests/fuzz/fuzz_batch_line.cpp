// One JSONL line of `glm5 batch` (launcher/openai/openai_format.h): plain lines and OpenAI Batch
// lines, completions and chat (the chat formatter runs on the messages), with the tiny model's
// config and tokenizer. parse_batch_line never throws; a line it accepts runs as requests whose
// prompts are non-empty token ids inside the vocabulary and fit the context.
#include <cstdint>
#include <string>

#include "launcher/openai/openai_format.h"
#include "runtime/config.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  static const runtime::ModelConfig mc = runtime::load_config(fuzz::kData + "/tiny-a");
  static const runtime::Tokenizer tok = runtime::Tokenizer::load(fuzz::kData + "/tiny-a");
  const std::string text(reinterpret_cast<const char*>(data), size);
  launcher::BatchLine b;
  try {
    b = launcher::parse_batch_line(text, 7, mc, &tok);
  } catch (const std::exception& e) {
    fuzz::require(false, "parse_batch_line never throws");
  }
  fuzz::require(!b.key.empty(), "every line has a key");
  if (!b.error.empty()) return 0;
  fuzz::require(b.n >= 1 && b.n <= launcher::kMaxChoices, "n is within 1..kMaxChoices");
  const auto requests = launcher::choice_requests(b);
  fuzz::require(int64_t(requests.size()) == b.choices(), "one request per choice");
  for (const auto& r : requests) {
    fuzz::require(!r.prompt.empty(), "a runnable prompt has tokens");
    for (int32_t id : r.prompt) fuzz::require(id >= 0 && id < mc.vocab_size, "prompt ids are in the vocabulary");
    fuzz::require(int64_t(r.prompt.size()) + r.sampling.max_tokens <= mc.max_position_embeddings,
                  "prompt + max_tokens fit the context");
  }
  return 0;
}
