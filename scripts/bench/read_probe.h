// The memory read probe of the CPU benchmarks (bench_cpu, bench_kernels), so that both measure
// the bandwidth they set decode against the same way.
#pragma once

#include <omp.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

// A sum over `bytes` of floats with 64-byte vector accumulators (so the loop is limited by memory,
// not by a serial float reduction), on 2 MiB pages where the kernel gives them, as the weights are
// (cpu/weight_arena.h: 4 KiB pages would cost the sum a TLB walk per page and understate it).
class ReadProbe {
 public:
  typedef float v16 __attribute__((vector_size(64)));
  explicit ReadProbe(size_t bytes) : n_(bytes / sizeof(v16)) {
    a_ = static_cast<v16*>(std::aligned_alloc(size_t(2) << 20, n_ * sizeof(v16)));
    if (!a_) {
      std::fprintf(stderr, "cannot allocate %zu MiB for the memory read probe\n", bytes >> 20);
      std::exit(1);
    }
    ::madvise(a_, n_ * sizeof(v16), MADV_HUGEPAGE);
#pragma omp parallel for
    for (size_t i = 0; i < n_; ++i) a_[i] = v16{} + float(i & 1023);
  }
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;
  ~ReadProbe() { std::free(a_); }
  double gbs() const {  // GB/s of one sum over the buffer
    const auto t = std::chrono::steady_clock::now();
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
      v16 s0{}, s1{}, s2{}, s3{};
#pragma omp for
      for (size_t i = 0; i < n_; i += 4) {
        s0 += a_[i];
        s1 += a_[i + 1];
        s2 += a_[i + 2];
        s3 += a_[i + 3];
      }
      v16 s = s0 + s1 + s2 + s3;
      for (int j = 0; j < 16; ++j) total += s[j];
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    if (total < 0) std::puts("");
    return double(n_ * sizeof(v16)) / dt / 1e9;
  }

 private:
  size_t n_;
  v16* a_ = nullptr;
};
