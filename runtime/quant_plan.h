// What `glm5 convert` (and `glm5 inspect --quant`) do with each tensor of the schema: the target
// format, the group size and the roles to quantize. One rule for both, so the memory plan counts
// exactly what a conversion writes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"
#include "runtime/name_table.h"

namespace glm5::runtime {

struct QuantPlan {
  // Q4, Q8 (compressed-tensors pack-quantized), F8_E4M3 (128 x 128 blocks), BF16 or F32 (plain:
  // every matrix dequantized / cast to it).
  DType target = DType::BF16;
  int64_t group_size = 128;  // Q4 / Q8: columns per scale
  // Q4 / Q8 scales written: BF16 (what llm-compressor writes) or F32. Unless given (--scale-dtype),
  // an int tensor already stored in the target format and group keeps its scales, whatever dtype.
  DType scale_dtype = DType::BF16;
  bool scale_dtype_given = false;
  std::vector<Role> roles{Role::Expert, Role::SharedExpert};  // quantized roles (Q4/Q8/F8 only)

  bool quantized_target() const { return target == DType::Q4 || target == DType::Q8 || target == DType::F8_E4M3; }
  // Whether this plan stores `spec` in the target format: for Q4/Q8/F8 a matrix of a listed,
  // quantizable role (and, for Q4/Q8, a column count the group size divides); for BF16/F32 every
  // matrix. Everything else keeps its stored form.
  bool converts(const TensorSpec& spec) const;
  // Whether a tensor `converts` selects, stored as `dtype` (Q4/Q8: with `group` columns per scale of
  // `scale`), is already in the target form and is copied as it is: the same dtype, for Q4/Q8 the
  // same group and, when --scale-dtype was given, the same scale dtype. (convert and the memory plan)
  bool stored_as_target(DType dtype, int64_t group, DType scale) const;
};

// From the command line: quant "int4" | "int8" | "fp8" | "bf16" | "f32"; roles a comma list of
// role names ("experts,shared", "attention", ... or "all"); scale_dtype "" (not given) | "bf16" |
// "f32" (int4 / int8 only); errors name the flag and the choices.
QuantPlan parse_quant_plan(const std::string& quant, int64_t group_size, const std::string& roles,
                           const std::string& scale_dtype = "");
// "int4 g128 (experts, shared)" for messages and reports.
std::string describe(const QuantPlan& plan);

// Bytes a matrix or vector takes when stored in `dtype` (scales included; Q4/Q8 with `group`
// columns per scale of scale_bytes, plus the 16-byte weight_shape).
size_t stored_bytes(const TensorSpec& spec, DType dtype, int64_t group, int64_t scale_bytes = 2);

}  // namespace glm5::runtime
