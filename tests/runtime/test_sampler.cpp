// The sampler against a plain reference (full sort, straightforward loops, double exp) over many
// random logit vectors and parameter combinations: the same token exactly, logprobs within 1e-5,
// the same top-n ids in the same order. Plus semantic tests that do not trust the reference:
// top_k 1 / tiny top_p / min_p 1 are greedy, penalties move logits by exactly the documented
// amounts, the draw is reproducible per (seed, step), walks the kept tokens in id order, and its
// frequencies follow the (truncated) softmax; logprobs normalise; validate() names bad fields.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/sampler.h"
#include "tests/test_support.h"

namespace glm5::runtime {
namespace {

// ---- The reference: the documented semantics, written as plainly as possible. ----

std::vector<float> penalised(const float* logits, int64_t vocab, const SamplingParams& p,
                             const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated) {
  std::vector<float> x(logits, logits + vocab);
  if (p.repetition_penalty != 1.0f) {
    std::set<int32_t> seen;
    for (int32_t t : prompt) seen.insert(t);
    for (int32_t t : generated) seen.insert(t);
    for (int32_t t : seen)
      if (t >= 0 && t < vocab)
        x[size_t(t)] = x[size_t(t)] > 0 ? x[size_t(t)] / p.repetition_penalty : x[size_t(t)] * p.repetition_penalty;
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::map<int32_t, int> count;
    for (int32_t t : generated) ++count[t];
    for (auto [t, c] : count)
      if (t >= 0 && t < vocab) x[size_t(t)] -= p.presence_penalty + p.frequency_penalty * float(c);
  }
  if (p.temperature > 0.0f)
    for (float& f : x) f /= p.temperature;
  return x;
}

Sampled reference_sample(const float* logits, int64_t vocab, const SamplingParams& p,
                         const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated, int64_t step) {
  const std::vector<float> x = penalised(logits, vocab, p, prompt, generated);
  std::vector<int32_t> order(static_cast<size_t>(vocab));  // rank order: x descending, id ascending
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return x[size_t(a)] > x[size_t(b)] || (x[size_t(a)] == x[size_t(b)] && a < b);
  });
  const double mx = x[size_t(order[0])];
  std::vector<double> w(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) w[size_t(i)] = std::exp(double(x[size_t(i)]) - mx);

  Sampled s;
  if (p.temperature == 0.0f) {
    s.token = order[0];
  } else {
    size_t n = size_t(vocab);
    if (p.top_k > 0) n = std::min(n, size_t(p.top_k));
    if (p.min_p > 0.0f) {
      size_t keep = 0;
      while (keep < n && w[size_t(order[keep])] >= double(p.min_p)) ++keep;
      n = std::max<size_t>(keep, 1);
    }
    if (p.top_p < 1.0f) {
      double kept_mass = 0;
      for (size_t r = 0; r < n; ++r) kept_mass += w[size_t(order[r])];
      double acc = 0;
      size_t m = 0;
      while (m < n) {
        acc += w[size_t(order[m++])];
        if (acc >= double(p.top_p) * kept_mass) break;
      }
      n = m;
    }
    std::vector<char> kept(size_t(vocab), 0);
    for (size_t r = 0; r < n; ++r) kept[size_t(order[r])] = 1;
    double mass = 0;
    for (int64_t i = 0; i < vocab; ++i)
      if (kept[size_t(i)]) mass += w[size_t(i)];
    const double u = sampling_uniform(p.seed, step) * mass;
    double acc = 0;
    for (int64_t i = 0; i < vocab; ++i) {  // token-id order
      if (!kept[size_t(i)]) continue;
      s.token = int32_t(i);
      acc += w[size_t(i)];
      if (u < acc) break;
    }
  }
  if (p.logprobs >= 0) {
    double z = 0;
    for (double v : w) z += v;
    const double log_norm = mx + std::log(z);
    s.logprob = float(double(x[size_t(s.token)]) - log_norm);
    for (int64_t r = 0; r < std::min<int64_t>(p.logprobs, vocab); ++r)
      s.top.push_back({order[size_t(r)], float(double(x[size_t(order[size_t(r)])]) - log_norm)});
  }
  return s;
}

