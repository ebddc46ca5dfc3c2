// The paged KV cache. Every rank holds, for each of its layers, a pool of fixed-size blocks of
// kBlockTokens positions: latent rows [kv_lora_rank + qk_rope_head_dim] (c_kv after
// kv_a_layernorm | k_pe after RoPE) and indexer-key rows [index_head_dim] (after k_norm and
// RoPE), float32 or bfloat16 (kv_dtype) in backend memory. A sequence's cache is its block
// table: position t lives in row table[t / kBlockTokens] * kBlockTokens + t % kBlockTokens of
// the pool (kernels/ops.h KeyPages). Where the backend asks for it (Backend::index_key_tiles),
// each block of indexer keys is stored transposed, [index_head_dim][kBlockTokens]. Block ids
// are handed out by the column's scheduler (BlockManager) and are the same on every stage of the
// column, whose pools have the same number of blocks.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "kernels/ops.h"
#include "runtime/config.h"

namespace glm5::runtime {

constexpr int64_t kBlockTokens = 64;  // FlashMLA's page size, and the cpu backend's indexer tile

inline int64_t blocks_for(int64_t tokens) { return (tokens + kBlockTokens - 1) / kBlockTokens; }

// Hash chain of the full blocks of prompt positions [0, P - 1): block j's hash covers every token
// up to the end of block j (prefix sharing: runtime/scheduler.h). The last prompt position is left
// out: it is always computed (its logits are sampled).
std::vector<uint64_t> prefix_hashes(const std::vector<int32_t>& prompt);

class KvPool {
 public:
  // The rows of layers [first_layer, last_layer) (layer num_hidden_layers: the MTP layer); local
  // layer i is layer first_layer + i. Memory is taken from the backend up front; on the CPU backend
  // pages are touched only as blocks are written, so an unused block costs address space, not RAM.
  KvPool(kernels::Backend& backend, const ModelConfig& cfg, int first_layer, int last_layer, int64_t num_blocks,
         DType dtype = DType::F32);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  int64_t num_blocks() const { return num_blocks_; }
  DType dtype() const { return dtype_; }
  // Whether indexer keys are kept in tiles (the backend asks for it: Backend::index_key_tiles).
  bool index_tiles() const { return index_tiles_; }
  // Row arrays [num_blocks * kBlockTokens, width] of `dtype` elements (F32 or BF16); indexer keys
  // in tiles of a block ([width][kBlockTokens] each) when index_tiles().
  void* latent(int local_layer) const { return latent_[size_t(local_layer)]; }
  // nullptr for a layer without an indexer (a "shared" layer of GLM-5.2's IndexShare).
  void* index_k(int local_layer) const { return index_k_[size_t(local_layer)]; }

  // Bytes one cached position costs over layers [first, last): a latent row per layer, an indexer
  // key per layer with an indexer (ModelConfig::has_indexer).
  static size_t bytes_per_token(const ModelConfig& cfg, int first, int last, DType dtype = DType::F32);
  // Blocks per rank for a KV budget (bytes), the largest stage's position costing
  // stage_bytes_per_token. Without a budget: enough for max_batch sequences at the full context, at
  // most a quarter of RAM and 64 GiB.
  static int64_t blocks_for_budget(const ModelConfig& cfg, size_t stage_bytes_per_token, double budget_bytes,
                                   int max_batch);

 private:
  kernels::Backend& backend_;
  int64_t num_blocks_;
  DType dtype_;
  bool index_tiles_;
  std::vector<void*> latent_, index_k_;
};

// Block ids of one column's pools: a free list, reference counts (a block may be shared by
// sequences with the same prompt prefix), and cached blocks: unreferenced blocks that still
// hold a shareable prompt prefix, reused last (least recently released first) so that later
// requests of a job can still find the prefix. Runs on the column's stage-0 rank.
class BlockManager {
 public:
  explicit BlockManager(int64_t num_blocks);
  int64_t num_blocks() const { return int64_t(refs_.size()); }
  // Blocks a sequence can get now: free ones plus cached ones.
  int64_t free_blocks() const { return int64_t(free_.size()) + cached_count_; }
  int64_t unused_blocks() const { return int64_t(free_.size()); }  // of those, the ones holding nothing
  // A block (reference count 1), or -1 when none is left. A cached block is reused when no free
  // one is left: *evicted gets its id (its prefix is gone), else -1.
  int32_t allocate(int32_t* evicted);
  // One more reference; a cached block becomes referenced again.
  void retain(int32_t block);
  // Drops one reference. At zero the block is free again, or cached when keep_cached.
  void release(int32_t block, bool keep_cached);
  int32_t refs(int32_t block) const { return refs_[size_t(block)]; }

 private:
  std::vector<int32_t> free_;  // a stack: the most recently freed block is reused first
  std::vector<int32_t> refs_;
  std::vector<char> cached_;  // refs 0 and holding a prefix
  std::deque<int32_t> lru_;   // cached blocks, oldest first (entries no longer cached are skipped)
  int64_t cached_count_ = 0;
};

}  // namespace glm5::runtime
