// Quantization of float32 matrices into the stored formats of core/quant.h (what `glm5 convert`
// writes). Deterministic: the same input gives the same bytes, whatever the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/core/dtype.h"

namespace glm5::runtime {

// FP8 E4M3 with one F32 scale per 128 x 128 block (GLM-5-FP8 / DeepSeek-V3 layout): scale =
// amax / 448 of the block (1 for an all-zero block), q = e4m3(w / scale), rounded to nearest even.
// q [rows * cols], scale [ceil(rows / 128) * ceil(cols / 128)].
void quantize_fp8_block(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale);

// Symmetric group-wise int4 / int8 in compressed-tensors pack-quantized form. With BF16 scales,
// computed the way compressed-tensors / llm-compressor compute it (so a BF16 input converts to the
// same bytes):
//   scale = bf16(max(amax / ((2^bits - 1) / 2), eps_f32)) per group of `group` columns,
//   q = clamp(round_half_even(bf16(w / scale)), -2^(bits-1), 2^(bits-1) - 1);
// with F32 scales the same in float32 throughout (scale = max(amax / ..., eps), q = rne(w / scale)),
// so that a weight q * scale needs no rounding to the scale's dtype (faster int8 decode on CPUs).
// Stored as q + 2^(bits-1), 32 / bits per little-endian int32, rows zero-padded to whole int32s.
// packed [rows * ceil(cols * bits / 32)] int32, scale [rows * cols / group] of scale_dtype (BF16, F32).
void quantize_int_group(const float* w, int64_t rows, int64_t cols, int bits, int64_t group, int32_t* packed,
                        DType scale_dtype, void* scale);

}  // namespace glm5::runtime
