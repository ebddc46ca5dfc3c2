// Precision::kFast's gemm (cpu/fast_ops.h), each path against a scalar emulation of its documented
// recipe, bit for bit: "avx512bf16" (one vdpbf16ps lane chained over the k pairs, bf16::dp_lane;
// where the CPU has AVX512-BF16), "amx-emulated" (one term: the tile products in k order, even
// element first; the hardware "amx" path where the machine has AMX, against the same chain to
// rounding), and "portable" (the exact path's kernels over the rounded values, whose recipe the
// exact tests pin). Then: every path close to the reference backend's kFast gemm, batch- and
// thread-invariant, different from kExact by bf16 rounding only, and weights laid out for one
// precision or path refused by another.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"
#include "kernels/core/quant.h"
#include "kernels/cpu/amx_gemm.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/bf16_attention.h"
#include "kernels/cpu/bf16_gemm.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/weight_arena.h"
#include "kernels/ops.h"

namespace glm5::kernels::test {
namespace {

using cpu::fast::set_fast_gemm_path;

// Sets the fast path for a test, and the machine's best ("auto") when it ends.
struct FastPath {
  explicit FastPath(const std::string& p) { set_fast_gemm_path(p); }
  ~FastPath() { set_fast_gemm_path("auto"); }
};

bool has_path(const std::string& p) {
  for (const std::string& q : cpu::fast::fast_gemm_paths())
    if (q == p) return true;
  return false;
}

struct Case {
  int64_t m, n, k;
  std::vector<float> x;     // [m, k]
  std::vector<uint16_t> w;  // [n, k] BF16, row stride k
};

// Normal values with a sprinkle of zeros, signed zeros, ties, denormals and tiny values (the
// DAZ / FTZ edges of the instructions).
Case make_case(int64_t m, int64_t n, int64_t k, uint32_t seed) {
  Case c{m, n, k, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 1);
  std::uniform_int_distribution<int> pick(0, 60);
  const auto value = [&](float scale) {
    switch (pick(rng)) {
      case 0: return 0.0f;
      case 1: return -0.0f;
      case 2: return 1e-39f;  // a float32 denormal
      case 3: return -3e-39f;
      case 4: return 1.00390625f;         // a bf16 rounding tie (1 + 2^-8)
      case 5: return 0x1p-125f * d(rng);  // products underflow
      default: return scale * d(rng);
    }
  };
  c.x.resize(size_t(m * k));
  for (float& v : c.x) v = value(1.0f);
  c.w.resize(size_t(n * k));
  for (uint16_t& v : c.w) v = f32_to_bf16(value(0.05f));
  return c;
}

Weight bf16_weight(const Case& c) { return Weight{c.w.data(), DType::BF16, c.n, c.k, c.k}; }

std::vector<float> run(Backend& be, const Case& c, const Weight& w, bool accumulate = false) {
  std::vector<float> y(size_t(c.m * c.n), accumulate ? 0.25f : NAN);
  GemmParams p;
  p.x = c.x.data(), p.ldx = c.k, p.w = w, p.y = y.data(), p.ldy = c.n, p.m = c.m, p.n = c.n, p.k = c.k;
  p.accumulate = accumulate;
  be.gemm(p);
  return y;
}

uint32_t pair_of(const float* v, int64_t k, int64_t p) {
  const uint16_t lo = f32_to_bf16(v[2 * p]), hi = 2 * p + 1 < k ? f32_to_bf16(v[2 * p + 1]) : uint16_t(0);
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// The avx512bf16 recipe: y = dp_lane chained over the pairs.
float dp_chain(const Case& c, int64_t i, int64_t j) {
  float acc = 0;
  std::vector<float> wf(size_t(c.k));
  for (int64_t t = 0; t < c.k; ++t) wf[size_t(t)] = bf16_to_f32(c.w[size_t(j * c.k + t)]);
  for (int64_t p = 0; p < (c.k + 1) / 2; ++p)
    acc = cpu::bf16::dp_lane(acc, pair_of(&c.x[size_t(i * c.k)], c.k, p), pair_of(wf.data(), c.k, p));
  return acc;
}

// The one-term AMX recipe (TDPBF16PS as cpu/amx_gemm.cpp emulates it): per k pair, the even
// element's product then the odd one's, each added and rounded, denormal inputs and sums as zero.
float amx_chain(const Case& c, int64_t i, int64_t j) {
  const auto daz = [](uint16_t v) { return bf16_to_f32((v & 0x7f80u) == 0 ? uint16_t(v & 0x8000u) : v); };
  const auto ftz = [](float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; };
  float acc = 0;
  for (int64_t t = 0; t < c.k; ++t)
    acc = ftz(acc + daz(f32_to_bf16(c.x[size_t(i * c.k + t)])) * daz(c.w[size_t(j * c.k + t)]));
  return acc;
}

void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t e = 0; e < got.size(); ++e)
    ASSERT_EQ(0, std::memcmp(&got[e], &want[e], 4))
        << what << ": element " << e << " got " << got[e] << " want " << want[e];
}

const std::vector<std::vector<int64_t>> kShapes = {{1, 1, 1},    {1, 17, 2},     {3, 16, 33},  {4, 64, 64},
                                                   {5, 65, 100}, {1, 300, 1030}, {7, 40, 513}, {33, 130, 600},
                                                   {70, 20, 64}, {2, 3, 0}};

TEST(FastGemm, PackPairsRoundsLikeF32ToBf16) {
  const uint32_t edge[] = {0x00000001u, 0x80000001u, 0x007fffffu, 0x00008000u, 0x00018000u,
                           0x3f808000u, 0x3f818000u, 0x80000000u, 0x7f7f7fffu, 0xff7fffffu,
                           0x7f800000u, 0x7fc00001u, 0xff800001u, 0x3f80ffffu, 0x33333333u};
  for (int64_t k : {1, 15, 31, 32, 33, 70}) {
    std::vector<float> x(size_t(2 * k));
    std::mt19937 rng{uint32_t(k)};
    for (size_t i = 0; i < x.size(); ++i) {
      const uint32_t u = i < std::size(edge) ? edge[i] : uint32_t(rng());
      std::memcpy(&x[i], &u, 4);
    }
    cpu::bf16::PackedPairs pp;
    pp.data.assign(1000, 0xdeadbeefu);  // stale bytes must not show through
    cpu::bf16::pack_pairs(x.data(), k, 2, k, pp);
    ASSERT_EQ(pp.pairs, (k + 1) / 2);
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t p = 0; p < pp.pairs; ++p)
        ASSERT_EQ(pp.row(i)[p], pair_of(&x[size_t(i * k)], k, p)) << "k " << k << " row " << i << " pair " << p;
  }
}

