// Profiler: see profile.h.
#include "runtime/profile.h"

namespace glm5::runtime {

Profiler::Profiler(kernels::Backend& backend, bool trace, size_t max_events)
    : be_(backend), trace_(trace), max_events_(max_events) {}

Profiler::Scope::Scope(Profiler* p, const char* phase, int layer) : p_(p), phase_(phase), layer_(layer) {
  if (!p_) return;
  if (!p_->be_.host_memory()) p_->be_.synchronize();  // earlier work is not this phase's
  t0_ = p_->now();
}

Profiler::Scope::~Scope() {
  if (!p_) return;
  if (!p_->be_.host_memory()) p_->be_.synchronize();
  p_->record(phase_, layer_, t0_, p_->now());
}

void Profiler::record(const char* phase, int layer, double t0, double t1) {
  Total& t = totals_[{layer, phase}];
  t.seconds += t1 - t0;
  ++t.calls;
  if (!trace_) return;
  if (events_.size() < max_events_) events_.push_back({phase, layer, t0, t1});
  else ++dropped_;
}

nlohmann::json Profiler::totals() const {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [key, t] : totals_)
    out.push_back({{"phase", key.second}, {"layer", key.first}, {"seconds", t.seconds}, {"calls", t.calls}});
  return out;
}

nlohmann::json Profiler::trace_events(int rank) const {
  nlohmann::json out = nlohmann::json::array();
  for (const Event& e : events_) {
    nlohmann::json ev = {{"name", e.phase}, {"ph", "X"}, {"pid", rank}, {"tid", 0},
                         {"ts", e.t0 * 1e6}, {"dur", (e.t1 - e.t0) * 1e6}};
    if (e.layer >= 0) ev["args"] = {{"layer", e.layer}};
    out.push_back(std::move(ev));
  }
  return out;
}

}  // namespace glm5::runtime
