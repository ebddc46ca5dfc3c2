#include "runtime/engine/distributor.h"

#include "kernels/core/check.h"
#include "runtime/kv_cache.h"

namespace glm5::runtime {

int Distributor::pick(const Request& r, std::vector<int64_t>& load, std::vector<int64_t>& free_slots) {
  const int64_t cost = int64_t(r.prompt.size()) + r.sampling.max_tokens;
  const int64_t shareable = (int64_t(r.prompt.size()) - 1) / kBlockTokens * kBlockTokens;
  uint64_t* has = nullptr;
  if (columns_ > 1 && shareable > 0 && prefix_sharing_) {
    if (prefix_columns_.size() > 65536) prefix_columns_.clear();  // a bounded hint
    has = &prefix_columns_[prefix_hashes({r.prompt.begin(), r.prompt.begin() + kBlockTokens + 1})[0]];
  }
  auto charge = [&](int c) { return cost - (has && (*has >> (c % 64) & 1) ? shareable : 0); };
  int best = -1;
  for (int c = 0; c < columns_; ++c)
    if (free_slots[size_t(c)] > 0 && (best < 0 || load[size_t(c)] + charge(c) < load[size_t(best)] + charge(best)))
      best = c;
  CHECK(best >= 0, "internal: no column has room for request ", r.index);
  load[size_t(best)] += charge(best);
  if (has) *has |= uint64_t(1) << (best % 64);
  --free_slots[size_t(best)];
  return best;
}

}  // namespace glm5::runtime
