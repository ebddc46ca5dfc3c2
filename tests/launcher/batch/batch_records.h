// The records of a `glm5 batch` output file keyed by custom_id ("line:N" for plain lines), without
// the fields that differ between two runs of the same requests (ids, request ids, creation times), so
// that two runs compare as equal maps exactly when they answered the same. A key seen twice fails the
// test (a record written twice).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace glm5::testing {

inline std::map<std::string, nlohmann::json> read_records(const std::filesystem::path& p) {
  std::map<std::string, nlohmann::json> out;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    const std::string key =
        j["custom_id"].is_string() ? j["custom_id"].get<std::string>() : "line:" + std::to_string(j["line"].get<int>());
    EXPECT_EQ(out.count(key), 0u) << "duplicate record for " << key << " in " << p;
    j.erase("id");
    if (j["response"].is_object()) {
      j["response"].erase("request_id");
      j["response"]["body"].erase("id");
      j["response"]["body"].erase("created");
    }
    out[key] = j;
  }
  return out;
}

}  // namespace glm5::testing
