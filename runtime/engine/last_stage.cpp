// The last stage's work on a step: logits, sampling (or verifying drafts), prompt logprobs and,
// when speculating, the MTP layer's drafts for the next step.
#include "runtime/engine/last_stage.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "kernels/core/check.h"
#include "runtime/profile.h"
#include "runtime/sampler.h"

namespace glm5::runtime {

namespace {

// Prompt logprobs of a logits_all chunk of rows [start, start + cnt): row p scores prompt token
// p + 1 (the last prompt row has none: its logits give the first generated token).
std::vector<Sampled> prompt_logprobs(const float* rows, int64_t cnt, int64_t V, int64_t start, const Request& r) {
  std::vector<Sampled> out;
  for (int64_t j = 0; j < cnt && start + j + 1 < int64_t(r.prompt.size()); ++j)
    out.push_back(token_logprob(rows + j * V, V, r.prompt[size_t(start + j + 1)], r.prompt_logprobs));
  return out;
}

// Prompt logprobs of a chunk of an echo request (its rows [first, first + cnt) of h, positions from
// `start`), the logits made kLogprobRows rows at a time: a chunk may be thousands of rows, and a
// [rows x vocab] buffer of them (5 GB at GLM-5's vocabulary for 8192 rows) is not in the memory plan,
// which holds the logits of max_batch rows.
constexpr int64_t kLogprobRows = 64;
std::vector<Sampled> sliced_prompt_logprobs(Model& model, const float* h, int64_t first, int64_t cnt, int64_t start,
                                            const Request& r) {
  kernels::Backend& be = model.backend();
  const int64_t H = model.config().hidden_size, V = model.config().vocab_size;
  std::vector<Sampled> out;
  std::vector<float> logits;
  for (int64_t j = 0; j < cnt; j += kLogprobRows) {
    const int64_t n = std::min(kLogprobRows, cnt - j);
    float* hs = static_cast<float*>(be.alloc(size_t(n * H) * sizeof(float)));
    be.copy_2d({h + (first + j) * H, H, hs, H, n, H});
    logits.resize(size_t(n * V));
    model.logits(hs, n, logits.data());
    be.free(hs);
    std::vector<Sampled> part = prompt_logprobs(logits.data(), n, V, start + j, r);
    out.insert(out.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
  }
  return out;
}

// MTP drafting on the last stage, after sampling (speculative decoding; spec §3.9). The MTP layer
// runs over every row of the step whose next token is now known: a prefill chunk's rows (the next
// prompt token; after the last one, the token just sampled) and a decode step's accepted rows
// (the tokens just sampled), writing its own KV rows at their positions. For a speculating
// sequence that sampled, the MTP output of its last row gives draft 1, and k - 1 chained steps
// give the rest: step j runs at the next position on draft j - 1 and the state the step before
// carried (after shared_head.norm). Drafts are greedy (the argmax of lm_head). The layer runs k
// times per step on every rank of the stage, rows or not, so its MoE exchanges pair up.
void draft(Model& model, const Step& step, const float* h, SeqTable& table, std::vector<Back>& backs, int k) {
  kernels::Backend& be = model.backend();
  const int64_t H = model.config().hidden_size, V = model.config().vocab_size;
  std::unordered_map<int64_t, Back*> back_of;
  for (Back& b : backs) back_of[b.req] = &b;
  std::vector<SeqStep> batch;
  std::vector<int32_t> next_ids;
  std::vector<std::pair<int64_t, int64_t>> rows;  // (first row in h, count) per batch entry
  struct Drafting {
    SeqTable::Entry* e;
    Back* b;
    int64_t row;  // its last row in the MTP batch
    int64_t pos;  // the position its next chained step runs at
  };
  std::vector<Drafting> drafting;
  int64_t row = 0, m = 0;
  for (const StepSeq& s : step.seqs) {
    const int64_t first = row;
    row += s.n;
    auto it = back_of.find(s.req);
    Back* b = it == back_of.end() ? nullptr : it->second;
    if (!s.mtp || (b && !b->error.empty())) continue;
    SeqTable::Entry& e = table.at(s.req);
    const int64_t cnt = s.decode ? int64_t(b->tokens.size()) : s.n;  // rows whose next token is known
    batch.push_back({e.blocks.data(), s.start, cnt, int64_t(e.req.prompt.size())});
    for (int64_t p = s.start; p < s.start + cnt; ++p) next_ids.push_back(e.token_at(p + 1));
    rows.push_back({first, cnt});
    m += cnt;
    e.drafts.clear();
    if (s.sample && s.draft) drafting.push_back({&e, b, m - 1, s.start + cnt});
  }
  // Passes no rank of the stage has rows for are skipped by all (its ranks call the layer together).
  int64_t any[2] = {m, int64_t(drafting.size())};
  model.stage_max(any, 2);
  if (any[0] == 0) return;
  // hidden = model.norm(h) of those rows; state = what the MTP layer carries (shared_head.norm).
  auto alloc = [&](int64_t r) {
    return static_cast<float*>(be.alloc(size_t(std::max<int64_t>(r, 1) * H) * sizeof(float)));
  };
  float *hs = alloc(m), *state = alloc(m);
  int64_t at = 0;
  for (auto& [first, cnt] : rows) {
    be.copy_2d({h + first * H, H, hs + at * H, H, cnt, H});
    at += cnt;
  }
  model.final_norm(hs, m, hs);
  model.mtp_forward(batch, next_ids.data(), hs, state);
  // Draft j of the sequences still drafting (`active`, their states in that order in `state`).
  std::vector<Drafting*> active;
  for (Drafting& q : drafting) {
    const int64_t to = int64_t(active.size());  // rows ascend: compacted in place
    if (q.row != to) be.copy_2d({state + q.row * H, H, state + to * H, H, 1, H});
    active.push_back(&q);
  }
  std::vector<float> logits;
  for (int j = 1; j <= k; ++j) {
    const int64_t n = int64_t(active.size());
    logits.resize(size_t(n * V));
    if (n > 0) model.head_logits(state, n, logits.data());
    std::vector<SeqStep> chain;
    std::vector<int32_t> ids;
    std::vector<Drafting*> still;
    for (int64_t d = 0; d < n; ++d) {
      Drafting& q = *active[size_t(d)];
      q.e->drafts.push_back(argmax(logits.data() + d * V, V));
      // A chained step writes MTP KV rows past the sequence: only within its blocks.
      if (j == k || q.pos >= int64_t(q.e->blocks.size()) * kBlockTokens) continue;
      if (int64_t(still.size()) != d) be.copy_2d({state + d * H, H, state + int64_t(still.size()) * H, H, 1, H});
      chain.push_back({q.e->blocks.data(), q.pos++, 1, int64_t(q.e->req.prompt.size())});
      ids.push_back(q.e->drafts.back());
      still.push_back(&q);
    }
    if (j == k || any[1] == 0) break;
    model.mtp_forward(chain, ids.data(), state, state);
    active.swap(still);
  }
  for (const Drafting& q : drafting) q.b->drafts = q.e->drafts;
  be.free(state);
  be.free(hs);
}

// Rows of h whose logits the step needs: (first row in h, count) per seq of the step, and each
// seq's first row in h.
struct LogitRows {
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<int64_t> first;
  int64_t total = 0;
};

LogitRows logit_rows(const Step& step, SeqTable& table) {
  LogitRows lr;
  int64_t row = 0;
  for (auto& s : step.seqs) {
    lr.first.push_back(row);
    // Every row's logits for a dump (--dump-logits); an echo request's prompt rows are scored in
    // slices (sliced_prompt_logprobs), so only its sampled row joins the step's logits.
    if (s.logits_all && table.at(s.req).req.want_prompt_logits)
      lr.rows.push_back({row, s.n});
    else if (s.sample)
      lr.rows.push_back({row + s.n - 1 - s.drafts, 1 + s.drafts});  // a verify step: every row
    else
      lr.rows.push_back({row, 0});
    lr.total += lr.rows.back().second;
    row += s.n;
  }
  return lr;
}

// [lr.total, vocab] logits of those rows, gathered contiguously first.
std::vector<float> step_logits(Model& model, const float* h, const LogitRows& lr) {
  kernels::Backend& be = model.backend();
  const int64_t H = model.config().hidden_size, V = model.config().vocab_size;
  std::vector<float> logits(size_t(lr.total * V));
  if (lr.total == 0) return logits;
  float* hs = static_cast<float*>(be.alloc(size_t(lr.total * H) * sizeof(float)));
  int64_t at = 0;
  for (auto& [first, cnt] : lr.rows) {
    if (cnt) be.copy_2d({h + first * H, H, hs + at * H, H, cnt, H});
    at += cnt;
  }
  model.logits(hs, lr.total, logits.data());
  be.free(hs);
  return logits;
}

bool all_finite(const float* x, int64_t n) {
  return std::all_of(x, x + n, [](float v) { return std::isfinite(v); });
}

// One seq's Back from its cnt rows of logits at `mine` (its rows of h from `first`): the sampled
// or verified tokens, cut at EOS and max_tokens; prompt logprobs; the logits asked for. Non-finite
// logits give an error and a line on stderr instead.
Back finish_seq(Model& model, const StepSeq& s, SeqTable::Entry& e, const float* mine, int64_t cnt, const float* h,
                int64_t first, int rank) {
  const int64_t V = model.config().vocab_size;
  Back b;
  b.req = s.req;
  // A verify step's rows after the first are checked only as far as plain decoding would have
  // computed them: up to the first non-finite one, which ends the verification there.
  int64_t drafts = s.drafts;
  for (int64_t j = 1; j <= drafts; ++j)
    if (!all_finite(mine + (cnt - 1 - s.drafts + j) * V, V)) drafts = j - 1;
  if (!all_finite(mine, (cnt - s.drafts) * V)) {
    b.error = "non-finite logits (NaN or inf) at positions " + std::to_string(s.start) + ".." +
              std::to_string(s.start + s.n - 1) + " (generated token " + std::to_string(e.generated.size()) + ")";
    std::fprintf(stderr, "[glm5] rank %d: request %lld: %s; the request ends with an error, the others go on\n", rank,
                 (long long)s.req, b.error.c_str());
    return b;
  }
  const float* last = cnt > 0 ? mine + (cnt - 1) * V : nullptr;  // (an echo chunk's rows are scored below)
  if (s.sample) {  // one token, or a verify step's (the rows' logits are plain decoding's bits)
    CHECK(int64_t(e.drafts.size()) >= s.drafts, "internal: request ", s.req, " verifies ", s.drafts,
          " drafts, the last stage proposed ", e.drafts.size());
    b.tokens = verify_drafts(last - int64_t(s.drafts) * V, V, e.drafts.data(), drafts, e.req.sampling, e.req.prompt,
                             e.generated);
    // What the scheduler keeps: up to the first EOS and max_tokens (stop strings it cuts itself).
    const SamplingParams& sp = e.req.sampling;
    const int64_t before = int64_t(e.generated.size()) - int64_t(b.tokens.size());
    size_t keep = 0;
    while (keep < b.tokens.size() && before + int64_t(keep) < sp.max_tokens)
      if (sp.ends_at(b.tokens[keep++].token, model.config().eos_token_id)) break;
    b.tokens.resize(std::max<size_t>(keep, 1));
  }
  if (s.logits_all && e.req.prompt_logprobs >= 0)
    b.prompt_logprobs = e.req.want_prompt_logits ? prompt_logprobs(mine, cnt, V, s.start, e.req)
                                                 : sliced_prompt_logprobs(model, h, first, s.n, s.start, e.req);
  if (s.logits_all && e.req.want_prompt_logits)
    b.logits.assign(mine, mine + cnt * V);
  else if (s.logits_sampled)
    b.logits.assign(last, last + V);
  return b;
}

}  // namespace

std::vector<Back> finish_step(Model& model, const Step& step, const float* h, SeqTable& table, int rank,
                              int speculative_tokens) {
  const int64_t V = model.config().vocab_size;
  const LogitRows lr = logit_rows(step, table);
  const std::vector<float> logits = step_logits(model, h, lr);
  std::optional<Profiler::Scope> span(std::in_place, model.profiler(), "sample",
                                      -1);  // (and the logits checks, copies)
  std::vector<Back> out;
  int64_t at = 0;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const StepSeq& s = step.seqs[i];
    const int64_t cnt = lr.rows[i].second;
    const float* mine = logits.data() + at * V;
    at += cnt;
    if (s.sample || s.logits_all) out.push_back(finish_seq(model, s, table.at(s.req), mine, cnt, h, lr.first[i], rank));
  }
  span.reset();
  if (speculative_tokens > 0) draft(model, step, h, table, out, speculative_tokens);
  return out;
}

}  // namespace glm5::runtime
