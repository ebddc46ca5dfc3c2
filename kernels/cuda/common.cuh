// Device helpers shared by the CUDA kernel files: fixed-order warp/block reductions (the order
// depends only on blockDim, never on how many rows a launch has: batch invariance), weight
// widening, and launch-size helpers. Internal to kernels/cuda/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace glm5::kernels::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;  // the same value in every lane
}

// Sum over the block; every thread gets the result. `sh` holds >= 33 floats. blockDim.x must be
// a multiple of 32. The block may call it repeatedly with the same `sh`.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // earlier readers of sh are done
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < n_warps ? sh[lane] : 0.0f;
    w = warp_sum(w);
    if (lane == 0) sh[32] = w;
  }
  __syncthreads();
  return sh[32];
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// E4M3 (fn) code -> float32: exact for every code, NaN for 0x7f / 0xff (like fp8_e4m3_to_f32).
__device__ __forceinline__ float fp8_e4m3(uint32_t v) {
  const uint32_t e = (v >> 3) & 0xfu, m = v & 7u;
  float r = e == 0 ? float(m) * (1.0f / 512.0f)                        // subnormal: m/8 * 2^-6
                   : __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e-7)
  if ((v & 0x7fu) == 0x7fu) r = __uint_as_float(0x7fc00000u);
  return (v & 0x80u) ? -r : r;
}

// quant::round_to: the value after a round trip through the scale's dtype (nearest even).
template <typename S>
__device__ __forceinline__ float round_to_scale(float v) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>)
    return __bfloat162float(__float2bfloat16_rn(v));
  else if constexpr (std::is_same_v<S, __half>)
    return __half2float(__float2half_rn(v));
  else
    return v;
}

// Records the first bad input of a launch in the backend's error word (see kernels.cuh).
__device__ __forceinline__ void report_error(int* err, int code, int64_t value, int64_t row, int64_t bound) {
  auto clamp = [](int64_t v) { return int(v > 0x7fffffff ? 0x7fffffff : v < -0x7fffffff ? -0x7fffffff : v); };
  if (atomicCAS(err, 0, code) == 0) {
    err[1] = clamp(value);
    err[2] = clamp(row);
    err[3] = clamp(bound);
  }
}

inline unsigned grid_for(int64_t n, int threads, int64_t cap = int64_t(1) << 20) {
  int64_t b = (n + threads - 1) / threads;
  if (b > cap) b = cap;  // kernels use grid-stride loops past the cap
  return unsigned(b < 1 ? 1 : b);
}

}  // namespace glm5::kernels::cuda
