// CUDA kernels of the row-wise and element-wise ops (norms, RoPE, router, SwiGLU, embedding,
// gather, MoE combine, add) and the GEMM helpers around cuBLAS (activation split, combine, plain
// fallback GEMM). One block per row wherever a row is reduced, so a row's reduction order never
// depends on the batch. Attention, indexer and top-k live in ops_attention.cu.
#include <cfloat>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kernels.cuh"

namespace glm5::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;

// ---- norms -------------------------------------------------------------------------------------

__global__ void rms_norm_kernel(RmsNormParams p) {
  __shared__ float sh[33];
  const int64_t row = blockIdx.x;
  const float* x = p.x + row * p.ldx;
  float* y = p.y + row * p.ldy;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) ss = fmaf(x[j], x[j], ss);
  ss = block_sum(ss, sh);
  const float inv = 1.0f / sqrtf(ss / float(p.d) + p.eps);
  for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) y[j] = p.weight[j] * (x[j] * inv);
}

__global__ void layer_norm_kernel(LayerNormParams p) {
  __shared__ float sh[33];
  const int64_t row = blockIdx.x;
  const float* x = p.x + row * p.ldx;
  float* y = p.y + row * p.ldy;
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) s += x[j];
  const float mean = block_sum(s, sh) / float(p.d);
  float v = 0.0f;
  for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) {
    const float c = x[j] - mean;
    v = fmaf(c, c, v);
  }
  const float inv = 1.0f / sqrtf(block_sum(v, sh) / float(p.d) + p.eps);
  for (int64_t j = threadIdx.x; j < p.d; j += blockDim.x) y[j] = (x[j] - mean) * inv * p.weight[j] + p.bias[j];
}

// ---- RoPE --------------------------------------------------------------------------------------

// One thread per (token, head, pair). sincosf (not the fast intrinsic): angles reach 1e5 rad.
__global__ void rope_kernel(RopeParams p) {
  const int64_t half = p.rope_dim / 2, total = p.m * p.n_heads * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half, th = idx / half, head = th % p.n_heads, token = th / p.n_heads;
    float* base = p.x + token * p.token_stride + head * p.head_stride + p.offset;
    float s, c;
    sincosf(float(p.positions[token]) * p.inv_freq[i], &s, &c);
    c *= p.mscale;
    s *= p.mscale;
    float* a = p.interleaved ? base + 2 * i : base + i;
    float* b = p.interleaved ? base + 2 * i + 1 : base + i + half;
    const float xa = *a, xb = *b;
    *a = xa * c - xb * s;
    *b = xa * s + xb * c;
  }
}

// ---- router ------------------------------------------------------------------------------------

// Larger value wins; equal values go to the lower index; index -1 means "none yet".
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return bi < 0 || v > bv || (v == bv && i < bi);
}

// Block-wide argmax over vals[0, n) skipping taken[e] != 0; NaN counts as -inf. Every thread
// gets the winner's index (-1 only if all are taken).
__device__ int block_argmax(const float* vals, const unsigned char* taken, int n, float* shv, int* shi) {
  float bv = -INFINITY;
  int bi = -1;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    if (taken[e]) continue;
    const float v = isnan(vals[e]) ? -INFINITY : vals[e];
    if (better(v, e, bv, bi)) bv = v, bi = e;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, bv, o);
    const int oi = __shfl_xor_sync(kFullMask, bi, o);
    if (oi >= 0 && better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) shv[warp] = bv, shi[warp] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < n_warps; ++w)
      if (shi[w] >= 0 && better(shv[w], shi[w], bv, bi)) bv = shv[w], bi = shi[w];
    shi[32] = bi;
  }
  __syncthreads();
  return shi[32];
}