// The kPair16 kernel and the backend's fast path on it: dp_lane's chain, bit for bit.
TEST(FastGemm, Avx512Bf16IsTheDpLaneChain) {
  if (!has_path("avx512bf16")) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  FastPath path("avx512bf16");
  auto be = make_cpu_backend(Precision::kFast);
  uint32_t seed = 1;
  for (const auto& s : kShapes) {
    const Case c = make_case(s[0], s[1], s[2], seed++);
    const Weight up = be->upload_gemm_matrix(bf16_weight(c), c.w.size() * 2);
    ASSERT_EQ(up.layout, WeightLayout::kPair16);
    std::vector<float> want(size_t(c.m * c.n));
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) want[size_t(i * c.n + j)] = dp_chain(c, i, j);
    const std::string shape = "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k);
    expect_bits(run(*be, c, up), want, "avx512bf16 " + shape);
    std::vector<float> acc = want;
    for (float& v : acc) v = 0.25f + v;
    expect_bits(run(*be, c, up, true), acc, "avx512bf16 accumulate " + shape);
  }
}

// The one-term AMX kernel on emulated tiles: the tile chain, bit for bit (row-major and kTile16).
TEST(FastGemm, AmxEmulatedIsTheTileChain) {
  FastPath path("amx-emulated");
  auto be = make_cpu_backend(Precision::kFast);
  uint32_t seed = 100;
  for (const auto& s : kShapes) {
    const Case c = make_case(s[0], s[1], s[2], seed++);
    std::vector<float> want(size_t(c.m * c.n));
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) want[size_t(i * c.n + j)] = amx_chain(c, i, j);
    const std::string shape = "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k);
    expect_bits(run(*be, c, bf16_weight(c)), want, "amx-emulated row-major " + shape);
    const Weight up = be->upload_gemm_matrix(bf16_weight(c), c.w.size() * 2);
    ASSERT_EQ(up.layout, WeightLayout::kTile16);
    expect_bits(run(*be, c, up), want, "amx-emulated kTile16 " + shape);
  }
}

// The hardware tiles against the same chain, to rounding (the hardware may add within an
// instruction in another order); skipped with the reason where the machine has no AMX.
TEST(FastGemm, AmxHardwareCloseToTheTileChain) {
  std::string why;
  if (!cpu::amx::available(&why)) GTEST_SKIP() << why;
  FastPath path("amx");
  auto be = make_cpu_backend(Precision::kFast);
  const Case c = make_case(37, 70, 300, 7);
  const std::vector<float> got = run(*be, c, bf16_weight(c));
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      const float want = amx_chain(c, i, j);
      double mag = 0;  // sum |x w|: the scale of any reordering's rounding
      for (int64_t t = 0; t < c.k; ++t)
        mag += std::fabs(double(bf16_round(c.x[size_t(i * c.k + t)])) * bf16_to_f32(c.w[size_t(j * c.k + t)]));
      ASSERT_NEAR(got[size_t(i * c.n + j)], want, 1e-5 * mag + 1e-30) << i << ", " << j;
    }
}

