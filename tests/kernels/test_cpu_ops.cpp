// The fast CPU backend against the reference on every case of op_cases.h, its batch invariance
// (a row's bytes do not depend on the other rows or on their number, nor on the thread count),
// and the parameter errors both CPU backends raise.
#include <omp.h>

#include <cmath>
#include <tuple>

#include "kernels/cpu/dot_tile.h"
#include "kernels/cpu/weight_arena.h"
#include "tests/kernels/op_cases.h"

namespace glm5::kernels::test {
namespace {

class CpuVsReference : public ::testing::TestWithParam<OpCase> {};

TEST_P(CpuVsReference, MatchesReference) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  EXPECT_TRUE(compare(*cpu, *ref, GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Ops, CpuVsReference, ::testing::ValuesIn(op_cases()),
                         [](const auto& info) { return test_name(info.param.name); });

class CpuBatchInvariance : public ::testing::TestWithParam<RowCase> {};

// The probe row alone, as row 3 of 7 and as row 41 of 64 (other rows random): same bytes.
TEST_P(CpuBatchInvariance, RowBitsIndependentOfBatch) {
  auto cpu = make_cpu_backend();
  const RowCase& c = GetParam();
  auto alone = probe_bytes(*cpu, c, 1, 0);
  auto in7 = probe_bytes(*cpu, c, 7, 3);
  auto in64 = probe_bytes(*cpu, c, 64, 41);
  ASSERT_EQ(alone.size(), in7.size());
  ASSERT_EQ(alone.size(), in64.size());
  EXPECT_EQ(0, std::memcmp(alone.data(), in7.data(), alone.size())) << c.name << ": m=1 vs m=7";
  EXPECT_EQ(0, std::memcmp(alone.data(), in64.data(), alone.size())) << c.name << ": m=1 vs m=64";
  // And the reference agrees up to rounding (the probe is not trivially zero or garbage).
  auto ref = make_reference_backend();
  auto r = probe_bytes(*ref, c, 1, 0);
  std::vector<float> a(alone.size() / 4), b(r.size() / 4);
  std::memcpy(a.data(), alone.data(), alone.size());
  std::memcpy(b.data(), r.data(), r.size());
  EXPECT_TRUE(compare_floats(c.name, a, b, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Rows, CpuBatchInvariance, ::testing::ValuesIn(row_cases()),
                         [](const auto& info) { return test_name(info.param.name); });

// A paged cache (shared or per-row block tables, shuffled blocks, garbage in the spare ones) gives
// the bytes of the contiguous cache, on the fast backend and on the reference.
TEST(CpuBackend, PagedCacheBitsEqualContiguous) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  for (const auto& [plain, paged] : paging_pairs()) {
    for (Backend* b : {cpu.get(), ref.get()}) {
      Outputs x = run_case(*b, plain), y = run_case(*b, paged);
      ASSERT_EQ(x.floats.size(), y.floats.size()) << paged.name;
      for (size_t i = 0; i < x.floats.size(); ++i) {
        ASSERT_EQ(x.floats[i].size(), y.floats[i].size()) << paged.name;
        size_t first = 0;
        while (first < x.floats[i].size() && std::memcmp(&x.floats[i][first], &y.floats[i][first], 4) == 0) ++first;
        EXPECT_EQ(first, x.floats[i].size())
            << paged.name << " differs from " << plain.name << " on " << b->name() << " at element " << first << ": "
            << (first < x.floats[i].size() ? x.floats[i][first] : 0.0f) << " vs "
            << (first < y.floats[i].size() ? y.floats[i][first] : 0.0f);
      }
    }
  }
}

// The thread count changes which thread computes a column, never how.
TEST(CpuBackend, GemmBitsIndependentOfThreadCount) {
  auto cpu = make_cpu_backend();
  for (int64_t m : {1, 64}) {
    OpCase c = cases::gemm_case(m, 300, 1100, DType::BF16, false, false, 0, 77);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    Outputs one = run_case(*cpu, c);
    omp_set_num_threads(std::max(saved, 2));
    Outputs many = run_case(*cpu, c);
    omp_set_num_threads(saved);
    ASSERT_EQ(one.floats[0].size(), many.floats[0].size());
    EXPECT_EQ(0, std::memcmp(one.floats[0].data(), many.floats[0].data(), one.floats[0].size() * 4)) << "m = " << m;
  }
}

// Single-row tiles (decode at batch 1) with and without their software prefetch
// (cpu/dot_tile.h single_row_prefetch), on row-major and interleaved (kQuad16) BF16 weights: the
// same bytes.
TEST(CpuBackend, SingleRowPrefetchDoesNotChangeBits) {
  auto cpu = make_cpu_backend();
  const int64_t n = 300, k = 2048;
  const std::vector<uint8_t> bytes = weight_bytes(random_floats(size_t(n * k), 3), DType::BF16);
  const std::vector<float> x = random_floats(size_t(k), 4);
  cpu::WeightArena arena;
  const Weight rows{bytes.data(), DType::BF16, n, k, k};
  Weight quads{arena.copy_interleaved(bytes.data(), 2, n, k, k, WeightLayout::kQuad16), DType::BF16, n, k,
               cpu::WeightArena::interleaved_ld(WeightLayout::kQuad16, k)};
  quads.layout = WeightLayout::kQuad16;
  ASSERT_NE(quads.data, nullptr);
  const bool saved = cpu::single_row_prefetch();
  for (const Weight& w : {rows, quads}) {
    std::vector<float> y[2];
    for (int on = 0; on < 2; ++on) {
      cpu::set_single_row_prefetch(on == 1);
      y[on].assign(size_t(n), -1.0f);
      cpu->gemm({x.data(), k, w, false, y[on].data(), n, 1, n, k});
    }
    EXPECT_EQ(0, std::memcmp(y[0].data(), y[1].data(), size_t(n) * 4))
        << (w.layout == WeightLayout::kQuad16 ? "quads" : "rows");
  }
  cpu::set_single_row_prefetch(saved);
}

// y = x W with W [k, n] (trans_w) is, for every element, the sequential chain acc = fma(x[kk],
// W[kk, j], acc) over kk from zero (then y + acc with accumulate), whatever the tile: one row's
// 256-column items, 4-row items of 64 columns (BF16: of 256, in tiles of 64), the BF16 tiles that
// widen 32 columns per load. Checked bit for bit against that chain written out, on column tails
// of every kind.
TEST(CpuBackend, TransposedGemmIsTheSequentialChain) {
  auto cpu = make_cpu_backend();
  for (DType dt : {DType::BF16, DType::F32})
    for (int64_t m : {1, 2, 3, 5})
      for (int64_t n : {1, 16, 17, 31, 32, 48, 90, 256, 281})
        for (bool acc : {false, true}) {
          const int64_t k = 37, ldw = n + 2, ldx = k + 1, ldy = n + 3;
          const std::vector<float> wf = random_floats(size_t(k * ldw), 11 + uint64_t(n));
          const std::vector<uint8_t> wb = weight_bytes(wf, dt);
          const std::vector<float> x = random_floats(size_t(m * ldx), 12 + uint64_t(m));
          std::vector<float> y = random_floats(size_t(m * ldy), 13), want = y;
          const Weight w{wb.data(), dt, k, n, ldw};
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              float chain = 0.0f;
              for (int64_t kk = 0; kk < k; ++kk) chain = std::fma(x[size_t(i * ldx + kk)], weight_at(w, kk, j), chain);
              float& o = want[size_t(i * ldy + j)];
              o = acc ? o + chain : chain;
            }
          cpu->gemm({x.data(), ldx, w, true, y.data(), ldy, m, n, k, acc});
          EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * 4))
              << dtype_name(dt) << " m=" << m << " n=" << n << " accumulate=" << acc;
        }
}

// gemm_batch runs independent gemms together (one parallel region, items of all gemms spread over
// the threads): every output is bitwise what gemm() gives it alone, whatever the mix of dtypes,
// transposed or quantized weights, row counts (decode's static split and whole-row tiles, prefill's
// dynamic split and cache-blocked panels over several row blocks) and thread counts.
TEST(CpuBackend, GemmBatchBitsEqualSingleGemms) {
  auto cpu = make_cpu_backend();
  const int64_t k = 384, n = 200;
  std::vector<std::vector<uint8_t>> w;
  std::vector<Weight> ws;
  auto add = [&](DType dt, int64_t rows, int64_t cols, uint64_t seed) {
    const std::vector<float> v = random_floats(size_t(rows * cols), seed);
    w.push_back(weight_bytes(v, dt));
    ws.push_back(Weight{w.back().data(), dt, rows, cols, cols});
  };
  add(DType::BF16, n, k, 1);
  add(DType::F32, 24, k, 2);
  add(DType::F16, n, k, 3);
  add(DType::BF16, k, 96, 4);  // trans_w: W [k, n]
  // Q8, groups of 32 with BF16 scales; FP8 with 128 x 128 F32 blocks.
  std::vector<uint8_t> q8(size_t(n * k)), fp8(size_t(n * k));
  for (size_t i = 0; i < q8.size(); ++i) q8[i] = uint8_t((i * 37 + 11) % 256), fp8[i] = uint8_t((i * 53 + 5) % 120);
  std::vector<uint16_t> q8s(size_t(n * k / 32));
  for (size_t i = 0; i < q8s.size(); ++i) q8s[i] = f32_to_bf16(0.001f * float(1 + i % 7));
  std::vector<float> fp8s(size_t(2 * 3));
  for (size_t i = 0; i < fp8s.size(); ++i) fp8s[i] = 0.5f + 0.25f * float(i);
  Weight wq8{q8.data(), DType::Q8, n, k, k, q8s.data(), DType::BF16, k / 32, 32, 1};
  Weight wfp8{fp8.data(), DType::F8_E4M3, n, k, k, fp8s.data(), DType::F32, 3, 128, 128};
  for (int64_t m : {1, 3, 16, 64, 130}) {
    const std::vector<float> x = random_floats(size_t(m * k), 10 + uint64_t(m));
    std::vector<GemmParams> ps{{x.data(), k, ws[0], false, nullptr, n, m, n, k},
                               {x.data(), k, ws[1], false, nullptr, 24, m, 24, k},
                               {x.data(), k, ws[2], false, nullptr, n, m, n, k, /*accumulate=*/true},
                               {x.data(), k, ws[3], true, nullptr, 96, m, 96, k},
                               {x.data(), k, wq8, false, nullptr, n, m, n, k},
                               {x.data(), k, wfp8, false, nullptr, n, m, n, k}};
    auto run = [&](bool batched, int threads) {
      std::vector<std::vector<float>> ys;
      for (const GemmParams& p : ps) ys.push_back(std::vector<float>(size_t(m * p.n), 0.25f));
      std::vector<GemmParams> qs = ps;
      for (size_t i = 0; i < qs.size(); ++i) qs[i].y = ys[i].data();
      const int saved = omp_get_max_threads();
      omp_set_num_threads(threads);
      if (batched)
        cpu->gemm_batch(qs);
      else
        for (const GemmParams& q : qs) cpu->gemm(q);
      omp_set_num_threads(saved);
      return ys;
    };
    const auto alone = run(false, 1);
    for (int threads : {1, 2}) {
      const auto together = run(true, threads);
      for (size_t i = 0; i < ps.size(); ++i)
        EXPECT_EQ(0, std::memcmp(alone[i].data(), together[i].data(), alone[i].size() * 4))
            << "gemm " << i << " of the batch, m = " << m << ", " << threads << " threads";
    }
    // The values are real products (not all zero or untouched).
    EXPECT_NE(alone[0][0], 0.25f);
    EXPECT_NE(alone[4][0], 0.25f);
  }
}

// The prefill tiles' 16 sums at once are simd::reduce of each vector, bit for bit: values of
// mixed sign and magnitude (each tree gives other bits), every tile shape, with and without
// accumulate; entries outside the tile are neither read into y nor written.
TEST(CpuBackend, ReduceFourByFourIsReduceOfEach) {
  std::mt19937 g(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int mr = 1; mr <= 4; ++mr)
    for (int nr = 1; nr <= 4; ++nr)
      for (bool acc : {false, true}) {
        simd::vf v[4][4];
        float lanes[4][4][simd::kLanes];
        for (int r = 0; r < 4; ++r)
          for (int c = 0; c < 4; ++c) {
            for (float& x : lanes[r][c]) x = u(g) * std::ldexp(1.0f, int(g() % 40) - 20);
            v[r][c] = simd::load(lanes[r][c]);
          }
        constexpr int64_t ldy = 7;
        std::vector<float> y(4 * ldy), want;
        for (float& x : y) x = u(g);
        want = y;
        for (int r = 0; r < mr; ++r)
          for (int c = 0; c < nr; ++c) {
            const float s = simd::reduce(v[r][c]);
            want[size_t(r * ldy + c)] = acc ? want[size_t(r * ldy + c)] + s : s;
          }
        simd::reduce_store_4x4(v, mr, nr, y.data(), ldy, acc);
        EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * 4)) << mr << "x" << nr << " accumulate=" << acc;
      }
}

