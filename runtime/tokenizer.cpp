// Byte-level BPE tokenizer from a Hugging Face tokenizer.json, step by step as HF `tokenizers`:
// added tokens are cut out (raw, then normalized text), the rest is normalized, pre-tokenized
// (regex splits, byte-level mapping) and BPE-merged by rank. Regexes are PCRE2 (UTF+UCP, JIT) with
// Oniguruma's \s \w \h rewritten to mean what they mean in HF; chars newer than PCRE2's Unicode
// tables may still split differently. Not here: offsets, Unicode normalization.
#include "runtime/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "kernels/core/check.h"

namespace glm5::runtime {
namespace {

using json = nlohmann::json;

// ------------------------------------------------------------------------------------------------
// UTF-8

// Length (1..4) of the well-formed UTF-8 sequence starting at s[i], or 0 if none starts there
// (stray continuation byte, truncated sequence, overlong form, surrogate, > U+10FFFF).
size_t utf8_valid_len(const unsigned char* s, size_t n, size_t i) {
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

uint32_t decode_cp(const unsigned char* s, size_t len) {
  switch (len) {
    case 1:
      return s[0];
    case 2:
      return ((s[0] & 0x1Fu) << 6) | (s[1] & 0x3Fu);
    case 3:
      return ((s[0] & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu);
    default:
      return ((s[0] & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) | (s[3] & 0x3Fu);
  }
}

void append_utf8(std::string& out, uint32_t cp) {
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

const unsigned char* bytes(std::string_view s) { return reinterpret_cast<const unsigned char*>(s.data()); }

// First / last code point of s; false when s is empty or does not start / end with a valid char.
bool first_cp(std::string_view s, uint32_t& cp) {
  if (s.empty()) return false;
  size_t len = utf8_valid_len(bytes(s), s.size(), 0);
  if (len == 0) return false;
  cp = decode_cp(bytes(s), len);
  return true;
}
bool last_cp(std::string_view s, uint32_t& cp, size_t& start) {
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
std::array<uint32_t, 256> make_byte_to_cp() {
  std::array<uint32_t, 256> m{};
  std::array<bool, 256> direct{};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) m[b] = direct[b] ? uint32_t(b) : next++;
  return m;
}

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

MatchScratch& scratch() {
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

std::string onig_to_pcre2(const std::string& p) {
  std::string out;
  bool in_class = false;
  size_t class_start = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[++i];
      switch (e) {
        case 's':
          out += "\\p{White_Space}";
          break;
        case 'S':
          out += "\\P{White_Space}";
          break;
        case 'w':
          out += in_class ? kOnigWord : "[" + std::string(kOnigWord) + "]";
          break;
        case 'W':
          if (in_class) {
            out += "\\W";
          } else {
            out += "[^";
            out += kOnigWord;
            out += ']';
          }
          break;
        case 'h':
          out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
          break;
        case 'H':
          out += in_class ? "\\x{0}-/:-@G-`g-\\x{10FFFF}" : "[^0-9a-fA-F]";
          break;
        default:
          out += c;
          out += e;
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
std::string escape_literal(const std::string& literal) {
  std::string out;
  for (char c : literal) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// JSON access with messages that name the file and the field.

struct JsonCtx {
  std::string file;
  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    GLM5_FAIL("tokenizer '", file, "': ", field, ": ", what);
  }
  const json& member(const json& obj, const std::string& key, const std::string& field) const {
    if (!obj.is_object()) fail(field, "expected an object, found " + std::string(obj.type_name()));
    auto it = obj.find(key);
    if (it == obj.end()) fail(field + "." + key, "missing");
    return *it;
  }
  std::string str(const json& obj, const std::string& key, const std::string& field) const {
    const json& v = member(obj, key, field);
    if (!v.is_string()) fail(field + "." + key, std::string("expected a string, found ") + v.type_name());
    return v.get<std::string>();
  }
  bool flag(const json& obj, const std::string& key, bool dflt, const std::string& field) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) fail(field + "." + key, std::string("expected true/false, found ") + it->type_name());
    return it->get<bool>();
  }
  // A Split/Replace pattern: {"Regex": "..."} or {"String": "..."} -> regex source.
  std::string pattern(const json& obj, const std::string& field) const {
    const json& p = member(obj, "pattern", field);
    if (p.is_object() && p.contains("Regex") && p["Regex"].is_string()) return p["Regex"].get<std::string>();
    if (p.is_object() && p.contains("String") && p["String"].is_string())
      return escape_literal(p["String"].get<std::string>());
    fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}, found " + p.dump());
  }
};

// ------------------------------------------------------------------------------------------------
// Normalizer: a Sequence of Replace and Prepend (no Unicode normalization or case folding).

struct NormOp {
  enum Kind { kReplace, kPrepend } kind;
  std::unique_ptr<Regex> re;  // kReplace
  std::string text;           // replacement (kReplace) or prefix (kPrepend)
};

void parse_normalizer(const JsonCtx& ctx, const json& j, const std::string& field, std::vector<NormOp>& ops) {
  if (j.is_null()) return;
  std::string type = ctx.str(j, "type", field);
  if (type == "Sequence") {
    const json& list = ctx.member(j, "normalizers", field);
    if (!list.is_array()) ctx.fail(field + ".normalizers", "expected a list");
    for (size_t i = 0; i < list.size(); ++i)
      parse_normalizer(ctx, list[i], field + ".normalizers[" + std::to_string(i) + "]", ops);
  } else if (type == "Replace") {
    auto re = std::make_unique<Regex>(ctx.pattern(j, field), "tokenizer '" + ctx.file + "': " + field);
    ops.push_back(NormOp{NormOp::kReplace, std::move(re), ctx.str(j, "content", field)});
  } else if (type == "Prepend") {
    ops.push_back(NormOp{NormOp::kPrepend, nullptr, ctx.str(j, "prepend", field)});
  } else {
    ctx.fail(field, "normalizer type '" + type +
                        "' is not supported (supported: Sequence, Replace, Prepend; no Unicode "
                        "normalization or case folding)");
  }
}

std::string apply_normalizer(const std::vector<NormOp>& ops, std::string_view in) {
  std::string cur(in);
  for (const NormOp& op : ops) {
    if (op.kind == NormOp::kPrepend) {
      if (!cur.empty()) cur = op.text + cur;
    } else {
      std::string out;
      size_t last = 0;
      op.re->for_each_match(cur, [&](size_t s, size_t e) {
        out.append(cur, last, s - last);
        out += op.text;
        last = e;
      });
      out.append(cur, last, std::string::npos);
      cur = std::move(out);
    }
  }
  return cur;
}

// ------------------------------------------------------------------------------------------------
// Pre-tokenizer stages.

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Stage {
  enum Kind { kSplit, kByteLevel } kind;
  std::unique_ptr<Regex> re;  // kSplit, or the GPT-2 regex for kByteLevel with use_regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
};

constexpr const char* kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

Behavior parse_behavior(const JsonCtx& ctx, const std::string& b, const std::string& field) {
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  ctx.fail(field + ".behavior", "unknown split behavior '" + b + "'");
}

void parse_pre_tokenizer(const JsonCtx& ctx, const json& j, const std::string& field, std::vector<Stage>& stages) {
  if (j.is_null()) return;
  std::string type = ctx.str(j, "type", field);
  std::string where = "tokenizer '" + ctx.file + "': " + field;
  if (type == "Sequence") {
    const json& list = ctx.member(j, "pretokenizers", field);
    if (!list.is_array()) ctx.fail(field + ".pretokenizers", "expected a list");
    for (size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(ctx, list[i], field + ".pretokenizers[" + std::to_string(i) + "]", stages);
  } else if (type == "Split") {
    Stage s{Stage::kSplit, std::make_unique<Regex>(ctx.pattern(j, field), where)};
    s.behavior = parse_behavior(ctx, ctx.str(j, "behavior", field), field);
    s.invert = ctx.flag(j, "invert", false, field);
    stages.push_back(std::move(s));
  } else if (type == "Digits") {
    // Each numeric char (Rust char::is_numeric = \p{N}) is a match: alone, or runs merged.
    Stage s{Stage::kSplit, std::make_unique<Regex>("\\p{N}", where)};
    s.behavior = ctx.flag(j, "individual_digits", false, field) ? Behavior::kIsolated : Behavior::kContiguous;
    stages.push_back(std::move(s));
  } else if (type == "ByteLevel") {
    Stage s{Stage::kByteLevel, nullptr};
    s.add_prefix_space = ctx.flag(j, "add_prefix_space", true, field);
    if (ctx.flag(j, "use_regex", true, field)) s.re = std::make_unique<Regex>(kGpt2Regex, where);
    stages.push_back(std::move(s));
  } else {
    ctx.fail(field,
             "pre_tokenizer type '" + type + "' is not supported (supported: Sequence, Split, Digits, ByteLevel)");
  }
}

struct Span {
  uint32_t off, len;
};

// HF's SplitDelimiterBehavior applied to the (offset, is_match) pieces covering `text`.
void split_piece(const Stage& st, std::string_view text, uint32_t base, std::vector<Span>& out) {
  struct P {
    uint32_t s, e;
    bool m;
  };
  thread_local std::vector<P> parts;
  parts.clear();
  uint32_t prev = 0;
  st.re->for_each_match(text, [&](size_t s, size_t e) {
    if (prev != s) parts.push_back({prev, uint32_t(s), st.invert});
    parts.push_back({uint32_t(s), uint32_t(e), !st.invert});
    prev = uint32_t(e);
  });
  if (prev != text.size()) parts.push_back({prev, uint32_t(text.size()), st.invert});

  auto emit = [&](uint32_t s, uint32_t e) {
    if (e > s) out.push_back({base + s, e - s});
  };
  switch (st.behavior) {
    case Behavior::kIsolated:
      for (const P& p : parts) emit(p.s, p.e);
      break;
    case Behavior::kRemoved:
      for (const P& p : parts)
        if (!p.m) emit(p.s, p.e);
      break;
    case Behavior::kMergedWithPrevious: {
      thread_local std::vector<P> acc;
      acc.clear();
      bool prev_match = false;
      for (const P& p : parts) {
        if (p.m && !prev_match && !acc.empty())
          acc.back().e = p.e;
        else
          acc.push_back(p);
        prev_match = p.m;
      }
      for (const P& p : acc) emit(p.s, p.e);
      break;
    }
    case Behavior::kMergedWithNext: {
      thread_local std::vector<P> acc;
      acc.clear();
      bool prev_match = false;
      for (size_t i = parts.size(); i-- > 0;) {
        const P& p = parts[i];
        if (p.m && !prev_match && !acc.empty())
          acc.back().s = p.s;
        else
          acc.push_back(p);
        prev_match = p.m;
      }
      for (size_t i = acc.size(); i-- > 0;) emit(acc[i].s, acc[i].e);
      break;
    }
    case Behavior::kContiguous: {
      thread_local std::vector<P> acc;
      acc.clear();
      bool prev_match = false;
      for (const P& p : parts) {
        if (p.m == prev_match && !acc.empty())
          acc.back().e = p.e;
        else
          acc.push_back(p);
        prev_match = p.m;
      }
      for (const P& p : acc) emit(p.s, p.e);
      break;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Hash maps keyed by std::string, looked up with std::string_view.

struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StrMap = std::unordered_map<std::string, V, SvHash, std::equal_to<>>;

// ------------------------------------------------------------------------------------------------
// BPE model.

// (left id, right id) -> (rank, merged id), open addressing in a power-of-two table: one probe
// sequence per lookup instead of std::unordered_map's modulo and node chasing (this lookup is the
// inner loop of BPE).
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0, new_id = 0;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Entry{});
    shift_ = 64 - __builtin_ctzll(cap);
  }
  void set(int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    uint64_t key = pack(a, b);
    for (size_t i = slot(key);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == kEmpty || slots_[i].key == key) {
        slots_[i] = Entry{key, rank, new_id};  // a repeated pair: the later rank wins, as in HF
        return;
      }
    }
  }
  const Entry* find(int32_t a, int32_t b) const {
    uint64_t key = pack(a, b);
    for (size_t i = slot(key);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == key) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t pack(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  size_t slot(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Entry> slots_;
  int shift_ = 60;
};

// Finished words -> ids, shared by all threads of one tokenizer (HF keeps the same kind of cache).
// Open addressing on a 64-bit hash; keys and ids live in two arenas. When full it starts over.
class WordCache {
 public:
  static constexpr size_t kMaxWord = 256;  // longer pieces are not cached

  bool find(std::string_view key, uint64_t h, std::vector<int32_t>& out) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (slots_.empty()) return false;
    for (size_t i = h & kMask;; i = (i + 1) & kMask) {
      const Slot& s = slots_[i];
      if (s.hash == 0) return false;
      if (s.hash == h && s.key_len == key.size() &&
          std::memcmp(keys_.data() + s.key_off, key.data(), key.size()) == 0) {
        out.insert(out.end(), ids_.begin() + s.ids_off, ids_.begin() + s.ids_off + s.n_ids);
        return true;
      }
    }
  }
  void insert(std::string_view key, uint64_t h, const int32_t* ids, size_t n) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (slots_.empty()) slots_.resize(kSlots);  // allocated on first use
    if (count_ * 2 >= kSlots || ids_.size() + n > kMaxIds) {
      std::fill(slots_.begin(), slots_.end(), Slot{});
      keys_.clear();
      ids_.clear();
      count_ = 0;
    }
    size_t i = h & kMask;
    while (slots_[i].hash != 0) {
      if (slots_[i].hash == h && slots_[i].key_len == key.size() &&
          std::memcmp(keys_.data() + slots_[i].key_off, key.data(), key.size()) == 0)
        return;  // another thread got there first
      i = (i + 1) & kMask;
    }
    slots_[i] = Slot{h, uint32_t(keys_.size()), uint32_t(key.size()), uint32_t(ids_.size()), uint32_t(n)};
    keys_.append(key);
    ids_.insert(ids_.end(), ids, ids + n);
    ++count_;
  }
  static uint64_t hash(std::string_view key) {
    uint64_t h = std::hash<std::string_view>{}(key);
    return h ? h : 1;  // 0 marks an empty slot
  }

 private:
  static constexpr size_t kSlots = size_t(1) << 18, kMask = kSlots - 1, kMaxIds = size_t(1) << 22;
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, key_len = 0, ids_off = 0, n_ids = 0;
  };
  mutable std::mutex mu_;
  mutable std::vector<Slot> slots_;
  mutable std::string keys_;
  mutable std::vector<int32_t> ids_;
  mutable size_t count_ = 0;
};

struct Bpe {
  StrMap<int32_t> vocab;
  std::vector<std::string> id_to_token;  // "" where the model has no token
  MergeTable merges;
  std::vector<int32_t> small_char_id;      // id of each single-char token below U+0800
  std::array<int32_t, 256> byte_id{};      // byte-level: id of the printable char of each byte
  std::array<std::string, 256> byte_char;  // byte-level: that char in UTF-8
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  WordCache cache;

  int32_t lookup(std::string_view s) const {
    auto it = vocab.find(s);
    return it == vocab.end() ? -1 : it->second;
  }

  // A pre-tokenized piece of text: its chars are the initial symbols (HF BPE::tokenize).
  void tokenize(std::string_view word, std::vector<int32_t>& out) const { tokenize_impl(word, false, out); }
  // A piece of raw bytes under a byte-level pre-tokenizer: byte b's initial symbol is the token
  // of its printable char, so the mapped string need not be built. Same ids as
  // tokenize(map(word)).
  void tokenize_bytes(std::string_view raw, std::vector<int32_t>& out) const { tokenize_impl(raw, true, out); }

 private:
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };

  void tokenize_impl(std::string_view word, bool raw_bytes, std::vector<int32_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      int32_t id = -1;
      if (raw_bytes) {
        std::string mapped;
        for (char c : word) mapped += byte_char[static_cast<unsigned char>(c)];
        id = lookup(mapped);
      } else {
        id = lookup(word);
      }
      if (id >= 0) {
        out.push_back(id);
        return;
      }
    }
    if (raw_bytes && word.size() == 1) {  // a lone byte: its symbol, nothing to merge
      if (int32_t id = byte_id[static_cast<unsigned char>(word[0])]; id >= 0) {
        out.push_back(id);
        return;
      }
    }
    const bool cacheable = word.size() <= WordCache::kMaxWord;
    uint64_t h = 0;
    if (cacheable) {
      h = WordCache::hash(word);
      if (cache.find(word, h, out)) return;
    }
    size_t first = out.size();
    thread_local std::vector<Sym> syms;
    syms.clear();
    if (raw_bytes)
      initial_bytes(word, syms);
    else
      initial_chars(word, syms);
    merge_all(syms);
    for (const Sym& s : syms)
      if (s.alive) out.push_back(s.id);
    if (cacheable) cache.insert(word, h, out.data() + first, out.size() - first);
  }

  static void push_sym(std::vector<Sym>& syms, int32_t id) {
    int32_t n = int32_t(syms.size());
    syms.push_back({id, n - 1, n + 1, true});
  }

  void initial_bytes(std::string_view word, std::vector<Sym>& syms) const {
    for (char c : word) {
      int32_t id = byte_id[static_cast<unsigned char>(c)];
      if (id >= 0)
        push_sym(syms, id);
      else
        initial_chars(byte_char[static_cast<unsigned char>(c)], syms);  // unk / fallback rules
    }
  }

  // One symbol per char; chars missing from the vocab go to byte fallback, then unk (fused or
  // not), else are dropped, as in HF.
  void initial_chars(std::string_view word, std::vector<Sym>& syms) const {
    bool pending_unk = false;
    for (size_t i = 0; i < word.size();) {
      size_t len = utf8_valid_len(bytes(word), word.size(), i);
      bool valid = len != 0;
      if (!valid) len = 1;
      std::string_view ch = word.substr(i, len);
      uint32_t cp = valid ? decode_cp(bytes(word) + i, len) : 0;
      int32_t id = valid && cp < small_char_id.size() ? small_char_id[cp] : lookup(ch);
      i += len;
      if (id >= 0) {
        pending_unk = false;
        push_sym(syms, id);
        continue;
      }
      if (byte_fallback) {
        std::array<int32_t, 4> ids{};
        bool all = true;
        for (size_t k = 0; k < ch.size(); ++k) {
          char name[8];
          std::snprintf(name, sizeof(name), "<0x%02X>", unsigned(static_cast<unsigned char>(ch[k])));
          ids[k] = lookup(name);
          all = all && ids[k] >= 0;
        }
        if (all) {
          pending_unk = false;
          for (size_t k = 0; k < ch.size(); ++k) push_sym(syms, ids[k]);
          continue;
        }
      }
      if (unk_id >= 0 && !(fuse_unk && pending_unk)) {
        push_sym(syms, unk_id);
        pending_unk = true;
      }
    }
  }

  // HF's Word::merge_all: repeatedly apply the lowest-rank merge (leftmost on ties). Short words
  // rescan their few pairs; long ones use a heap with stale entries skipped. Both give the same
  // result: the pair chosen is always the minimum (rank, position).
  void merge_all(std::vector<Sym>& syms) const {
    if (syms.size() < 2) return;
    syms.back().next = -1;
    if (syms.size() <= 24)
      merge_small(syms);
    else
      merge_heap(syms);
  }

  void merge_small(std::vector<Sym>& syms) const {
    // rank[i]: rank of the pair (symbol i, its next), INT32_MAX if none.
    thread_local std::vector<int32_t> rank, result;
    size_t n = syms.size();
    rank.assign(n, INT32_MAX);
    result.assign(n, -1);
    auto update = [&](int32_t i) {
      const Sym& s = syms[i];
      rank[i] = INT32_MAX;
      if (s.next < 0) return;
      if (const MergeTable::Entry* m = merges.find(s.id, syms[s.next].id)) {
        rank[i] = m->rank;
        result[i] = m->new_id;
      }
    };
    for (size_t i = 0; i < n; ++i) update(int32_t(i));
    for (;;) {
      int32_t best = -1;
      for (int32_t i = 0; i >= 0; i = syms[i].next)
        if (rank[i] != INT32_MAX && (best < 0 || rank[i] < rank[best])) best = i;
      if (best < 0) return;
      Sym& left = syms[best];
      Sym& right = syms[left.next];
      left.id = result[best];
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) syms[left.next].prev = best;
      update(best);
      if (left.prev >= 0) update(left.prev);
    }
  }

  void merge_heap(std::vector<Sym>& syms) const {
    struct Cand {
      int32_t rank, pos, new_id;
      bool operator<(const Cand& o) const {  // priority_queue pops the "largest": lowest rank
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    thread_local std::vector<Cand> storage;
    storage.clear();
    std::priority_queue<Cand, std::vector<Cand>> heap(std::less<Cand>(), std::move(storage));
    for (size_t i = 0; i + 1 < syms.size(); ++i)
      if (const MergeTable::Entry* m = merges.find(syms[i].id, syms[i + 1].id))
        heap.push({m->rank, int32_t(i), m->new_id});
    while (!heap.empty()) {
      Cand top = heap.top();
      heap.pop();
      Sym& left = syms[top.pos];
      if (!left.alive || left.next < 0) continue;
      Sym& right = syms[left.next];
      const MergeTable::Entry* m = merges.find(left.id, right.id);
      if (!m || m->new_id != top.new_id) continue;  // stale entry
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) syms[left.next].prev = top.pos;
      if (left.prev >= 0)
        if (const MergeTable::Entry* pm = merges.find(syms[left.prev].id, left.id))
          heap.push({pm->rank, left.prev, pm->new_id});
      if (left.next >= 0)
        if (const MergeTable::Entry* nm = merges.find(left.id, syms[left.next].id))
          heap.push({nm->rank, top.pos, nm->new_id});
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Added tokens: a byte trie with leftmost-longest search (HF uses aho-corasick LeftmostLongest).

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, lstrip, rstrip, single_word, normalized;
};

class Trie {
 public:
  Trie() { root_.fill(-1); }
  bool empty() const { return nodes_.empty(); }
  void insert(std::string_view key, int32_t value) {
    if (key.empty()) return;
    int32_t node = child_of_root(bytes(key)[0], true);
    for (size_t i = 1; i < key.size(); ++i) node = child(node, bytes(key)[i], true);
    nodes_[node].value = value;
  }
  // Leftmost-longest match at or after `pos`: sets start, end and value.
  bool find(std::string_view text, size_t pos, size_t& start, size_t& end, int32_t& value) const {
    const unsigned char* s = bytes(text);
    for (size_t i = pos; i < text.size(); ++i) {
      int32_t node = root_[s[i]];
      if (node < 0) continue;
      int32_t best = -1;
      size_t best_end = 0;
      for (size_t k = i;;) {
        if (nodes_[node].value >= 0) {
          best = nodes_[node].value;
          best_end = k + 1;
        }
        if (++k >= text.size()) break;
        node = child(node, s[k], false);
        if (node < 0) break;
      }
      if (best >= 0) {
        start = i;
        end = best_end;
        value = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    int32_t value = -1;
    std::vector<std::pair<unsigned char, int32_t>> kids;
  };
  int32_t child_of_root(unsigned char c, bool create) {
    if (root_[c] < 0 && create) {
      root_[c] = int32_t(nodes_.size());
      nodes_.emplace_back();
    }
    return root_[c];
  }
  int32_t child(int32_t node, unsigned char c, bool create) {
    for (auto& [k, v] : nodes_[node].kids)
      if (k == c) return v;
    if (!create) return -1;
    int32_t n = int32_t(nodes_.size());
    nodes_.emplace_back();
    nodes_[node].kids.push_back({c, n});
    return n;
  }
  int32_t child(int32_t node, unsigned char c, bool) const {
    for (auto& [k, v] : nodes_[node].kids)
      if (k == c) return v;
    return -1;
  }
  std::array<int32_t, 256> root_;
  std::vector<Node> nodes_;
};

}  // namespace

// ------------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string path;
  Bpe bpe;
  std::vector<NormOp> normalizer;
  std::vector<Stage> stages;
  bool byte_level_pre = false;      // a ByteLevel pre-tokenizer maps bytes to printable chars
  bool byte_level_decoder = false;  // else the decoder is absent: tokens are joined by spaces

  std::vector<AddedToken> added;
  StrMap<int32_t> added_by_content;     // content -> index in `added`
  std::vector<int32_t> added_index;     // id -> index in `added`, -1 if not added
  Trie raw_trie, normalized_trie;       // match content (raw) / normalized content
  std::unique_ptr<Regex> word_char_re;  // Rust regex \w, for single_word
  std::unique_ptr<Regex> space_re;      // Rust regex \s, for lstrip/rstrip

  std::vector<std::string> id_bytes;  // what decode() emits for each id
  std::vector<bool> id_present;
  int32_t size = 0;

  // -- encode ------------------------------------------------------------------------------------

  bool is_word(uint32_t cp) const {
    std::string s;
    append_utf8(s, cp);
    return word_char_re->matches_whole(s);
  }
  bool is_space(uint32_t cp) const {
    std::string s;
    append_utf8(s, cp);
    return space_re->matches_whole(s);
  }
  // Start of the run of whitespace that ends `s` (s.size() if none).
  size_t trailing_space_start(std::string_view s) const {
    size_t end = s.size();
    uint32_t cp;
    size_t start;
    while (last_cp(s.substr(0, end), cp, start) && is_space(cp)) end = start;
    return end;
  }
  // Length of the run of whitespace that starts `s`.
  size_t leading_space_len(std::string_view s) const {
    size_t pos = 0;
    uint32_t cp;
    while (first_cp(s.substr(pos), cp) && is_space(cp)) pos += utf8_valid_len(bytes(s), s.size(), pos);
    return pos;
  }

  // HF AddedVocabulary::find_matches: cut `text` into added tokens (id >= 0) and the pieces
  // between them (id -1), in order.
  template <typename F>
  void split_added(std::string_view text, const Trie& trie, bool parse_special, F&& f) const {
    if (text.empty()) return;
    if (trie.empty()) {
      f(text, -1);
      return;
    }
    size_t start_offset = 0, pos = 0, ms, me;
    int32_t idx;
    while (trie.find(text, pos, ms, me, idx)) {
      pos = me;
      const AddedToken& tok = added[idx];
      if (!parse_special && tok.special) continue;
      if (ms < start_offset) continue;  // inside whitespace an rstrip token already took
      if (tok.single_word) {
        uint32_t cp;
        size_t st;
        bool start_ok = ms == 0 || !(last_cp(text.substr(0, ms), cp, st) && is_word(cp));
        bool stop_ok = me == text.size() || !(first_cp(text.substr(me), cp) && is_word(cp));
        if (!start_ok || !stop_ok) continue;
      }
      size_t start = ms, stop = me;
      if (tok.lstrip) start = std::max(trailing_space_start(text.substr(0, ms)), start_offset);
      if (tok.rstrip) stop += leading_space_len(text.substr(me));
      if (start_offset < start) f(text.substr(start_offset, start - start_offset), -1);
      f(std::string_view(), tok.id);
      start_offset = stop;
      pos = std::max(pos, stop);
    }
    if (start_offset < text.size()) f(text.substr(start_offset), -1);
  }

  void encode(std::string_view text, bool parse_special, std::vector<int32_t>& out) const {
    split_added(text, raw_trie, parse_special, [&](std::string_view piece, int32_t id) {
      if (id >= 0)
        out.push_back(id);
      else
        encode_unadded(piece, parse_special, out);
    });
  }

  // A piece with no raw-matched added token: valid UTF-8 runs go through normalization; each
  // byte that is not valid UTF-8 becomes its own piece.
  void encode_unadded(std::string_view piece, bool parse_special, std::vector<int32_t>& out) const {
    size_t run = 0, i = 0;
    while (i < piece.size()) {
      size_t len = utf8_valid_len(bytes(piece), piece.size(), i);
      if (len) {
        i += len;
        continue;
      }
      encode_valid(piece.substr(run, i - run), parse_special, out);
      encode_raw_byte(static_cast<unsigned char>(piece[i]), out);
      run = ++i;
    }
    encode_valid(piece.substr(run), parse_special, out);
  }

  void encode_raw_byte(unsigned char b, std::vector<int32_t>& out) const {
    std::string_view one(reinterpret_cast<const char*>(&b), 1);
    if (!byte_level_pre)
      bpe.tokenize(one, out);
    else if (stages.back().kind == Stage::kByteLevel)
      bpe.tokenize_bytes(one, out);
    else
      bpe.tokenize(bpe.byte_char[b], out);
  }

  void encode_valid(std::string_view run, bool parse_special, std::vector<int32_t>& out) const {
    if (run.empty()) return;
    auto pieces = [&](std::string_view text) {
      split_added(text, normalized_trie, parse_special, [&](std::string_view p, int32_t id) {
        if (id >= 0)
          out.push_back(id);
        else
          pre_tokenize_and_merge(p, out);
      });
    };
    if (normalizer.empty()) {
      pieces(run);
    } else {
      std::string norm = apply_normalizer(normalizer, run);
      pieces(norm);
    }
  }

  void pre_tokenize_and_merge(std::string_view text, std::vector<int32_t>& out) const {
    // Pieces are spans of `cur`; a ByteLevel stage that is not last moves them to a new buffer.
    thread_local std::string owned, next_buf, prefixed;
    thread_local std::vector<Span> spans, next, sub;
    std::string_view cur = text;
    spans.assign(1, Span{0, uint32_t(text.size())});
    for (size_t si = 0; si < stages.size(); ++si) {
      const Stage& st = stages[si];
      next.clear();
      if (st.kind == Stage::kSplit) {
        for (const Span& sp : spans) split_piece(st, cur.substr(sp.off, sp.len), sp.off, next);
        spans.swap(next);
        continue;
      }
      // ByteLevel: optional leading space per piece, optional GPT-2 split, then every byte
      // becomes its printable char. As the last stage it hands raw bytes to the model instead.
      const bool last = si + 1 == stages.size();
      next_buf.clear();
      for (const Span& sp : spans) {
        std::string_view piece = cur.substr(sp.off, sp.len);
        if (st.add_prefix_space && (piece.empty() || piece[0] != ' ')) {
          prefixed.assign(1, ' ');
          prefixed.append(piece);
          piece = prefixed;
        }
        sub.clear();
        if (st.re)
          split_gpt2(st, piece, sub);
        else
          sub.push_back({0, uint32_t(piece.size())});
        for (const Span& s : sub) {
          if (last) {
            bpe.tokenize_bytes(piece.substr(s.off, s.len), out);
            continue;
          }
          uint32_t off = uint32_t(next_buf.size());
          for (size_t k = s.off; k < s.off + s.len; ++k)
            next_buf += bpe.byte_char[static_cast<unsigned char>(piece[k])];
          if (next_buf.size() > off) next.push_back({off, uint32_t(next_buf.size() - off)});
        }
      }
      if (last) return;
      owned.swap(next_buf);
      cur = owned;
      spans.swap(next);
    }
    for (const Span& sp : spans) bpe.tokenize(cur.substr(sp.off, sp.len), out);
  }

  // The GPT-2 regex split of ByteLevel(use_regex=true), Isolated.
  static void split_gpt2(const Stage& st, std::string_view piece, std::vector<Span>& out) {
    uint32_t prev = 0;
    st.re->for_each_match(piece, [&](size_t s, size_t e) {
      if (prev != s) out.push_back({prev, uint32_t(s) - prev});
      out.push_back({uint32_t(s), uint32_t(e - s)});
      prev = uint32_t(e);
    });
    if (prev != piece.size()) out.push_back({prev, uint32_t(piece.size()) - prev});
  }

  // -- load --------------------------------------------------------------------------------------

  void load(const std::string& file) {
    path = file;
    JsonCtx ctx{file};
    std::ifstream in(file, std::ios::binary);
    CHECK(in.good(), "tokenizer: cannot open '", file, "'");
    std::stringstream ss;
    ss << in.rdbuf();
    json j;
    try {
      j = json::parse(ss.str());
    } catch (const json::exception& e) {
      GLM5_FAIL("tokenizer '", file, "' is not valid JSON: ", e.what());
    }
    if (!j.is_object()) ctx.fail("top level", std::string("expected an object, found ") + j.type_name());
    try {
      load_model(ctx, ctx.member(j, "model", "tokenizer"));
      if (auto it = j.find("normalizer"); it != j.end()) parse_normalizer(ctx, *it, "normalizer", normalizer);
      if (auto it = j.find("pre_tokenizer"); it != j.end()) parse_pre_tokenizer(ctx, *it, "pre_tokenizer", stages);
      for (const Stage& st : stages) byte_level_pre = byte_level_pre || st.kind == Stage::kByteLevel;
      load_decoder(ctx, j.contains("decoder") ? j["decoder"] : json());
      if (auto it = j.find("added_tokens"); it != j.end()) load_added(ctx, *it);
    } catch (const json::exception& e) {
      GLM5_FAIL("tokenizer '", file, "': unexpected JSON content: ", e.what());
    }
    build_tables();
  }

  void load_model(const JsonCtx& ctx, const json& m) {
    std::string type = m.contains("type") ? ctx.str(m, "type", "model") : std::string("BPE");
    if (type != "BPE") ctx.fail("model.type", "'" + type + "' is not supported (only BPE)");
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
      ctx.fail("model.dropout", "BPE dropout is random at encode time; not supported");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty())
        ctx.fail(std::string("model.") + k, "'" + m[k].get<std::string>() + "' is not supported");
    bpe.ignore_merges = ctx.flag(m, "ignore_merges", false, "model");
    bpe.byte_fallback = ctx.flag(m, "byte_fallback", false, "model");
    bpe.fuse_unk = ctx.flag(m, "fuse_unk", false, "model");

    const json& vocab = ctx.member(m, "vocab", "model");
    if (!vocab.is_object()) ctx.fail("model.vocab", "expected an object token -> id");
    int32_t max_id = -1;
    bpe.vocab.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() > INT32_MAX)
        ctx.fail("model.vocab[\"" + it.key() + "\"]", "expected a non-negative id, found " + it.value().dump());
      int32_t id = it.value().get<int32_t>();
      bpe.vocab[it.key()] = id;
      max_id = std::max(max_id, id);
    }
    bpe.id_to_token.assign(size_t(max_id + 1), std::string());
    for (const auto& [tok, id] : bpe.vocab) bpe.id_to_token[id] = tok;
    size = max_id + 1;

    if (m.contains("unk_token") && !m["unk_token"].is_null()) {
      std::string unk = ctx.str(m, "unk_token", "model");
      bpe.unk_id = bpe.lookup(unk);
      if (bpe.unk_id < 0) ctx.fail("model.unk_token", "'" + unk + "' is not in model.vocab");
    }

    const json& merges = ctx.member(m, "merges", "model");
    if (!merges.is_array()) ctx.fail("model.merges", "expected a list");
    bpe.merges.reserve(merges.size());
    for (size_t r = 0; r < merges.size(); ++r) {
      const json& e = merges[r];
      std::string field = "model.merges[" + std::to_string(r) + "]";
      std::string a, b;
      if (e.is_string()) {
        std::string s = e.get<std::string>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          ctx.fail(field, "expected \"left right\" with one space, found \"" + s + "\"");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        ctx.fail(field, "expected \"left right\" or [left, right], found " + e.dump());
      }
      int32_t ia = bpe.lookup(a), ib = bpe.lookup(b), inew = bpe.lookup(a + b);
      if (ia < 0) ctx.fail(field, "left part '" + a + "' is not in model.vocab");
      if (ib < 0) ctx.fail(field, "right part '" + b + "' is not in model.vocab");
      if (inew < 0) ctx.fail(field, "merged token '" + a + b + "' is not in model.vocab");
      bpe.merges.set(ia, ib, int32_t(r), inew);
    }
  }

  void load_decoder(const JsonCtx& ctx, const json& d) {
    if (d.is_null()) return;
    std::string type = ctx.str(d, "type", "decoder");
    if (type == "ByteLevel") {
      byte_level_decoder = true;
    } else {
      ctx.fail("decoder", "decoder type '" + type + "' is not supported (supported: ByteLevel)");
    }
  }

  // Ids are assigned the way HF's AddedVocabulary::add_tokens does when it reads the file: a
  // content already added or in the BPE vocab keeps that id; a new one gets the BPE vocab's entry
  // count, or one past the largest added id once that is reached. For any consistent file this is
  // the "id" written there; where it is not, HF (and so the model's training) used these ids.
  void load_added(const JsonCtx& ctx, const json& list) {
    if (!list.is_array()) ctx.fail("added_tokens", "expected a list");
    const int64_t vocab_count = int64_t(bpe.vocab.size());
    int64_t max_added = -1;
    for (size_t i = 0; i < list.size(); ++i) {
      const json& t = list[i];
      std::string field = "added_tokens[" + std::to_string(i) + "]";
      const json& idj = ctx.member(t, "id", field);
      if (!idj.is_number_integer() || idj.get<int64_t>() < 0 || idj.get<int64_t>() > INT32_MAX)
        ctx.fail(field + ".id", "expected a non-negative id, found " + idj.dump());
      AddedToken tok{ctx.str(t, "content", field),          -1,
                     ctx.flag(t, "special", false, field),  ctx.flag(t, "lstrip", false, field),
                     ctx.flag(t, "rstrip", false, field),   ctx.flag(t, "single_word", false, field),
                     ctx.flag(t, "normalized", true, field)};
      if (tok.content.empty()) continue;  // HF ignores empty added tokens
      auto it = added_by_content.find(tok.content);
      if (it != added_by_content.end()) {
        tok.id = added[it->second].id;
      } else if (int32_t vid = bpe.lookup(tok.content); vid >= 0) {
        tok.id = vid;
      } else {
        int64_t id = max_added < 0                                    ? vocab_count
                     : (max_added >= vocab_count || vocab_count == 0) ? max_added + 1
                                                                      : vocab_count;
        if (id > INT32_MAX) ctx.fail(field, "too many added tokens");
        tok.id = int32_t(id);
      }
      max_added = std::max<int64_t>(max_added, tok.id);
      if (it != added_by_content.end()) {
        added[it->second] = tok;  // same content again: the later flags win, as in HF
      } else {
        added_by_content[tok.content] = int32_t(added.size());
        added.push_back(tok);
      }
      size = std::max(size, tok.id + 1);
    }
    bool need_word = false, need_space = false;
    for (size_t i = 0; i < added.size(); ++i) {
      const AddedToken& t = added[i];
      need_word = need_word || t.single_word;
      need_space = need_space || t.lstrip || t.rstrip;
      if (t.normalized) {
        std::string key = normalizer.empty() ? t.content : apply_normalizer(normalizer, t.content);
        normalized_trie.insert(key, int32_t(i));
      } else {
        raw_trie.insert(t.content, int32_t(i));
      }
    }
    std::string where = "tokenizer '" + ctx.file + "'";
    if (need_word)
      word_char_re = std::make_unique<Regex>(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])", where);
    if (need_space) space_re = std::make_unique<Regex>(R"(\p{White_Space})", where);
  }

  void build_tables() {
    auto byte_to_cp = make_byte_to_cp();
    std::unordered_map<uint32_t, unsigned char> cp_to_byte;
    for (int b = 0; b < 256; ++b) {
      bpe.byte_char[b].clear();
      append_utf8(bpe.byte_char[b], byte_to_cp[b]);
      cp_to_byte[byte_to_cp[b]] = static_cast<unsigned char>(b);
    }
    bpe.small_char_id.assign(0x800, -1);
    for (const auto& [tok, id] : bpe.vocab) {
      size_t len = utf8_valid_len(bytes(tok), tok.size(), 0);
      if (len == tok.size() && len > 0) {
        uint32_t cp = decode_cp(bytes(tok), len);
        if (cp < 0x800) bpe.small_char_id[cp] = id;
      }
    }
    for (int b = 0; b < 256; ++b) bpe.byte_id[b] = bpe.small_char_id[byte_to_cp[b]];
    added_index.assign(size_t(size), -1);
    for (size_t i = 0; i < added.size(); ++i) added_index[added[i].id] = int32_t(i);

    // Decoded bytes per id: ByteLevel maps a token back to bytes when every char of it is a
    // byte-level char, and otherwise emits the token's text as it is (as HF does).
    id_bytes.assign(size_t(size), std::string());
    id_present.assign(size_t(size), false);
    for (int32_t id = 0; id < size; ++id) {
      std::string tok;
      if (added_index[id] >= 0)
        tok = added[added_index[id]].content;
      else if (id < int32_t(bpe.id_to_token.size()) && !bpe.id_to_token[id].empty())
        tok = bpe.id_to_token[id];
      else
        continue;
      id_present[id] = true;
      if (!byte_level_decoder) {
        id_bytes[id] = tok;
        continue;
      }
      std::string out;
      bool all = true;
      for (size_t i = 0; i < tok.size() && all;) {
        size_t len = utf8_valid_len(bytes(tok), tok.size(), i);
        if (!len) {
          all = false;
          break;
        }
        auto it = cp_to_byte.find(decode_cp(bytes(tok) + i, len));
        if (it == cp_to_byte.end())
          all = false;
        else
          out += char(it->second);
        i += len;
      }
      id_bytes[id] = all ? out : tok;
    }
  }
};

// ------------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::load(const std::string& path_or_model_dir) {
  namespace fs = std::filesystem;
  std::string file = path_or_model_dir;
  std::error_code ec;
  if (fs::is_directory(file, ec)) file = (fs::path(file) / "tokenizer.json").string();
  CHECK(fs::exists(file, ec), "tokenizer: '", file, "' does not exist");
  CHECK(fs::is_regular_file(file, ec), "tokenizer: '", file, "' is not a regular file");
  auto impl = std::make_shared<Impl>();
  impl->load(file);
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  CHECK(text.size() < (size_t(1) << 32), "tokenizer: text of ", text.size(),
        " bytes is too long to encode at once (limit 4 GiB)");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  impl_->encode(text, parse_special, out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  bool first = true;
  for (int32_t id : ids)
    if (append_decoded(out, id, skip_special, first)) first = false;
  return out;
}

bool Tokenizer::append_decoded(std::string& out, int32_t id, bool skip_special, bool first) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.size || !m.id_present[id]) return false;
  if (skip_special && m.added_index[id] >= 0 && m.added[m.added_index[id]].special) return false;
  if (!m.byte_level_decoder && !first) out += ' ';
  out += m.id_bytes[id];
  return true;
}

int32_t Tokenizer::token_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return impl_->added[it->second].id;
  return impl_->bpe.lookup(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.size) return {};
  if (m.added_index[id] >= 0) return m.added[m.added_index[id]].content;
  if (id < int32_t(m.bpe.id_to_token.size())) return m.bpe.id_to_token[id];
  return {};
}

bool Tokenizer::is_special(int32_t id) const {
  const Impl& m = *impl_;
  return id >= 0 && id < m.size && m.added_index[id] >= 0 && m.added[m.added_index[id]].special;
}

int32_t Tokenizer::vocab_size() const { return impl_->size; }

const std::string& Tokenizer::path() const { return impl_->path; }

}  // namespace glm5::runtime
