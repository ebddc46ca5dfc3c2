// CUDA kernel benchmark (not a test), for a GPU machine: each figure beside a ceiling measured in
// the same run. Uses the Backend interface only (no CUDA headers), so it builds everywhere and
// exits with a message where no GPU is usable. Wall time of N calls after a warm-up, then the
// backend's synchronize().
//   HBM:        the faster of a 4 GiB device-to-device copy and a 2 GiB y += x (bytes read +
//               written per second): the ceiling.
//   mla_decode: GLM-5 dims (64 heads, kv_lora 512 + rope 64, BF16 cache), 2048 selected keys per
//               row from a paged pool, each row its own sequence of 32768 keys (no L2 reuse): key
//               bytes read per second vs HBM, on the SIMT kernel and the tensor-core one, with the
//               rate the tensor-core kernel's MMAs would have at that time.
//   indexer:    indexer_scores (32 heads x 128) of R rows over T cached keys, then top-2048:
//               key + score bytes per second vs HBM (and each op alone), f32 and bf16 keys, SIMT
//               and tensor-core kernels.
//   expert GEMM: y = x W^T with GLM-5's expert shape (W [2048, 6144] BF16) at m = 1 .. 4096 on the
//               default path (x split into 3 bf16 terms, exact to fp32) against one bf16 term
//               (GLM5_CUDA_GEMM_TERMS=1: a plain cuBLASLt bf16 GEMM on the same path): the cost of
//               exactness; the fixed 64-row chunked path; and the algorithm pinned at m = 16 and
//               64 instead of 512 (GLM5_CUDA_GEMM_ALGO_ROWS: which suits decode's small m).
//   expert layer: 64 experts' gate GEMMs (GLM-5's shape) at 1..128 rows each in precision fast,
//               BF16 and FP8 weights: one call per expert, one grouped launch
//               (GLM5_CUDA_EXPERT_GEMM=grouped), and one plain bf16 cuBLASLt GEMM of all the rows
//               through one weight (the same FLOPs): the ceiling.
//   bench_cuda [--reps N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.h"

using namespace glm5;
using namespace glm5::kernels;

namespace {

int g_reps = 20;

double seconds_per_call(Backend& be, const std::function<void()>& f) {
  f();
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < g_reps; ++r) f();
  be.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / g_reps;
}

// Device memory filled with a repeated pseudo-random pattern (values in [-1, 1]).
template <class T>
T* device_fill(Backend& be, size_t n) {
  T* p = static_cast<T*>(be.alloc(n * sizeof(T)));
  const size_t chunk = std::min<size_t>(n, size_t(16) << 20);
  std::vector<T> h(chunk);
  uint32_t s = 7;
  for (T& v : h) {
    s = s * 1664525u + 1013904223u;
    const float f = float(int32_t(s >> 8) % 2001 - 1000) / 1000.0f;
    if constexpr (sizeof(T) == 2) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      v = T(u >> 16);
    } else {
      v = T(f);
    }
  }
  for (size_t i = 0; i < n; i += chunk) be.to_device(p + i, h.data(), std::min(chunk, n - i) * sizeof(T));
  return p;
}

// The HBM ceiling: the faster of a 4 GiB device-to-device copy (copy_2d of one contiguous run:
// cudaMemcpyAsync) and y += x over 2 GiB vectors (add: 2 reads, 1 write), bytes read + written.
double hbm_gbs(Backend& be) {
  const size_t bytes = size_t(4) << 30;
  char* a = static_cast<char*>(be.alloc(bytes));
  char* b = static_cast<char*>(be.alloc(bytes));
  const int64_t cols = int64_t(1) << 20;  // copy_2d in F32 elements: rows of 4 MiB
  const int64_t rows = int64_t(bytes / 4 / size_t(cols));
  const double t = seconds_per_call(be, [&] { be.copy_2d({a, cols, b, cols, rows, cols}); });
  const int64_t n = int64_t(bytes / 8);  // floats per vector: two vectors in each buffer's first half
  const double t_add = seconds_per_call(be, [&] {
    be.add({reinterpret_cast<const float*>(a), reinterpret_cast<float*>(b), n});
  });
  be.free(a);
  be.free(b);
  const double copy = 2.0 * double(bytes) / t / 1e9, add = 3.0 * double(n) * 4 / t_add / 1e9;
  std::printf("HBM probes: copy %.0f GB/s, add %.0f GB/s (read + write)\n", copy, add);
  return std::max(copy, add);
}