// One block per token row. Shared: sc[n], b[n], taken[n], group scores and kept flags.
__global__ void router_kernel(RouterParams p) {
  extern __shared__ float smem[];
  __shared__ float shv[33];
  __shared__ int shi[33];
  __shared__ int picked[64];
  const int n = int(p.n_experts), n_group = int(p.n_group), gsize = n / n_group;
  float* sc = smem;
  float* b = sc + n;
  float* gscore = b + n;
  unsigned char* taken = reinterpret_cast<unsigned char*>(gscore + n_group);
  unsigned char* gtaken = taken + n;
  const int64_t row = blockIdx.x;
  const float* logits = p.logits + row * p.n_experts;
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const float s = 1.0f / (1.0f + expf(-logits[e]));
    sc[e] = s;
    b[e] = p.bias ? s + p.bias[e] : s;
    taken[e] = 0;
  }
  for (int g = threadIdx.x; g < n_group; g += blockDim.x) gtaken[g] = 0;
  __syncthreads();
  if (n_group > 1) {
    // Group score: sum of the group's two largest b (largest first).
    for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
      float t1 = -INFINITY, t2 = -INFINITY;
      for (int j = g * gsize; j < (g + 1) * gsize; ++j) {
        const float v = isnan(b[j]) ? -INFINITY : b[j];
        if (v > t1)
          t2 = t1, t1 = v;
        else if (v > t2)
          t2 = v;
      }
      gscore[g] = gsize > 1 ? t1 + t2 : t1;
    }
    __syncthreads();
    for (int r = 0; r < int(p.topk_group); ++r) {
      const int g = block_argmax(gscore, gtaken, n_group, shv, shi);
      if (threadIdx.x == 0 && g >= 0) gtaken[g] = 1;
      __syncthreads();
    }
    // Experts of the dropped groups can no longer be chosen.
    for (int e = threadIdx.x; e < n; e += blockDim.x)
      if (!gtaken[e / gsize]) b[e] = -INFINITY;
    __syncthreads();
  }
  for (int r = 0; r < int(p.top_k); ++r) {
    const int e = block_argmax(b, taken, n, shv, shi);
    if (threadIdx.x == 0) {
      picked[r] = e;
      if (e >= 0) taken[e] = 1;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int k = int(p.top_k);
    for (int i = 1; i < k; ++i)  // ascending expert id: fixes the combine order
      for (int j = i; j > 0 && picked[j - 1] > picked[j]; --j) {
        const int t = picked[j];
        picked[j] = picked[j - 1];
        picked[j - 1] = t;
      }
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum += sc[picked[i]];
    for (int i = 0; i < k; ++i) {
      float w = sc[picked[i]];
      if (p.norm_topk_prob) w = w / (sum + 1e-20f);
      p.expert_ids[row * k + i] = picked[i];
      p.expert_weights[row * k + i] = w * p.routed_scaling_factor;
    }
  }
}

// ---- element-wise ------------------------------------------------------------------------------

__global__ void swiglu_kernel(SwigluParams p) {
  const int64_t total = p.m * p.n;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / p.n, j = idx % p.n;
    const float g = p.gate[i * p.ld_in + j], u = p.up[i * p.ld_in + j];
    p.out[i * p.ld_out + j] = g / (1.0f + expf(-g)) * u;
  }
}

template <typename T>
__global__ void embedding_kernel(EmbeddingParams p, int* err) {
  const int64_t hidden = p.table.cols, total = p.m * hidden;
  const T* table = static_cast<const T*>(p.table.data);
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / hidden, j = idx % hidden;
    const int32_t id = p.ids[i];
    if (id < 0 || id >= p.table.rows) {
      if (j == 0) report_error(err, kEmbeddingIdOutOfRange, id, i, p.table.rows);
      p.out[idx] = 0.0f;
      continue;
    }
    p.out[idx] = to_float(table[int64_t(id) * p.table.ld + j]);
  }
}

__global__ void gather_rows_kernel(GatherRowsParams p, int* err) {
  const int64_t total = p.n * p.d;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / p.d, j = idx % p.d;
    const int32_t r = p.rows[i];
    if (r < 0) {
      if (j == 0) report_error(err, kGatherRowNegative, r, i, 0);
      p.dst[idx] = 0.0f;
      continue;
    }
    p.dst[idx] = p.src[int64_t(r) * p.d + j];
  }
}

