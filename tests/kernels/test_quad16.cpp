// The interleaved weight layout (WeightLayout::kQuad16, ops.h): the arena's copy puts every element
// where quad16_offset says and zeroes the padding; the fast gemm gives bitwise the row-major
// results on it (decode tiles, prefill panels, threads, batches); the fast cpu backend uploads
// plain-dtype gemm matrices in it (not where BF16 runs on AMX tiles); and the layout's limits are
// refused with a message.
#include <omp.h>

#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/weight_arena.h"
#include "tests/kernels/op_cases.h"

namespace glm5::kernels::test {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const glm5::Error& e) {
    return e.what();
  }
  return "";
}

// The fp32 gemm path for the scope: on a CPU with AMX a row-major BF16 weight would run on the
// tiles (another recipe), an interleaved one never does.
struct Fp32Path {
  const std::string saved = cpu::fast::gemm_path();
  Fp32Path() { cpu::fast::set_gemm_path("fp32"); }
  ~Fp32Path() { cpu::fast::set_gemm_path(saved); }
};

// A row-major matrix [rows, cols] with row stride ld, and its interleaved copy.
struct Pair {
  std::vector<uint8_t> bytes;
  Weight rows, quad;
};

Pair make_pair(cpu::WeightArena& arena, DType dt, int64_t rows, int64_t cols, int64_t ld, uint64_t seed) {
  Pair p;
  p.bytes = weight_bytes(random_floats(size_t(rows * ld), seed), dt);
  p.rows = Weight{p.bytes.data(), dt, rows, cols, ld};
  p.quad = p.rows;
  p.quad.data = arena.copy_quad16(p.bytes.data(), dtype_size(dt), rows, cols, ld);
  p.quad.layout = WeightLayout::kQuad16;
  p.quad.ld = cpu::WeightArena::quad16_ld(cols);
  return p;
}

// (The values are placed by quad16_offset, which weight_at also reads by: that the kernels agree
// with it is what GemmBitsEqualRowMajor checks against the row-major results.)
// The arena copies nothing under GLM5_CPU_WEIGHTS=mmap, nor where memory is short (a cgroup limit
// well under the host's RAM): then there is no interleaved weight to test.
#define SKIP_WITHOUT_ARENA(arena)                                                                     \
  do {                                                                                                \
    std::vector<uint8_t> mib(size_t(1) << 20);                                                        \
    if (!(arena).copy(mib.data(), mib.size()))                                                        \
      GTEST_SKIP() << "the weight arena copies nothing here (GLM5_CPU_WEIGHTS=mmap or memory short)"; \
  } while (0)

TEST(Quad16, ArenaCopyPlacesEveryElementAndZeroesThePadding) {
  cpu::WeightArena arena;
  SKIP_WITHOUT_ARENA(arena);
  for (DType dt : {DType::BF16, DType::F16, DType::F32})
    for (int64_t rows : {1, 3, 4, 5, 9})
      for (int64_t cols : {1, 15, 16, 17, 40}) {
        const Pair p = make_pair(arena, dt, rows, cols, cols + 3, uint64_t(rows * 100 + cols));
        ASSERT_NE(p.quad.data, nullptr) << "the arena took a 1 MiB copy and refused a small one";
        ASSERT_EQ(reinterpret_cast<uintptr_t>(p.quad.data) % 64, 0u);
        const int64_t ld = p.quad.ld;
        EXPECT_EQ(ld % 16, 0);
        for (int64_t r = 0; r < (rows + 3) / 4 * 4; ++r)
          for (int64_t c = 0; c < ld; ++c) {
            const float want = r < rows && c < cols ? weight_at(p.rows, r, c) : 0.0f;
            const size_t at = size_t(quad16_offset(r, c, ld)) * dtype_size(dt);
            std::vector<uint8_t> zero(dtype_size(dt), 0);
            if (r < rows && c < cols) {
              ASSERT_EQ(weight_at(p.quad, r, c), want)
                  << dtype_name(dt) << " [" << rows << ", " << cols << "] (" << r << ", " << c << ")";
            } else {
              ASSERT_EQ(0, std::memcmp(static_cast<const uint8_t*>(p.quad.data) + at, zero.data(), zero.size()))
                  << "padding (" << r << ", " << c << ") of [" << rows << ", " << cols << "] is not zero";
            }
          }
      }
}

