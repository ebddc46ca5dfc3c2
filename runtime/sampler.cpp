// Host-side sampler. Greedy is exact argmax (lowest index on ties); random draws come from a
// counter-based generator keyed by (seed, step), never from shared state.
#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "core/check.h"

namespace glm5::runtime {

void SamplingParams::validate() const {
  CHECK(std::isfinite(temperature) && temperature >= 0.0f,
        "sampling field 'temperature': expected a number >= 0, found ", temperature);
  CHECK(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f,
        "sampling field 'top_p': expected a number in (0, 1], found ", top_p);
  CHECK(top_k >= -1, "sampling field 'top_k': expected -1, 0 (off) or a positive integer, found ", top_k);
  CHECK(std::isfinite(min_p) && min_p >= 0.0f && min_p <= 1.0f,
        "sampling field 'min_p': expected a number in [0, 1], found ", min_p);
  CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f,
        "sampling field 'repetition_penalty': expected a number > 0, found ", repetition_penalty);
  CHECK(std::isfinite(presence_penalty) && std::fabs(presence_penalty) <= 2.0f,
        "sampling field 'presence_penalty': expected a number in [-2, 2], found ", presence_penalty);
  CHECK(std::isfinite(frequency_penalty) && std::fabs(frequency_penalty) <= 2.0f,
        "sampling field 'frequency_penalty': expected a number in [-2, 2], found ", frequency_penalty);
  CHECK(max_tokens >= 1, "sampling field 'max_tokens': expected an integer >= 1, found ", max_tokens);
  CHECK(logprobs >= -1 && logprobs <= 20,
        "sampling field 'logprobs': expected an integer in [0, 20], found ", logprobs);
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in [0, 1) from (seed, step).
double uniform(uint64_t seed, int64_t step) {
  uint64_t r = splitmix64(splitmix64(seed) ^ uint64_t(step) * 0xd1342543de82ef95ull);
  return double(r >> 11) * (1.0 / 9007199254740992.0);
}
}  // namespace

Sampled sample(const float* logits, int64_t vocab, const SamplingParams& p,
               const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
               int64_t step) {
  std::vector<float> x(logits, logits + vocab);
  // Penalties: repetition (HF) on prompt + generated; presence/frequency (OpenAI) on generated.
  if (p.repetition_penalty != 1.0f) {
    std::vector<char> seen(static_cast<size_t>(vocab), 0);
    for (int32_t t : prompt) if (t >= 0 && t < vocab) seen[size_t(t)] = 1;
    for (int32_t t : generated) if (t >= 0 && t < vocab) seen[size_t(t)] = 1;
    for (int64_t i = 0; i < vocab; ++i)
      if (seen[size_t(i)]) x[size_t(i)] = x[size_t(i)] > 0 ? x[size_t(i)] / p.repetition_penalty
                                                           : x[size_t(i)] * p.repetition_penalty;
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> count;
    for (int32_t t : generated) ++count[t];
    for (auto [t, c] : count)
      if (t >= 0 && t < vocab) x[size_t(t)] -= p.presence_penalty + p.frequency_penalty * float(c);
  }

  auto log_softmax_at = [&](const std::vector<float>& v, int32_t tok) {
    double mx = *std::max_element(v.begin(), v.end()), sum = 0;
    for (float f : v) sum += std::exp(double(f) - mx);
    return float(double(v[size_t(tok)]) - mx - std::log(sum));
  };
  auto finish = [&](int32_t tok, const std::vector<float>& dist) {
    Sampled s;
    s.token = tok;
    if (p.logprobs >= 0) {
      s.logprob = log_softmax_at(dist, tok);
      if (p.logprobs > 0) {
        std::vector<int32_t> idx(static_cast<size_t>(vocab));
        std::iota(idx.begin(), idx.end(), 0);
        int64_t n = std::min<int64_t>(p.logprobs, vocab);
        std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
          return dist[size_t(a)] > dist[size_t(b)] || (dist[size_t(a)] == dist[size_t(b)] && a < b);
        });
        for (int64_t i = 0; i < n; ++i) s.top.push_back({idx[size_t(i)], log_softmax_at(dist, idx[size_t(i)])});
      }
    }
    return s;
  };

  if (p.temperature == 0.0f) return finish(argmax(x.data(), vocab), x);

  for (float& f : x) f /= p.temperature;
  // Candidates sorted by logit (descending, lower id first on ties), then truncated.
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return x[size_t(a)] > x[size_t(b)]; });
  size_t n = idx.size();
  if (p.top_k > 0) n = std::min(n, size_t(p.top_k));
  const double mx = x[size_t(idx[0])];
  std::vector<double> prob(n);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(double(x[size_t(idx[i])]) - mx);
  if (p.min_p > 0.0f) {  // keep tokens with prob >= min_p * max prob
    size_t keep = 0;
    while (keep < n && prob[keep] >= double(p.min_p) * prob[0]) ++keep;
    n = std::max<size_t>(keep, 1);
  }
  sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i];
  if (p.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p
    double acc = 0;
    size_t keep = 0;
    while (keep < n) {
      acc += prob[keep++] / sum;
      if (acc >= double(p.top_p)) break;
    }
    n = keep;
    sum = 0;
    for (size_t i = 0; i < n; ++i) sum += prob[i];
  }
  double u = uniform(p.seed, step) * sum, acc = 0;
  size_t pick = n - 1;
  for (size_t i = 0; i < n; ++i) {
    acc += prob[i];
    if (u < acc) { pick = i; break; }
  }
  return finish(idx[pick], x);
}

}  // namespace glm5::runtime
