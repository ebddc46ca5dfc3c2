// CUDA kernels of the attention-side ops: DSA indexer scores, per-row top-k, naive MLA prefill
// and weight-absorbed MLA decode. Top-k is an exact 4-pass radix select per row (one block per
// row), so its selection equals the reference rule bit for bit. The indexer and MLA decode read
// each cached key row from global memory once per query row into a shared-memory tile that all
// heads of the row (the indexer's heads; up to 64 MLA heads, FlashMLA's head block) then use.
// Prefill attention is one block per (query row, head) with an online softmax. For BF16 caches,
// MLA decode and the indexer also have tensor-core kernels (bf16 MMAs on q split into 3 exact bf16
// terms; opt-in, see backend_cuda.cu). Every result's reduction order depends only on that row's
// own inputs, never on how many rows a call has.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kernels.cuh"

namespace glm5::kernels::cuda {
namespace {

// Element i of a cached row array stored as F32, or as BF16 (a bf16 KV cache; widened exactly).
__device__ __forceinline__ float cached(const float* base, int64_t i, bool bf16) {
  if (bf16) return __uint_as_float(uint32_t(reinterpret_cast<const unsigned short*>(base)[i]) << 16);
  return __ldg(base + i);
}

// Four BF16 values (two little-endian words, element 2i in the low half) widened exactly.
__device__ __forceinline__ float4 bf16x4_to_float4(uint2 u) {
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}

// One warp copies cached row `row` (dk elements of F32 or BF16 at `base`) into dst[0:dk) as floats.
// `vec`: dk % 4 == 0 and `base` 16-byte (F32) / 8-byte (BF16) aligned, so every row is too; dst
// is 16-byte aligned. Coalesced: consecutive lanes read consecutive elements.
__device__ __forceinline__ void load_row_warp(const void* base, int64_t row, int64_t dk, bool bf16, bool vec,
                                              float* dst, int lane) {
  if (vec) {
    const int64_t n4 = dk / 4;
    float4* d4 = reinterpret_cast<float4*>(dst);
    if (bf16) {
      const uint2* src = reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(base) + row * dk);
#pragma unroll 4
      for (int64_t v = lane; v < n4; v += 32) d4[v] = bf16x4_to_float4(__ldg(src + v));
    } else {
      const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(base) + row * dk);
#pragma unroll 4
      for (int64_t v = lane; v < n4; v += 32) d4[v] = __ldg(src + v);
    }
  } else {
    const float* b = static_cast<const float*>(base);
    for (int64_t d = lane; d < dk; d += 32) dst[d] = cached(b, row * dk + d, bf16);
  }
}

// acc + x . y as one fmaf chain in element order (x, y, z, w): the order a dot takes everywhere
// below, so a dot's value depends on its operands only.
__device__ __forceinline__ float dot4(float4 x, float4 y, float acc) {
  acc = __fmaf_rn(x.x, y.x, acc);
  acc = __fmaf_rn(x.y, y.y, acc);
  acc = __fmaf_rn(x.z, y.z, acc);
  return __fmaf_rn(x.w, y.w, acc);
}

int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }

// Shared-memory pitch (floats) of rows that 8 consecutive lanes read as float4 at the same
// column, one row each: >= d4 and = 4 (mod 32), so the 8 reads start 4 banks apart and fill the
// 32 banks once (no conflict).
int conflict_free_pitch(int64_t d4) { return int(d4 + (36 - d4 % 32) % 32); }

bool aligned_rows(const void* base, int64_t dk, DType dtype) {
  const uintptr_t need = dtype == DType::BF16 ? 8 : 16;
  return dk % 4 == 0 && reinterpret_cast<uintptr_t>(base) % need == 0;
}

// Largest dynamic shared memory one block may take on the current device (opt-in limit).
int max_dynamic_smem() {
  int dev = 0, v = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return v;
}

