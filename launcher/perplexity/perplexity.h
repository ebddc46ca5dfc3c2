// `glm5 perplexity`: perplexity of a text file through the real engine, as llama.cpp's
// llama-perplexity measures it, and KL divergence against a base run (--save-logits / --kl-base).
//
// Windows: the text's tokens are cut into windows of `ctx` tokens starting every `stride` tokens
// (tokens after the last whole window are not scored, as llama-perplexity drops them); each window
// is one prompt, prefilled from position 0, and scores its last `score = min(stride, ctx - ctx/2 - 1)`
// tokens. With the default stride = ctx that is llama-perplexity's rule exactly (non-overlapping
// windows; positions ctx/2 + 1 .. ctx - 1 scored, ctx - ctx/2 - 1 tokens per window); a stride below
// ctx/2 scores every token after the first window once (consecutive scored ranges tile the text).
// Token p of a window is scored by log_softmax(logits of row p - 1)[token p]: runtime::token_logprob,
// the function that gives sampled tokens' and echoed prompt tokens' logprobs, so that perplexity and
// an OpenAI client's loglikelihoods (lm-eval) are the same numbers. Without --save-logits / --kl-base
// the last pipeline stage computes them and no logits travel.
//
// --save-logits F writes a safetensors file: `token_ids` I32 [N] and `logprobs` F32 [N, vocab]
// (the full log-softmax of every scored row, in scoring order) and the window plan as metadata,
// through F.tmp renamed when complete (a failed run leaves no F that --kl-base would take);
// --kl-base F reads one back and prints, per scored token, KL(base || this) summaries: mean with
// its standard error, median, 99th percentile and maximum, and top-1 agreement (the argmax of both
// rows equal). The texts' tokens and the window plan must match the base run's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "launcher/cluster/cluster_config.h"
#include "parallel/comm.h"

namespace glm5::launcher {

struct PerplexityArgs {
  std::string model, cluster, file;
  int64_t ctx = 512, stride = 0;  // stride 0: ctx
  int64_t chunks = 0;             // only the first `chunks` windows (0: all), as llama-perplexity's --chunks
  std::string save_logits, kl_base;
  bool json = false;           // one JSON object on stdout instead of the table
  ClusterOverrides overrides;  // --precision
};

// One window: tokens [start, start + len) of the text; scores its rows [first, len).
struct Window {
  int64_t start = 0, len = 0, first = 0;
};

// The windows of a text of n tokens (see above). Empty when n < 2.
std::vector<Window> plan_windows(int64_t n, int64_t ctx, int64_t stride);

// log_softmax(row)[token] (runtime::token_logprob: the max subtracted, the normaliser in double).
double log_softmax_at(const float* row, int64_t vocab, int32_t token);

// Running sums of per-token negative log-likelihoods: perplexity exp(mean) and its standard error
// ppl * sqrt(var / (n - 1)), as llama-perplexity reports it.
struct NllStats {
  double sum = 0, sum_sq = 0;
  int64_t n = 0;
  void add(double nll) { sum += nll, sum_sq += nll * nll, ++n; }
  double mean() const { return n ? sum / double(n) : 0.0; }
  double perplexity() const;
  double perplexity_stderr() const;
};

// KL(base || this) of one row pair of full log-softmaxes, in double.
double kl_divergence(const float* base_logprobs, const float* logprobs, int64_t vocab);

int run_perplexity(const PerplexityArgs& a, std::unique_ptr<parallel::Comm> world);

}  // namespace glm5::launcher
