// Engine: executes the scheduler's steps and moves their bytes. Per tick (one micro-batch step of
// one column):
//   stage 0 --step+hidden(+top-k)--> stage 1 --> ... --> stage P-1 --tokens(+logits)--> stage 0
// (the top-k follows the hidden states when the next stage begins with a GLM-5.2 "shared" layer)
// Every message is (int64 size, payload) on the world communicator between ranks of a column,
// sent with isend (see engine.h: why that cannot deadlock). Between ticks the stage-0 ranks
// share their state (all_gather over the stage), send finished results to world rank 0, and
// rank 0 hands out new requests (two broadcasts over the stage).
#include "runtime/engine/engine.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>

#include "kernels/core/check.h"
#include "parallel/device_comm.h"
#include "runtime/engine/distributor.h"
#include "runtime/engine/last_stage.h"
#include "runtime/engine/outbox.h"
#include "runtime/engine/seq_table.h"
#include "runtime/engine/wire.h"
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
using wire::Reader, wire::Writer, wire::recv_bytes;

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
  std::vector<bool> inflight;              // per group: a step awaits its results
  std::vector<bool> inflight_rows;         // ... and it had rows
  int64_t done = 0, total = -1;            // progress (rank 0)
  std::chrono::milliseconds idle_wait{2};  // rank 0's wait when it has no work
  Distributor distributor;                 // rank 0: which column takes a request
  Clock::time_point t_start = Clock::now(), t_progress = Clock::now();
  Stage0(const ModelConfig& cfg, const SchedulerOptions& so, const Tokenizer* tok, int G, int E)
      : sched(cfg, so, tok),
        inflight(size_t(G), false),
        inflight_rows(size_t(G), false),
        distributor(E, so.prefix_sharing) {}
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

// A stage-0 rank's column between ticks, as the stage's stage-0 ranks share it (all_gather).
struct Engine::ColumnState {
  int64_t work;           // running, waiting, results to deliver, steps in flight
  int64_t load;           // tokens in flight (Scheduler::load)
  int64_t free_slots;     // sequences it can still take
  int64_t result_bytes;   // its partial tokens and results, one message to column 0
  int64_t results;        // finished results in that message
  int64_t partials;       // streams' partial tokens in that message (before the results)
  int64_t blocks_in_use;  // KV blocks
};

// What world rank 0 decides between ticks, for every column of the stage.
struct Engine::Handout {
  std::vector<std::vector<Request>> assigned;  // [E] new requests per column
  std::vector<int64_t> cancelled;              // request indexes (a column holds them or ignores them)
  bool stop = false;                           // the run is over
};

// Between ticks on the stage-0 ranks: results go to world rank 0, which hands out new requests
// (to the least-loaded columns with room) and decides when the run is over. False: over.
bool Engine::exchange(Stage0& s) {
  const int E = grid_.expert_parallel, col = stats_.column;
  std::vector<Result> finished = s.sched.take_finished();
  std::vector<std::pair<int64_t, std::vector<int32_t>>> partial = s.sched.take_partial();
  Writer res;
  for (auto& [index, tokens] : partial) {
    res.put(index);
    res.put_vec(tokens);
  }
  for (auto& r : finished) wire::put_result(res, r);
  const ColumnState mine{s.sched.work() + s.steps_in_flight() + int64_t(finished.size()),
                         s.sched.load(),
                         s.sched.free_slots(),
                         int64_t(res.b.size()),
                         int64_t(finished.size()),
                         int64_t(partial.size()),
                         s.sched.blocks_in_use()};
  std::vector<ColumnState> cols(size_t(E), mine);
  auto t = Clock::now();
  if (E > 1) stage_comm_.all_gather(&mine, sizeof mine, cols.data());
  Handout h;
  h.assigned.resize(size_t(E));
  if (col == 0) {
    // A column's partial tokens go out before its results (a stream's last tokens may be in both).
    for (auto& [index, tokens] : partial) s.source->on_tokens(index, tokens);
    for (auto& r : finished) deliver(s, std::move(r));
    receive_results(s, cols);
    hand_out(s, cols, h);
  } else if (!res.b.empty()) {
    s.out.send_bytes(stage_comm_, 0, kTagResults, std::move(res.b));
  }
  if (E > 1) share_handout(h);
  for (int64_t index : h.cancelled) s.sched.cancel(index);  // a column holds it or ignores it
  for (auto& r : h.assigned[size_t(col)]) s.sched.add(std::move(r));
  // Live counters (a server's /metrics reads them between steps; a batch job at the end).
  copy_counters(s.sched, stats_);
  stats_.comm_s += since(t);
  return !h.stop;
}

void Engine::deliver(Stage0& s, Result&& r) {
  ++s.done;
  (*s.on_result)(std::move(r));
}

// Column 0: the other columns' partial tokens and results, in column order.
void Engine::receive_results(Stage0& s, const std::vector<ColumnState>& cols) {
  for (size_t c = 1; c < cols.size(); ++c) {
    if (cols[c].result_bytes == 0) continue;
    std::vector<char> b = recv_bytes(stage_comm_, int(c), kTagResults);
    Reader rd(b);
    for (int64_t i = 0; i < cols[c].partials; ++i) {
      const int64_t index = rd.get<int64_t>();
      s.source->on_tokens(index, rd.get_vec<int32_t>());
    }
    for (int64_t i = 0; i < cols[c].results; ++i) deliver(s, wire::get_result(rd));
  }
}

