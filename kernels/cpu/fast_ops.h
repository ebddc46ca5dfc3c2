// The ops of the fast CPU backend that have their own kernels (the rest reuse cpu/reference.h on
// row ranges). All are OpenMP-parallel and batch-invariant: an output row depends only on its own
// inputs, never on how many other rows share the call. Callers run cpu::validate() first.
#pragma once

#include "ops.h"

namespace glm5::kernels::cpu::fast {

void gemm(const GemmParams& p);                      // cpu/gemm.cpp
void indexer_scores(const IndexerScoresParams& p);   // cpu/attention.cpp
void mla_prefill(const MlaPrefillParams& p);         // cpu/attention.cpp
void mla_decode(const MlaDecodeParams& p);           // cpu/attention.cpp
void topk(const TopkParams& p);                      // cpu/attention.cpp

}  // namespace glm5::kernels::cpu::fast
