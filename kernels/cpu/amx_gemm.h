// y = x W^T for BF16 weights on Intel AMX tiles (AMX-BF16), exact to float32 activations.
//
// The tiles multiply bf16 by bf16 with float32 accumulation. Activations are float32, so each x
// is split into three bf16 terms, x = x1 + x2 + x3 (x1 = bf16(x), x2 = bf16(x - x1), x3 =
// bf16(x - x1 - x2): together all 24 bits of x's mantissa, for |x| >= 2^-100), and every product
// x_t * w is exact in float32: the result is the sum of three float32 dot products (one per
// term) in the tiles' accumulation order, within the goldens' 1e-4 of the reference, with no
// weight rounding anywhere. (A weight of +-inf gives NaN, where the reference gives +-inf: the
// zero terms of x multiply it too.)
//
// Layout: the tiles compute C^T = W x^T. A tiles are 16 W rows x 32 k values read straight from
// the weight: row-major (row stride = the weight's) or, as the fast backend holds them, kTile16
// (each tile one contiguous KiB, one stream per 16-row block); B tiles are the packed activation
// terms, 16 k pairs x N columns, where column 3 r + t is term t of x row r of a block of 5 rows
// (N = 3 min(m, 5): a decode row is one B tile of 3 columns, one product per W tile); C tiles
// are 16 W rows x N columns of float32, whose three columns of an x row are added on store.
//
// Batch-invariant: y[i, j] is, whatever m, n, the tile mix or the thread: C_t = the TDPBF16PS
// products of W row j and term t of x row i over the 32-wide k chunks in order, each term its own
// column (a column's value depends on its own column of B only); then y = (C_1 + C_2) + C_3 (or
// y + that). In Precision::kFast x is one term, bf16(x) (round to nearest even), and y = C_1 (or
// y + C_1): the fast precision's AMX recipe. Zero padding (k past its end, W rows past n, x rows past m) adds exact
// zeros.
//
// Two implementations of the same kernel source: the hardware one (inline assembly, used where
// cpuid, XCR0 and the Linux permission request allow) and an emulation of the tile instructions in
// plain C++ (exact products, round to nearest even per accumulation, bf16 input and float32 output
// denormals flushed, the operand checks that fault on hardware), which tests and machines without
// AMX can run: it checks the kernel's tiling, padding, packing and tile configuration everywhere.
// Within one instruction the hardware may add the 16 pairs of a dot product in another order than
// the emulation's (sequential), so the two agree to rounding, not bitwise; each is batch-invariant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

namespace glm5::kernels::cpu::amx {

// Whether this CPU and OS run AMX-BF16: cpuid AMX-TILE and AMX-BF16, the tile state enabled in
// XCR0, and the process's permission for it (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). When
// not, `why` (if given) says what is missing.
bool available(std::string* why = nullptr);

constexpr int kTerms = 3;      // bf16 terms per float32 activation
constexpr int kChunk = 32;     // k values per tile product (16 pairs)
constexpr int kTileRows = 16;  // W rows per A / C tile, and k pairs per B tile

// std::allocator on 64-byte boundaries: a tile row that crosses a cache line costs a tile load
// ~6x its time (measured: 1 KiB from L1 in 4.5 ns aligned, 26 ns at a 16-byte offset).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const {
    return true;
  }
};

// x rows per B tile: each brings its three terms as three columns (15 of the tile's 16).
constexpr int kRowsPerBlock = 5;

// Activations packed into B tiles: for x-row block cb (kRowsPerBlock rows) and chunk kc, a tile
// of 16 k pairs x n_cols columns x 2 bf16, column 3 r + t = term t of row r of the block
// (n_cols = 3 min(m, kRowsPerBlock): small batches pack no padding columns). A tile row (one k
// pair) takes ld columns, n_cols rounded up to 4, 8 or 16, so that no row crosses a cache line.
// With terms = 1 (Precision::kFast: x rounded to bf16, one term) a block is 16 rows, column r = row
// r (n_cols = min(m, 16)).
struct PackedX {
  int64_t m = 0, k = 0, chunks = 0, col_blocks = 0;
  int n_cols = 0, ld = 0;
  int terms = kTerms, rows_per_block = kRowsPerBlock;
  std::vector<uint16_t, Aligned64<uint16_t>> data;  // every tile on a 64-byte boundary

  int64_t tile_elems() const { return int64_t(kTileRows) * ld * 2; }
  const uint16_t* tile(int64_t cb, int64_t kc) const { return data.data() + (cb * chunks + kc) * tile_elems(); }
};
// x [m, k] float32, row stride ldx. Packs of kPackParallelElems elements or more run on all threads.
constexpr int64_t kPackParallelElems = int64_t(1) << 18;
// terms: kTerms (exact) or 1 (fast: each x rounded to bf16, nearest even).
void pack_x(const float* x, int64_t ldx, int64_t m, int64_t k, PackedX& out, int terms = kTerms);

// The three bf16 terms of one float32 (exported for tests).
void split_terms(float v, uint16_t out[kTerms]);

// y[:, 0:nb] (+)= x W^T for W rows [0, nb) (bf16, row stride ldw elements), x packed; y row
// stride ldy. W row-major, or `tiled` (WeightLayout::kTile16 of ops.h from a multiple of 16 rows:
// each A tile one contiguous KiB, zero padding past k and past the last row). Any nb >= 1; a call
// uses one thread and leaves its tiles configured (release_tiles); nothing else on the thread may
// change the tile state in between. `emulated` runs the emulation.
void gemm_rows(const PackedX& x, const uint16_t* w, int64_t ldw, bool tiled, int64_t nb, float* y, int64_t ldy,
               bool accumulate, bool emulated);

// gemm_rows leaves the calling thread's tiles configured for its next call of the same shape; a
// thread calls this when its run of gemm_rows calls ends (a batch's items), to release them.
void release_tiles();

// The calling thread's BF16 multiply-add rate on the tiles in multiply-adds per second: `iters`
// rounds of four independent full-size TDPBF16PS (no memory traffic), what benchmarks measure the
// AMX kernel against (a float32 activation costs kTerms of them). Hardware only.
double tile_macs_per_second(int64_t iters);

}  // namespace glm5::kernels::cpu::amx
