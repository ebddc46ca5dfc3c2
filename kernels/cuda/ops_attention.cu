// CUDA kernels of the attention-side ops: DSA indexer scores, per-row top-k, naive MLA prefill
// and weight-absorbed MLA decode. Top-k is an exact 4-pass radix select per row (one block per
// row), so its selection equals the reference rule bit for bit; attention is one block per
// (query row, head) with an online softmax whose order depends only on that row's keys.
#include <cfloat>
#include <cmath>

#include "common.cuh"
#include "cuda_check.h"
#include "kernels.cuh"

namespace glm5::kernels::cuda {
namespace {

// Element i of a cached row array stored as F32, or as BF16 (a bf16 KV cache; widened exactly).
__device__ __forceinline__ float cached(const float* base, int64_t i, bool bf16) {
  if (bf16) return __uint_as_float(uint32_t(reinterpret_cast<const unsigned short*>(base)[i]) << 16);
  return __ldg(base + i);
}

// Largest dynamic shared memory one block may take on the current device (opt-in limit).
int max_dynamic_smem() {
  int dev = 0, v = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return v;
}

template <typename Kernel>
void reserve_smem(Kernel kernel, size_t bytes, const char* op, const char* what) {
  if (bytes <= 48 * 1024) return;
  CHECK(bytes <= size_t(max_dynamic_smem()), "cuda ", op, ": ", what, " needs ", bytes,
        " bytes of shared memory per block, the device allows ", max_dynamic_smem());
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// ---- indexer scores ----------------------------------------------------------------------------

constexpr int kIdxWarps = 8, kIdxKeysPerWarp = 32, kIdxKeysPerBlock = kIdxWarps * kIdxKeysPerWarp;
constexpr int kIdxMaxPerLane = 8;  // head_dim <= 256 keeps the key row in registers

// Block = (query row s, tile of 256 keys); warp = one key at a time, lanes split head_dim.
// Per key: sum over heads in ascending order of w[h] * relu(q[h] . k) (each dot: lane-strided
// partial sums, then a fixed butterfly).
__global__ void __launch_bounds__(kIdxWarps * 32) indexer_scores_kernel(IndexerScoresParams p) {
  extern __shared__ float smem[];
  const int64_t tiles = (p.t + kIdxKeysPerBlock - 1) / kIdxKeysPerBlock;
  const int64_t s = blockIdx.x / tiles, t0 = (blockIdx.x % tiles) * kIdxKeysPerBlock;
  const int64_t hd = p.head_dim, nh = p.n_heads, qpos = p.q_pos[s];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* row = p.scores + s * p.ld_scores;
  if (t0 > qpos) {  // the whole tile is in the future
    for (int64_t t = t0 + threadIdx.x; t < p.t && t < t0 + kIdxKeysPerBlock; t += blockDim.x)
      row[t] = -INFINITY;
    return;
  }
  float* q = smem;         // [n_heads * head_dim]
  float* w = q + nh * hd;  // [n_heads]
  for (int64_t i = threadIdx.x; i < nh * hd; i += blockDim.x) q[i] = p.q[s * nh * hd + i];
  for (int64_t i = threadIdx.x; i < nh; i += blockDim.x) w[i] = p.weights[s * nh + i];
  __syncthreads();
  for (int j = 0; j < kIdxKeysPerWarp; ++j) {
    const int64_t t = t0 + warp + int64_t(kIdxWarps) * j;
    if (t >= p.t) break;
    if (t > qpos) {
      if (lane == 0) row[t] = -INFINITY;
      continue;
    }
    const int64_t k = p.pages.row(s, t) * hd;  // element offset of the key row
    const bool bf16 = p.pages.dtype == DType::BF16;
    float acc = 0.0f;
    if (hd <= 32 * kIdxMaxPerLane) {
      float kr[kIdxMaxPerLane];
#pragma unroll
      for (int u = 0; u < kIdxMaxPerLane; ++u) {
        const int64_t d = lane + 32 * u;
        kr[u] = d < hd ? cached(p.k, k + d, bf16) : 0.0f;
      }
      for (int64_t h = 0; h < nh; ++h) {
        const float* qh = q + h * hd;
        float part = 0.0f;
#pragma unroll
        for (int u = 0; u < kIdxMaxPerLane; ++u) {
          const int64_t d = lane + 32 * u;
          if (d < hd) part = fmaf(qh[d], kr[u], part);
        }
        acc += w[h] * fmaxf(warp_sum(part), 0.0f);
      }
    } else {
      for (int64_t h = 0; h < nh; ++h) {
        const float* qh = q + h * hd;
        float part = 0.0f;
        for (int64_t d = lane; d < hd; d += 32) part = fmaf(qh[d], cached(p.k, k + d, bf16), part);
        acc += w[h] * fmaxf(warp_sum(part), 0.0f);
      }
    }
    if (lane == 0) row[t] = acc;
  }
}

// ---- top-k -------------------------------------------------------------------------------------

constexpr int kTopkThreads = 1024;

// Order-preserving map of a finite float to uint32 (larger float -> larger key); -0 == +0.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum over the block (blockDim.x == kTopkThreads); *total gets the block sum.
// `sh` holds >= 33 ints.
__device__ __forceinline__ int block_exclusive_scan(int v, int* sh, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();
  if (lane == 31) sh[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int wv = lane < n_warps ? sh[lane] : 0, winc = wv;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(kFullMask, winc, o);
      if (lane >= o) winc += n;
    }
    if (lane < n_warps) sh[lane] = winc - wv;  // exclusive warp offsets
    if (lane == 31) sh[32] = winc;
  }
  __syncthreads();
  *total = sh[32];
  return sh[warp] + inc - v;
}

// One block per row. Radix select finds the key of the k-th largest finite entry (4 passes of
// 8 bits; pass 0 also counts the finite entries), then one ordered compaction pass writes, in
// ascending index order, every entry above that key and the first `need` entries equal to it:
// exactly "the k largest, ties to the lower index, sorted ascending".
__global__ void __launch_bounds__(kTopkThreads) topk_kernel(TopkParams p) {
  __shared__ int hist[256];
  __shared__ int scan_sh[33];
  __shared__ uint32_t sel_prefix;
  __shared__ int sel_need, n_finite;
  const int64_t row = blockIdx.x;
  const float* x = p.scores + row * p.ld;
  int32_t* out = p.indices + row * p.k;
  uint32_t prefix = 0, mask = 0;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int64_t t = threadIdx.x; t < p.cols; t += blockDim.x) {
      const float f = x[t];
      if (!isfinite(f)) continue;
      const uint32_t key = order_key(f);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (pass == 0) {
        int n = 0;
        for (int b = 0; b < 256; ++b) n += hist[b];
        n_finite = n;
        sel_need = int(p.k < n ? p.k : n);
      }
      if (n_finite > p.k) {  // else every finite entry is taken: no threshold needed
        int need = sel_need, b = 255;
        for (; b > 0 && hist[b] < need; --b) need -= hist[b];
        sel_need = need;
        sel_prefix = prefix | (uint32_t(b) << shift);
      }
    }
    __syncthreads();
    if (n_finite <= p.k) break;
    prefix = sel_prefix;
    mask |= 255u << shift;
  }
  const bool take_all = n_finite <= p.k;
  const uint32_t kth = prefix;
  const int need = sel_need;  // entries equal to kth to take (take_all: unused)
  int written = 0, eq_seen = 0;
  for (int64_t base = 0; base < p.cols && written < int(p.k); base += blockDim.x) {
    const int64_t t = base + threadIdx.x;
    const float f = t < p.cols ? x[t] : NAN;
    const bool fin = isfinite(f);
    const uint32_t key = fin ? order_key(f) : 0u;
    bool sel;
    if (take_all) {
      sel = fin;
    } else {
      const bool eq = fin && key == kth;
      int eq_total;
      const int eq_rank = eq_seen + block_exclusive_scan(eq ? 1 : 0, scan_sh, &eq_total);
      eq_seen += eq_total;
      sel = (fin && key > kth) || (eq && eq_rank < need);
    }
    int sel_total;
    const int pos = written + block_exclusive_scan(sel ? 1 : 0, scan_sh, &sel_total);
    if (sel && pos < p.k) out[pos] = int32_t(t);
    written += sel_total;
  }
  for (int64_t i = written + threadIdx.x; i < p.k; i += blockDim.x) out[i] = -1;
}

