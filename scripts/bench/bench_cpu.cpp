// CPU forward-pass benchmark: decode tokens/s at batch 1 and prefill tokens/s, each next to the
// machine limit measured in the same run: for decode the memory read bandwidth (a STREAM-like
// sum: best of 5 over 1 GiB before loading, and, in a second decode phase, over 512 MiB between
// windows of 8 tokens, each window set against the probes around it), for prefill the float32
// FMA peak of all threads (independent FMA chains in registers: what the cores can do at all).
// Also peak RSS after loading vs weight bytes.
//   bench_cpu --model DIR [--prompt 512] [--decode 32] [--decode-tokens random|greedy] [--chunk 512]
//             [--beside N] [--prefill-reps 1] [--precision exact|fast]
// --prefill-reps N: the prefill is run once untimed, then N times timed (the median is reported), as
// llama-bench's pp warms up before its timed runs (-r of them): the first forward pass at a new
// size faults in its work buffers. 0: one timed pass from cold, for runs after decode figures only
// (a 16k prompt takes ~40 s per pass). (BENCHMARKS.md's pp figures before its seventh Zen 4
// sitting are cold single passes.)
// --beside N: a second sequence of N tokens shares the KV pool, and a third decode phase alternates
// steps between the two (decode pairs), so that decode after `prompt` tokens of context is set
// against decode after N in one process, step by step (the machine's speed drifts by more than the
// difference between two runs). (The long sequence's steps there start after its 2 x decode earlier
// steps, the short one's right after its prompt.)
// The prompt is prefilled in chunks of --chunk tokens (llama-bench's default ubatch is 512 too), so
// a long context is built as a server would build it, without one [prompt x prompt] score matrix.
// Decode feeds pseudo-random tokens by default, as llama-bench's tg test does: every step routes
// to its own experts, so none is still in the L3 from the step before. `greedy` feeds the model's
// own argmax, which on a random checkpoint repeats a few tokens and so reuses their experts.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cpu/amx_gemm.h"
#include "kernels/cpu/fast_ops.h"
#include "parallel/comm.h"
#include "runtime/engine/engine.h"
#include "runtime/model.h"
#include "runtime/name_table.h"
#include "runtime/safetensors.h"
#include "scripts/bench/read_probe.h"

using namespace glm5;
using Clock = std::chrono::steady_clock;

