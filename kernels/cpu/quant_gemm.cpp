// The fast CPU gemm for quantized weights (F8_E4M3 block-scaled, pack-quantized int4 / int8;
// element values in core/quant.h). Each work item dequantizes a block of W rows into a float32
// panel that stays in L2 (exactly the values weight_at() gives) and runs the float32 register
// tile of cpu/dot_tile.h over it, so an output element is the same dot_tile recipe over the same
// float32 weights whatever m, the block or the thread count: quantized results are bitwise those
// of the checkpoint dequantized to F32, and batch-invariant. Dequantization is the only new
// inner loop; it has an AVX-512 version and a portable one, chosen at run time from cpuid.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/dot_tile.h"
#include "cpu/fast_ops.h"
#include "cpu/panel_block.h"

#if defined(__x86_64__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace glm5::kernels::cpu::fast {

namespace {

// Float32 panel bytes per work item (the W block, dequantized): kept in L2 while x streams past.
constexpr int64_t kPanelBytes = 192 * 1024;

// ---- portable dequantization: one row segment [c0, c1) of row r into out[0, c1 - c0) ----------

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_e4m3_to_f32(uint8_t(i));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

void dequant_row_portable(const Weight& w, int64_t r, float* out) {
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + size_t(r) * quant::row_bytes(w.dtype, w.ld);
  const int64_t srow = (r / w.scale_block_rows) * w.scale_ld;
  if (w.dtype == DType::F8_E4M3) {
    const float* t = fp8_table().v;
    for (int64_t c0 = 0; c0 < w.cols; c0 += w.group) {
      const float s = quant::scale_at(w.scale_dtype, w.scale, srow + c0 / w.group);
      const int64_t c1 = std::min(w.cols, c0 + w.group);
      for (int64_t c = c0; c < c1; ++c) out[c] = t[row[c]] * s;
    }
    return;
  }
  for (int64_t c0 = 0; c0 < w.cols; c0 += w.group) {
    const float s = quant::scale_at(w.scale_dtype, w.scale, srow + c0 / w.group);
    const int64_t c1 = std::min(w.cols, c0 + w.group);
    if (w.dtype == DType::Q4) {  // the group's 16 values, by stored nibble q + 8
      float table[16];
      for (int u = 0; u < 16; ++u) table[u] = quant::round_to(w.scale_dtype, float(u - 8) * s);
      for (int64_t c = c0; c < c1; ++c) out[c] = table[(row[c / 2] >> (4 * (c & 1))) & 0xf];
      continue;
    }
    for (int64_t c = c0; c < c1; ++c)
      out[c] = quant::round_to(w.scale_dtype, float(quant::int_at(w.dtype, row, c)) * s);
  }
}

// ---- AVX-512 dequantization ---------------------------------------------------------------------

#if defined(__x86_64__)
#define GLM5_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))

GLM5_AVX512 inline __m512 round_to_avx512(DType t, __m512 v) {
  if (t == DType::BF16) {  // round to nearest even on the 16 dropped bits (finite values)
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  }
  if (t == DType::F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return v;
}

// 16 E4M3 bytes -> float32 times 2^-120, exactly: the code's 7 magnitude bits shifted into place
// (exponent field e, mantissa m) are the float 2^(e - 127) (1 + m / 8), or m 2^-129 for e = 0 (a
// float32 denormal), i.e. the E4M3 value times 2^-120 in both cases; so one multiply by
// scale * 2^120 gives fp8 * scale with the one rounding of weight_at. NaN codes give NaN.
constexpr float kTwo120 = 1.329227995784916e+36f;  // 2^120
GLM5_AVX512 inline __m512 fp8x16_biased(const uint8_t* p) {
  __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m512i mag = _mm512_and_si512(_mm512_slli_epi32(x, 20), _mm512_set1_epi32(0x07f00000));
  __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(x, 7), 31);
  __m512 v = _mm512_castsi512_ps(_mm512_or_si512(mag, sign));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7f));
  return _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(__builtin_nanf("")));
}

// fp8 * s for 16 codes: s * 2^120 as one factor unless that overflows (s >= 2^8), then two steps
// (the first exact).
struct Fp8Scale {
  __m512 f;
  bool two_steps;
  GLM5_AVX512 explicit Fp8Scale(float s) {
    const float pre = s * kTwo120;
    two_steps = !std::isfinite(pre) && std::isfinite(s);
    f = _mm512_set1_ps(two_steps ? s : pre);
  }
  GLM5_AVX512 __m512 apply(__m512 biased) const {
    if (two_steps) biased = _mm512_mul_ps(biased, _mm512_set1_ps(kTwo120));
    return _mm512_mul_ps(biased, f);
  }
};

