// quantize_fp8_block, quantize_int_group (see quantize.h). Rows are independent, so the loops
// run in parallel without changing a byte.
#include "runtime/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/core/check.h"
#include "kernels/core/quant.h"

namespace glm5::runtime {

void quantize_fp8_block(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale) {
  const int64_t B = quant::kFp8Block, br = (rows + B - 1) / B, bc = (cols + B - 1) / B;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < br; ++i) {
    const int64_t r0 = i * B, r1 = std::min(rows, r0 + B);
    for (int64_t j = 0; j < bc; ++j) {
      const int64_t c0 = j * B, c1 = std::min(cols, c0 + B);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      const float s = amax > 0.0f ? amax / quant::kFp8Max : 1.0f;
      scale[i * bc + j] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = quant::f32_to_fp8_e4m3(w[r * cols + c] / s);
    }
  }
}

void quantize_int_group(const float* w, int64_t rows, int64_t cols, int bits, int64_t group, int32_t* packed,
                        DType scale_dtype, void* scale) {
  CHECK(scale_dtype == DType::BF16 || scale_dtype == DType::F32, "quantize_int_group: scale dtype ",
        dtype_name(scale_dtype), " (expected BF16 or F32)");
  const bool bf16 = scale_dtype == DType::BF16;
  const int per = 32 / bits, qmin = -(1 << (bits - 1)), qmax = (1 << (bits - 1)) - 1;
  const int64_t words = (cols + per - 1) / per, groups = cols / group;
  const float half_range = float((1 << bits) - 1) / 2.0f;  // 7.5 for int4, 127.5 for int8
  const float eps = std::numeric_limits<float>::epsilon();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w + r * cols;
    uint32_t* out = reinterpret_cast<uint32_t*>(packed + r * words);
    std::fill(out, out + words, 0u);
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.0f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) amax = std::max(amax, std::fabs(row[c]));
      float s = std::max(amax / half_range, eps);
      if (bf16) {
        const uint16_t sb = f32_to_bf16(s);
        static_cast<uint16_t*>(scale)[r * groups + g] = sb;
        s = bf16_to_f32(sb);
      } else {
        static_cast<float*>(scale)[r * groups + g] = s;
      }
      for (int64_t c = g * group; c < (g + 1) * group; ++c) {
        const float t = bf16 ? bf16_to_f32(f32_to_bf16(row[c] / s)) : row[c] / s;
        const int v = std::clamp(int(std::nearbyint(t)), qmin, qmax);
        out[c / per] |= uint32_t(v - qmin) << (bits * (c % per));
      }
    }
  }
}

}  // namespace glm5::runtime
