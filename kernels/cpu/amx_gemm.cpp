// AMX-BF16 gemm: the kernel of cpu/amx_gemm.h over two tile implementations (hardware, emulated).
// The tile instructions are written as inline assembly (not the compiler's intrinsics, which need
// a target attribute on every caller and declare no memory operands), so this file builds with any
// -march; nothing here runs AMX unless amx::available() said so.
#include "kernels/cpu/amx_gemm.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cerrno>
#endif

#include "kernels/core/check.h"
#include "kernels/core/dtype.h"
#include "kernels/cpu/simd.h"

namespace glm5::kernels::cpu::amx {

namespace {

// Tile registers, two layouts. Wide (x has more than one row block): C(wb, cb) = 2 wb + cb (0..3)
// for 2 W blocks x 2 x-row blocks, A(wb) = 4 + wb, B(cb) = 6 + cb. Narrow (decode-sized x, one
// x-row block): C(wb) = wb (0..2) and A(wb) = 3 + wb for 3 W blocks, B = 6 or 7 by chunk parity.
constexpr int kB = 6, kTiles = 8;
constexpr int c_tile(bool narrow, int wb, int cb) { return narrow ? wb : 2 * wb + cb; }
constexpr int a_tile(bool narrow, int wb) { return (narrow ? 3 : 4) + wb; }
constexpr int max_w_blocks(bool narrow) { return narrow ? 3 : 2; }

// The 64-byte operand of LDTILECFG (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// B and C tiles: 16 rows (k pairs / W rows) of n_cols 4-byte columns; A tiles: 16 W rows of 32 bf16.
TileConfig config_for(bool narrow, int n_cols) {
  TileConfig c;
  for (int t = 0; t < kTiles; ++t) {
    const bool a = t >= a_tile(narrow, 0) && t < a_tile(narrow, 0) + max_w_blocks(narrow);
    c.rows[t] = kTileRows;
    c.colsb[t] = uint16_t(a ? kChunk * 2 : n_cols * 4);
  }
  return c;
}

#if defined(__x86_64__)
// The hardware tiles. Tile numbers are immediates, hence the templates.
struct HwTiles {
  static void configure(const TileConfig& c) { asm volatile("ldtilecfg %0" ::"m"(c)); }
  static void release() { asm volatile("tilerelease" ::: "memory"); }
  template <int T>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  // The W rows of a block a few chunks ahead (16 rows are 16 streams; the L2 streamer alone
  // follows them late).
  static void prefetch(const uint16_t* p, int64_t stride_bytes) {
    for (int r = 0; r < kTileRows; ++r) __builtin_prefetch(reinterpret_cast<const char*>(p) + r * stride_bytes);
  }
  template <int C, int A, int B>
  static void dp() {  // C += A . B (TDPBF16PS tmmC, tmmA, tmmB; AT&T operand order)
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};
#endif

// The same instructions in C++ (pairs added into C in sequence), with their operand checks (a violation
// is #UD on hardware, a failed check here).
struct EmuTiles {
  struct State {
    TileConfig cfg;
    bool configured = false;
    alignas(64) uint8_t t[8][16][64];
  };
  static State& s() {
    thread_local State st;
    return st;
  }
  static void configure(const TileConfig& c) {  // the #GP conditions of LDTILECFG
    CHECK(c.palette == 1 && c.start_row == 0, "amx emulation: palette ", int(c.palette), ", start_row ",
          int(c.start_row));
    for (uint8_t r : c.reserved) CHECK(r == 0, "amx emulation: reserved config bytes not zero");
    for (int t = 0; t < 16; ++t)
      CHECK((c.rows[t] == 0) == (c.colsb[t] == 0) && (t < 8 || c.rows[t] == 0) && c.rows[t] <= 16 && c.colsb[t] <= 64,
            "amx emulation: tile ", t, " configured with rows ", int(c.rows[t]), ", colsb ", c.colsb[t]);
    s().cfg = c;
    s().configured = true;
    std::memset(s().t, 0, sizeof(s().t));
  }
  static void release() { s().configured = false; }
  static void prefetch(const uint16_t*, int64_t) {}
  static void check(int t) {
    CHECK(s().configured, "amx emulation: tile ", t, " used without a configuration");
    CHECK(s().cfg.rows[t] >= 1 && s().cfg.rows[t] <= 16 && s().cfg.colsb[t] >= 4 && s().cfg.colsb[t] <= 64 &&
              s().cfg.colsb[t] % 4 == 0,
          "amx emulation: tile ", t, " is not configured (rows ", int(s().cfg.rows[t]), ", colsb ", s().cfg.colsb[t],
          ")");
  }
  template <int T>
  static void zero() {
    check(T);
    std::memset(s().t[T], 0, sizeof(s().t[T]));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    check(T);
    zero<T>();
    for (int r = 0; r < s().cfg.rows[T]; ++r)
      std::memcpy(s().t[T][r], static_cast<const uint8_t*>(p) + r * stride, s().cfg.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    check(T);
    for (int r = 0; r < s().cfg.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s().t[T][r], s().cfg.colsb[T]);
  }
  static float bf16_daz(uint16_t v) {
    if ((v & 0x7f80u) == 0) v &= 0x8000u;  // denormal input -> signed zero
    return bf16_to_f32(v);
  }
  static float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
  template <int C, int A, int B>
  static void dp() {
    check(C), check(A), check(B);
    static_assert(C != A && C != B && A != B, "tdpbf16ps needs three distinct tiles (#UD)");
    const TileConfig& c = s().cfg;
    CHECK(c.rows[A] == c.rows[C] && c.colsb[B] == c.colsb[C] && c.colsb[A] / 4 == c.rows[B],
          "amx emulation: tdpbf16ps shapes: C ", int(c.rows[C]), "x", c.colsb[C], ", A ", int(c.rows[A]), "x",
          c.colsb[A], ", B ", int(c.rows[B]), "x", c.colsb[B]);
    for (int m = 0; m < c.rows[C]; ++m) {
      float* out = reinterpret_cast<float*>(s().t[C][m]);
      const uint16_t* a = reinterpret_cast<const uint16_t*>(s().t[A][m]);
      for (int kp = 0; kp < c.colsb[A] / 4; ++kp) {
        const uint16_t* b = reinterpret_cast<const uint16_t*>(s().t[B][kp]);
        for (int n = 0; n < c.colsb[C] / 4; ++n) {
          float acc = out[n];
          acc = ftz(acc + bf16_daz(a[2 * kp]) * bf16_daz(b[2 * n]));  // products are exact
          acc = ftz(acc + bf16_daz(a[2 * kp + 1]) * bf16_daz(b[2 * n + 1]));
          out[n] = acc;
        }
      }
    }
  }
};

// One 16-row W block as A tiles: chunk kc from `base` (row stride ld_bytes) while kc < full, the
// zero-padded last chunk from `tail` (16 x 32, stride 64 bytes).
struct ABlock {
  const uint16_t* base = nullptr;
  int64_t ld_bytes = 0, full = 0;
  int64_t step = kChunk;  // elements from one chunk to the next (kTile16: a whole 16 x 32 tile)
  const uint16_t* tail = nullptr;
  // The block at this position of the next group (narrow calls read the groups one after another:
  // prefetching runs on into it), or nullptr.
  const uint16_t* next = nullptr;
  const uint16_t* chunk(int64_t kc) const { return kc < full ? base + kc * step : tail; }
  int64_t stride(int64_t kc) const { return kc < full ? ld_bytes : kChunk * 2; }
};

constexpr int64_t kAhead = 8;  // chunks (512 bytes of each W row) prefetched ahead

template <int... I, class F>
void each(std::integer_sequence<int, I...>, F&& f) {
  (f.template operator()<I>(), ...);
}

// The C tiles of up to 3 W blocks x 2 x-row blocks, as stored: [wb][cb][W row][column 3 r + t].
struct alignas(64) OutTiles {
  float t[3][2][16][16];
  float (&operator[](int wb))[2][16][16] { return t[wb]; }
  const float (&operator[](int wb) const)[2][16][16] { return t[wb]; }
};

// Chunks [kc0, kc1) into C(wb, cb) for MW W blocks x NC x-row blocks: C starts at zero (kc0 = 0)
// or as `out` holds it (a float32 tile stored and loaded back is the same value, so cutting k into
// blocks changes no bit), and is stored to out[wb][cb] (16 x 16 floats, row = W row, column =
// term t of x row r at 3 r + t). `prefetch`: the W rows a few chunks ahead (first pass over W),
// running on into the next group's block where the call reads the groups one after another.
template <class Tiles, bool N, int MW, int NC>
void micro(const ABlock* a, const PackedX& x, int64_t cb0, int64_t kc0, int64_t kc1, bool prefetch, OutTiles& out) {
  static_assert(MW <= max_w_blocks(N) && (!N || NC == 1));
  constexpr auto wbs = std::make_integer_sequence<int, MW>{};
  constexpr auto cbs = std::make_integer_sequence<int, NC>{};
  each(wbs, [&]<int W>() {
    each(cbs, [&]<int B>() {
      if (kc0 == 0)
        Tiles::template zero<c_tile(N, W, B)>();
      else
        Tiles::template load<c_tile(N, W, B)>(&out[W][B][0][0], 16 * 4);
    });
  });
  const int64_t b_stride = int64_t(x.ld) * 4;
  // Chunk kc; with one x block in the call (narrow, or the wide kernel's odd last block) its B
  // tile alternates between 6 and 7 by the parity P of the chunk, so the next chunk's B load need
  // not wait for the products reading this one.
  const auto chunk = [&]<int P>(int64_t kc) {
    each(wbs, [&]<int W>() {
      Tiles::template load<a_tile(N, W)>(a[W].chunk(kc), a[W].stride(kc));
      const int64_t ahead = kc + kAhead;
      if (prefetch && ahead < a[W].full)
        Tiles::prefetch(a[W].chunk(ahead), a[W].stride(kc));
      else if (prefetch && a[W].next && ahead - a[W].full < a[W].full)
        Tiles::prefetch(a[W].next + (ahead - a[W].full) * a[W].step, a[W].ld_bytes);
    });
    each(cbs, [&]<int B>() {
      constexpr int b_tile = kB + (NC == 1 ? P : B);
      Tiles::template load<b_tile>(x.tile(cb0 + B, kc), b_stride);
      each(wbs, [&]<int W>() { Tiles::template dp<c_tile(N, W, B), a_tile(N, W), b_tile>(); });
    });
  };
  int64_t kc = kc0;
  for (; kc + 1 < kc1; kc += 2) chunk.template operator()<0>(kc), chunk.template operator()<1>(kc + 1);
  if (kc < kc1) chunk.template operator()<0>(kc);
  each(wbs,
       [&]<int W>() { each(cbs, [&]<int B>() { Tiles::template store<c_tile(N, W, B)>(&out[W][B][0][0], 16 * 4); }); });
}

template <class Tiles>
using MicroFn = void (*)(const ABlock*, const PackedX&, int64_t, int64_t, int64_t, bool, OutTiles&);

template <class Tiles>
MicroFn<Tiles> micro_fn(bool narrow, int mw, int nc) {
  static const MicroFn<Tiles> wide[2][2] = {{micro<Tiles, false, 1, 1>, micro<Tiles, false, 1, 2>},
                                            {micro<Tiles, false, 2, 1>, micro<Tiles, false, 2, 2>}};
  static const MicroFn<Tiles> thin[3] = {micro<Tiles, true, 1, 1>, micro<Tiles, true, 2, 1>, micro<Tiles, true, 3, 1>};
  return narrow ? thin[mw - 1] : wide[mw - 1][nc - 1];
}

// Chunks per k block of the wide kernel: the B tiles of one block (2 x-row blocks x kKBlock
// KiB) stay in L1 while every W block pair of the call passes over them (tile loads from L2 cost
// several times those from L1).
constexpr int64_t kKBlock = 8;

// Per-thread buffers: the last-chunk tails of the W blocks, a W block past n copied whole, the C
// tiles of every W block pair between k blocks.
struct Scratch {
  std::vector<uint16_t, Aligned64<uint16_t>> tails;  // [pair][wb] 16 x 32
  std::vector<uint16_t, Aligned64<uint16_t>> part;
  std::vector<ABlock> blocks;                      // [pair][wb]
  std::vector<OutTiles, Aligned64<OutTiles>> out;  // [pair]
};

// W rows [r0, r0 + rows) of a block as an ABlock: straight from w when all 16 rows exist (only the
// partial last chunk copied), else copied whole into `part` with zero rows and columns.
ABlock a_block(const uint16_t* w, int64_t ldw, int64_t k, int64_t chunks, int rows, uint16_t* tail,
               std::vector<uint16_t, Aligned64<uint16_t>>& part) {
  ABlock b;
  if (rows == kTileRows) {
    b.base = w;
    b.ld_bytes = ldw * 2;
    b.full = k / kChunk;
    const int64_t rem = k - b.full * kChunk;
    if (rem > 0) {
      std::memset(tail, 0, size_t(kTileRows * kChunk) * 2);
      for (int r = 0; r < kTileRows; ++r)
        std::memcpy(tail + r * kChunk, w + r * ldw + b.full * kChunk, size_t(rem) * 2);
      b.tail = tail;
    }
    return b;
  }
  const int64_t kpad = chunks * kChunk;
  part.assign(size_t(kTileRows * kpad), 0);
  for (int r = 0; r < rows; ++r) std::memcpy(part.data() + r * kpad, w + r * ldw, size_t(k) * 2);
  b.base = part.data();
  b.ld_bytes = kpad * 2;
  b.full = chunks;
  return b;
}

// W rows [r0, r0 + 16) of a kTile16 weight (r0 a multiple of 16; ldw >= 32 * chunks, zero-padded,
// so no chunk needs a tail): chunk kc is the KiB at group + kc * 512 elements, 64 bytes per row.
ABlock tiled_block(const uint16_t* group, int64_t chunks) {
  ABlock b;
  b.base = group;
  b.ld_bytes = kChunk * 2;
  b.full = chunks;
  b.step = kTileRows * kChunk;
  return b;
}

// y[r, j] (+)= (c[j][3r] + c[j][3r + 1]) + c[j][3r + 2] for r < nr, j < nj (c: a stored C tile,
// [W row][column 3 r + t]). With AVX-512 the tile is transposed in registers (simd::transpose16)
// and each y row written at once.
// One term (terms = 1): y[r, j] (+)= c[j][r].
void store_rows(float (&c)[16][16], int nr, int nj, float* y, int64_t ldy, bool accumulate, int terms) {
  if (terms == 1) {
    for (int i = 0; i < nr; ++i)
      for (int j = 0; j < nj; ++j) y[i * ldy + j] = accumulate ? y[i * ldy + j] + c[j][i] : c[j][i];
    return;
  }
#if defined(__AVX512F__)
  __m512 r[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_load_ps(c[j]);
  simd::transpose16(r);
  const __mmask16 mask = __mmask16((1u << nj) - 1);
  for (int i = 0; i < nr; ++i) {
    float* yr = y + i * ldy;
    const __m512 v = _mm512_add_ps(_mm512_add_ps(r[3 * i], r[3 * i + 1]), r[3 * i + 2]);
    _mm512_mask_storeu_ps(yr, mask, accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, yr), v) : v);
  }
#else
  for (int i = 0; i < nr; ++i)
    for (int j = 0; j < nj; ++j) {
      const float v = (c[j][3 * i] + c[j][3 * i + 1]) + c[j][3 * i + 2];
      y[i * ldy + j] = accumulate ? y[i * ldy + j] + v : v;
    }
#endif
}

// The configuration the calling thread's tiles hold (gemm_rows leaves it loaded for the next call,
// release_tiles drops it): a decode batch runs hundreds of items of one shape per thread, and
// LDTILECFG costs ~160 ns.
struct ThreadTiles {
  TileConfig cfg;
  bool on = false;
};
template <class Tiles>
ThreadTiles& thread_tiles() {
  thread_local ThreadTiles t;
  return t;
}
template <class Tiles>
void configure_once(const TileConfig& c) {
  ThreadTiles& t = thread_tiles<Tiles>();
  if (t.on && std::memcmp(&t.cfg, &c, sizeof c) == 0) return;
  Tiles::configure(c);
  t.cfg = c, t.on = true;
}
template <class Tiles>
void release_once() {
  ThreadTiles& t = thread_tiles<Tiles>();
  if (t.on) Tiles::release();
  t.on = false;
}

// The loop: for each pair of x-row blocks, for each k block, every pair (narrow: triple) of W
// blocks; C tiles wait in sc.out between k blocks. Decode-sized x (one x-row block) takes all of k
// at once: its B tiles are small and its C tiles never leave the registers.
template <class Tiles>
void gemm_rows_t(const PackedX& x, const uint16_t* w, int64_t ldw, bool tiled, int64_t nb, float* y, int64_t ldy,
                 bool accumulate) {
  thread_local Scratch sc;
  const bool narrow = x.col_blocks == 1;
  const int max_mw = max_w_blocks(narrow);
  const int64_t span = max_mw * kTileRows, groups = (nb + span - 1) / span;
  const int64_t kb = narrow ? std::max<int64_t>(x.chunks, 1) : kKBlock;
  sc.blocks.resize(size_t(groups * max_mw));
  sc.tails.resize(size_t(groups * max_mw * kTileRows * kChunk));
  sc.out.resize(size_t(groups));
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t r0 = gi * span, rem = nb - r0;
    const int mw = int(std::min<int64_t>(max_mw, (rem + kTileRows - 1) / kTileRows));
    for (int wb = 0; wb < mw; ++wb) {
      const int rows = int(std::min<int64_t>(kTileRows, rem - wb * kTileRows));
      // (only the last block can be partial, so one `part` serves)
      const uint16_t* wr = w + (r0 + wb * kTileRows) * ldw;
      uint16_t* tail = sc.tails.data() + (gi * max_mw + wb) * kTileRows * kChunk;
      sc.blocks[size_t(gi * max_mw + wb)] =
          tiled ? tiled_block(wr, x.chunks) : a_block(wr, ldw, x.k, x.chunks, rows, tail, sc.part);
    }
  }
  if (narrow)  // block wb of group gi runs on into block wb of group gi + 1, where that exists
    for (int64_t gi = 0; gi + 1 < groups; ++gi)
      for (int wb = 0; wb < max_mw && (gi + 1) * span + wb * kTileRows < nb; ++wb)
        sc.blocks[size_t(gi * max_mw + wb)].next = sc.blocks[size_t((gi + 1) * max_mw + wb)].base;
  configure_once<Tiles>(config_for(narrow, x.n_cols));
  for (int64_t cb0 = 0; cb0 < x.col_blocks; cb0 += 2) {
    const int nc = int(std::min<int64_t>(2, x.col_blocks - cb0));
    for (int64_t kc0 = 0; kc0 < std::max<int64_t>(x.chunks, 1); kc0 += kb) {
      const int64_t kc1 = std::min(x.chunks, kc0 + kb);
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int mw = int(std::min<int64_t>(max_mw, (nb - gi * span + kTileRows - 1) / kTileRows));
        micro_fn<Tiles>(narrow, mw, nc)(sc.blocks.data() + gi * max_mw, x, cb0, kc0, kc1, cb0 == 0, sc.out[size_t(gi)]);
      }
    }
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t r0 = gi * span;
      const int mw = int(std::min<int64_t>(max_mw, (nb - r0 + kTileRows - 1) / kTileRows));
      OutTiles& out = sc.out[size_t(gi)];
      for (int wb = 0; wb < mw; ++wb)
        for (int cb = 0; cb < nc; ++cb) {
          const int64_t i0 = (cb0 + cb) * x.rows_per_block, j0 = r0 + wb * kTileRows;
          const int64_t ni = std::min<int64_t>(x.rows_per_block, x.m - i0), nj = std::min<int64_t>(kTileRows, nb - j0);
          store_rows(out[wb][cb], int(ni), int(nj), y + i0 * ldy + j0, ldy, accumulate, x.terms);
        }
    }
  }
}

