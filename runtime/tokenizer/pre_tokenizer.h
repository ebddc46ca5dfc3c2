// The pre-tokenizer: regex splits and the byte-level mapping. A part of the tokenizer (tokenizer.cpp), used by it
// alone.
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
#include "runtime/tokenizer/normalizer.h"

namespace glm5::runtime::tok {

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

inline Behavior parse_behavior(const JsonCtx& ctx, const std::string& b, const std::string& field) {
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  ctx.fail(field + ".behavior", "unknown split behavior '" + b + "'");
}

inline void parse_pre_tokenizer(const JsonCtx& ctx, const json& j, const std::string& field,
                                std::vector<Stage>& stages) {
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
inline void split_piece(const Stage& st, std::string_view text, uint32_t base, std::vector<Span>& out) {
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

}  // namespace glm5::runtime::tok
