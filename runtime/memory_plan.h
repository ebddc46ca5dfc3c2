// The memory plan behind `glm5 inspect`: how every tensor of the schema is stored (read from
// model.safetensors.index.json names, else from config.json's quantization_config, optionally
// overlaid by the QuantPlan a `glm5 convert` would apply), the bytes the runtime then holds for
// it (glm5.cpp's loading rules, not the file size), what one rank of a layout holds, and an
// estimate of one step's activation memory. Never opens a safetensors shard: a directory with
// config.json alone is enough.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"
#include "runtime/batch_limits.h"
#include "runtime/config.h"
#include "runtime/model.h"
#include "runtime/name_table.h"
#include "runtime/quant_plan.h"

namespace glm5::runtime {

// How one table tensor is stored in the checkpoint (or would be, after a conversion).
struct StoredForm {
  DType dtype = DType::BF16;  // BF16, F16, F32, F8_E4M3 (128 x 128 F32 scales), Q4, Q8
  int64_t group = 0;          // columns per scale: FP8 128, Q4 / Q8 the group size
  // Q4 / Q8: the scales' dtype: a checkpoint's from its shards' headers (BF16 without them, what
  // llm-compressor writes); a conversion's from its plan.
  DType scale_dtype = DType::BF16;
};
// "BF16", "FP8", "int4 g128", ... for tables and messages.
std::string form_name(const StoredForm& f);

// Bytes the runtime holds for `spec` stored as `form` on a rank that loads it:
//   1-D tensors (norms, biases, e_score_correction_bias)           F32, numel * 4
//   self_attn.indexer.weights_proj                                  F32, always
//   self_attn.kv_b_proj, model.embed_tokens when stored quantized   F32 (dequantized at load)
//   every other matrix: its stored form (BF16 2 B; FP8 1 B + F32 per 128 x 128 block; int4 /
//   int8 packed I32 + BF16 group scales)
size_t resident_bytes(const TensorSpec& spec, const StoredForm& form);

struct WeightPlan {
  std::vector<TensorSpec> tensors;  // tensor_table(cfg): the main model
  std::vector<StoredForm> stored;   // per tensor, after the QuantPlan when one was given
  std::vector<size_t> resident;     // per tensor: resident_bytes
  // mtp_tensor_table(cfg) and their resident bytes (a speculating last stage loads the first MTP
  // layer); not part of the counts below.
  std::vector<TensorSpec> mtp_tensors;
  std::vector<size_t> mtp_resident;
  // lm_head of a tie_word_embeddings model: the embedding matrix again, in its stored form.
  size_t tied_head_bytes = 0;
  std::string source;  // where the stored forms come from (for the report)
  bool from_index = false;
  std::string plan;      // describe(QuantPlan) when one was applied, else ""
  size_t converted = 0;  // tensors whose form the plan changed
  size_t missing = 0;    // table tensors the index does not list (planned as config dtype)
  std::string first_missing;
  size_t dequantized_f32 = 0;  // matrices held dequantized (BF16 from int4/int8, F32 from FP8)
};

// The stored form of every table tensor (see the file comment) and what the runtime holds. With
// an index, a tensor is FP8 when `<name>_scale_inv` is listed and pack-quantized when
// `<name>_packed` is (bits and group from config.quantization); otherwise plain, in the config's
// dtype. Without an index the form follows config.quantization: fp8 -> the attention, indexer,
// dense-MLP and expert matrices FP8; compressed-tensors -> routed and shared experts int at
// num_bits / group_size; none -> the config dtype. `plan` (may be null): what `convert` writes,
// plan->converts(spec) -> its target. Throws glm5::Error on an unreadable index.
WeightPlan plan_weights(const ModelConfig& cfg, const std::string& model_dir, const QuantPlan* plan = nullptr);

// Resident weight bytes of the rank holding `shard` (its layers, its 1/E of each MoE layer's
// routed experts, the embedding on stage 0, final norm + lm_head on the last stage).
size_t shard_weight_bytes(const WeightPlan& w, const ModelConfig& cfg, const ModelShard& shard);

// Peak device memory of one step beyond weights and KV pool, estimated from the buffers the
// forward pass allocates (runtime/glm5.cpp, engine.cpp), float32 activations, balanced routing.
struct StepShape : BatchLimits {
  int expert_parallel = 1;
  bool device = false;  // a CUDA backend: add its fixed overhead
};
struct ActivationEstimate {
  double residual = 0;   // hidden states alive through the step: engine h, forward a / y
  double attention = 0;  // one layer's attention transients (projections, absorbed q/o, indexer scores, tables)
  double mlp = 0;        // one layer's dense MLP or MoE transients (exchange tables, expert outputs)
  double logits = 0;     // last stage: final norm + logits of max_batch rows
  double fixed = 0;      // CUDA context, cuBLAS workspace, allocator slack (device backends)
  double total() const;  // residual + max(attention, mlp, logits) + fixed
};
ActivationEstimate estimate_activations(const ModelConfig& cfg, const StepShape& s);

}  // namespace glm5::runtime
