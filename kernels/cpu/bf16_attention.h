// MLA attention on AVX512-BF16 (vdpbf16ps): precision fast's recipe for mla_prefill and mla_decode
// (ops.h) where the CPU has the instruction (bf16::available()) and the portable fast path was not
// asked for. Twice a float32 FMA's multiply-adds per instruction, and half the bytes of keys.
//
// Recipe, for one query row (a head of a token) and its allowed keys L[0..n) in ascending order
// (ops.h; dense causal rows: 0..q_pos), whatever other rows, heads or threads share the call:
//   Operands as bf16 (f32_to_bf16, nearest even) packed as pairs, one dword per pair (low half the
//   even element): a query or key is [part 1 | part 2] (prefill: nope | rope; decode: latent |
//   rope), each part zero-padded to a multiple of 16 pairs (one vector).
//   score[i] = scale * tree(lane), lane l = bf16::dp_lane chained over the vectors c = 0, 1, ... of
//              the query and key L[i] with pair 16 c + l of each; tree: simd::reduce's (lanes l +
//              l + 8, then + 4, + 2, + 1).
//   w        = softmax_row(score[0..n)) (cpu/attention_rows.h: float32, as kExact).
//   out[d]   = dp_lane chained over j = 0 .. ceil(n / 2) - 1 of the weight pair (w[2j], w[2j+1]) and
//              the value pair (v(L[2j])[d], v(L[2j+1])[d]), both as bf16; for odd n the last pair's
//              second weight and value are zero.
// The tests check the kernels against this recipe bit for bit (tests/kernels/test_fast_precision.cpp).
#pragma once

#include <vector>

#include "kernels/ops.h"

namespace glm5::kernels::cpu::bf16 {

// Both need bf16::available(). Callers validate their params first.
void mla_prefill(const MlaPrefillParams& p);
void mla_decode(const MlaDecodeParams& p);
// For tests: mla_decode's scores alone (the recipe's first step, which the outputs hardly show:
// the weights are rounded to bf16), row by row, head by head, each head's keys in list order.
std::vector<float> mla_decode_scores(const MlaDecodeParams& p);

}  // namespace glm5::kernels::cpu::bf16