#if defined(__x86_64__) && defined(__linux__)
uint64_t xcr0() {
  uint32_t lo, hi;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return uint64_t(hi) << 32 | lo;
}

std::string probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "cpuid has no leaf 7";
  if (!(d & (1u << 24))) return "the CPU has no AMX-TILE";
  if (!(d & (1u << 22))) return "the CPU has no AMX-BF16";
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return "the OS has not enabled XSAVE";
  if ((xcr0() & (3u << 17)) != (3u << 17)) return "the OS has not enabled the AMX tile state (XCR0 bits 17, 18)";
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0)
    return std::string("the kernel refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM: ") + std::strerror(errno) +
           "; Linux >= 5.16 grants it unless a thread has a small sigaltstack)";
  return "";
}
#else
std::string probe() { return "AMX needs x86-64 Linux"; }
#endif

}  // namespace

bool available(std::string* why) {
  static const std::string missing = probe();
  if (why) *why = missing;
  return missing.empty();
}

void split_terms(float v, uint16_t out[kTerms]) {
  if (!std::isfinite(v)) {
    out[0] = f32_to_bf16(v);
    out[1] = out[2] = 0;
    return;
  }
  for (int t = 0; t < kTerms; ++t) {
    uint16_t h = f32_to_bf16(v);
    if (!std::isfinite(bf16_to_f32(h))) {  // rounds past the largest bf16: truncate instead
      uint32_t u;
      std::memcpy(&u, &v, 4);
      h = uint16_t(u >> 16);
    }
    out[t] = h;
    v -= bf16_to_f32(h);  // exact (Sterbenz): h is within a factor 2 of v
  }
}

