// The checkpoint schema, shared by the loader's checks, the converter, the memory planner and the
// parameter count: every tensor the main model (layers 0..num_hidden_layers-1, embedding, final
// norm, lm_head) and its MTP layers (index >= num_hidden_layers, loaded when speculating) hold,
// with its HF name, shape and role, and how a checkpoint may store it (plain, FP8 block-scaled, or
// compressed-tensors int4/int8; core/quant.h).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
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
  LmHead,
  MtpProjection  // an MTP layer's eh_proj
};
// "attention", "experts", ... (the names `convert --quantize` takes, of the quantizable roles).
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
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
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

// The tensors of layer l, 0 <= l < num_hidden_layers + num_nextn_predict_layers: a decoder layer
// (MLA, its indexer unless shared, a dense MLP or the MoE) and, for an MTP layer (spec §3.9), then
// eh_proj [H, 2H], enorm, hnorm and shared_head.norm.
std::vector<TensorSpec> layer_tensors(const ModelConfig& cfg, int64_t l);
// The tensors outside the layers: model.embed_tokens, model.norm, lm_head (unless tied).
std::vector<TensorSpec> global_tensors(const ModelConfig& cfg);
// The main model: embedding, layers 0..num_hidden_layers-1, final norm, lm_head (unless tied).
std::vector<TensorSpec> tensor_table(const ModelConfig& cfg);
// The MTP layers: layer_tensors of num_hidden_layers .. + num_nextn_predict_layers - 1.
std::vector<TensorSpec> mtp_tensor_table(const ModelConfig& cfg);
// Those of them the checkpoint holds, in any stored form (a checkpoint may leave its MTP layers out).
std::vector<TensorSpec> mtp_tensors_held(const Checkpoint& ckpt, const ModelConfig& cfg);
// Part of the schema by name: what the loader asks for, so that names and shapes come from here.
class SchemaLookup {
 public:
  explicit SchemaLookup(std::vector<TensorSpec> specs);
  // The spec named `name`; an internal error when the schema has none (the loader asked for a
  // tensor this model does not have).
  const TensorSpec& operator[](const std::string& name) const;

 private:
  std::unordered_map<std::string, TensorSpec> by_name_;
};

// True for names of layers >= num_hidden_layers (MTP), which only speculation loads.
bool is_mtp_tensor(const ModelConfig& cfg, const std::string& name);
// Strict check of the whole checkpoint against the tables, without reading tensor data beyond
// headers: every main-table tensor present with its shape and a supported dtype; the MTP tables'
// tensors the checkpoint holds the same (a checkpoint may leave its MTP layers out); no unknown
// names, but for other tensors of MTP layers (copies of the embedding or lm_head). Throws
// glm5::Error naming the file, the tensor, expected and found.
void check_checkpoint(Checkpoint& ckpt, const ModelConfig& cfg);

}  // namespace glm5::runtime