int multiprocessor_count() {
  int dev = 0, v = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
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

// Block = (query row s, tile of kIdxTile keys). The tile's key rows are read from global memory
// once, a warp per row (coalesced), into shared memory k_s [kIdxTile][pitch]; q [n_heads][d4] and
// the head weights of row s sit beside them. Thread (group g = tid / 64, kl = tid % 64) scores
// keys kl and kl + 64 against heads g, g + 4, g + 8, ..., kIdxHeadChunk heads at a time: 2 x 8
// register accumulators, each key float4 read feeding 8 heads, each q float4 read (a broadcast:
// the 32 lanes of a warp share the head) feeding 2 keys.
// Per (s, t): dot_h is one fmaf chain over d ascending; S_g = fmaf chain of w_h * relu(dot_h)
// over the group's heads ascending; score = (S_0 + S_1) + (S_2 + S_3). Nothing depends on the
// tile, the grid or the other rows of the call.
constexpr int kIdxThreads = 256, kIdxGroups = 4, kIdxTile = 128, kIdxHeadChunk = 8;
static_assert(kIdxThreads / kIdxGroups * 2 == kIdxTile, "each thread of a group takes 2 keys of the tile");
static_assert(kIdxGroups == 4, "the final sum below adds 4 group sums");

struct IndexerArgs {
  IndexerScoresParams p;
  int d4;     // head_dim rounded up to 4: dots run over zero padding
  int pitch;  // k_s row pitch, conflict_free_pitch(d4)
  bool vec;   // aligned_rows(k, head_dim): float4 / 4 x bf16 loads
};

__global__ void __launch_bounds__(kIdxThreads) indexer_scores_kernel(IndexerArgs a) {
  extern __shared__ float4 idx_smem4[];
  float* smem = reinterpret_cast<float*>(idx_smem4);
  const IndexerScoresParams p = a.p;
  const int64_t tiles = (p.t + kIdxTile - 1) / kIdxTile;
  const int64_t s = blockIdx.x / tiles, t0 = (blockIdx.x % tiles) * kIdxTile;
  const int64_t qpos = p.q_pos[s];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* row = p.scores + s * p.ld_scores;
  if (t0 > qpos) {  // the whole tile is in the future
    for (int64_t t = t0 + tid; t < p.t && t < t0 + kIdxTile; t += blockDim.x) row[t] = -INFINITY;
    return;
  }
  const int hd = int(p.head_dim), nh = int(p.n_heads), d4 = a.d4, P = a.pitch;
  float* q_s = smem;                   // [nh][d4], zero padded
  float* w_s = q_s + nh * d4;          // [nh] (room rounded up to 4 floats: k_s stays 16-byte aligned)
  float* k_s = w_s + ((nh + 3) & ~3);  // [kIdxTile][P]; columns [hd, d4) zero
  float* r_s = k_s + kIdxTile * P;     // [kIdxGroups][kIdxTile] group sums
  for (int i = tid; i < nh * d4; i += blockDim.x) {
    const int h = i / d4, d = i % d4;
    q_s[i] = d < hd ? p.q[(s * nh + h) * hd + d] : 0.0f;
  }
  for (int i = tid; i < nh; i += blockDim.x) w_s[i] = p.weights[s * nh + i];
  if (d4 > hd)
    for (int i = tid; i < kIdxTile * (d4 - hd); i += blockDim.x) k_s[(i / (d4 - hd)) * P + hd + i % (d4 - hd)] = 0.0f;
  // Keys t0 .. last are read (at least one: t0 <= qpos and t0 < T); the rest of the tile is never
  // written out as a score, so its rows stay unread.
  const int64_t last = qpos < p.t - 1 ? qpos : p.t - 1;
  const int nk = int(last - t0 + 1 < kIdxTile ? last - t0 + 1 : kIdxTile);
  const bool bf16 = p.pages.dtype == DType::BF16;
  for (int jj = warp; jj < nk; jj += kIdxThreads / 32)
    load_row_warp(p.k, p.pages.row(s, t0 + jj), hd, bf16, a.vec, k_s + jj * P, lane);
  __syncthreads();

  const int g = tid / (kIdxThreads / kIdxGroups), kl = tid % (kIdxThreads / kIdxGroups);
  const float4* ka = reinterpret_cast<const float4*>(k_s + kl * P);
  const float4* kb = reinterpret_cast<const float4*>(k_s + (kl + kIdxTile / 2) * P);
  float sa = 0.0f, sb = 0.0f;  // S_g of keys kl and kl + 64
  for (int h0 = g; h0 < nh; h0 += kIdxGroups * kIdxHeadChunk) {
    float da[kIdxHeadChunk], db[kIdxHeadChunk];
#pragma unroll
    for (int i = 0; i < kIdxHeadChunk; ++i) da[i] = db[i] = 0.0f;
    for (int v = 0; v < d4 / 4; ++v) {
      const float4 x0 = ka[v], x1 = kb[v];
#pragma unroll
      for (int i = 0; i < kIdxHeadChunk; ++i) {
        const int h = h0 + kIdxGroups * i;
        if (h < nh) {  // the same for the whole warp
          const float4 qv = reinterpret_cast<const float4*>(q_s + h * d4)[v];
          da[i] = dot4(qv, x0, da[i]);
          db[i] = dot4(qv, x1, db[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kIdxHeadChunk; ++i) {
      const int h = h0 + kIdxGroups * i;
      if (h < nh) {
        sa = __fmaf_rn(w_s[h], fmaxf(da[i], 0.0f), sa);
        sb = __fmaf_rn(w_s[h], fmaxf(db[i], 0.0f), sb);
      }
    }
  }
  r_s[g * kIdxTile + kl] = sa;
  r_s[g * kIdxTile + kl + kIdxTile / 2] = sb;
  __syncthreads();
  for (int j = tid; j < kIdxTile; j += blockDim.x) {
    const int64_t t = t0 + j;
    if (t >= p.t) break;
    row[t] = t <= qpos ? __fadd_rn(__fadd_rn(r_s[j], r_s[kIdxTile + j]),
                                   __fadd_rn(r_s[2 * kIdxTile + j], r_s[3 * kIdxTile + j]))
                       : -INFINITY;
  }
}

// ---- top-k -------------------------------------------------------------------------------------

constexpr int kTopkThreads = 1024;

// Order-preserving map of a finite float to uint32 (larger float -> larger key); -0 == +0.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024); *total gets the block sum.
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

// ---- top-k over many blocks per row (few rows: decode) ------------------------------------------
// The same selection as topk_kernel (the k largest, ties to the lower index, ascending), with each
// row's columns cut into slices of kTopkMbCols, one block per (slice, row): a decode step's few
// rows then occupy B x rows blocks instead of rows. Four radix passes, each a histogram kernel
// (every block adds its slice's counts into the row's global histogram) and a decide kernel (one
// thread per row picks the byte of the k-th key); then a count kernel (each block's entries above
// the k-th key and equal to it) and a write kernel (each block's output offset from the counts of
// the slices before it, then the same ordered compaction as topk_kernel within its slice).

constexpr int kTopkMbThreads = 256;
constexpr int64_t kTopkMbCols = 8192;

struct TopkMbRow {
  uint32_t prefix, mask;
  int need, n_finite, done;  // done: every finite entry is taken (n_finite <= k), or the key is found
};

__global__ void __launch_bounds__(kTopkMbThreads) topk_mb_hist(TopkParams p, int pass, int* hist, const TopkMbRow* st) {
  __shared__ int h[256];
  const int64_t row = blockIdx.y;
  if (pass > 0 && st[row].done) return;
  const uint32_t prefix = pass > 0 ? st[row].prefix : 0u, mask = pass > 0 ? st[row].mask : 0u;
  const int shift = 24 - 8 * pass;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) h[i] = 0;
  __syncthreads();
  const float* x = p.scores + row * p.ld;
  const int64_t t0 = int64_t(blockIdx.x) * kTopkMbCols, t1 = t0 + kTopkMbCols < p.cols ? t0 + kTopkMbCols : p.cols;
  for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
    const float f = x[t];
    if (!isfinite(f)) continue;
    const uint32_t key = order_key(f);
    if ((key & mask) == prefix) atomicAdd(&h[(key >> shift) & 255u], 1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    if (h[i]) atomicAdd(&hist[row * 256 + i], h[i]);
}

// One thread per row: the decision topk_kernel's thread 0 makes after each pass; clears the row's
// histogram for the next pass.
__global__ void topk_mb_decide(TopkParams p, int pass, int* hist, TopkMbRow* st) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.rows) return;
  TopkMbRow s = st[row];
  int* hr = hist + row * 256;
  if (pass == 0) {
    int n = 0;
    for (int b = 0; b < 256; ++b) n += hr[b];
    s.n_finite = n;
    s.need = int(p.k < n ? p.k : n);
    s.prefix = 0u, s.mask = 0u, s.done = n <= p.k;
  }
  if (!s.done) {
    const int shift = 24 - 8 * pass;
    int need = s.need, b = 255;
    for (; b > 0 && hr[b] < need; --b) need -= hr[b];
    s.need = need;
    s.prefix |= uint32_t(b) << shift;
    s.mask |= 255u << shift;
    if (pass == 3) s.done = 1;
  }
  for (int b = 0; b < 256; ++b) hr[b] = 0;
  st[row] = s;
}

// take_all (n_finite <= k): every finite entry; else those above the k-th key, and `need` of those equal.
__device__ __forceinline__ void topk_mb_class(float f, const TopkMbRow& s, bool take_all, bool* gt, bool* eq) {
  const bool fin = isfinite(f);
  const uint32_t key = fin ? order_key(f) : 0u;
  *gt = take_all ? fin : fin && key > s.prefix;
  *eq = !take_all && fin && key == s.prefix;
}

__global__ void __launch_bounds__(kTopkMbThreads) topk_mb_count(TopkParams p, const TopkMbRow* st, int* counts) {
  __shared__ int scan_sh[33];
  const int64_t row = blockIdx.y;
  const TopkMbRow s = st[row];
  const bool take_all = s.n_finite <= p.k;
  const float* x = p.scores + row * p.ld;
  const int64_t t0 = int64_t(blockIdx.x) * kTopkMbCols, t1 = t0 + kTopkMbCols < p.cols ? t0 + kTopkMbCols : p.cols;
  int gt_n = 0, eq_n = 0;
  for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
    bool gt, eq;
    topk_mb_class(x[t], s, take_all, &gt, &eq);
    gt_n += gt, eq_n += eq;
  }
  int gt_total, eq_total;
  block_exclusive_scan(gt_n, scan_sh, &gt_total);
  block_exclusive_scan(eq_n, scan_sh, &eq_total);
  if (threadIdx.x == 0) {
    counts[(row * gridDim.x + blockIdx.x) * 2] = gt_total;
    counts[(row * gridDim.x + blockIdx.x) * 2 + 1] = eq_total;
  }
}

__global__ void __launch_bounds__(kTopkMbThreads) topk_mb_write(TopkParams p, const TopkMbRow* st, const int* counts) {
  __shared__ int scan_sh[33];
  const int64_t row = blockIdx.y;
  const int B = int(gridDim.x), blk = int(blockIdx.x);
  const TopkMbRow s = st[row];
  const bool take_all = s.n_finite <= p.k;
  const int* c = counts + row * B * 2;
  // Entries equal to the k-th key before this slice, and what the slices before it write.
  int eq_seen = 0, written = 0;
  for (int j = 0; j < blk; ++j) {
    const int eq_take = take_all ? 0 : max(0, min(c[2 * j + 1], s.need - eq_seen));
    written += c[2 * j] + eq_take;
    eq_seen += c[2 * j + 1];
  }
  const float* x = p.scores + row * p.ld;
  int32_t* out = p.indices + row * p.k;
  const int64_t t0 = int64_t(blk) * kTopkMbCols, t1 = t0 + kTopkMbCols < p.cols ? t0 + kTopkMbCols : p.cols;
  for (int64_t base = t0; base < t1 && written < int(p.k); base += blockDim.x) {
    const int64_t t = base + threadIdx.x;
    bool gt = false, eq = false;
    if (t < t1) topk_mb_class(x[t], s, take_all, &gt, &eq);
    int eq_total;
    const int eq_rank = eq_seen + block_exclusive_scan(eq ? 1 : 0, scan_sh, &eq_total);
    eq_seen += eq_total;
    const bool sel = gt || (eq && eq_rank < s.need);
    int sel_total;
    const int pos = written + block_exclusive_scan(sel ? 1 : 0, scan_sh, &sel_total);
    if (sel && pos < p.k) out[pos] = int32_t(t);
    written += sel_total;
  }
  if (blk == B - 1) {  // the last slice pads the row: -1 past the entries taken
    int total = 0, eq_all = 0;
    for (int j = 0; j < B; ++j) {
      total += c[2 * j] + (take_all ? 0 : max(0, min(c[2 * j + 1], s.need - eq_all)));
      eq_all += c[2 * j + 1];
    }
    for (int64_t i = total + threadIdx.x; i < p.k; i += blockDim.x) out[i] = -1;
  }
}

// ---- MLA prefill (and the key selection of both modes) ------------------------------------------------------------

constexpr int kSelectThreads = 512;
constexpr int kMaxTopkLen = 16384;  // the sort of one row's list lives in shared memory

// One block per query row: the row's top-k list as a set, as the reference reads it. Sorts the
// list in shared memory (bitonic), then writes each key once, ascending, if 0 <= t <= q_pos and
// t < T: keys[s, 0:counts[s]]. Entries outside [-1, T) are reported as errors and skipped.
__global__ void __launch_bounds__(kSelectThreads)
    select_keys_kernel(const int32_t* topk, int64_t len, const int32_t* q_pos, int64_t t_count, int n_pow2,
                       int32_t* keys, int32_t* counts, int* err) {
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

// Prefill ("MHA mode"): query row (s, h) attends over keys t. The key is [ka(t, h) (da values) |
// kb(t) (db)] = [k_nope | k_pe], the value v(t, h) (dv values).
struct AttnArgs {
  const float* q;
  int64_t q_stride_s, q_stride_h;
  const float* ka;
  int64_t ka_stride_t, ka_stride_h, da;
  const float* kb;
  int64_t kb_stride_t, db;
  int64_t kb_offset;  // elements from kb to the k_pe part of a row (0 for prefill's own k_pe rows)
  const float* v;
  int64_t v_stride_t, v_stride_h, dv;
  const int32_t* q_pos;
  const int32_t* keys;    // select_keys_kernel output [s, keys_ld], or nullptr: dense causal
  const int32_t* counts;  // [s]
  int64_t keys_ld;
  float* out;
  int64_t s, t, n_heads;
  float scale;
  KeyPages pages;  // contiguous (no block table) for prefill
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

// The per-row key sets of a top-k list (select_keys_kernel) into `scratch`, which holds
// s * (topk_len + 1) ints: keys [s, topk_len], then counts [s].
void launch_select_keys(const int32_t* topk, int64_t topk_len, const int32_t* q_pos, int64_t s, int64_t t,
                        int32_t* scratch, int* err, cudaStream_t st, const char* op) {
  CHECK(topk_len <= kMaxTopkLen, "cuda ", op, ": topk_len ", topk_len, " > ", kMaxTopkLen, " is not supported");
  CHECK(s < (int64_t(1) << 31), "cuda ", op, ": s = ", s, " too large for one launch");
  int n_pow2 = 1;
  while (n_pow2 < topk_len) n_pow2 <<= 1;
  const size_t smem = size_t(n_pow2 + 33) * sizeof(int32_t);
  reserve_smem(select_keys_kernel, smem, op, "topk_len");
  select_keys_kernel<<<unsigned(s), kSelectThreads, smem, st>>>(topk, topk_len, q_pos, t, n_pow2, scratch,
                                                                scratch + s * topk_len, err);
  CUDA_CHECK_LAUNCH(op);
}

// Prefill: the key selection when a top-k list is given, then the attention.
void launch_attention(AttnArgs a, const int32_t* topk, int64_t topk_len, int32_t* scratch, int* err, cudaStream_t st,
                      const char* op) {
  if (a.s == 0 || a.n_heads == 0) return;
  CHECK(a.s < (int64_t(1) << 31) / (a.n_heads > 0 ? a.n_heads : 1), "cuda ", op, ": s = ", a.s,
        " x n_heads = ", a.n_heads, " too large for one launch");
  if (topk) {
    launch_select_keys(topk, topk_len, a.q_pos, a.s, a.t, scratch, err, st, op);
    a.keys = scratch, a.counts = scratch + a.s * topk_len, a.keys_ld = topk_len;
  }
  const size_t smem = size_t(a.da + a.db + kAttnWarps * a.dv) * sizeof(float);
  reserve_smem(mla_attention_kernel, smem, op, "head dims");
  mla_attention_kernel<<<unsigned(a.s * a.n_heads), kAttnWarps * 32, smem, st>>>(a);
  CUDA_CHECK_LAUNCH(op);
}

// ---- MLA decode: the heads of a row share each key tile ----------------------------------------

// Block = (query row s, group of G heads, 512-column chunk of the output). Shapes (dk =
// kv_lora_rank + qk_rope_head_dim, R = kv_lora_rank): q [s, H, dk], cache rows [c_kv | k_pe] of dk,
// out [s, H, R]. The block walks the row's candidate keys (ascending) in tiles of TK: each tile's
// key rows are read from global memory once, a warp per row, into shared memory k_s [TK][pitch],
// and all G heads use them there (as FlashMLA's head block does; 64 heads x 512 fp32
// accumulators are half of an SM's registers, so G <= 64). Per tile:
//   scores  p_s[g][j] = scale * q[g] . k[j]: thread item = 2 heads x 2 keys (4 dots sharing each
//           float4 read; q rows 2 apart and key rows of 8 lanes land in distinct banks);
//   softmax one thread per head walks the tile's keys in order: running max m, per-key rescale
//           c_j = exp(m_old - m_new) (1 when the max holds), p_j = exp(s_j - m), l = l * c_j + p_j;
//   values  acc[h][c] = acc[h][c] * c_j + p_j * cache[t_j][c] for j in order: warp = a block of 8
//           heads, lane = columns c, c + 32, ... (8 x 16 register accumulators per thread; the
//           8 heads' p_j, c_j are warp-wide broadcasts, the value row is read conflict-free).
// Each head's result is thus one sequential online softmax over the row's keys in ascending
// order, with every dot a single fmaf chain over d: the same arithmetic whatever G, TK or the
// number of rows, so the host may pick G and TK per call (from the row count, to fill the GPU).
// Padding q / key columns [dk, d4) are zero and add nothing; heads of a group past H compute on
// zero q and are not written.
constexpr int kDecThreads = 256, kDecWarps = kDecThreads / 32;
constexpr int kDecMaxHeads = 64;                    // G <= 64
constexpr int kDecHeadsPerWarp = 8;                 // values phase: a warp's head block
constexpr int kDecColsPerLane = 16;                 // values phase: 16 x 32 lanes = 512 columns per warp
constexpr int kDecColChunk = kDecColsPerLane * 32;  // output columns per block (grid z)
static_assert(kDecMaxHeads == kDecHeadsPerWarp * kDecWarps, "8 warps x 8 heads cover G <= 64");

struct DecodeArgs {
  const float* q;
  const void* cache;  // F32 or BF16 rows of dk elements, addressed through `pages`
  KeyPages pages;
  bool bf16, vec;  // vec: aligned_rows(cache, dk)
  const int32_t* q_pos;
  const int32_t* keys;    // select_keys_kernel output [s, keys_ld], or nullptr: dense causal
  const int32_t* counts;  // [s]
  int64_t keys_ld;
  float* out;
  int64_t s, t, n_heads, r, dk;
  int g, tk;          // heads per block, keys per tile (even)
  int d4, pitch, ts;  // round_up4(dk); q_s / k_s row pitch; p_s / c_s row pitch (tk + 1)
  float scale;
};

size_t decode_smem_bytes(int g, int tk, int pitch) {
  const size_t ts = size_t(tk) + 1;
  return sizeof(float) * (size_t(g) * pitch + size_t(tk) * pitch + 2 * size_t(g) * ts + 2 * size_t(g));
}

__global__ void __launch_bounds__(kDecThreads, 1) mla_decode_kernel(DecodeArgs a) {
  extern __shared__ float4 dec_smem4[];
  float* smem = reinterpret_cast<float*>(dec_smem4);
  const int G = a.g, TK = a.tk, P = a.pitch, TS = a.ts, d4 = a.d4;
  float* q_s = smem;          // [G][P]   this block's heads of q, zero padded
  float* k_s = q_s + G * P;   // [TK][P]  the tile's key rows (value = first R columns)
  float* p_s = k_s + TK * P;  // [G][TS]  scores, then p_j
  float* c_s = p_s + G * TS;  // [G][TS]  c_j
  float* m_s = c_s + G * TS;  // [G]      running max
  float* l_s = m_s + G;       // [G]      running sum
  const int64_t s = blockIdx.x, h0 = int64_t(blockIdx.y) * G;
  const int heads = int(a.n_heads - h0 < G ? a.n_heads - h0 : G);  // heads of this block that exist
  const int64_t c0 = int64_t(blockIdx.z) * kDecColChunk;
  const int64_t c_end = c0 + kDecColChunk < a.r ? c0 + kDecColChunk : a.r;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t dk = a.dk;

  for (int i = tid; i < G * d4; i += kDecThreads) {
    const int g = i / d4, d = i % d4;
    q_s[g * P + d] = g < heads && d < dk ? a.q[(s * a.n_heads + h0 + g) * dk + d] : 0.0f;
  }
  if (d4 > dk)
    for (int i = tid; i < TK * (d4 - int(dk)); i += kDecThreads)
      k_s[(i / (d4 - int(dk))) * P + int(dk) + i % (d4 - int(dk))] = 0.0f;
  for (int g = tid; g < G; g += kDecThreads) m_s[g] = -INFINITY, l_s[g] = 0.0f;

  const int64_t qpos = a.q_pos[s];
  const int64_t last = qpos < a.t - 1 ? qpos : a.t - 1;
  const int64_t n_cand = a.keys ? int64_t(a.counts[s]) : (last >= 0 ? last + 1 : 0);
  const int32_t* keys = a.keys ? a.keys + s * a.keys_ld : nullptr;

  // Values phase mapping: head block hb (heads 8 hb .. 8 hb + 7 of the group), and when the group
  // has fewer than 8 head blocks, several warps per head block splitting the columns.
  const int n_hb = (G + kDecHeadsPerWarp - 1) / kDecHeadsPerWarp;
  const int wpb = kDecWarps / n_hb;  // >= 1 since n_hb <= 8
  const int hb = warp / wpb, cp = warp % wpb;
  const bool pv = hb < n_hb;
  float acc[kDecHeadsPerWarp][kDecColsPerLane];
#pragma unroll
  for (int i = 0; i < kDecHeadsPerWarp; ++i)
#pragma unroll
    for (int jc = 0; jc < kDecColsPerLane; ++jc) acc[i][jc] = 0.0f;

  for (int64_t j0 = 0; j0 < n_cand; j0 += TK) {
    const int nk = int(n_cand - j0 < TK ? n_cand - j0 : TK);
    __syncthreads();  // the previous tile's readers are done (and the set-up above is visible)
    for (int jj = warp; jj < nk; jj += kDecWarps) {
      const int64_t t = keys ? int64_t(keys[j0 + jj]) : j0 + jj;
      load_row_warp(a.cache, a.pages.row(s, t), dk, a.bf16, a.vec, k_s + jj * P, lane);
    }
    __syncthreads();

    // Scores: item = head pair hp x key pair kp (keys kp and kp + TK/2); rows of keys >= nk hold
    // stale data, and their scores are never read.
    const int kpairs = TK / 2, items = (G + 1) / 2 * kpairs;
    for (int it = tid; it < items; it += kDecThreads) {
      const int hp = it / kpairs, kp = it % kpairs;
      const int ga = 2 * hp, gb = 2 * hp + 1 < G ? 2 * hp + 1 : ga;
      const float4* qa = reinterpret_cast<const float4*>(q_s + ga * P);
      const float4* qb = reinterpret_cast<const float4*>(q_s + gb * P);
      const float4* ka = reinterpret_cast<const float4*>(k_s + kp * P);
      const float4* kb = reinterpret_cast<const float4*>(k_s + (kp + kpairs) * P);
      float saa = 0.0f, sab = 0.0f, sba = 0.0f, sbb = 0.0f;
      for (int v = 0; v < d4 / 4; ++v) {
        const float4 x0 = qa[v], x1 = qb[v], y0 = ka[v], y1 = kb[v];
        saa = dot4(x0, y0, saa);
        sab = dot4(x0, y1, sab);
        sba = dot4(x1, y0, sba);
        sbb = dot4(x1, y1, sbb);
      }
      p_s[ga * TS + kp] = __fmul_rn(a.scale, saa);
      p_s[ga * TS + kp + kpairs] = __fmul_rn(a.scale, sab);
      if (gb != ga) {
        p_s[gb * TS + kp] = __fmul_rn(a.scale, sba);
        p_s[gb * TS + kp + kpairs] = __fmul_rn(a.scale, sbb);
      }
    }
    __syncthreads();

    // Online softmax, key by key in candidate order (the first key: c = exp(-inf) = 0).
    for (int g = tid; g < G; g += kDecThreads) {
      float m = m_s[g], l = l_s[g];
      float* ps = p_s + g * TS;
      float* cs = c_s + g * TS;
      for (int jj = 0; jj < nk; ++jj) {
        const float sc = ps[jj];
        float c = 1.0f;
        if (sc > m) {
          c = expf(m - sc);
          m = sc;
        }
        const float pr = expf(sc - m);
        l = __fmaf_rn(l, c, pr);
        ps[jj] = pr;
        cs[jj] = c;
      }
      m_s[g] = m, l_s[g] = l;
    }
    __syncthreads();

    if (pv) {
      for (int jj = 0; jj < nk; ++jj) {
        const float* vrow = k_s + jj * P;
        float pr[kDecHeadsPerWarp], cr[kDecHeadsPerWarp];
#pragma unroll
        for (int i = 0; i < kDecHeadsPerWarp; ++i) {
          const int g = hb * kDecHeadsPerWarp + i;
          pr[i] = g < G ? p_s[g * TS + jj] : 0.0f;
          cr[i] = g < G ? c_s[g * TS + jj] : 1.0f;
        }
#pragma unroll
        for (int i = 0; i < kDecHeadsPerWarp; ++i)
          if (cr[i] != 1.0f) {  // warp-uniform: the lanes share the heads
#pragma unroll
            for (int jc = 0; jc < kDecColsPerLane; ++jc) acc[i][jc] = __fmul_rn(acc[i][jc], cr[i]);
          }
#pragma unroll
        for (int jc = 0; jc < kDecColsPerLane; ++jc) {
          const int64_t c = c0 + 32 * (cp + int64_t(wpb) * jc) + lane;
          if (c < c_end) {
            const float v = vrow[c];
#pragma unroll
            for (int i = 0; i < kDecHeadsPerWarp; ++i) acc[i][jc] = __fmaf_rn(pr[i], v, acc[i][jc]);
          }
        }
      }
    }
  }
  __syncthreads();  // l_s final (also when the row has no key)
  if (pv) {
#pragma unroll
    for (int i = 0; i < kDecHeadsPerWarp; ++i) {
      const int g = hb * kDecHeadsPerWarp + i;
      if (g >= heads) continue;
      const float l = l_s[g];
      float* out = a.out + (s * a.n_heads + h0 + g) * a.r;
#pragma unroll
      for (int jc = 0; jc < kDecColsPerLane; ++jc) {
        const int64_t c = c0 + 32 * (cp + int64_t(wpb) * jc) + lane;
        if (c < c_end) out[c] = l > 0.0f ? __fdiv_rn(acc[i][jc], l) : 0.0f;
      }
    }
  }
}

// ---- MLA decode on the tensor cores (BF16 cache, top-k rows) ------------------------------------

// The production case (a BF16 latent cache, each row its top-k keys) as bf16 MMAs without giving
// up fp32 exactness: the cached keys are bf16 already, and the fp32 operands (q, and the softmax
// weights p) are split into 3 bf16 terms x = x1 + x2 + x3 that hold x exactly (as the GEMMs do), so
// every product is exact; what differs from the SIMT kernel is the accumulation (the tensor
// cores' fp32 sums, in their order), at fp32 rounding level.
// Block = (query row s, split of kMmaSplit candidate keys, group of 16 heads), 8 warps; a split
// walks its keys in tiles of kMmaTile:
//   load    the tile's key rows (bf16, as cached) into k_s [kMmaTile][pitch];
//   scores  S = q k^T (16 heads x 32 keys, K = dk): warp w takes keys 8 (w % 4) .. + 7 over half
//           of dk (w / 4); the two halves are added in that order;
//   softmax per head over the tile (16 lanes a head): max, p = exp(s - m), the old sum and output
//           rescaled by exp(m_old - m) (flash attention);
//   values  O += p V (V = the first R columns of the key rows): warp w owns columns 64 w .. + 63.
// Each split writes its unnormalized O with (m, l) to `part`, and mla_decode_combine_kernel merges
// a row's splits in split order. The splits of a row depend only on its own key count, so a row's
// bits never depend on the other rows of the call.
constexpr int kMmaThreads = 256;
constexpr int kMmaHeads = 16;   // the MMA's M
constexpr int kMmaTile = 32;    // keys per tile
constexpr int kMmaSplit = 256;  // keys per split (one block)
constexpr int kMmaR = 512;      // kv_lora_rank: 8 warps x 64 value columns
constexpr int kMmaTerms = 3;
constexpr int64_t kMmaRowChunk = 128;     // rows per launch: bounds the partials (1.05 MB a row at GLM-5 dims)
constexpr int kMmaSPitch = kMmaTile + 4;  // scores row pitch (floats)
constexpr int kMmaPPitch = kMmaTile + 8;  // p row pitch (bf16): 20 words, conflict-free A fragments

struct MmaDecodeArgs {
  const float* q;
  const uint16_t* cache;  // BF16 rows of dk, 16-byte aligned (dk % 8 == 0)
  KeyPages pages;
  const int32_t* keys;    // select_keys_kernel output [s, keys_ld]
  const int32_t* counts;  // [s]
  int64_t keys_ld;
  int64_t s0;   // this launch's first row (rows s0 .. s0 + gridDim.x / (splits * groups) - 1)
  float* part;  // [rows of the launch, n_heads, splits, kMmaR + 2]: O, then m, l
  int64_t n_heads, dk, splits;
  int pitch;  // q_s / k_s row pitch in bf16: dk + 8 (= 4 words mod 32 when dk % 64 == 0)
  float scale;
};

size_t mma_decode_smem_bytes(int pitch) {
  return size_t(kMmaTerms) * kMmaHeads * pitch * 2 + size_t(kMmaTile) * pitch * 2 +
         size_t(2) * kMmaHeads * kMmaSPitch * 4 + size_t(kMmaTerms) * kMmaHeads * kMmaPPitch * 2 +
         size_t(kMmaTile) * 8 + size_t(3) * kMmaHeads * 4;
}

// c += a b for one m16n8k16 tile: a row-major 16 x 16 bf16 (4 words), b 16 x 8 (2 words), c fp32.
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // code for an architecture without bf16 MMA (the host only launches on >= 8.0)
#endif
}

// v = t0 + t1 + t2 in bf16, exactly for finite v (each remainder is exact in fp32), as gemm_split_x.
__device__ __forceinline__ void split3(float v, uint16_t* t0, int64_t stride) {
#pragma unroll
  for (int t = 0; t < kMmaTerms; ++t) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    t0[t * stride] = __bfloat16_as_ushort(h);
    const float hf = __bfloat162float(h);
    v = isfinite(hf) ? v - hf : 0.0f;
  }
}

// The block copies key rows row_s[0 .. rows) (BF16, `width` elements each, 16-byte aligned) of
// `cache` into dst [rows][pitch], 16 bytes per thread step; rows from nk on are zeros.
__device__ __forceinline__ void load_bf16_rows(const uint16_t* cache, const int64_t* row_s, int rows, int nk, int width,
                                               uint16_t* dst, int pitch) {
  const int n16 = width / 8;  // 16-byte chunks per row
#pragma unroll 4
  for (int i = threadIdx.x; i < rows * n16; i += blockDim.x) {
    const int r = i / n16, c = i % n16;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < nk) v = __ldg(reinterpret_cast<const uint4*>(cache + row_s[r] * width) + c);
    *reinterpret_cast<uint4*>(dst + r * pitch + c * 8) = v;
  }
}

__global__ void __launch_bounds__(kMmaThreads, 2) mla_decode_mma_kernel(MmaDecodeArgs a) {
  extern __shared__ float4 mma_smem4[];
  const int P = a.pitch, dk = int(a.dk);
  uint16_t* q_s = reinterpret_cast<uint16_t*>(mma_smem4);                         // [3][16][P] q's terms
  uint16_t* k_s = q_s + kMmaTerms * kMmaHeads * P;                                // [32][P] the tile's key rows
  float* s_s = reinterpret_cast<float*>(k_s + kMmaTile * P);                      // [2][16][kMmaSPitch] score halves
  uint16_t* p_s = reinterpret_cast<uint16_t*>(s_s + 2 * kMmaHeads * kMmaSPitch);  // [3][16][kMmaPPitch]
  int64_t* row_s = reinterpret_cast<int64_t*>(p_s + kMmaTerms * kMmaHeads * kMmaPPitch);  // [32]
  float* m_s = reinterpret_cast<float*>(row_s + kMmaTile);                                // [16] running max
  float* l_s = m_s + kMmaHeads;                                                           // [16] running sum
  float* c_s = l_s + kMmaHeads;                                                           // [16] this tile's rescale
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  // blockIdx.x = (s * splits + split) * groups + group: the head groups of a split run side by
  // side and share its key rows in the L2.
  const int64_t groups = (a.n_heads + kMmaHeads - 1) / kMmaHeads, blk = blockIdx.x;
  const int64_t h0 = (blk % groups) * kMmaHeads, split = (blk / groups) % a.splits, sl = blk / groups / a.splits;
  const int64_t s = a.s0 + sl;  // the row; sl its place in this launch's partials
  const int64_t count = a.counts[s];
  const int64_t j_begin = split * kMmaSplit;
  const int64_t j_end = j_begin + kMmaSplit < count ? j_begin + kMmaSplit : count;
  float* part = a.part + ((sl * a.n_heads + h0) * a.splits + split) * (kMmaR + 2);
  const int64_t head_stride = a.splits * (kMmaR + 2);
  if (j_begin >= j_end) {  // no key in this split: (m, l) = (-inf, 0), O unused
    if (tid < kMmaHeads && h0 + tid < a.n_heads)
      part[tid * head_stride + kMmaR] = -INFINITY, part[tid * head_stride + kMmaR + 1] = 0.0f;
    return;
  }

  for (int i = tid; i < kMmaHeads * dk; i += kMmaThreads) {
    const int hh = i / dk, d = i % dk;
    const float v = h0 + hh < a.n_heads ? a.q[(s * a.n_heads + h0 + hh) * dk + d] : 0.0f;
    split3(v, q_s + hh * P + d, int64_t(kMmaHeads) * P);
  }
  if (tid < kMmaHeads) m_s[tid] = -INFINITY, l_s[tid] = 0.0f;

  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q_s);
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k_s);
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(p_s);
  const int P2 = P / 2, PP2 = kMmaPPitch / 2;  // words per row
  const int ksteps = dk / 16, kh = warp >> 2, nt_s = warp & 3;
  const int kb = kh ? ksteps / 2 : 0, ke = kh ? ksteps : ksteps / 2;
  float acc[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

  for (int64_t j0 = j_begin; j0 < j_end; j0 += kMmaTile) {
    const int nk = int(j_end - j0 < kMmaTile ? j_end - j0 : kMmaTile);
    __syncthreads();  // the previous tile's readers are done (and the set-up above is visible)
    if (tid < kMmaTile) row_s[tid] = tid < nk ? a.pages.row(s, a.keys[s * a.keys_ld + j0 + tid]) : -1;
    __syncthreads();
    load_bf16_rows(a.cache, row_s, kMmaTile, nk, dk, k_s, P);  // keys past nk: zeros (p = 0 there)
    __syncthreads();

    {  // scores: warp (nt_s, kh) -> keys 8 nt_s + n, head rows g, g + 8
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint32_t* kr = k32 + (nt_s * 8 + g) * P2 + t4;
      for (int kk = kb; kk < ke; ++kk) {
        const uint32_t b[2] = {kr[kk * 8], kr[kk * 8 + 4]};
#pragma unroll
        for (int term = 0; term < kMmaTerms; ++term) {
          const uint32_t* qr = q32 + (term * kMmaHeads + g) * P2 + kk * 8 + t4;
          const uint32_t af[4] = {qr[0], qr[8 * P2], qr[4], qr[8 * P2 + 4]};
          mma_16816(c, af, b);
        }
      }
      float* sh = s_s + kh * kMmaHeads * kMmaSPitch + nt_s * 8 + 2 * t4;
      sh[g * kMmaSPitch] = c[0], sh[g * kMmaSPitch + 1] = c[1];
      sh[(g + 8) * kMmaSPitch] = c[2], sh[(g + 8) * kMmaSPitch + 1] = c[3];
    }
    __syncthreads();

    {  // softmax: head hh = tid / 16, keys 2 (tid % 16) and + 1; the 16 lanes of a head are one half-warp
      const int hh = tid >> 4, kk = (tid & 15) * 2;
      float sc[2], p[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float* sr = s_s + hh * kMmaSPitch + kk + e;
        sc[e] = kk + e < nk ? __fmul_rn(a.scale, sr[0] + sr[kMmaHeads * kMmaSPitch]) : -INFINITY;
      }
      float mx = fmaxf(sc[0], sc[1]);
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
      const float m_old = m_s[hh], m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[e] = kk + e < nk ? expf(sc[e] - m_new) : 0.0f;
        sum += p[e];
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
#pragma unroll
      for (int e = 0; e < 2; ++e) split3(p[e], p_s + hh * kMmaPPitch + kk + e, int64_t(kMmaHeads) * kMmaPPitch);
      __syncwarp();
      if ((tid & 15) == 0) {
        const float corr = expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        c_s[hh] = corr;
        m_s[hh] = m_new;
        l_s[hh] = __fmaf_rn(l_s[hh], corr, sum);
      }
    }
    __syncthreads();

    {  // values: warp w -> columns 64 w + 8 nt + 2 t4 (+1), head rows g, g + 8
      const float cg = c_s[g], cg8 = c_s[g + 8];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        acc[nt][0] = __fmul_rn(acc[nt][0], cg), acc[nt][1] = __fmul_rn(acc[nt][1], cg);
        acc[nt][2] = __fmul_rn(acc[nt][2], cg8), acc[nt][3] = __fmul_rn(acc[nt][3], cg8);
      }
#pragma unroll
      for (int ks = 0; ks < kMmaTile / 16; ++ks) {
        uint32_t af[kMmaTerms][4];
#pragma unroll
        for (int term = 0; term < kMmaTerms; ++term) {
          const uint32_t* pr = p32 + (term * kMmaHeads + g) * PP2 + ks * 8 + t4;
          af[term][0] = pr[0], af[term][1] = pr[8 * PP2], af[term][2] = pr[4], af[term][3] = pr[8 * PP2 + 4];
        }
        const uint16_t* v0 = k_s + (ks * 16 + 2 * t4) * P + warp * 64 + g;  // key rows 2 t4, 2 t4 + 1; + 8
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const uint16_t* v = v0 + nt * 8;
          const uint32_t b[2] = {uint32_t(v[0]) | (uint32_t(v[P]) << 16),
                                 uint32_t(v[8 * P]) | (uint32_t(v[9 * P]) << 16)};
#pragma unroll
          for (int term = 0; term < kMmaTerms; ++term) mma_16816(acc[nt], af[term], b);
        }
      }
    }
  }

