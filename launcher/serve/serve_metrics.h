// The server's Prometheus metrics: requests by endpoint and status, prompt and generated tokens,
// queue depth, running requests, KV blocks in use, and histograms of time to first token,
// inter-token latency and end-to-end latency. Thread-safe (HTTP threads and the engine thread both
// record). The engine's own per-rank counters come from moe_monitor's prometheus_text.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace glm5::launcher {

// A cumulative histogram (Prometheus buckets: counts of observations <= each bound, then +Inf).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double x);
  void write(std::string& out, const std::string& name, const std::string& help) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket (not cumulative), +Inf last
  double sum_ = 0;
  int64_t count_ = 0;
};

struct ServeMetrics {
  ServeMetrics();
  void count_request(const std::string& endpoint, int status);
  std::string text() const;  // the server's families, exposition format 0.0.4

  std::atomic<int64_t> prompt_tokens{0}, generation_tokens{0}, cancelled{0}, engine_ticks{0};
  std::atomic<int64_t> queue_depth{0}, running{0}, kv_blocks_used{0}, kv_blocks{0};
  Histogram ttft, itl, e2e;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
};

}  // namespace glm5::launcher