// ---- MLA attention (both modes) ----------------------------------------------------------------

constexpr int kSelectThreads = 512;
constexpr int kMaxTopkLen = 16384;  // the sort of one row's list lives in shared memory

// One block per query row: the row's top-k list as a set, as the reference reads it. Sorts the
// list in shared memory (bitonic), then writes each key once, ascending, if 0 <= t <= q_pos and
// t < T: keys[s, 0:counts[s]]. Entries outside [-1, T) are reported as errors and skipped.
__global__ void __launch_bounds__(kSelectThreads)
    select_keys_kernel(const int32_t* topk, int64_t len, const int32_t* q_pos, int64_t t_count,
                       int n_pow2, int32_t* keys, int32_t* counts, int* err) {
  extern __shared__ int32_t list[];  // [n_pow2], then 33 ints of scan scratch
  int* scan = list + n_pow2;
  const int64_t s = blockIdx.x;
  const int32_t* row = topk + s * len;
  for (int i = threadIdx.x; i < n_pow2; i += blockDim.x) {
    int32_t v = INT32_MAX;  // padding and -1 sort last and are dropped
    if (i < len) {
      v = row[i];
      if (v < -1 || v >= t_count) report_error(err, kTopkEntryOutOfRange, v, s, t_count);
      if (v < 0 || v >= t_count) v = INT32_MAX;
    }
    list[i] = v;
  }
  __syncthreads();
  for (int size = 2; size <= n_pow2; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n_pow2 / 2; i += blockDim.x) {
        const int lo = ((i & ~(stride - 1)) << 1) | (i & (stride - 1)), hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        const int32_t a = list[lo], b = list[hi];
        if ((a > b) == ascending) list[lo] = b, list[hi] = a;
      }
      __syncthreads();
    }
  const int64_t last = q_pos[s] < t_count - 1 ? q_pos[s] : t_count - 1;
  int written = 0;
  for (int base = 0; base < n_pow2; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int32_t v = i < n_pow2 ? list[i] : INT32_MAX;
    const bool keep = v != INT32_MAX && v <= last && (i == 0 || list[i - 1] != v);
    int total;
    const int pos = written + block_exclusive_scan(keep ? 1 : 0, scan, &total);
    if (keep) keys[s * len + pos] = v;
    written += total;
  }
  if (threadIdx.x == 0) counts[s] = written;
}