// Portable: the exact kernels over the bf16 values: for every weight dtype, the kFast gemm is the
// kExact gemm of the rounded x and the rounded weight (row-major F32, or the BF16 / quantized
// weight itself where its values are bf16 already), bit for bit, at decode and prefill sizes.
TEST(FastGemm, PortableIsTheExactRecipeOnRoundedValues) {
  FastPath path("portable");
  cpu::fast::set_gemm_path("fp32");  // (the exact side's recipe: the 16-lane one, also on AMX machines)
  struct Restore {
    ~Restore() { cpu::fast::set_gemm_path("auto"); }
  } restore;
  auto fast = make_cpu_backend(Precision::kFast);
  auto exact = make_cpu_backend(Precision::kExact);
  for (int64_t m : {1, 3, 40}) {
    const int64_t n = 37, k = 256;
    const Case c = make_case(m, n, k, uint32_t(m));
    Case r = c;
    for (float& v : r.x) v = bf16_round(v);
    std::mt19937 rng(9);
    std::normal_distribution<float> d(0, 0.05f);
    // F32 and F16 weights: rounded as read.
    std::vector<float> wf(size_t(n * k));
    std::vector<uint16_t> wh(size_t(n * k));
    for (size_t i = 0; i < wf.size(); ++i)  // (F16: sign, exponent 2^-5 .. 2^2, random mantissa)
      wf[i] = d(rng), wh[i] = uint16_t((rng() % 2) << 15 | (10 + rng() % 8) << 10 | (rng() & 0x3ffu));
    std::vector<float> wf_r(wf.size()), wh_r(wh.size());
    for (size_t i = 0; i < wf.size(); ++i) wf_r[i] = bf16_round(wf[i]), wh_r[i] = bf16_round(f16_to_f32(wh[i]));
    const std::string at = "m " + std::to_string(m);
    expect_bits(run(*fast, c, Weight{wf.data(), DType::F32, n, k, k}),
                run(*exact, r, Weight{wf_r.data(), DType::F32, n, k, k}), "F32 " + at);
    expect_bits(run(*fast, c, Weight{wh.data(), DType::F16, n, k, k}),
                run(*exact, r, Weight{wh_r.data(), DType::F32, n, k, k}), "F16 " + at);
    expect_bits(run(*fast, c, bf16_weight(c)), run(*exact, r, bf16_weight(c)), "BF16 " + at);
    // Quantized: int8 with BF16 scales (values bf16 already) and FP8 with F32 scales (rounded).
    std::vector<uint8_t> q8(size_t(n * k)), f8(size_t(n * k));
    std::vector<uint16_t> s8(size_t(n * (k / 32)));
    std::vector<float> sf8(size_t(((n + 127) / 128) * ((k + 127) / 128)));
    for (uint8_t& b : q8) b = uint8_t(rng());
    for (uint8_t& b : f8) b = uint8_t(rng() % 0x7e) | uint8_t(rng() % 2 ? 0x80 : 0);  // (no NaN codes)
    for (uint16_t& s : s8) s = f32_to_bf16(0.001f * (1 + float(rng() % 7)));
    for (float& s : sf8) s = 0.003f * (1 + float(rng() % 5));
    Weight wq{q8.data(), DType::Q8, n, k, k, s8.data(), DType::BF16, k / 32, 32, 1};
    Weight w8{f8.data(), DType::F8_E4M3, n, k, k, sf8.data(), DType::F32, (k + 127) / 128, 128, 128};
    expect_bits(run(*fast, c, wq), run(*exact, r, wq), "int8 (BF16 scales) " + at);
    std::vector<float> w8_r(size_t(n * k));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t t = 0; t < k; ++t) w8_r[size_t(j * k + t)] = bf16_round(weight_at(w8, j, t));
    expect_bits(run(*fast, c, w8), run(*exact, r, Weight{w8_r.data(), DType::F32, n, k, k}), "FP8 " + at);
  }
}