// A row's bits do not depend on the gemm path its row count picks (whole-row tiles below
// kPanelMinRows rows, cache-blocked panels from there): rows 5 and m - 1 of a 40- or 130-row call
// (the last in a tile of 4 rows, or of 2) equal the same row alone, over all 150 columns (a last
// tile of 2 columns), for k with a tail chunk, below one chunk, exactly one panel, several panels
// and zero, with and without accumulate, every weight dtype.
TEST(CpuBackend, GemmPanelsBitsEqualRowTiles) {
  auto cpu = make_cpu_backend();
  const int64_t n = 150;
  for (DType dt : {DType::BF16, DType::F16, DType::F32})
    for (int64_t k : {0, 5, 16, 256, 300, 1100})
      for (bool acc : {false, true})
        for (int64_t m : {40, 130}) {
          const std::vector<uint8_t> w = weight_bytes(random_floats(size_t(n * std::max<int64_t>(k, 1)), 3), dt);
          const std::vector<float> x = random_floats(size_t(m * std::max<int64_t>(k, 1)), 4);
          std::vector<float> y0 = random_floats(size_t(m * n), 5), all = y0;
          all[size_t(5 * n)] = -0.0f;
          const Weight wt{w.data(), dt, n, k, k};
          cpu->gemm({x.data(), k, wt, false, all.data(), n, m, n, k, acc});
          for (int64_t r : {int64_t(5), m - 1}) {
            std::vector<float> one(y0.begin() + r * n, y0.begin() + (r + 1) * n);
            if (r == 5) one[0] = -0.0f;
            cpu->gemm({x.data() + r * k, k, wt, false, one.data(), n, 1, n, k, acc});
            EXPECT_EQ(0, std::memcmp(all.data() + r * n, one.data(), size_t(n) * 4))
                << dtype_name(dt) << " k=" << k << " m=" << m << " row " << r << " accumulate=" << acc;
          }
        }
}

