// Engine scheduling rules that do not show in the goldens: the KV budget (a request that can never
// fit is refused with a clear error, requests that fit one at a time wait their turn), the step
// token budget, bad requests answered with errors, and EOS / max_tokens handling.
#include <gtest/gtest.h>

#include <cstring>

#include "runtime/model.h"
#include "runtime/sampler.h"
#include "tests/runtime/model_fixture.h"

using namespace glm5;
using namespace glm5::testing;

namespace {

runtime::Request greedy(std::vector<int32_t> prompt, int max_tokens, int64_t index) {
  runtime::Request r;
  r.index = index;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  return r;
}

}  // namespace

TEST(Engine, KvBudgetRefusesWhatCanNeverFitAndQueuesTheRest) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  const double per_block =
      double((runtime::KvPool::bytes_per_token(m.cfg, 0, int(m.cfg.num_hidden_layers)) * runtime::kBlockTokens));
  std::vector<runtime::Request> reqs = {greedy({1, 2, 3, 4, 5, 6, 7, 8}, 4, 0),
                                        greedy({9, 10, 11, 12, 13, 14, 15, 16}, 4, 1),
                                        greedy(std::vector<int32_t>(70, 3), 4, 2)};
  runtime::EngineOptions opt;
  opt.kv_budget_bytes = per_block * 1.5;  // one block: one short request (8 + 4 + 1 tokens) at a time
  auto res = m.run(reqs, opt);
  ASSERT_EQ(res.size(), 3u);
  EXPECT_TRUE(res[0].error.empty()) << res[0].error;
  EXPECT_TRUE(res[1].error.empty()) << res[1].error;
  EXPECT_EQ(res[0].tokens.size(), 4u);
  EXPECT_EQ(res[1].tokens.size(), 4u);
  EXPECT_EQ(res[2].finish_reason, "error");
  EXPECT_NE(res[2].error.find("request needs 2 KV blocks of 64 tokens (prompt + max_tokens), more than the 1 blocks"),
            std::string::npos)
      << res[2].error;
  // Queued behind the budget, the answers equal those of an unlimited run.
  auto free_run = m.run(reqs);
  EXPECT_EQ(res[0].tokens, free_run[0].tokens);
  EXPECT_EQ(res[1].tokens, free_run[1].tokens);
  EXPECT_EQ(free_run[2].tokens.size(), 4u);
}

TEST(Engine, StepTokenBudgetBoundsEveryStep) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  std::vector<runtime::Request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(greedy(std::vector<int32_t>(size_t(30 + i), 7 + i), 5, i));
  auto free_run = m.run(reqs);
  EXPECT_EQ(m.last_stats.max_step_rows, 4 * 30 + 6);  // every prompt in the first step
  runtime::EngineOptions opt;
  opt.max_batch = 4;
  opt.max_step_tokens = 16;
  auto res = m.run(reqs, opt);
  EXPECT_EQ(m.last_stats.max_step_rows, 16);
  EXPECT_EQ(m.last_stats.prompt_tokens, 4 * 30 + 6);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(res[i].tokens, free_run[i].tokens) << i;
  // The budget must leave room for one decode token per running sequence.
  opt.max_step_tokens = 3;
  try {
    m.run(reqs, opt);
    ADD_FAILURE() << "max_step_tokens 3 < max_batch 4 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_step_tokens must be >= max_batch (4)"), std::string::npos) << e.what();
  }
}

TEST(Engine, BadRequestsGetErrorsAndTheOthersRun) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  auto too_long = greedy(std::vector<int32_t>(size_t(m.cfg.max_position_embeddings), 1), 8, 1);
  auto empty = greedy({}, 4, 2);
  auto res = m.run({greedy({5, 6, 7}, 3, 0), too_long, empty});
  ASSERT_EQ(res.size(), 3u);
  EXPECT_EQ(res[0].tokens.size(), 3u);
  EXPECT_NE(res[1].error.find("exceeds the context length"), std::string::npos) << res[1].error;
  EXPECT_NE(res[2].error.find("prompt is empty"), std::string::npos) << res[2].error;
}

