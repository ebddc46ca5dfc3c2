// Engine: executes the scheduler's steps and moves their bytes. Per tick (one micro-batch step of
// one column):
//   stage 0 --step+hidden(+top-k)--> stage 1 --> ... --> stage P-1 --tokens(+logits)--> stage 0
// (the top-k follows the hidden states when the next stage begins with a GLM-5.2 "shared" layer)
// Every message is (int64 size, payload) on the world communicator between ranks of a column,
// sent with isend (see engine.h: why that cannot deadlock). Between ticks the stage-0 ranks
// share their state (all_gather over the stage), send finished results to world rank 0, and
// rank 0 hands out new requests (two broadcasts over the stage).
#include "runtime/engine.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_map>

#include "core/check.h"
#include "parallel/device_comm.h"
#include "runtime/scheduler.h"

namespace glm5::runtime {

long peak_rss_kb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

using parallel::kTagBack, parallel::kTagHidden, parallel::kTagResults, parallel::kTagStep;

struct Writer {
  std::vector<char> b;
  template <typename T>
  void put(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put<int64_t>(int64_t(v.size()));
    const char* p = reinterpret_cast<const char*>(v.data());
    b.insert(b.end(), p, p + v.size() * sizeof(T));
  }
  void put_str(const std::string& s) { put_vec(std::vector<char>(s.begin(), s.end())); }
};

struct Reader {
  const char* p;
  const char* end;
  explicit Reader(const std::vector<char>& v) : p(v.data()), end(v.data() + v.size()) {}
  template <typename T>
  T get() {
    CHECK(p + sizeof(T) <= end, "internal: truncated engine message");
    T v;
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }
  template <typename T>
  std::vector<T> get_vec() {
    int64_t n = get<int64_t>();
    CHECK(n >= 0 && p + size_t(n) * sizeof(T) <= end, "internal: truncated engine message");
    std::vector<T> v(static_cast<size_t>(n));
    if (n) std::memcpy(static_cast<void*>(v.data()), p, size_t(n) * sizeof(T));
    p += size_t(n) * sizeof(T);
    return v;
  }
  std::string get_str() {
    auto v = get_vec<char>();
    return std::string(v.begin(), v.end());
  }
};

std::vector<char> recv_bytes(parallel::Comm& c, int src, int tag) {
  int64_t n = 0;
  c.recv(&n, sizeof n, src, tag);
  std::vector<char> b(static_cast<size_t>(n));
  if (n) c.recv(b.data(), b.size(), src, tag);
  return b;
}

// GLM-5.2's IndexShare across a hop: the step's top-k [Model::topk_values] int32, in the backend's
// memory, when the receiving stage begins with a "shared" layer (nullptr, 0 values otherwise).
struct TopkCarry {
  int32_t* p = nullptr;
  int64_t n = 0;
  TopkCarry(Model& model, const std::vector<SeqStep>& batch, bool needed)
      : n(needed ? Model::topk_values(batch, model.config().index_topk) : 0) {
    if (n > 0) p = static_cast<int32_t*>(model.backend().alloc(size_t(n) * sizeof(int32_t)));
  }
};

// Hidden states between stages travel in the backend's memory over the hidden-state communicator
// (the world for host backends; NCCL, or a staging communicator, for device ones).
void recv_hidden(parallel::Comm& c, float* h, int64_t n, int src) {
  if (n > 0) c.recv(h, size_t(n) * sizeof(float), src, kTagHidden);
}

void put_request(Writer& w, const Request& r) {
  w.put(r.index);
  w.put_vec(r.prompt);
  const SamplingParams& s = r.sampling;
  w.put(s.temperature);
  w.put(s.top_p);
  w.put(s.top_k);
  w.put(s.min_p);
  w.put(s.repetition_penalty);
  w.put(s.presence_penalty);
  w.put(s.frequency_penalty);
  w.put(s.seed);
  w.put(s.max_tokens);
  w.put(s.logprobs);
  w.put(s.ignore_eos);
  w.put<int64_t>(int64_t(s.stop.size()));
  for (auto& x : s.stop) w.put_str(x);
  w.put(r.want_prompt_logits);
  w.put(r.want_logits);
  w.put(r.extra_final_step);
  w.put(r.prompt_logprobs);
  w.put_str(r.error);
  w.put(r.stream);
  w.put(r.speculative);
  w.put_vec(r.generated);
}
Request get_request(Reader& rd) {
  Request r;
  r.index = rd.get<int64_t>();
  r.prompt = rd.get_vec<int32_t>();
  SamplingParams& s = r.sampling;
  s.temperature = rd.get<float>();
  s.top_p = rd.get<float>();
  s.top_k = rd.get<int32_t>();
  s.min_p = rd.get<float>();
  s.repetition_penalty = rd.get<float>();
  s.presence_penalty = rd.get<float>();
  s.frequency_penalty = rd.get<float>();
  s.seed = rd.get<uint64_t>();
  s.max_tokens = rd.get<int32_t>();
  s.logprobs = rd.get<int32_t>();
  s.ignore_eos = rd.get<bool>();
  int64_t ns = rd.get<int64_t>();
  for (int64_t i = 0; i < ns; ++i) s.stop.push_back(rd.get_str());
  r.want_prompt_logits = rd.get<bool>();
  r.want_logits = rd.get<bool>();
  r.extra_final_step = rd.get<bool>();
  r.prompt_logprobs = rd.get<int32_t>();
  r.error = rd.get_str();
  r.stream = rd.get<bool>();
  r.speculative = rd.get<bool>();
  r.generated = rd.get_vec<int32_t>();
  return r;
}

// A list of logprob entries (prompt logprobs): count, then token, logprob and top list each.
void put_sampled(Writer& w, const std::vector<Sampled>& v) {
  w.put<int64_t>(int64_t(v.size()));
  for (const Sampled& x : v) {
    w.put(x.token);
    w.put(x.logprob);
    w.put_vec(x.top);
  }
}
std::vector<Sampled> get_sampled(Reader& rd) {
  std::vector<Sampled> v(static_cast<size_t>(rd.get<int64_t>()));
  for (Sampled& x : v) {
    x.token = rd.get<int32_t>();
    x.logprob = rd.get<float>();
    x.top = rd.get_vec<std::pair<int32_t, float>>();
  }
  return v;
}

void put_result(Writer& w, const Result& r) {
  w.put(r.index);
  w.put_vec(r.tokens);
  w.put_vec(r.logprobs);
  w.put<int64_t>(int64_t(r.top_logprobs.size()));
  for (auto& t : r.top_logprobs) w.put_vec(t);
  w.put_str(r.finish_reason);
  w.put_str(r.error);
  w.put_vec(r.prompt_logits);
  w.put_vec(r.decode_logits);
  put_sampled(w, r.prompt_logprobs);
}
Result get_result(Reader& rd) {
  Result r;
  r.index = rd.get<int64_t>();
  r.tokens = rd.get_vec<int32_t>();
  r.logprobs = rd.get_vec<float>();
  int64_t n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) r.top_logprobs.push_back(rd.get_vec<std::pair<int32_t, float>>());
  r.finish_reason = rd.get_str();
  r.error = rd.get_str();
  r.prompt_logits = rd.get_vec<float>();
  r.decode_logits = rd.get_vec<float>();
  r.prompt_logprobs = get_sampled(rd);
  return r;
}

