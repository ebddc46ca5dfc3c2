// A caching allocator for a backend's scratch memory: blocks are taken from the raw allocator
// (cudaMalloc, or host memory for the device-like test backend) once and then reused, so the step
// loop's many short-lived buffers cost no raw allocation and no device sync after the first step.
//
// Ordering: a backend with one in-order work queue (a CUDA stream) may hand a freed block to the
// next alloc() at once: every later use of it is queued behind every earlier use. A block that
// work on another queue (a communicator's stream) may still touch must not be freed until that
// work is ordered before the backend's queue (an event) or has completed (an isend's done()):
// the communicators' contract, which this class cannot check.
//
// Sizes are rounded up to size classes (512 bytes, then powers of two split in 4 steps: up to 25 %
// rounding), and a request takes the smallest free block of its class or of up to twice its size
// (so a block may be up to 2.5x the request), so a buffer that grows step by step (attention over
// a growing context) costs a raw allocation only every ~25 % of growth, not every step. Like
// PyTorch's caching allocator, freed blocks stay cached until a raw allocation fails: then every
// cached block goes back to the raw allocator and the allocation is tried once more; a backend
// whose other allocations fail (a library's workspace) calls release_cached() itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace glm5::kernels {

class CachingAllocator {
 public:
  // raw_alloc returns nullptr when it cannot serve the size (no throw); raw_free releases it.
  using RawAlloc = std::function<void*(size_t)>;
  using RawFree = std::function<void(void*)>;
  CachingAllocator(RawAlloc raw_alloc, RawFree raw_free)
      : raw_alloc_(std::move(raw_alloc)), raw_free_(std::move(raw_free)) {}
  ~CachingAllocator() { release_all(); }
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` (nullptr for 0 bytes, or when even an emptied cache leaves the
  // raw allocator unable to serve it: the caller reports that with its own words).
  void* alloc(size_t bytes) {
    if (bytes == 0 || bytes > kMaxBytes) return nullptr;
    const size_t size = size_class(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.lower_bound(size);  // entries are never empty
    if (it != free_.end() && it->first <= 2 * size) {
      const size_t got = it->first;
      void* p = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) free_.erase(it);
      cached_bytes_ -= got;
      live_[p] = got;
      return p;
    }
    void* p = raw_alloc_(size);
    if (!p && cached_bytes_ > 0) {
      release_cached_locked();
      p = raw_alloc_(size);
    }
    if (!p) return nullptr;
    ++raw_allocs_;
    live_[p] = size;
    return p;
  }

  // Returns a block to the cache (not to the raw allocator). Unknown pointers are a caller bug.
  bool free(void* p) {
    if (!p) return true;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) return false;
    free_[it->second].push_back(p);
    cached_bytes_ += it->second;
    live_.erase(it);
    return true;
  }

  // Gives every cached (free) block back to the raw allocator.
  void release_cached() {
    std::lock_guard<std::mutex> lock(mu_);
    release_cached_locked();
  }

  bool owns(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.count(const_cast<void*>(p)) > 0;
  }
  // Raw allocator calls so far (the step loop's should stay at 0 once warm) and raw frees.
  uint64_t raw_allocs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return raw_allocs_;
  }
  uint64_t raw_frees() const {
    std::lock_guard<std::mutex> lock(mu_);
    return raw_frees_;
  }
  size_t cached_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_bytes_;
  }

  // Largest request served (a size_t from a negative count is refused, not looped over).
  static constexpr size_t kMaxBytes = size_t(1) << 48;
  static size_t size_class(size_t bytes) {
    constexpr size_t kMin = 512;
    if (bytes <= kMin) return kMin;
    size_t pow2 = kMin;
    while (pow2 * 2 < bytes) pow2 *= 2;  // pow2 < bytes <= 2 * pow2
    const size_t step = pow2 / 4;
    return (bytes + step - 1) / step * step;
  }

 private:
  void release_cached_locked() {
    for (auto& [size, blocks] : free_)
      for (void* p : blocks) {
        raw_free_(p);
        ++raw_frees_;
      }
    free_.clear();
    cached_bytes_ = 0;
  }
  void release_all() {
    release_cached_locked();
    for (auto& [p, size] : live_) {
      raw_free_(p);
      ++raw_frees_;
    }
    live_.clear();
  }

  RawAlloc raw_alloc_;
  RawFree raw_free_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // size class -> free blocks (never empty)
  std::unordered_map<void*, size_t> live_;     // handed out -> size class
  size_t cached_bytes_ = 0;
  uint64_t raw_allocs_ = 0, raw_frees_ = 0;
};

}  // namespace glm5::kernels