// The previous sampler's generator, copied verbatim: sampling_uniform must stay bit-exact.
uint64_t old_splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
double old_uniform(uint64_t seed, int64_t step) {
  uint64_t r = old_splitmix64(old_splitmix64(seed) ^ uint64_t(step) * 0xd1342543de82ef95ull);
  return double(r >> 11) * (1.0 / 9007199254740992.0);
}

// ---- Random inputs ----

// Logits shaped in one of several ways: Gaussian (as an LM's), a few values only (many ties),
// a Gaussian with a few boosted tokens, or one with very negative entries and signed zeros.
std::vector<float> random_logits(std::mt19937_64& rng, int64_t vocab) {
  std::vector<float> x(static_cast<size_t>(vocab));
  std::normal_distribution<float> gauss(0.0f, std::uniform_real_distribution<float>(0.5f, 4.0f)(rng));
  std::uniform_int_distribution<int> small(-3, 3);
  const int shape = int(rng() % 4);
  for (float& f : x) {
    switch (shape) {
      case 0: f = gauss(rng); break;
      case 1: f = 0.5f * float(small(rng)); break;
      case 2: f = gauss(rng); break;
      default: f = rng() % 5 == 0 ? -1e4f * float(1 + rng() % 3) : (rng() % 7 == 0 ? -0.0f : gauss(rng));
    }
  }
  if (shape == 2)
    for (int j = 0; j < 5; ++j) x[size_t(rng() % uint64_t(vocab))] += 8.0f + float(j);
  return x;
}

SamplingParams random_params(std::mt19937_64& rng, int64_t vocab) {
  auto pick = [&](std::initializer_list<double> v) { return *(v.begin() + rng() % v.size()); };
  SamplingParams p;
  p.temperature = float(pick({0.0, 0.3, 0.8, 1.0, 1.0, 1.7}));
  p.top_k = int32_t(pick({0.0, 0.0, -1.0, 1.0, 2.0, 5.0, 50.0, 128.0, 129.0, 200.0, 1000.0, double(vocab - 1),
                          double(vocab), double(vocab + 3)}));
  p.top_p = float(pick({1.0, 1.0, 0.95, 0.9, 0.5, 0.1, 1e-6}));
  p.min_p = float(pick({0.0, 0.0, 0.0, 0.01, 0.1, 0.5, 1.0}));
  p.repetition_penalty = float(pick({1.0, 1.0, 1.1, 1.5, 0.8}));
  p.presence_penalty = float(pick({0.0, 0.0, 0.5, -0.7, 2.0}));
  p.frequency_penalty = float(pick({0.0, 0.0, 0.3, -1.0}));
  p.logprobs = int32_t(pick({-1.0, -1.0, 0.0, 1.0, 5.0, 20.0}));
  p.seed = rng();
  return p;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t vocab, size_t n) {
  std::vector<int32_t> t(n);
  for (int32_t& v : t) {
    // Mostly in range, with repeats (a small id pool) and the odd out-of-range id to ignore.
    const uint64_t r = rng() % 20;
    v = r == 0 ? -1 : r == 1 ? int32_t(vocab + 2) : int32_t(rng() % uint64_t(std::min<int64_t>(vocab, 40)));
  }
  return t;
}

void expect_same(const Sampled& fast, const Sampled& ref, const SamplingParams& p, const std::string& what) {
  ASSERT_EQ(fast.token, ref.token) << what;
  if (p.logprobs < 0) return;
  EXPECT_NEAR(fast.logprob, ref.logprob, 1e-5) << what;
  ASSERT_EQ(fast.top.size(), ref.top.size()) << what;
  for (size_t i = 0; i < ref.top.size(); ++i) {
    EXPECT_EQ(fast.top[i].first, ref.top[i].first) << what << " top " << i;
    EXPECT_NEAR(fast.top[i].second, ref.top[i].second, 1e-5) << what << " top " << i;
  }
}

