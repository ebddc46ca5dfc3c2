// Scheduler rules on their own, without a model: admission (max_batch, even micro-batches, the KV
// budget), step building (decode rows first, prefill chunks, the step row budget), requests
// announced once and released once, completion (EOS, max_tokens, stop strings, errors), and the
// load / free-slot figures the request distributor balances columns by.
#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "runtime/config.h"
#include "runtime/scheduler.h"
#include "runtime/tokenizer/tokenizer.h"

using namespace glm5;
using namespace glm5::runtime;

namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 100;
  c.max_position_embeddings = 64;
  c.eos_token_id = {99};
  return c;
}

Request req(int64_t index, int prompt_len, int max_tokens) {
  Request r;
  r.index = index;
  r.prompt.assign(size_t(prompt_len), 7);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  return r;
}

// The last stage's answer to a step: token `tok` for every sampled sequence.
std::vector<Back> answer(const Step& s, int32_t tok) {
  std::vector<Back> out;
  for (auto& q : s.seqs) {
    if (!q.sample) continue;
    Back b;
    b.req = q.req;
    b.tokens.push_back({tok, 0.0f, {}});
    out.push_back(b);
  }
  return out;
}

// Runs one group to completion, answering every step with `tok`; returns the steps taken.
int drain(Scheduler& s, int32_t tok) {
  std::vector<int32_t> tokens;
  int steps = 0;
  for (; s.work() > int64_t(0) && steps < 1000; ++steps) {
    Step st = s.next_step(0, tokens);
    s.apply(answer(st, tok));
    s.take_finished();
  }
  return steps;
}

}  // namespace

TEST(Scheduler, RefusesWhatCanNeverRun) {
  SchedulerOptions o;
  o.kv_blocks = 1;  // 64 positions
  Scheduler s(small_config(), o, nullptr);
  EXPECT_EQ(s.refuse_reason(req(0, 4, 4)), "");
  EXPECT_EQ(s.refuse_reason(req(0, 0, 4)), "prompt is empty");
  EXPECT_NE(s.refuse_reason(req(0, 60, 8)).find("exceeds the context length 64"), std::string::npos);
  EXPECT_NE(s.refuse_reason(req(0, 50, 50 - 1)).find("exceeds"), std::string::npos);
  EXPECT_NE(s.refuse_reason(req(0, 61, 4)).find("exceeds"), std::string::npos);
  // 40 + 24 + 1 positions need 2 blocks
  EXPECT_NE(s.refuse_reason(req(0, 40, 24))
                .find("request needs 2 KV blocks of 64 tokens (prompt + max_tokens), "
                      "more than the 1 blocks"),
            std::string::npos);
  EXPECT_EQ(s.refuse_reason(req(0, 40, 23)), "");
  Request bad = req(0, 3, 3);
  bad.error = "line 4: bad";
  EXPECT_EQ(s.refuse_reason(bad), "line 4: bad");
}

TEST(Scheduler, StepsPutDecodeFirstAndCutPrefillToTheRowBudget) {
  SchedulerOptions o;
  o.max_batch = 4;
  o.prefill_chunk = 5;
  o.max_step_tokens = 8;
  Scheduler s(small_config(), o, nullptr);
  s.add(req(0, 12, 3));
  s.add(req(1, 3, 3));
  std::vector<int32_t> tokens;
  Step a = s.next_step(0, tokens);
  ASSERT_EQ(a.seqs.size(), 2u);
  EXPECT_EQ(a.seqs[0].n, 5);  // a full chunk
  EXPECT_EQ(a.seqs[1].n, 3);  // the rest of the row budget (8), all of request 1's prompt
  EXPECT_FALSE(a.seqs[0].sample);
  EXPECT_TRUE(a.seqs[1].sample);
  EXPECT_EQ(a.rows(), 8);
  EXPECT_EQ(tokens.size(), 8u);
  ASSERT_EQ(a.added.size(), 2u);  // both are new to the column
  s.apply(answer(a, 5));
  Step b = s.next_step(0, tokens);
  ASSERT_EQ(b.seqs.size(), 2u);
  EXPECT_TRUE(b.seqs[0].decode);  // request 1 decodes first
  EXPECT_EQ(b.seqs[0].req, 1);
  EXPECT_EQ(tokens[0], 5);  // feeding back the sampled token
  EXPECT_EQ(b.seqs[1].req, 0);
  EXPECT_EQ(b.seqs[1].start, 5);
  EXPECT_EQ(b.seqs[1].n, 5);
  EXPECT_TRUE(b.added.empty());  // announced once
  EXPECT_EQ(s.prompt_rows(), 13);
}