void put_step(Writer& w, const Step& s) {
  w.put(s.stop);
  w.put<int64_t>(int64_t(s.seqs.size()));
  for (auto& q : s.seqs) w.put(q);
  w.put_vec(s.released);
  w.put<int64_t>(int64_t(s.added.size()));
  for (auto& r : s.added) put_request(w, r);
  w.put_vec(s.blocks);
}
Step get_step(Reader& rd) {
  Step s;
  s.stop = rd.get<bool>();
  int64_t n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) s.seqs.push_back(rd.get<StepSeq>());
  s.released = rd.get_vec<int64_t>();
  n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) s.added.push_back(get_request(rd));
  s.blocks = rd.get_vec<int32_t>();
  return s;
}

void put_backs(Writer& w, const std::vector<Back>& backs) {
  w.put<int64_t>(int64_t(backs.size()));
  for (auto& b : backs) {
    w.put(b.req);
    put_sampled(w, b.tokens);
    w.put_vec(b.drafts);
    w.put_vec(b.logits);
    w.put_str(b.error);
    put_sampled(w, b.prompt_logprobs);
  }
}
std::vector<Back> get_backs(Reader& rd) {
  std::vector<Back> backs(static_cast<size_t>(rd.get<int64_t>()));
  for (Back& b : backs) {
    b.req = rd.get<int64_t>();
    b.tokens = get_sampled(rd);
    b.drafts = rd.get_vec<int32_t>();
    b.logits = rd.get_vec<float>();
    b.error = rd.get_str();
    b.prompt_logprobs = get_sampled(rd);
  }
  return backs;
}

// Messages in flight: each owns its bytes until the send completes. Sizes and payloads go as two
// messages (the receiver allocates from the size).
class Outbox {
 public:
  void send_bytes(parallel::Comm& c, int dst, int tag, std::vector<char> b) {
    auto m = std::make_unique<Msg>();
    m->size = int64_t(b.size());
    m->bytes = std::move(b);
    m->sends.push_back(c.isend(&m->size, sizeof m->size, dst, tag));
    if (m->size) m->sends.push_back(c.isend(m->bytes.data(), m->bytes.size(), dst, tag));
    push(std::move(m));
  }
  // n floats at h, in the backend's memory (no size message: the step before it gives the row
  // count), over the hidden-state communicator; h is freed once the send is complete.
  void send_hidden(parallel::Comm& c, kernels::Backend& be, float* h, int64_t n, int dst) {
    if (n == 0) return be.free(h);
    auto m = std::make_unique<Msg>();
    m->release = [&be, h] { be.free(h); };
    m->sends.push_back(c.isend(h, size_t(n) * sizeof(float), dst, kTagHidden));
    push(std::move(m));
  }
  // Waits for every send (end of the run). Not while unwinding to the job's abort: waiting could
  // hang on a peer that waits for us, and MPI may still read the buffers, so the messages are
  // leaked whole.
  void drain() {
    if (std::uncaught_exceptions() > 0) {
      for (auto& m : q_) m.release();
      q_.clear();
      return;
    }
    for (auto& m : q_)
      for (auto& s : m->sends) s->wait();
    reap();
  }
  ~Outbox() { drain(); }