// Every path this machine has, through the backend with its own layout: within float32 rounding of
// the reference backend's kFast gemm (the same rounded products summed in k order), a row's bytes
// independent of the other rows of the call and of the thread count, and away from kExact by
// bf16 rounding only (so kFast does round).
TEST(FastGemm, EveryPathNearReferenceAndInvariant) {
  auto ref_fast = make_reference_backend(Precision::kFast);
  auto ref_exact = make_reference_backend(Precision::kExact);
  const Case c = make_case(37, 90, 700, 21);
  const std::vector<float> want = run(*ref_fast, c, bf16_weight(c)), exact = run(*ref_exact, c, bf16_weight(c));
  std::vector<double> mag(size_t(c.m * c.n), 0);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j)
      for (int64_t t = 0; t < c.k; ++t)
        mag[size_t(i * c.n + j)] += std::fabs(double(c.x[size_t(i * c.k + t)]) * bf16_to_f32(c.w[size_t(j * c.k + t)]));
  size_t differ = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    differ += want[e] != exact[e];
    ASSERT_NEAR(want[e], exact[e], 0x1p-7 * mag[e]) << "kFast is kExact up to bf16 rounding of x";
  }
  EXPECT_GT(differ, want.size() / 2) << "kFast must round x to bf16";
  for (const std::string& name : cpu::fast::fast_gemm_paths()) {
    FastPath path(name);
    auto be = make_cpu_backend(Precision::kFast);
    const Weight w = be->upload_gemm_matrix(bf16_weight(c), c.w.size() * 2);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(2);
    const std::vector<float> all = run(*be, c, w);
    omp_set_num_threads(threads);
    for (size_t e = 0; e < want.size(); ++e)
      ASSERT_NEAR(all[e], want[e], 1e-5 * (mag[e] + 1e-30)) << name << " element " << e;
    for (int64_t i : {int64_t(0), int64_t(17), c.m - 1}) {  // each row alone
      Case one{1, c.n, c.k, {c.x.begin() + i * c.k, c.x.begin() + (i + 1) * c.k}, c.w};
      const std::vector<float> y = run(*be, one, w);
      ASSERT_EQ(0, std::memcmp(y.data(), &all[size_t(i * c.n)], size_t(c.n) * 4)) << name << " row " << i << " alone";
    }
    omp_set_num_threads(1);
    const std::vector<float> single = run(*be, c, w);
    omp_set_num_threads(threads);
    expect_bits(single, all, name + " on one thread and on two");
  }
}

