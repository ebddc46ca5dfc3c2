// Batch invariance: a sequence's logits are bitwise identical whether it runs alone or inside a
// batch of other sequences of different lengths, whatever the batch limit and prefill chunking.
#include <gtest/gtest.h>

#include <omp.h>

#include <cstring>

#include "tests/runtime/model_fixture.h"

using namespace glm5;
using namespace glm5::testing;

namespace {

std::vector<int32_t> make_prompt(int n, int vocab, unsigned seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    p.push_back(int32_t((seed >> 8) % unsigned(vocab)));
  }
  return p;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void check_invariance(const std::string& dir) {
  OneProcessModel m(dir);
  const int V = int(m.cfg.vocab_size);
  const auto target = make_prompt(40, V, 1);  // longer than index_topk of the tiny models
  auto alone = m.run({golden_request(target, 6)});

  std::vector<runtime::Request> batch;
  const int lens[] = {3, 77, 40, 1, 18, 55};
  for (int i = 0; i < 6; ++i) batch.push_back(golden_request(make_prompt(lens[i], V, 10 + i), 2 + i, i));
  batch.push_back(golden_request(target, 6, 6));
  for (int max_batch : {2, 7}) {
    for (int64_t chunk : {int64_t(256), int64_t(7)}) {
      for (int64_t step_tokens : {int64_t(8192), int64_t(9)}) {  // 9: chunks cut to fit the step
        runtime::EngineOptions opt;
        opt.max_batch = max_batch;
        opt.prefill_chunk = chunk;
        opt.max_step_tokens = step_tokens;
        auto res = m.run(batch, opt);
        ASSERT_EQ(res.size(), batch.size());
        SCOPED_TRACE("max_batch " + std::to_string(max_batch) + " chunk " + std::to_string(chunk) +
                     " max_step_tokens " + std::to_string(step_tokens));
        EXPECT_EQ(res[6].tokens, alone[0].tokens);
        EXPECT_TRUE(bitwise_equal(res[6].prompt_logits, alone[0].prompt_logits));
        EXPECT_TRUE(bitwise_equal(res[6].decode_logits, alone[0].decode_logits));
      }
    }
  }
}

}  // namespace

TEST(BatchInvariance, TinyA) { check_invariance(std::string(GLM5_TEST_DATA) + "/tiny-a"); }
TEST(BatchInvariance, TinyV32) { check_invariance(std::string(GLM5_TEST_DATA) + "/tiny-v32"); }

// A step of more rows than the MLPs' block (2048: on a host backend the dense MLP and a one-rank
// stage's MoE take a long step's rows in blocks): 10 prompts of 300 tokens prefill in one
// 3000-row step, and the target keeps the bits it has alone. (The engine lays a step's rows out in
// request order, so the target's rows 1800..2099 straddle the first block boundary.)
TEST(BatchInvariance, StepsLongerThanTheMlpBlock) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a");
  const int V = int(m.cfg.vocab_size);
  const auto target = make_prompt(300, V, 5);
  auto alone = m.run({golden_request(target, 3)});
  std::vector<runtime::Request> batch;
  for (int i = 0; i < 10; ++i)
    batch.push_back(i == 6 ? golden_request(target, 3, i) : golden_request(make_prompt(300, V, 50 + i), 2, i));
  runtime::EngineOptions opt;
  opt.max_batch = 10;
  opt.prefill_chunk = 512;
  opt.max_step_tokens = 8192;
  auto res = m.run(batch, opt);
  ASSERT_EQ(res.size(), batch.size());
  EXPECT_GE(m.last_stats.max_step_rows, 3000);
  EXPECT_EQ(res[6].tokens, alone[0].tokens);
  EXPECT_TRUE(bitwise_equal(res[6].prompt_logits, alone[0].prompt_logits));
  EXPECT_TRUE(bitwise_equal(res[6].decode_logits, alone[0].decode_logits));
}

// Thread-count invariance: the same batch with 1 and with 2 OpenMP threads gives bitwise the same
// logits (the threaded GEMM, attention, indexer and top-k paths split rows or columns, never a
// reduction). Prompts long enough that every kernel takes its threaded path.
TEST(BatchInvariance, ThreadCountDoesNotChangeBits) {
  for (const char* model : {"tiny-a", "tiny-v32", "tiny-b"}) {
    SCOPED_TRACE(model);
    OneProcessModel m(std::string(GLM5_TEST_DATA) + "/" + model);
    const int V = int(m.cfg.vocab_size);
    std::vector<runtime::Request> batch;
    const int lens[] = {120, 3, 200, 64};
    for (int i = 0; i < 4; ++i) batch.push_back(golden_request(make_prompt(lens[i], V, 30 + i), 5, i));
    const int before = omp_get_max_threads();
    omp_set_num_threads(1);
    auto one = m.run(batch);
    omp_set_num_threads(2);
    auto two = m.run(batch);
    omp_set_num_threads(before);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(one[i].tokens, two[i].tokens) << i;
      EXPECT_TRUE(bitwise_equal(one[i].prompt_logits, two[i].prompt_logits)) << i;
      EXPECT_TRUE(bitwise_equal(one[i].decode_logits, two[i].decode_logits)) << i;
    }
  }
}
