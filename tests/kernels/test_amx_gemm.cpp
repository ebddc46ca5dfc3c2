// The AMX-BF16 gemm (cpu/amx_gemm.h): the three bf16 terms of an activation sum to it exactly; the
// kernel on emulated tiles (every machine) and on the hardware (machines with AMX; skipped with the
// reason elsewhere) is close to a float64 dot product over every shape edge (k, n and m around the
// tile sizes, strides, accumulate), batch-invariant bitwise, independent of how W rows are cut
// into calls, and the same bytes from a kTile16 weight as from the row-major one; through the cpu
// backend on each BF16 path, close to the reference backend and invariant in m and in the thread
// count, and on the AMX paths holding BF16 weights as kTile16.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/core/dtype.h"
#include "kernels/cpu/amx_gemm.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/weight_arena.h"
#include "kernels/ops.h"

namespace glm5::kernels::test {
namespace {

using cpu::amx::PackedX;

TEST(AmxGemm, ThreeTermsSumExactly) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mant(-2, 2);
  // (Below ~2^-100 the third term would be a denormal, which the tiles read as zero: activations
  // are never that small.)
  std::uniform_int_distribution<int> ex(-100, 120);
  for (int i = 0; i < 200000; ++i) {
    const float v = std::ldexp(mant(rng), ex(rng));
    uint16_t t[3];
    cpu::amx::split_terms(v, t);
    const double sum = double(bf16_to_f32(t[0])) + double(bf16_to_f32(t[1])) + double(bf16_to_f32(t[2]));
    ASSERT_EQ(sum, double(v)) << v;
    ASSERT_EQ(t[0], f32_to_bf16(v)) << "the first term is bf16(v)";
  }
  uint16_t t[3];
  cpu::amx::split_terms(3.4e38f, t);  // rounds to infinity in bf16: truncated instead
  EXPECT_EQ(double(bf16_to_f32(t[0])) + bf16_to_f32(t[1]) + bf16_to_f32(t[2]), double(3.4e38f));
  cpu::amx::split_terms(INFINITY, t);
  EXPECT_TRUE(std::isinf(bf16_to_f32(t[0])));
  EXPECT_EQ(t[1], 0);
}

// Every x element's terms sit where the B tiles read them (pair kk of chunk kc, column 3 (i % 5) + t
// of block i / 5), zeros past k and past m; infinities, NaNs and values near the float32 maximum
// included.
TEST(AmxGemm, PackPlacesEveryTerm) {
  PackedX px;  // reused from larger to smaller m: stale bytes must not show through
  for (int64_t m : {21, 16, 5, 3, 2, 1}) {
    const int64_t k = 70, ldx = 75;
    std::vector<float> x(size_t(m * ldx));
    std::mt19937 rng{uint32_t(m)};
    std::normal_distribution<float> d(0, 1);
    for (float& v : x) v = d(rng);
    x[3] = INFINITY, x[size_t((m - 1) * ldx + 40)] = NAN, x[10] = 3.4e38f, x[size_t((m - 1) * ldx + 69)] = -3.4e38f;
    cpu::amx::pack_x(x.data(), ldx, m, k, px);
    ASSERT_EQ(px.n_cols, 3 * std::min<int64_t>(m, 5));
    ASSERT_EQ(px.ld, m == 1 ? 4 : m == 2 ? 8 : 16);  // tile rows of 16, 32 or 64 bytes
    ASSERT_EQ(px.col_blocks, (m + 4) / 5);
    for (int64_t i = 0; i < px.col_blocks * 5; ++i) {
      if (3 * (i % 5) >= px.n_cols) continue;
      for (int64_t c = 0; c < px.chunks * 32; ++c) {
        uint16_t want[3] = {0, 0, 0};
        if (i < m && c < k) cpu::amx::split_terms(x[size_t(i * ldx + c)], want);
        for (int t = 0; t < 3; ++t) {
          const uint16_t got = px.tile(i / 5, c / 32)[((c % 32) / 2 * px.ld + 3 * (i % 5) + t) * 2 + c % 2];
          ASSERT_EQ(got, want[t]) << "m " << m << " row " << i << " k " << c << " term " << t;
        }
      }
    }
  }
}

// The same on finite bit patterns of every kind, a tile at a time (the vectorised packing where the
// build has it): denormals, signed zeros, rounding ties of both parities, values just under where
// bf16 rounding overflows, and uniformly random bits, with one special value in a single chunk.
TEST(AmxGemm, PackSplitsEdgeValuesLikeSplitTerms) {
  for (int64_t m : {1, 2, 7}) {  // (one row: decode's own tile rows of 4 dwords)
    const int64_t k = 96;
    std::vector<float> x(size_t(m * k));
    std::mt19937 rng{uint32_t(11 + m)};
    const uint32_t edge[] = {0x00000001u, 0x80000001u, 0x007fffffu, 0x00008000u, 0x00018000u, 0x3f808000u,
                             0x3f818000u, 0x80000000u, 0x00000000u, 0x7f7f7fffu, 0xff7f7fffu, 0x3f80ffffu};
    for (size_t i = 0; i < x.size(); ++i) {
      uint32_t u = i < std::size(edge) ? edge[i] : uint32_t(rng());
      if ((u & 0x7f800000u) == 0x7f800000u) u &= 0xbfffffffu;  // finite
      std::memcpy(&x[i], &u, 4);
    }
    x[size_t((m - 1) * k + 70)] = INFINITY;  // chunk 2 of the last block only
    PackedX px;
    cpu::amx::pack_x(x.data(), k, m, k, px);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < k; ++c) {
        uint16_t want[3];
        cpu::amx::split_terms(x[size_t(i * k + c)], want);
        for (int t = 0; t < 3; ++t) {
          const uint16_t got = px.tile(i / 5, c / 32)[((c % 32) / 2 * px.ld + 3 * (i % 5) + t) * 2 + c % 2];
          ASSERT_EQ(got, want[t]) << "m " << m << " row " << i << " k " << c << " term " << t << " value "
                                  << x[size_t(i * k + c)];
        }
      }
  }
}

