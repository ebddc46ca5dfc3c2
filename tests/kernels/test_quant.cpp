// Quantized weights (core/quant.h): the scalar element rules (FP8 E4M3 decode/encode, F16
// rounding, int4/int8 unpacking), and the fast CPU gemm over F8_E4M3 / Q4 / Q8 weights on every
// dequantization path this CPU has: bitwise equal to the same gemm over the weights dequantized to
// float32 (weight_at), close to the reference, batch-invariant (a row's bytes do not depend on m)
// and independent of the thread count; also in the quads of rows the fast backend holds them in
// (kQuantQuad, int4 in nibble128 order: the same values, the same bytes out).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/dot_tile.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/ops.h"

namespace glm5::kernels::test {
namespace {

TEST(Quant, Fp8DecodeEncodeRoundTrip) {
  // Every finite code decodes to a value that encodes back to the same code.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    const float v = fp8_e4m3_to_f32(uint8_t(c));
    const uint8_t back = quant::f32_to_fp8_e4m3(v);
    if (v == 0.0f)
      EXPECT_EQ(back & 0x7f, 0) << c;
    else
      EXPECT_EQ(back, c) << "code " << c << " value " << v;
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(quant::f32_to_fp8_e4m3(1e6f), 0x7e);           // saturates
  EXPECT_EQ(quant::f32_to_fp8_e4m3(-1e6f), 0xfe);
  // Round to nearest even: 1 + 1/16 lies halfway between 1 and 1 + 1/8.
  EXPECT_EQ(fp8_e4m3_to_f32(quant::f32_to_fp8_e4m3(1.0625f)), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(quant::f32_to_fp8_e4m3(1.1875f)), 1.25f);
}

// Encoding picks the nearest E4M3 value, ties to an even mantissa, saturating at 448: checked
// against the decoded neighbours for 2^24 float32 values spread over the whole range.
TEST(Quant, Fp8EncodingIsNearestEven) {
  for (uint32_t u = 0; u < 0x44000000u; u += 67) {  // up to 512, past saturation
    float v;
    std::memcpy(&v, &u, 4);
    const uint8_t c = quant::f32_to_fp8_e4m3(v);
    const float got = fp8_e4m3_to_f32(c);
    if (v >= 448.0f) {
      ASSERT_EQ(c, 0x7e) << v;
      continue;
    }
    const float lo = c > 0 ? fp8_e4m3_to_f32(uint8_t(c - 1)) : 0.0f;
    const float hi = c == 0x7e ? INFINITY : fp8_e4m3_to_f32(uint8_t(c + 1));  // 0x7f is NaN
    const double d = std::fabs(double(v) - got);
    ASSERT_LE(d, std::fabs(double(v) - lo)) << v << " -> " << got;
    ASSERT_LE(d, std::fabs(double(v) - hi)) << v << " -> " << got;
    if (d == std::fabs(double(v) - lo) && c > 0 && got != lo) {
      ASSERT_EQ(c & 1, 0) << "tie " << v;
    }
    if (d == std::fabs(double(v) - hi) && got != hi) {
      ASSERT_EQ(c & 1, 0) << "tie " << v;
    }
    ASSERT_EQ(quant::f32_to_fp8_e4m3(-v), c | 0x80) << v;
  }
}

TEST(Quant, F16RoundingIsIeee) {
  // Against the hardware-independent definition: the nearest f16, ties to even.
  EXPECT_EQ(quant::round_to(DType::F16, 1.0f + std::ldexp(1.0f, -11)), 1.0f);  // tie -> even
  EXPECT_EQ(quant::round_to(DType::F16, 1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(quant::round_to(DType::F16, std::ldexp(1.0f, -24)), std::ldexp(1.0f, -24));  // subnormal
  EXPECT_TRUE(std::isinf(quant::round_to(DType::F16, 70000.0f)));
  EXPECT_EQ(quant::round_to(DType::BF16, 1.0f + std::ldexp(1.0f, -8)), 1.0f);
  EXPECT_EQ(quant::round_to(DType::F32, 1.1f), 1.1f);
}

TEST(Quant, IntUnpackingFollowsPackQuantized) {
  // Byte 0x2f: element 0 = low nibble 0xf -> 15 - 8 = 7, element 1 = 0x2 -> -6.
  const uint8_t row[2] = {0x2f, 0x80};
  EXPECT_EQ(quant::int_at(DType::Q4, row, 0), 7);
  EXPECT_EQ(quant::int_at(DType::Q4, row, 1), -6);
  EXPECT_EQ(quant::int_at(DType::Q4, row, 2), -8);
  EXPECT_EQ(quant::int_at(DType::Q4, row, 3), 0);
  EXPECT_EQ(quant::int_at(DType::Q8, row, 1), 0);
  EXPECT_EQ(quant::int_at(DType::Q8, row, 0), 0x2f - 128);
}

// A random quantized weight [n, k] with its storage.
struct QWeight {
  std::vector<uint8_t> data, scale;
  Weight w;
};

QWeight random_weight(DType dt, DType scale_dt, int64_t n, int64_t k, int64_t group, uint64_t seed) {
  std::mt19937_64 rng(seed);
  QWeight q;
  int64_t ld = k, srows = n, scols;
  if (dt == DType::Q4) ld = (k + 7) / 8 * 8;
  if (dt == DType::Q8) ld = (k + 3) / 4 * 4;
  q.data.resize(quant::row_bytes(dt, ld) * size_t(n));
  for (auto& b : q.data) {
    b = uint8_t(rng());
    if (dt == DType::F8_E4M3 && (b & 0x7f) == 0x7f) b ^= 1;  // no NaN codes
  }
  if (dt == DType::F8_E4M3) {
    srows = (n + 127) / 128;
    scols = (k + 127) / 128;
    group = 128;
  } else {
    scols = k / group;
  }
  std::uniform_real_distribution<float> u(0.001f, 0.05f);
  q.scale.resize(size_t(srows * scols) * dtype_size(scale_dt));
  for (int64_t i = 0; i < srows * scols; ++i) {
    const float s = u(rng);
    if (scale_dt == DType::F32)
      std::memcpy(q.scale.data() + 4 * i, &s, 4);
    else if (scale_dt == DType::BF16)
      reinterpret_cast<uint16_t*>(q.scale.data())[i] = f32_to_bf16(s);
    else
      reinterpret_cast<uint16_t*>(q.scale.data())[i] = quant::f32_to_f16(s);
  }
  q.w = Weight{q.data.data(), dt, n, k, ld, q.scale.data(), scale_dt, scols, group, dt == DType::F8_E4M3 ? 128 : 1};
  return q;
}

std::vector<float> dequantized(const Weight& w) {
  std::vector<float> v(size_t(w.rows * w.cols));
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t c = 0; c < w.cols; ++c) v[size_t(r * w.cols + c)] = weight_at(w, r, c);
  return v;
}

std::vector<float> run_gemm(Backend& b, const Weight& w, const std::vector<float>& x, int64_t m) {
  std::vector<float> y(size_t(m * w.rows), -7.0f);
  GemmParams p;
  p.x = x.data(), p.ldx = w.cols, p.w = w, p.y = y.data(), p.ldy = w.rows, p.m = m, p.n = w.rows, p.k = w.cols;
  b.gemm(p);
  return y;
}

// Whether w (row-major) can take kQuantQuad, and w in it (bytes in `store`).
bool quad_fits(const Weight& w) { return quant_quad_fits(w.dtype, w.cols, w.ld, w.group); }
Weight quad(const Weight& w, std::vector<uint8_t>& store) {
  const size_t rb = quant::row_bytes(w.dtype, w.ld);
  store.assign(rb * size_t((w.rows + 3) / 4 * 4), 0xaa);
  quant::repack_quant_quad(w.dtype, static_cast<const uint8_t*>(w.data), store.data(), w.rows, rb);
  Weight n = w;
  n.data = store.data();
  n.layout = WeightLayout::kQuantQuad;
  return n;
}

struct QCase {
  DType dt, scale_dt;
  int64_t n, k, group;
};

std::vector<QCase> cases() {
  std::vector<QCase> c;
  for (DType s : {DType::BF16, DType::F32, DType::F16})
    for (int64_t g : {32, 64, 128}) {
      c.push_back({DType::Q4, s, 70, 256, g});
      c.push_back({DType::Q8, s, 33, 384, g});
    }
  c.push_back({DType::Q4, DType::BF16, 9, 8, 8});          // group not a multiple of 16: portable code
  c.push_back({DType::Q4, DType::BF16, 7, 36, 12});        // ld 40 > cols 36 (rows padded to whole int32s)
  c.push_back({DType::Q8, DType::F32, 5, 26, 13});         // ld 28 > cols 26
  c.push_back({DType::Q4, DType::BF16, 512, 256, 32});     // many column blocks, the fused path's row items
  c.push_back({DType::Q4, DType::BF16, 37, 768, 256});     // groups of two 128-column blocks
  c.push_back({DType::Q8, DType::F32, 38, 320, 32});       // quads: 5 chunks of 64 bytes, 2 padding rows
  c.push_back({DType::Q8, DType::BF16, 9, 192, 16});       // groups of 16: not the decode tile's 32-column pairs
  for (DType s : {DType::BF16, DType::F32, DType::F16}) {  // 80 / 34 groups: blocks of 32 groups and tails
    c.push_back({DType::Q4, s, 35, 1280, 16});             // (35 rows: a last tile of 3)
    c.push_back({DType::Q8, s, 35, 1088, 32});
  }
  c.push_back({DType::F8_E4M3, DType::F32, 200, 300, 128});  // ragged 128 x 128 blocks
  c.push_back({DType::F8_E4M3, DType::F32, 130, 136, 128});
  c.push_back({DType::F8_E4M3, DType::F32, 256, 384, 128});  // fused path across 2 x 3 scale blocks
  c.push_back({DType::F8_E4M3, DType::F32, 260, 208, 128});  // fused path, partial last blocks
  c.push_back({DType::F8_E4M3, DType::F32, 130, 320, 128});  // quads: a partial last block, a last tile of 2 rows
  c.push_back({DType::F8_E4M3, DType::BF16, 64, 96, 128});
  return c;
}

std::string name(const QCase& c) {
  return std::string(dtype_name(c.dt)).substr(0, 7) + "/" + std::string(dtype_name(c.scale_dt)) + " n" +
         std::to_string(c.n) + " k" + std::to_string(c.k) + " g" + std::to_string(c.group);
}

// On every path: the fast gemm's bytes equal its float32 gemm over weight_at's values (the
// same recipe over the same weights), whatever m; and it is close to the reference.
TEST(QuantGemm, BitwiseDequantizedF32OnEveryPath) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  for (const std::string& path : cpu::fast::quant_paths()) {
    cpu::fast::set_quant_path(path);
    int seed = 1;
    for (const QCase& c : cases()) {
      SCOPED_TRACE(path + " " + name(c));
      QWeight q = random_weight(c.dt, c.scale_dt, c.n, c.k, c.group, uint64_t(seed++));
      std::vector<float> f = dequantized(q.w);
      const Weight wf{f.data(), DType::F32, c.n, c.k, c.k};
      for (int64_t m : {1, 3, 17, 70}) {
        std::mt19937 rng(uint32_t(m + seed));
        std::uniform_real_distribution<float> u(-1, 1);
        std::vector<float> x(size_t(m * c.k));
        for (float& v : x) v = u(rng);
        const auto yq = run_gemm(*cpu, q.w, x, m), yf = run_gemm(*cpu, wf, x, m);
        ASSERT_EQ(0, std::memcmp(yq.data(), yf.data(), yq.size() * 4)) << "m = " << m;
        const auto yr = run_gemm(*ref, q.w, x, m);
        for (size_t i = 0; i < yq.size(); ++i)
          ASSERT_NEAR(yq[i], yr[i], 1e-4f * (1.0f + std::fabs(yr[i]))) << "element " << i << ", m = " << m;
        // Row 0 alone gives the bytes it has inside the batch (batch invariance).
        const std::vector<float> x0(x.begin(), x.begin() + c.k);
        const auto y0 = run_gemm(*cpu, q.w, x0, 1);
        ASSERT_EQ(0, std::memcmp(y0.data(), yq.data(), y0.size() * 4)) << "m = " << m;
        if (quad_fits(q.w)) {  // in quads: the same bytes
          std::vector<uint8_t> store;
          const Weight wn = quad(q.w, store);
          const auto yn = run_gemm(*cpu, wn, x, m), y0n = run_gemm(*cpu, wn, x0, 1);
          ASSERT_EQ(0, std::memcmp(yn.data(), yq.data(), yq.size() * 4)) << "quads, m = " << m;
          ASSERT_EQ(0, std::memcmp(y0n.data(), yq.data(), y0n.size() * 4)) << "quads row 0, m = " << m;
          const auto yrn = run_gemm(*ref, wn, x, m);
          ASSERT_EQ(0, std::memcmp(yrn.data(), yr.data(), yr.size() * 4)) << "reference quads, m = " << m;
        }
      }
    }
  }
  cpu::fast::set_quant_path("auto");
}

// The AVX-512 and portable dequantizations give identical floats, and 1 or 2 threads identical bytes.
TEST(QuantGemm, PathsAndThreadsAgreeBitwise) {
  const auto paths = cpu::fast::quant_paths();
  auto cpu = make_cpu_backend();
  for (const QCase& c : cases()) {
    SCOPED_TRACE(name(c));
    QWeight q = random_weight(c.dt, c.scale_dt, c.n, c.k, c.group, 99);
    std::vector<std::vector<float>> rows;
    for (const std::string& path : paths) {
      cpu::fast::set_quant_path(path);
      std::vector<float> out(size_t(c.n * c.k));
      cpu::fast::dequantize_rows(q.w, 0, c.n, out.data(), c.k);
      rows.push_back(out);
    }
    cpu::fast::set_quant_path("auto");
    ASSERT_EQ(0, std::memcmp(rows[0].data(), dequantized(q.w).data(), rows[0].size() * 4));
    for (size_t i = 1; i < rows.size(); ++i)
      ASSERT_EQ(0, std::memcmp(rows[0].data(), rows[i].data(), rows[0].size() * 4)) << paths[i];
    if (quad_fits(q.w)) {
      std::vector<uint8_t> store;
      const Weight wn = quad(q.w, store);
      ASSERT_EQ(0, std::memcmp(rows[0].data(), dequantized(wn).data(), rows[0].size() * 4)) << "weight_at, quads";
      for (const std::string& path : paths) {
        cpu::fast::set_quant_path(path);
        std::vector<float> out(size_t(c.n * c.k));
        cpu::fast::dequantize_rows(wn, 0, c.n, out.data(), c.k);
        ASSERT_EQ(0, std::memcmp(rows[0].data(), out.data(), out.size() * 4)) << path << ", quads";
      }
      cpu::fast::set_quant_path("auto");
    }
    std::vector<float> x(size_t(64 * c.k), 0.25f);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 7919 % 200) - 100) / 100.0f;
    const int saved = omp_get_max_threads();
    std::vector<uint8_t> store;
    const Weight wq = quad_fits(q.w) ? quad(q.w, store) : q.w;
    for (int64_t m : {1, 3, 64}) {
      omp_set_num_threads(1);
      const auto y1 = run_gemm(*cpu, q.w, x, m), y1q = run_gemm(*cpu, wq, x, m);
      omp_set_num_threads(2);
      const auto y2 = run_gemm(*cpu, q.w, x, m), y2q = run_gemm(*cpu, wq, x, m);
      ASSERT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * 4)) << "m = " << m;
      ASSERT_EQ(0, std::memcmp(y1.data(), y1q.data(), y1.size() * 4)) << "quads, 1 thread, m = " << m;
      ASSERT_EQ(0, std::memcmp(y1.data(), y2q.data(), y1.size() * 4)) << "quads, 2 threads, m = " << m;
    }
    omp_set_num_threads(saved);
    // Single-row tiles without and with their next-tile prefetch (cpu/dot_tile.h): the same bytes.
    const bool pf = cpu::single_row_prefetch();
    std::vector<float> y[2], yq[2];
    for (int on = 0; on < 2; ++on) {
      cpu::set_single_row_prefetch(on == 1);
      y[on] = run_gemm(*cpu, q.w, x, 1), yq[on] = run_gemm(*cpu, wq, x, 1);
    }
    cpu::set_single_row_prefetch(pf);
    ASSERT_EQ(0, std::memcmp(y[0].data(), y[1].data(), y[0].size() * 4)) << "prefetch on / off";
    ASSERT_EQ(0, std::memcmp(y[0].data(), yq[1].data(), y[0].size() * 4)) << "prefetch on / off, quads";
    ASSERT_EQ(0, std::memcmp(yq[0].data(), yq[1].data(), y[0].size() * 4)) << "quads, prefetch on / off";
  }
}

