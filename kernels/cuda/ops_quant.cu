// CUDA kernels for quantized weights: F8_E4M3 with block scales, and the pack-quantized int4 and
// int8 formats with group scales. core/quant.h defines the formats, and every element's value is
// exactly weight_at() of ops.h:
//   FP8:   fp8(q) * scale                        (one float32 multiply)
//   Q4/Q8: round_to(scale dtype, float(q) * scale)
// __fmul_rn keeps nvcc from contracting the multiply into a neighbouring add.
//
// * quant_gemm_kernel: y (+)= x W^T straight from the stored bytes. This is the W4A16-style
//   kernel. A block covers 16 weight rows (8 warps, 2 rows each) and 8 rows of x. Each lane owns
//   16 stored bytes of a row per k-chunk of 32 * 16 bytes (Q4: 32 elements; Q8/FP8: 16). The lane
//   dequantizes them in registers and runs one fp32 fmaf chain per output (k ascending within its
//   share). A fixed xor-tree warp sum combines the 32 lane partials. How an output (i, j) is
//   summed therefore depends only on k (which columns each lane owns). It does not depend on m,
//   on which 8-row tile row i falls in, or on the grid. x is staged chunk by chunk in shared
//   memory, and the next chunk's weight bytes are loaded while the current one is computed. The
//   weight bytes are read once per 8-row tile of x: exactly once for m <= 8, and for m = 9..16
//   twice (the second read mostly from L2). At large m this is an fp32 SIMT GEMM without tensor
//   cores, which is where GLM5_CUDA_QUANT_GEMM=dequant (cuBLAS) is faster.
// * dequant_kernel: rows of W expanded into float32, or into bf16 where that is exact (Q4/Q8 with
//   BF16 scales, whose values are bf16 numbers by definition). The backend feeds the result to its
//   cuBLAS GEMM path (GLM5_CUDA_QUANT_GEMM=dequant, and trans_w).
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kernels.cuh"

namespace glm5::kernels::cuda {
namespace {

enum class QKind { kFp8, kQ4, kQ8 };

// Elements in one 16-byte lane chunk.
template <QKind K>
constexpr int kChunkElems = K == QKind::kQ4 ? 32 : 16;

constexpr int kQuantWarps = 8;        // warps per block
constexpr int kQuantRowsPerWarp = 2;  // weight rows per warp (each x value read from smem is used twice)
constexpr int kQuantTileM = 8;        // rows of x per block
constexpr int kQuantRowsPerBlock = kQuantWarps * kQuantRowsPerWarp;
constexpr int kPitch = 33;  // smem pitch of the staged x chunk: conflict-free lane reads

// The value of one element from its stored code (FP8 byte, int8 byte, int4 nibble) and its scale.
template <QKind K, typename S>
__device__ __forceinline__ float dequant(uint32_t code, float s) {
  if constexpr (K == QKind::kFp8)
    return __fmul_rn(fp8_e4m3(code), s);
  else if constexpr (K == QKind::kQ4)
    return round_to_scale<S>(__fmul_rn(float(int(code) - 8), s));
  else
    return round_to_scale<S>(__fmul_rn(float(int(code) - 128), s));
}

// Code of element t of a 16-byte chunk held as four little-endian words. Q4 element 2i is the low
// nibble of byte i, so element t of a word sits at bits 4t.
template <QKind K>
__device__ __forceinline__ uint32_t code_at(const uint32_t (&wd)[4], int t) {
  if constexpr (K == QKind::kQ4)
    return (wd[t >> 3] >> (4 * (t & 7))) & 0xfu;
  else
    return (wd[t >> 2] >> (8 * (t & 3))) & 0xffu;
}

// The 16 stored bytes [b0, b0 + 16) of a row, with bytes at or past `valid` read as 0. `align` is
// the alignment (16, 4 or 1) of every row start and of 16-byte chunk offsets, as the host found it.
__device__ __forceinline__ void load_chunk(const uint8_t* row, int64_t b0, int64_t valid, int align,
                                           uint32_t (&wd)[4]) {
  if (b0 + 16 <= valid) {
    if (align >= 16) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + b0));
      wd[0] = u.x, wd[1] = u.y, wd[2] = u.z, wd[3] = u.w;
      return;
    }
    if (align >= 4) {
      const uint32_t* p = reinterpret_cast<const uint32_t*>(row + b0);
#pragma unroll
      for (int q = 0; q < 4; ++q) wd[q] = __ldg(p + q);
      return;
    }
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t v = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int64_t b = b0 + 4 * q + t;
      if (b < valid) v |= uint32_t(__ldg(row + b)) << (8 * t);
    }
    wd[q] = v;
  }
}

