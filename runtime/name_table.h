// The checkpoint schema, shared by the loader, the converter and the memory planner: every tensor
// the main model (layers 0..num_hidden_layers-1, embedding, final norm, lm_head) needs, with its
// HF name, shape and role, and how a checkpoint may store it (plain, FP8 block-scaled, or
// compressed-tensors int4/int8; core/quant.h). The MTP layer(s) (index >= num_hidden_layers) are
// recognised and skipped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"
#include "kernels/ops.h"
#include "runtime/config.h"

namespace glm5::runtime {

class Checkpoint;
struct TensorInfo;

// What a tensor is for; decides what conversion may quantize (Linear weights only).
enum class Role : uint8_t {
  Embedding,
  Norm,
  Attention,
  Indexer,
  IndexerWeights,
  Router,
  RouterBias,
  DenseMlp,
  Expert,
  SharedExpert,
  LmHead
};
// "attention", "experts", ... (the names `convert --quantize` takes).
const char* role_name(Role r);
// Roles whose matrices may be stored quantized (FP8, int4, int8): the Linear layers the FP8
// release quantizes plus lm_head. Router, indexer weights_proj, norms and embeddings never are.
bool quantizable(Role r);

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int layer = -1;   // -1 for embedding / final norm / lm_head
  int expert = -1;  // routed expert index, -1 otherwise
  Role role = Role::Norm;
};

// How a checkpoint stores one table tensor `X.weight`:
//   plain    X.weight BF16 / F16 / F32
//   FP8      X.weight F8_E4M3 + X.weight_scale_inv F32 [ceil(rows/128), ceil(cols/128)]
//   int      X.weight_packed I32 [rows, ceil(cols * bits / 32)] + X.weight_scale [rows, cols / group]
//            (BF16 / F16 / F32) + X.weight_shape I64/I32 [2] = [rows, cols]   (compressed-tensors)
struct StoredTensor {
  DType dtype = DType::Unknown;       // kernel dtype: BF16, F16, F32, F8_E4M3, Q4, Q8
  const TensorInfo* data = nullptr;   // X.weight or X.weight_packed
  const TensorInfo* scale = nullptr;  // X.weight_scale_inv or X.weight_scale (quantized only)
  int64_t group = 0;                  // columns per scale (FP8: 128)
  size_t nbytes() const;              // data + scales
};
// Names a stored form adds beside (or instead of) `X.weight`.
std::string fp8_scale_name(const std::string& weight_name);                 // X.weight_scale_inv
std::string packed_name(const std::string& weight_name, const char* part);  // X.weight_<part>
// The stored form of `spec`, checked against the spec (shapes of data and scales, dtypes).
// Throws glm5::Error naming the file, the tensor, expected and found.
StoredTensor resolve_tensor(Checkpoint& ckpt, const TensorSpec& spec);
// The two values of a compressed-tensors `X.weight_shape` (I64, or I32 as some writers declare it);
// empty when the tensor is not of that form.
std::vector<int64_t> stored_shape(const TensorInfo& t);
// A resolved matrix [rows, cols] as a kernels::Weight over the mmapped host bytes (scales too).
kernels::Weight weight_view(const StoredTensor& st, int64_t rows, int64_t cols);

std::vector<TensorSpec> tensor_table(const ModelConfig& cfg);
// True for names of layers >= num_hidden_layers (MTP), which the main model does not load.
bool is_mtp_tensor(const ModelConfig& cfg, const std::string& name);
// Strict check of the whole checkpoint against the table, without reading tensor data beyond
// headers: every table tensor present with its shape and a supported dtype, and no unknown names
// (MTP names allowed). Throws glm5::Error naming the file, the tensor, expected and found.
void check_checkpoint(Checkpoint& ckpt, const ModelConfig& cfg);

}  // namespace glm5::runtime