TEST(Engine, StopsAtEosUnlessIgnored) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  // The tiny-a golden run produces eos id 510 as its 14th token (index 13).
  Golden g(std::string(GLM5_TEST_DATA) + "/tiny-a/golden.safetensors");
  auto prompt = g.get<int32_t>("prompt_ids");
  auto gold = g.get<int32_t>("decode_tokens");
  auto r = greedy(prompt, 16, 0);
  r.sampling.ignore_eos = false;
  auto res = m.run({r});
  ASSERT_EQ(res[0].tokens.size(), 14u);
  EXPECT_EQ(res[0].tokens.back(), 510);
  EXPECT_EQ(res[0].finish_reason, "stop");
  EXPECT_EQ(res[0].tokens, std::vector<int32_t>(gold.begin(), gold.begin() + 14));
  r.sampling.ignore_eos = true;
  res = m.run({r});
  EXPECT_EQ(res[0].tokens, gold);
  EXPECT_EQ(res[0].finish_reason, "length");
}

// A KV pool of 3 blocks for sequences that grow to 2 blocks each: sequences get preempted and
// recomputed, and every token and every logit is bitwise what the unconstrained run gives
// (rows take the same attention form and reduction order however they are recomputed).
TEST(Engine, PreemptionUnderATinyPoolChangesNoBit) {
  for (const char* model : {"tiny-a", "tiny-v32"}) {
    SCOPED_TRACE(model);
    OneProcessModel m(std::string(GLM5_TEST_DATA) + "/" + model);
    std::vector<runtime::Request> reqs;
    for (int i = 0; i < 4; ++i) {
      std::vector<int32_t> prompt;
      for (int t = 0; t < 50 + 3 * i; ++t) prompt.push_back(int32_t((t * 31 + i * 7 + 1) % m.cfg.vocab_size));
      runtime::Request r = greedy(prompt, 30, i);
      r.want_logits = true;
      r.sampling.logprobs = 3;
      reqs.push_back(r);
    }
    auto free_run = m.run(reqs);
    EXPECT_EQ(m.last_stats.preemptions, 0);
    runtime::EngineOptions opt;
    opt.kv_budget_bytes =
        3.5 *
        double((runtime::KvPool::bytes_per_token(m.cfg, 0, int(m.cfg.num_hidden_layers)) * runtime::kBlockTokens));
    opt.prefill_chunk = 16;
    auto tight = m.run(reqs, opt);
    EXPECT_GT(m.last_stats.preemptions, 0);
    EXPECT_LE(m.last_stats.kv_blocks_peak, 3);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(tight[i].error.empty()) << tight[i].error;
      EXPECT_EQ(tight[i].tokens, free_run[i].tokens) << i;
      EXPECT_EQ(tight[i].logprobs, free_run[i].logprobs) << i;
      ASSERT_EQ(tight[i].decode_logits.size(), free_run[i].decode_logits.size()) << i;
      EXPECT_EQ(0, std::memcmp(tight[i].decode_logits.data(), free_run[i].decode_logits.data(),
                               tight[i].decode_logits.size() * sizeof(float)))
          << i;
    }
  }
}

