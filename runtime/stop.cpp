// StopMatcher: see stop.h.
#include "runtime/stop.h"

#include <algorithm>

#include "runtime/tokenizer/tokenizer.h"

namespace glm5::runtime {

StopMatcher::StopMatcher(std::vector<std::string> stops, const Tokenizer* tok) : stops_(std::move(stops)), tok_(tok) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  for (auto& s : stops_) keep_ = std::max(keep_, s.size() - 1);
}

bool StopMatcher::feed(int32_t token) {
  if (stops_.empty() || !tok_) return false;
  const size_t old = tail_.size();
  if (!tok_->append_decoded(tail_, token, /*skip_special=*/true, first_)) return false;
  first_ = false;
  // A match must end in the new piece: search from where a stop string could start.
  const size_t from = old > keep_ ? old - keep_ : 0;
  bool hit = false;
  for (auto& s : stops_) hit = hit || tail_.find(s, from) != std::string::npos;
  if (tail_.size() > keep_) tail_.erase(0, tail_.size() - keep_);
  return hit;
}

}  // namespace glm5::runtime