// One query row (s, h) attends over keys t. The key is [ka(t, h) (da values) | kb(t) (db)], the
// value v(t, h) (dv values). prefill: ka = k_nope, kb = k_pe, v = v;  decode: ka = c_kv,
// kb = k_pe (both rows of the latent cache), v = c_kv.
struct AttnArgs {
  const float* q;
  int64_t q_stride_s, q_stride_h;
  const float* ka;
  int64_t ka_stride_t, ka_stride_h, da;
  const float* kb;
  int64_t kb_stride_t, db;
  int64_t kb_offset;  // elements from kb to the k_pe part of a row (decode: kv_lora_rank; prefill: 0)
  const float* v;
  int64_t v_stride_t, v_stride_h, dv;
  const int32_t* q_pos;
  const int32_t* keys;    // select_keys_kernel output [s, keys_ld], or nullptr: dense causal
  const int32_t* counts;  // [s]
  int64_t keys_ld;
  float* out;
  int64_t s, t, n_heads;
  float scale;
  KeyPages pages;  // paged key/value rows (decode over a paged latent cache); contiguous by default
};

constexpr int kAttnWarps = 8;

// Block = (s, h); warp w takes candidates w, w + 8, ... with its own running max / sum /
// accumulator (online softmax); the 8 partial results are merged in warp order at the end, so
// the order depends only on the row's own keys. Candidates: t = 0..min(q_pos, T - 1), or the
// row's selected keys. No allowed key: zeros (as the reference).
__global__ void __launch_bounds__(kAttnWarps * 32) mla_attention_kernel(AttnArgs a) {
  extern __shared__ float smem[];
  __shared__ float warp_m[kAttnWarps], warp_l[kAttnWarps];
  const int64_t s = blockIdx.x / a.n_heads, h = blockIdx.x % a.n_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t dq = a.da + a.db;
  float* q = smem;                    // [da + db]
  float* acc = q + dq + warp * a.dv;  // this warp's [dv]
  const float* qg = a.q + s * a.q_stride_s + h * a.q_stride_h;
  for (int64_t i = threadIdx.x; i < dq; i += blockDim.x) q[i] = qg[i];
  for (int64_t i = lane; i < a.dv; i += 32) acc[i] = 0.0f;
  __syncthreads();
  const int64_t qpos = a.q_pos[s];
  const int64_t last = qpos < a.t - 1 ? qpos : a.t - 1;
  const int64_t n_cand = a.keys ? int64_t(a.counts[s]) : last + 1;
  const int32_t* keys = a.keys ? a.keys + s * a.keys_ld : nullptr;
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = warp; j < n_cand; j += kAttnWarps) {
    const int64_t t = a.pages.row(s, keys ? int64_t(keys[j]) : j);  // the key's row in the cache
    const bool bf16 = a.pages.dtype == DType::BF16;
    const int64_t ka = t * a.ka_stride_t + h * a.ka_stride_h, kb = t * a.kb_stride_t + a.kb_offset;  // elements
    float part = 0.0f;
    for (int64_t d = lane; d < a.da; d += 32) part = fmaf(q[d], cached(a.ka, ka + d, bf16), part);
    for (int64_t d = lane; d < a.db; d += 32) part = fmaf(q[a.da + d], cached(a.kb, kb + d, bf16), part);
    const float score = a.scale * warp_sum(part);
    if (score > m) {
      const float corr = expf(m - score);  // 0 on the first key
      l *= corr;
      for (int64_t d = lane; d < a.dv; d += 32) acc[d] *= corr;
      m = score;
    }
    const float pr = expf(score - m);
    l += pr;
    const int64_t v = t * a.v_stride_t + h * a.v_stride_h;
    for (int64_t d = lane; d < a.dv; d += 32) acc[d] = fmaf(pr, cached(a.v, v + d, bf16), acc[d]);
  }
  if (lane == 0) warp_m[warp] = m, warp_l[warp] = l;
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w)
    if (warp_l[w] > 0.0f) m_all = fmaxf(m_all, warp_m[w]);
  float f[kAttnWarps], l_all = 0.0f;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) {
    f[w] = warp_l[w] > 0.0f ? expf(warp_m[w] - m_all) : 0.0f;
    l_all += f[w] * warp_l[w];
  }
  float* out = a.out + (s * a.n_heads + h) * a.dv;
  const float* acc0 = q + dq;
  for (int64_t d = threadIdx.x; d < a.dv; d += blockDim.x) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) o += f[w] * acc0[w * a.dv + d];
    out[d] = l_all > 0.0f ? o / l_all : 0.0f;
  }
}

