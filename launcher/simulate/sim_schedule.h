// The simulator's schedule: replays what the engine does with a workload on a layout, tick by
// tick, with the cost model's step times instead of kernels. Each column runs the engine's own
// scheduler (runtime/scheduler.h: admission into micro-batch groups, KV blocks sized as the engine
// sizes them, preemption, prefix sharing, decode rows first, prefill chunks while the step has
// room, speculative verify steps) and world rank 0 the engine's distributor
// (runtime/engine/distributor.h); only the tokens are made up (drafts accepted as the acceptance
// model draws them). Stage-0 ranks tick in lockstep; a step moves down its column stage by stage
// (a stage works on one step at a time, in order), and group g's next step waits for its tokens to
// come back from the last stage. The MoE layers of a stage wait for all its columns (the exchange).
//
// CPU ranks of one host share its cores and memory bandwidth: a rank's rates are scaled by how
// many of the host's ranks are busy at once, estimated from the utilisation of the previous pass
// (a few fixed-point passes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "launcher/cluster/cluster_config.h"
#include "launcher/simulate/hardware.h"
#include "launcher/simulate/sim_cost.h"

namespace glm5::launcher {

struct Workload {
  int64_t prompts = 1, in = 2048, out = 512;
  int64_t prefix = 0;  // leading prompt tokens every request shares (prefix caching)
};
// "prompts=N,in=T,out=T[,prefix=T]"; errors name the field.
Workload parse_workload(const std::string& text);
// "0.86,0.66,0.52": at least k values, each in [0, 1] and none above the one before (--acceptance).
std::vector<double> parse_acceptance(const std::string& text, int k);

struct StagePrediction {
  int first_layer = 0, last_layer = 0;
  double busy_s = 0;  // computing (the slowest column's share of each step), exchange included
  double comm_s = 0;  // MoE exchange and pipeline hops out of this stage
  PhaseTimes phases;  // seconds per phase over the run (the slowest column of each segment)
};

struct Prediction {
  double makespan_s = 0, generated_per_s = 0, tokens_per_s = 0;  // generated / all (prompt + generated)
  double mean_ttft_s = 0;                                        // request handed out -> first token back at stage 0
  double decode_per_s = 0;  // tokens/s over the ticks that only decode (the steady state)
  int64_t ticks = 0, generated = 0;
  int64_t preemptions = 0;  // sequences the columns' schedulers preempted (KV blocks ran out)
  std::vector<StagePrediction> stages;
  double exchange_bytes_per_layer = 0;       // mean bytes one rank sends per MoE layer per step
  double exchange_plan_bytes_per_layer = 0;  // of which the plan (count headers, slot entries)
  double pipeline_bytes_per_step = 0;        // mean hidden-state bytes per stage hop
  std::vector<double> rank_utilisation;
};

struct SimSetup {
  const runtime::ModelConfig* cfg = nullptr;
  const ClusterConfig* cluster = nullptr;
  std::vector<parallel::LayerRange> stages;
  const Hardware* hw = nullptr;
  const StepCost* cost = nullptr;
  Workload work;
  double exchange_value_bytes = 4;  // bytes per hidden value the MoE exchange moves (glm5: f32)
  bool overlap = false;             // MoE exchange hidden behind compute (what-if; glm5 does not)
  // Speculative decoding (cluster speculative_tokens > 0): the acceptance model, the fraction of
  // verify steps whose drafts 1..j were all accepted, j = 1..k (a report's spec_accepted_at / spec_verify_steps).
  std::vector<double> acceptance;
};

Prediction simulate_run(const SimSetup& s);

// The host (node) of every rank: GPUs fill nodes of devices_per_node in order; CPU ranks fill the
// cluster's hosts by their slots (mpirun's by-slot mapping), one host when none are listed.
std::vector<int> host_of_ranks(const ClusterConfig& cc, const Hardware& hw);

}  // namespace glm5::launcher
