// UTF-8: well-formed sequences, code points, and GPT-2's byte-to-code-point map. A part of the tokenizer
// (tokenizer.cpp), used by it alone.
#pragma once

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

namespace glm5::runtime::tok {

// ------------------------------------------------------------------------------------------------
// UTF-8

// Length (1..4) of the well-formed UTF-8 sequence starting at s[i], or 0 if none starts there
// (stray continuation byte, truncated sequence, overlong form, surrogate, > U+10FFFF).
inline size_t utf8_valid_len(const unsigned char* s, size_t n, size_t i) {
  unsigned char c = s[i];
  if (c < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + len > n) return 0;
  if (s[i + 1] < lo || s[i + 1] > hi) return 0;
  for (size_t k = 2; k < len; ++k)
    if ((s[i + k] & 0xC0) != 0x80) return 0;
  return len;
}

inline uint32_t decode_cp(const unsigned char* s, size_t len) {
  switch (len) {
    case 1: return s[0];
    case 2: return ((s[0] & 0x1Fu) << 6) | (s[1] & 0x3Fu);
    case 3: return ((s[0] & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu);
    default: return ((s[0] & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) | (s[3] & 0x3Fu);
  }
}

inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

inline const unsigned char* bytes(std::string_view s) { return reinterpret_cast<const unsigned char*>(s.data()); }

// First / last code point of s; false when s is empty or does not start / end with a valid char.
inline bool first_cp(std::string_view s, uint32_t& cp) {
  if (s.empty()) return false;
  size_t len = utf8_valid_len(bytes(s), s.size(), 0);
  if (len == 0) return false;
  cp = decode_cp(bytes(s), len);
  return true;
}
inline bool last_cp(std::string_view s, uint32_t& cp, size_t& start) {
  for (size_t back = 1; back <= 4 && back <= s.size(); ++back) {
    size_t i = s.size() - back;
    unsigned char c = bytes(s)[i];
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep stepping back
    size_t len = utf8_valid_len(bytes(s), s.size(), i);
    if (len != back) return false;
    cp = decode_cp(bytes(s) + i, len);
    start = i;
    return true;
  }
  return false;
}

// GPT-2's reversible byte <-> printable-char map: printable Latin-1 bytes map to themselves, the
// other 68 bytes to U+0100.. in byte order.
inline std::array<uint32_t, 256> make_byte_to_cp() {
  std::array<uint32_t, 256> m{};
  std::array<bool, 256> direct{};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) m[b] = direct[b] ? uint32_t(b) : next++;
  return m;
}

}  // namespace glm5::runtime::tok