GLM5_AVX512 inline __m512 q8x16(const uint8_t* p) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(128)));
}

// Groups are whole multiples of 16 columns here (checked by the caller); a ragged last chunk of
// a row (cols % 16) goes through the portable code. Int4 takes each group's 16 possible values
// from a table built once per group (the same rule, so the same floats) with one permute.
GLM5_AVX512 void dequant_row_avx512(const Weight& w, int64_t r, float* out) {
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + size_t(r) * quant::row_bytes(w.dtype, w.ld);
  const int64_t srow = (r / w.scale_block_rows) * w.scale_ld;
  const int64_t full = w.cols / 16 * 16;
  const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t c0 = 0; c0 < full; c0 += w.group) {
    const float s = quant::scale_at(w.scale_dtype, w.scale, srow + c0 / w.group);
    const __m512 sv = _mm512_set1_ps(s);
    const int64_t c1 = std::min(full, c0 + w.group);
    if (w.dtype == DType::Q4) {
      const __m512 table = round_to_avx512(w.scale_dtype, _mm512_mul_ps(levels, sv));  // value of stored nibble u = q + 8
      for (int64_t c = c0; c < c1; c += 16) {
        __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
        __m512i u = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
        _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(u, table));
      }
      continue;
    }
    const Fp8Scale fs(s);
    for (int64_t c = c0; c < c1; c += 16) {
      __m512 v;
      if (w.dtype == DType::F8_E4M3) v = fs.apply(fp8x16_biased(row + c));
      else v = round_to_avx512(w.scale_dtype, _mm512_mul_ps(q8x16(row + c), sv));
      _mm512_storeu_ps(out + c, v);
    }
  }
  for (int64_t c = full; c < w.cols; ++c) out[c] = weight_at(w, r, c);
}
#endif

#if defined(__AVX512F__)
// ---- AVX-512 small-m gemm: W rows dequantized in registers, no panel ----------------------------
// For m <= 4 (decode) a panel costs as much as the dot products: here each 16-column chunk of up to
// four W rows is dequantized into registers and multiplied straight into the accumulators. The
// recipe is dot_tile's exactly (lane l sums x[16q + l] * w[16q + l] by FMA in q order, then the
// simd::reduce tree), over the same float weights, so the bytes equal the panel path's.

// Per group state and one chunk of 16 dequantized values, per format.
template <DType DT, DType SD>
struct Chunk {
  __m512 t;  // Q4: the group's 16 values by stored nibble; Q8: the scale
  Fp8Scale fs{1.0f};
  GLM5_AVX512 void group(float s) {
    if constexpr (DT == DType::Q4)
      t = round_to_avx512(SD, _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm512_set1_ps(s)));
    else if constexpr (DT == DType::F8_E4M3)
      fs = Fp8Scale(s);
    else
      t = _mm512_set1_ps(s);
  }
  // Q4: 32 values (16 bytes) at once, chunks c and c + 16.
  GLM5_AVX512 void at2(const uint8_t* row, int64_t c, __m512& a, __m512& b) const {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2));
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
    a = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), t);
    b = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), t);
  }
  GLM5_AVX512 __m512 at(const uint8_t* row, int64_t c) const {
    if constexpr (DT == DType::Q4) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
      __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
      __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
      return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), t);
    } else if constexpr (DT == DType::Q8) {
      return round_to_avx512(SD, _mm512_mul_ps(q8x16(row + c), t));
    } else {
      return fs.apply(fp8x16_biased(row + c));
    }
  }
};