// FP8 scales of 2^8 and more take the two-step multiply on the AVX-512 path: same values.
TEST(QuantGemm, Fp8LargeScalesAndSubnormalCodes) {
  QWeight q = random_weight(DType::F8_E4M3, DType::F32, 200, 256, 128, 5);
  const float big[4] = {300.0f, 1e30f, 0.5f, 3e-39f};  // the last one a float32 denormal
  std::memcpy(q.scale.data(), big, sizeof big);
  for (int c = 0; c < 32; ++c) q.data[size_t(c)] = uint8_t(c % 8);  // subnormal E4M3 codes
  const std::vector<float> want = dequantized(q.w);
  auto cpu = make_cpu_backend();
  for (const std::string& path : cpu::fast::quant_paths()) {
    cpu::fast::set_quant_path(path);
    std::vector<float> got(want.size());
    cpu::fast::dequantize_rows(q.w, 0, q.w.rows, got.data(), q.w.cols);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << path;
    std::vector<float> x(256, 0.001f);
    const Weight wf{want.data(), DType::F32, 200, 256, 256};
    const auto a = run_gemm(*cpu, q.w, x, 1), b = run_gemm(*cpu, wf, x, 1);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << path;
  }
  cpu::fast::set_quant_path("auto");
}

// Int8 / int4 with BF16 scales: every stored value against every scale mantissa and sign (the
// AVX-512 path rounds q * s to BF16 by Veltkamp's split there, or in the decode tile with AVX512-BF16
// by vcvtne2ps2bf16, ties included), every exponent, and
// scales outside the split's range (tiny, subnormal, zero, the largest finite: the bit trick), in
// both dequantize_rows and the fused decode tiles (m = 1..4, tiles of 4 and 3 rows, tiles that mix
// both kinds of group). One group per row, each row all 256 byte values (int4: every pair of nibbles).
TEST(QuantGemm, Bf16ScalesEveryMantissaAndExponent) {
  std::vector<uint16_t> scales;
  for (uint16_t sm = 0; sm < 256; ++sm) scales.push_back(uint16_t((sm & 0x80) << 8 | 0x3a00 | (sm & 0x7f)));
  for (uint16_t e = 1; e < 255; ++e) scales.push_back(uint16_t((e & 1) << 15 | e << 7 | 0x55));
  for (uint16_t v : {0x0000, 0x8000, 0x0001, 0x807f, 0x0040, 0x7f7f, 0xff7f, 0x0c00, 0x7200}) scales.push_back(v);
  while (scales.size() % 4 != 3) scales.push_back(0x3c00);  // a last tile of 3 rows
  const int64_t n = int64_t(scales.size());
  auto cpu = make_cpu_backend();
  for (DType dt : {DType::Q8, DType::Q4}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const int64_t k = dt == DType::Q8 ? 256 : 512, group = k;
    std::vector<uint8_t> data(quant::row_bytes(dt, k) * size_t(n));
    std::mt19937 rng(11);
    for (int64_t r = 0; r < n; ++r) {  // each row holds every stored byte value, shuffled
      uint8_t* row = data.data() + size_t(r) * 256;
      for (int i = 0; i < 256; ++i) row[i] = uint8_t(i);
      std::shuffle(row, row + 256, rng);
    }
    const Weight rm{data.data(), dt, n, k, k, scales.data(), DType::BF16, 1, group, 1};
    const std::vector<float> want = dequantized(rm);
    std::vector<uint8_t> store;
    const std::vector<Weight> forms{rm, quad(rm, store)};
    for (const std::string& path : cpu::fast::quant_paths()) {
      for (const Weight& w : forms) {
        SCOPED_TRACE(w.layout == WeightLayout::kQuantQuad ? "quads" : "row-major");
        cpu::fast::set_quant_path(path);
        std::vector<float> got(want.size());
        cpu::fast::dequantize_rows(w, 0, n, got.data(), k);
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << path;
        const Weight wf{want.data(), DType::F32, n, k, k};
        for (int64_t m = 1; m <= 4; ++m) {
          std::vector<float> x(size_t(m * k));
          for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 7919 % 201) - 100) * 1e-3f;
          const auto a = run_gemm(*cpu, w, x, m), b = run_gemm(*cpu, wf, x, m);
          EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << path << ", m = " << m;
        }
      }
    }
    cpu::fast::set_quant_path("auto");
  }
}