TEST(Scheduler, MaxBatchAndEvenGroups) {
  SchedulerOptions o;
  o.micro_batches = 2;
  o.max_batch = 4;
  Scheduler s(small_config(), o, nullptr);
  for (int i = 0; i < 10; ++i) s.add(req(i, 2, 2));
  EXPECT_EQ(s.free_slots(), 0);  // 10 waiting > 2 x max_batch
  std::vector<int32_t> tokens;
  Step g0 = s.next_step(0, tokens), g1 = s.next_step(1, tokens);
  EXPECT_EQ(g0.seqs.size(), 2u);  // each group takes its share of max_batch
  EXPECT_EQ(g1.seqs.size(), 2u);
  EXPECT_EQ(g0.seqs[0].req, 0);  // in arrival order
  EXPECT_EQ(g1.seqs[0].req, 2);
}

TEST(Scheduler, KvBudgetMakesTheQueueWaitAndReleasesOnFinish) {
  SchedulerOptions o;
  o.kv_blocks = 1;  // one request of 4 + 4 + 1 positions at a time
  Scheduler s(small_config(), o, nullptr);
  s.add(req(0, 4, 4));
  s.add(req(1, 4, 4));
  std::vector<int32_t> tokens;
  Step a = s.next_step(0, tokens);
  ASSERT_EQ(a.seqs.size(), 1u);
  EXPECT_EQ(a.seqs[0].req, 0);
  int64_t finished_first = -1;
  for (int i = 0; i < 10 && finished_first < 0; ++i) {
    s.apply(answer(a, 3));
    for (auto& r : s.take_finished()) finished_first = r.index;
    a = s.next_step(0, tokens);
  }
  EXPECT_EQ(finished_first, 0);
  ASSERT_EQ(a.released.size(), 1u);  // the next step tells the stages to free request 0
  EXPECT_EQ(a.released[0], 0);
  ASSERT_EQ(a.seqs.size(), 1u);
  EXPECT_EQ(a.seqs[0].req, 1);  // admitted once the budget was free
}

TEST(Scheduler, EndsOnEosOrMaxTokensAndLoadReturnsToZero) {
  Scheduler s(small_config(), SchedulerOptions{}, nullptr);
  s.add(req(0, 3, 5));
  Request no_eos = req(1, 3, 5);
  no_eos.sampling.ignore_eos = true;
  s.add(no_eos);
  EXPECT_EQ(s.load(), 2 * (3 + 5));
  std::vector<int32_t> tokens;
  s.apply(answer(s.next_step(0, tokens), 99));  // EOS
  std::vector<Result> done = s.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].index, 0);
  EXPECT_EQ(done[0].finish_reason, "stop");
  EXPECT_EQ(done[0].tokens, std::vector<int32_t>{99});
  drain(s, 99);
  EXPECT_EQ(s.load(), 0);
  EXPECT_EQ(s.work(), 0);
  EXPECT_EQ(s.tokens_generated(), 1 + 5);
}

TEST(Scheduler, AnErrorFromTheLastStageEndsOnlyThatRequest) {
  Scheduler s(small_config(), SchedulerOptions{}, nullptr);
  s.add(req(0, 3, 4));
  s.add(req(1, 3, 4));
  std::vector<int32_t> tokens;
  Step st = s.next_step(0, tokens);
  std::vector<Back> backs = answer(st, 4);
  backs[0].tokens.clear();
  backs[0].error = "non-finite logits (NaN or inf) at positions 0..2";
  s.apply(backs);
  std::vector<Result> done = s.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].index, 0);
  EXPECT_EQ(done[0].finish_reason, "error");
  EXPECT_EQ(done[0].error, backs[0].error);
  drain(s, 4);
  EXPECT_EQ(s.tokens_generated(), 4);
  EXPECT_EQ(s.load(), 0);
}

TEST(Scheduler, StopStringEndsAtTheTokenThatCompletesIt) {
  Tokenizer tok = Tokenizer::load(std::string(GLM5_TEST_DATA) + "/tiny-a");
  ModelConfig c = small_config();
  c.vocab_size = tok.vocab_size();
  c.eos_token_id = {};
  Scheduler s(c, SchedulerOptions{}, &tok);
  const std::vector<int32_t> text = tok.encode("one two three four five", false);
  ASSERT_GE(text.size(), 4u);
  Request r = req(0, 2, 32);
  r.sampling.stop = {"thr"};
  s.add(r);
  std::vector<int32_t> tokens;
  std::vector<Result> done;
  for (size_t i = 0; i < text.size() && done.empty(); ++i) {
    s.apply(answer(s.next_step(0, tokens), text[i]));
    done = s.take_finished();
  }
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].finish_reason, "stop");
  const std::string got = tok.decode(done[0].tokens, true);
  EXPECT_NE(got.find("thr"), std::string::npos) << got;  // the completing token is kept
  std::vector<int32_t> shorter(done[0].tokens.begin(), done[0].tokens.end() - 1);
  EXPECT_EQ(tok.decode(shorter, true).find("thr"), std::string::npos);  // and it is the first such
}

