// What the CPU backend's MLA attention kernels share (cpu/attention.cpp: the exact recipe and
// precision fast's portable one; cpu/bf16_attention.cpp: precision fast on AVX512-BF16): each query
// row's allowed keys, and its softmax weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/core/check.h"

namespace glm5::kernels::cpu::fast {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Multiply-adds below which a call stays on one thread (a fork/join costs a few microseconds).
constexpr int64_t kParallelMacs = int64_t(1) << 18;

// Softmax weights of one row's n scores, in place: w = exp(s - max) / sum over the keys in
// ascending order, 16 lanes at a time (vector exp, fixed lane sums). Nothing for n = 0.
void softmax_row(float* w, int64_t n);  // cpu/attention.cpp

// The allowed keys of every query row (ops.h): dense causal rows use a prefix of 0, 1, 2, ...;
// indexer-selected rows get their own sorted, de-duplicated list.
struct AllowedKeys {
  std::vector<int32_t> iota;
  std::vector<std::vector<int32_t>> lists;
  std::vector<const int32_t*> ptr;
  std::vector<int64_t> len;

  AllowedKeys(int64_t s, int64_t t, const int32_t* q_pos, const int32_t* topk, int64_t topk_len, const char* op) {
    ptr.resize(size_t(s));
    len.resize(size_t(s));
    if (!topk) {
      iota.resize(size_t(t));
      std::iota(iota.begin(), iota.end(), 0);
      for (int64_t r = 0; r < s; ++r) {
        ptr[r] = iota.data();
        len[r] = std::clamp<int64_t>(int64_t(q_pos[r]) + 1, 0, t);
      }
      return;
    }
    for (int64_t i = 0; i < s * topk_len; ++i)
      CHECK(topk[i] >= -1 && topk[i] < t, op, ": topk entry ", topk[i], " (row ", i / topk_len, ", column ",
            i % topk_len, ") outside [-1, ", t, ")");
    lists.resize(size_t(s));
#pragma omp parallel for schedule(static) if (s * topk_len >= 4096)
    for (int64_t r = 0; r < s; ++r) {
      std::vector<int32_t>& l = lists[size_t(r)];
      const int32_t* sel = topk + r * topk_len;
      for (int64_t j = 0; j < topk_len; ++j)
        if (sel[j] >= 0 && sel[j] <= q_pos[r]) l.push_back(sel[j]);
      // (topk's rows are already strictly ascending: then no sort)
      if (std::adjacent_find(l.begin(), l.end(), std::greater_equal<int32_t>()) != l.end()) {
        std::sort(l.begin(), l.end());
        l.erase(std::unique(l.begin(), l.end()), l.end());
      }
      ptr[r] = l.data();
      len[r] = int64_t(l.size());
    }
  }
};

}  // namespace glm5::kernels::cpu::fast