// Requests sharing a 150-token prefix (2 full blocks): with prefix sharing the later ones take
// the first one's blocks instead of computing them, and every token and logit is bitwise the
// unshared run's (also under a pool small enough to preempt).
TEST(Engine, PrefixSharingChangesNoBit) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  std::vector<int32_t> prefix;
  for (int t = 0; t < 150; ++t) prefix.push_back(int32_t((t * 17 + 3) % m.cfg.vocab_size));
  std::vector<runtime::Request> reqs;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt = prefix;
    for (int t = 0; t < 1 + 5 * i; ++t) prompt.push_back(int32_t((t * 13 + i) % m.cfg.vocab_size));
    runtime::Request r = greedy(prompt, 8, i);
    r.want_logits = true;
    reqs.push_back(r);
  }
  runtime::EngineOptions off;
  off.prefix_sharing = false;
  auto plain = m.run(reqs, off);
  EXPECT_EQ(m.last_stats.prefix_hit_tokens, 0);
  runtime::EngineOptions on;
  on.max_batch = 3;  // later requests arrive after the first blocks are filled
  auto shared = m.run(reqs, on);
  EXPECT_EQ(m.last_stats.prefix_hit_tokens, 5 * 128);  // 5 requests x 2 full blocks
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(shared[i].tokens, plain[i].tokens) << i;
    ASSERT_EQ(shared[i].decode_logits.size(), plain[i].decode_logits.size());
    EXPECT_EQ(0, std::memcmp(shared[i].decode_logits.data(), plain[i].decode_logits.data(),
                             plain[i].decode_logits.size() * sizeof(float)))
        << i;
  }
  on.kv_budget_bytes =
      6.5 * double((runtime::KvPool::bytes_per_token(m.cfg, 0, int(m.cfg.num_hidden_layers)) * runtime::kBlockTokens));
  auto tight = m.run(reqs, on);
  EXPECT_GT(m.last_stats.prefix_hit_tokens, 0);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(tight[i].tokens, plain[i].tokens) << i;
  // One block per step: the others take each prefix block as soon as it is filled, waiting for
  // the next (blocks shared while waiting reach the stages with the next step).
  runtime::EngineOptions slow;
  slow.prefill_chunk = 64;
  slow.max_batch = 6;
  auto progressive = m.run(reqs, slow);
  EXPECT_EQ(m.last_stats.prefix_hit_tokens, 5 * 128);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(progressive[i].tokens, plain[i].tokens) << i;
    EXPECT_EQ(0, std::memcmp(progressive[i].decode_logits.data(), plain[i].decode_logits.data(),
                             plain[i].decode_logits.size() * sizeof(float)))
        << i;
  }
}

// prompt_logprobs (echo): one entry per prompt token after the first, each bitwise
// token_logprob of the prompt row before it (the logits of a want_prompt_logits run), over
// several prefill chunks, beside a sharing request with the same prompt, and under preemption;
// no logits travel and the generated tokens are those of a plain run.
TEST(Engine, PromptLogprobsAreTheLogSoftmaxOfThePromptRows) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  const int64_t V = m.cfg.vocab_size;
  std::vector<int32_t> prompt;
  for (int t = 0; t < 150; ++t) prompt.push_back(int32_t((t * 31 + 7) % V));
  auto dump = m.run({golden_request(prompt, 4)});
  ASSERT_EQ(int64_t(dump[0].prompt_logits.size()), int64_t(prompt.size()) * V);
  runtime::Request echo = greedy(prompt, 4, 0);
  echo.prompt_logprobs = 3;
  const runtime::Request plain = greedy(prompt, 4, 1);  // shares the prefix blocks when it can
  auto check = [&](const runtime::Result& r, const std::string& where) {
    SCOPED_TRACE(where);
    ASSERT_TRUE(r.error.empty()) << r.error;
    EXPECT_TRUE(r.prompt_logits.empty());
    EXPECT_EQ(r.tokens, dump[0].tokens);
    ASSERT_EQ(r.prompt_logprobs.size(), prompt.size() - 1);
    for (size_t t = 1; t < prompt.size(); ++t) {
      const runtime::Sampled want =
          runtime::token_logprob(&dump[0].prompt_logits[(t - 1) * size_t(V)], V, prompt[t], 3);
      const runtime::Sampled& got = r.prompt_logprobs[t - 1];
      ASSERT_EQ(got.token, prompt[t]) << t;
      ASSERT_EQ(got.logprob, want.logprob) << t;
      ASSERT_EQ(got.top, want.top) << t;
    }
  };
  runtime::EngineOptions chunks;
  chunks.prefill_chunk = 48;
  auto a = m.run({plain, echo}, chunks);
  check(a[0], "chunks of 48 beside a plain request");
  EXPECT_TRUE(a[1].prompt_logprobs.empty());
  // Two longer requests admitted first: the echo request, the youngest, is the one preempted
  // when the pool runs dry, and its prompt rows are computed again.
  std::vector<runtime::Request> crowd;
  for (int i = 1; i <= 2; ++i) {
    std::vector<int32_t> other;
    for (int t = 0; t < 100; ++t) other.push_back(int32_t((t * 17 + 5 * i) % V));
    crowd.push_back(greedy(other, 60, i));
  }
  crowd.push_back(echo);
  runtime::EngineOptions tight;
  tight.prefill_chunk = 16;
  tight.max_batch = 3;
  tight.kv_budget_bytes =
      5.5 * double((runtime::KvPool::bytes_per_token(m.cfg, 0, int(m.cfg.num_hidden_layers)) * runtime::kBlockTokens));
  auto b = m.run(crowd, tight);
  check(b[0], "a pool of 5 blocks");
  EXPECT_GT(m.last_stats.preemptions, 0);
}

