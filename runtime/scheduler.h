// The scheduler of one pipeline column (it runs on the column's stage-0 rank): which requests run,
// when they are admitted, and what each micro-batch step contains. It never touches tensors or
// communicators; the engine (engine.cpp) executes the steps it builds and feeds back what the
// last stage returned.
//
//   add(request)            queue a request (checked with refuse_reason first)
//   next_step(g, tokens)    admit waiting requests into micro-batch group g (continuous batching,
//                           FCFS, while KV blocks are free), then build g's step: decode rows
//                           first, then prefill chunks of prefill_chunk tokens while the step
//                           has room, handing out KV blocks as the sequences grow
//   apply(g, backs)         take the sampled tokens (or errors) of g's step; requests that end
//                           (EOS, stop string, max_tokens, error) become results
//   take_finished()         the results to deliver
//   cancel(index)           end a request early (a waiting one now, a running one at its group's
//                           next step, when no step of it is in flight); result "cancelled"
//   take_partial()          the tokens `stream` requests sampled since the last call
//   load(), free_slots()    what the engine's request distributor balances columns by
//
// KV memory is a pool of fixed-size blocks (kv_cache.h). A waiting request is admitted when the
// blocks for its first chunk are free with one block to spare per running sequence. When a
// running sequence needs a block and none is free, the youngest sequence of the group is
// preempted: its blocks are freed and it goes back to the head of the queue with the tokens it
// has generated, to be recomputed (prompt + generated) when blocks free up; its output is the
// same bits as without preemption. A request that could never fit the pool is refused.
//
// Prefix sharing (as vLLM's automatic prefix caching): a full block of prompt positions is
// identified by a hash chain over its tokens and every token before it. Once a sequence's step
// fills such a block, later sequences whose prompt starts with the same tokens take the block
// (a reference) instead of computing it, and skip those positions of their prefill; while a
// running sequence is still computing a block that another needs, the other waits for it. The
// last prompt position is never shared (its logits are sampled). KV rows depend only on the
// tokens before them, so results are bitwise those of unshared runs.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/batch_limits.h"
#include "runtime/config.h"
#include "runtime/kv_cache.h"
#include "runtime/request.h"

namespace glm5::runtime {

class Tokenizer;

// micro_batches: the groups that take turns (1 on a one-stage pipeline).
struct SchedulerOptions : SchedulingPolicy {
  int64_t kv_blocks = 1 << 20;  // blocks in the column's KV pools
};

// One sequence's entry in a step: rows [start, start + n) of request `req`.
struct StepSeq {
  int64_t req = 0, start = 0, n = 0;
  int64_t new_blocks = 0;       // KV blocks appended to its table for this step (Step::blocks)
  bool decode = false;          // one generated token (else a prompt chunk)
  bool sample = false;          // the last row is sampled
  bool logits_all = false;      // every row's logits (prompt-logit dumps) or logprobs (echo)
  bool logits_sampled = false;  // return the sampled row's logits (decode-logit dumps)
  int32_t drafts = 0;           // decode: rows 1..drafts are draft tokens this step verifies
  bool mtp = false;             // the last stage runs the MTP layer over its rows (speculation)
  bool draft = false;           // ... and drafts after its sampled row
};

// One micro-batch step, as it travels down the column.
struct Step {
  bool stop = false;              // no more steps: the stages end
  std::vector<StepSeq> seqs;      // decode rows first, then prefill chunks
  std::vector<int64_t> released;  // requests finished before this step: free their state
  std::vector<Request> added;     // requests that appear in this step for the first time
  std::vector<int32_t> blocks;    // the new blocks of every seq, in seqs order
  int64_t rows() const;
};

// What the last stage returns for one sequence of a step.
struct Back {
  int64_t req = 0;
  // The tokens sampled: one, or on a verify step one per row up to and including the first row
  // whose sample differs from the next draft (the accepted drafts, then the target's own token).
  std::vector<Sampled> tokens;
  std::vector<int32_t> drafts;           // the MTP layer's drafts for the next step (speculating requests)
  std::vector<float> logits;             // rows x vocab, when the step asked for them
  std::vector<Sampled> prompt_logprobs;  // a logits_all chunk of a prompt_logprobs request: one per
                                         // row with a prompt token after it
  std::string error;                     // non-empty: the request failed at this step (e.g. NaN logits)
};

class Scheduler {
 public:
  // tok: for stop strings (may be null when no request has any).
  Scheduler(const ModelConfig& cfg, const SchedulerOptions& opt, const Tokenizer* tok);
  ~Scheduler();

