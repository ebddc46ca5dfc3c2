// WeightArena: chunks of anonymous memory (madvise MADV_HUGEPAGE), filled by a parallel copy.
#include "kernels/cpu/weight_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace glm5::kernels::cpu {

namespace {

constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kChunkBytes = size_t(256) << 20;  // untouched tail pages of a chunk cost nothing

size_t meminfo(const char* key) {  // a /proc/meminfo field in bytes (0 if absent)
  std::ifstream mi("/proc/meminfo");
  std::string k;
  size_t kb = 0;
  while (mi >> k >> kb) {
    if (k == key) return kb * 1024;
    mi.ignore(64, '\n');
  }
  return 0;
}

// Bytes the process's cgroup (v2) may still take: its limit less what it uses, page cache not
// counted (reclaimable, and the checkpoint's own pages fill it while they are copied). SIZE_MAX
// without a limit. The process's own cgroup is read from /proc/self/cgroup.
size_t cgroup_left() {
  std::ifstream self("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(self, line))
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  const std::string dir = "/sys/fs/cgroup" + (path == "/" ? std::string() : path);
  std::ifstream max_f(dir + "/memory.max"), cur_f(dir + "/memory.current"), stat_f(dir + "/memory.stat");
  std::string max_s;
  size_t cur = 0;
  if (!(max_f >> max_s) || max_s == "max" || !(cur_f >> cur)) return SIZE_MAX;
  std::string k;
  size_t v = 0, file = 0;
  while (stat_f >> k >> v)
    if (k == "file") file = v;
  const size_t lim = std::strtoull(max_s.c_str(), nullptr, 10), used = cur > file ? cur - file : 0;
  return lim > used ? lim - used : 0;
}

// Memory to leave free after the copy: the default KV pool may take a quarter of RAM
// (runtime/kv_cache.cpp), plus activations and the OS.
size_t keep_free() { return std::max(size_t(1) << 30, meminfo("MemTotal:") / 4 + (size_t(1) << 30)); }

}  // namespace

bool WeightArena::copy_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("GLM5_CPU_WEIGHTS");
    const std::string v = e ? e : "";
    if (!v.empty() && v != "copy" && v != "mmap")
      std::fprintf(stderr, "glm5: GLM5_CPU_WEIGHTS=%s ignored (expected copy or mmap)\n", v.c_str());
    return v != "mmap";
  }();
  return on;
}

WeightArena::~WeightArena() {
  for (Chunk& c : chunks_) ::munmap(c.base, c.size);
}

bool WeightArena::grow(size_t bytes) {
  const size_t size = (std::max(bytes, kChunkBytes) + kHuge - 1) / kHuge * kHuge;
  const size_t left = std::min(meminfo("MemAvailable:"), cgroup_left());
  if (size + keep_free() > left) {
    std::fprintf(stderr,
                 "glm5: weights stay mapped from the checkpoint files from here on (%.1f GB copied; %.1f GB more "
                 "would leave less than %.1f GB of the %.1f GB available): decode reads them more slowly\n",
                 double(used_) / 1e9, double(size) / 1e9, double(keep_free()) / 1e9, double(left) / 1e9);
    refused_ = true;
    return false;
  }
  // Over-allocate by one huge page so that the chunk can start on a 2 MiB boundary.
  void* m = ::mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    std::fprintf(stderr, "glm5: weights stay mapped from the checkpoint files: mmap of %.1f GB failed (%s)\n",
                 double(size) / 1e9, std::strerror(errno));
    refused_ = true;
    return false;
  }
  char* base = static_cast<char*>(m);
  char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge);
  if (aligned > base) ::munmap(base, size_t(aligned - base));
  const size_t tail = size_t(base + size + kHuge - (aligned + size));
  if (tail) ::munmap(aligned + size, tail);
  ::madvise(aligned, size, MADV_HUGEPAGE);
  chunks_.push_back({aligned, size, 0});
  return true;
}

char* WeightArena::take(size_t bytes) {
  if (!copy_enabled() || refused_ || bytes == 0) return nullptr;
  const size_t need = (bytes + 63) / 64 * 64;
  if (chunks_.empty() || chunks_.back().size - chunks_.back().used < need)
    if (!grow(need)) return nullptr;
  Chunk& c = chunks_.back();
  char* dst = c.base + c.used;
  c.used += need;
  used_ += bytes;
  return dst;
}