namespace {

// The terms of 32 values at once, branch-free (vectorized by the compiler) for finite values
// whose first term does not round past the largest bf16; the rest through split_terms.
void split_chunk(const float* v, int n, uint16_t out[kTerms][kChunk]) {
  float r[kChunk] = {};
  if (n > 0) std::memcpy(r, v, size_t(n) * 4);
  uint32_t special = 0;
  for (int t = 0; t < kTerms; ++t)
    for (int c = 0; c < kChunk; ++c) {
      const uint16_t h = f32_to_bf16(r[c]);
      special |= uint32_t((h & 0x7f80u) == 0x7f80u);  // inf / NaN / overflow
      out[t][c] = h;
      r[c] -= bf16_to_f32(h);
    }
  if (special)
    for (int c = 0; c < n; ++c) {
      uint16_t t3[kTerms];
      split_terms(v[c], t3);
      for (int t = 0; t < kTerms; ++t) out[t][c] = t3[t];
    }
}

}  // namespace

namespace {

// The tile of x-row block cb, chunk kc (see pack_x), one row and chunk at a time through
// split_chunk: every case, special values included.
void pack_tile_scalar(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t cb, int64_t kc, PackedX& out) {
  for (int64_t r = 0; r < kRowsPerBlock; ++r) {
    const int64_t i = cb * kRowsPerBlock + r;
    if (i >= m && m <= kRowsPerBlock) return;  // no such column
    uint16_t t3[kTerms][kChunk];
    const int n = i < m ? int(std::min<int64_t>(kChunk, k - kc * kChunk)) : 0;
    split_chunk(n > 0 ? x + i * ldx + kc * kChunk : nullptr, n, t3);
    uint16_t* dst = out.data.data() + (cb * out.chunks + kc) * out.tile_elems() + r * kTerms * 2;
    for (int kk = 0; kk < kChunk / 2; ++kk)
      for (int t = 0; t < kTerms; ++t) std::memcpy(dst + (kk * out.ld + t) * 2, &t3[t][2 * kk], 4);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same tile in registers: each row's 32 values split into its three terms 16 lanes at a time
// (split_chunk's arithmetic: round to nearest even, subtract, exact), each term's 32 bf16 in k
// order as one vector, i.e. 16 k pairs as 16 dwords; the 15 term vectors (row r, term t at 3 r +
// t) transposed as a 16 x 16 dword block are the tile's 16 rows. Columns past the block's rows
// are zero. False, with nothing written, when a term is inf / NaN / rounds past the largest bf16
// (then pack_tile_scalar). An expert's x (64 x 2048, one thread): 2.4 -> 0.8 ns per element.
bool pack_tile_avx512(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t cb, int64_t kc, PackedX& out) {
  alignas(64) static const uint16_t odd_words[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i high_halves = _mm512_load_si512(odd_words);  // word 2j + 1 of a, then of b
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000), one = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_set1_epi32(0x7fff), keep = _mm512_set1_epi32(int(0xffff0000u));
  const int n = int(std::min<int64_t>(kChunk, k - kc * kChunk));
  const __mmask16 m0 = __mmask16((1u << std::min(n, 16)) - 1), m1 = __mmask16((1u << std::max(n - 16, 0)) - 1);
  __m512 r[16];
  __mmask16 special = 0;
  for (int row = 0; row < kRowsPerBlock; ++row) {
    const int64_t i = cb * kRowsPerBlock + row;
    if (i >= m) {  // a zero row of x (past m): zero terms
      for (int t = 0; t < kTerms; ++t) r[kTerms * row + t] = _mm512_setzero_ps();
      continue;
    }
    __m512 v[2] = {_mm512_maskz_loadu_ps(m0, x + i * ldx + kc * kChunk),
                   _mm512_maskz_loadu_ps(m1, x + i * ldx + kc * kChunk + 16)};
    for (int t = 0; t < kTerms; ++t) {
      __m512i h[2];
      for (int e = 0; e < 2; ++e) {
        const __m512i u = _mm512_castps_si512(v[e]);
        // u + 0x7fff + ((u >> 16) & 1): the bf16 in the high half (f32_to_bf16 for finite u)
        h[e] = _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        special |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exp_mask), exp_mask) |
                   _mm512_cmpeq_epi32_mask(_mm512_and_si512(h[e], exp_mask), exp_mask);
        v[e] = _mm512_sub_ps(v[e], _mm512_castsi512_ps(_mm512_and_si512(h[e], keep)));
      }
      r[kTerms * row + t] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(h[0], high_halves, h[1]));
    }
  }
  if (special) return false;
  uint16_t* dst = out.data.data() + (cb * out.chunks + kc) * out.tile_elems();
  if (m == 1) {  // decode: tile rows of 4 dwords (the three terms' pairs and a zero), 4 rows per vector
    alignas(64) static const int32_t from01[16] = {0, 16, 0, 0, 1, 17, 0, 0, 2, 18, 0, 0, 3, 19, 0, 0};
    alignas(64) static const int32_t from2[16] = {0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0};
    const __m512i i01 = _mm512_load_si512(from01), i2 = _mm512_load_si512(from2), four = _mm512_set1_epi32(4);
    __m512i a01 = i01, a2 = i2;
    const __m512i p0 = _mm512_castps_si512(r[0]), p1 = _mm512_castps_si512(r[1]), p2 = _mm512_castps_si512(r[2]);
    for (int q = 0; q < 4; ++q) {  // tile rows 4 q .. 4 q + 3
      const __m512i lo = _mm512_maskz_permutex2var_epi32(__mmask16(0x3333), p0, a01, p1);
      const __m512i v = _mm512_mask_permutexvar_epi32(lo, __mmask16(0x4444), a2, p2);
      _mm512_store_si512(dst + q * 32, v);
      a01 = _mm512_add_epi32(a01, four), a2 = _mm512_add_epi32(a2, four);
    }
    return true;
  }
  r[15] = _mm512_setzero_ps();
  simd::transpose16(r);
  const __mmask16 cols = __mmask16((1u << out.ld) - 1);
  for (int kk = 0; kk < kTileRows; ++kk) _mm512_mask_storeu_ps(dst + kk * out.ld * 2, cols, r[kk]);
  return true;
}
#endif

}  // namespace