// Runs the key selection when a top-k list is given (into `scratch`, which holds
// s * (topk_len + 1) ints), then the attention.
void launch_attention(AttnArgs a, const int32_t* topk, int64_t topk_len, int32_t* scratch, int* err,
                      cudaStream_t st, const char* op) {
  if (a.s == 0 || a.n_heads == 0) return;
  CHECK(a.s < (int64_t(1) << 31) / (a.n_heads > 0 ? a.n_heads : 1), "cuda ", op, ": s = ", a.s,
        " x n_heads = ", a.n_heads, " too large for one launch");
  if (topk) {
    CHECK(topk_len <= kMaxTopkLen, "cuda ", op, ": topk_len ", topk_len, " > ", kMaxTopkLen,
          " is not supported");
    int n_pow2 = 1;
    while (n_pow2 < topk_len) n_pow2 <<= 1;
    const size_t smem = size_t(n_pow2 + 33) * sizeof(int32_t);
    reserve_smem(select_keys_kernel, smem, op, "topk_len");
    a.keys = scratch, a.counts = scratch + a.s * topk_len, a.keys_ld = topk_len;
    select_keys_kernel<<<unsigned(a.s), kSelectThreads, smem, st>>>(
        topk, topk_len, a.q_pos, a.t, n_pow2, scratch, scratch + a.s * topk_len, err);
    CUDA_CHECK_LAUNCH(op);
  }
  const size_t smem = size_t(a.da + a.db + kAttnWarps * a.dv) * sizeof(float);
  reserve_smem(mla_attention_kernel, smem, op, "head dims");
  mla_attention_kernel<<<unsigned(a.s * a.n_heads), kAttnWarps * 32, smem, st>>>(a);
  CUDA_CHECK_LAUNCH(op);
}

}  // namespace