struct QuantGemmArgs {
  const float* x = nullptr;
  int64_t ldx = 0;
  const uint8_t* w = nullptr;
  int64_t row_bytes = 0;    // stored bytes per weight row (ld elements)
  int64_t valid_bytes = 0;  // bytes holding columns [0, k) of a row
  const void* scale = nullptr;
  int64_t scale_ld = 0, group = 1, scale_block_rows = 1;
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  int align = 1;        // 16, 4 or 1: alignment of rows and chunks (see load_chunk)
  bool uniform = true;  // group % chunk elements == 0: one scale per lane chunk
  bool accumulate = false;
};

// This lane's 16 stored bytes of chunk c0 for each of the warp's rows (zeros past n or k).
template <QKind K>
__device__ __forceinline__ void load_rows(const QuantGemmArgs& a, int64_t j_base, int64_t col0,
                                          uint32_t (&wd)[kQuantRowsPerWarp][4]) {
  constexpr int kShift = K == QKind::kQ4 ? 1 : 0;  // column -> byte offset
#pragma unroll
  for (int r = 0; r < kQuantRowsPerWarp; ++r) {
    const int64_t j = j_base + r;
    if (col0 < a.k && j < a.n) {
      load_chunk(a.w + j * a.row_bytes, col0 >> kShift, a.valid_bytes, a.align, wd[r]);
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) wd[r][q] = 0;
    }
  }
}

template <QKind K, typename S>
__global__ void __launch_bounds__(kQuantWarps * 32, 2) quant_gemm_kernel(QuantGemmArgs a) {
  constexpr int E = kChunkElems<K>, KC = 32 * E, R = kQuantRowsPerWarp, MT = kQuantTileM;
  // x[m0 + i, c0 + l * E + e] at xs[(i * E + e) * kPitch + l]: lane l reads consecutive words.
  __shared__ float xs[MT * E * kPitch];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t m0 = int64_t(blockIdx.y) * MT;
  const int rows_m = int(a.m - m0 < MT ? a.m - m0 : MT);
  const int64_t j_base = (int64_t(blockIdx.x) * kQuantWarps + warp) * R;
  const S* scale = static_cast<const S*>(a.scale);
  int64_t srow[R];  // offset of row j's scales
#pragma unroll
  for (int r = 0; r < R; ++r)
    srow[r] = (K == QKind::kFp8 ? (j_base + r) / a.scale_block_rows : j_base + r) * a.scale_ld;

  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[r][i] = 0.0f;

  uint32_t wd[R][4];
  load_rows<K>(a, j_base, int64_t(lane) * E, wd);
  for (int64_t c0 = 0; c0 < a.k; c0 += KC) {
    const int64_t col0 = c0 + int64_t(lane) * E;  // this lane's first column of the chunk
    __syncthreads();                              // everyone is done with the previous chunk of xs
    for (int idx = threadIdx.x; idx < rows_m * KC; idx += blockDim.x) {
      const int i = idx / KC, cc = idx % KC;
      const int64_t col = c0 + cc;
      xs[(i * E + cc % E) * kPitch + cc / E] = col < a.k ? a.x[(m0 + i) * a.ldx + col] : 0.0f;
    }
    uint32_t next[R][4];  // the next chunk's bytes, in flight while this one is computed
    load_rows<K>(a, j_base, col0 + KC, next);
    __syncthreads();

    if (col0 < a.k) {
      float s[R];
#pragma unroll
      for (int r = 0; r < R; ++r)
        s[r] = a.uniform && j_base + r < a.n ? to_float(scale[srow[r] + col0 / a.group]) : 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int64_t c = col0 + e;
        float w[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float sc = s[r];
          if (!a.uniform) sc = c < a.k && j_base + r < a.n ? to_float(scale[srow[r] + c / a.group]) : 0.0f;
          // Padding columns read as 0 whatever their bytes hold.
          w[r] = c < a.k ? dequant<K, S>(code_at<K>(wd[r], e), sc) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          if (i >= rows_m) break;
          const float xv = xs[(i * E + e) * kPitch + lane];
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r][i] = fmaf(xv, w[r], acc[r][i]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int q = 0; q < 4; ++q) wd[r][q] = next[r][q];
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t j = j_base + r;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const float v = warp_sum(acc[r][i]);
      if (lane == i && i < rows_m && j < a.n) {
        float* out = a.y + (m0 + i) * a.ldy + j;
        *out = a.accumulate ? *out + v : v;
      }
    }
  }
}