const void* WeightArena::copy(const void* src, size_t bytes) {
  char* dst = take(bytes);
  if (!dst) return nullptr;
  // In 1 MiB pieces over the threads: the copy's source is the page cache (or the disk).
  constexpr size_t kPiece = size_t(1) << 20;
  const int64_t pieces = int64_t((bytes + kPiece - 1) / kPiece);
#pragma omp parallel for schedule(dynamic, 1) if (pieces > 1)
  for (int64_t i = 0; i < pieces; ++i) {
    const size_t off = size_t(i) * kPiece;
    std::memcpy(dst + off, static_cast<const char*>(src) + off, std::min(kPiece, bytes - off));
  }
  return dst;
}

const void* WeightArena::copy_interleaved(const void* src, size_t elem_bytes, int64_t rows, int64_t cols, int64_t ld,
                                          WeightLayout layout) {
  CHECK(layout == WeightLayout::kQuad16 || layout == WeightLayout::kTile16 || layout == WeightLayout::kPair16,
        "copy_interleaved: not a plain interleaved layout");
  CHECK(layout != WeightLayout::kPair16 || elem_bytes == 2, "copy_interleaved: kPair16 holds BF16 only");
  char* dst = take(interleaved_bytes(elem_bytes, rows, cols, layout));
  if (!dst) return nullptr;
  interleave(dst, src, elem_bytes, rows, cols, ld, layout);
  return dst;
}

void WeightArena::interleave(void* out, const void* src, size_t elem_bytes, int64_t rows, int64_t cols, int64_t ld,
                             WeightLayout layout) {
  const int64_t G = layout_group_rows(layout), C = layout_ld_multiple(layout);
  const int64_t groups = (rows + G - 1) / G, ldc = interleaved_ld(layout, cols);
  const size_t chunk = size_t(C) * elem_bytes;  // one row's C elements
  char* dst = static_cast<char*>(out);
  const char* s = static_cast<const char*>(src);
  if (layout == WeightLayout::kPair16) {  // chunks of one pair (a dword): each group written in order
    const auto* s16 = reinterpret_cast<const uint16_t*>(src);
    auto* d32 = reinterpret_cast<uint32_t*>(dst);
    const int64_t pairs = ldc / 2;
#pragma omp parallel for schedule(dynamic, 16) if (groups > 16)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t q = 0; q < pairs; ++q)
        for (int64_t c = 0; c < G; ++c) {
          const int64_t r = G * g + c, k = 2 * q;
          const uint16_t lo = r < rows && k < cols ? s16[r * ld + k] : uint16_t(0);
          const uint16_t hi = r < rows && k + 1 < cols ? s16[r * ld + k + 1] : uint16_t(0);
          d32[(g * G * ldc) / 2 + q * G + c] = uint32_t(lo) | uint32_t(hi) << 16;  // pair16_offset(r, k, ldc) / 2
        }
    return;
  }
#pragma omp parallel for schedule(dynamic, 256 / G) if (groups * G > 256)  // pieces of 256 rows
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t q = 0; q < ldc / C; ++q)
      for (int64_t c = 0; c < G; ++c) {
        char* out = dst + size_t(interleaved_offset(G * g + c, C * q, ldc, G, C)) * elem_bytes;
        const int64_t r = G * g + c, n = r < rows ? std::min<int64_t>(C, cols - C * q) : 0;
        if (n > 0) std::memcpy(out, s + size_t(r * ld + C * q) * elem_bytes, size_t(n) * elem_bytes);
        std::memset(out + size_t(n) * elem_bytes, 0, chunk - size_t(n) * elem_bytes);
      }
}

const void* WeightArena::copy_quant_quad(const void* src, DType t, int64_t rows, size_t rb) {
  CHECK(rb % quant::kQuadChunk == 0, "copy_quant_quad: rows of ", rb, " bytes, not a multiple of ", quant::kQuadChunk);
  const int64_t quads = (rows + 3) / 4;
  char* dst = take(size_t(quads) * 4 * rb);
  if (!dst) return nullptr;
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = reinterpret_cast<uint8_t*>(dst);
#pragma omp parallel for schedule(dynamic, 64) if (quads > 64)  // pieces of 256 rows
  for (int64_t q = 0; q < quads; ++q)
    quant::repack_quant_quad(t, s + size_t(4 * q) * rb, d + size_t(4 * q) * rb, std::min<int64_t>(4, rows - 4 * q), rb);
  return dst;
}

}  // namespace glm5::kernels::cpu
