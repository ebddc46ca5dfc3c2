// The ops of the fast CPU backend that have their own kernels (the rest reuse cpu/reference.h on
// row ranges). All are OpenMP-parallel and batch-invariant: an output row depends only on its own
// inputs, never on how many other rows share the call. Callers run validate() (kernels/validate.h) first.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace glm5::kernels::cpu::fast {

void gemm(const GemmParams& p, Precision precision = Precision::kExact);  // cpu/gemm.cpp
// Independent gemms (no output overlaps another's input or output) in one parallel region, their
// work items spread over all threads; each result is bitwise what gemm() gives it alone.
void gemm_batch(std::span<const GemmParams> ps, Precision precision = Precision::kExact);  // cpu/gemm.cpp
// The BF16-weight gemm's code paths (y = x W^T): "fp32" (the 16-lane dot_tile recipe, AVX-512 or
// portable), "amx" (AMX-BF16 tiles on three bf16 terms of x, cpu/amx_gemm.h; where
// amx::available()), "amx-emulated" (the same kernel on emulated tiles, for tests). gemm_paths()
// lists what this machine runs; the path in use is GLM5_CPU_GEMM if set, else the best (amx where
// available); set_gemm_path ("auto" = best) switches it for tests and benchmarks. One path serves
// every row count, so results stay batch-invariant; F16 / F32 / quantized weights keep theirs, and
// so do interleaved BF16 weights (WeightLayout::kQuad16: always fp32; the backend interleaves BF16
// matrices that way at load only when the path is fp32, so switching to amx later leaves them
// there). On an AMX path the backend holds BF16 matrices as tiles (kTile16), which only an AMX
// path runs: switching to fp32 after loading is refused at their first gemm.
std::vector<std::string> gemm_paths();
std::string gemm_path();
void set_gemm_path(const std::string& path);
// Precision::kFast's code paths (x and the weights rounded to bf16, float32 accumulation), each its
// own batch-invariant recipe:
//   "avx512bf16": kPair16 BF16 weights on vdpbf16ps (cpu/bf16_gemm.h: one lane chained over the k
//                 pairs);
//   "amx", "amx-emulated": BF16 weights on AMX tiles with one term (cpu/amx_gemm.h);
//   "portable": the exact path's kernels (the dot_tile recipe: 16 lanes of FMA, then the reduce
//               tree) over the rounded values.
// Row-major BF16 weights off the AMX paths, F16 / F32 and quantized weights (dequantized, then
// rounded unless quant_values_are_bf16) and transposed gemms take the portable recipe on every
// path. fast_gemm_paths() lists what this machine runs; the path in use is GLM5_CPU_FAST_GEMM if
// set, else the best (amx, avx512bf16, portable); set_fast_gemm_path ("auto" = best) switches it
// for tests and benchmarks. fast_bf16_layout(): how the backend holds BF16 gemm matrices for the
// path in use (kPair16, kTile16 or kQuad16); a weight laid out for one path is refused on another.
// x rows [0, m) of k values rounded to bf16 (nearest even, f32_to_bf16) into out (row stride k): the
// inputs precision fast gives its float kernels; on all threads when large and may_fork.
void round_bf16_rows(const float* x, int64_t ldx, int64_t m, int64_t k, float* out, bool may_fork = true);
std::vector<std::string> fast_gemm_paths();
std::string fast_gemm_path();
void set_fast_gemm_path(const std::string& path);
WeightLayout fast_bf16_layout();
// Whether precision fast's attention-side ops run their vdpbf16ps recipes (cpu/bf16_gemm.h
// indexer_block, cpu/bf16_attention.h): where the CPU has AVX512-BF16, unless the portable fast path
// is in use (which runs the exact kernels on the rounded values, as its gemm does).
bool fast_bf16_dots();
// bf16_dots: precision fast's recipe where the CPU has AVX512-BF16 (cpu/bf16_gemm.h indexer_block);
// else every score is the exact recipe's 16-lane FMA chain (on whatever values it is given).
void indexer_scores(const IndexerScoresParams& p, bool bf16_dots = false);  // cpu/attention.cpp
void mla_prefill(const MlaPrefillParams& p);                                // cpu/attention.cpp
void mla_decode(const MlaDecodeParams& p);                                  // cpu/attention.cpp
void topk(const TopkParams& p);                                             // cpu/attention.cpp

// Quantized weights (cpu/quant_gemm.cpp): gemm over F8_E4M3 / Q4 / Q8 weights, and the row
// dequantization behind it (rows [r0, r0 + n) of w into out, row stride ldo; values of weight_at).
// quant_split cuts y = x W^T into items of W rows, quant_item runs one (any thread, any order);
// gemm_quantized_tn is y = x W for a quantized W [k, n].
// round: Precision::kFast for a format whose values are not bf16 already (quant_values_are_bf16):
// the dequantized values are rounded to bf16 (in registers when fused, else the panel).
struct QuantSplit {
  bool fused = false;  // dequantized in registers (AVX-512 builds, m <= 4) instead of a panel
  bool round = false;
  int64_t rows_per_item = 0, items = 0;
};
QuantSplit quant_split(const GemmParams& p, bool round = false);
void quant_item(const GemmParams& p, const QuantSplit& s, int64_t item);
void gemm_quantized_tn(const GemmParams& p, Precision precision = Precision::kExact);
// Whether every dequantized value of w is a bf16 value already: int4 / int8 with BF16 scales
// (weight_at rounds q s to the scale's dtype), so Precision::kFast reads them unchanged.
inline bool quant_values_are_bf16(const Weight& w) {
  return (w.dtype == DType::Q4 || w.dtype == DType::Q8) && w.scale_dtype == DType::BF16;
}
void dequantize_rows(const Weight& w, int64_t r0, int64_t n, float* out, int64_t ldo);
// The dequantization code paths this CPU can run ("portable", and "avx512" where cpuid has it),
// the one in use, and a switch for tests and benchmarks ("auto" = best; GLM5_CPU_KERNELS=portable
// in the environment forces the portable path too).
std::vector<std::string> quant_paths();
// The sequence the fused decode tiles of int8 with BF16 scales use on this CPU ("pairs", "split" or
// "bits": the same floats; timed once per process unless GLM5_CPU_Q8_BF16 names one; cpu/quant_gemm.cpp),
// or "none" where those tiles are not built.
std::string q8_bf16_sequence();
std::string quant_path();
void set_quant_path(const std::string& path);

}  // namespace glm5::kernels::cpu::fast
