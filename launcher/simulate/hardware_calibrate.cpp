// `glm5 simulate --calibrate`: measures this CPU with the CPU backend's own kernels, so that the
// simulator's rates are the ones the model's forward pass gets here (hardware.h lists the keys).
// Shapes are GLM-5's per-rank attention dims and MoE-sized weight matrices; each timing is the
// best of several repeats.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#include "kernels/core/check.h"
#include "kernels/ops.h"
#include "launcher/simulate/hardware.h"

namespace glm5::launcher {

namespace {

// Seconds of one call of f: the median of `rounds` rounds, each repeating f for >= 0.3 s. The
// median, not the best: the simulator predicts runs of minutes on machines whose speed drifts.
double median_seconds(const std::function<void()>& f, int rounds = 5) {
  using Clock = std::chrono::steady_clock;
  f();  // warm up: pages touched, threads started
  std::vector<double> per_call;
  for (int r = 0; r < rounds; ++r) {
    int n = 0;
    const auto t0 = Clock::now();
    double el = 0;
    do {
      f();
      ++n;
      el = std::chrono::duration<double>(Clock::now() - t0).count();
    } while (el < 0.3);
    per_call.push_back(el / n);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      if (c != std::string::npos) return line.substr(line.find_first_not_of(' ', c + 1));
    }
  return "unknown CPU";
}

struct Bf16Matrix {
  std::vector<uint16_t> v;
  kernels::Weight w;
  Bf16Matrix(int64_t rows, int64_t cols) : v(size_t(rows * cols), 0x3c24) {  // bf16 0.01
    w.data = v.data();
    w.dtype = DType::BF16;
    w.rows = rows, w.cols = cols, w.ld = cols;
  }
};

// FLOP/s of a GEMM of `m` rows x 2048 x 2048 BF16 weights (256: prefill-sized, 16: decode-sized).
// The weight is laid out as the backend holds a model's matrices (upload_gemm_matrix: the layout its
// gemm path reads, e.g. bf16 pairs in precision fast).
double gemm_rate(kernels::Backend& be, int64_t m) {
  const int64_t n = 2048, k = 2048;
  Bf16Matrix W(n, k);
  const kernels::Weight w = be.upload_gemm_matrix(W.w, size_t(n * k) * 2);
  std::vector<float> x(size_t(m * k), 0.5f), y(size_t(m * n));
  const double s = median_seconds([&] { be.gemm({x.data(), k, w, false, y.data(), n, m, n, k}); });
  return 2.0 * double(m * n * k) / s;
}

// Bytes/s of weight streaming as decode does it: routed experts of hidden x moe_intermediate
// (gate and up [I, H], down [H, I], BF16) times 2 rows each, in one batch, as many experts as
// make >= 256 MiB (far beyond any cache).
double stream_rate(kernels::Backend& be, int64_t H, int64_t I) {
  const int64_t m = 2, per_expert = 3 * H * I * 2;
  const int64_t experts = std::max<int64_t>(1, ((int64_t(256) << 20) + per_expert - 1) / per_expert);
  std::vector<Bf16Matrix> W;
  W.reserve(size_t(3 * experts));
  std::vector<float> x(size_t(m * std::max(H, I)), 0.5f), y(size_t(3 * experts * m * std::max(H, I)));
  std::vector<kernels::GemmParams> batch;
  for (int64_t e = 0; e < 3 * experts; ++e) {
    const bool down = e % 3 == 2;
    const int64_t n = down ? H : I, k = down ? I : H;
    W.emplace_back(n, k);
    batch.push_back({x.data(), k, W.back().w, false, y.data() + e * m * std::max(H, I), n, m, n, k});
  }
  const double s = median_seconds([&] { be.gemm_batch(batch); }, 3);
  return double(experts * per_expert) / s;
}

}  // namespace

Hardware calibrate_cpu(int64_t hidden, int64_t moe_intermediate) {
  auto be = kernels::make_cpu_backend();
  auto fast = kernels::make_cpu_backend(kernels::Precision::kFast);
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  Hardware hw;
  hw.name = cpu_model();
  hw.kind = "cpu";
  hw.cores = cores;
  {
    std::ifstream f("/proc/meminfo");
    std::string key;
    double kb = 0;
    if (f >> key >> kb && key == "MemTotal:") hw.memory_gb = kb * 1024 / 1e9;
  }
  // Weight streaming of one core alone (one core cannot fill the memory system), then of all.
  omp_set_num_threads(1);
  hw.mem_bw_core = stream_rate(*be, hidden, moe_intermediate);
  omp_set_num_threads(cores);
  hw.mem_bw = std::max(hw.mem_bw_core, stream_rate(*be, hidden, moe_intermediate));
  // Compute rates per core while every core computes (what a run gets: its ranks keep all cores
  // busy; one core alone runs faster where cores share a physical core or a power budget).
  hw.gemm_flops = gemm_rate(*fast, 256) / cores;
  hw.gemm_flops_small = gemm_rate(*fast, 16) / cores;
  hw.exact_gemm_cost = std::max(1.0, hw.gemm_flops * cores / gemm_rate(*be, 256));
  // Indexer scores of 16 rows over 8192 keys (32 heads x 128), latent attention of 16 rows over
  // 2048 keys (16 heads x (512 + 64)), top-k 512 of 8192 scores.
  const int64_t S = 16, T = 8192, IH = 32, ID = 128;
  std::vector<float> q(size_t(S * IH * ID), 0.01f), wts(size_t(S * IH), 0.1f), keys(size_t(T * ID), 0.02f);
  std::vector<float> scores(size_t(S * T));
  std::vector<int32_t> pos(size_t(S), int32_t(T - 1));
  const double t_idx = median_seconds([&] {
    be->indexer_scores({q.data(), wts.data(), keys.data(), pos.data(), scores.data(), S, T, IH, ID, T, {}});
  });
  for (int64_t i = 0; i < S * T; ++i) scores[size_t(i)] = float((i * 2654435761u) % 1000003);
  const int64_t K = 512;
  std::vector<int32_t> sel(size_t(S * K));
  const double t_topk = median_seconds([&] { be->topk({scores.data(), S, T, T, K, sel.data()}); });
  hw.topk_rate = double(S * T) / t_topk / cores;
  const int64_t TA = 2048, NH = 16, R = 512, DR = 64, LAT = R + DR;
  std::vector<float> q_lat(size_t(S * NH * LAT), 0.01f), cache(size_t(TA * LAT), 0.02f), o_lat(size_t(S * NH * R));
  std::vector<int32_t> apos(size_t(S), int32_t(TA - 1));
  const double t_att = median_seconds([&] {
    be->mla_decode({q_lat.data(), cache.data(), apos.data(), nullptr, 0, o_lat.data(), S, TA, NH, R, DR, 0.05f, {}});
  });
  const double f_idx = 2.0 * double(S * T * IH * ID), f_att = 2.0 * double(S * TA * NH * (LAT + R));
  hw.attention_flops = (f_idx + f_att) / (t_idx + t_att) / cores;
  // One small kernel call (64 x 64 GEMV): the fixed cost of a parallel region.
  {
    std::vector<float> w(64 * 64, 0.1f), x(64, 1.0f), y(64);
    kernels::Weight W{w.data(), DType::F32, 64, 64, 64};
    hw.op_overhead_s = median_seconds([&] { be->gemm({x.data(), 64, W, false, y.data(), 64, 1, 64, 64}); });
  }
  // The shared-memory link between ranks of this host: one core's memcpy of 64 MiB.
  {
    std::vector<char> a(64 << 20, 1), b(64 << 20);
    hw.intra_node_bw = double(a.size()) / median_seconds([&] { std::memcpy(b.data(), a.data(), a.size()); }, 3);
  }
  hw.intra_node_latency_s = 20e-6;  // MPI over shared memory with the engine's polling back-off
  hw.inter_node_bw = 1.25e9;        // 10 GbE between hosts (not measured: one host here)
  hw.inter_node_latency_s = 50e-6;
  return hw;
}

}  // namespace glm5::launcher