#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int col = warp * 64 + nt * 8 + 2 * t4;
    if (h0 + g < a.n_heads)
      *reinterpret_cast<float2*>(part + g * head_stride + col) = make_float2(acc[nt][0], acc[nt][1]);
    if (h0 + g + 8 < a.n_heads)
      *reinterpret_cast<float2*>(part + (g + 8) * head_stride + col) = make_float2(acc[nt][2], acc[nt][3]);
  }
  __syncthreads();  // m_s, l_s final
  if (tid < kMmaHeads && h0 + tid < a.n_heads)
    part[tid * head_stride + kMmaR] = m_s[tid], part[tid * head_stride + kMmaR + 1] = l_s[tid];
}

// out[s, h, :] = sum_i e_i O_i / sum_i e_i l_i over the row's non-empty splits i in order,
// e_i = exp(m_i - max m); zeros when the row has no key. Block = (s, h). A split is empty when its
// l is 0 (a NaN l, from NaN scores, counts as not empty, so the NaN reaches the output as in the
// reference).
__global__ void __launch_bounds__(128) mla_decode_combine_kernel(const float* part, int64_t splits, float* out) {
  const int64_t sh = blockIdx.x;
  const float* ph = part + sh * splits * (kMmaR + 2);
  float m = -INFINITY;
  for (int64_t i = 0; i < splits; ++i)
    if (ph[i * (kMmaR + 2) + kMmaR + 1] != 0.0f) m = fmaxf(m, ph[i * (kMmaR + 2) + kMmaR]);
  float l = 0.0f;
  for (int64_t i = 0; i < splits; ++i) {
    const float li = ph[i * (kMmaR + 2) + kMmaR + 1];
    if (li != 0.0f) l = __fmaf_rn(expf(ph[i * (kMmaR + 2) + kMmaR] - m), li, l);
  }
  for (int c = threadIdx.x; c < kMmaR; c += blockDim.x) {
    float o = 0.0f;
    for (int64_t i = 0; i < splits; ++i) {
      const float* pi = ph + i * (kMmaR + 2);
      if (pi[kMmaR + 1] != 0.0f) o = __fmaf_rn(expf(pi[kMmaR] - m), pi[c], o);
    }
    out[sh * kMmaR + c] = l != 0.0f ? __fdiv_rn(o, l) : 0.0f;
  }
}

