// The process grid: world = stages x expert-parallel columns; rank r is stage r / E, column r % E.
// Stage s owns a contiguous range of decoder layers; columns split each MoE layer's experts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace glm5::parallel {

struct LayerRange {
  int first = 0, last = 0;  // [first, last)
  int size() const { return last - first; }
};

struct Grid {
  int stages = 1;           // P
  int expert_parallel = 1;  // E
  int world() const { return stages * expert_parallel; }
  int stage_of(int rank) const { return rank / expert_parallel; }
  int column_of(int rank) const { return rank % expert_parallel; }
  int rank_of(int stage, int column) const { return stage * expert_parallel + column; }
};

// Splits n_layers into `stages` contiguous ranges with weights cost[l] (e.g. parameters per
// layer), so that the largest stage cost is as small as possible; every stage gets >= 1 layer.
std::vector<LayerRange> balance_layers(const std::vector<double>& cost, int stages);

// Experts [first, last) owned by column `column` of E when n_experts is split evenly.
LayerRange expert_range(int n_experts, int expert_parallel, int column);

}  // namespace glm5::parallel
