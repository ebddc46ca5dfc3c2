// `glm5 perplexity`: the window plan, the scoring arithmetic against plain formulas, and the command
// itself: the same numbers on every layout, KL divergence 0 against its own base run, a different
// model's KL divergence positive, and clear errors for bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "launcher/perplexity/perplexity.h"
#include "tests/test_support.h"

using glm5::launcher::kl_divergence;
using glm5::launcher::log_softmax_at;
using glm5::launcher::NllStats;
using glm5::launcher::plan_windows;
using json = nlohmann::json;
using namespace glm5::testing;

namespace {

const ScratchDir scratch("glm5_perplexity");

TEST(PerplexityPlan, LlamaPerplexityWindowsByDefault) {
  // stride = ctx: non-overlapping windows, each scoring positions ctx/2 + 1 .. ctx - 1 (llama-perplexity's
  // `first = n_ctx/2`, `count += n_ctx - first - 1`); the tail after the last whole window is not scored.
  auto w = plan_windows(1100, 512, 512);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].start, 0);
  EXPECT_EQ(w[1].start, 512);
  EXPECT_EQ(w[1].len, 512);
  EXPECT_EQ(w[0].first, 257);
  EXPECT_EQ(w[0].len - w[0].first, 255);
}

TEST(PerplexityPlan, SlidingWindowsScoreEachTokenOnce) {
  // stride = ctx / 4: each window scores its last stride tokens, and consecutive windows' scored
  // ranges tile the text.
  auto w = plan_windows(1000, 256, 64);
  ASSERT_EQ(w.size(), 12u);  // starts 0, 64, ..., 704 (704 + 256 <= 1000)
  for (size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ(w[i].first, 256 - 64);
    if (i) {
      EXPECT_EQ(w[i].start + w[i].first, w[i - 1].start + w[i - 1].len);
    }
  }
  EXPECT_TRUE(plan_windows(100, 256, 64).empty());
}

TEST(PerplexityMath, LogSoftmaxAndKl) {
  const std::vector<float> row = {1.0f, 2.0f, 3.0f, -1.0f};
  double z = 0;
  for (float x : row) z += std::exp(double(x));
  EXPECT_NEAR(log_softmax_at(row.data(), 4, 2), 3.0 - std::log(z), 1e-6);  // a float, as sampled logprobs
  // Large logits must not overflow (the max is subtracted first).
  const std::vector<float> big = {1000.0f, 1000.0f};
  EXPECT_NEAR(log_softmax_at(big.data(), 2, 0), -std::log(2.0), 1e-6);
  const std::vector<float> p = {std::log(0.5f), std::log(0.5f)}, q = {std::log(0.25f), std::log(0.75f)};
  EXPECT_NEAR(kl_divergence(p.data(), q.data(), 2), 0.5 * std::log(2.0) + 0.5 * std::log(0.5 / 0.75), 1e-6);
  EXPECT_EQ(kl_divergence(p.data(), p.data(), 2), 0.0);
}

TEST(PerplexityMath, StatsAsLlamaPerplexity) {
  NllStats s;
  for (double x : {1.0, 2.0, 3.0}) s.add(x);
  EXPECT_NEAR(s.perplexity(), std::exp(2.0), 1e-12);
  // ppl * sqrt(var / (n - 1)), var = E[x^2] - E[x]^2 = 2/3
  EXPECT_NEAR(s.perplexity_stderr(), std::exp(2.0) * std::sqrt((2.0 / 3.0) / 2.0), 1e-12);
}

json run_json(const std::string& cmd, const std::string& name) {
  const Proc p = run_captured(cmd, scratch(name + ".out"), scratch(name + ".err"));
  EXPECT_EQ(p.code, 0) << cmd << "\n" << p.err;
  return json::parse(p.out.substr(0, p.out.find('\n')), nullptr, false);
}

std::string text_file() {
  // 4 KB of held-out text: enough for several windows of 64 tokens.
  const std::string held = slurp(kData + "/glm5-kjv/heldout.txt");
  const auto path = scratch("text.txt");
  std::ofstream(path) << held.substr(0, 4000);
  return path.string();
}

TEST(PerplexityCli, SameNumbersOnEveryLayoutAndZeroKlAgainstItself) {
  const std::string text = text_file(), base = scratch("base.logprobs").string();
  const std::string args = " perplexity --model " + kData + "/tiny-a --file " + text + " --ctx 64 --json";
  const json one = run_json(kBin + args + " --save-logits " + base, "one");
  ASSERT_FALSE(one.is_discarded());
  EXPECT_GT(one["tokens_scored"].get<int64_t>(), 100);
  EXPECT_GT(one["perplexity"].get<double>(), 1.0);
  const json four = run_json(
      mpirun(4) + kBin + args + " --cluster " + kSrc + "/cluster-configs/cpu-pp2-ep2.yaml" + " --kl-base " + base,
      "four");
  ASSERT_FALSE(four.is_discarded());
  EXPECT_EQ(four["perplexity"].get<double>(), one["perplexity"].get<double>());  // bitwise
  // Without a logprob file the last stage scores the tokens (no logits travel): the same numbers.
  const json plain =
      run_json(mpirun(4) + kBin + args + " --cluster " + kSrc + "/cluster-configs/cpu-pp2-ep2.yaml", "plain");
  ASSERT_FALSE(plain.is_discarded());
  EXPECT_EQ(plain["perplexity"].get<double>(), one["perplexity"].get<double>());
  EXPECT_FALSE(plain.contains("kld_mean"));
  EXPECT_EQ(four["kld_mean"].get<double>(), 0.0);
  EXPECT_EQ(four["top1_agreement"].get<double>(), 1.0);
  // Another model on the same tokens (tiny-a's int4 conversion would do too): KL divergence > 0.
  const std::string conv = scratch("tiny-a-int4").string();
  ASSERT_EQ(
      sh(kBin + " convert --model " + kData + "/tiny-a --out " + conv + " --quant int4 --group-size 32 --no-progress",
         scratch("convert.log")),
      0);
  std::filesystem::copy_file(kData + "/tiny-a/tokenizer.json", conv + "/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  const json q =
      run_json(kBin + " perplexity --model " + conv + " --file " + text + " --ctx 64 --json --kl-base " + base, "q");
  ASSERT_FALSE(q.is_discarded());
  EXPECT_GT(q["kld_mean"].get<double>(), 0.0);
  EXPECT_LT(q["top1_agreement"].get<double>(), 1.0);
}

TEST(PerplexityCli, BadArgumentsNamed) {
  const std::string text = text_file();
  const std::string base = kBin + " perplexity --model " + kData + "/tiny-a --file ";
  struct Case {
    std::string args, message;
  } cases[] = {
      {text + " --ctx 3", "--ctx"},
      {text + " --ctx 64 --stride 65", "--stride"},
      {text + " --ctx 100000", "max_position_embeddings"},
      {"/nonexistent.txt", "/nonexistent.txt"},
      {text + " --ctx 64 --kl-base /nonexistent.lp", "/nonexistent.lp"},
      {text + " --ctx 4000", "fewer than one window"},
  };
  for (const Case& c : cases) {
    const Proc p = run_captured(base + c.args, scratch("bad.out"), scratch("bad.err"));
    EXPECT_NE(p.code, 0) << c.args;
    EXPECT_TRUE(contains(p.err, c.message)) << c.args << ": " << p.err;
  }
}

}  // namespace