template <QKind K, typename S>
void quant_gemm_typed(const QuantGemmArgs& a0, cudaStream_t st) {
  constexpr int64_t kMaxTiles = 65535;  // grid.y limit; larger m loops
  const unsigned gx = unsigned((a0.n + kQuantRowsPerBlock - 1) / kQuantRowsPerBlock);
  for (int64_t r0 = 0; r0 < a0.m; r0 += kMaxTiles * kQuantTileM) {
    QuantGemmArgs a = a0;
    a.x = a0.x + r0 * a0.ldx;
    a.y = a0.y + r0 * a0.ldy;
    a.m = a0.m - r0 < kMaxTiles * kQuantTileM ? a0.m - r0 : kMaxTiles * kQuantTileM;
    const dim3 grid(gx, unsigned((a.m + kQuantTileM - 1) / kQuantTileM));
    quant_gemm_kernel<K, S><<<grid, kQuantWarps * 32, 0, st>>>(a);
    CUDA_CHECK_LAUNCH("gemm (quantized)");
  }
}

struct DequantArgs {
  const uint8_t* w = nullptr;
  int64_t row_bytes = 0;
  const void* scale = nullptr;
  int64_t scale_ld = 0, group = 1, scale_block_rows = 1;
  int64_t r0 = 0, rows = 0, cols = 0;  // rows [r0, r0 + rows) of the weight view
  void* out = nullptr;
  int64_t ldo = 0;
};

template <QKind K, typename S, typename O>
__global__ void dequant_kernel(DequantArgs a) {
  const S* scale = static_cast<const S*>(a.scale);
  O* out = static_cast<O*>(a.out);
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    const int64_t rr = a.r0 + r;
    const uint8_t* row = a.w + rr * a.row_bytes;
    const int64_t srow = (K == QKind::kFp8 ? rr / a.scale_block_rows : rr) * a.scale_ld;
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < a.cols; c += int64_t(gridDim.x) * blockDim.x) {
      const uint32_t code = K == QKind::kQ4 ? (uint32_t(row[c >> 1]) >> (4 * (c & 1))) & 0xfu : uint32_t(row[c]);
      const float v = dequant<K, S>(code, to_float(scale[srow + c / a.group]));
      if constexpr (std::is_same_v<O, __nv_bfloat16>)
        out[r * a.ldo + c] = __float2bfloat16_rn(v);  // exact: v is a bf16 value
      else
        out[r * a.ldo + c] = v;
    }
  }
}

template <QKind K, typename S, typename O>
void dequant_typed(const DequantArgs& a, cudaStream_t st) {
  const int64_t col_blocks = (a.cols + 255) / 256;
  const dim3 grid(unsigned(col_blocks < 64 ? col_blocks : 64), unsigned(a.rows < 65535 ? a.rows : 65535));
  dequant_kernel<K, S, O><<<grid, 256, 0, st>>>(a);
  CUDA_CHECK_LAUNCH("dequantize");
}