// `kernel`: the one asked for; each row names the one that ran (Backend::kernel_ran), so a row is
// never labelled "tensor" when a SIMT fallback computed it.
void bench_mla_decode(Backend& be, double hbm, const char* kernel) {
  const int64_t H = 64, R = 512, dr = 64, LAT = R + dr, T = 32768, topk = 2048, B = 64;
  std::printf(
      "\n| mla_decode (asked: %s) rows | kernel that ran | us per call | key bytes | GB/s | of HBM | as bf16 MMA "
      "TFLOP/s (3 terms) |\n|---|---|---|---|---|---|---|\n",
      kernel);
  for (int64_t s : {1, 8, 32, 128}) {
    const int64_t per = T / B;  // blocks per row: each row its own sequence
    uint16_t* pool = device_fill<uint16_t>(be, size_t(s * T * LAT));
    std::vector<int32_t> table(size_t(s * per)), qpos(size_t(s), int32_t(T - 1)), sel(size_t(s * topk));
    for (int64_t i = 0; i < s * per; ++i) table[size_t(i)] = int32_t(i);
    for (int64_t i = 0; i < s; ++i)
      for (int64_t j = 0; j < topk; ++j) sel[size_t(i * topk + j)] = int32_t(j * (T / topk) + (i % 7));
    auto up = [&](const std::vector<int32_t>& v) {
      int32_t* d = static_cast<int32_t*>(be.alloc(v.size() * 4));
      be.to_device(d, v.data(), v.size() * 4);
      return d;
    };
    int32_t *d_table = up(table), *d_qpos = up(qpos), *d_sel = up(sel);
    float* q = device_fill<float>(be, size_t(s * H * LAT));
    float* out = static_cast<float*>(be.alloc(size_t(s * H * R) * 4));
    const MlaDecodeParams p{q,     reinterpret_cast<const float*>(pool),  d_qpos, d_sel, topk, out, s, T, H, R, dr,
                            0.05f, KeyPages{d_table, per, B, DType::BF16}};
    const double t = seconds_per_call(be, [&] { be.mla_decode(p); });
    const double bytes = double(s * topk * LAT * 2);
    // q k^T over dk and p V over R, each with q / p split into 3 bf16 terms (the tensor-core kernel)
    const double flops = 3.0 * 2.0 * double(s * topk * H) * double(LAT + R);
    std::printf("| %lld | %s | %.1f | %.1f MB | %.0f | %.0f %% | %.0f |\n", (long long)s,
                be.kernel_ran("mla_decode").c_str(), t * 1e6, bytes / 1e6, bytes / t / 1e9, 100 * bytes / t / 1e9 / hbm,
                flops / t / 1e12);
    for (void* v : {static_cast<void*>(pool), static_cast<void*>(d_table), static_cast<void*>(d_qpos),
                    static_cast<void*>(d_sel), static_cast<void*>(q), static_cast<void*>(out)})
      be.free(v);
  }
}