std::string describe(int64_t vocab, const SamplingParams& p, int64_t step) {
  std::ostringstream os;
  os << "vocab " << vocab << " T " << p.temperature << " top_k " << p.top_k << " top_p " << p.top_p << " min_p "
     << p.min_p << " rep " << p.repetition_penalty << " pres " << p.presence_penalty << " freq " << p.frequency_penalty
     << " logprobs " << p.logprobs << " seed " << p.seed << " step " << step;
  return os.str();
}

void check_against_reference(uint64_t rng_seed, const std::vector<int64_t>& vocabs, int trials) {
  std::mt19937_64 rng(rng_seed);
  for (int trial = 0; trial < trials; ++trial) {
    const int64_t vocab = vocabs[size_t(trial) % vocabs.size()];
    const std::vector<float> logits = random_logits(rng, vocab);
    const SamplingParams p = random_params(rng, vocab);
    const std::vector<int32_t> prompt = random_tokens(rng, vocab, rng() % 30);
    const std::vector<int32_t> generated = random_tokens(rng, vocab, rng() % 30);
    for (int64_t step : {int64_t(0), int64_t(rng() % 100000)}) {
      const Sampled fast = sample(logits.data(), vocab, p, prompt, generated, step);
      const Sampled ref = reference_sample(logits.data(), vocab, p, prompt, generated, step);
      expect_same(fast, ref, p, describe(vocab, p, step));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// ---- Against the reference ----

TEST(Sampler, MatchesReferenceOnSmallVocabularies) {
  check_against_reference(1, {1, 2, 3, 7, 15, 16, 17, 33, 100}, 6000);
}

TEST(Sampler, MatchesReferenceOnMediumVocabularies) { check_against_reference(2, {1000, 4097, 20000}, 300); }

TEST(Sampler, MatchesReferenceAtGlm5Vocabulary) { check_against_reference(3, {154880}, 24); }

// Many equal logits put one histogram bucket over the sort threshold (the counting-sort path).
TEST(Sampler, MatchesReferenceWithMassiveTies) {
  std::mt19937_64 rng(4);
  const int64_t vocab = 154880;
  std::vector<float> logits(size_t(vocab), 1.25f);
  for (int j = 0; j < 300; ++j) logits[size_t(rng() % uint64_t(vocab))] = 1.25f + 0.001f * float(j % 7);
  for (int32_t top_k : {0, 3, 1000, 100000})
    for (float top_p : {1.0f, 0.5f, 0.999f}) {
      SamplingParams p;
      p.temperature = 0.9f;
      p.top_k = top_k;
      p.top_p = top_p;
      p.logprobs = 5;
      p.seed = rng();
      for (int64_t step : {0, 17}) {
        expect_same(sample(logits.data(), vocab, p, {}, {}, step),
                    reference_sample(logits.data(), vocab, p, {}, {}, step), p, describe(vocab, p, step));
      }
    }
}

// ---- The generator ----

TEST(Sampler, UniformIsTheOldGeneratorBitForBit) {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 10000; ++i) {
    const uint64_t seed = i < 100 ? uint64_t(i) : rng();
    const int64_t step = i % 3 == 0 ? int64_t(i) : int64_t(rng() >> 1);
    const double u = sampling_uniform(seed, step);
    ASSERT_EQ(u, old_uniform(seed, step)) << seed << " " << step;
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

// ---- Semantics, without the reference ----

std::vector<float> gaussian_logits(uint64_t seed, int64_t vocab, float sd = 2.5f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, sd);
  std::vector<float> x(static_cast<size_t>(vocab));
  for (float& f : x) f = g(rng);
  return x;
}

TEST(Sampler, GreedyIsArgmaxLowestIdOnTies) {
  std::vector<float> x = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f};
  SamplingParams p;
  p.temperature = 0.0f;
  EXPECT_EQ(sample(x.data(), 5, p, {}, {}, 0).token, 1);
  p.logprobs = 2;  // the other greedy path (a working copy)
  const Sampled s = sample(x.data(), 5, p, {}, {}, 0);
  EXPECT_EQ(s.token, 1);
  ASSERT_EQ(s.top.size(), 2u);
  EXPECT_EQ(s.top[0].first, 1);
  EXPECT_EQ(s.top[1].first, 3);
  EXPECT_FLOAT_EQ(s.top[0].second, s.top[1].second);
}

TEST(Sampler, ArgmaxFindsTheFirstMaximumAnywhere) {
  for (int64_t n : {1, 5, 16, 17, 40, 1000}) {
    for (int64_t at : {int64_t(0), n / 2, n - 1}) {
      std::vector<float> x(size_t(n), -5.0f);
      x[size_t(at)] = 2.0f;
      if (at + 1 < n) x[size_t(at + 1)] = 2.0f;  // a later tie does not win
      EXPECT_EQ(argmax(x.data(), n), at) << n << " " << at;
    }
  }
  std::vector<float> x = {std::nanf(""), 1.0f, 4.0f, std::nanf(""), 3.0f};
  EXPECT_EQ(argmax(x.data(), 5), 2);
}

TEST(Sampler, TopK1IsGreedy) {
  for (uint64_t seed = 0; seed < 200; ++seed) {
    std::vector<float> x = gaussian_logits(seed, 1000);
    x[seed % 1000] = x[(seed * 7 + 3) % 1000] = 20.0f;  // a tie at the top: the lower id
    SamplingParams p;
    p.temperature = seed % 2 ? 0.7f : 1.6f;
    p.top_k = 1;
    p.seed = seed;
    EXPECT_EQ(sample(x.data(), 1000, p, {}, {}, int64_t(seed)).token, argmax(x.data(), 1000));
  }
}

TEST(Sampler, TinyTopPIsGreedy) {
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const std::vector<float> x = gaussian_logits(seed, 5000, 0.3f);  // flat: the top has little mass
    SamplingParams p;
    p.temperature = 1.3f;
    p.top_p = 1e-7f;
    p.seed = seed;
    EXPECT_EQ(sample(x.data(), 5000, p, {}, {}, int64_t(seed)).token, argmax(x.data(), 5000));
  }
}

TEST(Sampler, MinP1IsGreedy) {  // without ties at the top (tied maxima all have prob = max prob)
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const std::vector<float> x = gaussian_logits(seed + 1000, 5000, 0.3f);
    SamplingParams p;
    p.temperature = 2.0f;
    p.min_p = 1.0f;
    p.seed = seed;
    EXPECT_EQ(sample(x.data(), 5000, p, {}, {}, int64_t(seed)).token, argmax(x.data(), 5000));
  }
}