struct Problem {
  int64_t m, n, k, ldw, ldy;
  std::vector<float> x;
  std::vector<uint16_t> w;
  std::vector<double> exact;  // float64 x W^T
  std::vector<double> mag;    // sum |x| |w| per element: the scale of rounding error
};

Problem make_problem(int64_t m, int64_t n, int64_t k, uint32_t seed) {
  Problem p{m, n, k, k + 3, n + 5, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 1);
  p.x.resize(size_t(m * k));
  for (float& v : p.x) v = d(rng);
  p.w.assign(size_t(n * p.ldw), 0x7fc0);  // NaN in the stride padding: must never be read
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < k; ++c) p.w[size_t(j * p.ldw + c)] = f32_to_bf16(0.1f * d(rng));
  p.exact.assign(size_t(m * n), 0);
  p.mag.assign(size_t(m * n), 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < k; ++c) {
        const double a = p.x[size_t(i * k + c)], b = bf16_to_f32(p.w[size_t(j * p.ldw + c)]);
        p.exact[size_t(i * n + j)] += a * b;
        p.mag[size_t(i * n + j)] += std::fabs(a * b);
      }
  return p;
}

// p's W in WeightLayout::kTile16 (groups of 16 rows as 16 x 32 tiles, zero padding), row stride
// ld = k rounded up to 32, by the layout's offset function.
std::vector<uint16_t> tile16_of(const Problem& p, int64_t& ld) {
  ld = (p.k + 31) / 32 * 32;
  std::vector<uint16_t> t(size_t((p.n + 15) / 16 * 16 * ld), 0);
  for (int64_t j = 0; j < p.n; ++j)
    for (int64_t c = 0; c < p.k; ++c) t[size_t(tile16_offset(j, c, ld))] = p.w[size_t(j * p.ldw + c)];
  return t;
}