 private:
  struct Msg {
    int64_t size = 0;
    std::vector<char> bytes;
    std::function<void()> release;
    std::vector<std::unique_ptr<parallel::PendingSend>> sends;
    bool done() {
      for (auto& s : sends)
        if (!s->done()) return false;
      return true;
    }
    ~Msg() {  // only for completed messages, or at the end of a run (see drain)
      for (auto& s : sends) s->wait();
      if (release) release();
    }
  };
  void push(std::unique_ptr<Msg> m) {
    q_.push_back(std::move(m));
    reap();
  }
  void reap() {  // completed messages, oldest first
    while (!q_.empty() && q_.front()->done()) q_.pop_front();
  }
  std::deque<std::unique_ptr<Msg>> q_;
};

// The state a stage keeps per running sequence: its request (from the step that first carries
// it), its KV block table (grown by the steps) and, on the last stage, the tokens it has sampled
// (penalties and the sampling step).
class SeqTable {
 public:
  explicit SeqTable(int64_t num_blocks) : num_blocks_(num_blocks) {}
  // Applies a step's releases, additions and new blocks, then returns its batch for Model::forward.
  std::vector<SeqStep> enter(const Step& step) {
    for (int64_t r : step.released) seqs_.erase(r);
    for (const Request& r : step.added) {
      Entry e;
      e.req = r;
      e.generated = r.generated;
      CHECK(seqs_.emplace(r.index, std::move(e)).second, "internal: request ", r.index, " added twice");
    }
    std::vector<SeqStep> batch;
    size_t at = 0;
    for (auto& s : step.seqs) {
      Entry& e = this->at(s.req);
      CHECK(at + size_t(s.new_blocks) <= step.blocks.size(), "internal: step lists too few KV blocks");
      for (int64_t i = 0; i < s.new_blocks; ++i) {
        const int32_t b = step.blocks[at + size_t(i)];
        CHECK(b >= 0 && b < num_blocks_, "internal: KV block ", b, " outside the pool of ", num_blocks_, " blocks");
        e.blocks.push_back(b);
      }
      at += size_t(s.new_blocks);
      CHECK(int64_t(e.blocks.size()) >= blocks_for(s.start + s.n), "internal: request ", s.req, " has KV blocks for ",
            e.blocks.size() * size_t(kBlockTokens), " positions, the step needs ", s.start + s.n);
    }
    for (auto& s : step.seqs) {
      Entry& e = this->at(s.req);
      batch.push_back({e.blocks.data(), s.start, s.n, int64_t(e.req.prompt.size())});
    }
    return batch;
  }
  struct Entry {
    Request req;
    std::vector<int32_t> blocks;
    std::vector<int32_t> generated;
    std::vector<int32_t> drafts;  // last stage: the drafts it proposed for the next step
    // The token at position p: the prompt's, then the generated ones (last stage).
    int32_t token_at(int64_t p) const {
      const int64_t P = int64_t(req.prompt.size());
      return p < P ? req.prompt[size_t(p)] : generated[size_t(p - P)];
    }
  };
  Entry& at(int64_t req) {
    auto it = seqs_.find(req);
    CHECK(it != seqs_.end(), "internal: step names request ", req, ", which this stage does not hold");
    return it->second;
  }

 private:
  std::map<int64_t, Entry> seqs_;
  int64_t num_blocks_;
};

}  // namespace

