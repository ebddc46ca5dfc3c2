// Scheduler: admission, KV blocks, preemption, step building and request completion for one column.
#include "runtime/scheduler.h"

#include <algorithm>

#include "kernels/core/check.h"
#include "runtime/detokenizer.h"

namespace glm5::runtime {

int64_t Step::rows() const {
  int64_t m = 0;
  for (auto& s : seqs) m += s.n;
  return m;
}

// A request of this column, waiting or running.
struct Scheduler::Live {
  Request req;
  int group = 0;
  int64_t pos = 0;         // positions already in the cache
  int64_t admitted = 0;    // admission order (the youngest is preempted first)
  bool announced = false;  // sent down the column in a step's `added` since its admission
  bool finishing = false;  // the extra final step (logit dumps) is pending
  bool waiting = true;     // in waiting_ (not running)
  std::vector<int32_t> blocks;
  size_t sent = 0;               // of those, the ones the stages know (sent in a step)
  std::vector<uint64_t> hashes;  // prefix hashes of its full prompt blocks (shareable ones)
  size_t published = 0;          // of those, the blocks it filled and made shareable
  Result result;
  std::unique_ptr<Detokenizer> stop;  // its text, when it has stop strings
  std::vector<int32_t> drafts;        // the MTP layer's drafts for its next decode step
  int64_t verifying = 0;              // drafts fed by its step in flight (decode)

