// The checkpoint name table built from the config: every tensor the main model (layers
// 0..num_hidden_layers-1, embedding, final norm, lm_head) needs, with its HF name and shape.
// The MTP layer(s) (index >= num_hidden_layers) are recognised and skipped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace glm5::runtime {

class Checkpoint;

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int layer = -1;   // -1 for embedding / final norm / lm_head
  int expert = -1;  // routed expert index, -1 otherwise
};

std::vector<TensorSpec> tensor_table(const ModelConfig& cfg);
// True for names of layers >= num_hidden_layers (MTP), which the main model does not load.
bool is_mtp_tensor(const ModelConfig& cfg, const std::string& name);
// Strict check of the whole checkpoint against the table, without reading tensor data beyond
// headers: every table tensor present with its shape and a supported dtype, and no unknown names
// (MTP names allowed). Throws glm5::Error naming the file, the tensor, expected and found.
void check_checkpoint(Checkpoint& ckpt, const ModelConfig& cfg);

}  // namespace glm5::runtime
