// Precision::kFast through the model (kernels/ops.h): on the trained small model its prompt logits
// differ from kExact's (the gemm inputs are rounded) yet pick the same next token almost everywhere,
// with a small KL divergence; on the random tiny models it stays batch-invariant (the invariance
// suites run again in fast: tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "runtime/tokenizer/tokenizer.h"
#include "tests/runtime/model_fixture.h"

namespace glm5::testing {
namespace {

std::vector<double> log_softmax(const float* z, int64_t n) {
  double mx = -INFINITY, sum = 0;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(z[i]));
  for (int64_t i = 0; i < n; ++i) sum += std::exp(double(z[i]) - mx);
  std::vector<double> out(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = double(z[i]) - mx - std::log(sum);
  return out;
}

TEST(Precision, FastIsNearExactOnTheTrainedModel) {
  const std::string dir = std::string(GLM5_TEST_DATA) + "/glm5-kjv";
  using Kind = OneProcessModel::Kind;
  OneProcessModel exact(dir, Kind::Cpu, kernels::Precision::kExact), fast(dir, Kind::Cpu, kernels::Precision::kFast);
  ASSERT_EQ(fast.backend->precision(), kernels::Precision::kFast);
  const int64_t V = exact.cfg.vocab_size;
  // The first 400 tokens of the held-out text (the model never trained on it).
  std::stringstream text;
  text << std::ifstream(dir + "/heldout.txt").rdbuf();
  std::vector<int32_t> prompt = runtime::Tokenizer::load(dir).encode(text.str().substr(0, 4000), false);
  ASSERT_GE(prompt.size(), 400u);
  prompt.resize(400);
  runtime::Request r = golden_request(prompt, 1);
  const auto a = exact.run({r}), b = fast.run({r});
  const std::vector<float>&za = a.at(0).prompt_logits, &zb = b.at(0).prompt_logits;
  ASSERT_EQ(za.size(), zb.size());
  ASSERT_EQ(int64_t(za.size()), int64_t(prompt.size()) * V);
  EXPECT_NE(0, std::memcmp(za.data(), zb.data(), za.size() * 4)) << "kFast gave kExact's bits: nothing was rounded";
  double kl = 0;
  int agree = 0;
  const int64_t rows = int64_t(prompt.size());
  for (int64_t i = 0; i < rows; ++i) {
    const auto p = log_softmax(&za[size_t(i * V)], V), q = log_softmax(&zb[size_t(i * V)], V);
    for (int64_t t = 0; t < V; ++t) kl += std::exp(p[size_t(t)]) * (p[size_t(t)] - q[size_t(t)]);
    agree += std::max_element(p.begin(), p.end()) - p.begin() == std::max_element(q.begin(), q.end()) - q.begin();
  }
  EXPECT_LT(kl / double(rows), 1e-3) << "mean KL(exact || fast)";
  EXPECT_GE(double(agree) / double(rows), 0.98) << "top-1 agreement";
  std::printf("fast against exact, %lld rows: mean KL %.3g, top-1 agreement %.4f\n", (long long)rows, kl / double(rows),
              double(agree) / double(rows));
}

}  // namespace
}  // namespace glm5::testing
