// One generation's text as its tokens arrive, with its stop strings (OpenAI `stop`): the one place
// that turns a generation's tokens into its text (special tokens skipped) and looks for stop strings
// in it. The scheduler asks it whether a generation ends at a token (it ends at the token that
// completes a stop string, which stays in token_ids); the server's streams ask what text may go out
// now; every record, batch or server, takes its final text from it, cut before the stop string.
//
// A stop string is looked for only where it can end in the newest piece, so a token costs
// O(piece + longest stop string), not a decode of the whole generation.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace glm5::runtime {

class Tokenizer;

class Detokenizer {
 public:
  // tok may be null (a model without a tokenizer): no text, and no stop string ever matches.
  Detokenizer(const Tokenizer* tok, std::vector<std::string> stops);
  // Appends the token's text; true once a stop string occurs in the text so far.
  bool feed(int32_t token);
  bool stopped() const { return stop_at_ != std::string::npos; }
  // The text so far, cut where the first stop string seen starts (the earliest one when several
  // complete with the same token): what the client gets. A generation ends at that token, so no
  // text comes after it.
  std::string_view text() const;
  // The end of the text a stream may send now: text() without a trailing unfinished UTF-8 character
  // or a tail that may be the start of a stop string (both may still change).
  size_t stable_end() const;

 private:
  const Tokenizer* tok_;
  std::vector<std::string> stops_;  // the non-empty ones
  std::string text_;                // every piece so far (as many bytes as the generation's text)
  size_t keep_ = 0;                 // longest stop string - 1: how far back a match may start
  size_t stop_at_ = std::string::npos;
  bool first_ = true;  // no piece appended yet (non-byte-level decoders join pieces with spaces)
};

// `tokens` through a Detokenizer: the final text of a generation, cut before its stop string;
// *stopped says whether one was found.
std::string final_text(const Tokenizer* tok, const std::vector<int32_t>& tokens, const std::vector<std::string>& stops,
                       bool* stopped = nullptr);

}  // namespace glm5::runtime
