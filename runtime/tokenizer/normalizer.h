// The normalizer: a Sequence of Replace and Prepend. A part of the tokenizer (tokenizer.cpp), used by it alone.
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
#include "runtime/tokenizer/json_ctx.h"

namespace glm5::runtime::tok {

// ------------------------------------------------------------------------------------------------
// Normalizer: a Sequence of Replace and Prepend (no Unicode normalization or case folding).

struct NormOp {
  enum Kind { kReplace, kPrepend } kind;
  std::unique_ptr<Regex> re;  // kReplace
  std::string text;           // replacement (kReplace) or prefix (kPrepend)
};

inline void parse_normalizer(const JsonCtx& ctx, const json& j, const std::string& field, std::vector<NormOp>& ops) {
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

inline std::string apply_normalizer(const std::vector<NormOp>& ops, std::string_view in) {
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

}  // namespace glm5::runtime::tok
