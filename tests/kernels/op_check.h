// Test helpers shared by every backend test: buffers with guard values after each output, one
// comparison of a backend against another on an OpCase (normalised max error, NaN/inf parity,
// exact integers, guards intact), and deterministic random data. Header-only so that any
// tests/kernels/test_*.cpp (CPU now, CUDA later) can use it; the case lists are in op_cases.h.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__clang__) && __clang_major__ < 15 && defined(__F16C__)
#include <immintrin.h>  // _cvtss_sh
#endif
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace glm5::kernels::test {

// Values written after every output buffer; an op that touches them wrote out of bounds.
constexpr size_t kGuard = 16;
constexpr uint32_t kFloatSentinel = 0x7fc0dead;  // a quiet NaN with a recognisable payload
constexpr int32_t kIntSentinel = 0x5a5a5a5a;

inline float float_sentinel() {
  float f;
  std::memcpy(&f, &kFloatSentinel, 4);
  return f;
}

// Uniform floats in [lo, hi) from a fixed seed.
inline std::vector<float> random_floats(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

inline std::vector<int32_t> random_ints(size_t n, uint64_t seed, int32_t lo, int32_t hi) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> u(lo, hi);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

// Host bytes of a weight matrix in `dtype`, converted from float values (rounded to nearest).
inline std::vector<uint8_t> weight_bytes(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::F32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else if (dtype == DType::BF16) {
      uint16_t h = f32_to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else if (dtype == DType::F16) {
      // float -> half by the compiler's _Float16, or F16C where the compiler lacks it on x86
      // (clang < 15): both round to nearest even, independently of the kernels' own conversion.
#if defined(__clang__) && __clang_major__ < 15 && defined(__F16C__)
      const uint16_t h = _cvtss_sh(v[i], _MM_FROUND_TO_NEAREST_INT);
#else
      _Float16 h = static_cast<_Float16>(v[i]);
#endif
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      ADD_FAILURE() << "weight_bytes: no conversion to " << dtype_name(dtype);
    }
  }
  return out;
}

// What one op call produced, read back to the host: outputs in creation order, guards checked.
struct Outputs {
  std::vector<std::string> float_names, int_names;
  std::vector<std::vector<float>> floats;
  std::vector<std::vector<int32_t>> ints;
  std::vector<std::string> guard_errors;
};

// The device buffers of one op call on one backend. Inputs are copied in; outputs get kGuard
// sentinel values after them and start filled with the sentinel (or given initial values).
class Buffers {
 public:
  explicit Buffers(Backend& b) : b_(b) {}
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (void* p : owned_) b_.free(p);
  }

  Backend& backend() { return b_; }

  const float* in(const std::vector<float>& v) { return static_cast<const float*>(copy_in(v.data(), v.size() * 4)); }
  const int32_t* in(const std::vector<int32_t>& v) {
    return static_cast<const int32_t*>(copy_in(v.data(), v.size() * 4));
  }
  const void* in_bytes(const std::vector<uint8_t>& v) { return copy_in(v.data(), v.size()); }

  // An output of n floats, initially the sentinel (so unwritten elements show as NaN).
  float* out(const std::string& name, size_t n) { return out(name, std::vector<float>(n, float_sentinel())); }
  // An in/out buffer (accumulate, in-place ops) starting at `init`.
  float* out(const std::string& name, const std::vector<float>& init) {
    std::vector<float> host(init);
    host.resize(init.size() + kGuard, float_sentinel());
    auto* p = static_cast<float*>(copy_in(host.data(), host.size() * 4));
    float_outs_.push_back({name, p, init.size()});
    return p;
  }
  int32_t* out_i32(const std::string& name, size_t n) {
    std::vector<int32_t> host(n + kGuard, kIntSentinel);
    auto* p = static_cast<int32_t*>(copy_in(host.data(), host.size() * 4));
    int_outs_.push_back({name, p, n});
    return p;
  }

  Outputs fetch() {
    b_.synchronize();
    Outputs o;
    for (const auto& f : float_outs_) {
      std::vector<float> host(f.n + kGuard);
      b_.to_host(host.data(), f.p, host.size() * 4);
      for (size_t g = 0; g < kGuard; ++g) {
        uint32_t bits;
        std::memcpy(&bits, &host[f.n + g], 4);
        if (bits != kFloatSentinel)
          o.guard_errors.push_back(f.name + ": guard " + std::to_string(g) + " after " + std::to_string(f.n) +
                                   " elements was overwritten");
      }
      host.resize(f.n);
      o.float_names.push_back(f.name);
      o.floats.push_back(std::move(host));
    }
    for (const auto& f : int_outs_) {
      std::vector<int32_t> host(f.n + kGuard);
      b_.to_host(host.data(), f.p, host.size() * 4);
      for (size_t g = 0; g < kGuard; ++g)
        if (host[f.n + g] != kIntSentinel)
          o.guard_errors.push_back(f.name + ": guard " + std::to_string(g) + " after " + std::to_string(f.n) +
                                   " elements was overwritten");
      host.resize(f.n);
      o.int_names.push_back(f.name);
      o.ints.push_back(std::move(host));
    }
    return o;
  }

 private:
  void* copy_in(const void* src, size_t bytes) {
    void* p = b_.alloc(bytes ? bytes : 4);
    owned_.push_back(p);
    if (bytes) b_.to_device(p, src, bytes);
    return p;
  }
  template <class T>
  struct Out {
    std::string name;
    T* p;
    size_t n;
  };
  Backend& b_;
  std::vector<void*> owned_;
  std::vector<Out<float>> float_outs_;
  std::vector<Out<int32_t>> int_outs_;
};

// One op call with its inputs: `run` builds the params from Buffers and calls the op. The inputs
// live in the closure, so every backend sees the same data.
struct OpCase {
  std::string name;
  std::function<void(Buffers&)> run;
  double tol = 1e-5;  // normalised max error: max |a - b| / max |b| over finite elements
};

// gtest prints a failing parameter with these.
inline void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

inline Outputs run_case(Backend& b, const OpCase& c) {
  Buffers buf(b);
  c.run(buf);
  return buf.fetch();
}

// Float outputs: same size, same NaN / +-inf positions, normalised max error <= tol.
inline ::testing::AssertionResult compare_floats(const std::string& what, const std::vector<float>& a,
                                                 const std::vector<float>& ref, double tol) {
  if (a.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << a.size() << " vs " << ref.size();
  double max_ref = 0.0, max_err = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    bool fa = std::isfinite(a[i]), fr = std::isfinite(ref[i]);
    if (fa != fr || (!fa && !(std::isnan(a[i]) ? std::isnan(ref[i]) : a[i] == ref[i])))
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: " << a[i] << " vs reference " << ref[i] << " (NaN/inf parity)";
    if (!fr) continue;
    max_ref = std::max(max_ref, std::fabs(double(ref[i])));
    double e = std::fabs(double(a[i]) - double(ref[i]));
    if (e > max_err) max_err = e, worst = i;
  }
  double nerr = max_err / (max_ref > 0.0 ? max_ref : 1.0);
  if (nerr > tol)
    return ::testing::AssertionFailure() << what << ": normalised max error " << nerr << " > " << tol << " at ["
                                         << worst << "]: " << a[worst] << " vs reference " << ref[worst]
                                         << " (max |reference| " << max_ref << ")";
  return ::testing::AssertionSuccess();
}

// Runs `c` on `b` and on `ref` and compares every output.
inline ::testing::AssertionResult compare(Backend& b, Backend& ref, const OpCase& c) {
  Outputs ob = run_case(b, c), orf = run_case(ref, c);
  std::ostringstream why;
  for (const auto& e : ob.guard_errors) why << b.name() << " " << e << "; ";
  for (const auto& e : orf.guard_errors) why << ref.name() << " " << e << "; ";
  if (!why.str().empty()) return ::testing::AssertionFailure() << c.name << ": " << why.str();
  if (ob.floats.size() != orf.floats.size() || ob.ints.size() != orf.ints.size())
    return ::testing::AssertionFailure() << c.name << ": different output lists";
  for (size_t i = 0; i < ob.floats.size(); ++i) {
    auto r = compare_floats(c.name + " " + ob.float_names[i], ob.floats[i], orf.floats[i], c.tol);
    if (!r) return r;
  }
  for (size_t i = 0; i < ob.ints.size(); ++i)
    for (size_t j = 0; j < ob.ints[i].size(); ++j)
      if (ob.ints[i][j] != orf.ints[i][j])
        return ::testing::AssertionFailure() << c.name << " " << ob.int_names[i] << "[" << j << "]: " << ob.ints[i][j]
                                             << " vs reference " << orf.ints[i][j];
  return ::testing::AssertionSuccess();
}

// A batch-invariance probe: `run(buffers, rows, probe)` makes a call with `rows` rows in which
// row `probe` has fixed inputs (the others are random, seeded by `rows`) and returns where that
// row's result lies in the call's first float output: {first element, element count}.
// The probe's bytes must not depend on rows or probe.
struct RowCase {
  std::string name;
  std::function<std::pair<size_t, size_t>(Buffers&, int64_t rows, int64_t probe)> run;
};

inline void PrintTo(const RowCase& c, std::ostream* os) { *os << c.name; }

inline std::vector<uint8_t> probe_bytes(Backend& b, const RowCase& c, int64_t rows, int64_t probe) {
  Buffers buf(b);
  auto [first, count] = c.run(buf, rows, probe);
  Outputs o = buf.fetch();
  EXPECT_TRUE(o.guard_errors.empty()) << c.name << ": " << o.guard_errors.front();
  std::vector<uint8_t> bytes(count * 4);
  if (o.floats.empty() || first + count > o.floats[0].size()) {
    ADD_FAILURE() << c.name << ": probe slice outside the output";
    return bytes;
  }
  std::memcpy(bytes.data(), o.floats[0].data() + first, count * 4);
  return bytes;
}

// gtest-friendly name: letters, digits and '_' only.
inline std::string test_name(const std::string& s) {
  std::string r;
  for (char ch : s) r += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return r;
}

}  // namespace glm5::kernels::test