// Row count (decode tiles below kPanelMinRows, panels from it), k (below a chunk, a tail chunk,
// whole panels and more), n (inside one group of 4, a partial last group, several items), every
// plain dtype, accumulate: the interleaved weight gives the row-major result bit for bit.
TEST(Quad16, GemmBitsEqualRowMajor) {
  const Fp32Path fp32;
  cpu::WeightArena arena;
  SKIP_WITHOUT_ARENA(arena);
  auto cpu = make_cpu_backend();
  for (DType dt : {DType::BF16, DType::F16, DType::F32})
    for (int64_t n : {3, 4, 130, 261})
      for (int64_t k : {1, 17, 256, 300, 1100}) {
        const Pair p = make_pair(arena, dt, n, k, k, uint64_t(n * 7 + k));
        ASSERT_NE(p.quad.data, nullptr) << "the arena took a 1 MiB copy and refused a small one";
        for (int64_t m : {1, 5, 16, 40, 130})
          for (bool acc : {false, true}) {
            const std::vector<float> x = random_floats(size_t(m * k), uint64_t(m + k));
            std::vector<float> a = random_floats(size_t(m * n), 9), b = a;
            cpu->gemm({x.data(), k, p.rows, false, a.data(), n, m, n, k, acc});
            cpu->gemm({x.data(), k, p.quad, false, b.data(), n, m, n, k, acc});
            ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4))
                << dtype_name(dt) << " m=" << m << " n=" << n << " k=" << k << " accumulate=" << acc;
          }
      }
}

// In a batch with row-major and quantized weights, on 1 and 2 threads: each output is what the
// gemm gives alone.
TEST(Quad16, GemmBatchAndThreads) {
  const Fp32Path fp32;
  cpu::WeightArena arena;
  SKIP_WITHOUT_ARENA(arena);
  auto cpu = make_cpu_backend();
  const int64_t k = 2048, n = 700;
  const Pair a = make_pair(arena, DType::BF16, n, k, k, 1), b = make_pair(arena, DType::F32, 36, k, k, 2);
  ASSERT_TRUE(a.quad.data && b.quad.data);
  // And a transposed Q8 weight W [k, 64] (dequantized whole, then its own gemm call inside the batch).
  std::vector<uint8_t> q8t(size_t(k * 64));
  for (size_t i = 0; i < q8t.size(); ++i) q8t[i] = uint8_t((i * 29 + 3) % 256);
  std::vector<uint16_t> q8ts(size_t(k * 2), f32_to_bf16(0.004f));
  const Weight wq8t{q8t.data(), DType::Q8, k, 64, 64, q8ts.data(), DType::BF16, 2, 32, 1};
  std::vector<uint8_t> q8(size_t(n * k));
  for (size_t i = 0; i < q8.size(); ++i) q8[i] = uint8_t((i * 37 + 11) % 256);
  std::vector<uint16_t> q8s(size_t(n * k / 32), f32_to_bf16(0.002f));
  const Weight wq8{q8.data(), DType::Q8, n, k, k, q8s.data(), DType::BF16, k / 32, 32, 1};
  for (int64_t m : {1, 8, 64}) {
    const std::vector<float> x = random_floats(size_t(m * k), uint64_t(m));
    const std::vector<Weight> ws{a.quad, a.rows, b.quad, wq8, wq8t};
    std::vector<std::vector<float>> alone(ws.size()), together(ws.size());
    std::vector<GemmParams> ps;
    for (size_t i = 0; i < ws.size(); ++i) {
      const bool trans = ws[i].dtype == DType::Q8 && ws[i].rows == k;
      const int64_t n_out = trans ? ws[i].cols : ws[i].rows;
      alone[i].assign(size_t(m * n_out), 0.0f);
      together[i] = alone[i];
      cpu->gemm({x.data(), k, ws[i], trans, alone[i].data(), n_out, m, n_out, k});
      ps.push_back({x.data(), k, ws[i], trans, together[i].data(), n_out, m, n_out, k});
    }
    for (int threads : {1, 2}) {
      const int saved = omp_get_max_threads();
      omp_set_num_threads(threads);
      cpu->gemm_batch(ps);
      omp_set_num_threads(saved);
      for (size_t i = 0; i < ws.size(); ++i)
        EXPECT_EQ(0, std::memcmp(alone[i].data(), together[i].data(), alone[i].size() * 4))
            << "gemm " << i << " m=" << m << " threads=" << threads;
    }
    EXPECT_EQ(0, std::memcmp(alone[0].data(), alone[1].data(), alone[0].size() * 4)) << "quad vs rows, m=" << m;
    EXPECT_NE(alone[0][0], 0.0f);
    EXPECT_NE(alone[4][0], 0.0f);
  }
}

// On the AMX path (emulated here, so on every machine) an interleaved BF16 weight still takes the
// fp32 recipe: the bits of the row-major weight on the fp32 path, never tiles fed interleaved rows.
TEST(Quad16, AmxPathLeavesInterleavedWeightsOnTheFp32Recipe) {
  cpu::WeightArena arena;
  SKIP_WITHOUT_ARENA(arena);
  auto cpu = make_cpu_backend();
  const std::string saved = cpu::fast::gemm_path();
  const int64_t n = 100, k = 300;
  const Pair p = make_pair(arena, DType::BF16, n, k, k, 8);
  ASSERT_NE(p.quad.data, nullptr);
  for (int64_t m : {1, 40}) {
    const std::vector<float> x = random_floats(size_t(m * k), uint64_t(m));
    std::vector<float> fp32(size_t(m * n)), amx(size_t(m * n));
    cpu::fast::set_gemm_path("fp32");
    cpu->gemm({x.data(), k, p.rows, false, fp32.data(), n, m, n, k});
    cpu::fast::set_gemm_path("amx-emulated");
    cpu->gemm({x.data(), k, p.quad, false, amx.data(), n, m, n, k});
    EXPECT_EQ(0, std::memcmp(fp32.data(), amx.data(), fp32.size() * 4)) << "m=" << m;
  }
  cpu::fast::set_gemm_path(saved);
}

