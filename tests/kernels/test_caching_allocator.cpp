// The caching allocator (kernels/core/caching_allocator.h): blocks are reused, the raw allocator
// is called only on misses, and a failing raw allocator first gets the cache back.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

#include "kernels/core/caching_allocator.h"

namespace glm5::kernels {
namespace {

struct Raw {
  int allocs = 0, frees = 0;
  size_t limit = size_t(-1), in_use = 0;
  std::map<void*, size_t> live;
  CachingAllocator make() {
    return CachingAllocator(
        [this](size_t n) -> void* {
          if (in_use + n > limit) return nullptr;
          void* p = std::malloc(n);
          ++allocs;
          in_use += n;
          live[p] = n;
          return p;
        },
        [this](void* p) {
          ++frees;
          in_use -= live[p];
          live.erase(p);
          std::free(p);
        });
  }
};

TEST(CachingAllocator, ReusesFreedBlocksWithoutRawCalls) {
  Raw raw;
  {
    CachingAllocator a = raw.make();
    // A "step" allocating and freeing buffers of several sizes, run 10 times.
    for (int step = 0; step < 10; ++step) {
      void* x = a.alloc(4096);
      void* y = a.alloc(100000);
      void* z = a.alloc(3u << 20);
      ASSERT_TRUE(x && y && z);
      std::memset(z, 1, 3u << 20);
      EXPECT_TRUE(a.free(y));
      void* y2 = a.alloc(99000);  // same size class: the block just freed
      EXPECT_EQ(y2, y);
      EXPECT_TRUE(a.free(x));
      EXPECT_TRUE(a.free(y2));
      EXPECT_TRUE(a.free(z));
    }
    EXPECT_EQ(raw.allocs, 3);  // first step only
    EXPECT_EQ(a.raw_allocs(), 3u);
    EXPECT_EQ(raw.frees, 0);
    EXPECT_FALSE(a.free(reinterpret_cast<void*>(&raw)));  // not ours
    EXPECT_EQ(a.alloc(0), nullptr);
  }
  EXPECT_EQ(raw.frees, 3);  // the destructor returns everything
  EXPECT_TRUE(raw.live.empty());
}

TEST(CachingAllocator, SizeClassesBoundTheWaste) {
  for (size_t n : {size_t(1), size_t(511), size_t(513), size_t(1) << 20, (size_t(1) << 20) + 1, size_t(3) << 20,
                   size_t(5000000), size_t(1) << 30}) {
    const size_t c = CachingAllocator::size_class(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c, std::max<size_t>(512, n + n / 4)) << n;
  }
}

TEST(CachingAllocator, AGrowingBufferAllocatesOnlyEveryQuarterOfGrowth) {
  Raw raw;
  CachingAllocator a = raw.make();
  // 1,000 steps, each asking for 320 bytes more than the last (one more cached key row).
  for (size_t step = 1; step <= 1000; ++step) {
    void* p = a.alloc(4096 + 320 * step);
    ASSERT_TRUE(p);
    a.free(p);
  }
  EXPECT_LE(raw.allocs, 32);  // 4 classes per doubling over ~75x growth, not 1,000
}

TEST(CachingAllocator, AMissThatDoesNotFitReleasesTheCacheFirst) {
  Raw raw;
  raw.limit = 3u << 20;  // the "device" holds 3 MiB
  CachingAllocator a = raw.make();
  void* p = a.alloc(2u << 20);
  ASSERT_TRUE(p);
  a.free(p);
  EXPECT_EQ(a.cached_bytes(), size_t(2) << 20);
  // 2.5 MiB does not fit beside the cached 2 MiB: the cache goes back, then it fits.
  void* q = a.alloc((size_t(5) << 20) / 2);
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(raw.frees, 1);
  EXPECT_EQ(a.cached_bytes(), 0u);
  // More than the device holds: nullptr, no throw, nothing lost.
  EXPECT_EQ(a.alloc(4u << 20), nullptr);
  EXPECT_EQ(a.alloc(size_t(-64)), nullptr);  // a negative size cast to size_t: refused at once
  EXPECT_TRUE(a.owns(q));
  EXPECT_TRUE(a.free(q));
}

}  // namespace
}  // namespace glm5::kernels
