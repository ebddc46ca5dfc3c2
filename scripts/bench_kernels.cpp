// Kernel benchmark of the fast CPU backend (not a test): gemm with BF16 weights next to OpenBLAS
// sgemm on the same shape (FP32 weights, its own blocking) and, for m = 1, next to the memory read
// bandwidth measured in the same run; then the attention ops at GLM-5 head sizes. Median wall
// time of --reps runs after one warm-up, all OpenMP threads (set OMP_NUM_THREADS to change).
// Built and run by scripts/bench_kernels.sh; without OpenBLAS (-DGLM5_NO_BLAS) the sgemm
// column is left out.
//   bench_kernels [--reps N] [--quick] [--only decode|experts|attention|quant|prefill]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/quant.h"
#include "kernels/cpu/amx_gemm.h"
#include "kernels/cpu/dot_tile.h"
#include "kernels/cpu/fast_ops.h"
#include "kernels/cpu/weight_arena.h"
#include "kernels/ops.h"
#include "scripts/bench/read_probe.h"

#ifndef GLM5_NO_BLAS
#include <cblas.h>
#endif

using namespace glm5;
using namespace glm5::kernels;

namespace {

int g_reps = 7;

double median_seconds(const std::function<void()>& f) {
  f();  // warm-up: page faults, caches, thread start
  std::vector<double> t;
  for (int r = 0; r < g_reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

// Memory read bandwidth in GB/s: the median of --reps sums over 1 GiB.
double read_bandwidth() {
  const ReadProbe probe(size_t(1) << 30);
  std::vector<double> g;
  for (int r = 0; r <= g_reps; ++r) g.push_back(probe.gbs());
  g.erase(g.begin());  // warm-up
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
}

void gemm_row(int64_t m, int64_t n, int64_t k, bool trans, Backend& cpu, double bandwidth) {
  auto x = random_floats(size_t(m * k), 1);
  auto wf = random_floats(size_t(n * k), 2);
  std::vector<uint16_t> wb(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
  std::vector<float> y(size_t(m * n));
  GemmParams p;
  p.x = x.data(), p.ldx = k;
  p.w = Weight{wb.data(), DType::BF16, trans ? k : n, trans ? n : k, trans ? n : k};
  if (!trans) p.w = cpu.upload_gemm_matrix(p.w, wb.size() * 2);  // the layout the model holds on this path
  p.trans_w = trans;
  p.y = y.data(), p.ldy = n, p.m = m, p.n = n, p.k = k;
  double t = median_seconds([&] { cpu.gemm(p); });
  double flops = 2.0 * double(m) * double(n) * double(k);
  std::printf("| gemm%s bf16 | m=%ld n=%ld k=%ld | %.3f ms | %.1f GFLOP/s", trans ? " trans_w" : "", long(m), long(n),
              long(k), t * 1e3, flops / t / 1e9);
  if (m == 1) {
    double gbs = double(n) * double(k) * 2 / t / 1e9;
    std::printf(" (%.1f GB/s of weights) | memory read %.1f GB/s | %.2f |\n", gbs, bandwidth, gbs / bandwidth);
    return;
  }
#ifndef GLM5_NO_BLAS
  double tb = median_seconds([&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, trans ? CblasNoTrans : CblasTrans, int(m), int(n), int(k), 1.0f, x.data(),
                int(k), wf.data(), trans ? int(n) : int(k), 0.0f, y.data(), int(n));
  });
  std::printf(" | OpenBLAS sgemm %.1f GFLOP/s | %.2f |\n", flops / tb / 1e9, tb / t);
#else
  std::printf(" | - | - |\n");
#endif
}

// Decode from memory: y = x W^T at m = 1 over 1 GiB of BF16 weights (8 matrices [32768, 2048], in
// huge-page arena memory as the model holds them): row-major and interleaved (WeightLayout::kQuad16)
// on the fp32 path, and where the CPU has AMX, as AMX tiles (kTile16) on the amx path; each pass set
// against a 1 GiB read probe on either side of it (the bandwidth of a shared machine drifts within a
// run); medians over `rounds` alternating passes. The decode rows above fit in the L3 of large
// CPUs; this one cannot.
void decode_stream_rows(Backend& cpu, int rounds) {
  const int64_t n = 32768, k = 2048, mats = 8;
  const size_t bytes = size_t(mats * n * k) * 2;
  std::vector<uint16_t> src(size_t(n * k));
  for (size_t i = 0; i < src.size(); ++i) src[i] = f32_to_bf16(float(int(i % 61) - 30) / 64.0f);
  cpu::WeightArena arena;
  struct Layout {
    const char* name;
    const char* path;  // the gemm path that reads it
    WeightLayout layout;
    std::vector<Weight> ws;
    bool prefetch = true;  // single_row_prefetch (cpu/dot_tile.h) during its passes
  };
  // The fp32 layouts with this machine's choice of single-row prefetch (and interleaved rows with
  // the other choice, added below on the same weights).
  const bool pf = cpu::single_row_prefetch();
  std::vector<Layout> layouts = {{"row-major", "fp32", WeightLayout::kRowMajor, {}, pf},
                                 {"interleaved rows", "fp32", WeightLayout::kQuad16, {}, pf}};
  if (cpu::amx::available()) layouts.push_back({"AMX tiles (amx path)", "amx", WeightLayout::kTile16, {}});
  for (Layout& l : layouts)
    for (int64_t i = 0; i < mats; ++i) {
      Weight w{nullptr, DType::BF16, n, k, k};
      w.layout = l.layout;
      if (l.layout == WeightLayout::kRowMajor) {
        w.data = arena.copy(src.data(), src.size() * 2);
      } else {
        w.data = arena.copy_interleaved(src.data(), 2, n, k, k, l.layout);
        w.ld = cpu::WeightArena::interleaved_ld(l.layout, k);
      }
      if (!w.data) {
        std::printf("| gemm bf16 from memory | (no room for %zu GiB of weights: skipped) | | | | |\n", layouts.size());
        return;
      }
      l.ws.push_back(w);
    }
  Layout other = layouts[1];
  other.prefetch = !pf;
  layouts.insert(layouts.begin() + 2, std::move(other));
  const ReadProbe probe(size_t(1) << 30);  // more than any L3 it could hide in
  const std::vector<float> x = random_floats(size_t(k), 3);
  std::vector<float> y(static_cast<size_t>(n));
  const auto pass = [&](const Layout& l) {
    cpu::fast::set_gemm_path(l.path);
    cpu::set_single_row_prefetch(l.prefetch);
    const auto t0 = std::chrono::steady_clock::now();
    for (const Weight& w : l.ws) cpu.gemm({x.data(), k, w, false, y.data(), n, 1, n, k});
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu::set_single_row_prefetch(pf);
    return double(bytes) / dt / 1e9;
  };
  const size_t nl = layouts.size();
  std::vector<std::vector<double>> ratio(nl), gbs(nl);
  for (const Layout& l : layouts) pass(l);  // warm-up
  for (int r = 0; r < rounds; ++r)
    for (size_t l = 0; l < nl; ++l) {
      const double before = probe.gbs(), g = pass(layouts[l]), after = probe.gbs();
      gbs[l].push_back(g), ratio[l].push_back(g / (0.5 * (before + after)));
    }
  for (size_t l = 0; l < nl; ++l) {
    std::sort(ratio[l].begin(), ratio[l].end()), std::sort(gbs[l].begin(), gbs[l].end());
    std::printf(
        "| gemm bf16 from memory, %s%s | m=1, 8 x n=%ld k=%ld (1 GiB) | | %.1f GB/s of weights | read probed "
        "around each pass | %.2f (quartiles %.2f %.2f) |\n",
        layouts[l].name,
        layouts[l].layout == WeightLayout::kTile16 ? ""
        : layouts[l].prefetch                      ? ", sw prefetch"
                                                   : ", hw prefetch only",
        long(n), long(k), gbs[l][gbs[l].size() / 2], ratio[l][ratio[l].size() / 2], ratio[l][ratio[l].size() / 4],
        ratio[l][ratio[l].size() * 3 / 4]);
  }
}

// Routed experts at decode from memory: per MoE layer, 8 of 64 experts picked at random (a fixed
// seed), their gate and up gemms in one batch and their down gemms in another, as the model runs
// them (m = 1; speed-a's expert [256, 2048] / [2048, 256], 1 MiB each in BF16); 6 layers of
// experts (1.1 GiB) so that no step finds its experts in the L3. Each path reads the layout the
// model gives it; each pass (all 6 layers, 10 times) is set against a read probe on either side.
void expert_stream_rows(Backend& cpu, int rounds) {
  const int64_t H = 2048, I = 256, E = 64, K = 8, layers = 6, steps = 10;
  std::vector<uint16_t> src(size_t(H * I));
  for (size_t i = 0; i < src.size(); ++i) src[i] = f32_to_bf16(float(int(i % 61) - 30) / 64.0f);
  struct Path {
    const char* path;
    WeightLayout layout;
    cpu::WeightArena arena;
    std::vector<Weight> gate, up, down;  // [layer * E + e]
  };
  std::deque<Path> paths;  // (an arena does not move)
  const auto add = [&](const char* path, WeightLayout layout) {
    paths.emplace_back();
    paths.back().path = path, paths.back().layout = layout;
  };
  add("fp32", WeightLayout::kQuad16);
  if (cpu::amx::available()) add("amx", WeightLayout::kTile16);
  for (Path& p : paths) {
    const auto make = [&](int64_t n, int64_t k) {
      Weight w{p.arena.copy_interleaved(src.data(), 2, n, k, k, p.layout), DType::BF16, n, k,
               cpu::WeightArena::interleaved_ld(p.layout, k)};
      w.layout = p.layout;
      return w;
    };
    for (int64_t i = 0; i < layers * E; ++i) {
      p.gate.push_back(make(I, H)), p.up.push_back(make(I, H)), p.down.push_back(make(H, I));
      if (!p.gate.back().data || !p.up.back().data || !p.down.back().data) {
        std::printf("| routed experts from memory | (no room for the experts: skipped) | | | | |\n");
        return;
      }
    }
  }
  std::mt19937 rng(7);
  std::vector<int64_t> pick;  // [step][layer][K] expert ids, distinct within a layer
  for (int64_t i = 0; i < steps * layers; ++i) {
    std::vector<int64_t> ids(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) ids[size_t(e)] = e;
    std::shuffle(ids.begin(), ids.end(), rng);
    pick.insert(pick.end(), ids.begin(), ids.begin() + K);
  }
  const ReadProbe probe(size_t(1) << 30);
  const std::vector<float> x = random_floats(size_t(H), 5);
  std::vector<float> g(size_t(K * I)), u(size_t(K * I)), y(size_t(K * H));
  const double bytes = double(steps * layers * K * 3 * H * I * 2);
  const auto pass = [&](const Path& p) {
    cpu::fast::set_gemm_path(p.path);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t sl = 0; sl < steps * layers; ++sl) {
      const int64_t l = sl % layers;
      std::vector<GemmParams> upb, downb;
      for (int64_t j = 0; j < K; ++j) {
        const size_t e = size_t(l * E + pick[size_t(sl * K + j)]);
        upb.push_back({x.data(), H, p.gate[e], false, g.data() + j * I, I, 1, I, H});
        upb.push_back({x.data(), H, p.up[e], false, u.data() + j * I, I, 1, I, H});
        downb.push_back({g.data() + j * I, I, p.down[e], false, y.data() + j * H, H, 1, H, I});
      }
      cpu.gemm_batch(upb);
      cpu.gemm_batch(downb);
    }
    return bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
  };
  std::vector<std::vector<double>> ratio(paths.size()), gbs(paths.size());
  for (const Path& p : paths) pass(p);  // warm-up
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < paths.size(); ++i) {
      const double before = probe.gbs(), v = pass(paths[i]), after = probe.gbs();
      gbs[i].push_back(v), ratio[i].push_back(v / (0.5 * (before + after)));
    }
  for (size_t i = 0; i < paths.size(); ++i) {
    std::sort(ratio[i].begin(), ratio[i].end()), std::sort(gbs[i].begin(), gbs[i].end());
    std::printf(
        "| routed experts from memory, %s path | m=1, 8 of 64 x (gate, up [%ld, %ld], down [%ld, %ld]) | "
        "| %.1f GB/s of weights | read probed around each pass | %.2f (quartiles %.2f %.2f) |\n",
        paths[i].path, long(I), long(H), long(H), long(I), gbs[i][gbs[i].size() / 2], ratio[i][ratio[i].size() / 2],
        ratio[i][ratio[i].size() / 4], ratio[i][ratio[i].size() * 3 / 4]);
  }
}

// Quantized decode (int8 / int4, group 128, BF16 scales as `glm5 convert --quant` writes them, and
// int8 with F32 scales, `--scale-dtype f32`):
// y = x W^T at m = 1 over 512 MiB of weight bytes (matrices [32768, 2048]), each pass set against a
// read probe on either side as above; and the same kernel over one [256, 2048] matrix that stays in
// the L2, which shows what the dequantization costs when memory is not the limit. Scales are
// positive and of ordinary size, as a checkpoint's are (the kernels' fast sequences).
void quant_stream_rows(Backend& cpu, int rounds) {
  const int64_t n = 32768, k = 2048, group = 128;
  cpu::WeightArena arena;  // huge-page memory, as the model holds its weights
  struct Mat {
    std::vector<uint8_t> q;
    std::vector<uint16_t> s;
    std::vector<float> s32;
    Weight w;
  };
  const auto make = [&](DType dt, DType sd, int64_t rows, unsigned seed) {
    Mat m;
    std::mt19937 g(seed);
    m.q.resize(quant::row_bytes(dt, k) * size_t(rows));
    for (auto& b : m.q) b = uint8_t(g());
    m.s.resize(size_t(rows * (k / group)));
    for (auto& v : m.s) v = f32_to_bf16(float(g() % 1000 + 1) * 1e-5f);
    // in quads of rows, as CpuBackend holds it (upload_gemm_matrix)
    const void* held = arena.copy_quant_quad(m.q.data(), dt, rows, quant::row_bytes(dt, k));
    m.w = Weight{held ? held : m.q.data(), dt, rows, k, k};
    if (held) m.w.layout = WeightLayout::kQuantQuad;
    if (held) std::vector<uint8_t>().swap(m.q);
    m.w.scale = m.s.data(), m.w.scale_dtype = DType::BF16, m.w.scale_ld = k / group, m.w.group = group;
    if (sd == DType::F32) {
      for (uint16_t v : m.s) m.s32.push_back(bf16_to_f32(v) * 1.001f);  // not BF16 numbers
      m.w.scale = m.s32.data(), m.w.scale_dtype = DType::F32;
    }
    return m;
  };
  const ReadProbe probe(size_t(1) << 30);
  const std::vector<float> x = random_floats(size_t(k), 3);
  std::vector<float> y(static_cast<size_t>(n));
  for (const auto& [dt, sd] :
       {std::pair{DType::Q8, DType::BF16}, std::pair{DType::Q8, DType::F32}, std::pair{DType::Q4, DType::BF16}}) {
    const char* name = dt == DType::Q4 ? "int4" : sd == DType::F32 ? "int8 (F32 scales)" : "int8";
    std::deque<Mat> mats;
    const size_t total = size_t(512) << 20;
    while (mats.size() * quant::row_bytes(dt, k) * size_t(n) < total)
      mats.push_back(make(dt, sd, n, unsigned(mats.size())));
    const double bytes = double(mats.size() * quant::row_bytes(dt, k) * size_t(n));
    const bool pf = cpu::single_row_prefetch();
    const auto pass = [&](bool prefetch) {
      cpu::set_single_row_prefetch(prefetch);
      const auto t0 = std::chrono::steady_clock::now();
      for (const Mat& m : mats) cpu.gemm({x.data(), k, m.w, false, y.data(), n, 1, n, k});
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      cpu::set_single_row_prefetch(pf);
      return bytes / dt / 1e9;
    };
    pass(pf);                              // warm-up
    std::vector<double> ratio[2], gbs[2];  // [this machine's prefetch choice, the other]
    for (int r = 0; r < rounds; ++r)
      for (int o = 0; o < 2; ++o) {
        const double before = probe.gbs(), v = pass(o ? !pf : pf), after = probe.gbs();
        gbs[o].push_back(v), ratio[o].push_back(v / (0.5 * (before + after)));
      }
    for (int o = 0; o < 2; ++o) {
      std::sort(ratio[o].begin(), ratio[o].end()), std::sort(gbs[o].begin(), gbs[o].end());
      const size_t h = ratio[o].size();
      std::printf(
          "| gemm %s from memory, %s | m=1, %zu x n=%ld k=%ld, group %ld | | %.1f GB/s of weights | read probed "
          "around each pass | %.2f (quartiles %.2f %.2f) |\n",
          name, (o ? !pf : pf) ? "sw prefetch" : "hw prefetch only", mats.size(), long(n), long(k), long(group),
          gbs[o][h / 2], ratio[o][h / 2], ratio[o][h / 4], ratio[o][h * 3 / 4]);
    }
    const Mat small = make(dt, sd, 256, 99);
    const double sbytes = double(quant::row_bytes(dt, k) * 256);
    const double t = median_seconds([&] {
                       for (int i = 0; i < 100; ++i) cpu.gemm({x.data(), k, small.w, false, y.data(), 256, 1, 256, k});
                     }) /
                     100;
    std::printf("| gemm %s in L2 | m=1, n=256 k=%ld | %.3f ms | %.1f GB/s of weights | | |\n", name, long(k), t * 1e3,
                sbytes / t / 1e9);
  }
}

// The fp32 FMA peak of all threads in GFLOP/s: independent FMA chains in registers (16 lanes x
// 16 chains per thread), what the cores can do at all.
double fma_peak() {
  typedef float v16 __attribute__((vector_size(64)));
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const int64_t iters = int64_t(1) << 22;
    auto t0 = std::chrono::steady_clock::now();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      v16 a[16], b = v16{} + 1.0000001f, c = v16{} + 1e-7f;
      for (int i = 0; i < 16; ++i) a[i] = v16{} + float(i);
      for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = a[i] * b + c;
      for (int i = 0; i < 16; ++i) sink += a[i][0];
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sink == 12345.0f) std::puts("");
    best = std::max(best, double(iters) * 16 * 16 * 2 * omp_get_max_threads() / dt / 1e9);
  }
  return best;
}