// Prompt logprobs of a logits_all chunk of rows [start, start + cnt): row p scores prompt token
// p + 1 (the last prompt row has none: its logits give the first generated token).
static std::vector<Sampled> prompt_logprobs(const float* rows, int64_t cnt, int64_t V, int64_t start,
                                            const Request& r) {
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
static std::vector<Sampled> sliced_prompt_logprobs(Model& model, const float* h, int64_t first, int64_t cnt,
                                                   int64_t start, const Request& r) {
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
static void draft(Model& model, const Step& step, const float* h, SeqTable& table, std::vector<Back>& backs, int k) {
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

// The last stage's work on a step: logits of the rows that need them, then sampling. A sequence
// whose logits are not finite gets an error (it ends; the others go on) and a line on stderr.
static std::vector<Back> finish_step(Model& model, const Step& step, const float* h, SeqTable& table, int rank,
                                     int speculative_tokens) {
  kernels::Backend& be = model.backend();
  const int64_t H = model.config().hidden_size, V = model.config().vocab_size;
  // Rows that need logits, gathered contiguously.
  std::vector<std::pair<int64_t, int64_t>> rows;  // (first row in h, count) per seq
  std::vector<int64_t> row_of;                    // each seq's first row in h
  int64_t row = 0, total = 0;
  for (auto& s : step.seqs) {
    row_of.push_back(row);
    // Every row's logits for a dump (--dump-logits); an echo request's prompt rows are scored in
    // slices below, so only its sampled row joins the step's logits.
    if (s.logits_all && table.at(s.req).req.want_prompt_logits)
      rows.push_back({row, s.n});
    else if (s.sample)
      rows.push_back({row + s.n - 1 - s.drafts, 1 + s.drafts});  // a verify step: every row
    else
      rows.push_back({row, 0});
    total += rows.back().second;
    row += s.n;
  }
  std::vector<float> logits(size_t(total * V));
  if (total > 0) {
    float* hs = static_cast<float*>(be.alloc(size_t(total * H) * sizeof(float)));
    int64_t at = 0;
    for (auto& [first, cnt] : rows) {
      if (cnt) be.copy_2d({h + first * H, H, hs + at * H, H, cnt, H});
      at += cnt;
    }
    model.logits(hs, total, logits.data());
    be.free(hs);
  }
  std::optional<Profiler::Scope> span(std::in_place, model.profiler(), "sample",
                                      -1);  // (and the logits checks, copies)
  std::vector<Back> out;
  int64_t at = 0;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const StepSeq& s = step.seqs[i];
    const int64_t cnt = rows[i].second;
    const float* mine = logits.data() + at * V;
    at += cnt;
    if (!s.sample && !s.logits_all) continue;
    Back b;
    b.req = s.req;
    auto& e = table.at(s.req);
    // A verify step's rows after the first are checked only as far as plain decoding would have
    // computed them: up to the first non-finite one, which ends the verification there.
    auto finite = [&](int64_t row) {
      return std::all_of(mine + row * V, mine + (row + 1) * V, [](float x) { return std::isfinite(x); });
    };
    int64_t drafts = s.drafts;
    for (int64_t j = 1; j <= drafts; ++j)
      if (!finite(cnt - 1 - s.drafts + j)) drafts = j - 1;
    if (!std::all_of(mine, mine + (cnt - s.drafts) * V, [](float x) { return std::isfinite(x); })) {
      b.error = "non-finite logits (NaN or inf) at positions " + std::to_string(s.start) + ".." +
                std::to_string(s.start + s.n - 1) + " (generated token " + std::to_string(e.generated.size()) + ")";
      std::fprintf(stderr, "[glm5] rank %d: request %lld: %s; the request ends with an error, the others go on\n", rank,
                   (long long)s.req, b.error.c_str());
      out.push_back(std::move(b));
      continue;
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
                                                   : sliced_prompt_logprobs(model, h, row_of[i], s.n, s.start, e.req);
    if (s.logits_all && e.req.want_prompt_logits)
      b.logits.assign(mine, mine + cnt * V);
    else if (s.logits_sampled)
      b.logits.assign(last, last + V);
    out.push_back(std::move(b));
  }
  span.reset();
  if (speculative_tokens > 0) draft(model, step, h, table, out, speculative_tokens);
  return out;
}

namespace {

// The list form of run(): requests in order, indexed by position (callers' indexes need not be
// unique); results get the caller's index back.
class ListSource final : public RequestSource {
 public:
  explicit ListSource(const std::vector<Request>& reqs) : reqs_(reqs) {}
  std::optional<Request> next() override {
    if (at_ >= reqs_.size()) return std::nullopt;
    Request r = reqs_[at_];
    r.index = int64_t(at_++);
    return r;
  }
  bool exhausted() override { return at_ >= reqs_.size(); }
  int64_t size_hint() const override { return int64_t(reqs_.size()); }
  int64_t caller_index(int64_t i) const { return reqs_[size_t(i)].index; }

 private:
  const std::vector<Request>& reqs_;
  size_t at_ = 0;
};

}  // namespace

Engine::Engine(Model& model, parallel::Comm& world, parallel::Comm& stage_comm, const parallel::Grid& grid,
               const EngineOptions& opt, parallel::Comm* hidden_comm)
    : model_(model), world_(world), stage_comm_(stage_comm), grid_(grid), opt_(opt) {
  if (hidden_comm) {
    CHECK(hidden_comm->size() == world.size() && hidden_comm->rank() == world.rank() &&
              hidden_comm->device_buffers() == !model.backend().host_memory(),
          "engine: the hidden-state communicator (", hidden_comm->transport(),
          ") must have the world's ranks in order and take the backend's memory");
    hidden_ = hidden_comm;
  } else if (model.backend().host_memory()) {
    hidden_ = &world;
  } else {
    staged_hidden_ = parallel::make_staged_comm(world, model.backend());
    hidden_ = staged_hidden_.get();
  }
  stats_.rank = world.rank();
  stats_.stage = grid.stage_of(world.rank());
  stats_.column = grid.column_of(world.rank());
  trace_ = std::getenv("GLM5_TRACE") != nullptr;
  CHECK(opt_.micro_batches >= 1, "micro_batches must be >= 1, found ", opt_.micro_batches);
  CHECK(opt_.max_batch >= 1, "max_batch must be >= 1, found ", opt_.max_batch);
  CHECK(opt_.prefill_chunk >= 1, "prefill_chunk must be >= 1, found ", opt_.prefill_chunk);
  CHECK(opt_.max_step_tokens >= opt_.max_batch, "max_step_tokens must be >= max_batch (", opt_.max_batch,
        ") so that every running sequence can decode in one step, found ", opt_.max_step_tokens);
}

void Engine::run(const std::vector<Request>& requests, const std::function<void(Result&&)>& on_result) {
  ListSource src(requests);
  run(world_.rank() == 0 ? &src : nullptr, [&](Result&& r) {
    r.index = src.caller_index(r.index);
    on_result(std::move(r));
  });
}

void Engine::run(RequestSource* source, const std::function<void(Result&&)>& on_result) {
  CHECK(world_.rank() != 0 || source, "internal: world rank 0 needs a request source");
  auto t0 = Clock::now();
  // The paged KV cache: the same number of blocks on every rank (sized for the largest stage),
  // so that the block ids the stage-0 schedulers hand out are valid all down the column.
  const int first = model_.shard().first_layer, last = first + model_.kv_layers();
  const size_t per_token = opt_.kv_bytes_per_token > 0
                               ? opt_.kv_bytes_per_token
                               : KvPool::bytes_per_token(model_.config(), first, last, opt_.kv_dtype);
  kv_blocks_ = KvPool::blocks_for_budget(model_.config(), per_token, opt_.kv_budget_bytes, opt_.max_batch);
  world_.all_reduce(&kv_blocks_, 1, parallel::ReduceDType::I64, parallel::ReduceOp::Min);  // one size everywhere
  CHECK(opt_.speculative_tokens == 0 || model_.has_mtp() || !model_.shard().head,
        "internal: speculative decoding without the MTP layer on the last stage");
  KvPool pool(model_.backend(), model_.config(), first, last, kv_blocks_, opt_.kv_dtype);
  model_.set_kv_pool(&pool);
  struct Unset {
    Model& m;
    ~Unset() { m.set_kv_pool(nullptr); }
  } unset{model_};
  stats_.kv_blocks = kv_blocks_;
  if (stats_.stage == 0)
    run_stage0(source, on_result);
  else
    run_later_stage();
  stats_.wall_s = since(t0);
  stats_.comm_s += model_.moe_comm_seconds();
  stats_.compute_s -= model_.moe_comm_seconds();
  // idle_s: time spent waiting for pipeline messages (measured where it happens).
  stats_.bytes_sent += model_.moe_bytes_sent();
  stats_.expert_tokens = model_.expert_tokens();
  stats_.peak_rss_kb = peak_rss_kb();
}

// Stage-0 state of one run (one column).
struct Engine::Stage0 {
  Scheduler sched;
  RequestSource* source = nullptr;  // world rank 0 only
  const std::function<void(Result&&)>* on_result = nullptr;
  Outbox out;
  std::vector<bool> inflight;                             // per group: a step awaits its results
  std::vector<bool> inflight_rows;                        // ... and it had rows
  int64_t done = 0, total = -1;                           // progress (rank 0)
  std::chrono::milliseconds idle_wait{2};                 // rank 0's wait when it has no work
  std::unordered_map<uint64_t, uint64_t> prefix_columns;  // first prompt block -> columns with it (bits)
  Clock::time_point t_start = Clock::now(), t_progress = Clock::now();
  Stage0(const ModelConfig& cfg, const SchedulerOptions& so, const Tokenizer* tok, int G)
      : sched(cfg, so, tok), inflight(size_t(G), false), inflight_rows(size_t(G), false) {}
  int64_t steps_in_flight() const {
    int64_t n = 0;
    for (bool b : inflight_rows) n += b ? 1 : 0;
    return n;
  }
};

// The scheduler's counters into the run's stats.
static void copy_counters(const Scheduler& sched, EngineStats& st) {
  st.tokens_generated = sched.tokens_generated();
  st.prompt_tokens = sched.prompt_rows();
  st.preemptions = sched.preemptions();
  st.kv_blocks_peak = sched.blocks_peak();
  st.prefix_hit_tokens = sched.prefix_hit_tokens();
  st.spec_steps = sched.spec_stats().steps;
  st.spec_drafted = sched.spec_stats().drafted;
  st.spec_accepted = sched.spec_stats().accepted;
  st.spec_accepted_at = sched.spec_stats().accepted_at;
}

// Between ticks on the stage-0 ranks: results go to world rank 0, which hands out new requests
// (to the least-loaded columns with room) and decides when the run is over. False: over.
bool Engine::exchange(Stage0& s) {
  const int E = grid_.expert_parallel, col = stats_.column;
  constexpr int kState = 7;
  std::vector<Result> finished = s.sched.take_finished();
  auto partial = s.sched.take_partial();
  // Column state: work (running, waiting, results, steps in flight), load, free slots, the bytes
  // of its partial tokens and results, their counts, KV blocks in use.
  Writer res;
  for (auto& [index, tokens] : partial) {
    res.put(index);
    res.put_vec(tokens);
  }
  for (auto& r : finished) put_result(res, r);
  int64_t mine[kState] = {s.sched.work() + s.steps_in_flight() + int64_t(finished.size()),
                          s.sched.load(),
                          s.sched.free_slots(),
                          int64_t(res.b.size()),
                          int64_t(finished.size()),
                          int64_t(partial.size()),
                          s.sched.blocks_in_use()};
  std::vector<int64_t> all(size_t(kState * E));
  auto t = Clock::now();
  if (E > 1)
    stage_comm_.all_gather(mine, sizeof mine, all.data());
  else
    std::copy(mine, mine + kState, all.begin());
  auto deliver = [&](Result&& r) {
    ++s.done;
    (*s.on_result)(std::move(r));
  };
  if (col == 0) {
    // A column's partial tokens go out before its results (a stream's last tokens may be in both).
    for (auto& [index, tokens] : partial) s.source->on_tokens(index, tokens);
    for (auto& r : finished) deliver(std::move(r));
    for (int c = 1; c < E; ++c) {
      if (all[size_t(kState * c + 3)] == 0) continue;
      std::vector<char> b = recv_bytes(stage_comm_, c, kTagResults);
      Reader rd(b);
      for (int64_t i = 0; i < all[size_t(kState * c + 5)]; ++i) {
        const int64_t index = rd.get<int64_t>();
        s.source->on_tokens(index, rd.get_vec<int32_t>());
      }
      for (int64_t i = 0; i < all[size_t(kState * c + 4)]; ++i) deliver(get_result(rd));
    }
  } else if (!res.b.empty()) {
    s.out.send_bytes(stage_comm_, 0, kTagResults, std::move(res.b));
  }
  // Rank 0: new requests for the columns, cancellations, and the end of the run.
  std::vector<std::vector<Request>> assigned(static_cast<size_t>(E));
  std::vector<int64_t> cancelled;
  int64_t stop = 0;
  if (col == 0) {
    int64_t work = 0, room = 0;
    std::vector<int64_t> load(static_cast<size_t>(E)), free(static_cast<size_t>(E));
    EngineStatus status;
    for (int c = 0; c < E; ++c) {
      work += all[size_t(kState * c)];
      load[size_t(c)] = all[size_t(kState * c + 1)];
      room += free[size_t(c)] = all[size_t(kState * c + 2)];
      status.kv_blocks_used += all[size_t(kState * c + 6)];
    }
    status.work = work;
    status.kv_blocks = kv_blocks_ * E;
    s.source->on_status(status);
    cancelled = s.source->take_cancelled();
    int64_t handed = 0;
    while (room > 0) {
      std::optional<Request> r = s.source->next();
      if (!r) break;
      if (std::string why = s.sched.refuse_reason(*r); !why.empty()) {
        Result err;
        err.index = r->index;
        err.finish_reason = "error";
        err.error = why;
        deliver(std::move(err));
        continue;
      }
      // The column with room whose load (tokens in flight) would be least after taking it; a
      // column that already has the request's first prompt block (prefix sharing) is charged
      // only for what it will compute. Lowest column on ties.
      const int64_t cost = int64_t(r->prompt.size()) + r->sampling.max_tokens;
      const int64_t shareable = (int64_t(r->prompt.size()) - 1) / kBlockTokens * kBlockTokens;
      uint64_t* has = nullptr;
      if (E > 1 && shareable > 0 && opt_.prefix_sharing) {
        if (s.prefix_columns.size() > 65536) s.prefix_columns.clear();  // a bounded hint
        has = &s.prefix_columns[prefix_hashes({r->prompt.begin(), r->prompt.begin() + kBlockTokens + 1})[0]];
      }
      auto charge = [&](int c) { return cost - (has && (*has >> (c % 64) & 1) ? shareable : 0); };
      int best = -1;
      for (int c = 0; c < E; ++c)
        if (free[size_t(c)] > 0 && (best < 0 || load[size_t(c)] + charge(c) < load[size_t(best)] + charge(best)))
          best = c;
      load[size_t(best)] += charge(best);
      if (has) *has |= uint64_t(1) << (best % 64);
      --free[size_t(best)];
      --room;
      ++handed;
      assigned[size_t(best)].push_back(std::move(*r));
    }
    stop = work == 0 && handed == 0 && s.source->exhausted();
    // An idle server waits for requests instead of spinning: every tick is collectives on every
    // rank, so the wait doubles up to 50 ms while idle (a source wakes at once when work comes)
    // and is back at 2 ms as soon as there is work.
    if (work == 0 && handed == 0 && !stop) {
      s.source->wait_for_work(s.idle_wait);
      s.idle_wait = std::min(s.idle_wait * 2, std::chrono::milliseconds(50));
    } else {
      s.idle_wait = std::chrono::milliseconds(2);
    }
    if (s.total < 0) s.total = s.source->size_hint();
    show_progress(s, stop);
  }
  if (E > 1) {  // stop flag, the assignments and the cancellations, to every column of the stage
    Writer w;
    if (col == 0) {
      for (int c = 0; c < E; ++c) {
        w.put<int64_t>(int64_t(assigned[size_t(c)].size()));
        for (auto& r : assigned[size_t(c)]) put_request(w, r);
      }
      w.put_vec(cancelled);
    }
    int64_t head[2] = {stop, int64_t(w.b.size())};
    stage_comm_.broadcast(head, sizeof head, 0);
    stop = head[0];
    w.b.resize(size_t(head[1]));
    if (head[1]) stage_comm_.broadcast(w.b.data(), w.b.size(), 0);
    if (col != 0) {
      Reader rd(w.b);
      for (int c = 0; c < E; ++c) {
        const int64_t n = rd.get<int64_t>();
        for (int64_t i = 0; i < n; ++i) {
          Request r = get_request(rd);
          if (c == col) assigned[size_t(c)].push_back(std::move(r));
        }
      }
      cancelled = rd.get_vec<int64_t>();
    }
  }
  for (int64_t index : cancelled) s.sched.cancel(index);  // a column holds it or ignores it
  for (auto& r : assigned[size_t(col)]) s.sched.add(std::move(r));
  // Live counters (a server's /metrics reads them between steps; a batch job at the end).
  copy_counters(s.sched, stats_);
  stats_.comm_s += since(t);
  return !stop;
}

void Engine::show_progress(Stage0& s, bool end) {
  if (!opt_.progress || (since(s.t_progress) < 1.0 && !end)) return;
  const double el = since(s.t_start), rate = double(s.sched.tokens_generated()) / std::max(el, 1e-9);
  if (s.total >= 0) {
    const double eta = s.done > 0 ? el / double(s.done) * double(s.total - s.done) : 0;
    std::fprintf(stderr, "\r[glm5] %lld/%lld requests, %.1f tok/s (column 0), ETA %.0f s   ", (long long)s.done,
                 (long long)s.total, rate, eta);
  } else {
    std::fprintf(stderr, "\r[glm5] %lld requests done, %.1f tok/s (column 0)   ", (long long)s.done, rate);
  }
  if (end) std::fprintf(stderr, "\n");
  s.t_progress = Clock::now();
}

void Engine::run_stage0(RequestSource* source, const std::function<void(Result&&)>& on_result) {
  const ModelConfig& cfg = model_.config();
  const int P = grid_.stages, col = stats_.column;
  const int G = P == 1 ? 1 : opt_.micro_batches;
  const int64_t H = cfg.hidden_size;
  const int next = grid_.rank_of(1 % P, col), last = grid_.rank_of(P - 1, col);
  kernels::Backend& be = model_.backend();
  SchedulerOptions so;
  so.micro_batches = G;
  so.limits() = opt_.limits();
  so.kv_blocks = kv_blocks_;
  so.prefix_sharing = opt_.prefix_sharing;
  so.speculative_tokens = opt_.speculative_tokens;
  so.speculative_max_batch = opt_.speculative_max_batch;
  Stage0 s(cfg, so, opt_.tokenizer, G);
  s.source = source;
  s.on_result = &on_result;
  SeqTable table(kv_blocks_);

  // What the last stage returned for group g's step in flight.
  auto receive = [&](int g) {
    auto t = Clock::now();
    std::optional<Profiler::Scope> wait(std::in_place, model_.profiler(), "pipeline_wait", -1);
    std::vector<char> msg = recv_bytes(world_, last, kTagBack);
    wait.reset();
    stats_.idle_s += since(t);  // waiting for the pipeline: the bubble
    Reader rd(msg);
    s.sched.apply(get_backs(rd));
    s.inflight[size_t(g)] = s.inflight_rows[size_t(g)] = false;
  };

  for (int64_t tick = 0;; ++tick) {
    const int g = int(tick % G);
    if (P > 1 && s.inflight[size_t(g)]) receive(g);  // this group's previous step came back
    if (!exchange(s)) break;
    ++stats_.ticks;
    std::vector<int32_t> tokens;
    Step step = s.sched.next_step(g, tokens);
    // Run the step on this stage (possibly empty: the stage's MoE exchanges still pair up).
    const int64_t m = step.rows();
    stats_.max_step_rows = std::max(stats_.max_step_rows, m);
    if (trace_)
      std::fprintf(stderr, "[trace] rank %d tick %lld group %d rows %lld\n", world_.rank(), (long long)tick, g,
                   (long long)m);
    auto tc = Clock::now();
    std::vector<SeqStep> batch = table.enter(step);
    float* h = static_cast<float*>(be.alloc(size_t(std::max<int64_t>(m, 1) * H) * sizeof(float)));
    if (m > 0) model_.embed(tokens.data(), m, h);
    const TopkCarry topk(model_, batch, model_.gives_topk());
    model_.forward(batch, h, topk.p);
    stats_.compute_s += since(tc);
    if (P == 1) {
      tc = Clock::now();
      std::vector<Back> backs = finish_step(model_, step, h, table, world_.rank(), opt_.speculative_tokens);
      stats_.compute_s += since(tc);
      be.free(h);
      s.sched.apply(backs);
      continue;
    }
    Writer sw;
    put_step(sw, step);
    auto ts = Clock::now();
    std::optional<Profiler::Scope> send(std::in_place, model_.profiler(), "pipeline_send", -1);
    stats_.bytes_sent += sw.b.size() + size_t(m * H) * sizeof(float);
    s.out.send_bytes(world_, next, kTagStep, std::move(sw.b));
    s.out.send_hidden(*hidden_, be, h, m * H, next);
    if (topk.n > 0) s.out.send_hidden(*hidden_, be, reinterpret_cast<float*>(topk.p), topk.n, next);  // (same size)
    stats_.bytes_sent += size_t(topk.n) * sizeof(int32_t);
    send.reset();
    stats_.comm_s += since(ts);
    s.inflight[size_t(g)] = true;
    s.inflight_rows[size_t(g)] = m > 0;
  }
  if (P > 1) {
    for (int i = 0; i < G; ++i)  // drain the empty steps still in the pipeline
      if (s.inflight[size_t(i)]) receive(i);
    Step stop;
    stop.stop = true;
    Writer sw;
    put_step(sw, stop);
    s.out.send_bytes(world_, next, kTagStep, std::move(sw.b));
  }
  s.out.drain();
  copy_counters(s.sched, stats_);
}

void Engine::run_later_stage() {
  const ModelConfig& cfg = model_.config();
  const int P = grid_.stages, col = stats_.column, stage = stats_.stage;
  const int prev = grid_.rank_of(stage - 1, col), first = grid_.rank_of(0, col);
  const int next = stage + 1 < P ? grid_.rank_of(stage + 1, col) : -1;
  const int64_t H = cfg.hidden_size;
  kernels::Backend& be = model_.backend();
  SeqTable table(kv_blocks_);
  Outbox out;
  for (;;) {
    auto t = Clock::now();
    std::optional<Profiler::Scope> span(std::in_place, model_.profiler(), "pipeline_wait", -1);
    std::vector<char> msg = recv_bytes(world_, prev, kTagStep);
    span.emplace(model_.profiler(), "pipeline_recv", -1);  // the step's hidden states
    stats_.idle_s += since(t);                             // waiting for the previous stage: the bubble
    t = Clock::now();
    Reader rd(msg);
    Step step = get_step(rd);
    const int64_t m = step.rows();
    stats_.max_step_rows = std::max(stats_.max_step_rows, m);
    float* h = static_cast<float*>(be.alloc(size_t(std::max<int64_t>(m, 1) * H) * sizeof(float)));
    recv_hidden(*hidden_, h, m * H, prev);
    span.reset();
    stats_.comm_s += since(t);
    if (trace_)
      std::fprintf(stderr, "[trace] rank %d got step rows %lld stop %d\n", world_.rank(), (long long)m, int(step.stop));
    if (step.stop) {
      be.free(h);
      if (next >= 0) out.send_bytes(world_, next, kTagStep, std::move(msg));
      break;
    }
    ++stats_.ticks;
    std::vector<SeqStep> batch = table.enter(step);
    // The top-k a "shared" first layer needs came after the hidden states; the same buffer carries
    // this stage's on when the next stage needs it.
    const TopkCarry topk(model_, batch, model_.takes_topk() || model_.gives_topk());
    if (model_.takes_topk() && topk.n > 0) {
      const auto tr = Clock::now();
      Profiler::Scope recv(model_.profiler(), "pipeline_recv", -1);
      recv_hidden(*hidden_, reinterpret_cast<float*>(topk.p), topk.n, prev);
      stats_.comm_s += since(tr);
    }
    auto tc = Clock::now();
    model_.forward(batch, h, topk.p);
    stats_.compute_s += since(tc);
    if (next >= 0) {
      auto ts = Clock::now();
      Profiler::Scope send(model_.profiler(), "pipeline_send", -1);
      stats_.bytes_sent += msg.size() + size_t(m * H) * sizeof(float);
      out.send_bytes(world_, next, kTagStep, std::move(msg));
      out.send_hidden(*hidden_, be, h, m * H, next);
      if (model_.gives_topk() && topk.n > 0) {
        out.send_hidden(*hidden_, be, reinterpret_cast<float*>(topk.p), topk.n, next);
        stats_.bytes_sent += size_t(topk.n) * sizeof(int32_t);
      } else if (topk.p) {
        be.free(topk.p);
      }
      stats_.comm_s += since(ts);
      continue;
    }
    if (topk.p) be.free(topk.p);
    tc = Clock::now();
    std::vector<Back> backs = finish_step(model_, step, h, table, world_.rank(), opt_.speculative_tokens);
    be.free(h);
    stats_.compute_s += since(tc);
    for (auto& b : backs) stats_.tokens_generated += int64_t(b.tokens.size());
    Writer bw;
    put_backs(bw, backs);
    auto ts = Clock::now();
    Profiler::Scope send(model_.profiler(), "pipeline_send", -1);  // the sampled tokens, back to stage 0
    stats_.bytes_sent += bw.b.size();
    out.send_bytes(world_, first, kTagBack, std::move(bw.b));
    stats_.comm_s += since(ts);
  }
  out.drain();
}

}  // namespace glm5::runtime
