// Element types of checkpoints and kernels, and scalar conversions to float.
// Activations are always float32; weights stay in their checkpoint dtype and are widened inside
// the kernels (quantized formats: core/quant.h). dtype_size is 0 for Q4 (two elements per byte).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace glm5 {

// Q4 / Q8: compressed-tensors pack-quantized int4 / int8 weights as kernels see them (core/quant.h);
// never a safetensors dtype (those files store them as I32).
enum class DType : uint8_t { F32, F16, BF16, F8_E4M3, I32, I64, U8, Q4, Q8, Unknown };

// Safetensors spelling ("F32", "BF16", "F8_E4M3", ...).
inline std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::Q4: return "int4 (pack-quantized)";
    case DType::Q8: return "int8 (pack-quantized)";
    default: return "unknown";
  }
}

inline DType dtype_from_name(std::string_view s) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  if (s == "F8_E4M3") return DType::F8_E4M3;
  if (s == "I32") return DType::I32;
  if (s == "I64") return DType::I64;
  if (s == "U8") return DType::U8;
  return DType::Unknown;
}

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    case DType::F8_E4M3:
    case DType::U8:
    case DType::Q8: return 1;
    case DType::I64: return 8;
    default: return 0;
  }
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even (NaN kept quiet): used by the tiny-model tests and generators.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// OCP FP8 E4M3 (fn variant: no infinities, 0x7f/0xff are NaN), as stored in FP8 checkpoints.
inline float fp8_e4m3_to_f32(uint8_t v) {
  uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, mant = v & 0x7u;
  float r;
  if (exp == 0xf && mant == 0x7) return sign ? -__builtin_nanf("") : __builtin_nanf("");
  if (exp == 0)
    r = float(mant) / 8.0f / 64.0f;  // subnormal: m/8 * 2^-6
  else
    r = (1.0f + float(mant) / 8.0f) * float(1u << exp) / 128.0f;  // 2^(exp-7)
  return sign ? -r : r;
}

}  // namespace glm5
