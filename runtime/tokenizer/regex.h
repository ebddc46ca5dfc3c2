// PCRE2 regexes (UTF + UCP, JIT) with Oniguruma's \\s \\w \\h rewritten as HF means them. A part of the tokenizer
// (tokenizer.cpp), used by it alone.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/core/check.h"
#include "runtime/tokenizer/utf8.h"

namespace glm5::runtime::tok {

// ------------------------------------------------------------------------------------------------
// Regex: PCRE2 with UTF + UCP (Unicode \s \d \w and properties) and JIT.

struct MatchScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* js = nullptr;
  MatchScratch() {
    md = pcre2_match_data_create(16, nullptr);
    mc = pcre2_match_context_create(nullptr);
    js = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (mc && js) pcre2_jit_stack_assign(mc, nullptr, js);
  }
  ~MatchScratch() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mc);
    pcre2_jit_stack_free(js);
  }
};

inline MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

// HF compiles tokenizer regexes with Oniguruma. Where Oniguruma's escapes mean something else
// in PCRE2, rewrite them: \s/\S are the Unicode White_Space property (PCRE2 also counts U+180E);
// \w/\W are alphabetic chars, marks, decimal digits, connectors and, as Oniguruma has it, the
// Latin-1 numbers ² ³ ¹ ¼ ½ ¾ (PCRE2: letters and all numbers); \h/\H are hex digits (PCRE2:
// horizontal space). Checked code point by code point against tokenizers 0.22.1. Inside a class
// \W keeps PCRE2's meaning. Everything else is passed through.
constexpr const char* kOnigWord = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}";

inline std::string onig_to_pcre2(const std::string& p) {
  std::string out;
  bool in_class = false;
  size_t class_start = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[++i];
      switch (e) {
        case 's': out += "\\p{White_Space}"; break;
        case 'S': out += "\\P{White_Space}"; break;
        case 'w': out += in_class ? kOnigWord : "[" + std::string(kOnigWord) + "]"; break;
        case 'W':
          if (in_class) {
            out += "\\W";
          } else {
            out += "[^";
            out += kOnigWord;
            out += ']';
          }
          break;
        case 'h': out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]"; break;
        case 'H': out += in_class ? "\\x{0}-/:-@G-`g-\\x{10FFFF}" : "[^0-9a-fA-F]"; break;
        default: out += c; out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      class_start = out.size() + 1;
      if (i + 1 < p.size() && p[i + 1] == '^') {
        out += "[^";
        ++i;
        class_start = out.size();
      } else {
        out += c;
      }
      if (i + 1 < p.size() && p[i + 1] == ']') {  // a leading ']' is a literal
        out += ']';
        ++i;
      }
      continue;
    }
    if (in_class && c == ']' && out.size() > class_start) in_class = false;
    out += c;
  }
  return out;
}

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) : pattern_(pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    std::string translated = onig_to_pcre2(pattern);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), PCRE2_UTF | PCRE2_UCP,
                          &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      GLM5_FAIL(where, ": regex '", pattern, "' does not compile: ", reinterpret_cast<char*>(msg), " at offset ", off);
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if no JIT
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // First match in subject at or after `start`; subject must be valid UTF-8 (checked by caller).
  bool find(std::string_view subject, size_t start, size_t& ms, size_t& me) const {
    MatchScratch& s = scratch();
    int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start, PCRE2_NO_UTF_CHECK,
                         s.md, s.mc);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      GLM5_FAIL("tokenizer: regex '", pattern_, "' failed on a ", subject.size(),
                "-byte piece: ", reinterpret_cast<char*>(msg));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.md);
    ms = ov[0];
    me = ov[1];
    return true;
  }

  // All non-empty matches, left to right, non-overlapping (empty matches are skipped: they would
  // give empty pieces, which HF drops).
  template <typename F>
  void for_each_match(std::string_view subject, F&& f) const {
    size_t pos = 0, ms = 0, me = 0;
    while (pos <= subject.size() && find(subject, pos, ms, me)) {
      if (me == ms) {  // empty match: step one char past it
        if (ms >= subject.size()) break;
        size_t len = utf8_valid_len(bytes(subject), subject.size(), ms);
        pos = ms + (len ? len : 1);
        continue;
      }
      f(ms, me);
      pos = me;
    }
  }

  bool matches_whole(std::string_view subject) const {
    size_t ms, me;
    return find(subject, 0, ms, me) && ms == 0 && me == subject.size();
  }

 private:
  std::string pattern_;
  pcre2_code* code_ = nullptr;
};

// A regex that matches `literal` exactly (HF's Split/Replace with a {"String": ...} pattern).
inline std::string escape_literal(const std::string& literal) {
  std::string out;
  for (char c : literal) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace glm5::runtime::tok
