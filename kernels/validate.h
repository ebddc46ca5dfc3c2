// The parameter checks of every op of ops.h, one per op, run by every backend before the op:
// sizes, leading dimensions, the weight's shape, dtype, layout and scales, null pointers. Each
// throws glm5::Error naming the op, the field, what was expected and what was found.
//
// They read the params only, never the memory the pointers name (a device backend's memory): the
// checks of contents (token ids inside the table, row and slot indices) are the CPU backends'
// cpu::validate_contents() (cpu/reference.h); the CUDA backend makes them on the device. A backend
// adds after these what it alone cannot do (the CUDA backend: row-major weights only, ...).
#pragma once

#include "kernels/ops.h"

namespace glm5::kernels {

void validate(const GemmParams& p);
void validate(const RmsNormParams& p);
void validate(const LayerNormParams& p);
void validate(const RopeParams& p);
void validate(const IndexerScoresParams& p);
void validate(const TopkParams& p);
void validate(const MlaPrefillParams& p);
void validate(const MlaDecodeParams& p);
void validate(const RouterParams& p);
void validate(const SwigluParams& p);
void validate(const EmbeddingParams& p);
void validate(const GatherRowsParams& p);
void validate(const MoeCombineParams& p);
void validate(const AddParams& p);
void validate(const Copy2dParams& p);
void validate(const PagedWriteParams& p);

}  // namespace glm5::kernels
