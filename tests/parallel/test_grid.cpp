// The process grid without MPI: rank <-> (stage, column), layer balancing over pipeline stages
// (checked against brute force on small cases) and the even expert split.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>

#include "kernels/core/check.h"
#include "parallel/grid.h"

namespace glm5::parallel {
namespace {

double stage_cost(const std::vector<double>& cost, LayerRange r) {
  return std::accumulate(cost.begin() + r.first, cost.begin() + r.last, 0.0);
}

double max_stage_cost(const std::vector<double>& cost, const std::vector<LayerRange>& ranges) {
  double m = 0;
  for (auto r : ranges) m = std::max(m, stage_cost(cost, r));
  return m;
}

// The ranges are contiguous, non-empty, in order and cover every layer.
void expect_partition(const std::vector<LayerRange>& ranges, int n_layers, int stages) {
  ASSERT_EQ(int(ranges.size()), stages);
  int next = 0;
  for (auto r : ranges) {
    EXPECT_EQ(r.first, next);
    EXPECT_GE(r.size(), 1);
    next = r.last;
  }
  EXPECT_EQ(next, n_layers);
}

// Smallest possible largest-stage cost, by trying every split.
double brute_force(const std::vector<double>& cost, int stages) {
  const int n = int(cost.size());
  double best = std::numeric_limits<double>::infinity();
  std::function<void(int, int, double)> go = [&](int first, int left, double worst) {
    if (left == 1) {
      best = std::min(best, std::max(worst, stage_cost(cost, {first, n})));
      return;
    }
    for (int last = first + 1; last <= n - (left - 1); ++last)
      go(last, left - 1, std::max(worst, stage_cost(cost, {first, last})));
  };
  go(0, stages, 0);
  return best;
}

TEST(Grid, RankStageColumn) {
  Grid g{3, 4};
  EXPECT_EQ(g.world(), 12);
  for (int r = 0; r < g.world(); ++r) {
    EXPECT_EQ(g.stage_of(r), r / 4);
    EXPECT_EQ(g.column_of(r), r % 4);
    EXPECT_EQ(g.rank_of(g.stage_of(r), g.column_of(r)), r);
  }
}

TEST(BalanceLayers, FourLayersTwoStagesUnevenCosts) {
  // Heavy last layer: it gets a stage alone.
  auto a = balance_layers({1, 1, 1, 3}, 2);
  expect_partition(a, 4, 2);
  EXPECT_EQ(a[0].last, 3);
  // 1+2+3 = 6 vs 4 beats 1+2 = 3 vs 3+4 = 7.
  auto b = balance_layers({1, 2, 3, 4}, 2);
  expect_partition(b, 4, 2);
  EXPECT_EQ(b[0].last, 3);
  EXPECT_DOUBLE_EQ(max_stage_cost({1, 2, 3, 4}, b), 6);
  // Heavy first layer.
  auto c = balance_layers({5, 1, 1, 1}, 2);
  expect_partition(c, 4, 2);
  EXPECT_EQ(c[0].last, 1);
}

TEST(BalanceLayers, EqualCostsSplitEvenly) {
  auto r = balance_layers(std::vector<double>(8, 1.0), 4);
  expect_partition(r, 8, 4);
  for (auto x : r) EXPECT_EQ(x.size(), 2);
  auto one = balance_layers({2, 7, 1}, 1);
  expect_partition(one, 3, 1);
}

TEST(BalanceLayers, AsManyStagesAsLayers) {
  auto r = balance_layers({3, 1, 4, 1, 5}, 5);
  expect_partition(r, 5, 5);
  for (auto x : r) EXPECT_EQ(x.size(), 1);
  // Zero-cost layers still get a stage each.
  auto z = balance_layers({0, 0, 0, 9}, 4);
  expect_partition(z, 4, 4);
}

TEST(BalanceLayers, MoreStagesThanLayersIsAnError) {
  EXPECT_THROW(balance_layers({1, 1, 1}, 4), Error);
  EXPECT_THROW(balance_layers({}, 1), Error);
  EXPECT_THROW(balance_layers({1, 1}, 0), Error);
  try {
    balance_layers({1, 1, 1}, 4);
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("3 layers"), std::string::npos) << msg;
    EXPECT_NE(msg.find("4 pipeline stages"), std::string::npos) << msg;
  }
}

TEST(BalanceLayers, OptimalAgainstBruteForce) {
  uint32_t state = 12345;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
  };
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + int(next() % 9);
    const int stages = 1 + int(next() % n);
    std::vector<double> cost(n);
    for (auto& c : cost) c = double(next() % 20);  // includes zeros and ties
    auto r = balance_layers(cost, stages);
    expect_partition(r, n, stages);
    const double best = brute_force(cost, stages);
    EXPECT_LE(max_stage_cost(cost, r), best * (1 + 1e-9) + 1e-12)
        << "trial " << trial << ": " << n << " layers into " << stages << " stages";
  }
}

TEST(ExpertRange, EvenSplit) {
  for (int e : {1, 2, 4, 8}) {
    int next = 0;
    for (int c = 0; c < e; ++c) {
      LayerRange r = expert_range(256, e, c);
      EXPECT_EQ(r.first, next);
      EXPECT_EQ(r.size(), 256 / e);
      next = r.last;
    }
    EXPECT_EQ(next, 256);
  }
  LayerRange r = expert_range(8, 4, 2);
  EXPECT_EQ(r.first, 4);
  EXPECT_EQ(r.last, 6);
}

TEST(ExpertRange, BadSplitsAreErrors) {
  EXPECT_THROW(expert_range(10, 4, 0), Error);  // not divisible
  EXPECT_THROW(expert_range(8, 0, 0), Error);
  EXPECT_THROW(expert_range(8, 4, 4), Error);  // column outside the grid
  EXPECT_THROW(expert_range(8, 4, -1), Error);
  try {
    expert_range(10, 4, 0);
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("10"), std::string::npos) << msg;
    EXPECT_NE(msg.find("4"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace glm5::parallel
