// The engine's parts on their own: the messages' bytes (wire.h) and the column choice
// (distributor.h). The engine tests (test_engine.cpp) and the layout tests run them together.
#include <gtest/gtest.h>

#include <vector>

#include "runtime/engine/distributor.h"
#include "runtime/engine/wire.h"
#include "runtime/kv_cache.h"

namespace {

using glm5::runtime::Back;
using glm5::runtime::Distributor;
using glm5::runtime::Request;
using glm5::runtime::Result;
using glm5::runtime::Step;
namespace wire = glm5::runtime::wire;

Request request(int64_t index, int64_t prompt_len, int32_t max_tokens, int32_t first_token = 1) {
  Request r;
  r.index = index;
  for (int64_t i = 0; i < prompt_len; ++i) r.prompt.push_back(first_token + int32_t(i % 7));
  r.sampling.max_tokens = max_tokens;
  return r;
}

// Every field set, neighbours of the same type to different values, so that a swapped put / get
// pair shows.
Request full_request() {
  Request r = request(42, 5, 9);
  glm5::runtime::SamplingParams& s = r.sampling;
  s.temperature = 0.7f, s.top_p = 0.8f, s.top_k = 5, s.min_p = 0.05f;
  s.repetition_penalty = 1.1f, s.presence_penalty = 0.2f, s.frequency_penalty = 0.3f;
  s.seed = 1234567890123ull, s.logprobs = 2, s.ignore_eos = true, s.stop = {"\n\n", "END"};
  r.want_prompt_logits = true, r.want_logits = false, r.extra_final_step = true;
  r.prompt_logprobs = 3, r.error = "refused", r.stream = true, r.speculative = false;
  r.generated = {8, 9};
  return r;
}

void expect_same(const Request& a, const Request& b) {
  EXPECT_EQ(a.index, b.index);
  EXPECT_EQ(a.prompt, b.prompt);
  const glm5::runtime::SamplingParams &x = a.sampling, &y = b.sampling;
  EXPECT_EQ(std::vector<float>(
                {x.temperature, x.top_p, x.min_p, x.repetition_penalty, x.presence_penalty, x.frequency_penalty}),
            std::vector<float>(
                {y.temperature, y.top_p, y.min_p, y.repetition_penalty, y.presence_penalty, y.frequency_penalty}));
  EXPECT_EQ(std::vector<int64_t>({x.top_k, x.max_tokens, x.logprobs}),
            std::vector<int64_t>({y.top_k, y.max_tokens, y.logprobs}));
  EXPECT_EQ(x.seed, y.seed);
  EXPECT_EQ(x.ignore_eos, y.ignore_eos);
  EXPECT_EQ(x.stop, y.stop);
  EXPECT_EQ(std::vector<bool>({a.want_prompt_logits, a.want_logits, a.extra_final_step, a.stream, a.speculative}),
            std::vector<bool>({b.want_prompt_logits, b.want_logits, b.extra_final_step, b.stream, b.speculative}));
  EXPECT_EQ(a.prompt_logprobs, b.prompt_logprobs);
  EXPECT_EQ(a.error, b.error);
  EXPECT_EQ(a.generated, b.generated);
}

TEST(EngineWire, RequestStepAndBacksRoundTrip) {
  const Request r = full_request();
  Step s;
  s.stop = true;
  s.seqs.push_back({.req = 42, .start = 3, .n = 2, .new_blocks = 1, .sample = true, .drafts = 1});
  s.released = {7};
  s.added = {r};
  s.blocks = {5};
  Back b;
  b.req = 42;
  b.tokens = {{.token = 11, .logprob = -0.5f, .top = {{11, -0.5f}, {12, -1.5f}}}};
  b.drafts = {13, 14};
  b.logits = {0.25f, -0.75f};
  b.prompt_logprobs = {{.token = 15, .logprob = -2.5f, .top = {}}};
  b.error = "none";
  wire::Writer w;
  wire::put_step(w, s);
  wire::put_backs(w, {b});
  wire::put_request(w, r);
  wire::Reader rd(w.b);
  const Step s2 = wire::get_step(rd);
  const std::vector<Back> b2 = wire::get_backs(rd);
  expect_same(wire::get_request(rd), r);
  EXPECT_EQ(rd.left(), 0u) << "every byte read back";
  EXPECT_TRUE(s2.stop);
  ASSERT_EQ(s2.seqs.size(), 1u);
  EXPECT_EQ(s2.seqs[0].start, 3);
  EXPECT_EQ(s2.seqs[0].n, 2);
  EXPECT_EQ(s2.seqs[0].drafts, 1);
  EXPECT_TRUE(s2.seqs[0].sample);
  EXPECT_EQ(s2.released, s.released);
  EXPECT_EQ(s2.blocks, s.blocks);
  ASSERT_EQ(s2.added.size(), 1u);
  expect_same(s2.added[0], r);
  ASSERT_EQ(b2.size(), 1u);
  ASSERT_EQ(b2[0].tokens.size(), 1u);
  EXPECT_EQ(b2[0].tokens[0].token, 11);
  EXPECT_EQ(b2[0].tokens[0].logprob, -0.5f);
  EXPECT_EQ(b2[0].tokens[0].top, b.tokens[0].top);
  EXPECT_EQ(b2[0].drafts, b.drafts);
  EXPECT_EQ(b2[0].logits, b.logits);
  ASSERT_EQ(b2[0].prompt_logprobs.size(), 1u);
  EXPECT_EQ(b2[0].prompt_logprobs[0].token, 15);
  EXPECT_EQ(b2[0].error, "none");
}

TEST(EngineWire, CountPastTheMessageIsRefused) {
  wire::Writer w;
  w.put<int64_t>(int64_t(1) << 61);  // a vector's count far past the bytes that follow
  w.put<int32_t>(7);
  wire::Reader rd(w.b);
  EXPECT_THROW(rd.get_vec<int32_t>(), std::exception);
  wire::Writer neg;
  neg.put<int64_t>(-1);
  wire::Reader rn(neg.b);
  EXPECT_THROW(rn.get_vec<int32_t>(), std::exception);
}

TEST(EngineWire, TruncatedMessageIsRefusedNotRead) {
  Result res;
  res.index = 3;
  res.tokens = {1, 2, 3};
  res.finish_reason = "stop";
  wire::Writer w;
  wire::put_result(w, res);
  for (size_t cut : {size_t(0), size_t(4), w.b.size() / 2, w.b.size() - 1}) {
    const std::vector<char> part(w.b.begin(), w.b.begin() + std::ptrdiff_t(cut));
    wire::Reader rd(part);
    EXPECT_THROW(wire::get_result(rd), std::exception) << "cut at " << cut << " of " << w.b.size();
  }
  wire::Reader rd(w.b);
  EXPECT_EQ(wire::get_result(rd).tokens, res.tokens);
}

TEST(Distributor, LeastLoadedColumnWithRoomLowestOnTies) {
  Distributor d(3, false);
  std::vector<int64_t> load = {100, 40, 40}, free = {1, 1, 1};
  EXPECT_EQ(d.pick(request(0, 10, 10), load, free), 1);  // 40 + 20 < 100 + 20; column 1 before 2
  EXPECT_EQ(load, (std::vector<int64_t>{100, 60, 40}));
  EXPECT_EQ(free, (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(d.pick(request(1, 10, 10), load, free), 2);
  EXPECT_EQ(d.pick(request(2, 10, 10), load, free), 0);  // the only column with room left
  EXPECT_EQ(free, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_THROW(d.pick(request(3, 10, 10), load, free), std::exception);
}

TEST(Distributor, ColumnWithThePromptPrefixIsChargedOnlyForTheRest) {
  // 3 blocks of prompt: the first two are shareable (the last prompt token is always computed).
  const int64_t P = 3 * glm5::runtime::kBlockTokens, shareable = 2 * glm5::runtime::kBlockTokens;
  for (bool sharing : {true, false}) {
    Distributor d(2, sharing);
    std::vector<int64_t> load = {0, 0}, free = {4, 4};
    EXPECT_EQ(d.pick(request(0, P, 16, /*first_token=*/1), load, free), 0);  // a tie: the lowest column
    // Column 0 is busier by less than the shared part: with sharing it still costs less there.
    load = {shareable - 28, 0};
    EXPECT_EQ(d.pick(request(1, P, 16, 1), load, free), sharing ? 0 : 1) << "sharing " << sharing;
    EXPECT_EQ(load[0], sharing ? shareable - 28 + P + 16 - shareable : shareable - 28);
    // Another prompt (another first block) gets no discount anywhere.
    load = {shareable - 28, 0};
    EXPECT_EQ(d.pick(request(2, P, 16, /*first_token=*/50), load, free), 1) << "sharing " << sharing;
  }
}

}  // namespace