int alignment_of(const void* p, int64_t row_bytes) {
  const uint64_t bits = uint64_t(reinterpret_cast<uintptr_t>(p)) | uint64_t(row_bytes);
  return bits % 16 == 0 ? 16 : bits % 4 == 0 ? 4 : 1;
}

}  // namespace

DType dequantized_dtype(const Weight& w) {
  return (w.dtype == DType::Q4 || w.dtype == DType::Q8) && w.scale_dtype == DType::BF16 ? DType::BF16 : DType::F32;
}

void launch_gemm_quant_fused(const GemmParams& p, cudaStream_t st) {
  QuantGemmArgs a;
  a.x = p.x, a.ldx = p.ldx, a.w = static_cast<const uint8_t*>(p.w.data);
  a.row_bytes = int64_t(quant::row_bytes(p.w.dtype, p.w.ld));
  a.valid_bytes = p.w.dtype == DType::Q4 ? (p.k + 1) / 2 : p.k;
  a.scale = p.w.scale, a.scale_ld = p.w.scale_ld, a.group = p.w.group;
  a.scale_block_rows = p.w.scale_block_rows;
  a.y = p.y, a.ldy = p.ldy, a.m = p.m, a.n = p.n, a.k = p.k, a.accumulate = p.accumulate;
  a.align = alignment_of(p.w.data, a.row_bytes);
  const int elems = p.w.dtype == DType::Q4 ? kChunkElems<QKind::kQ4> : kChunkElems<QKind::kQ8>;
  a.uniform = p.w.group % elems == 0;
  const DType s = p.w.scale_dtype;
  switch (p.w.dtype) {
    case DType::F8_E4M3: return quant_gemm_typed<QKind::kFp8, float>(a, st);
    case DType::Q4:
      if (s == DType::BF16) return quant_gemm_typed<QKind::kQ4, __nv_bfloat16>(a, st);
      if (s == DType::F16) return quant_gemm_typed<QKind::kQ4, __half>(a, st);
      return quant_gemm_typed<QKind::kQ4, float>(a, st);
    case DType::Q8:
      if (s == DType::BF16) return quant_gemm_typed<QKind::kQ8, __nv_bfloat16>(a, st);
      if (s == DType::F16) return quant_gemm_typed<QKind::kQ8, __half>(a, st);
      return quant_gemm_typed<QKind::kQ8, float>(a, st);
    default: GLM5_FAIL("cuda gemm (quantized): weight dtype ", dtype_name(p.w.dtype), " not supported");
  }
}

void launch_dequantize_rows(const Weight& w, int64_t r0, int64_t rows, void* out, int64_t ldo, cudaStream_t st) {
  if (rows <= 0 || w.cols <= 0) return;
  DequantArgs a;
  a.w = static_cast<const uint8_t*>(w.data);
  a.row_bytes = int64_t(quant::row_bytes(w.dtype, w.ld));
  a.scale = w.scale, a.scale_ld = w.scale_ld, a.group = w.group;
  a.scale_block_rows = w.scale_block_rows;
  a.r0 = r0, a.rows = rows, a.cols = w.cols, a.out = out, a.ldo = ldo;
  const DType s = w.scale_dtype;
  switch (w.dtype) {
    case DType::F8_E4M3: return dequant_typed<QKind::kFp8, float, float>(a, st);
    case DType::Q4:
      if (s == DType::BF16) return dequant_typed<QKind::kQ4, __nv_bfloat16, __nv_bfloat16>(a, st);
      if (s == DType::F16) return dequant_typed<QKind::kQ4, __half, float>(a, st);
      return dequant_typed<QKind::kQ4, float, float>(a, st);
    case DType::Q8:
      if (s == DType::BF16) return dequant_typed<QKind::kQ8, __nv_bfloat16, __nv_bfloat16>(a, st);
      if (s == DType::F16) return dequant_typed<QKind::kQ8, __half, float>(a, st);
      return dequant_typed<QKind::kQ8, float, float>(a, st);
    default: GLM5_FAIL("cuda dequantize: weight dtype ", dtype_name(w.dtype), " not supported");
  }
}

}  // namespace glm5::kernels::cuda