// keys: F32 or BF16 (then `kernel` says which kernel the backend was made with).
void bench_indexer(Backend& be, double hbm, DType keys, const char* kernel) {
  const int64_t IH = 32, ID = 128, topk = 2048, es = keys == DType::BF16 ? 2 : 4;
  std::printf(
      "\n| indexer (%s keys, asked: %s) + top-k keys | rows | kernel that ran | us per call | bytes | GB/s | of HBM | "
      "indexer alone us | top-k alone us |\n|---|---|---|---|---|---|---|---|---|\n",
      keys == DType::BF16 ? "bf16" : "f32", kernel);
  const std::pair<int64_t, int64_t> shapes[] = {{4, 32768}, {4, 131072}, {64, 32768}};  // rows, keys
  for (const auto& [S, T] : shapes) {
    void* k = keys == DType::BF16 ? static_cast<void*>(device_fill<uint16_t>(be, size_t(T * ID)))
                                  : static_cast<void*>(device_fill<float>(be, size_t(T * ID)));
    float* q = device_fill<float>(be, size_t(S * IH * ID));
    float* w = device_fill<float>(be, size_t(S * IH));
    std::vector<int32_t> qpos(size_t(S), int32_t(T - 1));
    int32_t* d_qpos = static_cast<int32_t*>(be.alloc(qpos.size() * 4));
    be.to_device(d_qpos, qpos.data(), qpos.size() * 4);
    float* scores = static_cast<float*>(be.alloc(size_t(S * T) * 4));
    int32_t* idx = static_cast<int32_t*>(be.alloc(size_t(S * topk) * 4));
    const IndexerScoresParams ip{q,  w, static_cast<const float*>(k), d_qpos, scores, S, T, IH,
                                 ID, T, KeyPages{nullptr, 0, 0, keys}};
    const double t = seconds_per_call(be, [&] {
      be.indexer_scores(ip);
      be.topk({scores, S, T, T, topk, idx});
    });
    const double t_idx = seconds_per_call(be, [&] { be.indexer_scores(ip); });
    const double t_topk = seconds_per_call(be, [&] { be.topk({scores, S, T, T, topk, idx}); });
    const double bytes = double(T * ID * es) + 2.0 * double(S * T * 4);  // keys, scores written and read
    std::printf("| %lld | %lld | %s | %.1f | %.1f MB | %.0f | %.0f %% | %.1f | %.1f |\n", (long long)T, (long long)S,
                be.kernel_ran("indexer_scores").c_str(), t * 1e6, bytes / 1e6, bytes / t / 1e9,
                100 * bytes / t / 1e9 / hbm, t_idx * 1e6, t_topk * 1e6);
    for (void* v : {k, static_cast<void*>(q), static_cast<void*>(w), static_cast<void*>(d_qpos),
                    static_cast<void*>(scores), static_cast<void*>(idx)})
      be.free(v);
  }
}

// One backend per GEMM setting (the backend reads GLM5_CUDA_* when it is made).
double gemm_seconds(const char* mode, const char* terms, int64_t m, const char* algo_rows = "512") {
  setenv("GLM5_CUDA_GEMM", mode, 1);
  setenv("GLM5_CUDA_GEMM_TERMS", terms, 1);
  setenv("GLM5_CUDA_GEMM_ALGO_ROWS", algo_rows, 1);
  auto be = make_cuda_backend(0);
  const int64_t n = 2048, k = 6144;
  uint16_t* wd = device_fill<uint16_t>(*be, size_t(n * k));
  float* x = device_fill<float>(*be, size_t(m * k));
  float* y = static_cast<float*>(be->alloc(size_t(m * n) * 4));
  GemmParams p{x, k, Weight{wd, DType::BF16, n, k, k}, false, y, n, m, n, k};
  const double t = seconds_per_call(*be, [&] { be->gemm(p); });
  be->free(wd);
  be->free(x);
  be->free(y);
  return t;
}

