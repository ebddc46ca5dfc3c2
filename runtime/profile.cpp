// Profiler: see profile.h.
#include "runtime/profile.h"

#include <algorithm>
#include <cstdio>
#include <exception>

namespace glm5::runtime {

Profiler::Profiler(kernels::Backend& backend, bool trace, size_t max_events)
    : be_(backend), trace_(trace), max_events_(max_events) {}

void Profiler::restart() {
  start_ = std::chrono::steady_clock::now();
  totals_.clear();
  events_.clear();
  dropped_ = 0;
}

Profiler::Scope::Scope(Profiler* p, const char* phase, int layer) : p_(p), phase_(phase), layer_(layer) {
  if (!p_) return;
  if (!p_->be_.host_memory()) p_->be_.synchronize();  // earlier work is not this phase's
  t0_ = p_->now();
}

Profiler::Scope::~Scope() {
  if (!p_ || std::uncaught_exceptions() > 0) return;  // unwinding: no device calls, nothing to record
  if (!p_->be_.host_memory()) p_->be_.synchronize();
  p_->record(phase_, layer_, t0_, p_->now());
}

void Profiler::record(const char* phase, int layer, double t0, double t1) {
  Total& t = totals_[{layer, phase}];
  t.seconds += t1 - t0;
  ++t.calls;
  if (!trace_) return;
  if (events_.size() < max_events_)
    events_.push_back({phase, layer, t0, t1});
  else
    ++dropped_;
}

nlohmann::json Profiler::totals() const {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [key, t] : totals_)
    out.push_back({{"phase", key.second}, {"layer", key.first}, {"seconds", t.seconds}, {"calls", t.calls}});
  return out;
}

std::string Profiler::trace_text(int rank) const {
  std::string out;
  out.reserve(events_.size() * 110);
  char buf[256];
  for (const Event& e : events_) {
    const int n = e.layer >= 0
                      ? std::snprintf(buf, sizeof buf,
                                      "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,"
                                      "\"args\":{\"layer\":%d}}",
                                      out.empty() ? "" : ",", e.phase, rank, e.t0 * 1e6, (e.t1 - e.t0) * 1e6, e.layer)
                      : std::snprintf(buf, sizeof buf,
                                      "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f}",
                                      out.empty() ? "" : ",", e.phase, rank, e.t0 * 1e6, (e.t1 - e.t0) * 1e6);
    out.append(buf, size_t(std::min(n, int(sizeof buf) - 1)));
  }
  return out;
}

}  // namespace glm5::runtime
