// `glm5 convert`: rewrites a checkpoint tensor by tensor into another storage format
// (runtime/quant_plan.h), streaming, resumable, optionally one file set per rank.
#pragma once

#include <cstdint>
#include <string>

namespace glm5::launcher {

struct ConvertArgs {
  std::string model, out, quant = "int4", quantize, cluster, scale_dtype;  // scale_dtype "": BF16, or as stored
  int64_t group_size = 128;
  int64_t shard_size_mb = 4096;  // largest output file (one bigger tensor gets a file of its own)
  bool progress = true;
};

int run_convert(const ConvertArgs& args);

}  // namespace glm5::launcher
