// What one pipeline column runs at once: the defaults and the meaning of the three limits, in one
// place for the cluster config, the engine, its scheduler and the memory plan (each of their
// option structs is a BatchLimits, so the limits pass as one value).
#pragma once

#include <cstdint>

namespace glm5::runtime {

struct BatchLimits {
  int64_t max_batch = 64;  // running sequences per column, over all micro-batch groups
  // Prompt tokens per sequence per step. Fixed, so that results never depend on what else is
  // scheduled.
  int64_t prefill_chunk = 256;
  // Rows one micro-batch forwards in a step (decode tokens + prefill chunks, the last chunk cut to
  // fit): bounds the activation memory; >= max_batch.
  int64_t max_step_tokens = 8192;

  BatchLimits& limits() { return *this; }
  const BatchLimits& limits() const { return *this; }
};

}  // namespace glm5::runtime