// Weights uploaded from a file mapping are copied into the arena (64-byte aligned, same bytes,
// several pieces and chunks), unless GLM5_CPU_WEIGHTS=mmap; other uploads stay in place.
TEST(CpuBackend, MappedWeightsAreCopiedExactly) {
  auto cpu = make_cpu_backend();
  for (size_t bytes : {size_t(1), size_t(100), size_t(3) << 20, (size_t(300) << 20) + 7}) {
    std::vector<uint8_t> src(bytes);
    for (size_t i = 0; i < bytes; i += 4093) src[i] = uint8_t(i * 31 + 7);
    src.back() = 0xab;
    const void* up = cpu->upload_mapped(src.data(), bytes);
    // (the arena keeps the mapping when memory is short: then the same pointer comes back)
    if (up != static_cast<const void*>(src.data())) {
      EXPECT_TRUE(cpu::WeightArena::copy_enabled());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(up) % 64, 0u) << bytes;
    }
    EXPECT_EQ(0, std::memcmp(up, src.data(), bytes)) << bytes;
  }
  int x = 5;
  EXPECT_EQ(cpu->upload(&x, sizeof x), static_cast<const void*>(&x));
}

// Decode after a long context on 2 threads: one row's top-k over column chunks in parallel (each
// chunk's best, then the best of their union; from 8192 columns) selects exactly the reference's
// indices, also when k exceeds a chunk, and so does the sampled-threshold selection of long rows
// (alone or several in parallel; ties, infinities and NaN included); the indexer's long paged scan
// (f32 and bf16 keys) matches the reference.
TEST(CpuBackend, LongDecodeRowsOnTwoThreads) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  for (const OpCase& c :
       {cases::topk_case(1, 70000, 256, 76), cases::topk_case(1, 70000, 9000, 77), cases::topk_case(3, 9000, 64, 78),
        cases::topk_case(1, 2048, 256, 79), cases::topk_case(1, 20000, 256, 71), cases::topk_case(1, 10000, 5000, 72),
        cases::topk_case(1, 9000, 1, 73), cases::indexer_case(1, 3000, 8, 64, 74, cases::Paging::PerRow),
        cases::indexer_case(1, 3000, 8, 64, 75, cases::Paging::PerRow, true),
        cases::mla_decode_case(1, 5000, 16, 64, 16, 256, 80),
        cases::mla_decode_case(3, 5000, 9, 64, 16, 300, 81, 0.3f, cases::Paging::PerRow)})
    EXPECT_TRUE(compare(*cpu, *ref, c)) << c.name;
  omp_set_num_threads(saved);
}