TEST(FastGemm, WeightsOfAnotherPrecisionOrPathAreRefused) {
  const Case c = make_case(2, 20, 64, 3);
  if (has_path("avx512bf16")) {
    Weight pairs;
    {
      FastPath path("avx512bf16");
      pairs = make_cpu_backend(Precision::kFast)->upload_gemm_matrix(bf16_weight(c), c.w.size() * 2);
    }
    // (the backend that laid it out is gone; the arena memory with it: use a copy)
    std::vector<uint16_t> copy(cpu::WeightArena::interleaved_bytes(2, c.n, c.k, WeightLayout::kPair16) / 2);
    cpu::WeightArena::interleave(copy.data(), c.w.data(), 2, c.n, c.k, c.k, WeightLayout::kPair16);
    pairs.data = copy.data();
    auto exact = make_cpu_backend(Precision::kExact);
    EXPECT_THROW(run(*exact, c, pairs), Error);
    FastPath portable("portable");
    auto fast = make_cpu_backend(Precision::kFast);
    try {
      run(*fast, c, pairs);
      FAIL() << "a kPair16 weight on the portable path ran";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("kPair16"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(parse_precision("bf16", "--precision"), Error);
  EXPECT_EQ(parse_precision("fast", "--precision"), Precision::kFast);
}

// The attention side in kFast (ops.h Precision): paged_write stores bf16 values in a float32 cache,
// and mla_decode / mla_prefill / indexer_scores are kExact's kernels on the bf16-rounded inputs, bit
// for bit, on the cpu backend's portable path; the reference backend does the same to float32 rounding.
TEST(FastAttention, OpsTakeBf16Inputs) {
  FastPath path("portable");  // (the indexer's AVX512-BF16 recipe: the next test)
  auto fast = make_cpu_backend(Precision::kFast), exact = make_cpu_backend(Precision::kExact);
  auto ref = make_reference_backend(Precision::kFast);
  std::mt19937 rng(17);
  std::normal_distribution<float> d(0, 1);
  const auto randn = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = d(rng);
    return v;
  };
  const auto round_all = [](std::vector<float> v) {
    for (float& x : v) x = bf16_round(x);
    return v;
  };
  const auto near = [](const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] == b[i]) continue;  // (both -inf: a masked score)
      ASSERT_NEAR(a[i], b[i], 1e-4 * (1 + std::fabs(b[i]))) << what << " " << i;
    }
  };
  const int64_t S = 3, T = 70, H = 4, R = 32, DR = 16, LAT = R + DR;
  // paged_write: a float32 cache holds the bf16 values.
  const std::vector<float> rows = randn(size_t(S * LAT));
  std::vector<int32_t> pos = {5, 6, 7};
  std::vector<float> want(size_t(2 * 64 * LAT), 0.0f);
  const std::vector<int32_t> table = {1};  // (one sequence in block 1 of a 2-block pool)
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < LAT; ++j)
      want[size_t((64 + pos[size_t(i)]) * LAT + j)] = bf16_round(rows[size_t(i * LAT + j)]);
  for (Backend* be : {fast.get(), ref.get()}) {
    std::vector<float> pool(want.size(), 0.0f);
    be->paged_write({rows.data(), LAT, pos.data(), pool.data(), S, LAT, KeyPages{table.data(), 0, 64}});
    expect_bits(pool, want, "paged_write on " + be->name());
  }
  // mla_decode over a cache of bf16 values.
  const std::vector<float> cache = round_all(randn(size_t(T * LAT))), q = randn(size_t(S * H * LAT));
  const std::vector<float> qr = round_all(q);
  std::vector<int32_t> qpos = {69, 40, 3};
  const auto decode = [&](Backend& be, const std::vector<float>& qq) {
    std::vector<float> out(size_t(S * H * R));
    be.mla_decode({qq.data(), cache.data(), qpos.data(), nullptr, 0, out.data(), S, T, H, R, DR, 0.1f, {}});
    return out;
  };
  expect_bits(decode(*fast, q), decode(*exact, qr), "mla_decode");
  near(decode(*ref, q), decode(*fast, q), "mla_decode, reference");
  // indexer_scores.
  const int64_t IH = 4, ID = 32;
  const std::vector<float> iq = randn(size_t(S * IH * ID)), iw = randn(size_t(S * IH)),
                           keys = round_all(randn(size_t(T * ID)));
  const auto scores = [&](Backend& be, const std::vector<float>& qq) {
    std::vector<float> out(size_t(S * T));
    be.indexer_scores({qq.data(), iw.data(), keys.data(), qpos.data(), out.data(), S, T, IH, ID, T, {}});
    return out;
  };
  expect_bits(scores(*fast, iq), scores(*exact, round_all(iq)), "indexer_scores");
  near(scores(*ref, iq), scores(*fast, iq), "indexer_scores, reference");
  // mla_prefill: queries, expanded keys / values and k_pe rounded.
  const int64_t DN = 16, DV = 16;
  const std::vector<float> pq = randn(size_t(S * H * (DN + DR))), kv = randn(size_t(T * H * (DN + DV))),
                           kpe = randn(size_t(T * LAT));
  const auto prefill = [&](Backend& be, const std::vector<float>& a, const std::vector<float>& b,
                           const std::vector<float>& c) {
    std::vector<float> out(size_t(S * H * DV));
    be.mla_prefill(
        {a.data(), b.data(), c.data() + R, LAT, qpos.data(), nullptr, 0, out.data(), S, T, H, DN, DR, DV, 0.1f});
    return out;
  };
  expect_bits(prefill(*fast, pq, kv, kpe), prefill(*exact, round_all(pq), round_all(kv), round_all(kpe)),
              "mla_prefill");
  near(prefill(*ref, pq, kv, kpe), prefill(*fast, pq, kv, kpe), "mla_prefill, reference");
}

