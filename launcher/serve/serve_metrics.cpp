// Server metrics in the Prometheus text format.
#include "launcher/serve/serve_metrics.h"

#include <algorithm>
#include <cstdio>

namespace glm5::launcher {

namespace {

std::string num(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", x);
  return b;
}

void family(std::string& o, const std::string& name, const char* type, const std::string& help) {
  o += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// Latency buckets from 1 ms to 60 s: a CPU test model answers in milliseconds, a cluster in seconds.
std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double x) {
  std::lock_guard<std::mutex> lk(mu_);
  const size_t b = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), x) - bounds_.begin());
  ++counts_[b];
  sum_ += x;
  ++count_;
}

void Histogram::write(std::string& o, const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lk(mu_);
  family(o, name, "histogram", help);
  int64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    o += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  o += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  o += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

ServeMetrics::ServeMetrics() : ttft(latency_bounds()), itl(latency_bounds()), e2e(latency_bounds()) {}

void ServeMetrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lk(mu_);
  ++requests_[{endpoint, status}];
}

std::string ServeMetrics::text() const {
  std::string o;
  family(o, "glm5_serve_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [key, n] : requests_)
      o += "glm5_serve_requests_total{endpoint=\"" + key.first + "\",code=\"" + std::to_string(key.second) + "\"} " +
           std::to_string(n) + "\n";
  }
  const std::pair<const char*, const std::atomic<int64_t>*> counters[] = {
      {"glm5_serve_prompt_tokens_total", &prompt_tokens},
      {"glm5_serve_generation_tokens_total", &generation_tokens},
      {"glm5_serve_cancelled_total", &cancelled},
      {"glm5_serve_engine_ticks_total", &engine_ticks}};
  const char* counter_help[] = {"Prompt tokens of the requests run.", "Tokens generated for the requests.",
                                "Requests ended early (client gone, or the drain timed out).",
                                "Engine ticks on rank 0 (an idle engine backs off to about one per 50 ms)."};
  for (size_t i = 0; i < 4; ++i) {
    family(o, counters[i].first, "counter", counter_help[i]);
    o += std::string(counters[i].first) + " " + std::to_string(counters[i].second->load()) + "\n";
  }
  const std::pair<const char*, const std::atomic<int64_t>*> gauges[] = {
      {"glm5_serve_queue_depth", &queue_depth},
      {"glm5_serve_requests_running", &running},
      {"glm5_serve_kv_blocks_in_use", &kv_blocks_used},
      {"glm5_serve_kv_blocks", &kv_blocks}};
  const char* gauge_help[] = {"Requests accepted and waiting for the engine to take them.",
                              "Requests the engine holds (running or waiting in a column).",
                              "KV cache blocks in use, over all columns.", "KV cache blocks of all columns."};
  for (size_t i = 0; i < 4; ++i) {
    family(o, gauges[i].first, "gauge", gauge_help[i]);
    o += std::string(gauges[i].first) + " " + std::to_string(gauges[i].second->load()) + "\n";
  }
  ttft.write(o, "glm5_serve_time_to_first_token_seconds", "From the request read to its first token on rank 0.");
  itl.write(o, "glm5_serve_inter_token_latency_seconds", "Between consecutive tokens of a request on rank 0.");
  e2e.write(o, "glm5_serve_e2e_request_latency_seconds", "From the request read to its last token on rank 0.");
  return o;
}

}  // namespace glm5::launcher
