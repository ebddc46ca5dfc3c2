// WeightArena: chunks of anonymous memory (madvise MADV_HUGEPAGE), filled by a parallel copy.
#include "cpu/weight_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace glm5::kernels::cpu {

namespace {

constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kChunkBytes = size_t(256) << 20;  // untouched tail pages of a chunk cost nothing
constexpr size_t kKeepFree = size_t(1) << 30;      // left for activations, KV and the OS

// Bytes this process may still take: MemAvailable, and the cgroup (v2) limit less its usage.
size_t memory_left() {
  size_t left = SIZE_MAX;
  std::ifstream mi("/proc/meminfo");
  std::string key;
  size_t kb = 0;
  while (mi >> key >> kb) {
    if (key == "MemAvailable:") left = kb * 1024;
    mi.ignore(64, '\n');
  }
  std::ifstream max_f("/sys/fs/cgroup/memory.max"), cur_f("/sys/fs/cgroup/memory.current");
  std::string max_s;
  size_t cur = 0;
  if (max_f >> max_s && max_s != "max" && cur_f >> cur) {
    const size_t lim = std::strtoull(max_s.c_str(), nullptr, 10);
    left = std::min(left, lim > cur ? lim - cur : 0);
  }
  return left;
}

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
  if (refused_ || size_t(bytes) + kKeepFree > memory_left()) {
    if (!refused_)
      std::fprintf(stderr,
                   "glm5: weights stay mapped from the checkpoint files (%.1f GB copied; the rest would not fit in "
                   "the memory left): decode reads them more slowly\n",
                   double(used_) / 1e9);
    refused_ = true;
    return false;
  }
  // Over-allocate by one huge page so that the chunk can start on a 2 MiB boundary.
  void* m = ::mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
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

const void* WeightArena::copy(const void* src, size_t bytes) {
  if (!copy_enabled() || bytes == 0) return nullptr;
  const size_t need = (bytes + 63) / 64 * 64;
  if (chunks_.empty() || chunks_.back().size - chunks_.back().used < need)
    if (!grow(need)) return nullptr;
  Chunk& c = chunks_.back();
  char* dst = c.base + c.used;
  c.used += need;
  used_ += bytes;
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

}  // namespace glm5::kernels::cpu