// ---- indexer scores on the tensor cores (BF16 keys) --------------------------------------------

// The production case of the indexer (a bf16 KV cache: keys bf16 already) as bf16 MMAs, exact in
// the products as mla_decode_mma_kernel: q split into 3 bf16 terms. Block = (query row s, tile of
// kIdxMmaKeys keys), 8 warps; warp w scores keys 32 w .. + 31 (4 n-tiles of 8) against all heads
// (MT m-tiles of 16, padded heads have q = 0 and weight 0), K = head_dim in steps of 16. Per key:
//   dot_h = q_h . k (the MMA's fp32 sums), score = sum_h w_h * relu(dot_h): each lane adds its
//   heads g, g + 8 of every m-tile by FMA, then the 8 lane groups are added by a fixed butterfly.
// A score depends only on its row's q, weights and the key: never on the tile, grid or other rows.
constexpr int kIdxMmaThreads = 256, kIdxMmaKeys = 256, kIdxMmaMaxTiles = 4;  // up to 64 heads

struct IdxMmaArgs {
  IndexerScoresParams p;
  int pitch;  // q_s / k_s row pitch in bf16: head_dim + 8 (4 words mod 32 when head_dim % 64 == 0)
};

size_t idx_mma_smem_bytes(int pitch, int mt) {
  return size_t(kMmaTerms) * mt * 16 * pitch * 2 + size_t(kIdxMmaKeys) * pitch * 2 + size_t(mt) * 16 * 4 +
         size_t(kIdxMmaKeys) * 8;
}