  int64_t prompt_len() const { return int64_t(req.prompt.size()); }
  // Positions to fill before the next token is fed: the prompt and, after a preemption, every
  // generated token but the last (which the next decode step feeds).
  int64_t target() const { return prompt_len() + std::max<int64_t>(0, int64_t(result.tokens.size()) - 1); }
  bool decoding() const { return pos >= target() && !result.tokens.empty(); }
  int32_t token_at(int64_t p) const {
    return p < prompt_len() ? req.prompt[size_t(p)] : result.tokens[size_t(p - prompt_len())];
  }
};

Scheduler::Scheduler(const ModelConfig& cfg, const SchedulerOptions& opt, const Tokenizer* tok)
    : cfg_(cfg), opt_(opt), tok_(tok), group_size_(size_t(std::max(1, opt.micro_batches)), 0), blocks_(opt.kv_blocks) {
  // micro_batches, max_batch, prefill_chunk and max_step_tokens are checked where they are read
  // (the cluster config's reader, the Engine).
  CHECK(opt_.kv_blocks >= 1, "the KV cache has no block (kv_budget_gb too small for one block of ", kBlockTokens,
        " tokens)");
}

Scheduler::~Scheduler() = default;

int64_t Scheduler::cost(const Request& r) { return int64_t(r.prompt.size()) + r.sampling.max_tokens; }

std::string Scheduler::refuse_reason(const Request& r) const {
  if (!r.error.empty()) return r.error;
  if (r.prompt.empty()) return "prompt is empty";
  if (int64_t(r.prompt.size()) + r.sampling.max_tokens > cfg_.max_position_embeddings)
    return "prompt of " + std::to_string(r.prompt.size()) + " tokens + max_tokens " +
           std::to_string(r.sampling.max_tokens) + " exceeds the context length " +
           std::to_string(cfg_.max_position_embeddings) + " (max_position_embeddings)";
  // prompt + max_tokens + 1: the extra final step of a logit dump
  const int64_t need = blocks_for(int64_t(r.prompt.size()) + r.sampling.max_tokens + 1);
  if (need > opt_.kv_blocks)
    return "request needs " + std::to_string(need) + " KV blocks of " + std::to_string(kBlockTokens) +
           " tokens (prompt + max_tokens), more than the " + std::to_string(opt_.kv_blocks) +
           " blocks of the KV cache per rank (kv_budget_gb)";
  return "";
}

void Scheduler::add(Request r) {
  load_ += cost(r);
  // Logit dumps and their extra final step decode one row per step.
  r.speculative =
      r.speculative && opt_.speculative_tokens > 0 && !r.want_logits && !r.want_prompt_logits && !r.extra_final_step;
  auto L = std::make_unique<Live>();
  L->result.index = r.index;
  if (!r.sampling.stop.empty()) L->stop = std::make_unique<Detokenizer>(tok_, r.sampling.stop);
  L->req = std::move(r);
  waiting_.push_back(std::move(L));
}

int64_t Scheduler::free_slots() const {
  return std::max<int64_t>(0, 2 * int64_t(opt_.max_batch) - int64_t(live_.size() + waiting_.size()));
}

// Admits waiting requests into `group` in queue order, keeping the micro-batches even: a group
// takes at most its share of max_batch and of the work there is. The head waits unless the
// blocks of its first chunk are free with one to spare for every running sequence.
void Scheduler::admit(int group) {
  const size_t G = group_size_.size();
  const size_t work_now = live_.size() + waiting_.size();
  const int cap = int(std::min<size_t>((size_t(opt_.max_batch) + G - 1) / G, (work_now + G - 1) / G));
  while (!waiting_.empty() && int(live_.size()) < opt_.max_batch && group_size_[size_t(group)] < cap) {
    Live& W = *waiting_.front();
    // A new request needs its first chunk's blocks; a preempted one all of its recompute (else it
    // would only be preempted again).
    const int64_t first = W.result.tokens.empty()
                              ? blocks_for(std::min(opt_.prefill_chunk, std::max<int64_t>(1, W.target())))
                              : blocks_for(W.target() + 1);
    if (blocks_.free_blocks() < first + int64_t(live_.size())) break;
    std::unique_ptr<Live> L = std::move(waiting_.front());
    waiting_.pop_front();
    L->group = group;
    if (L->admitted == 0) L->admitted = ++admissions_;  // a preempted request keeps its age
    L->waiting = false;
    // Its prompt blocks nobody holds or computes yet are its to fill.
    if (opt_.prefix_sharing) L->hashes = prefix_hashes(L->req.prompt);
    L->published = 0;
    for (uint64_t h : L->hashes) prefix_.try_emplace(h, Prefix{-1, L->req.index, -1, {}});
    ++group_size_[size_t(group)];
    const int64_t id = L->req.index;
    CHECK(live_.emplace(id, std::move(L)).second, "internal: request index ", id, " is running twice");
  }
}

// Frees a running sequence's blocks and puts it back at the head of the queue; it is recomputed
// (prompt + generated tokens) when admitted again. Its partial result is kept.
void Scheduler::preempt(Live& L) {
  release_blocks(L);
  L.drafts.clear();
  drop_pending(L);
  load_ += L.pos;                 // to be recomputed
  if (L.result.tokens.empty()) {  // recomputed identically
    L.result.prompt_logits.clear();
    L.result.prompt_logprobs.clear();
  }
  L.pos = 0;
  L.announced = false;
  L.waiting = true;
  --group_size_[size_t(L.group)];
  released_.push_back(L.req.index);
  ++preemptions_;
  auto it = live_.find(L.req.index);
  waiting_.push_front(std::move(it->second));
  live_.erase(it);
}

// Drops L's references. A block nobody references is free again, or stays cached while it
// holds a shareable prefix (until the pool needs it: see evict).
void Scheduler::release_blocks(Live& L) {
  for (int32_t b : L.blocks) blocks_.release(b, block_hash_.count(b) > 0);
  L.blocks.clear();
  L.sent = 0;
}

// A cached block was reused: its prefix leaves the prefix cache.
void Scheduler::evict(int32_t b) {
  auto it = block_hash_.find(b);
  if (it == block_hash_.end()) return;
  auto e = prefix_.find(it->second);
  if (e != prefix_.end() && e->second.block == b) prefix_.erase(e);
  block_hash_.erase(it);
}

// Forgets the prompt blocks L was to fill but has not (another sequence computes them now).
void Scheduler::drop_pending(Live& L) {
  for (uint64_t h : L.hashes) {
    auto e = prefix_.find(h);
    if (e != prefix_.end() && e->second.block < 0 && e->second.owner == L.req.index) prefix_.erase(e);
  }
  L.hashes.clear();
  L.published = 0;
}

// At a block boundary of its prompt, L takes the blocks other sequences have filled with the
// same tokens (checked: same parent block and same tokens, so a hash collision cannot share a
// wrong block) and skips those positions. False: the next block is being filled by another
// running sequence, so L waits a step rather than compute it twice.
bool Scheduler::share_prefix(Live& L) {
  // Prompt logits and prompt logprobs need every prompt row computed.
  if (!opt_.prefix_sharing || L.req.want_prompt_logits || L.req.prompt_logprobs >= 0) return true;
  while (L.pos % kBlockTokens == 0 && size_t(L.pos / kBlockTokens) < L.hashes.size() &&
         int64_t(L.blocks.size()) == L.pos / kBlockTokens) {
    const size_t j = size_t(L.pos / kBlockTokens);
    auto it = prefix_.find(L.hashes[j]);
    if (it == prefix_.end()) {  // nobody has it: L fills it
      prefix_.emplace(L.hashes[j], Prefix{-1, L.req.index, -1, {}});
      return true;
    }
    const Prefix& e = it->second;
    if (e.block < 0) return e.owner == L.req.index;  // L's own, or wait for the owner
    const int32_t parent = j ? L.blocks[j - 1] : -1;
    if (e.parent != parent ||
        !std::equal(e.tokens.begin(), e.tokens.end(), L.req.prompt.begin() + int64_t(j) * kBlockTokens))
      return true;  // a collision: compute it
    blocks_.retain(e.block);
    L.blocks.push_back(e.block);
    L.pos += kBlockTokens;
    L.published = j + 1;
    load_ -= kBlockTokens;
    prefix_hits_ += kBlockTokens;
  }
  return true;
}

// Makes the prompt blocks L has filled (its step covers their last position) shareable.
void Scheduler::publish_blocks(Live& L) {
  while (L.published < L.hashes.size() && int64_t(L.published + 1) * kBlockTokens <= L.pos) {
    const size_t j = L.published++;
    auto it = prefix_.find(L.hashes[j]);
    if (it == prefix_.end() || it->second.block >= 0 || it->second.owner != L.req.index) continue;
    Prefix& e = it->second;
    e.block = L.blocks[j];
    e.parent = j ? L.blocks[j - 1] : -1;
    e.tokens.assign(L.req.prompt.begin() + int64_t(j) * kBlockTokens,
                    L.req.prompt.begin() + int64_t(j + 1) * kBlockTokens);
    block_hash_[e.block] = L.hashes[j];
  }
}

// Gives L the blocks for positions [0, tokens). When the pool is dry, preempts the youngest
// sequence of `group` that is not in `step` yet, or L itself when it is the youngest holder of
// blocks (false), or lets L wait a step when a younger holder runs in another group (false).
bool Scheduler::grow(Live& L, int64_t tokens, int group, const Step& step) {
  auto in_step = [&](int64_t id) {
    return std::any_of(step.seqs.begin(), step.seqs.end(), [&](const StepSeq& s) { return s.req == id; });
  };
  while (int64_t(L.blocks.size()) < blocks_for(tokens)) {
    int32_t evicted = -1;
    const int32_t b = blocks_.allocate(&evicted);
    if (evicted >= 0) evict(evicted);
    if (b >= 0) {
      L.blocks.push_back(b);
      continue;
    }
    // The youngest other sequence of the group that holds blocks (one without frees nothing), else L.
    Live* victim = nullptr;
    for (auto& [id, V] : live_)
      if (V.get() != &L && V->group == group && !V->blocks.empty() && !in_step(id) &&
          (!victim || V->admitted > victim->admitted))
        victim = V.get();
    if (!victim || victim->admitted < L.admitted) victim = &L;
    if (victim == &L) {
      // Sequences of other groups may have steps in flight and cannot be preempted now. If one of
      // them that holds blocks is younger than L, L waits (keeping its blocks) for it to finish or
      // to preempt itself, so the oldest sequence always gets through; L also stops filling prefix
      // blocks others may wait for, so that nobody waits on it.
      const bool younger_elsewhere = std::any_of(live_.begin(), live_.end(), [&](const auto& kv) {
        return kv.second->group != group && !kv.second->blocks.empty() && kv.second->admitted > L.admitted;
      });
      if (younger_elsewhere) {
        drop_pending(L);
        return false;
      }
    }
    const bool self = victim == &L;
    preempt(*victim);
    if (self) return false;
  }
  blocks_peak_ = std::max(blocks_peak_, blocks_in_use());
  return true;
}

// Decode rows first (see Model::forward), then prefill chunks while the step has room (the last
// one cut to fit; results do not depend on the chunking). A speculating sequence's decode row
// brings its drafts (as many as the step has room for) while the step has at most
// speculative_max_batch decoding sequences (beyond, verifying costs more than it saves: the step
// decodes plainly and the MTP layer skips its decode rows), and its sampled steps get KV blocks
// for the positions the MTP layer drafts at beyond them.
Step Scheduler::next_step(int group, std::vector<int32_t>& tokens) {
  end_cancelled(group);
  admit(group);
  Step step;
  tokens.clear();
  int64_t room = opt_.max_step_tokens;
  const int64_t lookahead = opt_.speculative_tokens;
  int64_t decoding = 0;
  for (auto& [id, Lp] : live_) decoding += Lp->group == group && Lp->decoding();
  const bool speculate = opt_.speculative_tokens > 0 && decoding <= opt_.speculative_max_batch;
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<Live*> members;  // a snapshot: grow() may preempt members
    for (auto& [id, Lp] : live_)
      if (Lp->group == group && Lp->decoding() == (pass == 0)) members.push_back(Lp.get());
    // Draft rows the decode rows may add: the budget beyond one row per member.
    int64_t spare = speculate && pass == 0 ? room - int64_t(members.size()) : 0;
    for (Live* Lp : members) {
      Live& L = *Lp;
      if (L.waiting) continue;  // preempted for an earlier member
      const Request& r = L.req;
      StepSeq s;
      s.req = r.index;
      s.start = L.pos;
      // Every prompt row gets its MTP row (shared prompt blocks hold them); decode rows while
      // speculating. Drafts follow a sampled row while the group speculates.
      s.mtp = pass == 0 ? r.speculative && speculate : opt_.speculative_tokens > 0;
      if (pass == 0) {
        const int64_t left = r.sampling.max_tokens - int64_t(L.result.tokens.size()) - 1;
        s.drafts = int32_t(
            std::clamp<int64_t>(std::min<int64_t>(int64_t(L.drafts.size()), left), 0, std::max<int64_t>(spare, 0)));
        spare -= s.drafts;
        s.n = 1 + s.drafts;
        s.decode = s.sample = true;
        s.logits_sampled = r.want_logits;
      }
      if (pass == 1) {
        if (room <= 0 || !share_prefix(L)) continue;  // no room, or a prefix block is on its way
        s.start = L.pos;
        s.n = std::min({opt_.prefill_chunk, L.target() - L.pos, room});
        s.sample = L.pos + s.n == L.target() && L.result.tokens.empty();
        s.logits_all = (r.want_prompt_logits || r.prompt_logprobs >= 0) && L.result.tokens.empty();
      }
      // Drafting pays only if a token is left after the ones this step can give.
      s.draft = r.speculative && speculate && s.sample &&
                r.sampling.max_tokens - int64_t(L.result.tokens.size()) - 1 - s.drafts >= 1;
      if (!grow(L, L.pos + s.n, group, step)) continue;
      // The MTP chain drafts at up to k - 1 positions past the step's rows: blocks for them only if
      // free ones are left (never by preempting or evicting; the chain stops at the last block).
      while (s.draft && int64_t(L.blocks.size()) < blocks_for(L.pos + s.n + lookahead - 1) &&
             blocks_.unused_blocks() > int64_t(live_.size())) {
        int32_t evicted = -1;
        L.blocks.push_back(blocks_.allocate(&evicted));
      }
      // Blocks the stages do not know yet: grown now, or shared now or while it waited.
      s.new_blocks = int64_t(L.blocks.size() - L.sent);
      step.blocks.insert(step.blocks.end(), L.blocks.begin() + int64_t(L.sent), L.blocks.end());
      L.sent = L.blocks.size();
      if (pass == 0) {
        tokens.push_back(L.result.tokens.back());
        tokens.insert(tokens.end(), L.drafts.begin(), L.drafts.begin() + s.drafts);
        L.verifying = s.drafts;
      } else {
        for (int64_t p = L.pos; p < L.pos + s.n; ++p) tokens.push_back(L.token_at(p));
        prompt_rows_ += s.n;
        load_ -= s.n;
      }
      if (!L.announced) {
        step.added.push_back(r);
        step.added.back().generated = L.result.tokens;
        L.announced = true;
      }
      L.pos += s.n;
      room -= s.n;
      step.seqs.push_back(s);
      publish_blocks(L);
    }
  }
  step.released.swap(released_);  // finished before this step, or preempted while building it
  return step;
}