__global__ void moe_combine_kernel(MoeCombineParams p, int* err) {
  const int64_t total = p.m * p.d;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / p.d, c = idx % p.d;
    float acc = 0.0f;
    for (int64_t j = 0; j < p.top_k; ++j) {  // fixed j order: layout-invariant result
      const int32_t slot = p.slots[i * p.top_k + j];
      if (slot < 0) {
        if (slot < -1 && c == 0) report_error(err, kMoeSlotInvalid, slot, i, -1);
        continue;
      }
      acc += p.weights[i * p.top_k + j] * p.expert_out[int64_t(slot) * p.d + c];
    }
    p.out[idx] = p.accumulate ? p.out[idx] + acc : acc;
  }
}

__global__ void add_kernel(AddParams p) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < p.n; i += int64_t(gridDim.x) * blockDim.x)
    p.y[i] += p.x[i];
}

// dst = src with an F32 <-> BF16 conversion (bf16 KV cache writes and reads).
__global__ void convert_2d_kernel(Copy2dParams p) {
  const int64_t total = p.rows * p.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.cols, c = i % p.cols;
    float v;
    if (p.src_dtype == DType::BF16)
      v = __uint_as_float(uint32_t(static_cast<const uint16_t*>(p.src)[r * p.ld_src + c]) << 16);
    else
      v = static_cast<const float*>(p.src)[r * p.ld_src + c];
    if (p.dst_dtype == DType::BF16) {
      uint32_t u = __float_as_uint(v);
      uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40)
                                                   : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
      static_cast<uint16_t*>(p.dst)[r * p.ld_dst + c] = h;  // as f32_to_bf16 (core/dtype.h)
    } else {
      static_cast<float*>(p.dst)[r * p.ld_dst + c] = v;
    }
  }
}

// One thread per element: row i of src to pool element pages.at(i, pos[i], j, width) (bf16: as f32_to_bf16).
__global__ void paged_write_kernel(PagedWriteParams p) {
  const int64_t total = p.n * p.width;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / p.width, j = e % p.width;
    const int64_t at = p.pages.at(i, p.pos[i], j, p.width);
    const float v = p.src[i * p.ld_src + j];
    if (p.pages.dtype == DType::BF16) {
      const uint32_t u = __float_as_uint(v);
      static_cast<uint16_t*>(p.pool)[at] = (u & 0x7fffffffu) > 0x7f800000u
                                               ? uint16_t((u >> 16) | 0x40)
                                               : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    } else {
      static_cast<float*>(p.pool)[at] = v;
    }
  }
}

// ---- GEMM helpers ------------------------------------------------------------------------------

// x = hi + mid + lo exactly (each step's remainder is exact in fp32 and fits the next bf16).
__global__ void gemm_split_x_kernel(const float* x, int64_t ldx, int64_t rows, int64_t k, int terms, int64_t chunk_rows,
                                    void* xs, int64_t ldk) {
  const int64_t rows_pad = (rows + chunk_rows - 1) / chunk_rows * chunk_rows, total = rows_pad * k;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / k, c = idx % k, chunk = r / chunk_rows, rr = r % chunk_rows;
    float v = r < rows ? x[r * ldx + c] : 0.0f;
    if (terms == 0) {
      static_cast<float*>(xs)[(chunk * chunk_rows + rr) * ldk + c] = v;
      continue;
    }
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(xs);
    for (int t = 0; t < terms; ++t) {
      const __nv_bfloat16 h = __float2bfloat16_rn(v);
      out[((chunk * terms + t) * chunk_rows + rr) * ldk + c] = h;
      const float hf = __bfloat162float(h);
      v = isfinite(hf) ? v - hf : 0.0f;
    }
  }
}

