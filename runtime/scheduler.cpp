// Scheduler: admission, KV accounting, step building and request completion for one column.
#include "runtime/scheduler.h"

#include <algorithm>

#include "core/check.h"
#include "runtime/model.h"

namespace glm5::runtime {

int64_t Step::rows() const {
  int64_t m = 0;
  for (auto& s : seqs) m += s.n;
  return m;
}

// A running request.
struct Scheduler::Live {
  Request req;
  int group = 0;
  int64_t pos = 0;         // tokens already in the cache
  bool announced = false;  // sent down the column in a step's `added`
  bool finishing = false;  // the extra final step (logit dumps) is pending
  double kv_bytes = 0;
  Result result;
  std::unique_ptr<StopMatcher> stop;
};

Scheduler::Scheduler(const ModelConfig& cfg, const SchedulerOptions& opt, const Tokenizer* tok)
    : cfg_(cfg), opt_(opt), tok_(tok), group_size_(size_t(std::max(1, opt.micro_batches)), 0) {
  CHECK(opt_.micro_batches >= 1, "micro_batches must be >= 1, found ", opt_.micro_batches);
  CHECK(opt_.max_batch >= 1, "max_batch must be >= 1, found ", opt_.max_batch);
  CHECK(opt_.prefill_chunk >= 1, "prefill_chunk must be >= 1, found ", opt_.prefill_chunk);
  CHECK(opt_.max_step_tokens >= opt_.max_batch, "max_step_tokens must be >= max_batch (",
        opt_.max_batch, ") so that every running sequence can decode in one step, found ",
        opt_.max_step_tokens);
}

Scheduler::~Scheduler() = default;

// Cache slots a request holds: prompt + max_tokens + 1 (the extra final step of a logit dump).
static double kv_slots(const Request& r) { return double(r.prompt.size()) + double(r.sampling.max_tokens) + 1; }

int64_t Scheduler::cost(const Request& r) { return int64_t(r.prompt.size()) + r.sampling.max_tokens; }

std::string Scheduler::refuse_reason(const Request& r) const {
  if (!r.error.empty()) return r.error;
  if (r.prompt.empty()) return "prompt is empty";
  if (int64_t(r.prompt.size()) + r.sampling.max_tokens > cfg_.max_position_embeddings)
    return "prompt of " + std::to_string(r.prompt.size()) + " tokens + max_tokens " +
           std::to_string(r.sampling.max_tokens) + " exceeds the context length " +
           std::to_string(cfg_.max_position_embeddings) + " (max_position_embeddings)";
  const double need = kv_slots(r) * double(opt_.kv_bytes_per_token);
  if (opt_.kv_budget_bytes > 0 && need > opt_.kv_budget_bytes)
    return "request needs " + std::to_string(size_t(need)) + " bytes of KV cache, more than the budget of " +
           std::to_string(size_t(opt_.kv_budget_bytes)) + " bytes per rank";
  return "";
}

void Scheduler::add(Request r) {
  load_ += cost(r);
  waiting_.push_back(std::move(r));
}

int64_t Scheduler::free_slots() const {
  return std::max<int64_t>(0, 2 * int64_t(opt_.max_batch) - int64_t(live_.size() + waiting_.size()));
}

// Admits waiting requests into `group` in arrival order, keeping the micro-batches even: a group
// takes at most its share of max_batch and of the work there is. The head waits while the KV
// budget cannot hold it (refuse_reason has ruled out requests that never fit).
void Scheduler::admit(int group) {
  const size_t G = group_size_.size();
  const size_t work_now = live_.size() + waiting_.size();
  const int cap = int(std::min<size_t>((size_t(opt_.max_batch) + G - 1) / G, (work_now + G - 1) / G));
  while (!waiting_.empty() && int(live_.size()) < opt_.max_batch && group_size_[size_t(group)] < cap) {
    const double need = kv_slots(waiting_.front()) * double(opt_.kv_bytes_per_token);
    if (opt_.kv_budget_bytes > 0 && kv_used_ + need > opt_.kv_budget_bytes) break;
    auto L = std::make_unique<Live>();
    L->req = std::move(waiting_.front());
    waiting_.pop_front();
    L->group = group;
    L->kv_bytes = need;
    L->result.index = L->req.index;
    if (!L->req.sampling.stop.empty()) L->stop = std::make_unique<StopMatcher>(L->req.sampling.stop, tok_);
    kv_used_ += need;
    ++group_size_[size_t(group)];
    const int64_t id = L->req.index;
    CHECK(live_.emplace(id, std::move(L)).second, "internal: request index ", id, " is running twice");
  }
}

// Decode rows first (see Model::forward), then prefill chunks while the step has room (the last
// one cut to fit; results do not depend on the chunking).
Step Scheduler::next_step(int group, std::vector<int32_t>& tokens) {
  admit(group);
  Step step;
  step.released.swap(released_);
  tokens.clear();
  int64_t room = opt_.max_step_tokens;
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& [id, Lp] : live_) {
      Live& L = *Lp;
      const Request& r = L.req;
      const int64_t plen = int64_t(r.prompt.size());
      const bool decode = L.pos >= plen;
      if (L.group != group || decode != (pass == 0)) continue;
      StepSeq s;
      s.req = id;
      s.start = L.pos;
      if (decode) {
        s.n = 1;
        s.decode = s.sample = true;
        s.logits_sampled = r.want_logits;
        tokens.push_back(L.result.tokens.back());
      } else {
        s.n = std::min({opt_.prefill_chunk, plen - L.pos, room});
        if (s.n <= 0) continue;  // no room left in this step: next one
        s.sample = L.pos + s.n == plen;
        s.logits_all = r.want_prompt_logits;
        tokens.insert(tokens.end(), r.prompt.begin() + L.pos, r.prompt.begin() + L.pos + s.n);
        prompt_rows_ += s.n;
        load_ -= s.n;
      }
      if (!L.announced) {
        step.added.push_back(r);
        L.announced = true;
      }
      L.pos += s.n;
      room -= s.n;
      step.seqs.push_back(s);
    }
  }
  return step;
}