TEST(Sampler, RepetitionPenaltyDemotesASeenToken) {
  std::vector<float> x = {0.0f, 1.0f, -1.0f, 5.0f, 2.0f, 4.0f, -0.5f};
  SamplingParams p;
  p.temperature = 0.0f;
  EXPECT_EQ(sample(x.data(), 7, p, {}, {}, 0).token, 3);
  p.repetition_penalty = 1.5f;  // 5 / 1.5 = 3.33 < 4: the runner-up wins
  EXPECT_EQ(sample(x.data(), 7, p, {3}, {}, 0).token, 5);
  EXPECT_EQ(sample(x.data(), 7, p, {}, {3}, 0).token, 5);     // generated tokens count as seen
  EXPECT_EQ(sample(x.data(), 7, p, {3, 5}, {}, 0).token, 3);  // both penalised: 3.33 > 2.67

  // Exact amounts through logprobs: positive divided, negative multiplied, once per distinct token.
  p.logprobs = 7;
  const Sampled s = sample(x.data(), 7, p, {3, 3, 2, 99, -4}, {3}, 0);
  std::map<int32_t, float> lp(s.top.begin(), s.top.end());
  EXPECT_NEAR(lp[3] - lp[0], 5.0f / 1.5f - 0.0f, 1e-5);
  EXPECT_NEAR(lp[2] - lp[0], -1.0f * 1.5f - 0.0f, 1e-5);
  EXPECT_NEAR(lp[5] - lp[0], 4.0f, 1e-5);  // unseen: untouched
}