void bench_expert_gemm() {
  std::printf(
      "\n| expert GEMM m | exact (3 terms) us | one bf16 term us | one term / exact | chunked (3 terms) us "
      "| GFLOP/s exact | exact, algorithm pinned at m = 16 us | at m = 64 us |\n|---|---|---|---|---|---|---|---|\n");
  for (int64_t m : {1, 16, 128, 1024, 4096}) {
    const double exact = gemm_seconds("lt", "3", m), one = gemm_seconds("lt", "1", m),
                 chunked = gemm_seconds("chunked", "3", m), at16 = gemm_seconds("lt", "3", m, "16"),
                 at64 = gemm_seconds("lt", "3", m, "64");
    std::printf("| %lld | %.1f | %.1f | %.2fx | %.1f | %.0f | %.1f | %.1f |\n", (long long)m, exact * 1e6, one * 1e6,
                one / exact, chunked * 1e6, 2.0 * double(m) * 2048 * 6144 / exact / 1e9, at16 * 1e6, at64 * 1e6);
  }
  unsetenv("GLM5_CUDA_GEMM_ALGO_ROWS");
  unsetenv("GLM5_CUDA_GEMM");
  unsetenv("GLM5_CUDA_GEMM_TERMS");
}

// A MoE layer's gate GEMMs (E experts of GLM-5's shape, W_e [2048, 6144], r rows each) in precision
// fast: one call per expert (GLM5_CUDA_EXPERT_GEMM=each: cuBLASLt for BF16, the fused kernel for
// FP8), one grouped launch (=grouped), and, as the ceiling, one plain cuBLASLt bf16 GEMM of all
// E * r rows through one BF16 weight (the same FLOPs, 1/E of the weight bytes).
enum class ExpertWeights { kBf16, kFp8, kOneBf16 };
double expert_layer_seconds(const char* mode, int64_t experts, int64_t r, ExpertWeights wt, std::string* kernel) {
  setenv("GLM5_CUDA_EXPERT_GEMM", mode, 1);
  auto be = make_cuda_backend(0, Precision::kFast);
  unsetenv("GLM5_CUDA_EXPERT_GEMM");
  const int64_t n = 2048, k = 6144, m = experts * r, copies = wt == ExpertWeights::kOneBf16 ? 1 : experts;
  const bool fp8 = wt == ExpertWeights::kFp8;
  void* wd = nullptr;
  float* scales = nullptr;
  const int64_t sld = (k + 127) / 128, srows = (n + 127) / 128;
  if (fp8) {  // random E4M3 codes without NaN (no code has all of 0x7f), the same in every expert; scales 1/256
    std::vector<uint8_t> codes(size_t(n * k));
    uint32_t s = 11;
    for (uint8_t& c : codes) c = uint8_t(((s = s * 1664525u + 1013904223u) >> 24) & 0xf7u);
    wd = be->alloc(size_t(copies) * codes.size());
    for (int64_t e = 0; e < copies; ++e)
      be->to_device(static_cast<char*>(wd) + size_t(e) * codes.size(), codes.data(), codes.size());
    std::vector<float> sc(size_t(copies * srows * sld), 1.0f / 256);
    scales = static_cast<float*>(be->alloc(sc.size() * 4));
    be->to_device(scales, sc.data(), sc.size() * 4);
  } else {
    wd = device_fill<uint16_t>(*be, size_t(copies) * size_t(n * k));
  }
  float* x = device_fill<float>(*be, size_t(m * k));
  float* y = static_cast<float*>(be->alloc(size_t(m * n) * 4));
  std::vector<GemmParams> ps;
  for (int64_t e = 0; e < copies; ++e) {
    Weight w{static_cast<const char*>(wd) + size_t(e * n * k) * (fp8 ? 1 : 2), fp8 ? DType::F8_E4M3 : DType::BF16, n, k,
             k};
    if (fp8) {  // GLM-5-FP8's blocks: one F32 scale per 128 x 128
      w.scale = scales + e * srows * sld;
      w.scale_dtype = DType::F32;
      w.scale_ld = sld;
      w.group = w.scale_block_rows = 128;
    }
    const int64_t rows = copies == 1 ? m : r;
    ps.push_back({x + e * r * k, k, w, false, y + e * r * n, n, rows, n, k});
  }
  const double t = seconds_per_call(*be, [&] { copies == 1 ? be->gemm_batch(ps) : be->gemm_grouped(ps); });
  if (kernel) *kernel = be->kernel_ran("gemm_grouped");
  for (void* p : {wd, static_cast<void*>(scales), static_cast<void*>(x), static_cast<void*>(y)})
    if (p) be->free(p);
  return t;
}