void launch_indexer_scores(const IndexerScoresParams& p, cudaStream_t st) {
  const size_t smem = size_t(p.n_heads * p.head_dim + p.n_heads) * sizeof(float);
  reserve_smem(indexer_scores_kernel, smem, "indexer_scores", "n_heads * head_dim");
  const int64_t blocks = p.s * ((p.t + kIdxKeysPerBlock - 1) / kIdxKeysPerBlock);
  CHECK(blocks < (int64_t(1) << 31), "cuda indexer_scores: s = ", p.s, ", t = ", p.t,
        " too large for one launch");
  indexer_scores_kernel<<<unsigned(blocks), kIdxWarps * 32, smem, st>>>(p);
  CUDA_CHECK_LAUNCH("indexer_scores");
}

void launch_topk(const TopkParams& p, cudaStream_t st) {
  topk_kernel<<<unsigned(p.rows), kTopkThreads, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("topk");
}

void launch_mla_prefill(const MlaPrefillParams& p, int32_t* scratch, int* error_word,
                        cudaStream_t st) {
  const int64_t kv_row = p.qk_nope_head_dim + p.v_head_dim;
  const int64_t dq = p.qk_nope_head_dim + p.qk_rope_head_dim;
  AttnArgs a{};
  a.q = p.q, a.q_stride_h = dq, a.q_stride_s = p.n_heads * dq;
  a.ka = p.kv, a.ka_stride_t = p.n_heads * kv_row, a.ka_stride_h = kv_row;
  a.da = p.qk_nope_head_dim;
  a.kb = p.k_pe, a.kb_stride_t = p.ld_k_pe, a.db = p.qk_rope_head_dim;
  a.v = p.kv + p.qk_nope_head_dim, a.v_stride_t = p.n_heads * kv_row, a.v_stride_h = kv_row;
  a.dv = p.v_head_dim;
  a.q_pos = p.q_pos, a.out = p.out, a.s = p.s, a.t = p.t, a.n_heads = p.n_heads;
  a.scale = p.scale;
  launch_attention(a, p.topk, p.topk_len, scratch, error_word, st, "mla_prefill");
}

void launch_mla_decode(const MlaDecodeParams& p, int32_t* scratch, int* error_word,
                       cudaStream_t st) {
  const int64_t row = p.kv_lora_rank + p.qk_rope_head_dim;
  AttnArgs a{};
  a.q = p.q_lat, a.q_stride_h = row, a.q_stride_s = p.n_heads * row;
  a.ka = p.cache, a.ka_stride_t = row, a.ka_stride_h = 0, a.da = p.kv_lora_rank;
  a.kb = p.cache, a.kb_offset = p.kv_lora_rank, a.kb_stride_t = row, a.db = p.qk_rope_head_dim;
  a.v = p.cache, a.v_stride_t = row, a.v_stride_h = 0, a.dv = p.kv_lora_rank;
  a.q_pos = p.q_pos, a.out = p.out_lat, a.s = p.s, a.t = p.t, a.n_heads = p.n_heads;
  a.scale = p.scale;
  a.pages = p.pages;
  launch_attention(a, p.topk, p.topk_len, scratch, error_word, st, "mla_decode");
}

}  // namespace glm5::kernels::cuda