template <int MT>
__global__ void __launch_bounds__(kIdxMmaThreads, 2) indexer_mma_kernel(IdxMmaArgs a) {
  extern __shared__ float4 idx_mma_smem4[];
  const IndexerScoresParams& p = a.p;
  const int64_t tiles = (p.t + kIdxMmaKeys - 1) / kIdxMmaKeys;
  const int64_t s = blockIdx.x / tiles, t0 = (blockIdx.x % tiles) * kIdxMmaKeys;
  const int64_t qpos = p.q_pos[s];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  float* row = p.scores + s * p.ld_scores;
  if (t0 > qpos) {  // the whole tile is in the future
    for (int64_t t = t0 + tid; t < p.t && t < t0 + kIdxMmaKeys; t += kIdxMmaThreads) row[t] = -INFINITY;
    return;
  }
  const int D = int(p.head_dim), H = int(p.n_heads), P = a.pitch, HP = MT * 16;
  uint16_t* q_s = reinterpret_cast<uint16_t*>(idx_mma_smem4);    // [3][HP][P] q's terms
  uint16_t* k_s = q_s + kMmaTerms * HP * P;                      // [kIdxMmaKeys][P] key rows
  float* w_s = reinterpret_cast<float*>(k_s + kIdxMmaKeys * P);  // [HP] head weights (0 past H)
  int64_t* row_s = reinterpret_cast<int64_t*>(w_s + HP);         // [kIdxMmaKeys] cache rows
  for (int i = tid; i < HP * D; i += kIdxMmaThreads) {
    const int hh = i / D, d = i % D;
    split3(hh < H ? p.q[(s * H + hh) * D + d] : 0.0f, q_s + hh * P + d, int64_t(HP) * P);
  }
  for (int i = tid; i < HP; i += kIdxMmaThreads) w_s[i] = i < H ? p.weights[s * H + i] : 0.0f;
  // Keys t0 .. last are read (at least one: t0 <= qpos and t0 < T); later rows of the tile are
  // zeros, and their scores are -inf or not written.
  const int64_t last = qpos < p.t - 1 ? qpos : p.t - 1;
  const int nk = int(last - t0 + 1 < kIdxMmaKeys ? last - t0 + 1 : kIdxMmaKeys);
  for (int i = tid; i < kIdxMmaKeys; i += kIdxMmaThreads) row_s[i] = i < nk ? p.pages.row(s, t0 + i) : -1;
  __syncthreads();
  load_bf16_rows(reinterpret_cast<const uint16_t*>(p.k), row_s, kIdxMmaKeys, nk, D, k_s, P);
  __syncthreads();

  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q_s);
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k_s);
  const int P2 = P / 2;
  float acc[4][MT][4];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[nt][mt][0] = acc[nt][mt][1] = acc[nt][mt][2] = acc[nt][mt][3] = 0.0f;
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t af[kMmaTerms][4];
#pragma unroll
      for (int term = 0; term < kMmaTerms; ++term) {
        const uint32_t* qr = q32 + (term * HP + mt * 16 + g) * P2 + kk * 8 + t4;
        af[term][0] = qr[0], af[term][1] = qr[8 * P2], af[term][2] = qr[4], af[term][3] = qr[8 * P2 + 4];
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint32_t* kr = k32 + (warp * 32 + nt * 8 + g) * P2 + kk * 8 + t4;
        const uint32_t b[2] = {kr[0], kr[4]};
#pragma unroll
        for (int term = 0; term < kMmaTerms; ++term) mma_16816(acc[nt][mt], af[term], b);
      }
    }
  }
  float wg[MT], wg8[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) wg[mt] = w_s[mt * 16 + g], wg8[mt] = w_s[mt * 16 + g + 8];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // key warp * 32 + nt * 8 + 2 t4 + e
      float v = 0.0f;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        v = __fmaf_rn(wg[mt], fmaxf(acc[nt][mt][e], 0.0f), v);
        v = __fmaf_rn(wg8[mt], fmaxf(acc[nt][mt][2 + e], 0.0f), v);
      }
      v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, 4));
      v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, 8));
      v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, 16));
      const int64_t t = t0 + warp * 32 + nt * 8 + 2 * t4 + e;
      if (g == 0 && t < p.t) row[t] = t <= qpos ? v : -INFINITY;
    }
}

}  // namespace