// A decode row alone on two or three threads (its scores split by keys, its values by columns over
// the threads) gives the bytes the same row gets as one row of a batch (heads split over the
// threads), and on one thread: dense and top-k rows (with -1 padding and duplicates), rows that see
// no key or fewer keys than threads, head counts that are not a multiple of 4, latent widths that
// are not a multiple of 16 (a chunk tail in the scores and in the values), paged caches in float32
// and in bf16 (the row's keys widened once over the threads).
TEST(CpuBackend, DecodeRowAloneEqualsRowInBatch) {
  auto cpu = make_cpu_backend();
  const int saved = omp_get_max_threads();
  struct Shape {
    int64_t t, heads, rank, rope, topk_len;
    bool paged, bf16 = false;
  };
  for (const Shape& sh :
       {Shape{600, 16, 256, 32, 256, false}, Shape{600, 9, 80, 16, 0, false}, Shape{700, 5, 72, 9, 0, false},
        Shape{3000, 7, 64, 16, 301, true}, Shape{900, 16, 128, 32, 2048, true},
        Shape{3000, 16, 256, 32, 256, true, true}, Shape{700, 5, 72, 9, 0, true, true}}) {
    const int64_t S = 6, dk = sh.rank + sh.rope, bs = 64;
    const auto q = random_floats(size_t(S * sh.heads * dk), 50, -0.5f, 0.5f);
    const auto cache = random_floats(size_t(sh.t * dk), 51);
    // (rows that see no key, one key, three keys: threads with empty runs of keys)
    std::vector<int32_t> q_pos = {int32_t(sh.t - 1), int32_t(sh.t / 2), int32_t(sh.t - 7), -1, 0, 2};
    auto topk = random_ints(size_t(S * std::max<int64_t>(sh.topk_len, 1)), 52, -1, int32_t(sh.t) - 1);
    std::vector<int32_t> table(size_t((sh.t + bs - 1) / bs));
    for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t((i * 7) % table.size());  // a permutation
    std::vector<float> pool(table.size() * size_t(bs * dk));
    std::vector<uint16_t> pool_bf16(pool.size());
    for (int64_t r = 0; r < sh.t; ++r)
      for (int64_t d = 0; d < dk; ++d) {
        const size_t at = size_t((int64_t(table[size_t(r / bs)]) * bs + r % bs) * dk + d);
        pool[at] = cache[size_t(r * dk + d)];
        pool_bf16[at] = f32_to_bf16(cache[size_t(r * dk + d)]);
      }
    const auto run = [&](int64_t row0, int64_t s, int threads) {
      std::vector<float> out(size_t(s * sh.heads * sh.rank), -1.0f);
      MlaDecodeParams p;
      p.q_lat = q.data() + row0 * sh.heads * dk, p.cache = sh.paged ? pool.data() : cache.data();
      p.q_pos = q_pos.data() + row0;
      if (sh.topk_len) p.topk = topk.data() + row0 * sh.topk_len, p.topk_len = sh.topk_len;
      p.out_lat = out.data(), p.s = s, p.t = sh.t, p.n_heads = sh.heads, p.kv_lora_rank = sh.rank;
      p.qk_rope_head_dim = sh.rope, p.scale = 0.2f;
      if (sh.paged) p.pages = KeyPages{table.data(), 0, bs, sh.bf16 ? DType::BF16 : DType::F32};
      if (sh.bf16) p.cache = reinterpret_cast<const float*>(pool_bf16.data());
      omp_set_num_threads(threads);
      cpu->mla_decode(p);
      omp_set_num_threads(saved);
      return out;
    };
    const auto batch = run(0, S, 2);
    for (int64_t r = 0; r < S; ++r)
      for (int threads : {2, 3, 1}) {
        const auto alone = run(r, 1, threads);
        EXPECT_EQ(0, std::memcmp(alone.data(), batch.data() + r * sh.heads * sh.rank, alone.size() * 4))
            << "t=" << sh.t << " heads=" << sh.heads << " rank=" << sh.rank << " topk=" << sh.topk_len
            << (sh.bf16 ? " bf16" : "") << " row " << r << ", " << threads << " threads";
        EXPECT_NE(alone[0], -1.0f);
        if (q_pos[size_t(r)] < 0) {
          EXPECT_EQ(alone[0], 0.0f);  // no key: zeros
        }
      }
  }
}