// The indexer's fast recipe on AVX512-BF16 (bf16::indexer_block): per head a dp_lane chain over the
// pairs of bf16(q) and bf16(k), then sum_h fma(w_h, max(dot_h, 0), .) in head order, bit for bit,
// for decode (one row) and prefill (rows sharing the keys), keys in float32 and in bf16.
TEST(FastAttention, IndexerOnAvx512Bf16IsTheLaneChain) {
  if (!has_path("avx512bf16")) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  FastPath path("avx512bf16");
  auto fast = make_cpu_backend(Precision::kFast);
  const int64_t T = 150, H = 6, D = 34;
  for (int64_t S : {int64_t(1), int64_t(5)}) {
    const Case c = make_case(S * H, T, D, uint32_t(40 + S));  // (x: the queries, w rows: the keys)
    std::vector<float> keys(size_t(T * D)), w(size_t(S * H));
    std::vector<uint16_t> keys16(size_t(T * D));
    for (size_t i = 0; i < keys.size(); ++i) keys16[i] = c.w[i], keys[i] = bf16_to_f32(c.w[i]) * 3.0f + 1e-3f;
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * float(int(i % 7) - 3);
    std::vector<int32_t> pos(static_cast<size_t>(S), 0);
    for (int64_t s = 0; s < S; ++s) pos[size_t(s)] = int32_t(T - 1 - 37 * s);
    for (DType dt : {DType::F32, DType::BF16}) {
      std::vector<float> got(size_t(S * T));
      IndexerScoresParams p{
          c.x.data(), w.data(),   dt == DType::F32 ? keys.data() : reinterpret_cast<const float*>(keys16.data()),
          pos.data(), got.data(), S,
          T,          H,          D,
          T,          {}};
      p.pages.dtype = dt;
      fast->indexer_scores(p);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t t = 0; t < T; ++t) {
          float want = -INFINITY;
          if (t <= pos[size_t(s)]) {
            want = 0.0f;
            for (int64_t h = 0; h < H; ++h) {
              float dot = 0.0f;
              const float* q = &c.x[size_t((s * H + h) * D)];
              for (int64_t pr = 0; pr < D / 2; ++pr) {
                const uint32_t qp = uint32_t(f32_to_bf16(q[2 * pr])) | uint32_t(f32_to_bf16(q[2 * pr + 1])) << 16;
                const uint16_t k0 =
                    dt == DType::F32 ? f32_to_bf16(keys[size_t(t * D + 2 * pr)]) : keys16[size_t(t * D + 2 * pr)];
                const uint16_t k1 = dt == DType::F32 ? f32_to_bf16(keys[size_t(t * D + 2 * pr + 1)])
                                                     : keys16[size_t(t * D + 2 * pr + 1)];
                dot = cpu::bf16::dp_lane(dot, qp, uint32_t(k0) | uint32_t(k1) << 16);
              }
              want = std::fma(w[size_t(s * H + h)], dot > 0.0f ? dot : 0.0f, want);
            }
          }
          const float g = got[size_t(s * T + t)];
          ASSERT_EQ(0, std::memcmp(&g, &want, 4)) << "rows " << S << " " << dtype_name(dt) << " row " << s << " key "
                                                  << t << ": got " << g << " want " << want;
        }
    }
  }
}

// The MLA recipe of cpu/bf16_attention.h in scalar: operands as bf16 pairs, each part padded to
// whole vectors of 16 pairs; a score is 16 dp_lane chains and simd::reduce's tree; the weights are
// softmax_row's, and each output element one dp_lane chain over pairs of consecutive keys.
struct MlaRecipe {
  int64_t d1, d2, dv;
  static int64_t words(int64_t d) { return ((d + 1) / 2 + 15) / 16 * 16; }
  std::vector<uint32_t> pack(const float* a, const float* b) const {  // [a (d1) | b (d2)]
    std::vector<uint32_t> w(size_t(words(d1) + words(d2)), 0);
    for (int64_t i = 0; i < (d1 + 1) / 2; ++i) w[size_t(i)] = pair_of(a, d1, i);
    for (int64_t i = 0; i < (d2 + 1) / 2; ++i) w[size_t(words(d1) + i)] = pair_of(b, d2, i);
    return w;
  }
  static float tree(const float (&v)[16]) {
    float a[8], b[4];
    for (int l = 0; l < 8; ++l) a[l] = v[l] + v[l + 8];
    for (int l = 0; l < 4; ++l) b[l] = a[l] + a[l + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
  }
  // One row's scores: q = [q1 | q2]; key i = [k1(i) | k2(i)]; n keys.
  template <class K1, class K2>
  std::vector<float> scores(const float* q1, const float* q2, int64_t n, K1 k1, K2 k2, float scale) const {
    const std::vector<uint32_t> qw = pack(q1, q2);
    std::vector<float> w(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<uint32_t> kw = pack(k1(i), k2(i));
      float lane[16] = {};
      for (size_t c = 0; c < qw.size(); ++c) lane[c % 16] = cpu::bf16::dp_lane(lane[c % 16], qw[c], kw[c]);
      w[size_t(i)] = scale * tree(lane);
    }
    return w;
  }
  // One row's output; value i is v(i).
  template <class K1, class K2, class Val>
  std::vector<float> row(const float* q1, const float* q2, int64_t n, K1 k1, K2 k2, Val v, float scale) const {
    std::vector<float> w = scores(q1, q2, n, k1, k2, scale);
    cpu::fast::softmax_row(w.data(), n);
    std::vector<float> out(size_t(dv), 0.0f);
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {
      const uint32_t wp = pair_of(w.data(), n, j);
      for (int64_t d = 0; d < dv; ++d) {
        const float pair[2] = {v(2 * j)[d], 2 * j + 1 < n ? v(2 * j + 1)[d] : 0.0f};
        out[size_t(d)] = cpu::bf16::dp_lane(out[size_t(d)], wp, pair_of(pair, 2, 0));
      }
    }
    return out;
  }
};

// A row's allowed keys as the ops define them (ascending, de-duplicated, causal).
std::vector<int32_t> allowed_keys(const int32_t* sel, int64_t len, int32_t pos, int64_t t) {
  std::vector<int32_t> l;
  if (!sel) {
    for (int32_t k = 0; k <= pos && k < t; ++k) l.push_back(k);
    return l;
  }
  for (int64_t j = 0; j < len; ++j)
    if (sel[j] >= 0 && sel[j] <= pos) l.push_back(sel[j]);
  std::sort(l.begin(), l.end());
  l.erase(std::unique(l.begin(), l.end()), l.end());
  return l;
}

// Runs `op` on 1 and on 2 threads: the same bits (returns the 2-thread result).
template <class F>
std::vector<float> on_1_and_2_threads(F op, const std::string& what) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> one = op();
  omp_set_num_threads(2);
  const std::vector<float> two = op();
  omp_set_num_threads(saved);
  expect_bits(two, one, what + ", 2 threads against 1");
  return two;
}

