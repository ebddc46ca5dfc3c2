// The Detokenizer (runtime/detokenizer.h) against plain references written from its contract: the
// text is the whole decode cut before the earliest occurrence of any stop string; a stop is seen at
// the first token whose text completes one; a stream's stable end never holds an unfinished UTF-8
// character or a tail that may start a stop string, and what it lets out is a prefix of the final
// text.
#include "runtime/detokenizer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"

namespace {

using glm5::runtime::Detokenizer;
using glm5::runtime::Tokenizer;

const Tokenizer& tiny_tokenizer() {
  static const Tokenizer tok = Tokenizer::load(std::string(GLM5_TEST_DATA) + "/tiny-a");
  return tok;
}

// The earliest occurrence of any non-empty stop in `text` (npos: none).
size_t earliest_stop(const std::string& text, const std::vector<std::string>& stops) {
  size_t at = std::string::npos;
  for (const std::string& s : stops)
    if (!s.empty()) at = std::min(at, text.find(s));
  return at;
}

// The stable end by its definition: the largest e <= the earliest stop such that, when no stop
// occurred yet, text[0, e) does not end inside a UTF-8 character and text[j, e) is no proper prefix of
// a stop for any j < e.
size_t reference_stable_end(const std::string& text, const std::vector<std::string>& stops) {
  if (size_t at = earliest_stop(text, stops); at != std::string::npos) return at;
  size_t end = text.size();
  // Back over an unfinished character: a lead byte with fewer continuation bytes than it announces.
  for (size_t i = text.size(); i > 0 && i + 4 > text.size(); --i) {
    const uint8_t b = uint8_t(text[i - 1]);
    if ((b & 0xC0) == 0x80) continue;
    const size_t need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    if (text.size() - (i - 1) < need) end = i - 1;
    break;
  }
  size_t hold = 0;
  for (const std::string& s : stops)
    for (size_t k = 1; k < s.size() && k <= end; ++k)
      if (text.compare(end - k, k, s, 0, k) == 0) hold = std::max(hold, k);
  return end - hold;
}

TEST(Detokenizer, StopsAtTheFirstTokenThatCompletesAStopString) {
  const Tokenizer& tok = tiny_tokenizer();
  const std::string text = "hello world, this is a test of stop strings";
  const std::vector<int32_t> ids = tok.encode(text, false);
  for (const std::string stop : {"world", "o w", "s s", "strings", "zzz", "t"}) {
    Detokenizer d(&tok, {stop});
    std::vector<int32_t> so_far;
    int fired_at = -1;
    for (size_t i = 0; i < ids.size(); ++i) {
      so_far.push_back(ids[i]);
      const bool naive = tok.decode(so_far, true).find(stop) != std::string::npos;
      const bool fast = d.feed(ids[i]);
      EXPECT_EQ(fast, naive) << "stop '" << stop << "' at token " << i;
      if (fast && fired_at < 0) fired_at = int(i);
    }
    EXPECT_EQ(fired_at >= 0, text.find(stop) != std::string::npos) << stop;
  }
}

// Several stops at once, multi-byte characters split over tokens, special tokens skipped: at every
// token, text() is the decode cut at the earliest stop and stable_end() is the reference's.
TEST(Detokenizer, TextAndStableEndMatchTheirDefinitionsTokenByToken) {
  const Tokenizer& tok = tiny_tokenizer();
  const std::vector<std::string> texts = {
      "caf\xC3\xA9 na\xC3\xAFve \xE2\x82\xAC 5 \xF0\x9F\x98\x80 and more caf\xC3\xA9",
      "the thing then the other, then three", "aaaa abab aab abc ab"};
  const std::vector<std::vector<std::string>> stop_sets = {
      {}, {"the"}, {"then", "the o"}, {"\xC3\xA9 n", "\xF0\x9F\x98"}, {"abc", "aab", ""}, {"zz", "e t"}};
  for (const std::string& text : texts) {
    std::vector<int32_t> ids = tok.encode(text, false);
    const int32_t special = tok.token_id("<|assistant|>");  // skipped in the text
    ASSERT_GE(special, 0);
    ids.insert(ids.begin() + int64_t(ids.size() / 2), special);
    for (const auto& stops : stop_sets) {
      Detokenizer d(&tok, stops);
      std::vector<int32_t> so_far;
      size_t sent = 0;
      for (int32_t id : ids) {
        so_far.push_back(id);
        d.feed(id);
        const std::string whole = tok.decode(so_far, true);
        const size_t cut = earliest_stop(whole, stops);
        ASSERT_EQ(std::string(d.text()), whole.substr(0, cut)) << text;
        ASSERT_EQ(d.stable_end(), reference_stable_end(whole, stops)) << text << " after " << so_far.size();
        ASSERT_GE(d.stable_end(), sent) << "a stable end went back: " << text;
        sent = d.stable_end();
      }
      EXPECT_EQ(glm5::runtime::final_text(&tok, ids, stops), std::string(d.text()));
    }
  }
}

TEST(Detokenizer, WithoutATokenizerHasNoTextAndNeverStops) {
  Detokenizer d(nullptr, {"a"});
  EXPECT_FALSE(d.feed(5));
  EXPECT_EQ(d.text(), "");
  EXPECT_EQ(d.stable_end(), 0u);
  bool stopped = true;
  EXPECT_EQ(glm5::runtime::final_text(nullptr, {1, 2}, {"a"}, &stopped), "");
  EXPECT_FALSE(stopped);
}

}  // namespace
