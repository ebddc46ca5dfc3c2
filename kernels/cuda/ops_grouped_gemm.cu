// The grouped GEMM of a MoE layer's experts: many independent y_i (+)= x_i W_i^T (fp32 x_i [m_i, k_i],
// W_i [n_i, k_i] row-major, fp32 y_i) in one launch on the tensor cores (bf16 MMA, fp32
// accumulators; nvcuda::wmma 16 x 16 x 16 fragments, compute capability >= 8.0). W_i is BF16, or
// quantized and dequantized while it is staged: each element's weight_at value (ops.h), rounded to
// bf16 (round to nearest even). That rounding is exact for Q4 / Q8 with BF16 scales (their values
// are bf16 numbers); for FP8 and other scales it is precision fast's weight rounding, and the
// backend sends such weights here only in fast's one term.
//
// Why our own kernel and not cuBLAS's grouped call: cuBLAS picks its algorithm (tile, split-K) per
// call from all the groups' sizes, so a row's bits would depend on how many tokens the other
// experts got. Here every output element is made the same way whatever m_i is and whatever else
// is in the launch: one CTA owns a kGM x kGN tile of one GEMM, no split-K, and the element's sum
// runs over k in steps of 16, ascending, one MMA per step and x term, each term into its own
// accumulator; the terms are added smallest first at the end (as the cuBLAS path's combine). Rows
// past m_i and k past k_i are zeros in shared memory and add exact zeros.
//
// x is split into `terms` bf16 parts while it is staged (x = hi + mid + lo, exact for finite x with
// 3, as gemm_split_x): 3 in Precision::kExact, 1 (x rounded to bf16) in kFast.
//
// A launch is a flat grid of CTAs over all the GEMMs' tiles: GEMM i owns the CTAs [tile0_i,
// tile0_{i+1}); within it, consecutive CTAs walk down the row tiles of one column tile, so the
// CTAs that read the same weight rows run together (L2 reuse at prefill).
#include <mma.h>

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kernels.cuh"

namespace glm5::kernels::cuda {
namespace {

constexpr int kGM = 64;            // rows of x per CTA tile
constexpr int kGN = 64;            // columns of y (rows of W) per CTA tile
constexpr int kGK = 32;            // k per staged slice (two MMA steps)
constexpr int kGPitch = kGK + 8;   // bf16 pitch of the staged slices: 80-byte rows keep the
                                   // fragments 32-byte aligned and spread the banks
constexpr int kGCPitch = kGN + 4;  // fp32 pitch of the output tile
constexpr int kGThreads = 128;     // 4 warps as 2 x 2, each owning 32 x 32 of the tile
constexpr int kGMaxTerms = 3;

struct GroupedTiles {
  __nv_bfloat16 a[kGMaxTerms][kGM][kGPitch];  // x's terms, rows x k
  __nv_bfloat16 b[kGN][kGPitch];              // W's rows x k (column-major k x n for the MMA)
  float c[kGM][kGCPitch];                     // the finished tile before it goes to y
};

// The GEMM that owns CTA `tile`: the last item whose tile0 <= tile (items sorted by tile0).
__device__ __forceinline__ int item_of(const GroupedGemmItem* items, int n_items, int64_t tile) {
  int lo = 0, hi = n_items - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (items[mid].tile0 <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// x rows [r0, r0 + kGM) x k [k0, k0 + kGK) into the terms' slices (zeros outside [m, k)).
template <int kTerms>
__device__ __forceinline__ void stage_x(const GroupedGemmItem& g, int64_t r0, int64_t k0, GroupedTiles& s) {
#pragma unroll 4
  for (int idx = threadIdx.x; idx < kGM * kGK; idx += kGThreads) {
    const int r = idx / kGK, c = idx % kGK;  // a warp reads 32 consecutive floats of one row
    const int64_t row = r0 + r, col = k0 + c;
    float v = row < g.m && col < g.k ? g.x[row * g.ldx + col] : 0.0f;
#pragma unroll
    for (int t = 0; t < kTerms; ++t) {
      const __nv_bfloat16 h = __float2bfloat16_rn(v);
      s.a[t][r][c] = h;
      const float hf = __bfloat162float(h);
      v = isfinite(hf) ? v - hf : 0.0f;
    }
  }
}

// A scale of a quantized weight, as a float.
__device__ __forceinline__ float scale_value(const GroupedGemmItem& g, int64_t i) {
  if (g.scale_dtype == DType::BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(g.scale)[i]);
  if (g.scale_dtype == DType::F16) return __half2float(static_cast<const __half*>(g.scale)[i]);
  return static_cast<const float*>(g.scale)[i];
}

// weight_at(row, col) of a quantized W (row < n, col < k), rounded to bf16.
__device__ __forceinline__ __nv_bfloat16 quant_value(const GroupedGemmItem& g, int64_t row, int64_t col) {
  const uint8_t* r = static_cast<const uint8_t*>(g.w) + row * g.w_row;
  const float s = scale_value(g, row / g.scale_block_rows * g.scale_ld + col / g.group);
  float v;
  if (g.kind == GroupedWeight::kFp8) {
    v = __fmul_rn(fp8_e4m3(__ldg(r + col)), s);
  } else {
    const uint32_t b = g.kind == GroupedWeight::kQ4 ? __ldg(r + col / 2) : __ldg(r + col);
    const int code = g.kind == GroupedWeight::kQ4 ? int(col & 1 ? b >> 4 : b & 0xfu) - 8 : int(b) - 128;
    v = __fmul_rn(float(code), s);
    if (g.scale_dtype == DType::BF16) v = round_to_scale<__nv_bfloat16>(v);
    if (g.scale_dtype == DType::F16) v = round_to_scale<__half>(v);
  }
  return __float2bfloat16_rn(v);
}

// W rows [c0, c0 + kGN) x k [k0, k0 + kGK) (zeros outside [n, k)). BF16: 16-byte loads where the
// host found every row start and k itself 16-byte aligned (`vec`), else element loads; quantized:
// element by element (a warp reads 32 consecutive elements of one row).
__device__ __forceinline__ void stage_w(const GroupedGemmItem& g, int64_t c0, int64_t k0, GroupedTiles& s) {
  const __nv_bfloat16* w = static_cast<const __nv_bfloat16*>(g.w);
  if (g.vec) {
    for (int idx = threadIdx.x; idx < kGN * (kGK / 8); idx += kGThreads) {
      const int r = idx / (kGK / 8), c = idx % (kGK / 8) * 8;
      const int64_t row = c0 + r, col = k0 + c;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < g.n && col < g.k) v = __ldg(reinterpret_cast<const uint4*>(w + row * g.w_row + col));
      *reinterpret_cast<uint4*>(&s.b[r][c]) = v;
    }
    return;
  }
  const bool bf16 = g.kind == GroupedWeight::kBf16;
  for (int idx = threadIdx.x; idx < kGN * kGK; idx += kGThreads) {
    const int r = idx / kGK, c = idx % kGK;
    const int64_t row = c0 + r, col = k0 + c;
    __nv_bfloat16 v = __float2bfloat16_rn(0.0f);
    if (row < g.n && col < g.k) v = bf16 ? w[row * g.w_row + col] : quant_value(g, row, col);
    s.b[r][c] = v;
  }
}

template <int kTerms>
__global__ void __launch_bounds__(kGThreads) gemm_grouped_kernel(const GroupedGemmItem* items, int n_items) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  __shared__ __align__(128) GroupedTiles s;

  // This CTA's GEMM, by reference (a copy in registers takes 32-85 more of them per thread).
  const GroupedGemmItem& g = items[item_of(items, n_items, blockIdx.x)];
  const int64_t t = int64_t(blockIdx.x) - g.tile0, row_tiles = (g.m + kGM - 1) / kGM;
  const int64_t r0 = t % row_tiles * kGM, c0 = t / row_tiles * kGN;
  const int warp = threadIdx.x / 32, wr = warp / 2 * 32, wc = warp % 2 * 32;

  FragC acc[kTerms][2][2];
#pragma unroll
  for (int q = 0; q < kTerms; ++q)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[q][i][j], 0.0f);