void Scheduler::finish(Live& L) {
  const int64_t id = L.req.index;
  // What was never generated no longer counts as load.
  if (L.pos < int64_t(L.req.prompt.size())) load_ -= int64_t(L.req.prompt.size()) - L.pos;
  load_ -= L.req.sampling.max_tokens - int64_t(L.result.tokens.size());
  kv_used_ -= L.kv_bytes;
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
    const bool decode_step = L.pos > int64_t(r.prompt.size());
    if (!b.logits.empty()) {
      auto& dst = decode_step ? L.result.decode_logits : L.result.prompt_logits;
      if (decode_step ? r.want_logits : r.want_prompt_logits) dst.insert(dst.end(), b.logits.begin(), b.logits.end());
    }
    if (!b.has_token) continue;
    if (L.finishing) {  // the extra step's token is not part of the answer
      finish(L);
      continue;
    }
    L.result.tokens.push_back(b.sampled.token);
    ++tokens_generated_;
    --load_;
    if (r.sampling.logprobs >= 0) {
      L.result.logprobs.push_back(b.sampled.logprob);
      L.result.top_logprobs.push_back(b.sampled.top);
    }
    const auto& eos = cfg_.eos_token_id;
    bool stop = !r.sampling.ignore_eos && std::find(eos.begin(), eos.end(), b.sampled.token) != eos.end();
    if (L.stop && L.stop->feed(b.sampled.token)) stop = true;
    if (stop || int64_t(L.result.tokens.size()) >= r.sampling.max_tokens) {
      L.result.finish_reason = stop ? "stop" : "length";
      if (r.extra_final_step) L.finishing = true;
      else finish(L);
    }
  }
}

std::vector<Result> Scheduler::take_finished() {
  std::vector<Result> out;
  out.swap(finished_);
  return out;
}

}  // namespace glm5::runtime
