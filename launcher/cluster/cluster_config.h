// Cluster configs (YAML): where things run, never model numbers. Read with yaml-cpp and validated
// against the model config and the world size with errors that name the file and the key.
//
//   stages: 2                      # or explicit layer ranges: stages: [[0, 3], [3, 4]]
//   expert_parallel: 2             # E; world size = stages x E
//   micro_batches: 2               # micro-batches in flight per column
//   backend: cpu                   # cpu | cuda | cpu-devicelike (cpu kernels behind a device's
//                                  #   memory rules: tests the GPU path's data movement anywhere)
//   comm: mpi                      # mpi | nccl: MoE payloads and hidden states between stages
//                                  #   in device memory (device backends; mpi stages them)
//   kv_budget_gb: 8                # KV cache budget per rank (0 or absent: unlimited)
//   device_memory_gb: 80           # per-rank device memory; `glm5 inspect` checks the plan fits
//   max_batch: 64                  # running sequences per column
//   prefill_chunk: 256             # prompt tokens per sequence per step
//   max_step_tokens: 8192          # rows one micro-batch forwards in a step (>= max_batch)
//   kv_dtype: f32                  # KV cache elements: f32 | bf16 (half the memory per token)
//   precision: exact               # exact | fast: gemm inputs rounded to bf16 (kernels/ops.h Precision)
//   prefix_caching: true           # share full prompt blocks (64 tokens) between sequences
//   speculative_tokens: 0          # MTP draft tokens verified per decode step (0: off; up to 8)
//   speculative_max_batch: 4       # decoding sequences of a step beyond which it decodes plainly
//   watchdog_s: 300                # a rank waiting this long with no progress reports and aborts (0: off)
//   hosts: [{host: node1, slots: 8}, {host: node2, slots: 8}]   # for `glm5 launch`
//   mpirun_args: ["--mca", "pml", "ucx"]                        # extra mpirun flags
//   env: {UCX_TLS: "rc,sm,self"}                                 # exported to every rank (-x)
#pragma once

#include <map>
#include <string>
#include <vector>

#include "parallel/grid.h"
#include "runtime/batch_limits.h"
#include "runtime/config.h"
#include "runtime/model.h"

namespace glm5::launcher {

struct HostSlots {
  std::string host;
  int slots = 1;
};

constexpr int kMaxSpeculativeTokens = 8;

struct ClusterConfig : runtime::SchedulingPolicy {
  std::string source;  // file path, for messages
  int stages = 1;
  std::vector<parallel::LayerRange> layer_ranges;  // explicit ranges, or empty = balanced
  int expert_parallel = 1;
  std::string backend = "cpu";
  std::string comm = "mpi";
  double kv_budget_gb = 0;
  double device_memory_gb = 0;  // memory of one rank's device (e.g. 80 for H100); 0 = unchecked
  double watchdog_s = 300;
  std::string kv_dtype = "f32";     // f32 | bf16: kv_cache_dtype()
  std::string precision = "exact";  // exact | fast (kernels::Precision)
  std::vector<HostSlots> hosts;
  std::vector<std::string> mpirun_args;
  std::map<std::string, std::string> env;

  parallel::Grid grid() const { return {stages, expert_parallel}; }
  int world_size() const { return stages * expert_parallel; }
  DType kv_cache_dtype() const { return kv_dtype == "bf16" ? DType::BF16 : DType::F32; }
};

// Most ranks a layout may have (stages x expert_parallel).
constexpr int64_t kMaxWorldSize = int64_t(1) << 20;

// What a command line replaces in the cluster config (unset: the config's).
struct ClusterOverrides {
  int speculative_tokens = -1;  // --speculative-tokens: >= 0
  std::string precision;        // --precision: exact | fast
  // Checks the values (errors name the flag) and writes the set ones into cc.
  void apply(ClusterConfig& cc) const;
};

// Parses and validates the YAML file itself (unknown keys, types, ranges: clear errors).
ClusterConfig load_cluster_config(const std::string& path);
ClusterConfig parse_cluster_config(const std::string& yaml_text, const std::string& source);
// The single-process default (1 x 1, cpu, mpi).
ClusterConfig default_cluster_config();

// Checks the config against the model and the world: world_size == stages * E,
// n_routed_experts % E == 0, stages <= num_hidden_layers, explicit ranges contiguous and covering
// all layers. Returns the layer range of every stage (balanced by parameter count when not given).
std::vector<parallel::LayerRange> plan_stages(const ClusterConfig& cc, const runtime::ModelConfig& mc, int world_size);

// What rank `rank` of this layout holds: its stage's layers (`stages` from plan_stages), its
// column's 1/E of the routed experts, the embedding on stage 0, final norm + lm_head on the last.
runtime::ModelShard rank_shard(const ClusterConfig& cc, const std::vector<parallel::LayerRange>& stages, int rank);

// KV cache bytes per token position on stage s's ranks: its layers, and the MTP layer's rows on a
// speculating last stage. kv_bytes_per_token: the largest, by which the engine sizes every rank's
// pool from kv_budget_gb (the same block count everywhere).
size_t stage_kv_bytes_per_token(const ClusterConfig& cc, const runtime::ModelConfig& mc,
                                const std::vector<parallel::LayerRange>& stages, size_t s);
size_t kv_bytes_per_token(const ClusterConfig& cc, const runtime::ModelConfig& mc,
                          const std::vector<parallel::LayerRange>& stages);

// Parameters of layer l (its tensors in the schema, runtime/name_table.h: attention, indexer, norms,
// the MLP with all experts; an MTP layer its own parts too), for balancing and plans.
double layer_parameters(const runtime::ModelConfig& mc, int layer);

// The mpirun command line that runs `glm5 <args...>` on this cluster: -np, hosts, the flags a
// root user needs (--allow-run-as-root when running as root), oversubscription when the slots do
// not cover the world, mpirun_args, -x for env, and `--cluster FILE` appended to the glm5 args.
std::vector<std::string> launch_command(const ClusterConfig& cc, const std::string& glm5_path,
                                        const std::vector<std::string>& glm5_args, bool as_root);
// The command as one line a POSIX shell reads back into the same words (single-quoted where
// needed).
std::string shell_join(const std::vector<std::string>& argv);

// A Slurm batch script (`sbatch FILE`) that runs `glm5 <args...> --cluster FILE` on this cluster:
// #SBATCH --ntasks = world size, --nodes / --ntasks-per-node / --nodelist from `hosts` (else one
// node), the env exported, then `srun --mpi=pmix` (srun = true) or mpirun with mpirun_args inside
// the allocation (which gives mpirun its hosts).
std::string slurm_script(const ClusterConfig& cc, const std::string& glm5_path,
                         const std::vector<std::string>& glm5_args, bool srun);

}  // namespace glm5::launcher
