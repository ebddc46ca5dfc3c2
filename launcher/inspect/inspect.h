// `glm5 inspect`: a checkpoint's configuration and each rank's memory under a cluster config,
// computed from config.json and the index's names (never the shards), without MPI.
#pragma once

#include <cstdint>
#include <string>

namespace glm5::launcher {

struct InspectArgs {
  std::string model, cluster, quant, quantize, scale_dtype;  // quant: as `glm5 convert --quant` would store it
  int64_t group_size = 128;
};

// Prints the config summary, the stored forms and the per-rank memory plan (runtime/memory_plan.h);
// returns 0.
int run_inspect(const InspectArgs& a);

}  // namespace glm5::launcher
