// Subcommands of the glm5 executable; main.cpp only dispatches here.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "launcher/cluster/cluster_config.h"
#include "parallel/comm.h"
#include "runtime/engine/engine.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace glm5::launcher {

int main_entry(int argc, char** argv);

// Everything one rank needs to run the model: communicators, its shard of the model, the engine.
struct Job {
  ClusterConfig cluster;
  runtime::ModelConfig config;
  std::unique_ptr<parallel::Comm> world, stage_comm;
  // Declared before what uses it (members are destroyed in reverse): the communicators below
  // hold its stream, the model and engine its memory.
  std::unique_ptr<kernels::Backend> backend;
  // Device backends: the stage's MoE payload and the hidden states between stages go over these
  // (NCCL, the device-like stand-in, or staging over MPI); null for host backends and where
  // nothing moves (one stage, one column).
  std::unique_ptr<parallel::Comm> moe_payload, hidden;
  std::unique_ptr<runtime::Checkpoint> checkpoint;
  std::unique_ptr<runtime::Model> model;
  std::unique_ptr<runtime::Engine> engine;
  std::vector<parallel::LayerRange> stages;
  int rank() const { return world->rank(); }
  // Collective: waits (unwatched) until every rank is ready to run, then arms the watchdog with
  // the cluster's watchdog_s. Loading and rank 0's input pre-scan are not timed by it.
  void start_watchdog();
};

// Builds the job for this rank. `world` is the MPI world (with --cluster) or a self comm.
// `overrides`: what the command line replaces in the cluster config.
std::unique_ptr<Job> make_job(const std::string& model_dir, const std::string& cluster_file,
                              std::unique_ptr<parallel::Comm> world, bool progress,
                              const ClusterOverrides& overrides = {});

}  // namespace glm5::launcher
