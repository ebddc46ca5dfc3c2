// Sampler cost per sampled token on one core at the GLM-5 vocabulary (154880), against one plain
// pass over the same logits measured in the same run (a memcpy of the 154880 floats), and against
// the previous full-sort sampler (copied below as old_sort_sampler). Not a test: it prints a
// markdown table. Thread CPU time per call, median (and p90) over --calls calls with different
// steps, so other processes on a shared machine do not count.
//
//   OMP_NUM_THREADS=1 taskset -c 0 build/bench_sampler [--calls 2000] [--old-calls 30]
//
// Logits: N(0, 2.5) per token (fixed seed) plus 10 boosted tokens at +10, +10.5, ..., +14.5: a
// spread like an LM's with a few strong candidates, which at temperature 0.8 hold 98.7% of the
// mass. Two extra rows use the Gaussian alone ("flat": no strong candidate, so top_p 0.95
// keeps 11320 tokens spread over the vocabulary) and plain temperature sampling (every token
// kept). Penalty cases see a prompt of 800 and a history of 200 tokens (ids uniform over the
// vocabulary).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/sampler.h"

using glm5::runtime::Sampled;
using glm5::runtime::SamplingParams;

namespace {

double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// ---- The previous sampler, verbatim but for names: the comparison point ----
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
int32_t old_argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}
Sampled old_sort_sampler(const float* logits, int64_t vocab, const SamplingParams& p,
                         const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated, int64_t step) {
  std::vector<float> x(logits, logits + vocab);
  if (p.repetition_penalty != 1.0f) {
    std::vector<char> seen(static_cast<size_t>(vocab), 0);
    for (int32_t t : prompt)
      if (t >= 0 && t < vocab) seen[size_t(t)] = 1;
    for (int32_t t : generated)
      if (t >= 0 && t < vocab) seen[size_t(t)] = 1;
    for (int64_t i = 0; i < vocab; ++i)
      if (seen[size_t(i)])
        x[size_t(i)] = x[size_t(i)] > 0 ? x[size_t(i)] / p.repetition_penalty : x[size_t(i)] * p.repetition_penalty;
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
  if (p.temperature == 0.0f) return finish(old_argmax(x.data(), vocab), x);
  for (float& f : x) f /= p.temperature;
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return x[size_t(a)] > x[size_t(b)]; });
  size_t n = idx.size();
  if (p.top_k > 0) n = std::min(n, size_t(p.top_k));
  const double mx = x[size_t(idx[0])];
  std::vector<double> prob(n);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(double(x[size_t(idx[i])]) - mx);
  if (p.min_p > 0.0f) {
    size_t keep = 0;
    while (keep < n && prob[keep] >= double(p.min_p) * prob[0]) ++keep;
    n = std::max<size_t>(keep, 1);
  }
  sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i];
  if (p.top_p < 1.0f) {
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
  double u = old_uniform(p.seed, step) * sum, acc = 0;
  size_t pick = n - 1;
  for (size_t i = 0; i < n; ++i) {
    acc += prob[i];
    if (u < acc) {
      pick = i;
      break;
    }
  }
  return finish(idx[pick], x);
}

// ---- Measurement ----

struct Stats {
  double median_us = 0, p90_us = 0;
};
template <typename F>
Stats time_calls(int calls, F&& call) {
  std::vector<double> t(static_cast<size_t>(calls));
  for (int i = 0; i < calls; ++i) {
    const double t0 = thread_seconds();
    call(i);
    t[size_t(i)] = 1e6 * (thread_seconds() - t0);
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t[std::min(t.size() - 1, t.size() * 9 / 10)]};
}

struct Case {
  std::string name;
  SamplingParams p;
  bool history = false;
  bool flat = false;  // the Gaussian logits without the boosted tokens
};

}  // namespace

