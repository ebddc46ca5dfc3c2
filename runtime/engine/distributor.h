#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "runtime/request.h"

namespace glm5::runtime {

// Which column of the stage takes a new request (world rank 0, between ticks): the column with
// room whose load (tokens in flight) would be least after taking it. With prefix sharing, a
// column that already has the request's first prompt block is charged only for what it will
// compute (a bounded hint: first block -> columns that got it). Lowest column on ties.
class Distributor {
 public:
  Distributor(int columns, bool prefix_sharing) : columns_(columns), prefix_sharing_(prefix_sharing) {}
  // load, free_slots: per column, as the columns reported them this tick; the chosen column's
  // load grows by the request's charge and its free slots shrink by one. At least one column
  // must have a free slot.
  int pick(const Request& r, std::vector<int64_t>& load, std::vector<int64_t>& free_slots);

 private:
  int columns_;
  bool prefix_sharing_;
  std::unordered_map<uint64_t, uint64_t> prefix_columns_;  // first prompt block -> columns with it (bits)
};

}  // namespace glm5::runtime
