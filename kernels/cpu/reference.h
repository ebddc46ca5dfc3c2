// The CPU reference ops as free functions (the executable spec of ops.h), the checks of host
// memory every CPU backend runs before an op, and the host-memory part of a Backend.
// The fast CPU backend reuses the reference functions for its cheap ops by calling them on row
// ranges; nothing here is threaded.
#pragma once

#include <sys/mman.h>

#include <unordered_map>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/ops.h"
#include "kernels/validate.h"

namespace glm5::kernels::cpu {

// The parameter checks are kernels/validate.h (every backend's). The checks of contents in host
// memory, which CPU backends run after them: token ids inside the table, gather rows >= 0, combine
// slots >= -1.
void validate_contents(const EmbeddingParams& p);
void validate_contents(const GatherRowsParams& p);
void validate_contents(const MoeCombineParams& p);

// Element i of a cached row array (F32 or BF16; kernels/ops.h KeyPages, Copy2dParams).
inline float cache_at(DType t, const void* base, int64_t i) {
  return t == DType::BF16 ? bf16_to_f32(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// The keys that query row s may attend to (ops.h, MlaPrefillParams): t < t_count, t <= q_pos and,
// when topk is given, t in topk[0:topk_len] (-1 ignored). Ascending, no duplicates.
// Throws when a topk entry is outside [-1, t_count).
void allowed_keys(int64_t t_count, int32_t q_pos, const int32_t* topk, int64_t topk_len, std::vector<int32_t>& out);

// Reference implementations (unchecked: callers run validate() first). Row-wise ops may be
// called on a sub-range of rows by offsetting the pointers and reducing m.
namespace ref {
void gemm(const GemmParams& p, Precision precision = Precision::kExact);
void rms_norm(const RmsNormParams& p);
void layer_norm(const LayerNormParams& p);
void rope(const RopeParams& p);
void indexer_scores(const IndexerScoresParams& p);
void topk(const TopkParams& p);
void mla_prefill(const MlaPrefillParams& p);
void mla_decode(const MlaDecodeParams& p);
void router(const RouterParams& p);
void swiglu(const SwigluParams& p);
void embedding(const EmbeddingParams& p);
void gather_rows(const GatherRowsParams& p);
void moe_combine(const MoeCombineParams& p);
void add(const AddParams& p);
void copy_2d(const Copy2dParams& p);
void paged_write(const PagedWriteParams& p);
}  // namespace ref

// Host memory: malloc/free/memcpy; weights are used in place (upload returns the host pointer).
// Freed blocks are kept (up to kMaxCachedBytes) and handed out again for the same block size
// (sizes rounded up to 4 classes per power of two, so at most a quarter is wasted; from 2 MiB on,
// then to whole 2 MiB huge pages, see raw_alloc): the model
// allocates similar scratch sizes every layer and step (row counts change from step to step),
// and returning them to the OS each time costs page faults and page clearing that showed up as
// a tenth of the CPU time.
class HostBackend : public Backend {
 public:
  static constexpr size_t kMaxCachedBytes = size_t(1) << 30;
  ~HostBackend() override {
    for (auto& [size, p] : cache_) std::free(p);
  }
  void* alloc(size_t bytes) override {
    if (!bytes) return nullptr;
    const size_t rounded = block_size(bytes);
    void* p = nullptr;
    if (auto it = cache_.find(rounded); it != cache_.end()) {
      p = it->second;
      cache_.erase(it);
      cached_bytes_ -= rounded;
    } else {
      p = raw_alloc(rounded);
      CHECK(p, name(), ": alloc of ", bytes, " bytes failed");
    }
    sizes_[p] = rounded;
    return p;
  }
  // 64-byte multiples up to 4 KiB, then 2^k * {4, 5, 6, 7} / 4 (64-byte alignment keeps vector
  // loads of a buffer's first row aligned).
  static size_t size_class(size_t bytes) {
    if (bytes <= 4096) return (bytes + 63) / 64 * 64;
    const int top = 63 - __builtin_clzll(bytes);  // 2^top <= bytes
    const size_t step = size_t(1) << (top - 2);
    return (bytes + step - 1) / step * step;
  }
  void free(void* p) override {
    if (!p) return;
    auto it = sizes_.find(p);
    CHECK(it != sizes_.end(), name(), ": free of a pointer this backend did not allocate");
    const size_t size = it->second;
    sizes_.erase(it);
    if (cached_bytes_ + size <= kMaxCachedBytes) {
      cache_.emplace(size, p);
      cached_bytes_ += size;
    } else {
      std::free(p);
    }
  }
  // Blocks of kHugeBytes and more (KV pools, long-prompt activations) start on a 2 MiB boundary
  // and ask for transparent huge pages: a decode step after 16k tokens scans 4 MB of indexer keys
  // per layer, and on 4 KiB pages every page costs a TLB walk (its page-table line evicted by the
  // weights streamed in between) and restarts the hardware prefetcher.
  // A block's size: its size class, and from kHugeBytes on a whole number of huge pages (what the
  // kernel commits once touched; the cache counts and reuses blocks by this size).
  static constexpr size_t kHugeBytes = size_t(2) << 20;
  static size_t block_size(size_t bytes) {
    const size_t c = size_class(bytes);
    return c < kHugeBytes ? c : (c + kHugeBytes - 1) / kHugeBytes * kHugeBytes;
  }
  static void* raw_alloc(size_t size) {
    if (size < kHugeBytes) return std::aligned_alloc(64, size);
    void* p = std::aligned_alloc(kHugeBytes, size);
    if (p) ::madvise(p, size, MADV_HUGEPAGE);
    return p;
  }
  void to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  const void* upload(const void* host, size_t) override { return host; }

 private:
  std::unordered_multimap<size_t, void*> cache_;  // size -> free block
  std::unordered_map<void*, size_t> sizes_;       // live block -> size
  size_t cached_bytes_ = 0;
};

}  // namespace glm5::kernels::cpu
