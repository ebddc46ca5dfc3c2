// The golden from the command line: `glm5 generate --prompt-ids <golden prompt> --max-new-tokens N
// --temperature 0 --dump-logits out.safetensors` reproduces tests/data/<model>/golden.safetensors
// (logits within 1e-4, tokens exact), as a user would run it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "runtime/safetensors.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using glm5::runtime::SafetensorsFile;

namespace {

const glm5::testing::ScratchDir scratch("glm5_golden_cli");

template <typename T>
std::vector<T> tensor(const SafetensorsFile& f, const std::string& name) {
  const auto* t = f.find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t) return {};
  const T* p = static_cast<const T*>(t->data);
  return std::vector<T>(p, p + t->nbytes / sizeof(T));
}

class GoldenCli : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenCli, GenerateDumpMatchesGolden) {
  const std::string dir = std::string(GLM5_TEST_DATA) + "/" + GetParam();
  SafetensorsFile golden(dir + "/golden.safetensors");
  auto prompt = tensor<int32_t>(golden, "prompt_ids");
  auto tokens = tensor<int32_t>(golden, "decode_tokens");
  std::string ids;
  for (int32_t t : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  const fs::path out = scratch(GetParam() + ".safetensors");
  const fs::path log = scratch(GetParam() + ".log");
  const std::string cmd = std::string(GLM5_BINARY) + " generate --model " + dir + " --prompt-ids " + ids +
                          " --max-new-tokens " + std::to_string(tokens.size()) + " --temperature 0 --dump-logits " +
                          out.string();
  ASSERT_EQ(0, glm5::testing::sh(cmd, log)) << cmd << "\n" << glm5::testing::slurp(log);
  SafetensorsFile got(out.string());
  EXPECT_EQ(tensor<int32_t>(got, "decode_tokens"), tokens);
  for (const char* name : {"prefill_logits", "decode_logits"}) {
    auto a = tensor<float>(got, name), b = tensor<float>(golden, name);
    ASSERT_EQ(a.size(), b.size()) << name;
    float worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
    EXPECT_LT(worst, 1e-4f) << name;
  }
  fs::remove(out);
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenCli, ::testing::Values("tiny-a", "tiny-b", "tiny-v32"));

}  // namespace
