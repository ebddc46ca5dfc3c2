// Detokenizer: see detokenizer.h.
#include "runtime/detokenizer.h"

#include <algorithm>

#include "runtime/tokenizer/tokenizer.h"

namespace glm5::runtime {

Detokenizer::Detokenizer(const Tokenizer* tok, std::vector<std::string> stops) : tok_(tok), stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  for (const std::string& s : stops_) keep_ = std::max(keep_, s.size() - 1);
}

bool Detokenizer::feed(int32_t token) {
  if (!tok_) return false;
  const size_t old = text_.size();
  if (!tok_->append_decoded(text_, token, /*skip_special=*/true, first_)) return stopped();
  first_ = false;
  if (stopped()) return true;
  // A match must end in the new piece: it starts at most keep_ bytes before it.
  const size_t from = old > keep_ ? old - keep_ : 0;
  for (const std::string& s : stops_) stop_at_ = std::min(stop_at_, text_.find(s, from));
  return stopped();
}

std::string_view Detokenizer::text() const { return std::string_view(text_).substr(0, stop_at_); }

size_t Detokenizer::stable_end() const {
  if (stopped()) return stop_at_;  // nothing before the earliest stop string can change
  // Not a trailing, unfinished UTF-8 character (a lead byte and fewer continuation bytes than it
  // announces).
  size_t end = text_.size(), i = end;
  int cont = 0;
  while (i > 0 && cont < 3 && (uint8_t(text_[i - 1]) & 0xC0) == 0x80) --i, ++cont;
  if (i > 0) {
    const uint8_t lead = uint8_t(text_[i - 1]);
    const int need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    if (need > 1 && cont + 1 < need) end = i - 1;
  }
  // Nor the longest tail that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(s.size() - 1, end); k > hold; --k)
      if (text_.compare(end - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  return end - hold;
}

std::string final_text(const Tokenizer* tok, const std::vector<int32_t>& tokens, const std::vector<std::string>& stops,
                       bool* stopped) {
  Detokenizer d(tok, stops);
  for (int32_t t : tokens) d.feed(t);
  if (stopped) *stopped = d.stopped();
  return std::string(d.text());
}

}  // namespace glm5::runtime