TEST(Sampler, PresenceAndFrequencyShiftByTheDocumentedAmount) {
  const std::vector<float> x = {0.5f, 1.0f, -1.0f, 2.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.0f;
  p.logprobs = 5;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  // Token 1 generated 3 times, token 2 once; token 3 only in the prompt (no presence penalty).
  const Sampled s = sample(x.data(), 5, p, {3, 3}, {1, 2, 1, 1}, 0);
  std::map<int32_t, float> lp(s.top.begin(), s.top.end());
  EXPECT_NEAR(lp[1] - lp[0], (1.0f - (0.5f + 0.25f * 3)) - 0.5f, 1e-5);
  EXPECT_NEAR(lp[2] - lp[0], (-1.0f - (0.5f + 0.25f)) - 0.5f, 1e-5);
  EXPECT_NEAR(lp[3] - lp[0], 2.0f - 0.5f, 1e-5);
  EXPECT_NEAR(lp[4] - lp[0], 0.0f - 0.5f, 1e-5);

  // With a temperature the penalised logits are scaled afterwards.
  p.temperature = 0.5f;
  const Sampled t = sample(x.data(), 5, p, {}, {1, 1, 1}, 0);
  std::map<int32_t, float> lt(t.top.begin(), t.top.end());
  EXPECT_NEAR(lt[1] - lt[0], ((1.0f - 1.25f) - 0.5f) / 0.5f, 1e-5);
}

TEST(Sampler, SameSeedAndStepGiveTheSameDraw) {
  const std::vector<float> x = gaussian_logits(7, 154880);
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  std::set<int32_t> distinct;
  for (int64_t step = 0; step < 200; ++step) {
    const int32_t a = sample(x.data(), 154880, p, {}, {}, step).token;
    sample(x.data(), 154880, p, {}, {}, step + 1);  // other calls in between change nothing
    EXPECT_EQ(sample(x.data(), 154880, p, {}, {}, step).token, a);
    distinct.insert(a);
  }
  EXPECT_GT(distinct.size(), 100u);  // different steps draw differently
  SamplingParams q = p;
  q.seed = 43;
  int same = 0;
  for (int64_t step = 0; step < 200; ++step)
    same += sample(x.data(), 154880, p, {}, {}, step).token == sample(x.data(), 154880, q, {}, {}, step).token;
  EXPECT_LT(same, 20);
}

// The draw walks kept tokens in id order: with u known, the token is predictable from the
// probabilities in id order (rank order would put token 1 first).
TEST(Sampler, DrawWalksKeptTokensInIdOrder) {
  const std::vector<float> x = {0.0f, 2.0f, 1.0f, -3.0f};
  double w[4], z = 0;
  for (int i = 0; i < 4; ++i) z += w[i] = std::exp(double(x[size_t(i)]));
  SamplingParams p;
  p.seed = 9;
  for (int64_t step = 0; step < 2000; ++step) {
    const double u = sampling_uniform(p.seed, step) * z;
    int expect = 0;
    for (double acc = w[0]; u >= acc && expect < 3;) acc += w[++expect];
    EXPECT_EQ(sample(x.data(), 4, p, {}, {}, step).token, expect) << step;
  }
}

// Pearson's chi-square of the counts against the expected probabilities (cells with p > 0).
double chi_square(const std::vector<int>& count, const std::vector<double>& prob, int n) {
  double chi = 0;
  for (size_t i = 0; i < prob.size(); ++i) {
    if (prob[i] == 0) {
      EXPECT_EQ(count[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = prob[i] * n;
    chi += (count[i] - e) * (count[i] - e) / e;
  }
  return chi;
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  const std::vector<float> x = {1.0f, 0.2f, 2.0f, -0.5f, 1.5f, 0.0f, 0.8f, -1.0f};
  const int n = 40000;
  auto frequencies = [&](const SamplingParams& p) {
    std::vector<int> count(8, 0);
    for (int64_t step = 0; step < n; ++step) ++count[size_t(sample(x.data(), 8, p, {}, {}, step).token)];
    return count;
  };
  auto softmax = [&](float t, const std::vector<int>& keep) {
    std::vector<double> prob(8, 0.0);
    double z = 0;
    for (int i : keep) z += prob[size_t(i)] = std::exp(double(x[size_t(i)] / t));
    for (double& v : prob) v /= z;
    return prob;
  };
  SamplingParams p;
  p.seed = 1234;
  p.temperature = 0.8f;
  // 7 degrees of freedom: P(chi2 > 30) is about 1e-4.
  EXPECT_LT(chi_square(frequencies(p), softmax(0.8f, {0, 1, 2, 3, 4, 5, 6, 7}), n), 30.0);
  p.top_k = 3;  // the three best, renormalised (2 degrees of freedom: P(chi2 > 18) ~ 1e-4)
  EXPECT_LT(chi_square(frequencies(p), softmax(0.8f, {2, 4, 0}), n), 18.0);
  p.top_k = 0;
  p.top_p = 0.75f;  // ranks 2, 4, 0 have 0.435, 0.233, 0.125: the prefix reaching 0.75 is {2, 4, 0}
  const std::vector<double> full = softmax(0.8f, {0, 1, 2, 3, 4, 5, 6, 7});
  ASSERT_LT(full[2] + full[4], 0.75);
  ASSERT_GE(full[2] + full[4] + full[0], 0.75);
  EXPECT_LT(chi_square(frequencies(p), softmax(0.8f, {2, 4, 0}), n), 18.0);
}

TEST(Sampler, LogprobsNormalise) {
  const std::vector<float> x = gaussian_logits(11, 12, 3.0f);
  for (float t : {0.0f, 0.4f, 1.0f, 2.5f}) {
    SamplingParams p;
    p.temperature = t;
    p.logprobs = 12;
    p.top_k = 3;  // truncation does not change the reported logprobs (full vocabulary)
    const Sampled s = sample(x.data(), 12, p, {}, {}, 3);
    ASSERT_EQ(s.top.size(), 12u);
    double total = 0;
    for (auto [id, lp] : s.top) total += std::exp(double(lp));
    EXPECT_NEAR(total, 1.0, 1e-5) << t;
    for (size_t i = 1; i < s.top.size(); ++i) EXPECT_GE(s.top[i - 1].second, s.top[i].second);
    const auto chosen = std::find_if(s.top.begin(), s.top.end(), [&](auto e) { return e.first == s.token; });
    ASSERT_NE(chosen, s.top.end());
    EXPECT_FLOAT_EQ(chosen->second, s.logprob);
  }
}

// token_logprob (prompt logprobs): a log-softmax in double to float rounding, the top n by (logit
// desc, id asc), and bitwise what a greedy sample() reports for the same token, so that prompt and
// generated tokens' logprobs are one computation.
TEST(Sampler, TokenLogprobIsTheLogSoftmaxAndGreedySamplesAgree) {
  for (int64_t vocab : {1, 7, 1000, 154880}) {
    std::mt19937_64 rng{uint64_t(vocab)};
    const std::vector<float> x = random_logits(rng, vocab);
    const Sampled ref = reference_sample(
        x.data(), vocab,
        [] {
          SamplingParams p;
          p.temperature = 0;
          p.logprobs = 5;
          return p;
        }(),
        {}, {}, 0);
    double mx = x[0], z = 0;
    for (float v : x) mx = std::max(mx, double(v));
    for (float v : x) z += std::exp(double(v) - mx);
    for (int32_t token : {int32_t(0), int32_t(vocab / 2), int32_t(vocab - 1), ref.token}) {
      const Sampled got = token_logprob(x.data(), vocab, token, 5);
      EXPECT_EQ(got.token, token);
      const double want = double(x[size_t(token)]) - mx - std::log(z);
      EXPECT_NEAR(got.logprob, want, 1e-6 * std::max(1.0, std::fabs(want))) << vocab << " " << token;
      EXPECT_LE(got.logprob, 0.0f);
      ASSERT_EQ(got.top.size(), ref.top.size());
      for (size_t i = 0; i < ref.top.size(); ++i) EXPECT_EQ(got.top[i].first, ref.top[i].first) << i;
    }
    SamplingParams greedy;
    greedy.temperature = 0;
    greedy.logprobs = 5;
    const Sampled s = sample(x.data(), vocab, greedy, {}, {}, 0);
    const Sampled t = token_logprob(x.data(), vocab, s.token, 5);
    EXPECT_EQ(s.logprob, t.logprob) << vocab;  // bitwise
    EXPECT_EQ(s.top, t.top) << vocab;
  }
  const std::vector<float> x = gaussian_logits(3, 10);
  glm5::testing::expect_error([&] { token_logprob(x.data(), 10, 10, 0); }, {"token 10", "10"});
  glm5::testing::expect_error([&] { token_logprob(x.data(), 10, -1, 0); }, {"token -1"});
}

TEST(Sampler, LeavesTheCallersLogitsAlone) {
  const std::vector<float> x = gaussian_logits(12, 1000);
  std::vector<float> y = x;
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.repetition_penalty = 1.3f;
  p.presence_penalty = 1.0f;
  p.logprobs = 20;
  sample(y.data(), 1000, p, {1, 2, 3}, {4, 4, 5}, 0);
  EXPECT_EQ(x, y);
}

TEST(Sampler, ValidateRejectsEachBadField) {
  using glm5::testing::expect_error;
  SamplingParams ok;
  EXPECT_NO_THROW(ok.validate());
  auto bad = [&](const char* field, auto change) {
    SamplingParams p;
    change(p);
    expect_error([&] { p.validate(); }, {std::string("'") + field + "'"});
  };
  bad("temperature", [](SamplingParams& p) { p.temperature = -0.1f; });
  bad("temperature", [](SamplingParams& p) { p.temperature = std::numeric_limits<float>::infinity(); });
  bad("top_p", [](SamplingParams& p) { p.top_p = 0.0f; });
  bad("top_p", [](SamplingParams& p) { p.top_p = 1.01f; });
  bad("top_k", [](SamplingParams& p) { p.top_k = -2; });
  bad("min_p", [](SamplingParams& p) { p.min_p = -0.01f; });
  bad("min_p", [](SamplingParams& p) { p.min_p = 1.5f; });
  bad("repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = 0.0f; });
  bad("presence_penalty", [](SamplingParams& p) { p.presence_penalty = 2.5f; });
  bad("frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = -2.5f; });
  bad("max_tokens", [](SamplingParams& p) { p.max_tokens = 0; });
  bad("logprobs", [](SamplingParams& p) { p.logprobs = 21; });
  bad("logprobs", [](SamplingParams& p) { p.logprobs = -2; });
}

}  // namespace
}  // namespace glm5::runtime

// ---------------------------------------------------------------------------------------------
// Speculative decoding's verification (verify_drafts): the target distribution is kept.

namespace glm5::runtime {

namespace {

// Pearson's chi-square statistic of counts against probabilities p (n draws).
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n) {
  double x = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double e = p[i] * double(n);
    x += (double(counts[i]) - e) * (double(counts[i]) - e) / e;
  }
  return x;
}

// The 0.999 quantile of chi-square with 5 degrees of freedom (6 tokens): a correct rule exceeds it
// once in a thousand runs; the seeds are fixed, so the test is deterministic.
constexpr double kChi2Df5 = 20.52;

struct TwoRows {
  std::vector<double> p0 = {0.30, 0.25, 0.20, 0.15, 0.07, 0.03}, p1 = {0.05, 0.10, 0.40, 0.05, 0.30, 0.10};
  std::vector<float> logits;  // [2, 6]: log p
  TwoRows() {
    for (double x : p0) logits.push_back(float(std::log(x)));
    for (double x : p1) logits.push_back(float(std::log(x)));
  }
};

}  // namespace

TEST(SpeculativeSampling, VerifiedTokensFollowTheTargetDistribution) {
  const TwoRows t;
  const int32_t drafts[1] = {1};  // a draft the target gives 0.25
  constexpr int64_t kN = 40000;
  std::vector<int64_t> first(6, 0), second(6, 0);
  int64_t accepted = 0;
  SamplingParams p;
  p.temperature = 1.0f;
  for (int64_t seed = 0; seed < kN; ++seed) {
    p.seed = uint64_t(seed);
    std::vector<int32_t> generated;
    const std::vector<Sampled> out = verify_drafts(t.logits.data(), 6, drafts, 1, p, {}, generated);
    ASSERT_GE(out.size(), 1u);
    ASSERT_LE(out.size(), 2u);
    ASSERT_EQ(generated.size(), out.size());
    ++first[size_t(out[0].token)];
    if (out.size() == 2) {  // the draft was accepted: the next token comes from row 1
      ASSERT_EQ(out[0].token, drafts[0]);
      ++accepted;
      ++second[size_t(out[1].token)];
    } else {
      ASSERT_NE(out[0].token, drafts[0]);
    }
  }
  EXPECT_LT(chi_square(first, t.p0, kN), kChi2Df5);
  EXPECT_LT(chi_square(second, t.p1, accepted), kChi2Df5);
  // The acceptance rate is the target's probability of the draft (binomial, 4.4 sigma).
  EXPECT_NEAR(double(accepted) / kN, t.p0[1], 4.4 * std::sqrt(0.25 * 0.75 / kN));
}

// The same statistic rejects a broken rule: accepting the draft with probability p(draft) and
// otherwise drawing from p itself (not p without the draft) over-weights the draft.
TEST(SpeculativeSampling, TheChiSquareBoundCatchesABrokenAcceptanceRule) {
  const TwoRows t;
  constexpr int64_t kN = 40000;
  const int32_t draft = 1;
  std::vector<int64_t> correct(6, 0), broken(6, 0);
  SamplingParams p;
  p.temperature = 1.0f;
  for (int64_t seed = 0; seed < kN; ++seed) {
    p.seed = uint64_t(seed);
    // The textbook form of the correct rule, with its own coin: accept with p(d), else draw from
    // p without d.
    const double coin = sampling_uniform(uint64_t(seed) ^ 0x5bd1e995u, 0);
    if (coin < t.p0[draft]) {
      ++correct[draft];
      ++broken[draft];
      continue;
    }
    std::vector<float> without(t.logits.begin(), t.logits.begin() + 6);
    without[draft] = -1e30f;
    ++correct[size_t(sample(without.data(), 6, p, {}, {}, 0).token)];
    ++broken[size_t(sample(t.logits.data(), 6, p, {}, {}, 0).token)];
  }
  EXPECT_LT(chi_square(correct, t.p0, kN), kChi2Df5);
  EXPECT_GT(chi_square(broken, t.p0, kN), 10 * kChi2Df5);
}

// Greedy verification is plain greedy decoding: the argmax of each row, up to the first row whose
// argmax is not the next draft; with penalties the rows see the drafts accepted before them.
TEST(SpeculativeSampling, GreedyVerificationIsPlainDecoding) {
  const int64_t V = 8;
  std::vector<float> logits(4 * V);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float((i * 37) % 11) * 0.25f;
  SamplingParams p;
  p.temperature = 0.0f;
  p.repetition_penalty = 1.3f;
  p.logprobs = 2;
  const std::vector<int32_t> prompt = {1, 2, 3};
  // Plain decoding row by row, feeding its own tokens: the drafts that are all accepted.
  std::vector<int32_t> plain_hist = {5};
  std::vector<Sampled> plain;
  for (int64_t j = 0; j < 4; ++j) {
    plain.push_back(sample(logits.data() + j * V, V, p, prompt, plain_hist, int64_t(plain_hist.size())));
    plain_hist.push_back(plain.back().token);
  }
  const int32_t all_right[3] = {plain[0].token, plain[1].token, plain[2].token};
  std::vector<int32_t> hist = {5};
  std::vector<Sampled> got = verify_drafts(logits.data(), V, all_right, 3, p, prompt, hist);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(hist, plain_hist);
  for (size_t j = 0; j < 4; ++j) {
    EXPECT_EQ(got[j].token, plain[j].token);
    EXPECT_EQ(got[j].logprob, plain[j].logprob);
    EXPECT_EQ(got[j].top, plain[j].top);
  }
  const int32_t second_wrong[3] = {plain[0].token, int32_t((plain[1].token + 1) % V), plain[2].token};
  hist = {5};
  got = verify_drafts(logits.data(), V, second_wrong, 3, p, prompt, hist);
  ASSERT_EQ(got.size(), 2u);  // the first draft, then the target's own token where the second was wrong
  EXPECT_EQ(got[1].token, plain[1].token);
}

}  // namespace glm5::runtime