  for (int64_t k0 = 0; k0 < g.k; k0 += kGK) {
    stage_x<kTerms>(g, r0, k0, s);
    stage_w(g, c0, k0, s);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGK; kk += 16) {  // k ascending, one MMA per step, term and fragment
      FragB b[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &s.b[wc + 16 * j][kk], kGPitch);
#pragma unroll
      for (int q = 0; q < kTerms; ++q)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          FragA a;
          wmma::load_matrix_sync(a, &s.a[q][wr + 16 * i][kk], kGPitch);
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[q][i][j], a, b[j], acc[q][i][j]);
        }
    }
    __syncthreads();  // the slices are read before the next ones are staged
  }

  // The terms' sums, smallest first (every accumulator has the same element layout), into the tile.
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      FragC sum = acc[kTerms - 1][i][j];
#pragma unroll
      for (int q = kTerms - 2; q >= 0; --q)
#pragma unroll
        for (int e = 0; e < sum.num_elements; ++e) sum.x[e] += acc[q][i][j].x[e];
      wmma::store_matrix_sync(&s.c[wr + 16 * i][wc + 16 * j], sum, kGCPitch, wmma::mem_row_major);
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kGM * kGN; idx += kGThreads) {  // a warp writes 32 consecutive floats
    const int r = idx / kGN, c = idx % kGN;
    const int64_t row = r0 + r, col = c0 + c;
    if (row >= g.m || col >= g.n) continue;
    float* out = g.y + row * g.ldy + col;
    *out = g.accumulate ? *out + s.c[r][c] : s.c[r][c];
  }
#else
  __trap();  // code for an architecture without bf16 MMA (the host launches only on >= 8.0)
#endif
}

}  // namespace

int64_t grouped_gemm_tiles(int64_t m, int64_t n) { return (m + kGM - 1) / kGM * ((n + kGN - 1) / kGN); }

void launch_gemm_grouped(const GroupedGemmItem* items, int n_items, int64_t tiles, int terms, cudaStream_t st) {
  CHECK(tiles > 0 && tiles < (int64_t(1) << 31), "cuda grouped gemm: ", tiles, " tiles do not fit one launch");
  const unsigned grid = unsigned(tiles);
  switch (terms) {
    case 1: gemm_grouped_kernel<1><<<grid, kGThreads, 0, st>>>(items, n_items); break;
    case 2: gemm_grouped_kernel<2><<<grid, kGThreads, 0, st>>>(items, n_items); break;
    case 3: gemm_grouped_kernel<3><<<grid, kGThreads, 0, st>>>(items, n_items); break;
    default: GLM5_FAIL("cuda grouped gemm: terms must be 1, 2 or 3, found ", terms);
  }
  CUDA_CHECK_LAUNCH("grouped gemm");
}

}  // namespace glm5::kernels::cuda
