// What one pipeline column runs at once and how it schedules it: the defaults and the meaning of
// each, in one place for the cluster config, the engine, its scheduler and the memory plan (each of
// their option structs is a BatchLimits, the first three a SchedulingPolicy, so that they pass as
// one value).
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

// How a column schedules its work, beyond the limits: the cluster config's keys of the same
// names, which the engine and its scheduler take as one value (policy()).
struct SchedulingPolicy : BatchLimits {
  int micro_batches = 1;       // micro-batches in flight per column (>= stages keeps all busy)
  bool prefix_sharing = true;  // share full prompt blocks between sequences (cluster key prefix_caching)
  // Speculative decoding: MTP draft tokens verified per decode step (0: off), and the decoding
  // sequences of a step beyond which it decodes plainly (no drafts, no MTP over its decode rows).
  int speculative_tokens = 0;
  int64_t speculative_max_batch = 4;

  SchedulingPolicy& policy() { return *this; }
  const SchedulingPolicy& policy() const { return *this; }
};

}  // namespace glm5::runtime
