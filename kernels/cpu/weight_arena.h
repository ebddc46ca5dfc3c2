// Weights copied out of the checkpoint's file mapping into anonymous memory on 2 MiB pages (the
// fast CPU backend's default; GLM5_CPU_WEIGHTS=mmap keeps them in the mapping). Decode streams
// every weight once per token, and the same gemm reads a file mapping at ~0.67 of the machine's
// read bandwidth against ~0.9 from anonymous memory (BENCHMARKS.md; 2 MiB pages on top of that
// save TLB misses). From the first chunk that would leave less than a quarter of RAM + 1 GiB free
// (MemAvailable, and the cgroup's limit less its non-cache use), the rest stays mapped, with one
// note on stderr. Ranks on one host each copy the weights they hold (the mapping shared the page
// cache between them). BF16 / F16 / F32 matrices the model uses only as y = x W^T are copied
// interleaved in groups of 4 rows (copy_quad16, WeightLayout::kQuad16 in ops.h; BF16 in the AMX
// tiles' groups of 16 rows, kTile16, where its gemm runs on them), quantized ones whose rows are
// whole 64-byte chunks (int4: 128-column groups) in groups of 4 rows too (copy_quant_quad,
// kQuantQuad), the rest (sliced or transposed) as they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/ops.h"

namespace glm5::kernels::cpu {

class WeightArena {
 public:
  WeightArena() = default;
  WeightArena(const WeightArena&) = delete;
  WeightArena& operator=(const WeightArena&) = delete;
  ~WeightArena();
  // A copy of [src, src + bytes) in the arena (64-byte aligned), or nullptr when the copy is off
  // or would not fit in memory.
  const void* copy(const void* src, size_t bytes);
  // A copy of the row-major [rows, cols] matrix at src (row stride ld elements of elem_bytes) in
  // an interleaved layout (WeightLayout::kQuad16 or kTile16, ops.h) with row stride
  // interleaved_ld(layout, cols), zero-padded, or nullptr as for copy().
  const void* copy_interleaved(const void* src, size_t elem_bytes, int64_t rows, int64_t cols, int64_t ld,
                               WeightLayout layout);
  // The same copy into `out` (interleaved_bytes long), for a caller that owns the memory.
  static void interleave(void* out, const void* src, size_t elem_bytes, int64_t rows, int64_t cols, int64_t ld,
                         WeightLayout layout);
  static size_t interleaved_bytes(size_t elem_bytes, int64_t rows, int64_t cols, WeightLayout layout) {
    const int64_t G = layout_group_rows(layout);
    return size_t((rows + G - 1) / G * G * interleaved_ld(layout, cols)) * elem_bytes;
  }
  const void* copy_quad16(const void* src, size_t elem_bytes, int64_t rows, int64_t cols, int64_t ld) {
    return copy_interleaved(src, elem_bytes, rows, cols, ld, WeightLayout::kQuad16);
  }
  // A copy of the quantized rows at src (rows x rb bytes of dtype t, rb a multiple of 64) in quads
  // (WeightLayout::kQuantQuad, core/quant.h repack_quant_quad), or nullptr as for copy().
  const void* copy_quant_quad(const void* src, DType t, int64_t rows, size_t rb);
  static int64_t interleaved_ld(WeightLayout layout, int64_t cols) {
    const int64_t c = layout_ld_multiple(layout);
    return (cols + c - 1) / c * c;
  }
  static int64_t quad16_ld(int64_t cols) { return interleaved_ld(WeightLayout::kQuad16, cols); }
  size_t bytes() const { return used_; }  // bytes copied so far

  // "copy" or "mmap", from GLM5_CPU_WEIGHTS (default copy).
  static bool copy_enabled();

 private:
  struct Chunk {
    char* base = nullptr;
    size_t size = 0, used = 0;
  };
  bool grow(size_t bytes);
  char* take(size_t bytes);  // room for `bytes` (64-byte aligned), or nullptr
  std::vector<Chunk> chunks_;
  size_t used_ = 0;
  bool refused_ = false;  // the memory check said no once: keep mapping from then on
};

}  // namespace glm5::kernels::cpu