// y [m, ldy] from gemm_rows over W rows cut into calls of `rows` rows (0: one call; a multiple of
// 16 when tiled), W row-major or as kTile16.
std::vector<float> run_rows(const Problem& p, bool emulated, int64_t rows, bool accumulate = false,
                            bool tiled = false) {
  PackedX px;
  cpu::amx::pack_x(p.x.data(), p.k, p.m, p.k, px);
  std::vector<float> y(size_t(p.m * p.ldy), accumulate ? 0.5f : -7.0f);
  int64_t ld = p.ldw;
  const std::vector<uint16_t> w = tiled ? tile16_of(p, ld) : p.w;
  if (rows == 0) rows = p.n;
  for (int64_t j0 = 0; j0 < p.n; j0 += rows)
    cpu::amx::gemm_rows(px, w.data() + j0 * ld, ld, tiled, std::min(rows, p.n - j0), y.data() + j0, p.ldy, accumulate,
                        emulated);
  return y;
}

// The kTile16 weight gives the row-major weight's bytes (the same tiles, read from elsewhere).
void expect_tiled_same(const Problem& p, bool emulated, const std::vector<float>& y, int64_t rows = 0,
                       bool accumulate = false) {
  const auto t = run_rows(p, emulated, rows, accumulate, true);
  ASSERT_EQ(0, std::memcmp(t.data(), y.data(), y.size() * 4)) << "kTile16 weight, calls of " << rows << " rows";
}

void expect_close(const Problem& p, const std::vector<float>& y, float offset = 0) {
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      const double e = p.exact[size_t(i * p.n + j)] + offset;
      // float32 accumulation over k terms: a few ulps of the magnitude per term.
      const double tol = 1e-6 * (1.0 + p.mag[size_t(i * p.n + j)]) * std::sqrt(double(p.k));
      ASSERT_NEAR(y[size_t(i * p.ldy + j)], e, tol) << "row " << i << " col " << j;
    }
    for (int64_t j = p.n; j < p.ldy; ++j)  // the stride gap is never written
      ASSERT_EQ(y[size_t(i * p.ldy + j)], offset ? 0.5f : -7.0f) << "row " << i << " gap " << j;
  }
}

// Shapes around every edge: m around the 5-row B block (and 16 / 32), n around 16 / 32, k around
// the 32-wide chunk.
void check_kernel(bool emulated) {
  uint32_t seed = 1;
  for (int64_t k : {1, 2, 31, 32, 33, 64, 100, 300})
    for (int64_t n : {1, 15, 16, 17, 31, 32, 33, 70})
      for (int64_t m : {1, 2, 3, 4, 5, 6, 10, 11, 16, 17, 33, 40}) {
        if (k > 64 && n > 32 && m > 17) continue;  // the emulation is slow; edges are covered
        SCOPED_TRACE("m " + std::to_string(m) + " n " + std::to_string(n) + " k " + std::to_string(k));
        const Problem p = make_problem(m, n, k, seed++);
        const auto y = run_rows(p, emulated, 0);
        expect_close(p, y);
        expect_tiled_same(p, emulated, y);
        if (m == 17 && n == 33) {
          const auto ya = run_rows(p, emulated, 0, true);
          expect_close(p, ya, 0.5f);
          expect_tiled_same(p, emulated, ya, 0, true);
        }
      }
}

// Row i alone, or W rows in calls of 16 / 32 / 48, give the bytes of the whole call.
void check_invariance(bool emulated) {
  for (int64_t m : {5, 6, 9, 16, 37, 150}) {
    const Problem p = make_problem(m, 70, 300, uint32_t(m));
    const auto all = run_rows(p, emulated, 0);
    for (int64_t rows : {16, 32, 48}) {
      const auto cut = run_rows(p, emulated, rows);
      ASSERT_EQ(0, std::memcmp(all.data(), cut.data(), all.size() * 4)) << "W rows in calls of " << rows;
      expect_tiled_same(p, emulated, all, rows);
    }
    for (int64_t i : {int64_t(0), int64_t(3), int64_t(17), m - 1}) {
      if (i >= m) continue;
      Problem one = p;
      one.m = 1;
      one.x.assign(p.x.begin() + i * p.k, p.x.begin() + (i + 1) * p.k);
      const auto y1 = run_rows(one, emulated, 0);
      ASSERT_EQ(0, std::memcmp(y1.data(), all.data() + i * p.ldy, size_t(p.n) * 4)) << "row " << i << " of " << m;
    }
  }
}