int main(int argc, char** argv) {
  int calls = 2000, old_calls = 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--calls"))
      calls = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--old-calls"))
      old_calls = std::atoi(argv[i + 1]);
  }
  const int64_t vocab = 154880;
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> gauss(0.0f, 2.5f);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (float& f : logits) f = gauss(rng);
  const std::vector<float> flat = logits;
  for (int j = 0; j < 10; ++j) logits[size_t(rng() % uint64_t(vocab))] += 10.0f + 0.5f * float(j);
  std::vector<int32_t> prompt(800), history(200);
  for (int32_t& t : prompt) t = int32_t(rng() % uint64_t(vocab));
  for (int32_t& t : history) t = int32_t(rng() % uint64_t(vocab));
  const std::vector<int32_t> none;

  std::vector<Case> cases;
  auto add = [&](std::string name, auto set, bool hist = false, bool flat_logits = false) {
    Case c{std::move(name), SamplingParams{}, hist, flat_logits};
    c.p.seed = 7;
    set(c.p);
    cases.push_back(c);
  };
  add("greedy", [](SamplingParams& p) { p.temperature = 0.0f; });
  add("temperature 0.8 + top_p 0.95", [](SamplingParams& p) { p.temperature = 0.8f, p.top_p = 0.95f; });
  add("top_k 50 (temperature 1)", [](SamplingParams& p) { p.top_k = 50; });
  add("greedy + top_logprobs 20", [](SamplingParams& p) { p.temperature = 0.0f, p.logprobs = 20; });
  add(
      "T 0.8 + top_p 0.95 + repetition 1.1 + top_logprobs 20 (1000-token history)",
      [](SamplingParams& p) { p.temperature = 0.8f, p.top_p = 0.95f, p.repetition_penalty = 1.1f, p.logprobs = 20; },
      true);
  add(
      "extra: flat logits, temperature 0.8 + top_p 0.95",
      [](SamplingParams& p) { p.temperature = 0.8f, p.top_p = 0.95f; }, false, true);
  add("extra: temperature 1, nothing truncated", [](SamplingParams&) {});

  std::vector<float> copy(static_cast<size_t>(vocab));
  const Stats pass = time_calls(calls, [&](int i) {
    logits[size_t(i) % 16] += 0.0f;  // keep the copy from being hoisted out of the loop
    std::memcpy(copy.data(), logits.data(), copy.size() * sizeof(float));
    asm volatile("" : : "r"(copy.data()) : "memory");
  });

  std::printf(
      "vocab %lld; logits N(0, 2.5) + 10 boosted tokens (+10 .. +14.5); %d calls per case "
      "(old: %d); thread CPU time per call\n\n",
      (long long)vocab, calls, old_calls);
  std::printf("reference pass (memcpy of %lld floats, %.0f KB): median %.1f us\n\n", (long long)vocab,
              double(vocab) * 4 / 1024, pass.median_us);
  std::printf("| case | us / token (median) | p90 | x memcpy | old full-sort us | old / new | distinct draws* |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  bool met = true;
  for (const Case& c : cases) {
    const std::vector<int32_t>& pr = c.history ? prompt : none;
    const std::vector<int32_t>& gen = c.history ? history : none;
    const float* x = c.flat ? flat.data() : logits.data();
    int64_t sink = 0;
    const Stats fast =
        time_calls(calls, [&](int i) { sink += glm5::runtime::sample(x, vocab, c.p, pr, gen, i).token; });
    const Stats old = time_calls(old_calls, [&](int i) { sink += old_sort_sampler(x, vocab, c.p, pr, gen, i).token; });
    // *distinct tokens drawn over the timed calls: how wide the kept set is
    std::vector<int32_t> drawn;
    for (int i = 0; i < std::min(calls, 500); ++i)
      drawn.push_back(glm5::runtime::sample(x, vocab, c.p, pr, gen, i).token);
    std::sort(drawn.begin(), drawn.end());
    const auto distinct = std::unique(drawn.begin(), drawn.end()) - drawn.begin();
    met = met && fast.median_us <= 1000.0;
    std::printf("| %s | %.1f | %.1f | %.1f | %.0f | %.0f | %lld |%s\n", c.name.c_str(), fast.median_us, fast.p90_us,
                fast.median_us / pass.median_us, old.median_us, old.median_us / fast.median_us, (long long)distinct,
                sink == 42 ? " " : "");
  }
  std::printf(
      "\n*distinct tokens among the first 500 draws. Target <= 1000 us per sampled token "
      "for every case: %s\n",
      met ? "met" : "NOT met");
  return 0;
}
