// Incremental stop-string matching: each generated token's text is appended once and only the
// tail that can still complete a stop string is kept, so a check costs O(token text + longest
// stop string) instead of re-decoding the whole generation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace glm5::runtime {

class Tokenizer;

class StopMatcher {
 public:
  StopMatcher(std::vector<std::string> stops, const Tokenizer* tok);
  // Appends the token's text (special tokens skipped, as the output text skips them); true once
  // any stop string occurs in the text generated so far.
  bool feed(int32_t token);

 private:
  std::vector<std::string> stops_;
  const Tokenizer* tok_;
  std::string tail_;   // the last (longest stop - 1) bytes of the text, plus the new piece
  size_t keep_ = 0;    // longest stop string - 1
  bool first_ = true;  // no piece appended yet (non-byte-level decoders join pieces with spaces)
};

}  // namespace glm5::runtime
