// QuantPlan: parsing the convert / inspect flags, and which tensors a plan converts.
#include "runtime/quant_plan.h"

#include <algorithm>
#include <sstream>

#include "kernels/core/check.h"
#include "kernels/core/quant.h"

namespace glm5::runtime {

namespace {

constexpr Role kAllQuantizable[] = {Role::Attention, Role::Indexer,      Role::DenseMlp,
                                    Role::Expert,    Role::SharedExpert, Role::LmHead};

}  // namespace

bool QuantPlan::converts(const TensorSpec& spec) const {
  if (spec.shape.size() != 2) return false;
  if (!quantized_target()) return true;
  if (!quantizable(spec.role) || std::find(roles.begin(), roles.end(), spec.role) == roles.end()) return false;
  if (target == DType::F8_E4M3) return true;
  return spec.shape[1] % group_size == 0;
}

bool QuantPlan::stored_as_target(DType dtype, int64_t group, DType scale) const {
  if (dtype != target) return false;
  if (target != DType::Q4 && target != DType::Q8) return true;
  return group == group_size && (!scale_dtype_given || scale == scale_dtype);
}

QuantPlan parse_quant_plan(const std::string& quant, int64_t group_size, const std::string& roles,
                           const std::string& scale_dtype) {
  QuantPlan p;
  if (quant == "int4")
    p.target = DType::Q4;
  else if (quant == "int8")
    p.target = DType::Q8;
  else if (quant == "fp8")
    p.target = DType::F8_E4M3;
  else if (quant == "bf16")
    p.target = DType::BF16;
  else if (quant == "f32")
    p.target = DType::F32;
  else
    GLM5_FAIL("--quant: expected int4, int8, fp8, bf16 or f32, found '", quant, "'");
  CHECK(group_size == 32 || group_size == 64 || group_size == 128, "--group-size: expected 32, 64 or 128, found ",
        group_size);
  p.group_size = group_size;
  CHECK(scale_dtype.empty() || scale_dtype == "bf16" || scale_dtype == "f32",
        "--scale-dtype: expected bf16 or f32, found '", scale_dtype, "'");
  CHECK(scale_dtype.empty() || p.target == DType::Q4 || p.target == DType::Q8, "--scale-dtype ", scale_dtype,
        ": only int4 and int8 have group scales to choose (found --quant ", quant, ")");
  p.scale_dtype = scale_dtype == "f32" ? DType::F32 : DType::BF16;
  p.scale_dtype_given = !scale_dtype.empty();
  if (roles.empty()) return p;
  p.roles.clear();
  std::stringstream ss(roles);
  for (std::string r; std::getline(ss, r, ',');) {
    if (r == "all") {
      p.roles.assign(std::begin(kAllQuantizable), std::end(kAllQuantizable));
      continue;
    }
    bool found = false;
    for (Role q : kAllQuantizable)
      if (r == role_name(q)) {
        p.roles.push_back(q);
        found = true;
      }
    CHECK(found, "--quantize: '", r,
          "' is not a quantizable role; expected a comma list of experts, shared, dense, attention, "
          "indexer, lm_head (or all); router, indexer weights_proj, norms and embeddings stay as they are");
  }
  return p;
}

std::string describe(const QuantPlan& p) {
  std::string s;
  switch (p.target) {
    case DType::Q4: s = "int4 g" + std::to_string(p.group_size); break;
    case DType::Q8: s = "int8 g" + std::to_string(p.group_size); break;
    case DType::F8_E4M3: s = "fp8 (128x128 blocks)"; break;
    case DType::BF16: return "bf16 (every matrix)";
    default: return "f32 (every matrix)";
  }
  if (p.scale_dtype == DType::F32) s += " f32 scales";
  s += " (";
  for (size_t i = 0; i < p.roles.size(); ++i) s += std::string(i ? ", " : "") + role_name(p.roles[i]);
  return s + ")";
}

size_t stored_bytes(const TensorSpec& spec, DType dtype, int64_t group, int64_t scale_bytes) {
  int64_t numel = 1;
  for (int64_t d : spec.shape) numel *= d;
  if (spec.shape.size() != 2) return size_t(numel) * dtype_size(dtype);
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  switch (dtype) {
    case DType::Q4: return size_t(rows * ((cols + 7) / 8) * 4 + rows * (cols / group) * scale_bytes + 16);
    case DType::Q8: return size_t(rows * ((cols + 3) / 4) * 4 + rows * (cols / group) * scale_bytes + 16);
    case DType::F8_E4M3: {
      const int64_t b = quant::kFp8Block;
      return size_t(numel + ((rows + b - 1) / b) * ((cols + b - 1) / b) * 4);
    }
    default: return size_t(numel) * dtype_size(dtype);
  }
}

}  // namespace glm5::runtime