// y[r, j] (+)= x[r, :] . W[j, :] for r < MR, j in [j0, j0 + nr), nr <= 4; k % 16 == 0, group % 16 == 0.
// The next tile's rows are prefetched as this one goes (each W row is short, a few KiB: too
// short for the hardware prefetcher to ramp up on four streams at once).
template <int MR, int NR, DType DT, DType SD>
GLM5_AVX512 void fused_tile(const float* x, int64_t ldx, const Weight& w, int64_t j0, float* y, int64_t ldy,
                            bool accumulate) {
  constexpr int nr = NR;
  const size_t rb = quant::row_bytes(DT, w.ld);
  const uint8_t* rows[4];
  int64_t srow[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t j = j0 + std::min(c, nr - 1);
    rows[c] = static_cast<const uint8_t*>(w.data) + size_t(j) * rb;
    srow[c] = (j / w.scale_block_rows) * w.scale_ld;
  }
  const uint8_t* next = rows[0] + 4 * rb;  // the following tile's first row
  const int64_t bytes_per_k = DT == DType::Q4 ? 1 : 2;  // 2 x bytes per element (Q4: half a byte)
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < w.cols; g0 += w.group) {
    Chunk<DT, SD> ch[4];
    for (int c = 0; c < 4; ++c) ch[c].group(quant::scale_at(SD, w.scale, srow[c] + g0 / w.group));
    const int64_t g1 = std::min(w.cols, g0 + w.group);  // FP8's last block may be partial
    int64_t k = g0;
    if constexpr (DT == DType::Q4) {
      for (; k + 32 <= g1; k += 32) {
        if ((k * bytes_per_k / 2) % 64 == 0)
          for (int c = 0; c < nr; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * rb + k * bytes_per_k / 2), _MM_HINT_T0);
        __m512 x0[MR], x1[MR];
        for (int r = 0; r < MR; ++r) {
          x0[r] = _mm512_loadu_ps(x + r * ldx + k);
          x1[r] = _mm512_loadu_ps(x + r * ldx + k + 16);
        }
        for (int c = 0; c < 4; ++c) {
          if (c >= nr) break;
          __m512 w0, w1;
          ch[c].at2(rows[c], k, w0, w1);
          for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(x1[r], w1, _mm512_fmadd_ps(x0[r], w0, acc[r][c]));
        }
      }
    }
    for (; k < g1; k += 16) {
      if ((k * bytes_per_k / 2) % 64 == 0)
        for (int c = 0; c < nr; ++c) _mm_prefetch(reinterpret_cast<const char*>(next + c * rb + k * bytes_per_k / 2), _MM_HINT_T0);
      __m512 xv[MR];
      for (int r = 0; r < MR; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < 4; ++c) {
        if (c >= nr) break;
        const __m512 wv = ch[c].at(rows[c], k);
        for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < nr; ++c) {
      float* o = y + r * ldy + j0 + c;
      const float v = simd::reduce(acc[r][c]);
      *o = accumulate ? *o + v : v;
    }
}

template <int MR, DType DT, DType SD>
GLM5_AVX512 void fused_tile_nr(const GemmParams& p, int64_t j, int nr) {
  switch (nr) {
    case 4: fused_tile<MR, 4, DT, SD>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate); break;
    case 3: fused_tile<MR, 3, DT, SD>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate); break;
    case 2: fused_tile<MR, 2, DT, SD>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate); break;
    default: fused_tile<MR, 1, DT, SD>(p.x, p.ldx, p.w, j, p.y, p.ldy, p.accumulate); break;
  }
}

template <DType DT, DType SD>
GLM5_AVX512 void fused_rows(const GemmParams& p, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += 4) {
    const int nr = int(std::min<int64_t>(4, j1 - j));
    switch (p.m) {
      case 1: fused_tile_nr<1, DT, SD>(p, j, nr); break;
      case 2: fused_tile_nr<2, DT, SD>(p, j, nr); break;
      case 3: fused_tile_nr<3, DT, SD>(p, j, nr); break;
      default: fused_tile_nr<4, DT, SD>(p, j, nr); break;
    }
  }
}

using FusedFn = void (*)(const GemmParams&, int64_t, int64_t);

template <DType DT>
FusedFn fused_for_scale(DType sd) {
  if (sd == DType::BF16) return fused_rows<DT, DType::BF16>;
  if (sd == DType::F16) return fused_rows<DT, DType::F16>;
  return fused_rows<DT, DType::F32>;
}

FusedFn fused_fn(const Weight& w) {
  if (w.dtype == DType::Q4) return fused_for_scale<DType::Q4>(w.scale_dtype);
  if (w.dtype == DType::Q8) return fused_for_scale<DType::Q8>(w.scale_dtype);
  return fused_for_scale<DType::F8_E4M3>(w.scale_dtype);
}
#endif

bool cpu_has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// Which dequantization path runs: the best the CPU has, unless GLM5_CPU_KERNELS=portable or a
// test forces one.
std::atomic<int> g_forced{-1};  // -1 auto, 0 portable, 1 avx512

bool use_avx512() {
  static const bool has = cpu_has_avx512();
  static const bool env_portable = [] {
    const char* e = std::getenv("GLM5_CPU_KERNELS");
    const std::string v = e ? e : "";
    if (!v.empty() && v != "portable" && v != "auto")
      std::fprintf(stderr, "glm5: GLM5_CPU_KERNELS=%s ignored (expected portable or auto)\n", v.c_str());
    return v == "portable";
  }();
  const int f = g_forced.load(std::memory_order_relaxed);
  if (f >= 0) return f == 1 && has;
  return has && !env_portable;
}

}  // namespace

