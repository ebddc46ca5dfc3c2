// Layer balancing over pipeline stages and the even expert split of a stage.
#include "parallel/grid.h"

#include <algorithm>
#include <numeric>

#include "kernels/core/check.h"

namespace glm5::parallel {

std::vector<LayerRange> balance_layers(const std::vector<double>& cost, int stages) {
  const int n = int(cost.size());
  CHECK(stages >= 1 && stages <= n, "cannot split ", n, " layers into ", stages,
        " pipeline stages (need 1 <= stages <= layers)");
  // Binary search on the largest stage cost; greedy packing decides feasibility.
  auto pack = [&](double limit, std::vector<LayerRange>* out) {
    int used = 0, l = 0;
    while (l < n) {
      if (used == stages) return false;
      int first = l;
      double sum = 0;
      // Leave at least one layer for each remaining stage.
      int max_last = n - (stages - used - 1);
      while (l < max_last && (l == first || sum + cost[l] <= limit)) sum += cost[l++];
      if (sum > limit && l - first == 1 && cost[first] > limit) return false;
      if (out) out->push_back({first, l});
      ++used;
    }
    if (out) {
      // Fewer ranges than stages: split the largest ranges until there are `stages` of them.
      while (int(out->size()) < stages) {
        auto it = std::max_element(out->begin(), out->end(), [](auto& a, auto& b) { return a.size() < b.size(); });
        LayerRange r = *it;
        int mid = r.first + r.size() / 2;
        *it = {r.first, mid};
        out->insert(it + 1, {mid, r.last});
      }
    }
    return true;
  };
  double lo = *std::max_element(cost.begin(), cost.end());
  double hi = std::accumulate(cost.begin(), cost.end(), 0.0);
  for (int it = 0; it < 100; ++it) {
    double mid = 0.5 * (lo + hi);
    if (pack(mid, nullptr))
      hi = mid;
    else
      lo = mid;
  }
  std::vector<LayerRange> out;
  pack(hi * (1 + 1e-12), &out);
  return out;
}

LayerRange expert_range(int n_experts, int expert_parallel, int column) {
  CHECK(expert_parallel >= 1 && n_experts % expert_parallel == 0, "n_routed_experts (", n_experts,
        ") is not divisible by the expert-parallel degree (", expert_parallel, ")");
  CHECK(column >= 0 && column < expert_parallel, "expert-parallel column ", column, " is outside [0, ", expert_parallel,
        ")");
  int per = n_experts / expert_parallel;
  return {column * per, (column + 1) * per};
}

}  // namespace glm5::parallel