// W rows with one power-of-two entry each: y[i, j] = x[i, c_j] 2^e_j exactly, which holds only if
// all three terms of x reach the tiles at the right k (a lost term or pair is a wrong bit here).
void check_one_hot(bool emulated) {
  for (int64_t k : {1, 33, 100})
    for (int64_t m : {1, 19}) {
      Problem p = make_problem(m, 37, k, 11);
      std::mt19937 rng{uint32_t(k)};
      for (int64_t j = 0; j < p.n; ++j) {
        const int64_t c = int64_t(rng() % uint32_t(k));
        const int e = int(rng() % 9) - 4;
        for (int64_t q = 0; q < k; ++q) p.w[size_t(j * p.ldw + q)] = q == c ? f32_to_bf16(std::ldexp(1.0f, e)) : 0;
        for (int64_t i = 0; i < m; ++i) p.exact[size_t(i * p.n + j)] = std::ldexp(double(p.x[size_t(i * k + c)]), e);
      }
      for (bool tiled : {false, true}) {
        const auto y = run_rows(p, emulated, 0, false, tiled);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < p.n; ++j)
            ASSERT_EQ(double(y[size_t(i * p.ldy + j)]), p.exact[size_t(i * p.n + j)])
                << "k " << k << " row " << i << " col " << j << (tiled ? " (kTile16)" : "");
      }
    }
}

// The hardware tests' first line: skip, saying why, where this machine cannot run AMX.
#define SKIP_WITHOUT_AMX()                                                  \
  do {                                                                      \
    std::string why;                                                        \
    if (!cpu::amx::available(&why)) GTEST_SKIP() << "no AMX here: " << why; \
  } while (0)

TEST(AmxGemm, EmulatedTilesExactOnOneHotWeights) { check_one_hot(true); }
TEST(AmxGemm, EmulatedTilesCloseToFloat64) { check_kernel(true); }
TEST(AmxGemm, EmulatedTilesBatchInvariant) { check_invariance(true); }

TEST(AmxGemm, HardwareTilesCloseToFloat64) {
  SKIP_WITHOUT_AMX();
  check_kernel(false);
}

TEST(AmxGemm, HardwareTilesExactOnOneHotWeights) {
  SKIP_WITHOUT_AMX();
  check_one_hot(false);
}

TEST(AmxGemm, HardwareTilesBatchInvariant) {
  SKIP_WITHOUT_AMX();
  check_invariance(false);
}

// The hardware and the emulation compute the same products and chunk order; inside one
// instruction the hardware may add pairs in another order, so the last bits may differ, no more.
TEST(AmxGemm, HardwareCloseToEmulation) {
  SKIP_WITHOUT_AMX();
  const Problem p = make_problem(40, 70, 300, 9);
  const auto hw = run_rows(p, false, 0), emu = run_rows(p, true, 0);
  int64_t differ = 0;
  for (size_t i = 0; i < hw.size(); ++i) {
    ASSERT_NEAR(hw[i], emu[i], 1e-5f * (1 + std::fabs(emu[i]))) << i;
    differ += hw[i] != emu[i];
  }
  RecordProperty("elements_differing_from_emulation", int(differ));
}

TEST(AmxGemm, PathSelection) {
  const auto paths = cpu::fast::gemm_paths();
  ASSERT_GE(paths.size(), 2u);
  EXPECT_EQ(paths.front(), "fp32");
  EXPECT_EQ(paths.back(), "amx-emulated");
  EXPECT_EQ(std::find(paths.begin(), paths.end(), "amx") != paths.end(), cpu::amx::available());
  EXPECT_THROW(cpu::fast::set_gemm_path("amx512"), std::exception);
  if (!cpu::amx::available()) {
    try {
      cpu::fast::set_gemm_path("amx");
      FAIL() << "amx accepted on a machine without it";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("cannot run AMX"), std::string::npos) << e.what();
    }
  }
  cpu::fast::set_gemm_path("auto");
  EXPECT_EQ(cpu::fast::gemm_path(), cpu::amx::available() ? "amx" : "fp32");
}

