// Wall time per phase of the forward pass and per layer on one rank (`glm5 batch --profile`), and
// optionally every phase call as a trace event (`--trace FILE`: Chrome trace format, one track per
// rank, opens in Perfetto). A phase is what runs together: e.g. "projections" is the batch of
// gemms on a layer's normalised input (q_a, kv_a and the indexer's wk / weights_proj, then q_b and
// wq_b) with their norms and RoPE. A device backend is synchronized at both ends of a phase, so
// that its time is its kernels' (which costs overlap on GPUs: profile runs are for looking).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/ops.h"

namespace glm5::runtime {

class Profiler {
 public:
  // trace: keep every phase call (at most max_events, ~100 bytes each as text; later ones are
  // counted, not kept).
  Profiler(kernels::Backend& backend, bool trace, size_t max_events = size_t(1) << 19);
  // Starts the clock again and forgets what was recorded: called once every rank is ready, so
  // that all ranks' traces share a time axis (loading takes different times).
  void restart();

  class Scope {
   public:
    Scope() = default;
    Scope(Profiler* p, const char* phase, int layer);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Profiler* p_ = nullptr;
    const char* phase_ = nullptr;
    int layer_ = -1;
    double t0_ = 0;
  };

  // [{"phase", "layer" (-1: none), "seconds", "calls"}], by layer then phase.
  nlohmann::json totals() const;
  // Chrome trace "X" events of this rank (pid = rank), microseconds since the profiler started,
  // as JSON objects joined by commas (the text goes straight into the trace file).
  std::string trace_text(int rank) const;
  size_t dropped_events() const { return dropped_; }

 private:
  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  void record(const char* phase, int layer, double t0, double t1);

  struct Total {
    double seconds = 0;
    int64_t calls = 0;
  };
  struct Event {
    const char* phase;
    int layer;
    double t0, t1;
  };
  kernels::Backend& be_;
  bool trace_;
  size_t max_events_, dropped_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::map<std::pair<int, std::string>, Total> totals_;  // (layer, phase)
  std::vector<Event> events_;
};

}  // namespace glm5::runtime
