// The execution engine: runs requests over the process grid (P pipeline stages x E
// expert-parallel columns) with continuous batching, chunked prefill and micro-batches in flight.
//
// World rank 0 pulls requests from a RequestSource as the columns have room (a bounded window:
// a million-line input is never held whole) and hands each to the least-loaded column. A column's
// stage-0 rank schedules its requests (runtime/scheduler.h) and sends each micro-batch's step
// (which sequences, which positions, and the requests new to the column) with the hidden states
// down its column; the last stage samples and sends token ids (and logits on request) back to
// stage 0. Stage-0 ranks tick in lockstep (one small all_gather per tick) so the MoE exchanges of
// a stage always pair up, and finished results flow to world rank 0. A server's streaming requests
// ride the same exchange: their new tokens travel with the results, cancellations with the
// assignments, so streaming adds no message of its own.
//
// Deadlock freedom: every pipeline message goes out with a nonblocking send whose buffer the
// engine keeps until it completes, so a rank only ever blocks in a receive or a collective, and
// each of those is matched by a send that was already started (by induction over the ticks).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "parallel/comm.h"
#include "parallel/grid.h"
#include "runtime/batch_limits.h"
#include "runtime/model.h"
#include "runtime/request.h"
#include "runtime/sampler.h"

namespace glm5::runtime {

// What world rank 0 knows of the whole grid after each tick (a server's gauges).
struct EngineStatus {
  int64_t work = 0;            // requests running or waiting in the columns
  int64_t kv_blocks_used = 0;  // KV blocks in use, summed over the columns
  int64_t kv_blocks = 0;       // KV blocks of all columns' pools
};

// Where requests come from, on world rank 0 (other ranks pass none). Called between steps: next()
// must not block for long (a server returns nullopt when its queue is empty). The streaming hooks
// (on_tokens, take_cancelled, on_status) are called on rank 0 between steps too, on the engine's
// thread; a batch job leaves them as they are.
class RequestSource {
 public:
  virtual ~RequestSource() = default;
  // The next request to run, or nullopt when none is ready now. Request::index must be unique
  // among the requests in flight: results carry it back.
  virtual std::optional<Request> next() = 0;
  // True once next() will never return a request again (the run ends when all work is done).
  virtual bool exhausted() = 0;
  // Number of requests in all, when known (progress line), else -1.
  virtual int64_t size_hint() const { return -1; }
  // Tokens a `stream` request sampled since the last call (each token exactly once, in order, and
  // all of them before its Result). Its Result still carries every token.
  virtual void on_tokens(int64_t /*index*/, const std::vector<int32_t>& /*tokens*/) {}
  // Requests (indexes next() gave) to end early, e.g. their client went away. Each still gets its
  // one Result, finish_reason "cancelled", once its sequence is freed: at its micro-batch's next
  // step (a step in flight comes back first). Unknown or finished indexes are ignored.
  virtual std::vector<int64_t> take_cancelled() { return {}; }
  virtual void on_status(const EngineStatus& /*status*/) {}
  // Rank 0 has no work and next() gave none: wait up to `most` (the engine backs off from 2 ms
  // to 50 ms while idle). A source that can tell when work arrives returns at once then.
  virtual void wait_for_work(std::chrono::milliseconds most) { std::this_thread::sleep_for(most); }
};

class Tokenizer;

// The policy's speculative_tokens > 0 needs the MTP layer in the last stage's Model.
struct EngineOptions : SchedulingPolicy {
  double kv_budget_bytes = 0;            // per rank: sizes the paged KV pool; 0 = max_batch full contexts
  size_t kv_bytes_per_token = 0;         // of the stage whose position costs most (budget accounting); 0 = this rank's
  bool progress = false;                 // progress line on stderr of rank 0
  const Tokenizer* tokenizer = nullptr;  // for stop strings (stage-0 ranks)
  DType kv_dtype = DType::F32;           // KV cache elements: F32 (default: the goldens) or BF16 (half the bytes)
};

// Per-rank counters for the run report.
struct EngineStats {
  int rank = 0, stage = 0, column = 0;
  // compute: kernels; comm: sending, collectives, MoE exchange, and receiving payloads that had
  // arrived; idle: waiting for the neighbouring stage's next message (pipeline bubble).
  double wall_s = 0, compute_s = 0, comm_s = 0, idle_s = 0;
  size_t bytes_sent = 0;
  int64_t tokens_generated = 0, prompt_tokens = 0, ticks = 0;
  int64_t max_step_rows = 0;                  // largest step this rank forwarded (rows of one micro-batch)
  int64_t kv_blocks = 0, kv_blocks_peak = 0;  // pool size and most blocks in use (stage 0)
  int64_t preemptions = 0;                    // sequences preempted (blocks freed, recomputed later)
  int64_t prefix_hit_tokens = 0;              // prompt positions taken from shared blocks instead of computed
  // Speculative decoding (stage 0): verify steps, drafts fed, drafts accepted, per draft position.
  int64_t spec_steps = 0, spec_drafted = 0, spec_accepted = 0;
  std::vector<int64_t> spec_accepted_at;
  std::vector<int64_t> expert_tokens;  // per local expert, summed over this rank's MoE layers
  long peak_rss_kb = 0;
};

class Engine {
 public:
  // world: all ranks; stage_comm: the E ranks of this rank's stage (world ranks of a stage
  // in column order). hidden_comm: the world's ranks in order, for the hidden states between
  // stages in the backend's memory (NCCL or a stand-in for device backends); nullptr: the world
  // itself for host backends, a communicator staging through host memory for device ones.
  Engine(Model& model, parallel::Comm& world, parallel::Comm& stage_comm, const parallel::Grid& grid,
         const EngineOptions& opt, parallel::Comm* hidden_comm = nullptr);

  // Collective over the world. On world rank 0, `source` gives the work (other ranks pass
  // nullptr) and on_result is called for each result as soon as it is final (any order).
  void run(RequestSource* source, const std::function<void(Result&&)>& on_result);
  // The same over a list (rank 0's list is the work); results carry the requests' own index.
  void run(const std::vector<Request>& requests, const std::function<void(Result&&)>& on_result);

  const EngineStats& stats() const { return stats_; }
  const parallel::Comm& hidden_comm() const { return *hidden_; }
  void set_tokenizer(const Tokenizer* tok) { opt_.tokenizer = tok; }

 private:
  struct Stage0;
  struct ColumnState;
  struct Handout;
  void run_stage0(RequestSource* source, const std::function<void(Result&&)>& on_result);
  bool exchange(Stage0& s);
  void deliver(Stage0& s, Result&& r);
  void receive_results(Stage0& s, const std::vector<ColumnState>& cols);
  void hand_out(Stage0& s, const std::vector<ColumnState>& cols, Handout& h);
  void share_handout(Handout& h);
  void receive_back(Stage0& s, int g, int last);
  void show_progress(Stage0& s, bool end);
  void run_later_stage();

  Model& model_;
  parallel::Comm& world_;
  parallel::Comm& stage_comm_;
  std::unique_ptr<parallel::Comm> staged_hidden_;  // made when a device backend gets no hidden_comm
  parallel::Comm* hidden_ = nullptr;               // hidden states between stages
  parallel::Grid grid_;
  EngineOptions opt_;
  EngineStats stats_;
  bool trace_ = false;     // GLM5_TRACE set: one line per tick on stderr
  int64_t kv_blocks_ = 0;  // KV pool blocks per rank in this run
};

long peak_rss_kb();

}  // namespace glm5::runtime