std::vector<float> backend_gemm(Backend& b, const std::vector<uint16_t>& w, int64_t n, int64_t k,
                                const std::vector<float>& x, int64_t m) {
  std::vector<float> y(size_t(m * n), -7.0f);
  GemmParams p;
  p.x = x.data(), p.ldx = k, p.w = Weight{w.data(), DType::BF16, n, k, k}, p.y = y.data(), p.ldy = n;
  p.m = m, p.n = n, p.k = k;
  b.gemm(p);
  return y;
}

// Through the cpu backend on every BF16 path: close to the reference backend, a row's bytes
// independent of m (decode and prefill sizes) and of the thread count.
TEST(AmxGemm, BackendEveryPathCloseAndInvariant) {
  auto cpu_b = make_cpu_backend();
  auto ref = make_reference_backend();
  const int64_t n = 300, k = 640;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0, 1);
  std::vector<uint16_t> w(size_t(n * k));
  for (auto& v : w) v = f32_to_bf16(0.05f * d(rng));
  for (const std::string& path : cpu::fast::gemm_paths()) {
    SCOPED_TRACE(path);
    cpu::fast::set_gemm_path(path);
    const int64_t big = path == "amx-emulated" ? 40 : 300;
    std::vector<float> x(size_t(big * k));
    for (float& v : x) v = d(rng);
    const auto y = backend_gemm(*cpu_b, w, n, k, x, big), yr = backend_gemm(*ref, w, n, k, x, big);
    for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], yr[i], 1e-4f * (1 + std::fabs(yr[i]))) << i;
    const std::vector<float> x0(x.begin() + 5 * k, x.begin() + 6 * k);
    const auto y0 = backend_gemm(*cpu_b, w, n, k, x0, 1);
    ASSERT_EQ(0, std::memcmp(y0.data(), y.data() + 5 * n, size_t(n) * 4)) << "row 5 alone";
    const int saved = omp_get_max_threads();
    omp_set_num_threads(2);
    const auto y2 = backend_gemm(*cpu_b, w, n, k, x, big);
    omp_set_num_threads(saved);
    ASSERT_EQ(0, std::memcmp(y2.data(), y.data(), y.size() * 4)) << "2 threads";
    // A batch where two gemms share x (packed once) and one has its own: each as alone.
    std::vector<float> ya(size_t(big * n)), yb(size_t(big * 100)), yc(static_cast<size_t>(n));
    GemmParams pa, pb, pc;
    pa.x = x.data(), pa.ldx = k, pa.w = Weight{w.data(), DType::BF16, n, k, k}, pa.y = ya.data(), pa.ldy = n;
    pa.m = big, pa.n = n, pa.k = k;
    pb = pa, pb.w = Weight{w.data() + 7 * k, DType::BF16, 100, k, k}, pb.y = yb.data(), pb.ldy = 100, pb.n = 100;
    pc = pa, pc.x = x0.data(), pc.m = 1, pc.y = yc.data();
    const GemmParams batch[] = {pa, pb, pc};
    cpu_b->gemm_batch(batch, 3);
    ASSERT_EQ(0, std::memcmp(ya.data(), y.data(), y.size() * 4)) << "batch: shared x";
    ASSERT_EQ(0, std::memcmp(yc.data(), y0.data(), y0.size() * 4)) << "batch: own x";
    for (int64_t i = 0; i < big; ++i)
      ASSERT_EQ(0, std::memcmp(yb.data() + i * 100, y.data() + i * n + 7, 400)) << "batch: shared x, row " << i;
  }
  cpu::fast::set_gemm_path("auto");
}