// The AMX-BF16 tile peak of all threads in bf16 GFLOP/s (0 without AMX).
double amx_peak() {
  if (!cpu::amx::available()) return 0;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double sum = 0;
#pragma omp parallel reduction(+ : sum)
    sum += cpu::amx::tile_macs_per_second(int64_t(1) << 18);
    best = std::max(best, 2 * sum / 1e9);
  }
  return best;
}

// The BF16 gemm paths worth timing here (not the emulation).
std::vector<std::string> bench_paths() {
  std::vector<std::string> v;
  for (const std::string& p : cpu::fast::gemm_paths())
    if (p != "amx-emulated") v.push_back(p);
  return v;
}

// Prefill cost per FLOP against the row count at hidden 6144 (q_a-like [2048, 6144] and
// o_proj-like [6144, 2048]): GFLOP/s, its share of the FMA peak and its ratio to 64 rows.
void prefill_sweep(Backend& cpu, bool quick) {
  const double peak = fma_peak(), tiles = amx_peak();
  std::printf("\nprefill gemm, BF16 weights, against the row count (fp32 FMA peak %.0f GFLOP/s", peak);
  if (tiles > 0)
    std::printf("; AMX-BF16 tile peak %.0f GFLOP/s, %.0f for fp32 activations as 3 terms", tiles, tiles / 3);
  std::printf(", same run):\n\n");
  std::printf("| path | n x k | rows | time | GFLOP/s | of its peak | vs 64 rows |\n|---|---|---|---|---|---|---|\n");
  for (const std::string& path : bench_paths()) {
    cpu::fast::set_gemm_path(path);
    const double path_peak = path == "amx" ? tiles / 3 : peak;
    for (auto [n, k] : {std::pair<int64_t, int64_t>{2048, 6144}, {6144, 2048}}) {
      auto wf = random_floats(size_t(n * k), 2);
      std::vector<uint16_t> wb(wf.size());
      for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
      const Weight w = cpu.upload_gemm_matrix(Weight{wb.data(), DType::BF16, n, k, k}, wb.size() * 2);
      double first = 0;
      for (int64_t m : {int64_t(64), int64_t(512), int64_t(2048), int64_t(8192)}) {
        if (quick && m > 2048) break;
        auto x = random_floats(size_t(m * k), 1);
        std::vector<float> y(size_t(m * n));
        GemmParams p;
        p.x = x.data(), p.ldx = k, p.w = w;
        p.y = y.data(), p.ldy = n, p.m = m, p.n = n, p.k = k;
        const double t = median_seconds([&] { cpu.gemm(p); });
        const double gf = 2.0 * double(m) * double(n) * double(k) / t / 1e9;
        if (m == 64) first = gf;
        std::printf("| %s | %ld x %ld | %ld | %.2f ms | %.1f | %.0f%% | %.2f |\n", path.c_str(), long(n), long(k),
                    long(m), t * 1e3, gf, 100 * gf / path_peak, gf / first);
      }
    }
  }
  cpu::fast::set_gemm_path("auto");
}

