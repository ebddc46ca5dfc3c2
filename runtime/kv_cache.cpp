// KvPool and BlockManager: see kv_cache.h.
#include "runtime/kv_cache.h"

#include <unistd.h>

#include <algorithm>

#include "kernels/core/check.h"

namespace glm5::runtime {

namespace {
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

std::vector<uint64_t> prefix_hashes(const std::vector<int32_t>& prompt) {
  std::vector<uint64_t> out;
  const int64_t full = (int64_t(prompt.size()) - 1) / kBlockTokens;
  uint64_t h = 0x243f6a8885a308d3ull;
  for (int64_t j = 0; j < full; ++j) {
    for (int64_t t = j * kBlockTokens; t < (j + 1) * kBlockTokens; ++t) h = mix(h ^ uint32_t(prompt[size_t(t)]));
    out.push_back(h);
  }
  return out;
}

KvPool::KvPool(kernels::Backend& backend, const ModelConfig& cfg, int first_layer, int last_layer, int64_t num_blocks,
               DType dtype)
    : backend_(backend), num_blocks_(num_blocks), dtype_(dtype), index_tiles_(backend.index_key_tiles()) {
  CHECK(num_blocks >= 1, "KV cache: need at least one block, got ", num_blocks);
  CHECK(dtype == DType::F32 || dtype == DType::BF16, "KV cache: kv_dtype must be f32 or bf16, found ",
        dtype_name(dtype));
  const size_t rows = size_t(num_blocks * kBlockTokens), es = dtype_size(dtype);
  const size_t lat = size_t(cfg.kv_lora_rank + cfg.qk_rope_head_dim), ik = size_t(cfg.index_head_dim);
  for (int l = first_layer; l < last_layer; ++l) {
    latent_.push_back(backend.alloc(rows * lat * es));
    index_k_.push_back(cfg.has_indexer(l) ? backend.alloc(rows * ik * es) : nullptr);
  }
}

KvPool::~KvPool() {
  for (void* p : latent_) backend_.free(p);
  for (void* p : index_k_)
    if (p) backend_.free(p);
}

size_t KvPool::bytes_per_token(const ModelConfig& cfg, int first, int last, DType dtype) {
  size_t values = 0;
  for (int l = first; l < last; ++l)
    values += size_t(cfg.kv_lora_rank + cfg.qk_rope_head_dim) + (cfg.has_indexer(l) ? size_t(cfg.index_head_dim) : 0);
  return values * dtype_size(dtype);
}

int64_t KvPool::blocks_for_budget(const ModelConfig& cfg, size_t stage_bytes_per_token, double budget_bytes,
                                  int max_batch) {
  const double per_block = double(std::max<size_t>(stage_bytes_per_token, 1)) * double(kBlockTokens);
  if (budget_bytes > 0) return int64_t(budget_bytes / per_block);
  // No budget: max_batch full contexts, but at most a quarter of this machine's memory (and 64
  // GiB): a real GLM-5 config (202752 positions) would otherwise ask for more than it has.
  const double ram = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGESIZE));
  const double cap = std::min(double(int64_t(64) << 30), ram > 0 ? ram / 4 : double(int64_t(64) << 30)) / per_block;
  const double want = double(max_batch) * double(blocks_for(cfg.max_position_embeddings + 1));
  return std::max<int64_t>(1, int64_t(std::min(want, cap)));
}

BlockManager::BlockManager(int64_t num_blocks)
    : refs_(size_t(std::max<int64_t>(0, num_blocks)), 0), cached_(refs_.size(), 0) {
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));  // block 0 first
}

int32_t BlockManager::allocate(int32_t* evicted) {
  *evicted = -1;
  int32_t b = -1;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    while (!lru_.empty() && b < 0) {
      const int32_t c = lru_.front();
      lru_.pop_front();
      if (cached_[size_t(c)]) b = c;
    }
    if (b < 0) return -1;
    cached_[size_t(b)] = 0;
    --cached_count_;
    *evicted = b;
  }
  refs_[size_t(b)] = 1;
  return b;
}

void BlockManager::retain(int32_t block) {
  if (cached_[size_t(block)]) {
    cached_[size_t(block)] = 0;
    --cached_count_;
  } else {
    CHECK(refs_[size_t(block)] > 0, "internal: retain of free KV block ", block);
  }
  ++refs_[size_t(block)];
}

void BlockManager::release(int32_t block, bool keep_cached) {
  CHECK(refs_[size_t(block)] > 0, "internal: release of free KV block ", block);
  if (--refs_[size_t(block)] > 0) return;
  if (keep_cached) {
    cached_[size_t(block)] = 1;
    ++cached_count_;
    lru_.push_back(block);
  } else {
    free_.push_back(block);
  }
}

}  // namespace glm5::runtime