__global__ void gemm_combine_kernel(const float* cs, int64_t ldc, int64_t rows, int64_t n, int terms,
                                    int64_t chunk_rows, float* y, int64_t ldy, bool accumulate) {
  const int t_count = terms < 1 ? 1 : terms;
  const int64_t total = rows * n;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / n, c = idx % n, chunk = r / chunk_rows, rr = r % chunk_rows;
    const float* base = cs + (chunk * t_count * chunk_rows + rr) * ldc + c;
    float v = base[(t_count - 1) * chunk_rows * ldc];
    for (int t = t_count - 2; t >= 0; --t) v += base[t * chunk_rows * ldc];
    float* out = y + r * ldy + c;
    *out = accumulate ? *out + v : v;
  }
}

// 64x64 output tile per block of 256 threads, 4x4 per thread, k in steps of 16 (ascending).
constexpr int kBM = 64, kBN = 64, kBK = 16;

template <typename W, bool kTrans>
__global__ void __launch_bounds__(256) gemm_simt_kernel(GemmParams p) {
  __shared__ float xs[kBK][kBM + 1];
  __shared__ float ws[kBK][kBN + 1];
  const W* w = static_cast<const W*>(p.w.data);
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t n0 = int64_t(blockIdx.x) * kBN, m0 = int64_t(blockIdx.y) * kBM;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < p.k; k0 += kBK) {
    for (int q = 0; q < 4; ++q) {
      const int e = tid + 256 * q;
      {
        const int i = e / kBK, kk = e % kBK;
        const int64_t r = m0 + i, c = k0 + kk;
        xs[kk][i] = (r < p.m && c < p.k) ? p.x[r * p.ldx + c] : 0.0f;
      }
      if (kTrans) {
        const int kk = e / kBN, j = e % kBN;
        const int64_t r = k0 + kk, c = n0 + j;
        ws[kk][j] = (r < p.k && c < p.n) ? to_float(w[r * p.w.ld + c]) : 0.0f;
      } else {
        const int j = e / kBK, kk = e % kBK;
        const int64_t r = n0 + j, c = k0 + kk;
        ws[kk][j] = (r < p.n && c < p.k) ? to_float(w[r * p.w.ld + c]) : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) a[u] = xs[kk][ty + 16 * u], b[u] = ws[kk][tx + 16 * u];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[u][v] = fmaf(a[u], b[v], acc[u][v]);
    }
    __syncthreads();
  }
  for (int u = 0; u < 4; ++u)
    for (int v = 0; v < 4; ++v) {
      const int64_t r = m0 + ty + 16 * u, c = n0 + tx + 16 * v;
      if (r >= p.m || c >= p.n) continue;
      float* out = p.y + r * p.ldy + c;
      *out = p.accumulate ? *out + acc[u][v] : acc[u][v];
    }
}

template <typename W>
void gemm_simt_typed(const GemmParams& p, cudaStream_t st) {
  const dim3 grid(unsigned((p.n + kBN - 1) / kBN), unsigned((p.m + kBM - 1) / kBM));
  if (p.trans_w)
    gemm_simt_kernel<W, true><<<grid, 256, 0, st>>>(p);
  else
    gemm_simt_kernel<W, false><<<grid, 256, 0, st>>>(p);
}

}  // namespace

const void* probe_kernel() { return reinterpret_cast<const void*>(&add_kernel); }

void launch_rms_norm(const RmsNormParams& p, cudaStream_t st) {
  rms_norm_kernel<<<unsigned(p.m), kRowThreads, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("rms_norm");
}

void launch_layer_norm(const LayerNormParams& p, cudaStream_t st) {
  layer_norm_kernel<<<unsigned(p.m), kRowThreads, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("layer_norm");
}

void launch_rope(const RopeParams& p, cudaStream_t st) {
  rope_kernel<<<grid_for(p.m * p.n_heads * (p.rope_dim / 2), 256), 256, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("rope");
}