// A pool too small for both sequences at full length: the younger one is preempted when the older
// needs a block, goes back to the queue with its tokens, is re-announced with them and recomputed
// (prompt + generated but the last, no sampling at the end), then decodes on. Both finish.
TEST(Scheduler, PreemptsTheYoungestAndRecomputesIt) {
  ModelConfig c = small_config();
  c.max_position_embeddings = 512;
  SchedulerOptions o;
  o.kv_blocks = 3;
  o.prefill_chunk = 64;
  o.max_step_tokens = 256;
  Scheduler s(c, o, nullptr);
  Request a = req(0, 60, 20), b = req(1, 60, 20);
  a.sampling.ignore_eos = b.sampling.ignore_eos = true;
  s.add(a);
  s.add(b);
  std::vector<int32_t> tokens;
  std::map<int64_t, Result> done;
  bool saw_recompute = false;
  int32_t next = 10;
  for (int i = 0; i < 200 && done.size() < 2; ++i) {
    Step st = s.next_step(0, tokens);
    for (const Request& r : st.added)
      if (!r.generated.empty()) {
        saw_recompute = true;
        EXPECT_EQ(r.index, 1);  // the younger one
        ASSERT_FALSE(st.seqs.empty());
      }
    for (const StepSeq& q : st.seqs) {
      if (q.req == 1 && !q.decode && q.start + q.n > 60) {
        EXPECT_FALSE(q.sample) << "a recompute chunk sampled";
      }
    }
    s.apply(answer(st, next++));
    for (auto& r : s.take_finished()) done[r.index] = r;
  }
  ASSERT_EQ(done.size(), 2u);
  EXPECT_GE(s.preemptions(), 1);
  EXPECT_TRUE(saw_recompute);
  EXPECT_EQ(done[0].tokens.size(), 20u);
  EXPECT_EQ(done[1].tokens.size(), 20u);
  EXPECT_LE(s.blocks_peak(), 3);
  EXPECT_EQ(s.blocks_in_use(), 0);
  EXPECT_EQ(s.load(), 0);
}

// Two micro-batch groups sharing a pool that holds one of their sequences at full length: the
// older one waits (keeping its blocks) while the younger, in the other group, preempts itself;
// both finish instead of preempting each other forever.
TEST(Scheduler, TwoGroupsUnderATightPoolBothFinish) {
  for (bool sharing : {false, true}) {
    ModelConfig c = small_config();
    c.max_position_embeddings = 512;
    SchedulerOptions o;
    o.micro_batches = 2;
    o.max_batch = 2;
    o.kv_blocks = 5;
    o.prefill_chunk = 7;
    o.prefix_sharing = sharing;
    Scheduler s(c, o, nullptr);
    const int64_t P[2] = {228, 186}, M[2] = {31, 4};
    for (int i = 0; i < 2; ++i) {
      Request r = req(i, 0, int(M[i]));
      for (int t = 0; t < P[i]; ++t) r.prompt.push_back(5 + (t * 7 + i) % 90);
      r.sampling.ignore_eos = true;
      ASSERT_EQ(s.refuse_reason(r), "");
      s.add(r);
    }
    // As in the pipeline: a group's results come back when its turn comes again.
    std::vector<Back> in_flight[2];
    std::vector<int32_t> tokens;
    size_t done = 0;
    for (int tick = 0; tick < 20000 && done < 2; ++tick) {
      const int g = tick % 2;
      s.apply(in_flight[g]);
      done += s.take_finished().size();
      in_flight[g] = answer(s.next_step(g, tokens), 7);
    }
    EXPECT_EQ(done, 2u) << "sharing " << sharing << ": " << s.preemptions() << " preemptions";
    EXPECT_EQ(s.blocks_in_use(), 0);
  }
}

