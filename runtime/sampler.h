// Token sampling on host logits: greedy, temperature, top-k, top-p, min-p, repetition / presence /
// frequency penalties, and a per-request seed. The random draw for a request's i-th token depends
// only on (seed, i), so a request samples the same tokens whatever else is in the batch and
// whatever the layout.
//
// What sample() computes, in this order (x = a working copy of the logits):
//  1. Repetition penalty (HF style) on every token seen in prompt + generated, once per distinct
//     token: x > 0 ? x / repetition_penalty : x * repetition_penalty.
//  2. Presence / frequency penalties (OpenAI style) on generated tokens only, c = the number of
//     times the token was generated: x -= presence_penalty + frequency_penalty * c.
//  3. temperature == 0: greedy, the argmax of x, lowest id on ties. Nothing else applies.
//  4. temperature > 0: x /= temperature. Candidates are ranked by (x descending, id ascending);
//     w = exp(x - max x) (so the best candidate has w = 1). Then
//       top_k > 0:  keep the top_k best;
//       min_p > 0:  of those, keep the ones with w >= min_p (always at least the best one);
//       top_p < 1:  of those, keep the smallest prefix in rank order whose mass reaches
//                   top_p * (the mass top_k / min_p kept).
//     The draw: u = sampling_uniform(seed, step) * (the kept mass); walk the kept candidates in
//     TOKEN-ID ORDER accumulating w and take the first where u < the running sum (the last kept
//     one if rounding leaves none). Drawing in id order rather than rank order is deliberate: it
//     gives each kept token its probability just the same, and needs no sort of the nucleus.
//  5. logprobs >= 0: logprob = log-softmax over the whole vocabulary of x (penalised and, when
//     temperature > 0, temperature-scaled) at the chosen token; logprobs = n > 0 adds the top n
//     tokens by (x descending, id ascending) with their log-softmax values.
// Logits are expected finite (large negative values are fine). Cost: a few vectorised passes
// over the vocabulary and no sort of it (under 1 ms per token on one core at vocab 154880; see
// BENCHMARKS.md); scratch memory is per thread and reused between calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace glm5::runtime {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy
  float top_p = 1.0f;               // (0, 1]
  int32_t top_k = 0;                // 0 or -1 = off
  float min_p = 0.0f;               // [0, 1]
  float repetition_penalty = 1.0f;  // > 0; HF style: divides positive logits of seen tokens
  float presence_penalty = 0.0f;    // [-2, 2], OpenAI style, on generated tokens
  float frequency_penalty = 0.0f;   // [-2, 2]
  uint64_t seed = 0;
  int32_t max_tokens = 16;
  int32_t logprobs = -1;  // -1 = none; >= 0: logprob of the chosen token (+ top-n)
  bool ignore_eos = false;
  std::vector<std::string> stop;  // stop strings (need a tokenizer)
  // Throws glm5::Error naming the first invalid field, its allowed range and the value found.
  void validate() const;
  // Whether `token` is an end of sequence that ends the answer (one of eos unless ignore_eos); the
  // one rule of where an answer stops on a token id (stop strings are the frontend's text).
  bool ends_at(int32_t token, const std::vector<int32_t>& eos) const {
    if (ignore_eos) return false;
    for (int32_t e : eos)
      if (e == token) return true;
    return false;
  }
};

struct Sampled {
  int32_t token = -1;
  float logprob = 0.0f;                        // log softmax of the (penalised, temperature-scaled) logits at token
  std::vector<std::pair<int32_t, float>> top;  // top-n alternatives when logprobs > 0
};

// Samples from logits[vocab] (the caller's array is not modified). `prompt` and `generated` feed
// the penalties; `step` is the index of the token being generated. Semantics: see the top.
Sampled sample(const float* logits, int64_t vocab, const SamplingParams& p, const std::vector<int32_t>& prompt,
               const std::vector<int32_t>& generated, int64_t step);

// Speculative decoding's verification of drafts[0..n_drafts) over logits [n_drafts + 1, vocab]
// (row j: the target's logits after the fed token and drafts 0..j-1). Row j's token is sampled
// exactly as sample() samples it in plain decoding (history `generated` plus the tokens accepted
// before it, step = its index), and verification stops after the first row whose token is not
// the next draft. With greedy drafts (q puts all its mass on the draft) this is the standard
// speculative-sampling rule: the draft is accepted with probability p(draft), and on rejection the
// token comes from p without the draft, renormalised, so every token has its target probability.
// Being plain decoding's own draw, it also gives plain decoding's tokens bit for bit for any seed.
// Appends the tokens to `generated` and returns them (1 to n_drafts + 1).
std::vector<Sampled> verify_drafts(const float* logits, int64_t vocab, const int32_t* drafts, int64_t n_drafts,
                                   const SamplingParams& p, const std::vector<int32_t>& prompt,
                                   std::vector<int32_t>& generated);

// log_softmax(logits)[token] over the whole vocabulary and, for n > 0, the n best tokens with
// theirs, best first (ties to the lower id): the arithmetic of sample()'s logprobs (step 5: the
// max subtracted, exp and the normaliser in double) on the logits as given (no penalty, no
// temperature). Prompt logprobs (echo) are computed with it, so prompt and generated tokens'
// logprobs agree. Result: token, logprob, top.
Sampled token_logprob(const float* logits, int64_t vocab, int32_t token, int32_t n);

// Index of the largest value, lowest index on ties (NaN entries are skipped).
int32_t argmax(const float* x, int64_t n);

// The draw's uniform number in [0, 1) for (seed, step): splitmix64 of splitmix64(seed) mixed
// with the step; 53 random bits. Exposed so tests can reproduce a draw.
double sampling_uniform(uint64_t seed, int64_t step);

}  // namespace glm5::runtime
