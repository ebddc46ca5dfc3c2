// glm5 simulate: an analytic model of a run (compute, memory, communication and the pipeline
// schedule) that predicts tokens/s, per-stage utilisation and the bottleneck for a model, a
// cluster config and a workload before the cluster is booked. See launcher/simulate/simulate.cpp.
#pragma once

#include <string>

namespace glm5::launcher {

struct SimulateArgs {
  std::string model;               // model directory or its config.json
  std::string cluster;             // cluster config YAML (layout, micro-batches, max_batch, ...)
  std::string workload;            // prompts=N,in=T,out=T[,prefix=T]
  std::string hardware;            // hardware YAML (cluster-configs/hardware/); default: the cluster's backend
  std::string routing;             // a batch --report JSON: per-layer expert loads instead of uniform routing
  std::string json;                // also write the prediction as JSON here
  double exchange_bytes = 4;       // what-if: bytes per value the MoE exchange moves (glm5 sends f32)
  bool overlap = false;            // what-if: MoE exchange overlapped with compute
  std::string acceptance;          // speculative decoding's acceptance model (cluster speculative_tokens > 0)
  bool published_kernels = false;  // what-if: the hardware file's published-kernel efficiencies, not glm5's
  bool calibrate = false;          // measure this machine and write a hardware file to `out`
  std::string out;
};

int run_simulate(const SimulateArgs& a);

}  // namespace glm5::launcher