// World rank 0: the status to the source, its cancellations, new requests for the columns with
// room (a request the scheduler refuses gets its error result at once), and the end of the run.
void Engine::hand_out(Stage0& s, const std::vector<ColumnState>& cols, Handout& h) {
  int64_t work = 0, room = 0;
  std::vector<int64_t> load, free;
  EngineStatus status;
  for (const ColumnState& c : cols) {
    work += c.work;
    load.push_back(c.load);
    free.push_back(c.free_slots);
    room += c.free_slots;
    status.kv_blocks_used += c.blocks_in_use;
  }
  status.work = work;
  status.kv_blocks = kv_blocks_ * int64_t(cols.size());
  s.source->on_status(status);
  h.cancelled = s.source->take_cancelled();
  int64_t handed = 0;
  while (room > 0) {
    std::optional<Request> r = s.source->next();
    if (!r) break;
    if (std::string why = s.sched.refuse_reason(*r); !why.empty()) {
      Result err;
      err.index = r->index;
      err.finish_reason = "error";
      err.error = why;
      deliver(s, std::move(err));
      continue;
    }
    const int c = s.distributor.pick(*r, load, free);
    --room;
    ++handed;
    h.assigned[size_t(c)].push_back(std::move(*r));
  }
  h.stop = work == 0 && handed == 0 && s.source->exhausted();
  // An idle server waits for requests instead of spinning: every tick is collectives on every
  // rank, so the wait doubles up to 50 ms while idle (a source wakes at once when work comes)
  // and is back at 2 ms as soon as there is work.
  if (work == 0 && handed == 0 && !h.stop) {
    s.source->wait_for_work(s.idle_wait);
    s.idle_wait = std::min(s.idle_wait * 2, std::chrono::milliseconds(50));
  } else {
    s.idle_wait = std::chrono::milliseconds(2);
  }
  if (s.total < 0) s.total = s.source->size_hint();
  show_progress(s, h.stop);
}

// Column 0's handout to every column of the stage: the stop flag and the message's size, then the
// assignments and the cancellations (two broadcasts).
void Engine::share_handout(Handout& h) {
  const int E = grid_.expert_parallel, col = stats_.column;
  Writer w;
  if (col == 0) {
    for (int c = 0; c < E; ++c) {
      w.put<int64_t>(int64_t(h.assigned[size_t(c)].size()));
      for (auto& r : h.assigned[size_t(c)]) wire::put_request(w, r);
    }
    w.put_vec(h.cancelled);
  }
  int64_t head[2] = {h.stop, int64_t(w.b.size())};
  stage_comm_.broadcast(head, sizeof head, 0);
  h.stop = head[0] != 0;
  w.b.resize(size_t(head[1]));
  if (head[1]) stage_comm_.broadcast(w.b.data(), w.b.size(), 0);
  if (col == 0) return;
  Reader rd(w.b);
  for (int c = 0; c < E; ++c) {
    const int64_t n = rd.get<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      Request r = wire::get_request(rd);
      if (c == col) h.assigned[size_t(c)].push_back(std::move(r));
    }
  }
  h.cancelled = rd.get_vec<int64_t>();
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
  so.policy() = opt_.policy();
  so.micro_batches = G;
  so.kv_blocks = kv_blocks_;
  Stage0 s(cfg, so, opt_.tokenizer, G, grid_.expert_parallel);
  s.source = source;
  s.on_result = &on_result;
  SeqTable table(kv_blocks_);
  auto receive = [&](int g) { receive_back(s, g, last); };

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
    wire::put_step(sw, step);
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
    wire::put_step(sw, stop);
    s.out.send_bytes(world_, next, kTagStep, std::move(sw.b));
  }
  s.out.drain();
  copy_counters(s.sched, stats_);
}

// What the last stage (world rank `last`) returned for group g's step in flight.
void Engine::receive_back(Stage0& s, int g, int last) {
  auto t = Clock::now();
  std::optional<Profiler::Scope> wait(std::in_place, model_.profiler(), "pipeline_wait", -1);
  std::vector<char> msg = recv_bytes(world_, last, kTagBack);
  wait.reset();
  stats_.idle_s += since(t);  // waiting for the pipeline: the bubble
  Reader rd(msg);
  s.sched.apply(wire::get_backs(rd));
  s.inflight[size_t(g)] = s.inflight_rows[size_t(g)] = false;
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
    Step step = wire::get_step(rd);
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
    wire::put_backs(bw, backs);
    auto ts = Clock::now();
    Profiler::Scope send(model_.profiler(), "pipeline_send", -1);  // the sampled tokens, back to stage 0
    stats_.bytes_sent += bw.b.size();
    out.send_bytes(world_, first, kTagBack, std::move(bw.b));
    stats_.comm_s += since(ts);
  }
  out.drain();
}

}  // namespace glm5::runtime