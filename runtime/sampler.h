// Token sampling on host logits: greedy, temperature, top-k, top-p, min-p, repetition / presence /
// frequency penalties, and a per-request seed. The random draw for a request's i-th token depends
// only on (seed, i), so a request samples the same tokens whatever else is in the batch and
// whatever the layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace glm5::runtime {

struct SamplingParams {
  float temperature = 1.0f;        // 0 = greedy
  float top_p = 1.0f;              // (0, 1]
  int32_t top_k = 0;               // 0 or -1 = off
  float min_p = 0.0f;              // [0, 1]
  float repetition_penalty = 1.0f; // > 0; HF style: divides positive logits of seen tokens
  float presence_penalty = 0.0f;   // [-2, 2], OpenAI style, on generated tokens
  float frequency_penalty = 0.0f;  // [-2, 2]
  uint64_t seed = 0;
  int32_t max_tokens = 16;
  int32_t logprobs = -1;           // -1 = none; >= 0: logprob of the chosen token (+ top-n)
  bool ignore_eos = false;
  std::vector<std::string> stop;   // stop strings (need a tokenizer)
  // Throws glm5::Error naming the first invalid field, its allowed range and the value found.
  void validate() const;
};

struct Sampled {
  int32_t token = -1;
  float logprob = 0.0f;  // log softmax of the (penalised, temperature-scaled) logits at token
  std::vector<std::pair<int32_t, float>> top;  // top-n alternatives when logprobs > 0
};

// Samples from logits[vocab] (copied; the caller's array is not modified). `prompt` and
// `generated` feed the penalties; `step` is the index of the token being generated.
Sampled sample(const float* logits, int64_t vocab, const SamplingParams& p,
               const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
               int64_t step);

// Index of the largest value, lowest index on ties.
int32_t argmax(const float* x, int64_t n);

}  // namespace glm5::runtime