// The fast cpu backend holds plain-dtype gemm matrices interleaved (BF16 in AMX tiles, kTile16,
// where its gemm runs on them), quantized ones in quads of rows (kQuantQuad); the reference backend
// keeps them as they are.
TEST(Quad16, BackendUploadsPlainGemmMatricesInterleaved) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  for (DType dt : {DType::BF16, DType::F16, DType::F32, DType::Q8}) {
    const int64_t rows = 10, cols = 64;
    std::vector<uint8_t> bytes(size_t(rows * cols));  // Q8: scattered codes, so that a misplaced byte shows
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 2654435761u >> 13);
    if (dt != DType::Q8) bytes = weight_bytes(random_floats(size_t(rows * cols), 4), dt);
    std::vector<uint16_t> scales(size_t(rows * cols / 32), f32_to_bf16(0.5f));
    Weight w{bytes.data(), dt, rows, cols, cols};
    if (dt == DType::Q8) w = Weight{bytes.data(), dt, rows, cols, cols, scales.data(), DType::BF16, cols / 32, 32, 1};
    const Weight up = cpu->upload_gemm_matrix(w, bytes.size());
    const bool tiles = dt == DType::BF16 && cpu::fast::gemm_path() != "fp32";
    const WeightLayout want =
        dt == DType::Q8 ? (cpu::fast::quant_path() == "avx512" ? WeightLayout::kQuantQuad : WeightLayout::kRowMajor)
        : tiles         ? WeightLayout::kTile16
                        : WeightLayout::kQuad16;
    if (up.data == w.data) {  // not copied: GLM5_CPU_WEIGHTS=mmap, or memory short
      EXPECT_EQ(up.layout, WeightLayout::kRowMajor) << dtype_name(dt);
    } else {
      EXPECT_EQ(up.layout, want) << dtype_name(dt);
      EXPECT_EQ(up.ld, dt == DType::Q8 ? cols : cpu::WeightArena::interleaved_ld(want, cols)) << dtype_name(dt);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(weight_at(up, r, c), weight_at(w, r, c)) << dtype_name(dt) << " (" << r << ", " << c << ")";
    const Weight kept = ref->upload_gemm_matrix(w, bytes.size());
    EXPECT_EQ(kept.layout, WeightLayout::kRowMajor);
    EXPECT_EQ(kept.data, w.data);
  }
}

// What the layout cannot hold: transposed use, quantized dtypes, a slice inside a group of 4 rows.
TEST(Quad16, LimitsAreRefusedWithAMessage) {
  std::vector<uint16_t> w(64 * 16, 0);
  std::vector<float> x(64 * 16), y(64 * 16);
  Weight q{w.data(), DType::BF16, 16, 64, 64};
  q.layout = WeightLayout::kQuad16;
  std::unique_ptr<Backend> backends[] = {make_cpu_backend(), make_reference_backend()};
  for (auto& b : backends) {
    std::string msg = error_of([&] { b->gemm({x.data(), 16, q, true, y.data(), 64, 1, 64, 16}); });
    EXPECT_NE(msg.find("interleaved"), std::string::npos) << b->name() << ": " << msg;
    EXPECT_NE(msg.find("trans_w = 1"), std::string::npos) << b->name() << ": " << msg;
    Weight q8 = q;
    std::vector<uint16_t> s(64, f32_to_bf16(1.0f));
    q8.dtype = DType::Q8, q8.scale = s.data(), q8.scale_dtype = DType::BF16, q8.scale_ld = 2, q8.group = 32;
    msg = error_of([&] { b->gemm({x.data(), 64, q8, false, y.data(), 16, 1, 16, 64}); });
    EXPECT_NE(msg.find("interleaved"), std::string::npos) << b->name() << ": " << msg;
  }
  Weight odd = q;  // ld not a multiple of 16
  odd.cols = 60, odd.ld = 60;
  for (auto& b : backends) {
    const std::string msg = error_of([&] { b->gemm({x.data(), 60, odd, false, y.data(), 16, 1, 16, 60}); });
    EXPECT_NE(msg.find("ld 60"), std::string::npos) << b->name() << ": " << msg;
  }
  EXPECT_NE(error_of([&] { (void)q.slice_rows(2, 4); }).find("group of 4"), std::string::npos);
  const Weight s = q.slice_rows(8, 8);
  EXPECT_EQ(static_cast<const uint16_t*>(s.data), w.data() + 8 * 64);
}

}  // namespace
}  // namespace glm5::kernels::test
