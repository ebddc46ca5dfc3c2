// The bridge between the HTTP threads and the engine thread of `glm5 serve` (world rank 0): a
// bounded queue of accepted requests that the engine takes between steps (runtime::RequestSource),
// the clients that wait for each request's tokens and result, cancellations, and the drain.
// Only the engine thread touches the engine; HTTP threads only lock this queue's mutex, which the
// engine thread holds for a few map operations per tick, never across a step.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "launcher/serve/serve_metrics.h"
#include "runtime/engine/engine.h"

namespace glm5::launcher {

using ServeClock = std::chrono::steady_clock;

// What waits for a request's choices. Called on the engine thread (or, for a request cancelled
// before the engine took it, on the canceller's): it must only hand the data to its own thread.
class EngineClient {
 public:
  virtual ~EngineClient() = default;
  virtual void tokens(int choice, std::vector<int32_t> tokens, ServeClock::time_point at) = 0;
  virtual void result(int choice, runtime::Result r) = 0;
};

class ServeQueue final : public runtime::RequestSource {
 public:
  ServeQueue(size_t max_queue, ServeMetrics& metrics) : max_queue_(max_queue), metrics_(metrics) {}

  enum class Admit { ok, full, draining };
  // Queues the choices of one request for `client` (their Request::index is set here, and written
  // to `indexes`, choice order). full: more than max_queue choices would wait for the engine.
  Admit submit(std::vector<runtime::Request> choices, std::shared_ptr<EngineClient> client,
               std::vector<int64_t>& indexes);
  // Ends these requests early (any thread): a queued one at once, a running one at its next step.
  void cancel(const std::vector<int64_t>& indexes);
  // No new requests from now on; the engine stops once the accepted ones are answered.
  void drain();
  // Cancels everything accepted (the drain timed out).
  void cancel_all();
  bool draining() const;
  size_t max_queue() const { return max_queue_; }
  // Most tokens (prompt + generated + 1) one sequence's KV cache can hold, as the engine said at
  // its last tick (0 before the first one).
  int64_t sequence_tokens() const { return sequence_tokens_.load(); }
  // Rank 0's engine counters (moe_monitor's exposition), as of the last snapshot (twice a second).
  void set_engine(const runtime::Engine* engine) { engine_ = engine; }
  std::string engine_metrics() const;

  // runtime::RequestSource, on the engine thread.
  std::optional<runtime::Request> next() override;
  bool exhausted() override;
  void on_tokens(int64_t index, const std::vector<int32_t>& tokens) override;
  std::vector<int64_t> take_cancelled() override;
  void on_status(const runtime::EngineStatus& status) override;
  void wait_for_work(std::chrono::milliseconds most) override;
  // The engine's on_result.
  void deliver(runtime::Result&& r);

 private:
  struct Waiter {
    std::shared_ptr<EngineClient> client;
    int choice = 0;
    bool taken = false;  // the engine has it (else it is still in pending_)
  };
  std::shared_ptr<EngineClient> find(int64_t index, int& choice);

  const size_t max_queue_;
  ServeMetrics& metrics_;
  mutable std::mutex mu_;
  std::condition_variable work_;          // a submit, a cancel or the drain wakes an idle engine
  std::deque<runtime::Request> pending_;  // accepted choices, not yet taken by the engine
  std::map<int64_t, Waiter> waiters_;     // by Request::index, until its result
  std::vector<int64_t> cancels_;          // for the engine's next tick
  int64_t next_index_ = 0;
  bool draining_ = false;
  const runtime::Engine* engine_ = nullptr;
  std::atomic<int64_t> sequence_tokens_{0};
  ServeClock::time_point snapshot_at_{};
  std::string engine_text_;
};

}  // namespace glm5::launcher