// -0 and +0 are one value to the selection: where the k-th best falls among zeros of both signs,
// the lower indices win whatever their sign, as in the reference: long decode rows chunked on 2
// threads (k = 256 with ~200 positives: each chunk through the sampled threshold, which lands on
// zero; k = 2048: the plain selection per chunk), and short rows.
TEST(CpuBackend, TopkSignedZerosAreTies) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  for (const auto& [rows, cols, k, every] :
       {std::tuple<int64_t, int64_t, int64_t, size_t>{1, 20000, 256, 101}, {1, 20000, 2048, 13}, {3, 300, 40, 13}}) {
    std::vector<float> v(size_t(rows * cols));
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = (i * 7919) % every == 0 ? 1.0f + float(i % 97) : (i % 3 ? -0.0f : 0.0f);
    std::vector<int32_t> got(size_t(rows * k)), want(got.size());
    cpu->topk({v.data(), rows, cols, cols, k, got.data()});
    ref->topk({v.data(), rows, cols, cols, k, want.data()});
    EXPECT_EQ(got, want) << rows << " x " << cols;
  }
  omp_set_num_threads(saved);
}

// Attention's key blocks (at most 32 of a row's keys each; decode's heads share them) and the
// grouping of heads into tiles change which tile computes a value, never how: each head of a
// sparse decode row over a long context, alone, gives the bytes it gives among 16 heads; and each
// prefill row with its own selection, alone, the bytes it gives among 8 (one task, whose blocks
// end where any of its rows has its 32nd next key); both agree with the reference to rounding.
// On one thread: a single decode row on several takes attend_one_row (DecodeRowAloneEqualsRowInBatch).
TEST(CpuBackend, AttentionKeyBlocksDoNotChangeBits) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const int64_t T = 5000, H = 16, R = 64, P = 16, D = R + P, K = 256;
  auto cache = random_floats(size_t(T * D), 90);
  auto q = random_floats(size_t(H * D), 91, -0.5f, 0.5f);
  auto sel = random_ints(size_t(K), 92, -1, int32_t(T) - 1);
  const int32_t pos = int32_t(T - 1);
  std::vector<float> all(static_cast<size_t>(H * R)), one(static_cast<size_t>(R));
  MlaDecodeParams p;
  p.cache = cache.data(), p.q_pos = &pos, p.topk = sel.data(), p.topk_len = K;
  p.s = 1, p.t = T, p.kv_lora_rank = R, p.qk_rope_head_dim = P, p.scale = 0.1f;
  p.q_lat = q.data(), p.out_lat = all.data(), p.n_heads = H;
  cpu->mla_decode(p);
  std::vector<float> want(all.size());
  p.out_lat = want.data();
  ref->mla_decode(p);
  EXPECT_TRUE(compare_floats("mla_decode t=5000 top-256", all, want, 1e-5));
  for (int64_t h = 0; h < H; ++h) {
    p.q_lat = q.data() + h * D, p.out_lat = one.data(), p.n_heads = 1;
    cpu->mla_decode(p);
    EXPECT_EQ(0, std::memcmp(one.data(), all.data() + h * R, size_t(R) * 4)) << "decode head " << h;
  }
  // Prefill: 8 rows of one head, each its own selection of up to 300 keys of 3000.
  const int64_t S = 8, TP = 3000, dn = 32, dr = 16, dv = 48, L = 300;
  auto qp = random_floats(size_t(S * (dn + dr)), 93, -0.5f, 0.5f);
  auto kv = random_floats(size_t(TP * (dn + dv)), 94), kpe = random_floats(size_t(TP * dr), 95);
  auto topk = random_ints(size_t(S * L), 96, -1, int32_t(TP) - 1);
  std::vector<int32_t> qpos(S);
  for (int64_t i = 0; i < S; ++i) qpos[size_t(i)] = int32_t(TP - S + i);
  std::vector<float> rows(static_cast<size_t>(S * dv)), row(static_cast<size_t>(dv));
  MlaPrefillParams f;
  f.kv = kv.data(), f.k_pe = kpe.data(), f.ld_k_pe = dr, f.t = TP, f.n_heads = 1, f.topk_len = L;
  f.qk_nope_head_dim = dn, f.qk_rope_head_dim = dr, f.v_head_dim = dv, f.scale = 0.125f;
  f.q = qp.data(), f.q_pos = qpos.data(), f.topk = topk.data(), f.out = rows.data(), f.s = S;
  cpu->mla_prefill(f);
  std::vector<float> ref_rows(rows.size());
  f.out = ref_rows.data();
  ref->mla_prefill(f);
  EXPECT_TRUE(compare_floats("mla_prefill 8 rows, top-300 of 3000", rows, ref_rows, 1e-5));
  for (int64_t i = 0; i < S; ++i) {
    f.q = qp.data() + i * (dn + dr), f.q_pos = qpos.data() + i, f.topk = topk.data() + i * L;
    f.out = row.data(), f.s = 1;
    cpu->mla_prefill(f);
    EXPECT_EQ(0, std::memcmp(row.data(), rows.data() + i * dv, size_t(dv) * 4)) << "prefill row " << i;
  }
  omp_set_num_threads(saved_threads);
}