// On the AMX paths the cpu backend holds BF16 gemm matrices as kTile16 (zero-padded to 16 rows and
// 32 columns, every element where weight_at finds it) and a gemm over them gives the bytes of the
// row-major weight on the same path, at decode and prefill sizes, alone and in a batch; the
// refusals: kTile16 with trans_w, another dtype, ld off 32, the fp32 path, a slice inside a group.
TEST(AmxGemm, BackendHoldsBf16InTiles) {
  cpu::WeightArena probe;
  std::vector<uint8_t> mib(size_t(1) << 20);
  if (!probe.copy(mib.data(), mib.size())) GTEST_SKIP() << "the weight arena copies nothing here";
  auto cpu_b = make_cpu_backend();
  const int64_t n = 70, k = 100;  // neither a multiple of the tile
  std::mt19937 rng(8);
  std::normal_distribution<float> d(0, 1);
  std::vector<uint16_t> w(size_t(n * k));
  for (auto& v : w) v = f32_to_bf16(0.05f * d(rng));
  const Weight rows{w.data(), DType::BF16, n, k, k};
  struct RestorePath {
    ~RestorePath() { cpu::fast::set_gemm_path("auto"); }
  } restore;  // also when an assertion returns early
  for (const std::string& path : cpu::fast::gemm_paths()) {
    if (path == "fp32") continue;
    SCOPED_TRACE(path);
    cpu::fast::set_gemm_path(path);
    const Weight t = cpu_b->upload_gemm_matrix(rows, w.size() * 2);
    ASSERT_EQ(t.layout, WeightLayout::kTile16);
    ASSERT_EQ(t.ld, 128);
    for (int64_t r = 0; r < 80; ++r)
      for (int64_t c = 0; c < t.ld; ++c) {
        const uint16_t got = static_cast<const uint16_t*>(t.data)[tile16_offset(r, c, t.ld)];
        ASSERT_EQ(got, r < n && c < k ? w[size_t(r * k + c)] : uint16_t(0)) << r << ", " << c;
        if (r < n && c < k) {
          ASSERT_EQ(weight_at(t, r, c), bf16_to_f32(got));
        }
      }
    for (int64_t m : {1, 3, 40}) {
      std::vector<float> x(size_t(m * k));
      for (float& v : x) v = d(rng);
      std::vector<float> yr(size_t(m * n)), yt(size_t(m * n)), yb(size_t(m * n));
      cpu_b->gemm({x.data(), k, rows, false, yr.data(), n, m, n, k});
      cpu_b->gemm({x.data(), k, t, false, yt.data(), n, m, n, k});
      ASSERT_EQ(0, std::memcmp(yr.data(), yt.data(), yr.size() * 4)) << "m=" << m;
      const GemmParams batch[] = {{x.data(), k, t.slice_rows(16, 48), false, yb.data() + 16, n, m, 48, k},
                                  {x.data(), k, t.slice_rows(0, 16), false, yb.data(), n, m, 16, k},
                                  {x.data(), k, t.slice_rows(64, 6), false, yb.data() + 64, n, m, 6, k}};
      cpu_b->gemm_batch(batch, 3);
      ASSERT_EQ(0, std::memcmp(yr.data(), yb.data(), yr.size() * 4)) << "batch of slices, m=" << m;
      std::vector<float> acc_r(size_t(m * n), 0.25f), acc_t(acc_r);
      GemmParams ar{x.data(), k, rows, false, acc_r.data(), n, m, n, k}, at = ar;
      ar.accumulate = true, at.w = t, at.y = acc_t.data(), at.accumulate = true;
      cpu_b->gemm(ar), cpu_b->gemm(at);
      ASSERT_EQ(0, std::memcmp(acc_r.data(), acc_t.data(), acc_r.size() * 4)) << "accumulate, m=" << m;
      EXPECT_NE(acc_t[0], yt[0]);
    }
    // Several distinct x in one batch, enough elements to be packed one per thread (prefill's
    // experts): each gemm's bytes as alone.
    {
      const int64_t m = 40, kk = 1024;
      std::vector<uint16_t> w2(size_t(16 * kk));
      for (auto& v : w2) v = f32_to_bf16(0.05f * d(rng));
      const Weight t2 = cpu_b->upload_gemm_matrix(Weight{w2.data(), DType::BF16, 16, kk, kk}, w2.size() * 2);
      std::vector<std::vector<float>> xs(3), alone(3), together(3);
      std::vector<GemmParams> batch;
      for (int b = 0; b < 3; ++b) {
        xs[size_t(b)].resize(size_t(m * kk));
        for (float& v : xs[size_t(b)]) v = d(rng);
        alone[size_t(b)].resize(size_t(m * 16)), together[size_t(b)].resize(size_t(m * 16));
        cpu_b->gemm({xs[size_t(b)].data(), kk, t2, false, alone[size_t(b)].data(), 16, m, 16, kk});
        batch.push_back({xs[size_t(b)].data(), kk, t2, false, together[size_t(b)].data(), 16, m, 16, kk});
      }
      const int saved = omp_get_max_threads();
      omp_set_num_threads(2);
      cpu_b->gemm_batch(batch);
      omp_set_num_threads(saved);
      for (int b = 0; b < 3; ++b)
        ASSERT_EQ(0, std::memcmp(alone[size_t(b)].data(), together[size_t(b)].data(), alone[size_t(b)].size() * 4))
            << "x " << b << " packed beside the others";
    }
    // A decode-sized batch on 2 threads (the small x packed where first read, by whichever thread
    // gets there): 16 gemms each with its own one-row x (the per-head absorption) and 4 sharing
    // one two-row x; each gemm's bytes as alone.
    {
      const int64_t kk = 512, nn = 64;
      std::vector<uint16_t> w3(size_t(nn * kk));
      for (auto& v : w3) v = f32_to_bf16(0.05f * d(rng));
      const Weight t3 = cpu_b->upload_gemm_matrix(Weight{w3.data(), DType::BF16, nn, kk, kk}, w3.size() * 2);
      std::vector<float> xs(size_t(16 * kk)), shared(size_t(2 * kk));
      for (float& v : xs) v = d(rng);
      for (float& v : shared) v = d(rng);
      std::vector<float> alone(size_t(20 * 2 * nn)), together(alone.size(), -1.0f);
      std::vector<GemmParams> batch;
      for (int64_t b = 0; b < 20; ++b) {
        const bool own = b < 16;
        const float* xb = own ? xs.data() + b * kk : shared.data();
        const int64_t m = own ? 1 : 2;
        cpu_b->gemm({xb, kk, t3, false, alone.data() + b * 2 * nn, nn, m, nn, kk});
        batch.push_back({xb, kk, t3, false, together.data() + b * 2 * nn, nn, m, nn, kk});
      }
      for (int rep = 0; rep < 3; ++rep) {  // (the packs are reused from one call to the next)
        const int saved = omp_get_max_threads();
        omp_set_num_threads(2);
        cpu_b->gemm_batch(batch);
        omp_set_num_threads(saved);
        for (int64_t b = 0; b < 20; ++b)
          ASSERT_EQ(0, std::memcmp(alone.data() + b * 2 * nn, together.data() + b * 2 * nn,
                                   size_t((b < 16 ? 1 : 2) * nn) * 4))
              << "gemm " << b << " in a decode batch, call " << rep;
      }
    }
    std::vector<float> x(size_t(k * 64)), y(size_t(k * 64));
    auto message = [&](const GemmParams& p) {
      try {
        cpu_b->gemm(p);
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    EXPECT_NE(message({x.data(), 70,
                       Weight{t.data, DType::BF16, 70, 100, 128, nullptr, DType::F32, 0, 0, 1, WeightLayout::kTile16},
                       true, y.data(), 100, 1, 100, 70})
                  .find("kTile16"),
              std::string::npos);
    Weight f16 = t;
    f16.dtype = DType::F16;
    EXPECT_NE(message({x.data(), k, f16, false, y.data(), n, 1, n, k}).find("only BF16"), std::string::npos);
    Weight odd = t;
    odd.ld = 112;
    EXPECT_NE(message({x.data(), k, odd, false, y.data(), n, 1, n, k}).find("ld 112"), std::string::npos);
    cpu::fast::set_gemm_path("fp32");
    EXPECT_NE(message({x.data(), k, t, false, y.data(), n, 1, n, k}).find("fp32 gemm path"), std::string::npos);
    try {
      (void)t.slice_rows(8, 8);
      ADD_FAILURE() << "a slice inside a group of 16 rows was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("group of 16"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace glm5::kernels::test