void Scheduler::finish(Live& L) {
  const int64_t id = L.req.index;
  cancel_.erase(id);
  // What was never generated no longer counts as load.
  if (L.pos < L.target()) load_ -= L.target() - L.pos;
  load_ -= L.req.sampling.max_tokens - int64_t(L.result.tokens.size());
  release_blocks(L);
  drop_pending(L);
  --group_size_[size_t(L.group)];
  released_.push_back(id);
  finished_.push_back(std::move(L.result));
  live_.erase(id);
}

void Scheduler::apply(const std::vector<Back>& backs) {
  for (const Back& b : backs) {
    auto it = live_.find(b.req);
    CHECK(it != live_.end(), "internal: a result came back for request ", b.req, ", which is not running");
    Live& L = *it->second;
    const Request& r = L.req;
    if (!b.error.empty()) {
      L.result.finish_reason = "error";
      L.result.error = b.error;
      finish(L);
      continue;
    }
    const bool decode_step = L.pos > L.prompt_len();
    if (!b.logits.empty()) {
      auto& dst = decode_step ? L.result.decode_logits : L.result.prompt_logits;
      if (decode_step ? r.want_logits : r.want_prompt_logits) dst.insert(dst.end(), b.logits.begin(), b.logits.end());
    }
    const auto& lp = b.prompt_logprobs;
    L.result.prompt_logprobs.insert(L.result.prompt_logprobs.end(), lp.begin(), lp.end());
    if (b.tokens.empty()) continue;
    if (L.finishing) {  // the extra step's token is not part of the answer
      finish(L);
      continue;
    }
    if (L.verifying > 0) {  // a verify step: its rejected rows' positions are free again
      const int64_t accepted = int64_t(b.tokens.size()) - 1;
      CHECK(accepted <= L.verifying, "internal: request ", b.req, " got ", b.tokens.size(), " tokens for ", L.verifying,
            " drafts");
      L.pos -= L.verifying - accepted;
      ++spec_.steps;
      spec_.drafted += L.verifying;
      spec_.accepted += accepted;
      spec_.accepted_at.resize(std::max(spec_.accepted_at.size(), size_t(opt_.speculative_tokens)), 0);
      for (int64_t j = 0; j < accepted; ++j) ++spec_.accepted_at[size_t(j)];
    }
    L.verifying = 0;
    L.drafts = b.drafts;
    for (const Sampled& t : b.tokens)
      if (take_token(L, t)) break;
  }
}

