// Reading tokenizer.json with messages that name the file and the field. A part of the tokenizer (tokenizer.cpp), used
// by it alone.
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
#include "runtime/tokenizer/regex.h"

namespace glm5::runtime::tok {

using json = nlohmann::json;

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

}  // namespace glm5::runtime::tok
