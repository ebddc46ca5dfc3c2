// The serve queue: accepted requests in, tokens and results out, cancellations and the drain.
#include "launcher/serve/serve_queue.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <tuple>
#include <unordered_set>

#include "launcher/report/moe_monitor.h"
#include "runtime/kv_cache.h"

namespace glm5::launcher {

ServeQueue::Admit ServeQueue::submit(std::vector<runtime::Request> choices, std::shared_ptr<EngineClient> client,
                                     std::vector<int64_t>& indexes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (draining_) return Admit::draining;
  if (pending_.size() + choices.size() > max_queue_) return Admit::full;
  indexes.clear();
  for (size_t j = 0; j < choices.size(); ++j) {
    runtime::Request& r = choices[j];
    r.index = next_index_++;
    indexes.push_back(r.index);
    waiters_[r.index] = {client, int(j), false};
    pending_.push_back(std::move(r));
  }
  metrics_.queue_depth = int64_t(pending_.size());
  work_.notify_all();
  return Admit::ok;
}

// The engine thread takes this mutex every tick: one pass over the queue for all the indexes
// (cancel_all of a full queue stays linear).
void ServeQueue::cancel(const std::vector<int64_t>& indexes) {
  std::vector<std::tuple<std::shared_ptr<EngineClient>, int, runtime::Result>> now;
  {
    std::lock_guard<std::mutex> lk(mu_);
    std::unordered_set<int64_t> queued;
    for (int64_t index : indexes) {
      auto w = waiters_.find(index);
      if (w == waiters_.end()) continue;  // answered already
      if (w->second.taken) {
        cancels_.push_back(index);  // the engine ends it and sends its result
        continue;
      }
      // Still queued: it never reaches the engine.
      queued.insert(index);
      runtime::Result r;
      r.index = index;
      r.finish_reason = "cancelled";
      now.emplace_back(w->second.client, w->second.choice, std::move(r));
      waiters_.erase(w);
    }
    if (!queued.empty())
      pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                    [&](const runtime::Request& r) { return queued.count(r.index) > 0; }),
                     pending_.end());
    metrics_.queue_depth = int64_t(pending_.size());
    work_.notify_all();
  }
  metrics_.cancelled += int64_t(now.size());
  for (auto& [client, choice, r] : now) client->result(choice, std::move(r));
}

void ServeQueue::drain() {
  std::lock_guard<std::mutex> lk(mu_);
  draining_ = true;
  work_.notify_all();
}

void ServeQueue::wait_for_work(std::chrono::milliseconds most) {
  std::unique_lock<std::mutex> lk(mu_);
  work_.wait_for(lk, most, [this] { return !pending_.empty() || !cancels_.empty() || draining_; });
}

void ServeQueue::cancel_all() {
  std::vector<int64_t> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    draining_ = true;
    for (auto& [index, w] : waiters_) all.push_back(index);
  }
  cancel(all);
}

bool ServeQueue::draining() const {
  std::lock_guard<std::mutex> lk(mu_);
  return draining_;
}

std::optional<runtime::Request> ServeQueue::next() {
  std::lock_guard<std::mutex> lk(mu_);
  if (pending_.empty()) return std::nullopt;
  runtime::Request r = std::move(pending_.front());
  pending_.pop_front();
  waiters_.at(r.index).taken = true;
  metrics_.queue_depth = int64_t(pending_.size());
  return r;
}

bool ServeQueue::exhausted() {
  std::lock_guard<std::mutex> lk(mu_);
  return draining_ && pending_.empty();
}

std::shared_ptr<EngineClient> ServeQueue::find(int64_t index, int& choice) {
  std::lock_guard<std::mutex> lk(mu_);
  auto w = waiters_.find(index);
  if (w == waiters_.end()) return nullptr;
  choice = w->second.choice;
  return w->second.client;
}

void ServeQueue::on_tokens(int64_t index, const std::vector<int32_t>& tokens) {
  int choice = 0;
  if (auto client = find(index, choice)) client->tokens(choice, tokens, ServeClock::now());
}

void ServeQueue::deliver(runtime::Result&& r) {
  std::shared_ptr<EngineClient> client;
  int choice = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto w = waiters_.find(r.index);
    if (w == waiters_.end()) return;
    client = std::move(w->second.client);
    choice = w->second.choice;
    waiters_.erase(w);
  }
  if (r.finish_reason == "cancelled") ++metrics_.cancelled;
  client->result(choice, std::move(r));
}

std::vector<int64_t> ServeQueue::take_cancelled() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<int64_t> out;
  out.swap(cancels_);
  return out;
}

// Gauges every tick; rank 0's engine counters twice a second (building the text costs more than a
// tick of the test models).
void ServeQueue::on_status(const runtime::EngineStatus& status) {
  ++metrics_.engine_ticks;
  metrics_.running = status.work;
  metrics_.kv_blocks_used = status.kv_blocks_used;
  metrics_.kv_blocks = status.kv_blocks;
  if (engine_) sequence_tokens_ = engine_->stats().kv_blocks * runtime::kBlockTokens;
  const auto now = ServeClock::now();
  if (!engine_ || now - snapshot_at_ < std::chrono::milliseconds(500)) return;
  snapshot_at_ = now;
  const runtime::EngineStats& st = engine_->stats();
  nlohmann::json rank0 = to_json(st);
  rank0["peak_rss_kb"] = runtime::peak_rss_kb();  // the engine's figure is taken at the end of a run
  std::string text = prometheus_text({{"ranks", nlohmann::json::array({rank0})}});
  std::lock_guard<std::mutex> lk(mu_);
  engine_text_ = std::move(text);
}

std::string ServeQueue::engine_metrics() const {
  std::lock_guard<std::mutex> lk(mu_);
  return engine_text_;
}

}  // namespace glm5::launcher