// (kernels.cuh) Probed on one kernel of this module: every .cu of the plugin is built for the same
// architectures, so the answer holds for the others (the grouped GEMM's too).
bool device_has_bf16_mma() {
  static std::atomic<int> known[64];  // 0 not asked, 1 no, 2 yes
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::atomic<int>* k = dev >= 0 && dev < 64 ? &known[dev] : nullptr;
  if (k && k->load(std::memory_order_relaxed) != 0) return k->load(std::memory_order_relaxed) == 2;
  int major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  cudaFuncAttributes attr{};
  const bool yes =
      major >= 8 && cudaFuncGetAttributes(&attr, mla_decode_mma_kernel) == cudaSuccess && attr.ptxVersion >= 80;
  cudaGetLastError();  // a failed probe must not surface as the next launch's error
  if (k) k->store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

bool indexer_mma_applies(const IndexerScoresParams& p) {
  const int64_t mt = (p.n_heads + 15) / 16;
  return p.pages.dtype == DType::BF16 && !p.pages.tiled && p.head_dim % 64 == 0 && p.head_dim <= 256 &&
         mt <= kIdxMmaMaxTiles && reinterpret_cast<uintptr_t>(p.k) % 16 == 0 &&
         idx_mma_smem_bytes(int(p.head_dim + 8), int(mt)) <= size_t(max_dynamic_smem()) && device_has_bf16_mma();
}

void launch_indexer_scores(const IndexerScoresParams& p, bool tensor_cores, cudaStream_t st) {
  if (tensor_cores) {
    CHECK(indexer_mma_applies(p), "cuda indexer_scores: the tensor-core kernel does not apply to these keys");
    IdxMmaArgs m{p, int(p.head_dim + 8)};
    const int mt = int((p.n_heads + 15) / 16);
    const int64_t blocks = p.s * ((p.t + kIdxMmaKeys - 1) / kIdxMmaKeys);
    CHECK(blocks < (int64_t(1) << 31), "cuda indexer_scores: s = ", p.s, ", t = ", p.t, " too large for one launch");
    const size_t smem = idx_mma_smem_bytes(m.pitch, mt);
    auto launch = [&](auto kernel) {
      reserve_smem(kernel, smem, "indexer_scores", "n_heads * head_dim");
      kernel<<<unsigned(blocks), kIdxMmaThreads, smem, st>>>(m);
    };
    switch (mt) {
      case 1: launch(indexer_mma_kernel<1>); break;
      case 2: launch(indexer_mma_kernel<2>); break;
      case 3: launch(indexer_mma_kernel<3>); break;
      default: launch(indexer_mma_kernel<4>); break;
    }
    CUDA_CHECK_LAUNCH("indexer_scores");
    return;
  }
  IndexerArgs a;
  a.p = p;
  a.d4 = int(round_up4(p.head_dim));
  a.pitch = conflict_free_pitch(a.d4);
  a.vec = aligned_rows(p.k, p.head_dim, p.pages.dtype);
  const size_t smem = sizeof(float) * (size_t(p.n_heads) * size_t(a.d4) + size_t(round_up4(p.n_heads)) +
                                       size_t(kIdxTile) * size_t(a.pitch) + size_t(kIdxGroups) * kIdxTile);
  reserve_smem(indexer_scores_kernel, smem, "indexer_scores", "n_heads * head_dim");
  const int64_t blocks = p.s * ((p.t + kIdxTile - 1) / kIdxTile);
  CHECK(blocks < (int64_t(1) << 31), "cuda indexer_scores: s = ", p.s, ", t = ", p.t, " too large for one launch");
  indexer_scores_kernel<<<unsigned(blocks), kIdxThreads, smem, st>>>(a);
  CUDA_CHECK_LAUNCH("indexer_scores");
}

int64_t topk_multiblock_scratch_bytes(const TopkParams& p) {
  const int64_t B = (p.cols + kTopkMbCols - 1) / kTopkMbCols;
  return p.rows * (256 * 4 + int64_t(sizeof(TopkMbRow)) + B * 2 * 4);
}

void launch_topk_multiblock(const TopkParams& p, void* scratch, cudaStream_t st) {
  const int64_t B = (p.cols + kTopkMbCols - 1) / kTopkMbCols;
  CHECK(B >= 1 && p.rows < 65536, "cuda topk (multi-block): ", p.rows, " rows x ", B,
        " slices: expected cols > 0 and rows < 65536 (the caller cuts to few rows)");
  int* hist = static_cast<int*>(scratch);
  TopkMbRow* rows = reinterpret_cast<TopkMbRow*>(hist + p.rows * 256);
  int* counts = reinterpret_cast<int*>(rows + p.rows);
  CUDA_CHECK(cudaMemsetAsync(hist, 0, size_t(p.rows * 256) * sizeof(int), st));
  const dim3 grid(unsigned(B), unsigned(p.rows));
  const unsigned decide_blocks = unsigned((p.rows + 127) / 128);
  for (int pass = 0; pass < 4; ++pass) {
    topk_mb_hist<<<grid, kTopkMbThreads, 0, st>>>(p, pass, hist, rows);
    topk_mb_decide<<<decide_blocks, 128, 0, st>>>(p, pass, hist, rows);
  }
  topk_mb_count<<<grid, kTopkMbThreads, 0, st>>>(p, rows, counts);
  topk_mb_write<<<grid, kTopkMbThreads, 0, st>>>(p, rows, counts);
  CUDA_CHECK_LAUNCH("topk (multi-block)");
}

void launch_topk(const TopkParams& p, cudaStream_t st) {
  topk_kernel<<<unsigned(p.rows), kTopkThreads, 0, st>>>(p);
  CUDA_CHECK_LAUNCH("topk");
}

void launch_mla_prefill(const MlaPrefillParams& p, int32_t* scratch, int* error_word, cudaStream_t st) {
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

int64_t mla_decode_partial_floats(const MlaDecodeParams& p) {
  const int64_t dk = p.kv_lora_rank + p.qk_rope_head_dim;
  const bool mma = p.topk && p.topk_len > 0 && p.pages.dtype == DType::BF16 && !p.pages.tiled &&
                   p.kv_lora_rank == kMmaR && dk % 64 == 0 && reinterpret_cast<uintptr_t>(p.cache) % 16 == 0 &&
                   mma_decode_smem_bytes(int(dk + 8)) <= size_t(max_dynamic_smem()) && device_has_bf16_mma();
  if (!mma) return 0;
  return std::min(p.s, kMmaRowChunk) * p.n_heads * ((p.topk_len + kMmaSplit - 1) / kMmaSplit) * (kMmaR + 2);
}

void launch_mla_decode(const MlaDecodeParams& p, int32_t* scratch, float* partials, int* error_word, cudaStream_t st) {
  if (p.s == 0) return;
  const int64_t dk = p.kv_lora_rank + p.qk_rope_head_dim;
  DecodeArgs a{};
  a.q = p.q_lat, a.cache = p.cache, a.pages = p.pages;
  a.bf16 = p.pages.dtype == DType::BF16;
  a.vec = aligned_rows(p.cache, dk, p.pages.dtype);
  a.q_pos = p.q_pos, a.out = p.out_lat;
  a.s = p.s, a.t = p.t, a.n_heads = p.n_heads, a.r = p.kv_lora_rank, a.dk = dk, a.scale = p.scale;
  if (p.topk) {
    launch_select_keys(p.topk, p.topk_len, p.q_pos, p.s, p.t, scratch, error_word, st, "mla_decode");
    a.keys = scratch, a.counts = scratch + p.s * p.topk_len, a.keys_ld = p.topk_len;
  }
  if (partials) {  // the caller sized them by mla_decode_partial_floats(p) > 0
    MmaDecodeArgs m{};
    m.q = p.q_lat, m.cache = reinterpret_cast<const uint16_t*>(p.cache), m.pages = p.pages;
    m.keys = a.keys, m.counts = a.counts, m.keys_ld = a.keys_ld, m.part = partials;
    m.n_heads = p.n_heads, m.dk = dk, m.splits = (p.topk_len + kMmaSplit - 1) / kMmaSplit;
    m.pitch = int(dk + 8), m.scale = p.scale;
    const int64_t groups = (p.n_heads + kMmaHeads - 1) / kMmaHeads;
    CHECK(kMmaRowChunk * m.splits * groups < (int64_t(1) << 31) && kMmaRowChunk * p.n_heads < (int64_t(1) << 31),
          "cuda mla_decode: n_heads = ", p.n_heads, " and topk_len = ", p.topk_len, " too large for one launch");
    const size_t smem = mma_decode_smem_bytes(m.pitch);
    reserve_smem(mla_decode_mma_kernel, smem, "mla_decode", "kv_lora_rank + qk_rope_head_dim");
    for (int64_t s0 = 0; s0 < p.s; s0 += kMmaRowChunk) {      // rows in launches of kMmaRowChunk: a row's
      const int64_t rows = std::min(kMmaRowChunk, p.s - s0);  // work does not depend on its launch
      m.s0 = s0;
      mla_decode_mma_kernel<<<unsigned(rows * m.splits * groups), kMmaThreads, smem, st>>>(m);
      CUDA_CHECK_LAUNCH("mla_decode");
      mla_decode_combine_kernel<<<unsigned(rows * p.n_heads), 128, 0, st>>>(partials, m.splits,
                                                                            p.out_lat + s0 * p.n_heads * kMmaR);
      CUDA_CHECK_LAUNCH("mla_decode combine");
    }
    return;
  }
  a.d4 = int(round_up4(dk));
  a.pitch = conflict_free_pitch(a.d4);
  // Heads per block: all of a row's heads (up to 64) once the rows fill the SMs; with fewer rows,
  // fewer heads per block so that about one block per SM still runs (the results do not change,
  // see mla_decode_kernel; only how often a key row is read from global memory does).
  const int64_t per_row = (int64_t(multiprocessor_count()) + p.s - 1) / p.s;
  int64_t g = std::clamp<int64_t>((p.n_heads + per_row - 1) / per_row, 1, std::min<int64_t>(p.n_heads, kDecMaxHeads));
  // Keys per tile: 32, or 16 where 32 does not fit (GLM-5's 64 heads x 576: 190 KB with 16).
  const size_t limit = size_t(max_dynamic_smem());
  int tk = 0;
  for (;;) {
    if (decode_smem_bytes(int(g), 32, a.pitch) <= limit) {
      tk = 32;
      break;
    }
    if (decode_smem_bytes(int(g), 16, a.pitch) <= limit) {
      tk = 16;
      break;
    }
    CHECK(g > 1, "cuda mla_decode: kv_lora_rank + qk_rope_head_dim = ", dk, " needs ",
          decode_smem_bytes(1, 16, a.pitch), " bytes of shared memory per block, the device allows ", limit);
    g = (g + 1) / 2;
  }
  a.g = int(g), a.tk = tk, a.ts = tk + 1;
  const int64_t groups = (p.n_heads + g - 1) / g, chunks = (p.kv_lora_rank + kDecColChunk - 1) / kDecColChunk;
  CHECK(p.s < (int64_t(1) << 31) && groups <= 65535 && chunks <= 65535, "cuda mla_decode: s = ", p.s,
        ", n_heads = ", p.n_heads, " or kv_lora_rank = ", p.kv_lora_rank, " too large for one launch");
  const size_t smem = decode_smem_bytes(a.g, a.tk, a.pitch);
  reserve_smem(mla_decode_kernel, smem, "mla_decode", "kv_lora_rank + qk_rope_head_dim");
  mla_decode_kernel<<<dim3(unsigned(p.s), unsigned(groups), unsigned(chunks)), kDecThreads, smem, st>>>(a);
  CUDA_CHECK_LAUNCH("mla_decode");
}

}  // namespace glm5::kernels::cuda