// Appends one sampled token to L's answer; true when L ends with it (its later tokens are dropped).
bool Scheduler::take_token(Live& L, const Sampled& t) {
  const Request& r = L.req;
  L.result.tokens.push_back(t.token);
  if (r.stream) partial_[r.index].push_back(t.token);
  ++tokens_generated_;
  --load_;
  if (r.sampling.logprobs >= 0) {
    L.result.logprobs.push_back(t.logprob);
    L.result.top_logprobs.push_back(t.top);
  }
  bool stop = r.sampling.ends_at(t.token, cfg_.eos_token_id);
  if (L.stop && L.stop->feed(t.token)) stop = true;
  if (!stop && int64_t(L.result.tokens.size()) < r.sampling.max_tokens) return false;
  L.result.finish_reason = stop ? "stop" : "length";
  if (r.extra_final_step)
    L.finishing = true;
  else
    finish(L);
  return true;
}

void Scheduler::cancel(int64_t index) {
  if (live_.count(index)) {
    cancel_.insert(index);  // its group's step may be in flight: ended by end_cancelled
    return;
  }
  auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const auto& W) { return W->req.index == index; });
  if (it == waiting_.end()) return;
  Live& W = **it;
  load_ -= W.target() - W.pos + W.req.sampling.max_tokens - int64_t(W.result.tokens.size());
  W.result.finish_reason = "cancelled";
  finished_.push_back(std::move(W.result));
  waiting_.erase(it);
}

// The cancelled sequences of `group`: its last step has come back (the engine receives a group's
// step before building its next), so no stage still works on them.
// A cancelled sequence preempted since is waiting again and ends at once.
void Scheduler::end_cancelled(int group) {
  std::vector<Live*> ending;
  std::vector<int64_t> requeued;
  for (int64_t id : cancel_) {
    auto it = live_.find(id);
    if (it == live_.end())
      requeued.push_back(id);
    else if (it->second->group == group)
      ending.push_back(it->second.get());
  }
  for (int64_t id : requeued) {
    cancel_.erase(id);
    cancel(id);
  }
  for (Live* L : ending) {
    L->result.finish_reason = "cancelled";
    finish(*L);  // erases it from cancel_
  }
}

std::vector<std::pair<int64_t, std::vector<int32_t>>> Scheduler::take_partial() {
  std::vector<std::pair<int64_t, std::vector<int32_t>>> out(std::make_move_iterator(partial_.begin()),
                                                            std::make_move_iterator(partial_.end()));
  partial_.clear();
  return out;
}

std::vector<Result> Scheduler::take_finished() {
  std::vector<Result> out;
  out.swap(finished_);
  return out;
}

}  // namespace glm5::runtime
