// The simulator's cost model: the FLOPs, memory bytes and kernel calls of every phase of the
// forward pass (runtime/glm5.cpp, phase names as the profiler's) for the rows of one step, turned
// into seconds by a roofline per phase: max(FLOPs / compute rate, bytes / bandwidth) plus a fixed
// cost per kernel call. Weight bytes come from the memory plan (runtime/memory_plan.h), so BF16,
// FP8 and int4/int8 checkpoints cost what they stream.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/config.h"
#include "runtime/memory_plan.h"

namespace glm5::launcher {

// What one rank computes with while it works (hardware.h rates, shared with the other busy ranks
// of its host).
struct Rates {
  double gemm_flops = 1, attention_flops = 1, topk_rate = 1, mem_bw = 1, op_overhead_s = 0;
  double gemm_flops_small = 1;  // at 16 rows or fewer; between 16 and 256 rows the rate is interpolated
  double attention_mem_bw = 0;  // bytes/s of the attention / indexer kernels (0: mem_bw)
  bool operator==(const Rates&) const = default;
};

// One sequence's rows in a step (the scheduler's StepSeq, as the cost model sees it): positions
// [start, start + n) of request `req`, whose prompt has prompt_len tokens; `sample`: its last row
// is sampled (the end of its prompt, or a decode row).
struct SimSeq {
  int64_t start = 0, n = 0, prompt_len = 0;
  bool sample = false;
  int64_t drafts = 0, accepted = 0;  // speculative decoding: drafts verified, of which accepted
  bool decode = false;               // one generated token (and its drafts), else prompt rows or a recompute
  bool mtp = false;                  // the MTP layer runs over its rows
  int64_t chain = 0;                 // drafts it then makes after the sampled row (0: none)
  int64_t req = 0;
  // The same work (whichever request): steps of columns that compare equal cost the same.
  bool operator==(const SimSeq& o) const {
    return start == o.start && n == o.n && prompt_len == o.prompt_len && sample == o.sample && drafts == o.drafts &&
           accepted == o.accepted && decode == o.decode && mtp == o.mtp && chain == o.chain;
  }
};

// Seconds per phase ("projections", "attention", "experts", ...), summed over layers.
using PhaseTimes = std::map<std::string, double>;

// The work of one phase and its time at `r`.
struct Work {
  double flops = 0, bytes = 0, scanned = 0, calls = 0;
  double rows = 256;            // rows of the GEMM's input (decode-sized GEMMs run at a lower rate)
  bool attention_unit = false;  // indexer / attention kernels (attention_flops), else GEMM rate
  double seconds(const Rates& r) const;
};

class StepCost {
 public:
  // expert_share: per layer, the fraction of routed picks each expert gets (empty: uniform).
  // kv_bytes: bytes per cached value (4: f32, 2: a bf16 KV cache).
  StepCost(const runtime::ModelConfig& cfg, const runtime::WeightPlan& plan, int expert_parallel,
           std::vector<std::vector<double>> expert_share = {}, double kv_bytes = 4);

  // One column's attention block of `layer` for its step's sequences (projections, cache writes,
  // naive and weight-absorbed attention with the indexer and top-k, o_proj, norms).
  void attention(int layer, const std::vector<SimSeq>& seqs, const Rates& r, PhaseTimes& t) const;
  // A dense MLP layer for m rows.
  void dense_mlp(int layer, int64_t m, const Rates& r, PhaseTimes& t) const;
  // The router and shared expert for one column's m rows.
  void router(int layer, int64_t m, const Rates& r, PhaseTimes& t) const;
  // Routed experts of column `column` when the stage's columns route `rows` rows in all.
  void experts(int layer, int column, int64_t rows, const Rates& r, PhaseTimes& t) const;
  // Bytes one rank sends to the other ranks of its stage in one MoE layer for its m rows: the
  // payload (dispatch: a row once per remote rank it picks; combine: a row per remote slot back)
  // and the plan (a 32-byte count header per peer, a (row, tag) entry per remote slot).
  // value_bytes: bytes per hidden value on the wire (4: f32, as glm5 sends; 2: bf16; 1: fp8).
  struct ExchangeBytes {
    double plan = 0, payload = 0;
    double total() const { return plan + payload; }
  };
  ExchangeBytes exchange_bytes(int64_t m, double value_bytes = 4) const;
  // Final norm, lm_head and sampling for `sampled` rows; the embedding of m rows.
  void head(int64_t sampled, const Rates& r, PhaseTimes& t) const;
  void embed(int64_t m, const Rates& r, PhaseTimes& t) const;

  // Weight bytes read from the experts of one column in a layer with `rows` rows routed (the
  // expected number of distinct experts picked times one expert's bytes).
  double active_expert_bytes(int layer, int column, int64_t rows) const;
  double expert_picks(int layer, int column, int64_t rows) const;
  double expert_count(int column) const;  // routed experts column `column` holds
  // Uniform routing: every column's experts cost the same for the same rows.
  bool uniform() const { return share_.empty(); }

 private:
  double bytes(int layer, const std::string& name) const;  // resident bytes of a layer tensor
  double share(int layer, int expert) const;

  runtime::ModelConfig cfg_;
  int E_ = 1;
  double kv_bytes_ = 4;
  std::map<std::string, double> bytes_;  // tensor name -> resident bytes
  std::vector<std::vector<double>> share_;
};

}  // namespace glm5::launcher
