#pragma once

#include <vector>

#include "runtime/engine/seq_table.h"
#include "runtime/model.h"
#include "runtime/scheduler.h"

namespace glm5::runtime {

// The last stage's work on a step (h: the step's [rows, hidden] output of the last layer): the
// logits of the rows that need them, then sampling, or verifying a speculating sequence's drafts;
// with speculative_tokens > 0 the MTP layer then drafts the next step's tokens (into `table`). A
// sequence whose logits are not finite gets an error (it ends; the others go on) and a line on
// stderr naming `rank`. One Back per sequence that sampled or wanted every row's logits.
std::vector<Back> finish_step(Model& model, const Step& step, const float* h, SeqTable& table, int rank,
                              int speculative_tokens);

}  // namespace glm5::runtime
