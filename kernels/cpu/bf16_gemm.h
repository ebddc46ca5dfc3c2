// y = x W^T with bf16 inputs on AVX512-BF16 (vdpbf16ps): the fast precision's gemm (Precision::kFast,
// ops.h) where the CPU has the instruction. Twice the multiply-adds of a float32 FMA per instruction,
// and half the bytes of x.
//
// Operands: x rounded to bf16 (nearest even, f32_to_bf16) and packed as k pairs, one dword per
// pair (low half the even column, k padded with a zero to even); W BF16 in WeightLayout::kPair16
// (ops.h): the 64 bytes of pair p of a group of 16 W rows are one vector, lane l = row 16 g + l.
//
// Recipe (what every y element is, whatever m, n, the tile, the item or the thread): y[i, j] is
// one lane of vdpbf16ps chained over the pairs in order,
//   acc = 0;  for p = 0, 1, ...:  acc = dp_lane(acc, x pair p of row i, W pair p of row j)
// then y = acc, or y + acc. dp_lane is the instruction's documented arithmetic (Intel SDM,
// VDPBF16PS): acc + x[2p+1] w[2p+1] rounded to float32 (nearest even), then + x[2p] w[2p] rounded
// again; the products are exact; bf16 inputs that are denormal count as zero, and a denormal
// sum is flushed to zero. The tests check the kernel against dp_lane bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/core/dtype.h"

namespace glm5::kernels::cpu::bf16 {

// Whether this CPU runs AVX512-BF16 (with AVX512-F / BW / VL).
bool available();

namespace detail {
inline float daz(float v) {  // a denormal as a zero of its sign
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  std::memcpy(&v, &u, 4);
  return v;
}
}  // namespace detail

// One vdpbf16ps lane: acc + x.hi * w.hi, then + x.lo * w.lo (see above). The two roundings are
// separate float32 additions: this is compiled with -ffp-contract=off (kernels/CMakeLists.txt).
inline float dp_lane(float acc, uint32_t x_pair, uint32_t w_pair) {
  using detail::daz;
  const float xh = daz(bf16_to_f32(uint16_t(x_pair >> 16))), wh = daz(bf16_to_f32(uint16_t(w_pair >> 16)));
  const float xl = daz(bf16_to_f32(uint16_t(x_pair))), wl = daz(bf16_to_f32(uint16_t(w_pair)));
  const float t = daz(daz(acc) + xh * wh);
  return daz(t + xl * wl);
}

// x [m, k] as rows of `pairs` dwords (bf16 pairs, rounded to nearest even, zero-padded).
struct PackedPairs {
  int64_t m = 0, pairs = 0;
  std::vector<uint32_t> data;
  const uint32_t* row(int64_t i) const { return data.data() + i * pairs; }
};
void pack_pairs(const float* x, int64_t ldx, int64_t m, int64_t k, PackedPairs& out);

// y[:, 0:nb] (+)= x W^T for the W rows [0, nb) of a kPair16 weight starting at `w` (a multiple of
// 16 rows into the matrix; row stride ldw elements, ldw >= 2 x.pairs). One thread. Needs
// available().
void gemm_rows(const PackedPairs& x, const uint16_t* w, int64_t ldw, int64_t nb, float* y, int64_t ldy,
               bool accumulate);

// The DSA indexer's scores on vdpbf16ps (precision fast, where available()): one query row against
// a block of kIndexerBlock keys. Operands as pairs of bf16 (f32_to_bf16 of each value, low half the
// even element): q [H][pairs] (q[h * pairs + p] = (q_h[2p], q_h[2p+1])), keys kp[p * kIndexerBlock +
// j] = (k_j[2p], k_j[2p+1]). Recipe: dot_h[j] = dp_lane chained over the pairs from 0; then
// out[j] = fma(w[h], max(dot_h[j], 0), out[j]) over h = 0, 1, ... from 0 (a fused multiply-add, as
// the exact kernel sums its heads).
constexpr int64_t kIndexerBlock = 64;
void indexer_block(const uint32_t* q, int64_t heads, int64_t pairs, const float* w, const uint32_t* kp, float* out);
// kp of a block from keys transposed as [D][kIndexerBlock] float32 (kt) or bf16 (kt16), D even.
void pack_key_block(const float* kt, int64_t D, uint32_t* kp);
void pack_key_block(const uint16_t* kt16, int64_t D, uint32_t* kp);

}  // namespace glm5::kernels::cpu::bf16