// kv_dtype bf16: logits stay close to the f32 cache's (keys rounded to bf16 are the only
// difference), and a sequence's bits still do not depend on what it is batched or chunked with.
TEST(Engine, Bf16KvCacheIsCloseToF32AndStillBatchInvariant) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  std::vector<int32_t> prompt;
  for (int t = 0; t < 60; ++t) prompt.push_back(int32_t((t * 29 + 5) % m.cfg.vocab_size));
  auto f32 = m.run({golden_request(prompt, 8)});
  runtime::EngineOptions bf;
  bf.kv_dtype = DType::BF16;
  auto alone = m.run({golden_request(prompt, 8)}, bf);
  // Rounded keys move logits a little, except where they flip an indexer selection (a near tie
  // among the top-k scores): there a row attends to another key and moves more. So: the mean
  // change is small, most rows keep their argmax, and something did change.
  const int64_t V = m.cfg.vocab_size, P = int64_t(prompt.size());
  double sum = 0;
  float worst = 0;
  int same_argmax = 0;
  for (int64_t r = 0; r < P; ++r) {
    const float* a = f32[0].prompt_logits.data() + r * V;
    const float* b = alone[0].prompt_logits.data() + r * V;
    for (int64_t v = 0; v < V; ++v) {
      sum += std::fabs(a[v] - b[v]);
      worst = std::max(worst, std::fabs(a[v] - b[v]));
    }
    same_argmax += runtime::argmax(a, V) == runtime::argmax(b, V) ? 1 : 0;
  }
  const double mean = sum / double(P * V);
  EXPECT_GT(worst, 0.0f) << "the bf16 cache changed nothing: is it used?";
  EXPECT_LT(mean, 0.06) << "max " << worst;  // observed 0.021 (max 0.93) on tiny-a
  EXPECT_GE(same_argmax, P * 9 / 10) << "mean " << mean << ", max " << worst;
  std::vector<runtime::Request> batch;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> p;
    for (int t = 0; t < 20 + 17 * i; ++t) p.push_back(int32_t((t * 7 + i) % m.cfg.vocab_size));
    batch.push_back(golden_request(p, 3 + i, i));
  }
  batch.push_back(golden_request(prompt, 8, 4));
  bf.prefill_chunk = 7;
  bf.max_batch = 3;
  auto mixed = m.run(batch, bf);
  EXPECT_EQ(mixed[4].tokens, alone[0].tokens);
  EXPECT_EQ(0, std::memcmp(mixed[4].prompt_logits.data(), alone[0].prompt_logits.data(),
                           alone[0].prompt_logits.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(mixed[4].decode_logits.data(), alone[0].decode_logits.data(),
                           alone[0].decode_logits.size() * sizeof(float)));
}