// The one-term tile of x-row block cb, chunk kc: column r = bf16(x[16 cb + r, 32 kc + 2 kk + {0, 1}]).
static void pack_tile_single(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t cb, int64_t kc, PackedX& out) {
  uint16_t* dst = out.data.data() + (cb * out.chunks + kc) * out.tile_elems();
  for (int64_t r = 0; r < out.n_cols; ++r) {
    const int64_t i = cb * out.rows_per_block + r;
    for (int kk = 0; kk < kChunk / 2; ++kk)
      for (int e = 0; e < 2; ++e) {
        const int64_t c = kc * kChunk + 2 * kk + e;
        dst[(kk * out.ld + r) * 2 + e] = i < m && c < k ? f32_to_bf16(x[i * ldx + c]) : uint16_t(0);
      }
  }
}

void pack_x(const float* x, int64_t ldx, int64_t m, int64_t k, PackedX& out, int terms) {
  CHECK(terms == kTerms || terms == 1, "amx::pack_x: ", terms, " terms (expected 1 or ", kTerms, ")");
  out.m = m;
  out.k = k;
  out.terms = terms;
  out.rows_per_block = terms == 1 ? kTileRows : kRowsPerBlock;
  out.chunks = (k + kChunk - 1) / kChunk;
  out.col_blocks = (m + out.rows_per_block - 1) / out.rows_per_block;
  out.n_cols = int(terms * std::min<int64_t>(m, out.rows_per_block));
  out.ld = out.n_cols <= 4 ? 4 : out.n_cols <= 8 ? 8 : 16;
  // Grown, never shrunk: a buffer reused for x of varying size (prefill's experts) is not zero-filled
  // again on every call. Every element a tile reads is written below.
  const size_t need = size_t(out.col_blocks * out.chunks * out.tile_elems());
  if (out.data.size() < need) out.data.resize(need);
  // Row i of x is row r = i % 5 of block i / 5: the B tile element (kk, 3 r + t) of chunk kc (2
  // bf16, row stride ld) holds term t of x[i, 32 kc + 2 kk + {0, 1}]; k past its end is zero.
  // Rows i >= m of the last block (m > 5) are zero rows of x.
  const auto block = [&](int64_t cb) {
    for (int64_t kc = 0; kc < out.chunks; ++kc) {
      if (terms == 1) {
        pack_tile_single(x, ldx, m, k, cb, kc, out);
        continue;
      }
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (pack_tile_avx512(x, ldx, m, k, cb, kc, out)) continue;
#endif
      pack_tile_scalar(x, ldx, m, k, cb, kc, out);
    }
  };
  // (A branch, not `parallel if`: a region whose if is false still costs ~0.5 us, and decode packs
  // a few hundred small x per token.)
  if (m * k >= kPackParallelElems) {
#pragma omp parallel for schedule(static)
    for (int64_t cb = 0; cb < out.col_blocks; ++cb) block(cb);
  } else {
    for (int64_t cb = 0; cb < out.col_blocks; ++cb) block(cb);
  }
}

