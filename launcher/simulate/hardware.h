// Hardware files for `glm5 simulate` (YAML, cluster-configs/hardware/): the rates the analytic
// model turns FLOPs and bytes into seconds. One file describes one kind of rank:
//
//   name: "NVIDIA H100 SXM5 80GB"
//   kind: gpu                    # gpu: one rank per device | cpu: the ranks of a host share its cores
//   cores: 1                     # cpu: cores per host (a rank gets cores / ranks-on-host threads)
//   devices_per_node: 8          # gpu: ranks per node (ranks fill nodes in order)
//   memory_gb: 80                # per device (gpu) or per host (cpu)
//   gemm_flops: 989e12           # dense GEMM rate of one core (cpu) or one device (gpu), FLOP/s
//   gemm_efficiency: 0.6         # fraction of gemm_flops large GEMMs reach (1 for measured rates)
//   gemm_flops_small: 989e12     # optional: the rate at 16 rows (decode-sized GEMMs; default gemm_flops)
//   exact_gemm_cost: 3           # optional: how many times longer a GEMM takes in precision exact than
//                                # in fast, whose rate gemm_flops is (default 1; GPUs: 3, the exact path's
//                                # three bf16 terms per activation; CPUs: fp32 FMA against bf16 dot products).
//                                # The simulator applies it to every GEMM; glm5's quantized GEMMs run the
//                                # same kernels in both modes, so for a quantized checkpoint it overstates
//                                # exact's cost (simulate says so).
//   attention_flops: 989e12      # indexer scores and latent attention, FLOP/s (core / device)
//   attention_efficiency: 0.3
//   mem_bw_core: 3.35e12         # weight streaming of one core (cpu); gpu: = mem_bw
//   mem_bw: 3.35e12              # of the host (cpu, all cores) or the device (gpu), bytes/s
//   mem_bw_efficiency: 0.8
//   attention_mem_efficiency: 0.8  # optional: the attention / indexer kernels' share of mem_bw
//                                  # (default mem_bw_efficiency)
//   topk_rate: 2e11              # scores per second the top-k selection scans (core / device)
//   op_overhead_us: 4            # fixed cost of one kernel call (launch; OpenMP region on cpu)
//   intra_node_bw: 450e9         # between ranks of one node/host, bytes/s per direction
//   intra_node_latency_us: 5
//   inter_node_bw: 50e9          # between nodes, per rank, bytes/s per direction
//   inter_node_latency_us: 10
//
//   glm5:                        # optional: glm5's own kernels as a run measured them, where they differ
//     measured_by: "one H200, 2026-12-04, bench_cuda (BENCHMARKS.md)"   # from the efficiencies above
//     gemm_efficiency: 0.15      # (any of the four efficiency keys and exact_gemm_cost; the others stay)
//     attention_mem_efficiency: 0.008
//
// Every key is required except the efficiencies (default 1). The top-level efficiencies of the GPU
// files are what the best published kernels reach; `glm5 simulate` predicts with the `glm5:` ones
// (glm5 as it runs) unless --published-kernels asks for that what-if. `glm5 simulate --calibrate`
// writes a file for the machine it runs on from measured kernels (hardware_calibrate.cpp).
#pragma once

#include <string>

namespace glm5::launcher {

struct Hardware {
  std::string source;  // the file, for messages
  std::string name, kind = "cpu";
  int cores = 1, devices_per_node = 1;
  double memory_gb = 0;
  double gemm_flops = 0, gemm_efficiency = 1, gemm_flops_small = 0;
  double exact_gemm_cost = 1;  // (see above; efficiencies are of the mode's own rate)
  double attention_flops = 0, attention_efficiency = 1;
  double mem_bw_core = 0, mem_bw = 0, mem_bw_efficiency = 1;
  double attention_mem_efficiency = 0;  // 0: mem_bw_efficiency
  double topk_rate = 0;
  double op_overhead_s = 0;
  double intra_node_bw = 0, intra_node_latency_s = 0, inter_node_bw = 0, inter_node_latency_s = 0;
  // The `glm5:` map: glm5's kernels' efficiencies as measured (0: as the top level), and by what run.
  struct Measured {
    double gemm = 0, attention = 0, mem_bw = 0, attention_mem = 0;
    double exact_gemm_cost = 0;  // 0: the top level's
    std::string by;
  };
  bool has_measured = false;
  Measured measured;
  bool gpu() const { return kind == "gpu"; }
  double attention_mem_eff() const {
    return attention_mem_efficiency > 0 ? attention_mem_efficiency : mem_bw_efficiency;
  }
  // The efficiencies glm5's own kernels reach (the `glm5:` map over the top level).
  Hardware as_measured() const;
};

Hardware load_hardware(const std::string& path);
Hardware parse_hardware(const std::string& yaml_text, const std::string& source);
// YAML text that parse_hardware reads back; `comment` lines go first (prefixed with "# ").
std::string hardware_yaml(const Hardware& hw, const std::string& comment);

// Measures this machine with the CPU backend's own kernels (about 20 s; medians of 5 rounds):
// GEMM FLOP/s at 256 and at 16 rows per core while every core computes, in precision fast (and the
// exact precision's cost against it at 256 rows); weight streaming of one
// core and of all (routed experts of the given shape, BF16, 256 MiB, 2 rows each); indexer-score
// and latent-attention FLOP/s and the top-k scan rate per core; the cost of one small kernel call;
// memcpy bandwidth for the shared-memory link between ranks of a host. Expert shape: the model's
// hidden_size and moe_intermediate_size (GLM-5's by default).
Hardware calibrate_cpu(int64_t hidden = 6144, int64_t moe_intermediate = 2048);

}  // namespace glm5::launcher