void bench_expert_layer(double hbm) {
  std::printf(
      "\n| experts x rows (fast) | BF16: one call per expert us | grouped us | grouped kernel | plain bf16 GEMM of all "
      "rows us | plain / grouped | grouped weight GB/s | of HBM | FP8: one call per expert us | grouped us | FP8 "
      "grouped weight GB/s | FP8 grouped kernel |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const int64_t experts = 64;
  for (int64_t r : {1, 4, 32, 128}) {
    std::string kernel, kernel8;
    const double each = expert_layer_seconds("each", experts, r, ExpertWeights::kBf16, nullptr),
                 grouped = expert_layer_seconds("grouped", experts, r, ExpertWeights::kBf16, &kernel),
                 plain = expert_layer_seconds("each", experts, r, ExpertWeights::kOneBf16, nullptr),
                 each8 = expert_layer_seconds("each", experts, r, ExpertWeights::kFp8, nullptr),
                 grouped8 = expert_layer_seconds("grouped", experts, r, ExpertWeights::kFp8, &kernel8);
    if (kernel8.empty()) kernel8 = "(none: per-expert calls)";
    const double bytes = double(experts) * 2048 * 6144, gbs = 2 * bytes / grouped / 1e9;
    std::printf("| %lld x %lld | %.1f | %.1f | %s | %.1f | %.2f | %.0f | %.0f %% | %.1f | %.1f | %.0f | %s |\n",
                (long long)experts, (long long)r, each * 1e6, grouped * 1e6,
                kernel.empty() ? "(none: per-expert calls)" : kernel.c_str(), plain * 1e6, plain / grouped, gbs,
                100 * gbs / hbm, each8 * 1e6, grouped8 * 1e6, bytes / grouped8 / 1e9, kernel8.c_str());
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) g_reps = std::max(1, std::atoi(argv[++i]));
  if (!cuda_available()) {
    try {
      make_cuda_backend(0);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_cuda: no usable CUDA device: %s\n", e.what());
      return 2;
    }
  }
  try {
    setenv("GLM5_CUDA_MLA_DECODE", "simt", 1);  // the default kernels, whatever the caller exported
    setenv("GLM5_CUDA_INDEXER", "simt", 1);
    auto be = make_cuda_backend(0);
    const double hbm = hbm_gbs(*be);
    std::printf("HBM ceiling (the faster probe): %.0f GB/s\n", hbm);
    std::fflush(stdout);
    // Established kernels first (cuBLASLt GEMMs, the SIMT attention), so that their figures are in
    // even if a tensor-core kernel that never ran before faults (a sticky error ends the process).
    bench_expert_gemm();
    bench_mla_decode(*be, hbm, "simt");
    bench_indexer(*be, hbm, DType::F32, "simt");
    bench_indexer(*be, hbm, DType::BF16, "simt");
    std::fflush(stdout);
    {  // the tensor-core kernels (opt-in: GLM5_CUDA_MLA_DECODE / GLM5_CUDA_INDEXER=tensor, read when a
       // backend is made)
      setenv("GLM5_CUDA_MLA_DECODE", "tensor", 1);
      setenv("GLM5_CUDA_INDEXER", "tensor", 1);
      auto tensor = make_cuda_backend(0);
      unsetenv("GLM5_CUDA_MLA_DECODE");
      unsetenv("GLM5_CUDA_INDEXER");
      bench_mla_decode(*tensor, hbm, "tensor");
      bench_indexer(*tensor, hbm, DType::BF16, "tensor");
    }
    bench_expert_layer(hbm);  // the grouped kernel (never run before its first GPU session) last
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
