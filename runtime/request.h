// What a caller asks of the engine (Request) and gets back (Result): shared by the engine, its
// scheduler and the frontends (batch, serve, generate), so the scheduler need not see the engine.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "runtime/sampler.h"

namespace glm5::runtime {

struct Request {
  int64_t index = 0;  // position in the input; results carry it back
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  bool want_prompt_logits = false;  // logits of every prompt row (--dump-logits)
  // >= 0: the logprob of each prompt token after the first under the row before it, with the n
  // best (echo). The last stage computes them (token_logprob), so no logits travel.
  int32_t prompt_logprobs = -1;
  bool want_logits = false;       // logits of every generated step
  bool extra_final_step = false;  // feed the last token once more (its logits close the dump)
  std::string error;              // set: the request is answered with this error, not run
  bool stream = false;            // its tokens go to RequestSource::on_tokens as they are sampled
  // Speculative decoding with the MTP layer when the engine has it on (speculative_tokens > 0);
  // false: this request decodes one token per step. Its tokens are the same either way.
  bool speculative = true;
  // Tokens it has already generated (a preempted request resumes: they are recomputed into the
  // cache and count for the penalties and the sampling step). Set by the scheduler only.
  std::vector<int32_t> generated;
};

struct Result {
  int64_t index = 0;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> top_logprobs;
  std::string finish_reason;  // "length" | "stop" | "error"
  std::string error;
  std::vector<float> prompt_logits;  // [prompt_len, vocab] when asked
  // [prompt_len - 1] when prompt_logprobs >= 0: entry t - 1 is prompt token t (token, its
  // log_softmax under prompt row t - 1, the n best).
  std::vector<Sampled> prompt_logprobs;
  std::vector<float> decode_logits;  // [steps, vocab] when asked
};

}  // namespace glm5::runtime