void launch_router(const RouterParams& p, cudaStream_t st) {
  const size_t smem = size_t(p.n_experts) * (2 * sizeof(float) + 1) + size_t(p.n_group) * (sizeof(float) + 1) + 16;
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(router_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  router_kernel<<<unsigned(p.m), kRowThreads, smem, st>>>(p);
  CUDA_CHECK_LAUNCH("router");
}

void launch_swiglu(const SwigluParams& p, cudaStream_t st) {
  swiglu_kernel<<<grid_for(p.m * p.n, 256), 256, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("swiglu");
}

void launch_embedding(const EmbeddingParams& p, int* error_word, cudaStream_t st) {
  const unsigned grid = grid_for(p.m * p.table.cols, 256);
  switch (p.table.dtype) {
    case DType::F32: embedding_kernel<float><<<grid, 256, 0, st>>>(p, error_word); break;
    case DType::BF16: embedding_kernel<__nv_bfloat16><<<grid, 256, 0, st>>>(p, error_word); break;
    case DType::F16: embedding_kernel<__half><<<grid, 256, 0, st>>>(p, error_word); break;
    default: GLM5_FAIL("cuda embedding: table dtype ", dtype_name(p.table.dtype), " not supported");
  }
  CUDA_CHECK_LAUNCH("embedding");
}

void launch_gather_rows(const GatherRowsParams& p, int* error_word, cudaStream_t st) {
  gather_rows_kernel<<<grid_for(p.n * p.d, 256), 256, 0, st>>>(p, error_word);
  CUDA_CHECK_LAUNCH("gather_rows");
}

void launch_moe_combine(const MoeCombineParams& p, int* error_word, cudaStream_t st) {
  moe_combine_kernel<<<grid_for(p.m * p.d, 256), 256, 0, st>>>(p, error_word);
  CUDA_CHECK_LAUNCH("moe_combine");
}

void launch_add(const AddParams& p, cudaStream_t st) {
  add_kernel<<<grid_for(p.n, 256), 256, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("add");
}

void launch_paged_write(const PagedWriteParams& p, cudaStream_t st) {
  paged_write_kernel<<<grid_for(p.n * p.width, 256), 256, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("paged_write");
}

void launch_convert_2d(const Copy2dParams& p, cudaStream_t st) {
  convert_2d_kernel<<<grid_for(p.rows * p.cols, 256), 256, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("copy_2d (convert)");
}

void launch_gemm_split_x(const float* x, int64_t ldx, int64_t rows, int64_t k, int terms, int64_t chunk_rows, void* xs,
                         int64_t ldk, cudaStream_t st) {
  const int64_t rows_pad = (rows + chunk_rows - 1) / chunk_rows * chunk_rows;
  gemm_split_x_kernel<<<grid_for(rows_pad * k, 256), 256, 0, st>>>(x, ldx, rows, k, terms, chunk_rows, xs, ldk);
  CUDA_CHECK_LAUNCH("gemm split");
}

void launch_gemm_combine(const float* cs, int64_t ldc, int64_t rows, int64_t n, int terms, int64_t chunk_rows, float* y,
                         int64_t ldy, bool accumulate, cudaStream_t st) {
  gemm_combine_kernel<<<grid_for(rows * n, 256), 256, 0, st>>>(cs, ldc, rows, n, terms, chunk_rows, y, ldy, accumulate);
  CUDA_CHECK_LAUNCH("gemm combine");
}

void launch_gemm_simt(const GemmParams& p, cudaStream_t st) {
  CHECK((p.m + kBM - 1) / kBM <= 65535, "cuda gemm: m = ", p.m, " too large for the plain GEMM");
  switch (p.w.dtype) {
    case DType::F32: gemm_simt_typed<float>(p, st); break;
    case DType::BF16: gemm_simt_typed<__nv_bfloat16>(p, st); break;
    case DType::F16: gemm_simt_typed<__half>(p, st); break;
    default: GLM5_FAIL("cuda gemm: weight dtype ", dtype_name(p.w.dtype), " not supported");
  }
  CUDA_CHECK_LAUNCH("gemm (plain)");
}

}  // namespace glm5::kernels::cuda