void attention_rows(Backend& cpu, bool quick) {
  {  // decode: one query row, 64 heads, latent cache of T tokens (576 = 512 + 64)
    const int64_t H = 64, T = quick ? 1024 : 4096, R = 512, P = 64, D = R + P;
    auto q = random_floats(size_t(H * D), 3), cache = random_floats(size_t(T * D), 4);
    std::vector<float> out(size_t(H * R));
    std::vector<int32_t> q_pos = {int32_t(T - 1)}, topk(2048);
    for (size_t i = 0; i < topk.size(); ++i) topk[i] = int32_t(i * T / topk.size());
    MlaDecodeParams p;
    p.q_lat = q.data(), p.cache = cache.data(), p.q_pos = q_pos.data(), p.out_lat = out.data();
    p.s = 1, p.t = T, p.n_heads = H, p.kv_lora_rank = R, p.qk_rope_head_dim = P, p.scale = 0.0625f;
    for (bool sparse : {false, true}) {
      p.topk = sparse ? topk.data() : nullptr;
      p.topk_len = sparse ? int64_t(topk.size()) : 0;
      int64_t keys = sparse ? std::min<int64_t>(int64_t(topk.size()), T) : T;  // distinct keys
      double t = median_seconds([&] { cpu.mla_decode(p); });
      double flops = 2.0 * double(H) * double(keys) * double(D + R);
      std::printf("| mla_decode%s | s=1 t=%ld heads=%ld | %.3f ms | %.1f GFLOP/s | | |\n", sparse ? " top-2048" : "",
                  long(T), long(H), t * 1e3, flops / t / 1e9);
    }
  }
  {  // prefill: causal, 192 + 64 query/key dims, 256 value dims
    const int64_t S = quick ? 256 : 1024, H = 16, N = 192, P = 64, V = 256;
    auto q = random_floats(size_t(S * H * (N + P)), 5), kv = random_floats(size_t(S * H * (N + V)), 6);
    auto k_pe = random_floats(size_t(S * P), 7);
    std::vector<float> out(size_t(S * H * V));
    std::vector<int32_t> q_pos(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) q_pos[size_t(i)] = int32_t(i);
    MlaPrefillParams p;
    p.q = q.data(), p.kv = kv.data(), p.k_pe = k_pe.data(), p.ld_k_pe = P, p.q_pos = q_pos.data();
    p.out = out.data(), p.s = S, p.t = S, p.n_heads = H, p.qk_nope_head_dim = N;
    p.qk_rope_head_dim = P, p.v_head_dim = V, p.scale = 0.0625f;
    double t = median_seconds([&] { cpu.mla_prefill(p); });
    double flops = 2.0 * double(H) * (double(S) * double(S + 1) / 2) * double(N + P + V);
    std::printf("| mla_prefill causal | s=t=%ld heads=%ld | %.3f ms | %.1f GFLOP/s | | |\n", long(S), long(H), t * 1e3,
                flops / t / 1e9);
  }
  {  // indexer: 32 heads of 128, causal, then top-k over the scores
    const int64_t S = quick ? 256 : 1024, T = S, H = 32, D = 128, K = 2048;
    auto q = random_floats(size_t(S * H * D), 8), w = random_floats(size_t(S * H), 9);
    auto k = random_floats(size_t(T * D), 10);
    std::vector<float> scores(size_t(S * T));
    std::vector<int32_t> q_pos(static_cast<size_t>(S)), idx(static_cast<size_t>(S * K));
    for (int64_t i = 0; i < S; ++i) q_pos[size_t(i)] = int32_t(i);
    IndexerScoresParams p;
    p.q = q.data(), p.weights = w.data(), p.k = k.data(), p.q_pos = q_pos.data();
    p.scores = scores.data(), p.s = S, p.t = T, p.n_heads = H, p.head_dim = D, p.ld_scores = T;
    double t = median_seconds([&] { cpu.indexer_scores(p); });
    double flops = 2.0 * double(H) * double(D) * (double(S) * double(S + 1) / 2);
    std::printf("| indexer_scores causal | s=t=%ld heads=%ld dim=%ld | %.3f ms | %.1f GFLOP/s | | |\n", long(S),
                long(H), long(D), t * 1e3, flops / t / 1e9);
    TopkParams tp;
    tp.scores = scores.data(), tp.rows = S, tp.cols = T, tp.ld = T, tp.k = K, tp.indices = idx.data();
    t = median_seconds([&] { cpu.topk(tp); });
    std::printf("| topk | rows=%ld cols=%ld k=%ld | %.3f ms | | | |\n", long(S), long(T), long(K), t * 1e3);
  }
  {  // decode: one row against a long paged cache (speed-a's indexer, 8 heads of 64, top-256),
     // the indexer keys read at the bandwidth of their bytes
    const int64_t T = 16384, H = 8, D = 64, K = 256, B = 64;
    auto q = random_floats(size_t(H * D), 11), w = random_floats(size_t(H), 12);
    auto k = random_floats(size_t(T * D), 13);
    std::vector<int32_t> table(size_t(T / B)), q_pos = {int32_t(T - 1)}, idx(static_cast<size_t>(K));
    for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t((i * 37) % table.size());  // shuffled blocks
    std::vector<float> scores(static_cast<size_t>(T));
    IndexerScoresParams p;
    p.q = q.data(), p.weights = w.data(), p.k = k.data(), p.q_pos = q_pos.data();
    p.scores = scores.data(), p.s = 1, p.t = T, p.n_heads = H, p.head_dim = D, p.ld_scores = T;
    p.pages = KeyPages{table.data(), 0, B, DType::F32, cpu.index_key_tiles()};  // the runtime's layout
    double t = median_seconds([&] { cpu.indexer_scores(p); });
    std::printf("| indexer_scores decode | s=1 t=%ld heads=%ld dim=%ld paged%s | %.3f ms | %.1f GB/s of keys | | |\n",
                long(T), long(H), long(D), p.pages.tiled ? ", tiles" : "", t * 1e3, double(T * D * 4) / t / 1e9);
    // top-k of 16 different score rows in turn (the same row again would let the branch predictors
    // learn its comparisons: a warm repeat took half the time of a row it had not seen).
    const int64_t R = 16;
    std::vector<float> rows(size_t(R * T));
    for (int64_t r = 0; r < R; ++r) {
      q = random_floats(size_t(H * D), 200 + uint64_t(r));
      p.q = q.data(), p.scores = rows.data() + r * T;
      cpu.indexer_scores(p);
    }
    t = median_seconds([&] {
          for (int64_t r = 0; r < R; ++r) {
            TopkParams tp;
            tp.scores = rows.data() + r * T, tp.rows = 1, tp.cols = T, tp.ld = T, tp.k = K, tp.indices = idx.data();
            cpu.topk(tp);
          }
        }) /
        double(R);
    std::printf("| topk decode, a new row each call | rows=1 cols=%ld k=%ld | %.3f ms | | | |\n", long(T), long(K),
                t * 1e3);
  }
  {  // decode after 16k tokens with the caches in memory, as in the model: speed-a's layers (latent
     // 256 + 32, 16 heads, top-256; indexer 8 x 64), 24 layers' caches (550 MB, past any L3) visited
     // in turn, each the indexer's scan over all keys and attention over 256 scattered keys
    const int64_t T = 16384, H = 16, R = 256, P = 32, D = R + P, IH = 8, ID = 64, K = 256, B = 64, L = 24;
    std::vector<std::vector<float>> lat, ik;
    for (int64_t l = 0; l < L; ++l)
      lat.push_back(random_floats(size_t(T * D), 40 + uint64_t(l))),
          ik.push_back(random_floats(size_t(T * ID), 80 + uint64_t(l)));
    auto q = random_floats(size_t(H * D), 14), qi = random_floats(size_t(IH * ID), 15),
         w = random_floats(size_t(IH), 16);
    std::vector<int32_t> table(size_t(T / B)), q_pos = {int32_t(T - 1)}, sel(static_cast<size_t>(K));
    for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
    for (size_t i = 0; i < sel.size(); ++i) sel[i] = int32_t((i * 2654435761u) % uint64_t(T));
    std::vector<float> scores(static_cast<size_t>(T)), out(size_t(H * R));
    const auto per_layer = [&](auto op) {
      return median_seconds([&] {
               for (int64_t l = 0; l < L; ++l) op(l);
             }) /
             double(L);
    };
    double t = per_layer([&](int64_t l) {
      IndexerScoresParams p;
      p.q = qi.data(), p.weights = w.data(), p.k = ik[size_t(l)].data(), p.q_pos = q_pos.data();
      p.scores = scores.data(), p.s = 1, p.t = T, p.n_heads = IH, p.head_dim = ID, p.ld_scores = T;
      p.pages = KeyPages{table.data(), 0, B, DType::F32, cpu.index_key_tiles()};
      cpu.indexer_scores(p);
    });
    std::printf(
        "| indexer_scores decode, keys from memory | s=1 t=%ld heads=%ld dim=%ld%s, %ld layers | %.3f ms | %.1f GB/s "
        "of keys | | |\n",
        long(T), long(IH), long(ID), cpu.index_key_tiles() ? " tiles" : "", long(L), t * 1e3,
        double(T * ID * 4) / t / 1e9);
    t = per_layer([&](int64_t l) {
      MlaDecodeParams p;
      p.q_lat = q.data(), p.cache = lat[size_t(l)].data(), p.q_pos = q_pos.data(), p.topk = sel.data(), p.topk_len = K;
      p.out_lat = out.data(), p.s = 1, p.t = T, p.n_heads = H, p.kv_lora_rank = R, p.qk_rope_head_dim = P;
      p.scale = 0.0625f, p.pages = KeyPages{table.data(), 0, B, DType::F32};
      cpu.mla_decode(p);
    });
    std::printf("| mla_decode top-256, cache from memory | s=1 t=%ld heads=%ld %ld+%ld, %ld layers | %.3f ms | | | |\n",
                long(T), long(H), long(R), long(P), long(L), t * 1e3);
    std::vector<std::vector<uint16_t>> lat16(static_cast<size_t>(L));  // the same caches in bf16
    for (int64_t l = 0; l < L; ++l) {
      for (float x : lat[size_t(l)]) lat16[size_t(l)].push_back(f32_to_bf16(x));
      std::vector<float>().swap(lat[size_t(l)]);
    }
    t = per_layer([&](int64_t l) {
      MlaDecodeParams p;
      p.q_lat = q.data(), p.cache = reinterpret_cast<const float*>(lat16[size_t(l)].data()), p.q_pos = q_pos.data();
      p.topk = sel.data(), p.topk_len = K, p.out_lat = out.data(), p.s = 1, p.t = T, p.n_heads = H;
      p.kv_lora_rank = R, p.qk_rope_head_dim = P, p.scale = 0.0625f,
      p.pages = KeyPages{table.data(), 0, B, DType::BF16};
      cpu.mla_decode(p);
    });
    std::printf(
        "| mla_decode top-256, bf16 cache from memory | s=1 t=%ld heads=%ld %ld+%ld, %ld layers | %.3f ms | | | |\n",
        long(T), long(H), long(R), long(P), long(L), t * 1e3);
  }
  {  // decode's weight absorption (speed-a: 16 heads, W_UK and W_UV [64, 256] BF16 per head, rows of
     // kv_b_proj as stored): q_lat = q_nope W_UK (trans_w), o = W_UV o_lat, one batch of 16 gemms
     // each, as the model runs them; 48 layers' kv_b_proj (48 MiB) so that W comes from memory
    const int64_t NH = 16, dn = 64, dv = 64, R = 256, DQ = 96, LAT = 288, L = 48;
    std::vector<std::vector<uint16_t>> kvb(static_cast<size_t>(L));
    for (int64_t l = 0; l < L; ++l) {
      const std::vector<float> v = random_floats(size_t(NH * (dn + dv) * R), 300 + uint64_t(l));
      for (float x : v) kvb[size_t(l)].push_back(f32_to_bf16(x));
    }
    const std::vector<float> q = random_floats(size_t(NH * DQ), 19), o_lat = random_floats(size_t(NH * R), 20);
    std::vector<float> q_lat(size_t(NH * LAT)), o(size_t(NH * dv));
    for (bool uk : {true, false}) {
      const double t =
          median_seconds([&] {
            for (int64_t l = 0; l < L; ++l) {
              const Weight w{kvb[size_t(l)].data(), DType::BF16, NH * (dn + dv), R, R};
              std::vector<GemmParams> ps;
              for (int64_t h = 0; h < NH; ++h)
                ps.push_back(uk ? GemmParams{q.data() + h * DQ, NH * DQ, w.slice_rows(h * (dn + dv), dn), true,
                                             q_lat.data() + h * LAT, NH * LAT, 1, R, dn}
                                : GemmParams{o_lat.data() + h * R, NH * R, w.slice_rows(h * (dn + dv) + dn, dv), false,
                                             o.data() + h * dv, NH * dv, 1, dv, R});
              cpu.gemm_batch(ps);
            }
          }) /
          double(L);
      std::printf(
          "| %s absorption, W from memory | 16 heads of [64, 256] BF16, %ld layers | %.1f us per layer | %.1f GB/s of "
          "W | | |\n",
          uk ? "W_UK (q_absorb, trans_w)" : "W_UV (v_absorb)", long(L), t * 1e6, double(NH * 64 * R * 2) / t / 1e9);
    }
  }
  {  // prefill's sparse rows (speed-a, a 512-token prompt): rows 256..511, each its own 256 of its
     // earlier positions, attention in the absorbed form
    const int64_t S = 256, T = 512, H = 16, R = 256, P = 32, D = R + P, K = 256;
    auto cache = random_floats(size_t(T * D), 17), q = random_floats(size_t(S * H * D), 18);
    std::vector<int32_t> q_pos(static_cast<size_t>(S)), sel(static_cast<size_t>(S * K));
    for (int64_t i = 0; i < S; ++i) {
      q_pos[size_t(i)] = int32_t(T - S + i);
      for (int64_t j = 0; j < K; ++j)
        sel[size_t(i * K + j)] = int32_t((uint64_t(j) * 2654435761u + uint64_t(i)) % uint64_t(q_pos[size_t(i)] + 1));
    }
    std::vector<float> out(size_t(S * H * R));
    MlaDecodeParams p;
    p.q_lat = q.data(), p.cache = cache.data(), p.q_pos = q_pos.data(), p.topk = sel.data(), p.topk_len = K;
    p.out_lat = out.data(), p.s = S, p.t = T, p.n_heads = H, p.kv_lora_rank = R, p.qk_rope_head_dim = P,
    p.scale = 0.0625f;
    const double t = median_seconds([&] { cpu.mla_decode(p); });
    std::printf("| mla_decode, prefill's sparse rows | s=%ld t=%ld heads=%ld top-%ld | %.3f ms | | | |\n", long(S),
                long(T), long(H), long(K), t * 1e3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i], next = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--reps" && i + 1 < argc)
      g_reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--quick")
      quick = true;
    else if (a == "--only" &&
             (next == "decode" || next == "experts" || next == "attention" || next == "quant" || next == "prefill"))
      only = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: bench_kernels [--reps N] [--quick] [--only decode|experts|attention|quant|prefill]\n");
      return 2;
    }
  }
  auto cpu = make_cpu_backend();
  std::string why;
  cpu::amx::available(&why);
  std::printf("threads: %d, median of %d runs; BF16 gemm paths: fp32%s (default: %s)\n\n", omp_get_max_threads(),
              g_reps, why.empty() ? ", amx" : (" (no amx: " + why + ")").c_str(), cpu::fast::gemm_path().c_str());
  const double bw = read_bandwidth();
  std::printf("| op | shape | time | rate | yardstick | ratio |\n|---|---|---|---|---|---|\n");
  if (only == "decode") {
    decode_stream_rows(*cpu, quick ? 5 : 15);
    expert_stream_rows(*cpu, quick ? 5 : 15);
    return 0;
  }
  if (only == "experts") {
    expert_stream_rows(*cpu, quick ? 5 : 15);
    return 0;
  }
  if (only == "quant") {
    quant_stream_rows(*cpu, quick ? 5 : 15);
    return 0;
  }
  if (only == "attention") {
    attention_rows(*cpu, quick);
    return 0;
  }
  if (only == "prefill") {
    prefill_sweep(*cpu, quick);
    return 0;
  }
  for (const std::string& path : bench_paths()) {  // BF16 rows on each gemm path
    cpu::fast::set_gemm_path(path);
    std::printf("| (gemm path: %s) | | | | | |\n", path.c_str());
    gemm_row(1, 2048, 2048, false, *cpu, bw);
    gemm_row(1, 6144, quick ? 2048 : 6144, false, *cpu, bw);
    gemm_row(512, 2048, 2048, false, *cpu, bw);
    if (!quick) gemm_row(512, 6144, 2048, false, *cpu, bw);
    gemm_row(64, 2048, 2048, false, *cpu, bw);
  }
  decode_stream_rows(*cpu, quick ? 5 : 15);  // (sets each layout's path)
  expert_stream_rows(*cpu, quick ? 5 : 15);
  cpu::fast::set_gemm_path("auto");
  quant_stream_rows(*cpu, quick ? 5 : 15);
  gemm_row(512, 512, 192, true, *cpu, bw);
  attention_rows(*cpu, quick);
  prefill_sweep(*cpu, quick);
  return 0;
}