// bf16 values in float32 (the caches of precision fast hold such values; the kernels' packers take a
// shortcut for them, which must give the same bits).
std::vector<float> rounded(std::vector<float> v) {
  for (float& x : v) x = bf16_round(x);
  return v;
}

// mla_prefill on AVX512-BF16 against MlaRecipe, bit for bit, on 1 and 2 threads: dense causal rows
// (a chunk that starts mid-sequence, a row without keys, a row past the keys) and rows with their own
// selections (duplicates, -1, odd counts); parts and value widths that are not whole vectors, k_pe
// with its own row stride; float32 inputs and bf16 values in float32.
TEST(FastAttention, MlaPrefillOnAvx512Bf16IsTheDpRecipe) {
  if (!has_path("avx512bf16")) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  FastPath path("avx512bf16");
  auto fast = make_cpu_backend(Precision::kFast);
  const int64_t H = 6, T = 90, S = 30, N = 40, P = 12, LDP = P + 5, V = 70, DQ = N + P, DKV = N + V, K = 41;
  const float scale = 0.15f;
  std::vector<int32_t> pos(static_cast<size_t>(S)), sel;
  for (int64_t s = 0; s < S; ++s) pos[size_t(s)] = int32_t(60 + s);  // keys 0..89
  pos[3] = -1, pos[7] = 200;
  std::mt19937 rng(5);
  for (int64_t i = 0; i < S * K; ++i) sel.push_back(int32_t(rng() % (T + 1)) - 1);
  const Case qc = make_case(S * H, 1, DQ, 71);
  for (const bool bf16_values : {false, true})
    for (const bool selected : {false, true}) {
      std::vector<float> kv = make_case(T * H, 1, DKV, 72).x, kpe = make_case(T, 1, LDP, 73).x;
      if (bf16_values) kv = rounded(kv), kpe = rounded(kpe);
      const auto run_prefill = [&] {
        std::vector<float> out(size_t(S * H * V), NAN);
        fast->mla_prefill({qc.x.data(), kv.data(), kpe.data(), LDP, pos.data(), selected ? sel.data() : nullptr,
                           selected ? K : 0, out.data(), S, T, H, N, P, V, scale});
        return out;
      };
      const std::string what =
          std::string("mla_prefill") + (selected ? " selected" : " dense") + (bf16_values ? ", bf16 values" : "");
      const std::vector<float> got = on_1_and_2_threads(run_prefill, what);
      const MlaRecipe recipe{N, P, V};
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h) {
          const std::vector<int32_t> keys =
              allowed_keys(selected ? &sel[size_t(s * K)] : nullptr, K, pos[size_t(s)], T);
          const auto k1 = [&](int64_t i) { return &kv[size_t((keys[size_t(i)] * H + h) * DKV)]; };
          const auto k2 = [&](int64_t i) { return &kpe[size_t(keys[size_t(i)] * LDP)]; };
          const auto v = [&](int64_t i) { return &kv[size_t((keys[size_t(i)] * H + h) * DKV + N)]; };
          const float* q = &qc.x[size_t((s * H + h) * DQ)];
          const std::vector<float> want = recipe.row(q, q + N, int64_t(keys.size()), k1, k2, v, scale);
          const std::vector<float> row(got.begin() + (s * H + h) * V, got.begin() + (s * H + h + 1) * V);
          expect_bits(row, want, what + ", row " + std::to_string(s) + " head " + std::to_string(h));
        }
    }
}