// Both CPU backends reject bad parameters with a message naming the op and the value.
class CpuBackendErrors : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Backend> backend() { return GetParam() == "cpu" ? make_cpu_backend() : make_reference_backend(); }
};

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const glm5::Error& e) {
    return e.what();
  }
  return "";
}

TEST_P(CpuBackendErrors, GemmUnsupportedDtype) {
  auto b = backend();
  std::vector<float> x(4), y(4);
  std::vector<uint8_t> w(16);
  GemmParams p;
  p.x = x.data(), p.ldx = 2, p.y = y.data(), p.ldy = 2, p.m = 2, p.n = 2, p.k = 2;
  p.w = Weight{w.data(), DType::F8_E4M3, 2, 2, 2};
  std::string msg = error_of([&] { b->gemm(p); });
  EXPECT_NE(msg.find("gemm"), std::string::npos) << msg;
  EXPECT_NE(msg.find("F8_E4M3"), std::string::npos) << msg;
  p.w.dtype = DType::I32;
  msg = error_of([&] { b->gemm(p); });
  EXPECT_NE(msg.find("I32"), std::string::npos) << msg;
}

TEST_P(CpuBackendErrors, GemmShapeMismatch) {
  auto b = backend();
  std::vector<float> x(6), y(6);
  std::vector<uint16_t> w(9);
  GemmParams p;
  p.x = x.data(), p.ldx = 3, p.y = y.data(), p.ldy = 3, p.m = 2, p.n = 3, p.k = 3;
  p.w = Weight{w.data(), DType::BF16, 2, 3, 3};  // 2 rows but n = 3
  std::string msg = error_of([&] { b->gemm(p); });
  EXPECT_NE(msg.find("weight is [2, 3]"), std::string::npos) << msg;
}