// Speculative decoding's bookkeeping, with hand-made answers from the last stage: a decode step
// feeds the last token and the drafts; the accepted ones and the target's own token come back,
// the rejected rows' positions are free again (the next step starts right after the accepted
// ones), a request that ends inside a verify step (max_tokens, EOS) keeps only its tokens, and the
// counters add up.
TEST(Scheduler, SpeculativeStepsRollBackRejectedDrafts) {
  SchedulerOptions o;
  o.speculative_tokens = 3;
  Scheduler s(small_config(), o, nullptr);
  s.add(req(0, 5, 20));
  std::vector<int32_t> tokens;
  Step st = s.next_step(0, tokens);  // the prompt: samples token 10 and drafts 11, 12, 13
  ASSERT_EQ(st.seqs.size(), 1u);
  EXPECT_TRUE(st.seqs[0].mtp && st.seqs[0].draft);
  Back b;
  b.req = 0;
  b.tokens = {{10, 0.0f, {}}};
  b.drafts = {11, 12, 13};
  s.apply({b});
  st = s.next_step(0, tokens);  // feeds 10 at position 5, then the three drafts
  ASSERT_EQ(st.seqs.size(), 1u);
  EXPECT_EQ(st.seqs[0].start, 5);
  EXPECT_EQ(st.seqs[0].n, 4);
  EXPECT_EQ(st.seqs[0].drafts, 3);
  EXPECT_EQ(tokens, (std::vector<int32_t>{10, 11, 12, 13}));
  b.tokens = {{11, 0.0f, {}}, {12, 0.0f, {}}, {40, 0.0f, {}}};  // 11 and 12 accepted, 13 rejected: 40
  b.drafts = {41};
  s.apply({b});
  st = s.next_step(0, tokens);  // 10, 11, 12 are cached at 5..7; 40 goes to position 8
  EXPECT_EQ(st.seqs[0].start, 8);
  EXPECT_EQ(tokens, (std::vector<int32_t>{40, 41}));
  b.tokens = {{42, 0.0f, {}}};  // draft 41 rejected
  b.drafts = {};                // (a step that did not draft: the next one is plain)
  s.apply({b});
  st = s.next_step(0, tokens);
  EXPECT_EQ(st.seqs[0].start, 9);
  EXPECT_EQ(st.seqs[0].drafts, 0);
  EXPECT_EQ(tokens, (std::vector<int32_t>{42}));
  b.tokens = {{43, 0.0f, {}}};
  b.drafts = {44, 99, 45};  // an EOS among the drafts
  s.apply({b});
  st = s.next_step(0, tokens);
  EXPECT_EQ(st.seqs[0].drafts, 3);
  b.tokens = {{44, 0.0f, {}}, {99, 0.0f, {}}, {45, 0.0f, {}}};
  s.apply({b});
  std::vector<Result> done = s.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].tokens, (std::vector<int32_t>{10, 11, 12, 40, 42, 43, 44, 99}));  // ends at the EOS
  EXPECT_EQ(done[0].finish_reason, "stop");
  EXPECT_EQ(s.tokens_generated(), 8);
  EXPECT_EQ(s.spec_stats().steps, 3);
  EXPECT_EQ(s.spec_stats().drafted, 3 + 1 + 3);
  EXPECT_EQ(s.spec_stats().accepted, 2 + 0 + 2);
  EXPECT_EQ(s.spec_stats().accepted_at, (std::vector<int64_t>{2, 2, 0}));
  EXPECT_EQ(s.blocks_in_use(), 0);
  EXPECT_EQ(s.load(), 0);
}

// Drafts never take a request past max_tokens, and a step with more decoding sequences than
// speculative_max_batch decodes plainly (no drafts, no MTP rows).
TEST(Scheduler, SpeculationStopsAtMaxTokensAndAtTheBatchLimit) {
  SchedulerOptions o;
  o.speculative_tokens = 4;
  o.speculative_max_batch = 1;
  Scheduler s(small_config(), o, nullptr);
  s.add(req(0, 3, 3));
  std::vector<int32_t> tokens;
  Step st = s.next_step(0, tokens);
  Back b;
  b.req = 0;
  b.tokens = {{10, 0.0f, {}}};
  b.drafts = {11, 12, 13, 14};
  s.apply({b});
  st = s.next_step(0, tokens);
  EXPECT_EQ(st.seqs[0].drafts, 1);  // 2 tokens left: one draft and the target's token
  EXPECT_FALSE(st.seqs[0].draft);   // nothing left to draft for after it
  s.add(req(1, 3, 8));
  s.add(req(2, 3, 8));
  b.tokens = {{11, 0.0f, {}}, {20, 0.0f, {}}};
  s.apply({b});
  EXPECT_EQ(s.take_finished().size(), 1u);
  st = s.next_step(0, tokens);  // two prompts
  std::vector<Back> backs;
  for (const StepSeq& q : st.seqs) {
    Back x;
    x.req = q.req;
    x.tokens = {{10, 0.0f, {}}};
    x.drafts = {11, 12};
    backs.push_back(x);
  }
  s.apply(backs);
  st = s.next_step(0, tokens);  // two decoding sequences > speculative_max_batch 1: plain
  ASSERT_EQ(st.seqs.size(), 2u);
  for (const StepSeq& q : st.seqs) EXPECT_TRUE(q.drafts == 0 && !q.mtp && !q.draft && q.n == 1);
}