// mla_decode on AVX512-BF16 against MlaRecipe, bit for bit (its scores too: the outputs hardly show
// them), on 1 and 2 threads: a batch of rows and a row alone (its heads split over tasks), dense and
// selected, over a paged cache (blocks of 16 positions, shuffled) of float32, bf16 values in float32,
// and bf16.
TEST(FastAttention, MlaDecodeOnAvx512Bf16IsTheDpRecipe) {
  if (!has_path("avx512bf16")) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  FastPath path("avx512bf16");
  auto fast = make_cpu_backend(Precision::kFast);
  const int64_t H = 12, T = 90, R = 40, P = 12, LAT = R + P, B = 16, K = 33;
  const float scale = 0.15f;
  const std::vector<int32_t> table = {3, 0, 5, 1, 4, 2};              // positions 16 b + j at row 16 table[b] + j
  const std::vector<float> cache32 = make_case(T + 6, 1, LAT, 82).x;  // [96 rows][LAT] (6 spare rows)
  std::vector<uint16_t> cache16(cache32.size());
  for (size_t i = 0; i < cache32.size(); ++i) cache16[i] = f32_to_bf16(cache32[i]);
  for (const int64_t S : {int64_t(5), int64_t(1)}) {
    std::vector<int32_t> pos = {89, 17, 0, 64, 45}, sel;
    pos.resize(size_t(S));
    std::mt19937 rng(6);
    for (int64_t i = 0; i < S * K; ++i) sel.push_back(int32_t(rng() % (T + 1)) - 1);
    const Case qc = make_case(S * H, 1, LAT, 81);
    for (const bool selected : {false, true})
      for (const int cache_kind : {0, 1, 2}) {  // float32, bf16 values in float32, bf16
        const DType dt = cache_kind == 2 ? DType::BF16 : DType::F32;
        const std::vector<float> cache = cache_kind == 1 ? rounded(cache32) : cache32;
        const MlaDecodeParams params{qc.x.data(),
                                     dt == DType::F32 ? cache.data() : reinterpret_cast<const float*>(cache16.data()),
                                     pos.data(),
                                     selected ? sel.data() : nullptr,
                                     selected ? K : 0,
                                     nullptr,
                                     S,
                                     T,
                                     H,
                                     R,
                                     P,
                                     scale,
                                     KeyPages{table.data(), 0, B, dt}};
        const auto run_decode = [&] {
          std::vector<float> out(size_t(S * H * R), NAN);
          MlaDecodeParams p = params;
          p.out_lat = out.data();
          fast->mla_decode(p);
          return out;
        };
        const std::string what = std::string("mla_decode, ") + std::to_string(S) + " rows" +
                                 (selected ? " selected, " : " dense, ") + std::to_string(cache_kind);
        const std::vector<float> got = on_1_and_2_threads(run_decode, what);
        const std::vector<float> got_scores = cpu::bf16::mla_decode_scores(params);
        size_t at_score = 0;
        const MlaRecipe recipe{R, P, R};
        for (int64_t s = 0; s < S; ++s) {
          const std::vector<int32_t> keys =
              allowed_keys(selected ? &sel[size_t(s * K)] : nullptr, K, pos[size_t(s)], T);
          std::vector<std::vector<float>> rows;  // the keys' cache rows, as the op reads them
          for (int32_t t : keys) {
            const int64_t at = int64_t(table[size_t(t / B)]) * B + t % B;
            std::vector<float> r(static_cast<size_t>(LAT));
            for (int64_t d = 0; d < LAT; ++d)
              r[size_t(d)] =
                  dt == DType::F32 ? cache[size_t(at * LAT + d)] : bf16_to_f32(cache16[size_t(at * LAT + d)]);
            rows.push_back(r);
          }
          const auto k1 = [&](int64_t i) { return rows[size_t(i)].data(); };
          const auto k2 = [&](int64_t i) { return rows[size_t(i)].data() + R; };
          for (int64_t h = 0; h < H; ++h) {
            const std::string where = what + ", row " + std::to_string(s) + " head " + std::to_string(h);
            const float* q = &qc.x[size_t((s * H + h) * LAT)];
            const std::vector<float> scores(got_scores.begin() + int64_t(at_score),
                                            got_scores.begin() + int64_t(at_score + keys.size()));
            at_score += keys.size();
            expect_bits(scores, recipe.scores(q, q + R, int64_t(keys.size()), k1, k2, scale), where + " scores");
            const std::vector<float> row(got.begin() + (s * H + h) * R, got.begin() + (s * H + h + 1) * R);
            expect_bits(row, recipe.row(q, q + R, int64_t(keys.size()), k1, k2, k1, scale), where);
          }
        }
      }
  }
}

}  // namespace
}  // namespace glm5::kernels::test