TEST_P(CpuBackendErrors, EmbeddingIdOutOfRangeAndDtype) {
  auto b = backend();
  std::vector<uint16_t> table(6);
  std::vector<int32_t> ids = {0, 3};
  std::vector<float> out(4);
  EmbeddingParams p;
  p.table = Weight{table.data(), DType::BF16, 3, 2, 2};
  p.ids = ids.data(), p.m = 2, p.out = out.data();
  std::string msg = error_of([&] { b->embedding(p); });
  EXPECT_NE(msg.find("token id 3"), std::string::npos) << msg;
  ids[1] = 1;
  p.table.dtype = DType::U8;
  msg = error_of([&] { b->embedding(p); });
  EXPECT_NE(msg.find("U8"), std::string::npos) << msg;
}

TEST_P(CpuBackendErrors, AttentionTopkEntryOutOfRange) {
  auto b = backend();
  std::vector<float> q(4), kv(8), k_pe(2), out(2);
  std::vector<int32_t> q_pos = {1}, topk = {0, 7};
  MlaPrefillParams p;
  p.q = q.data(), p.kv = kv.data(), p.k_pe = k_pe.data(), p.ld_k_pe = 1;
  p.q_pos = q_pos.data(), p.topk = topk.data(), p.topk_len = 2, p.out = out.data();
  p.s = 1, p.t = 2, p.n_heads = 1, p.qk_nope_head_dim = 1, p.qk_rope_head_dim = 1, p.v_head_dim = 2;
  std::string msg = error_of([&] { b->mla_prefill(p); });
  EXPECT_NE(msg.find("topk entry 7"), std::string::npos) << msg;
}