  // Why `r` can never run ("" when it can): its own error, an empty prompt, the context length,
  // a KV need larger than the whole budget.
  std::string refuse_reason(const Request& r) const;
  void add(Request r);

  Step next_step(int group, std::vector<int32_t>& tokens);
  void apply(const std::vector<Back>& backs);
  std::vector<Result> take_finished();
  // Ends request `index` if this column holds it (else nothing): see the header comment.
  void cancel(int64_t index);
  // Per `stream` request with new tokens, those tokens, in request order.
  std::vector<std::pair<int64_t, std::vector<int32_t>>> take_partial();

  // Tokens still to process over running and waiting requests (prompt rows not yet prefilled +
  // tokens not yet generated): the distributor sends new requests to the least-loaded column.
  int64_t load() const { return load_; }
  // Requests this column takes now: running + waiting up to twice max_batch.
  int64_t free_slots() const;
  // Running + waiting requests + results not yet taken.
  int64_t work() const { return int64_t(live_.size() + waiting_.size() + finished_.size()); }
  int64_t tokens_generated() const { return tokens_generated_; }
  int64_t prompt_rows() const { return prompt_rows_; }
  int64_t preemptions() const { return preemptions_; }
  int64_t blocks_in_use() const { return blocks_.num_blocks() - blocks_.free_blocks(); }
  int64_t blocks_peak() const { return blocks_peak_; }
  int64_t prefix_hit_tokens() const { return prefix_hits_; }
  // Speculative decoding: verify steps, draft tokens fed and accepted, and acceptances per draft
  // position (accepted_at[j]: steps whose draft j + 1 was accepted).
  struct SpecStats {
    int64_t steps = 0, drafted = 0, accepted = 0;
    std::vector<int64_t> accepted_at;
  };
  const SpecStats& spec_stats() const { return spec_; }

 private:
  struct Live;
  void admit(int group);
  bool grow(Live& L, int64_t tokens, int group, const Step& step);
  bool share_prefix(Live& L);
  void publish_blocks(Live& L);
  void drop_pending(Live& L);
  void release_blocks(Live& L);
  void evict(int32_t block);
  void preempt(Live& L);
  void finish(Live& L);
  bool take_token(Live& L, const Sampled& t);
  void end_cancelled(int group);
  static int64_t cost(const Request& r);

  ModelConfig cfg_;
  SchedulerOptions opt_;
  const Tokenizer* tok_;
  std::deque<std::unique_ptr<Live>> waiting_;      // new requests, preempted ones at the front
  std::map<int64_t, std::unique_ptr<Live>> live_;  // by request index
  std::vector<int> group_size_;
  std::vector<int64_t> released_;
  std::vector<Result> finished_;
  std::set<int64_t> cancel_;                         // running requests to end at their next step
  std::map<int64_t, std::vector<int32_t>> partial_;  // stream requests' tokens not yet taken
  BlockManager blocks_;
  // Prefix cache: block hash -> the block holding it (ready) or the request computing it.
  struct Prefix {
    int32_t block = -1;           // >= 0: ready
    int64_t owner = -1;           // request filling it while not ready
    int32_t parent = -1;          // the block before it in the chain (-1: the first)
    std::vector<int32_t> tokens;  // its tokens (ready blocks), to check a match exactly
  };
  std::unordered_map<uint64_t, Prefix> prefix_;
  std::unordered_map<int32_t, uint64_t> block_hash_;  // ready blocks -> their hash
  int64_t prefix_hits_ = 0;
  int64_t admissions_ = 0;  // admission counter: the youngest running sequence is preempted first
  SpecStats spec_;
  int64_t load_ = 0, tokens_generated_ = 0, prompt_rows_ = 0, preemptions_ = 0, blocks_peak_ = 0;
};

}  // namespace glm5::runtime