std::vector<std::string> quant_paths() {
  std::vector<std::string> p{"portable"};
  if (cpu_has_avx512()) p.push_back("avx512");
  return p;
}

void set_quant_path(const std::string& path) {
  CHECK(path == "auto" || path == "portable" || path == "avx512", "set_quant_path: unknown path '", path, "'");
  CHECK(path != "avx512" || cpu_has_avx512(), "set_quant_path: this CPU has no AVX-512");
  g_forced.store(path == "auto" ? -1 : path == "avx512" ? 1 : 0);
}

std::string quant_path() { return use_avx512() ? "avx512" : "portable"; }

void dequantize_rows(const Weight& w, int64_t r0, int64_t n, float* out, int64_t ldo) {
#if defined(__x86_64__)
  if (use_avx512() && w.group % 16 == 0) {
    for (int64_t i = 0; i < n; ++i) dequant_row_avx512(w, r0 + i, out + i * ldo);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dequant_row_portable(w, r0 + i, out + i * ldo);
}

// y = x W^T for a quantized W [n, k] cut into work items of W rows (cpu/gemm.cpp runs them):
// on AVX-512 builds, decode-sized calls dequantize in registers (fused_tile, 16 rows per item).
// Only where the register tile itself is the AVX-512 one (a build for AVX-512): its FMA is fused
// and the portable tile's (a * b + c) need not be, so mixing the two would make a row's bits
// depend on m. Otherwise each item dequantizes a block of rows once into a float32 panel.
QuantSplit quant_split(const GemmParams& p) {
  QuantSplit s;
#if defined(__AVX512F__)
  if (p.m <= 4 && use_avx512() && p.k % 16 == 0 && p.w.group % 16 == 0 && p.w.cols == p.k) {
    s.fused = true;
    s.rows_per_item = 16;
    s.items = (p.n + s.rows_per_item - 1) / s.rows_per_item;
    return s;
  }
#endif
  int64_t nb = kPanelBytes / (4 * std::max<int64_t>(p.k, 1));
  // (prefill runs panel_block over the panel, whose accumulators take 64 bytes per output: at most
  // kPanelCols W rows keep them in L2)
  s.rows_per_item = std::clamp<int64_t>(nb / kTileCols * kTileCols, kTileCols, p.m >= kPanelMinRows ? kPanelCols : 256);
  s.items = (p.n + s.rows_per_item - 1) / s.rows_per_item;
  return s;
}

void quant_item(const GemmParams& p, const QuantSplit& s, int64_t item) {
  const int64_t j0 = item * s.rows_per_item, j1 = std::min(p.n, j0 + s.rows_per_item);
#if defined(__AVX512F__)
  if (s.fused) {
    fused_fn(p.w)(p, j0, j1);
    return;
  }
#endif
  // One panel per thread, kept between calls: a fresh 192 KiB buffer per item would be mapped
  // and faulted in anew every time (decode makes hundreds of these calls per token).
  thread_local std::vector<float> panel;
  if (panel.size() < size_t(s.rows_per_item * p.k)) panel.resize(size_t(s.rows_per_item * p.k));
  dequantize_rows(p.w, j0, j1 - j0, panel.data(), p.k);
  if (p.m < kPanelMinRows || p.k == 0) {
    dot_block<LoadF32>(p.x, p.ldx, panel.data(), p.k, p.m, j1 - j0, p.k, p.y + j0, p.ldy, p.accumulate);
    return;
  }
  for (int64_t i0 = 0; i0 < p.m; i0 += kPanelRows)  // prefill: the cache-blocked kernel over the panel
    panel_block<LoadF32>(p.x + i0 * p.ldx, p.ldx, panel.data(), p.k, std::min(kPanelRows, p.m - i0), j1 - j0, p.k,
                         p.y + i0 * p.ldy + j0, p.ldy, p.accumulate);
}

// y = x W with a quantized W [k, n] (not on a hot path: the model dequantizes what it
// transposes at load): the whole matrix dequantized, then the float32 gemm.
void gemm_quantized_tn(const GemmParams& p) {
  std::vector<float> full(size_t(p.w.rows * p.w.cols));
  dequantize_rows(p.w, 0, p.w.rows, full.data(), p.w.cols);
  GemmParams q = p;
  q.w = Weight{full.data(), DType::F32, p.w.rows, p.w.cols, p.w.cols};
  gemm(q);
}

}  // namespace glm5::kernels::cpu::fast