// Tiles are an indexer-key layout: the latent cache given as tiles is refused.
TEST_P(CpuBackendErrors, AttentionRefusesTiledLatents) {
  auto b = backend();
  std::vector<float> q(4), cache(4), out(2);
  std::vector<int32_t> q_pos = {0}, table = {0};
  MlaDecodeParams p;
  p.q_lat = q.data(), p.cache = cache.data(), p.q_pos = q_pos.data(), p.out_lat = out.data();
  p.s = 1, p.t = 1, p.n_heads = 1, p.kv_lora_rank = 2, p.qk_rope_head_dim = 2, p.scale = 1.0f;
  p.pages = KeyPages{table.data(), 0, 1, DType::F32, true};
  std::string msg = error_of([&] { b->mla_decode(p); });
  EXPECT_NE(msg.find("tiled"), std::string::npos) << msg;
}

TEST_P(CpuBackendErrors, RouterBadGroups) {
  auto b = backend();
  std::vector<float> logits(10), w(2);
  std::vector<int32_t> ids(2);
  RouterParams p;
  p.logits = logits.data(), p.m = 1, p.n_experts = 10, p.top_k = 2, p.n_group = 4, p.topk_group = 2;
  p.expert_ids = ids.data(), p.expert_weights = w.data();
  std::string msg = error_of([&] { b->router(p); });
  EXPECT_NE(msg.find("not divisible by n_group 4"), std::string::npos) << msg;
}

INSTANTIATE_TEST_SUITE_P(Backends, CpuBackendErrors, ::testing::Values("cpu", "reference"));

TEST(CpuBackend, HostMemory) {
  auto b = make_cpu_backend();
  EXPECT_EQ(b->name(), "cpu");
  std::vector<float> host = {1, 2, 3}, back(3);
  void* d = b->alloc(12);
  b->to_device(d, host.data(), 12);
  b->to_host(back.data(), d, 12);
  EXPECT_EQ(back, host);
  b->free(d);
  EXPECT_EQ(b->upload(host.data(), 12), host.data());  // weights are used in place
}

}  // namespace
}  // namespace glm5::kernels::test