// kQuantQuad: byte b of row r where quant::quad_byte says, int4 nibbles where nibble128_byte /
// _shift say, every stored value kept; CpuBackend holds quantized gemm matrices that way when
// their rows are whole 64-byte chunks (int4: groups of 128 columns), else as stored; the reference
// backend as stored; layouts it cannot hold are refused.
TEST(QuantGemm, QuadLayoutAndUpload) {
  EXPECT_EQ(quant::quad_byte(0, 63, 128), 63u);
  EXPECT_EQ(quant::quad_byte(0, 64, 128), 256u);  // row 0's second chunk after the 4 rows' first
  EXPECT_EQ(quant::quad_byte(3, 0, 128), 192u);
  EXPECT_EQ(quant::quad_byte(5, 70, 128), 512u + 256u + 64u + 6u);
  EXPECT_EQ(quant::nibble128_byte(16), 0u);  // word l of a block: columns l, 16 + l, ..., 112 + l
  EXPECT_EQ(quant::nibble128_shift(16), 4);
  EXPECT_EQ(quant::nibble128_byte(33), 5u);
  EXPECT_EQ(quant::nibble128_byte(127 + 128), 64u + 63u);
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  for (DType dt : {DType::Q4, DType::Q8, DType::F8_E4M3}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    QWeight q = random_weight(dt, dt == DType::F8_E4M3 ? DType::F32 : DType::BF16, 7, 256, 128, 21);
    std::vector<uint8_t> store;
    const Weight wq = quad(q.w, store);
    for (int64_t r = 0; r < 7; ++r)
      for (int64_t c = 0; c < 256; ++c) {
        ASSERT_EQ(quant_code(wq, r, c), quant_code(q.w, r, c)) << r << ", " << c;
        ASSERT_EQ(weight_at(wq, r, c), weight_at(q.w, r, c)) << r << ", " << c;
      }
    const Weight up = cpu->upload_gemm_matrix(q.w, q.data.size());
    if (up.data != q.w.data && cpu::fast::quant_path() == "avx512") {  // (else kept as stored: the
      // arena off or full, GLM5_CPU_WEIGHTS=mmap; or no AVX-512 kernels to read quads fast)
      EXPECT_EQ(up.layout, WeightLayout::kQuantQuad);
      EXPECT_EQ(0, std::memcmp(up.data, store.data(), store.size()));  // (the padding row zero in both)
    }
    if (cpu::fast::quant_path() != "avx512") {
      EXPECT_EQ(up.layout, WeightLayout::kRowMajor);
    }
    EXPECT_EQ(ref->upload_gemm_matrix(q.w, q.data.size()).layout, WeightLayout::kRowMajor);
    EXPECT_NE(0, std::memcmp(store.data(), q.data.data(), q.data.size()));  // the order did change
  }
  QWeight g32 = random_weight(DType::Q4, DType::BF16, 6, 256, 32, 22);
  EXPECT_EQ(cpu->upload_gemm_matrix(g32.w, g32.data.size()).layout, WeightLayout::kRowMajor);
  Weight bad = g32.w;  // int4 groups of 32 columns cannot take the layout
  bad.layout = WeightLayout::kQuantQuad;
  std::vector<float> x(256), y(6);
  for (Backend* b : {cpu.get(), ref.get()}) {
    try {
      b->gemm({x.data(), 256, bad, false, y.data(), 6, 1, 6, 256});
      ADD_FAILURE() << b->name() << ": no error";
    } catch (const glm5::Error& e) {
      EXPECT_NE(std::string(e.what()).find("quad-interleaved"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("group 32"), std::string::npos) << e.what();
    }
  }
}

TEST(QuantGemm, MissingScalesRefused) {
  auto cpu = make_cpu_backend();
  QWeight q = random_weight(DType::Q4, DType::BF16, 4, 32, 32, 3);
  q.w.scale = nullptr;
  std::vector<float> x(32);
  try {
    run_gemm(*cpu, q.w, x, 1);
    FAIL() << "no error";
  } catch (const glm5::Error& e) {
    EXPECT_NE(std::string(e.what()).find("without valid scales"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace glm5::kernels::test