static double secs(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

static long rss_kb() {  // current resident set size
  std::ifstream f("/proc/self/statm");
  long pages = 0, res = 0;
  f >> pages >> res;
  return res * 4;
}

int main(int argc, char** argv) {
  std::string model_dir;
  int prompt = 512, decode = 32;
  std::string decode_tokens = "random";
  int chunk = 512, beside = 0, prefill_reps = 1;
  std::string precision = "exact";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--model" && i + 1 < argc)
      model_dir = argv[++i];
    else if (a == "--prompt" && i + 1 < argc)
      prompt = std::stoi(argv[++i]);
    else if (a == "--decode" && i + 1 < argc)
      decode = std::stoi(argv[++i]);
    else if (a == "--decode-tokens" && i + 1 < argc)
      decode_tokens = argv[++i];
    else if (a == "--chunk" && i + 1 < argc)
      chunk = std::stoi(argv[++i]);
    else if (a == "--beside" && i + 1 < argc)
      beside = std::stoi(argv[++i]);
    else if (a == "--prefill-reps" && i + 1 < argc)
      prefill_reps = std::stoi(argv[++i]);
    else if (a == "--precision" && i + 1 < argc)
      precision = argv[++i];
  }
  if (model_dir.empty() || prompt < 1 || decode < 1 || chunk < 1 || beside < 0 || prefill_reps < 0 ||
      (decode_tokens != "random" && decode_tokens != "greedy") || (precision != "exact" && precision != "fast")) {
    std::fprintf(stderr,
                 "usage: bench_cpu --model DIR [--prompt 512] [--decode 32] [--decode-tokens random|greedy]"
                 " [--chunk 512] [--beside N] [--prefill-reps 1] [--precision exact|fast]  (prompt, decode, chunk >= "
                 "1; N, reps >= 0)\n");
    return 2;
  }
  const int threads = omp_get_max_threads();

  // 1. Read bandwidth: best of 5 sums over 1 GiB (freed before loading: it would count against
  // the memory the weight copy checks for).
  double read_gbs = 0;
  {
    ReadProbe probe(size_t(1) << 30);
    for (int rep = 0; rep < 5; ++rep) read_gbs = std::max(read_gbs, probe.gbs());
  }
  // AMX peak, where the BF16 gemms run on the tiles: their rate, all threads (four independent
  // TDPBF16PS per round), as GFLOP/s of float32 activations (each costs three bf16 products).
  double amx_gflops = 0;
  if (glm5::kernels::cpu::fast::gemm_path() == "amx") {
    double macs = 0;
#pragma omp parallel reduction(+ : macs)
    macs += glm5::kernels::cpu::amx::tile_macs_per_second(int64_t(1) << 20);
    amx_gflops = 2 * macs / 3 / 1e9;
  }
  // 2. FMA peak: 12 independent 16-lane FMA chains per thread (enough to cover the latency of two
  // FMA pipes), all threads, best of 3. The compiler turns `a * b + c` into FMA instructions for
  // the native target; the result is the fp32 FLOP ceiling of this build on this CPU.
  double fma_gflops = 0;
  {
    typedef float v16 __attribute__((vector_size(64)));
    const int64_t iters = 20000000;
    for (int rep = 0; rep < 3; ++rep) {
      auto t = Clock::now();
      float sink = 0;
#pragma omp parallel reduction(+ : sink)
      {
        v16 acc[12];
        for (int j = 0; j < 12; ++j) acc[j] = v16{} + float(j + omp_get_thread_num());
        const v16 m = v16{} + 0.999999f, c = v16{} + 1e-7f;
        for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
          for (int j = 0; j < 12; ++j) acc[j] = acc[j] * m + c;
        for (int j = 0; j < 12; ++j) sink += acc[j][0];
      }
      const double dt = secs(t);
      if (sink == 12345.0f) std::puts("");
      fma_gflops = std::max(fma_gflops, 2.0 * 16 * 12 * double(iters) * threads / dt / 1e9);
    }
  }

  // 3. Load.
  long rss0 = rss_kb();
  auto t_load = Clock::now();
  runtime::ModelConfig cfg = runtime::load_config(model_dir);
  runtime::Checkpoint ckpt(model_dir);
  const kernels::Precision prec = kernels::parse_precision(precision, "--precision");
  auto be = kernels::make_cpu_backend(prec);
  auto self = parallel::make_self_comm();
  runtime::Model model(cfg, ckpt, *be, runtime::ModelShard{}, *self);
  const double load_s = secs(t_load);
  const double rss_load = double(rss_kb() - rss0) * 1024;
  const double weight_bytes = double(model.weight_bytes());

  // Weights touched per token, from the checkpoint's stored forms (name_table.h): everything but
  // the embedding table, with num_experts_per_tok of the routed experts per MoE layer. Bytes as
  // the model holds them (quantized matrices as stored, except kv_b_proj, dequantized to F32 at
  // load; indexer weights_proj and vectors in F32); parameters for the FLOP count.
  double touched = 0, touched_params = 0, lm_head_params = 0;
  for (const runtime::TensorSpec& spec : runtime::tensor_table(cfg)) {
    if (spec.role == runtime::Role::Embedding) continue;
    const runtime::StoredTensor st = runtime::resolve_tensor(ckpt, spec);
    double params = 1;
    for (int64_t d : spec.shape) params *= double(d);
    const bool f32_copy = spec.shape.size() == 1 || spec.role == runtime::Role::IndexerWeights ||
                          (quant::is_quantized(st.dtype) && spec.name.find("kv_b_proj") != std::string::npos);
    double bytes = f32_copy ? params * 4 : double(st.nbytes());
    if (spec.expert >= 0) {
      const double share = double(cfg.num_experts_per_tok) / double(cfg.n_routed_experts);
      bytes *= share;
      params *= share;
    }
    if (spec.role == runtime::Role::LmHead) lm_head_params = params;
    touched += bytes;
    touched_params += params;
  }

  // 4. Prefill `prompt` tokens (chunks of `chunk`), then `decode` steps at batch 1.
  std::vector<int32_t> ids(static_cast<size_t>(prompt));
  for (int i = 0; i < prompt; ++i) ids[size_t(i)] = int32_t((i * 7919 + 13) % cfg.vocab_size);
  // (three decode phases; the --beside sequence's blocks after the prompt's)
  const int64_t n_blocks = runtime::blocks_for(prompt + 3 * decode + 1);
  const int64_t n_beside = beside > 0 ? runtime::blocks_for(beside + decode + 1) : 0;
  runtime::KvPool pool(*be, cfg, 0, model.n_local_layers(), n_blocks + n_beside);
  std::vector<int32_t> table(static_cast<size_t>(n_blocks)), table_b(static_cast<size_t>(n_beside));
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
  for (size_t i = 0; i < table_b.size(); ++i) table_b[i] = int32_t(n_blocks + int64_t(i));
  model.set_kv_pool(&pool);
  std::vector<float> h(size_t(prompt) * size_t(cfg.hidden_size)), logits(size_t(cfg.vocab_size));
  // Prefills a sequence in chunks of `chunk` tokens, each chunk's hidden rows at hbuf + c0 rows
  // (all_rows) or at hbuf (a buffer of one chunk, when no row is needed afterwards).
  const auto prefill = [&](const std::vector<int32_t>& tokens, const int32_t* tbl, float* hbuf, bool all_rows) {
    const int len = int(tokens.size());
    for (int c0 = 0; c0 < len; c0 += chunk) {
      const int n = std::min(chunk, len - c0);
      float* hc = hbuf + (all_rows ? size_t(c0) * size_t(cfg.hidden_size) : 0);
      model.embed(tokens.data() + c0, n, hc);
      model.forward({{tbl, c0, n, len}}, hc);
    }
  };
  // (--prefill-reps: an untimed pass first unless 0)
  std::vector<double> prefill_times;
  for (int rep = prefill_reps > 0 ? 0 : 1; rep <= std::max(prefill_reps, 1); ++rep) {
    auto t = Clock::now();
    prefill(ids, table.data(), h.data(), true);
    model.logits(h.data() + size_t(prompt - 1) * size_t(cfg.hidden_size), 1, logits.data());
    if (rep > 0) prefill_times.push_back(secs(t));
  }
  std::sort(prefill_times.begin(), prefill_times.end());
  const double prefill_s = prefill_times[prefill_times.size() / 2];
  // FLOPs of the prefill: 2 x weights touched per token (no lm_head, one row of logits aside),
  // the kv_b expansion of all keys, and causal attention (qk + pv) per layer.
  const double NH = double(cfg.num_attention_heads), S = double(prompt);
  const double pairs = S * (S + 1) / 2;
  double flops = 2.0 * S * (touched_params - lm_head_params);
  flops += double(cfg.num_hidden_layers) * (2.0 * pairs * NH * double(cfg.qk_head_dim() + cfg.v_head_dim));
  int64_t indexers = 0;  // layers that score keys (GLM-5.2's shared layers do not)
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) indexers += cfg.has_indexer(l);
  if (S > double(cfg.index_topk))
    flops += double(indexers) * 2.0 * pairs * double(cfg.index_n_heads * cfg.index_head_dim);
  const double prefill_gflops = flops / prefill_s / 1e9;

  // Decode: `decode` steps timed as a whole (the headline tok/s), then `decode` more in windows of
  // kWindow with a read probe between windows (512 MiB: more than the L3 of these CPUs). On a shared
  // machine the bandwidth drifts by 10-20% within a run, so each window is set against the probes on
  // either side of it (their time left out); a window's first token finds the L3 emptied by the
  // probe, which the headline phase does not.
  constexpr int kWindow = 8;
  int32_t tok = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<float> h1(size_t(cfg.hidden_size));
  uint64_t lcg = 0x9E3779B97F4A7C15ull;  // fixed seed: every run feeds the same tokens
  // One decode step of a sequence (its block table, position, prompt length, token and generator).
  const auto decode_step = [&](const int32_t* tbl, int pos, int plen, int32_t& tk, uint64_t& rng) {
    model.embed(&tk, 1, h1.data());
    model.forward({{tbl, pos, 1, plen}}, h1.data());
    model.logits(h1.data(), 1, logits.data());
    tk = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());  // (always computed)
    if (decode_tokens == "random") {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      tk = int32_t((rng >> 33) % uint64_t(cfg.vocab_size));
    }
  };
  const auto step = [&](int i) { decode_step(table.data(), prompt + i, prompt, tok, lcg); };
  auto t = Clock::now();
  for (int i = 0; i < decode; ++i) step(i);
  const double decode_s = secs(t) / decode;
  const double bound_tps = read_gbs * 1e9 / touched;
  const double rss_run = double(rss_kb() - rss0) * 1024;

  std::vector<double> window_ratio;
  {
    ReadProbe probe(size_t(512) << 20);
    double before = probe.gbs();
    for (int i0 = decode; i0 < 2 * decode; i0 += kWindow) {
      const int n = std::min(kWindow, 2 * decode - i0);
      t = Clock::now();
      for (int i = i0; i < i0 + n; ++i) step(i);
      const double dt = secs(t), after = probe.gbs();
      window_ratio.push_back(touched * n / dt / 1e9 / (0.5 * (before + after)));
      before = after;
    }
  }
  std::sort(window_ratio.begin(), window_ratio.end());

  // --beside: prefill the second sequence (untimed), then `decode` pairs of steps, one on each.
  std::vector<double> t_long, t_short;
  if (beside > 0) {
    std::vector<int32_t> ids_b(static_cast<size_t>(beside));
    for (int i = 0; i < beside; ++i) ids_b[size_t(i)] = int32_t((i * 104729 + 7) % cfg.vocab_size);
    std::vector<float> hb(size_t(std::min(chunk, beside)) * size_t(cfg.hidden_size));
    prefill(ids_b, table_b.data(), hb.data(), false);
    int32_t tok_b = ids_b.back();
    uint64_t lcg_b = 0x2545F4914F6CDD1Dull;  // its own token stream, the same kind of tokens
    for (int i = 0; i < decode; ++i) {
      t = Clock::now();
      step(2 * decode + i);
      t_long.push_back(secs(t));
      t = Clock::now();
      decode_step(table_b.data(), beside + i, beside, tok_b, lcg_b);
      t_short.push_back(secs(t));
    }
  }

  std::printf("machine: %d threads, read bandwidth %.1f GB/s, fp32 FMA peak %.1f GFLOP/s; BF16 gemm path %s\n", threads,
              read_gbs, fma_gflops,
              (prec == kernels::Precision::kFast ? glm5::kernels::cpu::fast::fast_gemm_path()
                                                 : glm5::kernels::cpu::fast::gemm_path())
                  .c_str());
  std::printf("precision: %s; int8 BF16-scale decode sequence %s\n", precision.c_str(),
              glm5::kernels::cpu::fast::q8_bf16_sequence().c_str());
  std::printf("model: %s, %.3f GB of weights, loaded in %.2f s; RSS after load %.3f GB (%.2fx weights)\n",
              model_dir.c_str(), weight_bytes / 1e9, load_s, rss_load / 1e9, rss_load / weight_bytes);
  std::printf(
      "decode  batch 1 (%s tokens): %.2f tok/s (%.1f ms/token); %.3f GB of weights per token -> "
      "bandwidth bound %.2f tok/s; achieved %.0f%% of bound\n",
      decode_tokens.c_str(), 1 / decode_s, decode_s * 1e3, touched / 1e9, bound_tps, 100.0 / decode_s / bound_tps);
  std::printf(
      "decode  windows of %d tokens against the read bandwidth probed around each: median %.0f%% "
      "(quartiles %.0f%% %.0f%%, %zu windows)\n",
      kWindow, 100 * window_ratio[window_ratio.size() / 2], 100 * window_ratio[window_ratio.size() / 4],
      100 * window_ratio[window_ratio.size() * 3 / 4], window_ratio.size());
  std::printf("prefill %d tokens: %.1f tok/s, %.1f GFLOP/s = %.0f%% of the FMA peak", prompt, S / prefill_s,
              prefill_gflops, 100.0 * prefill_gflops / fma_gflops);
  if (prec == kernels::Precision::kFast && glm5::kernels::cpu::fast::fast_gemm_path() == "avx512bf16")
    std::printf(", %.0f%% of twice that (vdpbf16ps: 32 bf16 multiply-adds per instruction, at the FMA's issue rate)",
                50.0 * prefill_gflops / fma_gflops);
  if (amx_gflops > 0)
    std::printf(", %.0f%% of the AMX tile peak (%.0f GFLOP/s of fp32 activations as 3 bf16 terms)",
                100.0 * prefill_gflops / amx_gflops, amx_gflops);
  if (prefill_reps == 1)
    std::printf(" (warm: after one untimed pass)\n");
  else if (prefill_reps > 1)
    std::printf(" (warm: median of %d after one untimed pass)\n", prefill_reps);
  else
    std::printf(" (one pass from cold)\n");
  std::printf("RSS after prefill + decode: %.3f GB = %.2fx the weights (each weight held once)\n", rss_run / 1e9,
              rss_run / weight_bytes);
  if (beside > 0) {  // medians of the paired steps, and the median of their per-pair ratios
    std::vector<double> ratio;
    for (size_t i = 0; i < t_long.size(); ++i) ratio.push_back(t_short[i] / t_long[i]);
    const auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf(
        "decode after %d tokens of context / after %d, interleaved step by step (%d pairs): %.3f "
        "(median step %.2f / %.2f ms; median of the pairs' ratios %.3f)\n",
        prompt, beside, decode, median(t_short) / median(t_long), median(t_long) * 1e3, median(t_short) * 1e3,
        median(ratio));
  }
  return 0;
}