void gemm_rows(const PackedX& x, const uint16_t* w, int64_t ldw, bool tiled, int64_t nb, float* y, int64_t ldy,
               bool accumulate, bool emulated) {
  if (nb <= 0 || x.m <= 0) return;
  CHECK(!tiled || ldw >= x.chunks * kChunk, "amx::gemm_rows: a kTile16 weight with ld ", ldw, " for k = ", x.k);
  if (emulated) return gemm_rows_t<EmuTiles>(x, w, ldw, tiled, nb, y, ldy, accumulate);
#if defined(__x86_64__)
  CHECK(available(), "amx::gemm_rows: this machine cannot run AMX");
  return gemm_rows_t<HwTiles>(x, w, ldw, tiled, nb, y, ldy, accumulate);
#else
  GLM5_FAIL("amx::gemm_rows: AMX needs x86-64");
#endif
}

void release_tiles() {
  release_once<EmuTiles>();
#if defined(__x86_64__)
  release_once<HwTiles>();
#endif
}

double tile_macs_per_second(int64_t iters) {
  CHECK(available(), "amx::tile_macs_per_second: this machine cannot run AMX");
#if defined(__x86_64__)
  using T = HwTiles;
  configure_once<T>(config_for(false, kTileRows));
  T::zero<0>(), T::zero<1>(), T::zero<2>(), T::zero<3>(), T::zero<4>(), T::zero<5>(), T::zero<6>();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    T::dp<0, 4, 6>(), T::dp<1, 5, 6>(), T::dp<2, 4, 6>(), T::dp<3, 5, 6>();
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  release_once<T>();
  return double(iters) * 4 * kTileRows * kTileRows * kChunk / dt;
#else
  return 0;
#endif
}

}  // namespace glm5::kernels::cpu::amx
