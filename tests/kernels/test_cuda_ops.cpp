// Every op of the CUDA backend against the reference backend: the shared case lists of
// op_cases.h (as the CPU backend is checked), then CUDA-specific cases: GLM-5 sizes (64 heads,
// 576/512 latent, index top-k 2048 over a 128k context), every GEMM activation split, quantized
// weights (FP8 block-scaled, int4 / int8 group-wise, both GLM5_CUDA_QUANT_GEMM modes), both
// GLM5_CUDA_GEMM modes, batch invariance (GEMM rows for m = 1..2048 on every route; MLA decode and
// indexer rows alone, in 37 and in 150), device hygiene (no cudaMalloc in a warm step loop; a
// to_device source reusable at return), device-side input errors. Outputs are poisoned before
// each op and guarded after their end. Without a usable GPU every test skips with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/core/check.h"
#include "kernels/core/dtype.h"
#include "kernels/core/quant.h"
#include "kernels/ops.h"
#include "tests/kernels/op_cases.h"

namespace glm5::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr size_t kGuard = 64;  // elements after every device buffer, checked for stray writes

// Why cuda_available() is false, in the factory's own words.
std::string cuda_skip_reason() {
  try {
    make_cuda_backend(0);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "cuda_available() is false";
}

template <class T>
T guard_value() {
  if constexpr (std::is_same_v<T, float>)
    return 12345.678f;
  else if constexpr (std::is_same_v<T, int32_t>)
    return int32_t(0x5eed5eed);
  else
    return T(0xbeef);
}

// A device copy of a host vector with kGuard sentinel elements after it.
template <class T>
class Dev {
 public:
  Dev(Backend& b, const std::vector<T>& host) : b_(b), n_(host.size()) {
    p_ = static_cast<T*>(b_.alloc((n_ + kGuard) * sizeof(T)));
    std::vector<T> full(host);
    full.resize(n_ + kGuard, guard_value<T>());
    b_.to_device(p_, full.data(), full.size() * sizeof(T));
  }
  ~Dev() { b_.free(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  T* get() const { return p_; }
  // Contents back on the host; a changed guard element is a failure of `what`.
  std::vector<T> host(const std::string& what = "") const {
    std::vector<T> v(n_ + kGuard);
    b_.to_host(v.data(), p_, v.size() * sizeof(T));
    const T guard = guard_value<T>();
    for (size_t i = n_; i < v.size(); ++i)
      if (std::memcmp(&v[i], &guard, sizeof(T)) != 0) {
        ADD_FAILURE() << what << ": write past the end of the buffer at element " << i << " (size " << n_ << ")";
        break;
      }
    v.resize(n_);
    return v;
  }

 private:
  Backend& b_;
  size_t n_;
  T* p_ = nullptr;
};

struct Rng {
  std::mt19937 gen;
  explicit Rng(uint32_t seed) : gen(seed) {}
  float uniform(float lo = -1.0f, float hi = 1.0f) { return std::uniform_real_distribution<float>(lo, hi)(gen); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }
  std::vector<float> floats(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = uniform(lo, hi);
    return v;
  }
};

std::vector<float> nan_vec(size_t n) { return std::vector<float>(n, std::nanf("")); }

// |got - want| <= atol + rtol * |want| elementwise; NaN and infinities must match exactly.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, float atol, float rtol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  double worst = 0.0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = got[i], w = want[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g))
      ok = std::isnan(w) && std::isnan(g);
    else if (std::isinf(w) || std::isinf(g))
      ok = g == w;
    else {
      const double err = std::fabs(double(g) - double(w));
      worst = std::max(worst, err / (atol + rtol * std::fabs(double(w))));
      ok = err <= atol + rtol * std::fabs(double(w));
    }
    if (!ok && bad++ < 5) first << "\n  [" << i << "] got " << g << ", want " << w;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ (worst error " << worst
                     << " x tolerance)" << first.str();
}

template <class T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ < 5)
      first << "\n  [" << i << "] got " << got[i] << ", want " << want[i];
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ" << first.str();
}

// Raw weight bytes of a [rows, ld] matrix with random values in about [-1, 1].
std::vector<uint8_t> random_weight(Rng& rng, DType dt, int64_t rows, int64_t ld) {
  const size_t n = size_t(rows * ld);
  std::vector<uint8_t> bytes(n * dtype_size(dt));
  for (size_t i = 0; i < n; ++i) {
    if (dt == DType::F32) {
      const float v = rng.uniform();
      std::memcpy(&bytes[i * 4], &v, 4);
    } else if (dt == DType::BF16) {
      const uint16_t v = f32_to_bf16(rng.uniform());
      std::memcpy(&bytes[i * 2], &v, 2);
    } else {  // F16: sign, exponent 10..15 (2^-5 .. 1.99), random mantissa
      const uint16_t v = uint16_t((rng.integer(0, 1) << 15) | (rng.integer(10, 15) << 10) | rng.integer(0, 1023));
      std::memcpy(&bytes[i * 2], &v, 2);
    }
  }
  return bytes;
}

float weight_value(DType dt, const std::vector<uint8_t>& bytes, size_t i) {
  uint16_t h;
  switch (dt) {
    case DType::F32: {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      return f;
    }
    case DType::BF16: std::memcpy(&h, &bytes[i * 2], 2); return bf16_to_f32(h);
    default: std::memcpy(&h, &bytes[i * 2], 2); return f16_to_f32(h);
  }
}

// Scoped GLM5_CUDA_GEMM_TERMS (read when a CUDA backend is created).
class GemmTermsEnv {
 public:
  explicit GemmTermsEnv(const char* v) {
    if (const char* old = std::getenv("GLM5_CUDA_GEMM_TERMS")) old_ = old, had_ = true;
    if (v)
      setenv("GLM5_CUDA_GEMM_TERMS", v, 1);
    else
      unsetenv("GLM5_CUDA_GEMM_TERMS");
  }
  ~GemmTermsEnv() {
    if (had_)
      setenv("GLM5_CUDA_GEMM_TERMS", old_.c_str(), 1);
    else
      unsetenv("GLM5_CUDA_GEMM_TERMS");
  }

 private:
  std::string old_;
  bool had_ = false;
};

// A scoped environment variable (the backend reads GLM5_CUDA_* when it is created).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* v) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (v)
      setenv(name, v, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

// Captures stderr from construction to take() (released on every way out).
class StderrCapture {
 public:
  StderrCapture() { ::testing::internal::CaptureStderr(); }
  ~StderrCapture() {
    if (!done_) ::testing::internal::GetCapturedStderr();
  }
  std::string take() {
    done_ = true;
    return ::testing::internal::GetCapturedStderr();
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;

 private:
  bool done_ = false;
};

// The kernel line GLM5_CUDA_ATTENTION_LOG prints for op on the SIMT or the tensor-core kernel.
std::string attention_log_line(const std::string& op, const std::string& kernel) {
  return "glm5 cuda: " + op + " on the " + (kernel == "tensor" ? "tensor cores" : "SIMT") + " kernel";
}

// ---- the shared case lists (op_cases.h) ---------------------------------------------------------

// One backend for all parameterised cases (creating cuBLAS handles per case costs time); never
// destroyed, so nothing runs after the CUDA runtime has shut down at exit.
Backend& shared_gpu() {
  static Backend* gpu = make_cuda_backend(0).release();
  return *gpu;
}

class CudaVsReference : public ::testing::TestWithParam<test::OpCase> {};

TEST_P(CudaVsReference, MatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto ref = make_reference_backend();
  EXPECT_TRUE(test::compare(shared_gpu(), *ref, GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaVsReference, ::testing::ValuesIn(test::op_cases()),
                         [](const auto& info) { return test::test_name(info.param.name); });

class CudaBatchInvariance : public ::testing::TestWithParam<test::RowCase> {};

// The probe row alone, as row 3 of 7 and as row 41 of 64 (other rows random): same bytes, and
// close to the reference.
TEST_P(CudaBatchInvariance, RowBitsIndependentOfBatch) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  Backend& gpu = shared_gpu();
  const test::RowCase& c = GetParam();
  auto alone = test::probe_bytes(gpu, c, 1, 0);
  auto in7 = test::probe_bytes(gpu, c, 7, 3);
  auto in64 = test::probe_bytes(gpu, c, 64, 41);
  ASSERT_EQ(alone.size(), in7.size());
  ASSERT_EQ(alone.size(), in64.size());
  EXPECT_EQ(0, std::memcmp(alone.data(), in7.data(), alone.size())) << c.name << ": m=1 vs m=7";
  EXPECT_EQ(0, std::memcmp(alone.data(), in64.data(), alone.size())) << c.name << ": m=1 vs m=64";
  auto ref = make_reference_backend();
  auto r = test::probe_bytes(*ref, c, 1, 0);
  std::vector<float> a(alone.size() / 4), b(r.size() / 4);
  std::memcpy(a.data(), alone.data(), alone.size());
  std::memcpy(b.data(), r.data(), r.size());
  EXPECT_TRUE(test::compare_floats(c.name, a, b, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Rows, CudaBatchInvariance, ::testing::ValuesIn(test::row_cases()),
                         [](const auto& info) { return test::test_name(info.param.name); });

// ---- GEMM --------------------------------------------------------------------------------------

struct GemmCase {
  int64_t m, n, k;
  DType dt;
  bool trans, accumulate;
};

// Every output [i, j] < [m, n] of got (row stride ldy) within rel_tol * sum_k |x w| + 1e-6 of want
// (the bound of any reordering of the fp32 sum), where wabs[j * k + kk] = |w| of output j, input kk.
void expect_within_bound(const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>& x,
                         int64_t ldx, int64_t ldy, int64_t m, int64_t n, int64_t k, const std::vector<double>& wabs,
                         float rel_tol, const std::string& what) {
  size_t bad = 0;
  std::ostringstream first;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double bound = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) bound += std::fabs(double(x[i * ldx + kk])) * wabs[size_t(j * k + kk)];
      const double err = std::fabs(double(got[i * ldy + j]) - double(want[i * ldy + j]));
      if (!(err <= rel_tol * bound + 1e-6) && bad++ < 5)
        first << "\n  [" << i << ", " << j << "] got " << got[i * ldy + j] << ", want " << want[i * ldy + j]
              << " (sum |x w| " << bound << ")";
    }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " outputs out of tolerance" << first.str();
}

// One GEMM's inputs, its reference result and its device buffers: q is the call for the device
// backend, verify() checks its output (expect_within_bound).
// ref_precision: the reference backend's (kFast: bf16 inputs, the exact products summed in k order).
// The weight's ld is its columns + 2, or with aligned_ld its columns rounded up to 8 (16-byte rows).
class GemmCheck {
 public:
  GemmCheck(Backend& gpu, const GemmCase& c, uint32_t seed, Precision ref_precision = Precision::kExact,
            bool aligned_ld = false)
      : c_(c),
        rng_(seed),
        ldx_(c.k + 3),
        ldy_(c.n + 5),
        w_rows_(c.trans ? c.k : c.n),
        w_ld_(aligned_ld ? ((c.trans ? c.n : c.k) + 7) / 8 * 8 : (c.trans ? c.n : c.k) + 2),
        // One spare leading row so that the weight pointer handed over is a slice (an odd
        // alignment unless aligned_ld).
        wbytes_(random_weight(rng_, c.dt, w_rows_ + 1, w_ld_)),
        x_(rng_.floats(size_t(c.m * ldx_))),
        y0_(rng_.floats(size_t(c.m * ldy_))),
        dx_(gpu, x_),
        dy_(gpu, c.accumulate ? y0_ : nan_vec(y0_.size())) {
    what_ = "gemm m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
            " dtype=" + std::string(dtype_name(c.dt)) + (c.trans ? " trans_w" : "") +
            (c.accumulate ? " accumulate" : "");
    const int64_t w_cols = c.trans ? c.n : c.k;
    auto ref = make_reference_backend(ref_precision);
    Weight wh{wbytes_.data(), c.dt, w_rows_ + 1, w_cols, w_ld_};
    GemmParams p;
    p.x = x_.data(), p.ldx = ldx_, p.w = wh.slice_rows(1, w_rows_), p.trans_w = c.trans;
    p.ldy = ldy_, p.m = c.m, p.n = c.n, p.k = c.k, p.accumulate = c.accumulate;
    want_ = y0_;
    p.y = want_.data();
    ref->gemm(p);
    Weight wd{gpu.upload(wbytes_.data(), wbytes_.size()), c.dt, w_rows_ + 1, w_cols, w_ld_};
    q = p;
    q.x = dx_.get(), q.y = dy_.get(), q.w = wd.slice_rows(1, w_rows_);
  }

  void verify(float rel_tol) {
    auto got = dy_.host(what_);
    if (!c_.accumulate)  // padding columns of y are not part of the result
      for (int64_t i = 0; i < c_.m; ++i)
        for (int64_t j = c_.n; j < ldy_; ++j) got[i * ldy_ + j] = want_[i * ldy_ + j] = 0.0f;
    std::vector<double> wabs(size_t(c_.n * c_.k));  // (the weight follows one spare leading row)
    for (int64_t j = 0; j < c_.n; ++j)
      for (int64_t kk = 0; kk < c_.k; ++kk) {
        const size_t wi = c_.trans ? size_t((kk + 1) * w_ld_ + j) : size_t((j + 1) * w_ld_ + kk);
        wabs[size_t(j * c_.k + kk)] = std::fabs(double(weight_value(c_.dt, wbytes_, wi)));
      }
    expect_within_bound(got, want_, x_, ldx_, ldy_, c_.m, c_.n, c_.k, wabs, rel_tol, what_);
  }

  GemmParams q;  // the call for the device backend

 private:
  GemmCase c_;
  Rng rng_;
  int64_t ldx_, ldy_, w_rows_, w_ld_;
  std::vector<uint8_t> wbytes_;
  std::vector<float> x_, y0_, want_;
  Dev<float> dx_, dy_;
  std::string what_;
};

void check_gemm(Backend& gpu, const GemmCase& c, float rel_tol, uint32_t seed,
                Precision ref_precision = Precision::kExact) {
  GemmCheck g(gpu, c, seed, ref_precision);
  gpu.gemm(g.q);
  g.verify(rel_tol);
}

const std::vector<GemmCase>& gemm_cases() {
  static const std::vector<GemmCase> cases = {
      {1, 1, 1, DType::BF16, false, false},      {3, 5, 7, DType::BF16, false, true},
      {17, 33, 65, DType::BF16, true, false},    {64, 128, 256, DType::BF16, false, false},
      {65, 70, 300, DType::BF16, true, true},    {130, 257, 129, DType::BF16, false, false},
      {70, 512, 1536, DType::BF16, false, true}, {5, 9, 11, DType::F32, false, false},
      {66, 40, 200, DType::F32, true, true},     {7, 13, 19, DType::F16, false, true},
      {70, 65, 130, DType::F16, true, false},    {2, 3, 0, DType::BF16, false, false},
      {0, 4, 4, DType::BF16, false, false},
  };
  return cases;
}

// The GLM5_CUDA_GEMM modes (backend_cuda.cu): one cuBLASLt call with a pinned algorithm, or
// fixed 64-row cuBLAS chunks. Both must match the reference and be batch-invariant.
constexpr const char* kGemmModes[] = {"lt", "chunked"};

TEST(CudaOps, GemmMatchesReferenceExactActivations) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  GemmTermsEnv env(nullptr);  // default: 3 bf16 terms, activations exact
  for (const char* mode : kGemmModes) {
    SCOPED_TRACE(std::string("GLM5_CUDA_GEMM=") + mode);
    ScopedEnv gm("GLM5_CUDA_GEMM", mode);
    auto gpu = make_cuda_backend(0);
    uint32_t seed = 1;
    for (const auto& c : gemm_cases()) check_gemm(*gpu, c, 2e-5f, seed++);
  }
}

TEST(CudaOps, GemmOtherActivationSplits) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  // terms: 0 = plain fp32 kernel, 2 = ~16-bit activations, 1 = bf16 activations.
  const std::pair<const char*, float> modes[] = {{"0", 2e-5f}, {"2", 6e-5f}, {"1", 6e-3f}};
  for (const char* mode : kGemmModes)
    for (const auto& [terms, tol] : modes) {
      SCOPED_TRACE(std::string("GLM5_CUDA_GEMM=") + mode + " GLM5_CUDA_GEMM_TERMS=" + terms);
      ScopedEnv gm("GLM5_CUDA_GEMM", mode);
      GemmTermsEnv env(terms);
      auto gpu = make_cuda_backend(0);
      uint32_t seed = 100;
      for (const auto& c : gemm_cases()) check_gemm(*gpu, c, tol, seed++);
    }
}

// Precision fast: BF16 weights on one bf16 term of x, the reference's kFast gemm (the same rounded
// inputs) up to float32 summation order, in both GEMM modes, batch-invariant. (The exact path's three
// terms would be off by x's bf16 rounding, ~4e-3 relative: far outside this tolerance.)
TEST(CudaOps, FastPrecisionGemmIsOneBf16Term) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  GemmTermsEnv env(nullptr);
  for (const char* mode : kGemmModes) {
    SCOPED_TRACE(std::string("GLM5_CUDA_GEMM=") + mode);
    ScopedEnv gm("GLM5_CUDA_GEMM", mode);
    auto gpu = make_cuda_backend(0, Precision::kFast);
    ASSERT_EQ(gpu->precision(), Precision::kFast);
    uint32_t seed = 300;
    for (const auto& c : gemm_cases())
      if (c.dt == DType::BF16) check_gemm(*gpu, c, 2e-5f, seed++, Precision::kFast);
  }
}

TEST(CudaOps, GemmRowsAreBatchInvariant) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  for (const char* terms : {"3", "0", "1"}) {  // (1: what precision fast runs)
    for (DType dt : {DType::BF16, DType::F32, DType::F16}) {
      SCOPED_TRACE(std::string("terms ") + terms + " dtype " + std::string(dtype_name(dt)));
      GemmTermsEnv env(terms);
      auto gpu = make_cuda_backend(0);
      Rng rng(7);
      const int64_t m = 150, n = 96, k = 333;
      const auto wbytes = random_weight(rng, dt, n, k);
      Weight w{gpu->upload(wbytes.data(), wbytes.size()), dt, n, k, k};
      Dev<float> dx(*gpu, rng.floats(size_t(m * k))), dy(*gpu, nan_vec(size_t(m * n)));
      GemmParams p;
      p.x = dx.get(), p.ldx = k, p.w = w, p.y = dy.get(), p.ldy = n, p.m = m, p.n = n, p.k = k;
      gpu->gemm(p);
      const auto all = dy.host("gemm batch");
      for (int64_t r0 : {0, 1, 63, 64, 100, 149}) {
        const int64_t rows = std::min<int64_t>(r0 == 1 ? 5 : 1, m - r0);
        Dev<float> dy1(*gpu, nan_vec(size_t(rows * n)));
        GemmParams q = p;
        q.x = dx.get() + r0 * k, q.y = dy1.get(), q.m = rows;
        gpu->gemm(q);
        const auto part = dy1.host("gemm part");
        const std::vector<float> want(all.begin() + r0 * n, all.begin() + (r0 + rows) * n);
        expect_equal(
            part, want,
            "rows " + std::to_string(r0) + ".." + std::to_string(r0 + rows - 1) + " alone vs in a batch of 150");
      }
    }
  }
}

// ---- GEMM on quantized weights -----------------------------------------------------------------

// The GLM5_CUDA_QUANT_GEMM modes (backend_cuda.cu). Both must match the reference.
constexpr const char* kQuantModes[] = {"fused", "dequant"};

// A random quantized matrix [rows, cols] laid out as a checkpoint stores it: Q4 rows padded to 8
// elements and Q8 rows to 4, plus ld_extra elements. FP8 pad bytes hold the NaN code 0x7f, and
// the other formats' pad bytes are random, so a kernel that reads padding fails. `lead` more rows
// come first, so the matrix the kernels get is a slice (FP8: one 128-row scale block; Q4/Q8:
// one row) at a pointer offset that is not 16-byte aligned for most shapes. FP8 values are random
// codes without NaN, scales in [0.5, 2] / 256 (F32, blocks of 128 x 128). Q4/Q8 codes are random
// bytes, with positive group scales in sdt.
struct QuantMatrix {
  DType dt = DType::Q4, sdt = DType::BF16;
  int64_t rows = 0, cols = 0, ld = 0, group = 0, scale_block_rows = 1, scale_ld = 0, lead = 0;
  std::vector<uint8_t> data, scale;

  Weight view(const void* d, const void* s) const {
    Weight w{d, dt, lead + rows, cols, ld, s, sdt, scale_ld, group, scale_block_rows};
    return w.slice_rows(lead, rows);
  }
  Weight host() const { return view(data.data(), scale.data()); }
  Weight upload(Backend& b) const {
    return view(b.upload(data.data(), data.size()), b.upload(scale.data(), scale.size()));
  }
};

QuantMatrix random_quant_matrix(Rng& rng, DType dt, DType sdt, int64_t rows, int64_t cols, int64_t group,
                                int64_t ld_extra) {
  QuantMatrix q;
  const bool fp8 = dt == DType::F8_E4M3;
  q.dt = dt, q.sdt = fp8 ? DType::F32 : sdt, q.rows = rows, q.cols = cols;
  q.lead = fp8 ? quant::kFp8Block : 1;
  q.group = fp8 ? quant::kFp8Block : group;
  q.scale_block_rows = fp8 ? quant::kFp8Block : 1;
  q.ld = (dt == DType::Q4 ? (cols + 7) / 8 * 8 : dt == DType::Q8 ? (cols + 3) / 4 * 4 : cols) + ld_extra;
  const int64_t all_rows = q.lead + rows;
  const size_t row_bytes = quant::row_bytes(dt, q.ld);
  q.data.resize(size_t(all_rows) * row_bytes);
  for (int64_t r = 0; r < all_rows; ++r)
    for (size_t b = 0; b < row_bytes; ++b) {
      int v = rng.integer(0, 255);
      if (fp8) {
        if (int64_t(b) >= cols)
          v = 0x7f;
        else
          while ((v & 0x7f) == 0x7f) v = rng.integer(0, 255);
      }
      q.data[size_t(r) * row_bytes + b] = uint8_t(v);
    }
  q.scale_ld = (cols + q.group - 1) / q.group + 1;  // one spare scale column
  const int64_t scale_rows = (all_rows + q.scale_block_rows - 1) / q.scale_block_rows;
  const size_t es = dtype_size(q.sdt);
  q.scale.resize(size_t(scale_rows * q.scale_ld) * es);
  for (int64_t i = 0; i < scale_rows * q.scale_ld; ++i) {
    const float v = fp8               ? rng.uniform(0.5f, 2.0f) / 256.0f
                    : dt == DType::Q4 ? rng.uniform(0.02f, 0.3f)
                                      : rng.uniform(0.002f, 0.03f);
    if (q.sdt == DType::F32) {
      std::memcpy(&q.scale[size_t(i) * 4], &v, 4);
    } else {
      const uint16_t h = q.sdt == DType::BF16 ? f32_to_bf16(v) : quant::f32_to_f16(v);
      std::memcpy(&q.scale[size_t(i) * 2], &h, 2);
    }
  }
  return q;
}

struct QuantGemmCase {
  int64_t m, n, k;
  DType dt, sdt;  // sdt: scale dtype (FP8: always F32)
  int64_t group;  // Q4 / Q8 group (FP8: 128)
  bool trans, accumulate;
  int64_t ld_extra;  // weight row padding beyond the checkpoint layout, elements (Q4: even)
};

std::string quant_case_name(const QuantGemmCase& c) {
  return "gemm m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) + " " +
         std::string(dtype_name(c.dt)) +
         (c.dt == DType::F8_E4M3 ? std::string()
                                 : " scales " + std::string(dtype_name(c.sdt)) + " group " + std::to_string(c.group)) +
         (c.ld_extra ? " ld+" + std::to_string(c.ld_extra) : "") + (c.trans ? " trans_w" : "") +
         (c.accumulate ? " accumulate" : "");
}

// One quantized GEMM on both backends. The tolerance is check_gemm's: rel_tol * sum_k |x w| per
// output plus 1e-6, with w the weight_at() values.
// One quantized GEMM's inputs, reference result and device buffers, as GemmCheck (ref_precision:
// the reference backend's; kFast rounds x and every weight_at value to bf16).
class QuantGemmCheck {
 public:
  QuantGemmCheck(Backend& gpu, const QuantGemmCase& c, uint32_t seed, Precision ref_precision = Precision::kExact)
      : c_(c),
        rng_(seed),
        ldx_(c.k + 3),
        ldy_(c.n + 5),
        qm_(random_quant_matrix(rng_, c.dt, c.sdt, c.trans ? c.k : c.n, c.trans ? c.n : c.k, c.group, c.ld_extra)),
        x_(rng_.floats(size_t(c.m * ldx_))),
        y0_(rng_.floats(size_t(c.m * ldy_))),
        dx_(gpu, x_),
        dy_(gpu, c.accumulate ? y0_ : nan_vec(y0_.size())),
        what_(quant_case_name(c)) {
    auto ref = make_reference_backend(ref_precision);
    GemmParams p;
    p.x = x_.data(), p.ldx = ldx_, p.w = qm_.host(), p.trans_w = c.trans;
    p.ldy = ldy_, p.m = c.m, p.n = c.n, p.k = c.k, p.accumulate = c.accumulate;
    want_ = y0_;
    p.y = want_.data();
    ref->gemm(p);
    q = p;
    q.x = dx_.get(), q.y = dy_.get(), q.w = qm_.upload(gpu);
  }

  void verify(float rel_tol) {
    auto got = dy_.host(what_);
    if (!c_.accumulate)  // padding columns of y are not part of the result
      for (int64_t i = 0; i < c_.m; ++i)
        for (int64_t j = c_.n; j < ldy_; ++j) got[i * ldy_ + j] = want_[i * ldy_ + j] = 0.0f;
    // |w| once per weight element (weight_at is the slow part of the bound).
    const Weight wh = qm_.host();
    std::vector<double> wabs(size_t(c_.n * c_.k));
    for (int64_t j = 0; j < c_.n; ++j)
      for (int64_t kk = 0; kk < c_.k; ++kk)
        wabs[size_t(j * c_.k + kk)] = std::fabs(double(c_.trans ? weight_at(wh, kk, j) : weight_at(wh, j, kk)));
    expect_within_bound(got, want_, x_, ldx_, ldy_, c_.m, c_.n, c_.k, wabs, rel_tol, what_);
    for (size_t i = 0; i < got.size(); ++i)  // the padding columns of y keep their values too
      if (c_.accumulate && std::memcmp(&got[i], &want_[i], 4) != 0 && int64_t(i) % ldy_ >= c_.n) {
        ADD_FAILURE() << what_ << ": padding element " << i << " of y was written";
        break;
      }
  }

  GemmParams q;  // the call for the device backend

 private:
  QuantGemmCase c_;
  Rng rng_;
  int64_t ldx_, ldy_;
  QuantMatrix qm_;
  std::vector<float> x_, y0_, want_;
  Dev<float> dx_, dy_;
  std::string what_;
};

void check_quant_gemm(Backend& gpu, const QuantGemmCase& c, float rel_tol, uint32_t seed) {
  QuantGemmCheck g(gpu, c, seed);
  gpu.gemm(g.q);
  g.verify(rel_tol);
}

const std::vector<QuantGemmCase>& quant_gemm_cases() {
  static const std::vector<QuantGemmCase> cases = [] {
    const DType F8 = DType::F8_E4M3, Q4 = DType::Q4, Q8 = DType::Q8, BF16 = DType::BF16, F16 = DType::F16,
                F32 = DType::F32;
    std::vector<QuantGemmCase> v;
    // FP8: 200 x 300 has a partial 128-block both ways; m = 1, 3 (one x tile), 17, 300.
    for (int64_t m : {1, 3, 17, 300}) v.push_back({m, 200, 300, F8, F32, 128, false, m == 3, m == 17 ? 2 : 0});
    v.push_back({5, 130, 1100, F8, F32, 128, false, false, 16});  // several k chunks
    v.push_back({2, 64, 512, F8, F32, 128, false, false, 0});     // 16-byte aligned rows
    v.push_back({17, 96, 200, F8, F32, 128, true, false, 0});     // trans_w: W [200, 96]
    v.push_back({4, 300, 130, F8, F32, 128, true, true, 3});
    // Q4 / Q8, groups 32 / 64 / 128, BF16 and F32 scales, m = 1, 3, 17, 300. The shapes rotate:
    // ragged last group, several k chunks (1024 Q4 / 512 Q8 columns), 16-byte aligned rows.
    const std::pair<int64_t, int64_t> shapes[] = {{70, 300}, {33, 2100}, {64, 1024}};
    int s = 0;
    for (DType dt : {Q4, Q8})
      for (DType sdt : {BF16, F32})
        for (int64_t g : {32, 64, 128})
          for (int64_t m : {1, 3, 17, 300}) {
            const auto [n, k] = shapes[s++ % 3];
            v.push_back({m, n, k, dt, sdt, g, false, m == 17, m == 3 ? 8 : 0});
          }
    v.push_back({3, 40, 500, Q4, F16, 64, false, false, 0});  // F16 scales
    v.push_back({17, 40, 500, Q8, F16, 128, false, true, 0});
    v.push_back({5, 24, 301, Q4, BF16, 16, false, false, 0});  // groups narrower than a lane chunk
    v.push_back({5, 24, 301, Q8, F32, 48, false, false, 4});   // groups not a power of two
    v.push_back({3, 20, 257, Q4, BF16, 32, false, false, 2});  // odd k: the last byte is half padding
    v.push_back({17, 65, 200, Q4, BF16, 32, true, false, 0});  // trans_w
    v.push_back({3, 40, 96, Q8, F32, 64, true, true, 0});
    v.push_back({9, 70, 130, Q4, F16, 128, true, false, 0});
    v.push_back({2, 3, 0, Q4, BF16, 32, false, false, 8});   // k = 0: y = 0
    v.push_back({2, 3, 0, F8, F32, 128, false, true, 4});    // k = 0, accumulate: y unchanged
    v.push_back({0, 4, 64, Q8, BF16, 32, false, false, 0});  // m = 0
    return v;
  }();
  return cases;
}

TEST(CudaOps, QuantGemmMatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  GemmTermsEnv terms(nullptr);  // default: exact activations on the dequant route
  for (const char* mode : kQuantModes) {
    SCOPED_TRACE(std::string("GLM5_CUDA_QUANT_GEMM=") + mode);
    ScopedEnv env("GLM5_CUDA_QUANT_GEMM", mode);
    auto gpu = make_cuda_backend(0);
    uint32_t seed = 500;
    for (const auto& c : quant_gemm_cases()) check_quant_gemm(*gpu, c, 2e-5f, seed++);
  }
}

// The dequant route with a small scratch: weights go through in blocks of rows (output columns;
// with trans_w, ranges of k whose partial sums add up in y).
TEST(CudaOps, QuantGemmDequantInRowBlocks) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  GemmTermsEnv terms(nullptr);
  ScopedEnv env("GLM5_CUDA_QUANT_GEMM", "dequant");
  ScopedEnv scratch("GLM5_CUDA_DEQUANT_SCRATCH", "20000");  // e.g. FP8 k = 300: 16 rows a block
  auto gpu = make_cuda_backend(0);
  uint32_t seed = 600;
  for (const auto& c : quant_gemm_cases())
    if (c.m != 300) check_quant_gemm(*gpu, c, 2e-5f, seed++);
}

// The dequant route under the other activation splits: bf16-exact weights with 1 term (bf16
// activations), and the plain fp32 kernel (terms 0).
TEST(CudaOps, QuantGemmDequantOtherActivationSplits) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  ScopedEnv env("GLM5_CUDA_QUANT_GEMM", "dequant");
  const std::pair<const char*, float> modes[] = {{"0", 2e-5f}, {"1", 6e-3f}};
  for (const auto& [terms, tol] : modes) {
    SCOPED_TRACE(std::string("GLM5_CUDA_GEMM_TERMS=") + terms);
    GemmTermsEnv te(terms);
    auto gpu = make_cuda_backend(0);
    uint32_t seed = 700;
    for (const auto& c : quant_gemm_cases())
      if (c.m != 300) check_quant_gemm(*gpu, c, tol, seed++);
  }
}

TEST(CudaOps, QuantGemmRowsAreBatchInvariant) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  struct Fmt {
    DType dt, sdt;
    int64_t group;
  };
  const Fmt fmts[] = {{DType::F8_E4M3, DType::F32, 128},
                      {DType::Q4, DType::BF16, 128},
                      {DType::Q8, DType::F32, 64},
                      {DType::Q4, DType::F16, 32}};
  for (const char* mode : kQuantModes) {
    ScopedEnv env("GLM5_CUDA_QUANT_GEMM", mode);
    auto gpu = make_cuda_backend(0);
    for (const Fmt& f : fmts) {
      SCOPED_TRACE(std::string("mode ") + mode + " dtype " + std::string(dtype_name(f.dt)) + " scales " +
                   std::string(dtype_name(f.sdt)));
      Rng rng(9);
      const int64_t m = 150, n = 96, k = 333;
      const QuantMatrix qm = random_quant_matrix(rng, f.dt, f.sdt, n, k, f.group, 0);
      Dev<float> dx(*gpu, rng.floats(size_t(m * k))), dy(*gpu, nan_vec(size_t(m * n)));
      GemmParams p;
      p.x = dx.get(), p.ldx = k, p.w = qm.upload(*gpu), p.y = dy.get(), p.ldy = n;
      p.m = m, p.n = n, p.k = k;
      gpu->gemm(p);
      const auto all = dy.host("quantized gemm batch");
      for (int64_t r0 : {0, 1, 7, 8, 63, 64, 100, 149}) {
        const int64_t rows = std::min<int64_t>(r0 == 1 ? 5 : r0 == 8 ? 16 : 1, m - r0);
        Dev<float> dy1(*gpu, nan_vec(size_t(rows * n)));
        GemmParams q = p;
        q.x = dx.get() + r0 * k, q.y = dy1.get(), q.m = rows;
        gpu->gemm(q);
        const auto part = dy1.host("quantized gemm part");
        const std::vector<float> want(all.begin() + r0 * n, all.begin() + (r0 + rows) * n);
        expect_equal(
            part, want,
            "rows " + std::to_string(r0) + ".." + std::to_string(r0 + rows - 1) + " alone vs in a batch of 150");
      }
    }
  }
}

// y rows of an m-row GEMM whose rows m / 2 and m - 1 are `probe` (row 0 when m = 1) and whose
// other rows are random: the probe's output rows, in that order.
std::vector<std::vector<float>> gemm_probe_rows(Backend& gpu, const Weight& w, bool trans, int64_t n, int64_t k,
                                                int64_t m, const std::vector<float>& probe) {
  Rng rng(uint32_t(1000 + m));
  auto x = rng.floats(size_t(m * k));
  const std::vector<int64_t> at = m == 1 ? std::vector<int64_t>{0} : std::vector<int64_t>{m / 2, m - 1};
  for (int64_t r : at) std::copy(probe.begin(), probe.end(), x.begin() + r * k);
  Dev<float> dx(gpu, x), dy(gpu, nan_vec(size_t(m * n)));
  GemmParams p;
  p.x = dx.get(), p.ldx = k, p.w = w, p.trans_w = trans, p.y = dy.get(), p.ldy = n;
  p.m = m, p.n = n, p.k = k;
  gpu.gemm(p);
  const auto y = dy.host("gemm m=" + std::to_string(m));
  std::vector<std::vector<float>> rows;
  for (int64_t r : at) rows.emplace_back(y.begin() + r * n, y.begin() + (r + 1) * n);
  return rows;
}

// Every GEMM route (GLM5_CUDA_GEMM lt / chunked x GLM5_CUDA_GEMM_TERMS 3 / 2 / 1 / 0 x BF16 / F32
// / F16 weights x trans_w, and quantized weights fused or dequantized into either route): a probe
// row's output bits alone (m = 1) equal its bits at rows m / 2 and m - 1 of calls with m = 7, 64,
// 65, 300 and 2048 (one 64-row chunk and a bit, several cuBLASLt column tiles).
TEST(CudaOps, GemmRowsBatchInvariantAcrossM) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  struct Route {
    const char* gemm;
    const char* terms;
    const char* quant;  // nullptr: plain weights
    DType dt, sdt;
    int64_t group;
    bool trans;
  };
  std::vector<Route> routes;
  for (const char* gemm : kGemmModes)
    for (bool trans : {false, true}) {
      for (const char* terms : {"3", "2", "1", "0"})
        routes.push_back({gemm, terms, nullptr, DType::BF16, DType::F32, 0, trans});
      for (const char* terms : {"3", "0"}) routes.push_back({gemm, terms, nullptr, DType::F32, DType::F32, 0, trans});
      routes.push_back({gemm, "3", "dequant", DType::Q4, DType::BF16, 32, trans});       // bf16-exact rows
      routes.push_back({gemm, "3", "dequant", DType::F8_E4M3, DType::F32, 128, trans});  // fp32 rows
    }
  for (bool trans : {false, true}) routes.push_back({"lt", "3", nullptr, DType::F16, DType::F32, 0, trans});
  routes.push_back({"lt", "3", "fused", DType::Q4, DType::BF16, 32, false});
  routes.push_back({"lt", "3", "fused", DType::Q8, DType::F32, 64, false});
  routes.push_back({"lt", "3", "fused", DType::F8_E4M3, DType::F32, 128, false});
  const int64_t n = 160, k = 333;
  for (const Route& r : routes) {
    const std::string what = std::string("GLM5_CUDA_GEMM=") + r.gemm + " GLM5_CUDA_GEMM_TERMS=" + r.terms +
                             (r.quant ? std::string(" GLM5_CUDA_QUANT_GEMM=") + r.quant : std::string()) + " " +
                             std::string(dtype_name(r.dt)) + (r.trans ? " trans_w" : "");
    SCOPED_TRACE(what);
    ScopedEnv gm("GLM5_CUDA_GEMM", r.gemm), te("GLM5_CUDA_GEMM_TERMS", r.terms),
        qm("GLM5_CUDA_QUANT_GEMM", r.quant ? r.quant : "fused");
    auto gpu = make_cuda_backend(0);
    Rng rng(31);
    const int64_t w_rows = r.trans ? k : n, w_cols = r.trans ? n : k;
    Weight w;
    if (r.quant) {
      w = random_quant_matrix(rng, r.dt, r.sdt, w_rows, w_cols, r.group, 0).upload(*gpu);
    } else {
      const auto bytes = random_weight(rng, r.dt, w_rows, w_cols);
      w = Weight{gpu->upload(bytes.data(), bytes.size()), r.dt, w_rows, w_cols, w_cols};
    }
    const auto probe = rng.floats(size_t(k));
    const auto alone = gemm_probe_rows(*gpu, w, r.trans, n, k, 1, probe).front();
    for (int64_t m : {7, 64, 65, 300, 2048}) {
      const auto rows = gemm_probe_rows(*gpu, w, r.trans, n, k, m, probe);
      expect_equal(rows[0], alone,
                   what + ": row " + std::to_string(m / 2) + " of m = " + std::to_string(m) + " vs m = 1");
      expect_equal(rows[1], alone,
                   what + ": row " + std::to_string(m - 1) + " of m = " + std::to_string(m) + " vs m = 1");
    }
  }
}

// The lt route is really taken for an aligned shape (the batch-invariance test above would pass
// on the chunked path too): GLM5_CUDA_GEMM_LOG names the pinned algorithm, the bitwise probe at
// pinning keeps it, and rows still agree across m.
TEST(CudaOps, GemmLtPathIsTakenForAlignedShapes) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  ScopedEnv gm("GLM5_CUDA_GEMM", "lt"), log("GLM5_CUDA_GEMM_LOG", "1");
  for (DType dt : {DType::BF16, DType::F32}) {
    StderrCapture capture;
    auto gpu = make_cuda_backend(0);
    Rng rng(77);
    const int64_t n = 256, k = 512;
    const auto bytes = random_weight(rng, dt, n, k);
    const Weight w{gpu->upload(bytes.data(), bytes.size()), dt, n, k, k};
    const auto probe = rng.floats(size_t(k));
    const auto alone = gemm_probe_rows(*gpu, w, false, n, k, 1, probe).front();
    const auto rows = gemm_probe_rows(*gpu, w, false, n, k, 300, probe);
    gpu->synchronize();
    const std::string err = capture.take();
    EXPECT_NE(err.find("cuBLASLt algo"), std::string::npos) << dtype_name(dt) << ": " << err;
    EXPECT_EQ(err.find("chunked path"), std::string::npos) << dtype_name(dt) << ": " << err;
    expect_equal(rows[0], alone, std::string(dtype_name(dt)) + " lt: row 150 of m = 300 vs m = 1");
    expect_equal(rows[1], alone, std::string(dtype_name(dt)) + " lt: row 299 of m = 300 vs m = 1");
  }
}

// ---- The grouped expert GEMM (GLM5_CUDA_EXPERT_GEMM=grouped, ops_grouped_gemm.cu) -------------

// Many GEMMs in one gemm_grouped call, each against the reference, in exact (3 terms), 2 terms and
// fast (1 term, against the reference's kFast). On the grouped tensor-core kernel: BF16 weights
// (each case at an odd ld, element loads, and at a 16-byte ld, vector loads where k % 8 == 0) and
// Q4 / Q8 with BF16 scales in every setting, the other quantized weights (FP8, F16 / F32 scales)
// in one term; the rest (F32 / F16 weights, trans_w, k = 0) on gemm()'s routes. The backend's
// count of the gemms it grouped must be exactly those.
TEST(CudaOps, GroupedGemmTensorCoresMatchReference) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  ScopedEnv eg("GLM5_CUDA_EXPERT_GEMM", "grouped");
  struct Mode {
    const char* terms;
    Precision precision;
    float tol;
  };
  const Mode modes[] = {
      {nullptr, Precision::kExact, 2e-5f}, {"2", Precision::kExact, 6e-5f}, {nullptr, Precision::kFast, 2e-5f}};
  std::vector<GemmCase> cases = gemm_cases();
  cases.push_back({1, 2048, 6144, DType::BF16, false, false});  // a decode row through GLM-5's gate / up shape
  cases.push_back({96, 640, 2048, DType::BF16, false, true});   // down-shaped k, accumulating
  uint32_t seed = 500;
  for (const Mode& mode : modes) {
    SCOPED_TRACE(std::string("GLM5_CUDA_GEMM_TERMS=") + (mode.terms ? mode.terms : "(default)") +
                 (mode.precision == Precision::kFast ? " precision fast" : " precision exact"));
    GemmTermsEnv env(mode.terms);
    auto gpu = make_cuda_backend(0, mode.precision);
    const bool fast = mode.precision == Precision::kFast;  // one term
    std::vector<std::unique_ptr<GemmCheck>> checks;
    std::vector<std::unique_ptr<QuantGemmCheck>> quant_checks;
    std::vector<GemmParams> ps;
    size_t grouped = 0;
    for (const GemmCase& c : cases)
      for (bool aligned : {false, true}) {
        if (fast && c.dt != DType::BF16) continue;  // (fast on F32 / F16 weights: the gemm tests)
        checks.push_back(std::make_unique<GemmCheck>(*gpu, c, seed++, mode.precision, aligned));
        ps.push_back(checks.back()->q);
        grouped += c.dt == DType::BF16 && !c.trans && c.k > 0 && c.m > 0 && c.n > 0;
      }
    for (const QuantGemmCase& c : quant_gemm_cases()) {
      if (fast && c.trans) continue;  // (fast's trans_w quantized route rounds nothing: not kFast's values)
      quant_checks.push_back(std::make_unique<QuantGemmCheck>(*gpu, c, seed++, mode.precision));
      ps.push_back(quant_checks.back()->q);
      const bool bf16_values = c.dt != DType::F8_E4M3 && c.sdt == DType::BF16;
      grouped += !c.trans && c.k > 0 && c.m > 0 && c.n > 0 && (bf16_values || fast);
    }
    gpu->gemm_grouped(ps);
    EXPECT_EQ(gpu->kernel_ran("gemm_grouped"),
              "tensor cores (grouped: " + std::to_string(grouped) + " of " + std::to_string(ps.size()) + " gemms)");
    for (auto& g : checks) g->verify(mode.tol);
    for (auto& g : quant_checks) g->verify(mode.tol);
  }
}

// A probe row's bits through the grouped kernel, alone (m = 1, the only GEMM of the call), equal its
// bits at rows m / 2 and m - 1 of calls with m = 7, 64, 65 and 300 that also carry a GEMM of
// another shape, before or after it in the table; and the same weight values at a 16-byte-aligned
// ld (vector loads) and at an odd ld (element loads) give the same bits. Every terms setting, for
// BF16 weights and Q4 with BF16 scales; FP8 in precision fast (its one term).
TEST(CudaOps, GroupedGemmTensorCoresRowsIndependentOfBatch) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  ScopedEnv eg("GLM5_CUDA_EXPERT_GEMM", "grouped");
  const int64_t n = 160, k = 336, n2 = 96, k2 = 200;
  for (const char* terms : {"3", "2", "1"}) {
    SCOPED_TRACE(std::string("GLM5_CUDA_GEMM_TERMS=") + terms);
    GemmTermsEnv env(terms);
    const bool fast = std::string(terms) == "1";
    auto gpu = make_cuda_backend(0, fast ? Precision::kFast : Precision::kExact);
    Rng rng(41);
    const auto wbytes = random_weight(rng, DType::BF16, n, k);
    std::vector<uint8_t> odd(size_t(n * (k + 1)) * 2);  // the same rows at ld k + 1
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(&odd[size_t(r * (k + 1)) * 2], &wbytes[size_t(r * k) * 2], size_t(k) * 2);
    const auto w2bytes = random_weight(rng, DType::BF16, n2, k2);
    const Weight w{gpu->upload(wbytes.data(), wbytes.size()), DType::BF16, n, k, k};
    const Weight w_odd{gpu->upload(odd.data(), odd.size()), DType::BF16, n, k, k + 1};
    const Weight w2{gpu->upload(w2bytes.data(), w2bytes.size()), DType::BF16, n2, k2, k2};
    struct Probe {
      std::string name;
      Weight a, b;  // the same values, b at ld k + 1 (BF16; a quantized probe has b == a)
    };
    std::vector<Probe> probes{{"BF16", w, w_odd}};
    const QuantMatrix q4 = random_quant_matrix(rng, DType::Q4, DType::BF16, n, k, 32, 0);
    const Weight wq4 = q4.upload(*gpu);
    probes.push_back({"Q4, BF16 scales", wq4, wq4});
    if (fast) {
      const QuantMatrix f8 = random_quant_matrix(rng, DType::F8_E4M3, DType::F32, n, k, 128, 0);
      const Weight wf8 = f8.upload(*gpu);
      probes.push_back({"F8_E4M3", wf8, wf8});
    }
    const auto probe = rng.floats(size_t(k));
    // The probe rows of one call: the probe at rows m / 2 and m - 1 of w's GEMM, with a GEMM of w2
    // over m + 3 other rows in the same call (none for m = 1), first in the table with w2_first.
    auto run = [&](const Weight& wt, int64_t m, bool w2_first) {
      auto x = rng.floats(size_t(m * k));
      const std::vector<int64_t> at = m == 1 ? std::vector<int64_t>{0} : std::vector<int64_t>{m / 2, m - 1};
      for (int64_t r : at) std::copy(probe.begin(), probe.end(), x.begin() + r * k);
      const int64_t m2 = m == 1 ? 0 : m + 3;
      Dev<float> dx(*gpu, x), dy(*gpu, nan_vec(size_t(m * n))),
          dx2(*gpu, rng.floats(size_t(std::max<int64_t>(1, m2 * k2)))),
          dy2(*gpu, nan_vec(size_t(std::max<int64_t>(1, m2 * n2))));
      std::vector<GemmParams> ps{{dx.get(), k, wt, false, dy.get(), n, m, n, k}};
      if (m2 > 0)
        ps.insert(w2_first ? ps.begin() : ps.end(), GemmParams{dx2.get(), k2, w2, false, dy2.get(), n2, m2, n2, k2});
      gpu->gemm_grouped(ps);
      const auto y = dy.host("grouped gemm m=" + std::to_string(m));
      std::vector<std::vector<float>> rows;
      for (int64_t r : at) rows.emplace_back(y.begin() + r * n, y.begin() + (r + 1) * n);
      return rows;
    };
    for (const Probe& pr : probes) {
      SCOPED_TRACE(pr.name);
      const auto alone = run(pr.a, 1, false).front();
      EXPECT_EQ(gpu->kernel_ran("gemm_grouped"), "tensor cores (grouped: 1 of 1 gemms)");
      if (pr.b.data != pr.a.data)
        expect_equal(run(pr.b, 1, false).front(), alone, "the probe alone, weight at ld k + 1");
      for (int64_t m : {7, 64, 65, 300}) {
        const bool w2_first = m >= 64;
        const auto rows = run(m % 2 ? pr.b : pr.a, m, w2_first);
        EXPECT_EQ(gpu->kernel_ran("gemm_grouped"), "tensor cores (grouped: 2 of 2 gemms)");
        const std::string of = " of m = " + std::to_string(m) + " (another GEMM " + (w2_first ? "before" : "after") +
                               " it in the call) vs m = 1";
        expect_equal(rows[0], alone, "row " + std::to_string(m / 2) + of);
        expect_equal(rows[1], alone, "row " + std::to_string(m - 1) + of);
      }
    }
  }
}

// Host-side checks of quantized weights throw at the call, naming what is wrong.
TEST(CudaOps, QuantGemmRejectsBadWeights) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  std::vector<uint8_t> bytes(4096, 0x11);
  std::vector<float> x(64, 1.0f), y(64, 0.0f);
  auto expect_error = [&](Weight w, const std::vector<std::string>& needles) {
    GemmParams p;
    p.x = x.data(), p.ldx = 8, p.w = w, p.y = y.data(), p.ldy = 4, p.m = 2, p.n = 4, p.k = 8;
    try {
      gpu->gemm(p);
      ADD_FAILURE() << "expected an error mentioning '" << needles.front() << "'";
    } catch (const Error& e) {
      for (const auto& s : needles) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
    }
  };
  const Weight q4{bytes.data(), DType::Q4, 4, 8, 8, bytes.data(), DType::BF16, 1, 8, 1};
  Weight w = q4;
  w.scale_dtype = DType::U8;
  expect_error(w, {"int4", "scales must be BF16, F16 or F32"});
  w = q4, w.ld = 9;
  expect_error(w, {"int4", "ld 9 is odd"});
  w = q4, w.group = 0;
  expect_error(w, {"int4", "group > 0"});
  w = q4, w.group = 4;  // needs 2 scales per row
  expect_error(w, {"int4", "scale_ld >= 2"});
  w = q4, w.dtype = DType::Q8, w.scale_block_rows = 2;
  expect_error(w, {"int8", "scale_block_rows 2"});
  w = q4, w.scale = nullptr;
  expect_error(w, {"int4", "without scales"});
  w = q4, w.dtype = DType::F8_E4M3, w.scale_block_rows = 128;
  expect_error(w, {"F8_E4M3", "scales must be F32, found BF16"});
  w = q4, w.dtype = DType::U8;
  expect_error(w, {"U8", "not supported"});
  w = q4, w.rows = 5;
  expect_error(w, {"weight is [5, 8]"});
}

// ---- norms, rope, element-wise -----------------------------------------------------------------

TEST(CudaOps, RmsNormAndLayerNorm) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto ref = make_reference_backend();
  Rng rng(11);
  struct Case {
    int64_t m, d;
    bool in_place;
  };
  for (const Case c :
       {Case{1, 1, false}, Case{3, 7, true}, Case{37, 256, false}, Case{5, 1000, true}, Case{2, 6144, false}}) {
    const int64_t ld = c.d + 3;
    const std::string what = "m=" + std::to_string(c.m) + " d=" + std::to_string(c.d);
    auto x = rng.floats(size_t(c.m * ld), -3.0f, 3.0f);
    auto w = rng.floats(size_t(c.d)), bias = rng.floats(size_t(c.d));
    Dev<float> dw(*gpu, w), db(*gpu, bias);
    {  // rms_norm
      std::vector<float> want = c.in_place ? x : nan_vec(x.size());
      RmsNormParams p;
      p.x = x.data(), p.ldx = ld, p.weight = w.data(), p.y = want.data(), p.ldy = ld;
      p.m = c.m, p.d = c.d, p.eps = 1e-5f;
      if (c.in_place) p.x = want.data();
      ref->rms_norm(p);
      Dev<float> dx(*gpu, x), dy(*gpu, nan_vec(x.size()));
      RmsNormParams q = p;
      q.x = dx.get(), q.weight = dw.get(), q.y = c.in_place ? dx.get() : dy.get();
      gpu->rms_norm(q);
      auto got = (c.in_place ? dx : dy).host("rms_norm");
      expect_close(got, want, 1e-5f, 1e-5f, "rms_norm " + what);
    }
    {  // layer_norm
      std::vector<float> want = c.in_place ? x : nan_vec(x.size());
      LayerNormParams p;
      p.x = x.data(), p.ldx = ld, p.weight = w.data(), p.bias = bias.data(), p.y = want.data();
      p.ldy = ld, p.m = c.m, p.d = c.d, p.eps = 1e-6f;
      if (c.in_place) p.x = want.data();
      ref->layer_norm(p);
      Dev<float> dx(*gpu, x), dy(*gpu, nan_vec(x.size()));
      LayerNormParams q = p;
      q.x = dx.get(), q.weight = dw.get(), q.bias = db.get(), q.y = c.in_place ? dx.get() : dy.get();
      gpu->layer_norm(q);
      auto got = (c.in_place ? dx : dy).host("layer_norm");
      expect_close(got, want, 2e-5f, 2e-5f, "layer_norm " + what);
    }
  }
}

TEST(CudaOps, RopeBothLayouts) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto ref = make_reference_backend();
  Rng rng(12);
  struct Case {
    int64_t m, heads, head_stride, offset, rope_dim;
    float mscale;
  };
  // GLM-5 q: 64 heads of 256 with the rope slice at 192; indexer q: rope slice first.
  for (const Case c : {Case{1, 1, 2, 0, 2, 1.0f}, Case{3, 4, 48, 32, 16, 1.0f}, Case{5, 64, 256, 192, 64, 1.0f},
                       Case{7, 32, 128, 0, 64, 1.3689f}}) {
    for (bool interleaved : {true, false}) {
      const int64_t token_stride = c.heads * c.head_stride + 5;
      auto x = rng.floats(size_t(c.m * token_stride));
      std::vector<int32_t> pos(size_t(c.m));
      for (auto& v : pos) v = rng.integer(0, 131071);
      pos[0] = 0;
      std::vector<float> inv_freq(size_t(c.rope_dim / 2));
      for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(1e6f, -2.0f * float(i) / float(c.rope_dim));
      std::vector<float> want = x;
      RopeParams p;
      p.x = want.data(), p.m = c.m, p.n_heads = c.heads, p.token_stride = token_stride;
      p.head_stride = c.head_stride, p.offset = c.offset, p.rope_dim = c.rope_dim;
      p.positions = pos.data(), p.inv_freq = inv_freq.data(), p.mscale = c.mscale;
      p.interleaved = interleaved;
      ref->rope(p);
      Dev<float> dx(*gpu, x), dinv(*gpu, inv_freq);
      Dev<int32_t> dpos(*gpu, pos);
      RopeParams q = p;
      q.x = dx.get(), q.positions = dpos.get(), q.inv_freq = dinv.get();
      gpu->rope(q);
      expect_close(dx.host("rope"), want, 2e-6f, 2e-5f,
                   "rope heads=" + std::to_string(c.heads) + " dim=" + std::to_string(c.rope_dim) +
                       (interleaved ? " interleaved" : " half-split"));
    }
  }
}

TEST(CudaOps, SwigluAddCopy2dGatherRows) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto ref = make_reference_backend();
  Rng rng(13);
  for (auto [m, n] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {33, 2048}}) {
    const std::string what = " m=" + std::to_string(m) + " n=" + std::to_string(n);
    const int64_t ld_in = 2 * n + 1, ld_out = n + 2;
    {  // swiglu, gate and up interleaved in one buffer as [gate | up] rows
      auto in = rng.floats(size_t(m * ld_in), -10.0f, 10.0f);
      std::vector<float> want = nan_vec(size_t(m * ld_out));
      SwigluParams p;
      p.gate = in.data(), p.up = in.data() + n, p.ld_in = ld_in, p.out = want.data();
      p.ld_out = ld_out, p.m = m, p.n = n;
      ref->swiglu(p);
      Dev<float> din(*gpu, in), dout(*gpu, nan_vec(want.size()));
      SwigluParams q = p;
      q.gate = din.get(), q.up = din.get() + n, q.out = dout.get();
      gpu->swiglu(q);
      expect_close(dout.host("swiglu"), want, 1e-6f, 1e-5f, "swiglu" + what);
    }
    {  // add: one rounding on both sides, so bitwise equal
      auto x = rng.floats(size_t(m * n)), y = rng.floats(size_t(m * n));
      std::vector<float> want = y;
      AddParams p;
      p.x = x.data(), p.y = want.data(), p.n = m * n;
      ref->add(p);
      Dev<float> dx(*gpu, x), dy(*gpu, y);
      gpu->add(AddParams{dx.get(), dy.get(), m * n});
      expect_equal(dy.host("add"), want, "add" + what);
    }
    {  // copy_2d between strided blocks
      auto src = rng.floats(size_t(m * ld_in));
      auto dst = rng.floats(size_t(m * ld_out));
      std::vector<float> want = dst;
      Copy2dParams p;
      p.src = src.data(), p.ld_src = ld_in, p.dst = want.data(), p.ld_dst = ld_out;
      p.rows = m, p.cols = n;
      ref->copy_2d(p);
      Dev<float> ds(*gpu, src), dd(*gpu, dst);
      Copy2dParams q = p;
      q.src = ds.get(), q.dst = dd.get();
      gpu->copy_2d(q);
      expect_equal(dd.host("copy_2d"), want, "copy_2d" + what);
    }
    {  // gather_rows with repeats
      const int64_t src_rows = m + 3;
      auto src = rng.floats(size_t(src_rows * n));
      std::vector<int32_t> rows(size_t(2 * m));
      for (auto& r : rows) r = rng.integer(0, int(src_rows - 1));
      std::vector<float> want = nan_vec(rows.size() * size_t(n));
      GatherRowsParams p;
      p.src = src.data(), p.rows = rows.data(), p.n = int64_t(rows.size()), p.d = n;
      p.dst = want.data();
      ref->gather_rows(p);
      Dev<float> ds(*gpu, src), dd(*gpu, nan_vec(want.size()));
      Dev<int32_t> dr(*gpu, rows);
      GatherRowsParams q = p;
      q.src = ds.get(), q.rows = dr.get(), q.dst = dd.get();
      gpu->gather_rows(q);
      expect_equal(dd.host("gather_rows"), want, "gather_rows" + what);
    }
  }
}

TEST(CudaOps, EmbeddingAllDtypes) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto ref = make_reference_backend();
  Rng rng(14);
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
    const int64_t vocab = 513, hidden = 67, ld = 70;
    const auto bytes = random_weight(rng, dt, vocab, ld);
    std::vector<int32_t> ids = {0, 512, 7, 7, 300};
    std::vector<float> want = nan_vec(ids.size() * size_t(hidden));
    EmbeddingParams p;
    p.table = Weight{bytes.data(), dt, vocab, hidden, ld};
    p.ids = ids.data(), p.m = int64_t(ids.size()), p.out = want.data();
    ref->embedding(p);
    Dev<int32_t> dids(*gpu, ids);
    Dev<float> dout(*gpu, nan_vec(want.size()));
    EmbeddingParams q = p;
    q.table.data = gpu->upload(bytes.data(), bytes.size());
    q.ids = dids.get(), q.out = dout.get();
    gpu->embedding(q);
    expect_equal(dout.host("embedding"), want, "embedding " + std::string(dtype_name(dt)));
  }
}

TEST(CudaOps, MoeCombine) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto ref = make_reference_backend();
  Rng rng(15);
  for (auto [m, top_k, d] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {5, 4, 33}, {17, 8, 6144}}) {
    for (bool accumulate : {false, true}) {
      const int64_t n_slots = m * top_k + 2;
      auto expert_out = rng.floats(size_t(n_slots * d));
      std::vector<int32_t> slots(size_t(m * top_k));
      for (auto& s : slots) s = rng.integer(-1, int(n_slots - 1));  // -1: expert not here
      auto weights = rng.floats(slots.size(), 0.0f, 2.5f);
      auto out0 = rng.floats(size_t(m * d));
      std::vector<float> want = accumulate ? out0 : nan_vec(out0.size());
      MoeCombineParams p;
      p.expert_out = expert_out.data(), p.slots = slots.data(), p.weights = weights.data();
      p.out = want.data(), p.m = m, p.top_k = top_k, p.d = d, p.accumulate = accumulate;
      ref->moe_combine(p);
      Dev<float> de(*gpu, expert_out), dw(*gpu, weights), dout(*gpu, accumulate ? out0 : nan_vec(out0.size()));
      Dev<int32_t> ds(*gpu, slots);
      MoeCombineParams q = p;
      q.expert_out = de.get(), q.slots = ds.get(), q.weights = dw.get(), q.out = dout.get();
      gpu->moe_combine(q);
      expect_close(
          dout.host("moe_combine"), want, 1e-6f, 1e-6f,
          "moe_combine m=" + std::to_string(m) + " top_k=" + std::to_string(top_k) + (accumulate ? " accumulate" : ""));
    }
  }
}

// ---- router ------------------------------------------------------------------------------------

TEST(CudaOps, RouterMatchesReferenceIncludingTies) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto ref = make_reference_backend();
  Rng rng(16);
  struct Case {
    int64_t m, n_experts, top_k, n_group, topk_group;
    bool bias, norm, ties;
  };
  // GLM-5, DeepSeek-V3.2, tiny-a, odd sizes; `ties` draws logits from 8 levels only.
  for (const Case c : {Case{9, 256, 8, 1, 1, true, true, false}, Case{9, 256, 8, 8, 4, true, true, false},
                       Case{33, 16, 4, 4, 2, true, true, false}, Case{1, 7, 1, 1, 1, false, false, false},
                       Case{20, 64, 6, 4, 2, true, true, true}, Case{20, 48, 5, 1, 1, false, true, true}}) {
    // Logits on a 0.01 grid (distinct sigmoids stay far apart in float), bias on a 0.125 grid.
    std::vector<float> logits(size_t(c.m * c.n_experts));
    for (auto& v : logits) v = c.ties ? 0.5f * float(rng.integer(-4, 3)) : 0.01f * float(rng.integer(-400, 400));
    std::vector<float> bias(size_t(c.n_experts));
    for (auto& v : bias) v = 0.125f * float(rng.integer(-2, 2));
    RouterParams p;
    p.logits = logits.data(), p.bias = c.bias ? bias.data() : nullptr, p.m = c.m;
    p.n_experts = c.n_experts, p.top_k = c.top_k, p.n_group = c.n_group;
    p.topk_group = c.topk_group, p.norm_topk_prob = c.norm, p.routed_scaling_factor = 2.5f;
    std::vector<int32_t> want_ids(size_t(c.m * c.top_k), -7);
    std::vector<float> want_w = nan_vec(want_ids.size());
    p.expert_ids = want_ids.data(), p.expert_weights = want_w.data();
    ref->router(p);
    Dev<float> dl(*gpu, logits), db(*gpu, bias), dw(*gpu, nan_vec(want_w.size()));
    Dev<int32_t> di(*gpu, std::vector<int32_t>(want_ids.size(), -7));
    RouterParams q = p;
    q.logits = dl.get(), q.bias = c.bias ? db.get() : nullptr, q.expert_ids = di.get();
    q.expert_weights = dw.get();
    gpu->router(q);
    const std::string what = "router n_experts=" + std::to_string(c.n_experts) + " top_k=" + std::to_string(c.top_k) +
                             " groups=" + std::to_string(c.n_group) + (c.ties ? " ties" : "");
    expect_equal(di.host("router ids"), want_ids, what + " ids");
    expect_close(dw.host("router weights"), want_w, 1e-6f, 1e-5f, what + " weights");
  }
}

// ---- indexer, top-k ----------------------------------------------------------------------------

TEST(CudaOps, IndexerScores) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto ref = make_reference_backend();
  Rng rng(17);
  struct Case {
    int64_t s, t, heads, dim;
  };
  // GLM-5: 32 heads x 128; DeepSeek-V3.2: 64 x 128; head_dim 300 takes the no-register path.
  for (const Case c : {Case{1, 1, 1, 1}, Case{3, 17, 2, 5}, Case{5, 300, 8, 32}, Case{4, 1000, 32, 128},
                       Case{2, 513, 64, 128}, Case{2, 700, 3, 300}}) {
    const int64_t ld = c.t + 3;
    auto q = rng.floats(size_t(c.s * c.heads * c.dim));
    auto k = rng.floats(size_t(c.t * c.dim));
    auto w = rng.floats(size_t(c.s * c.heads), -0.3f, 0.3f);  // signed: applied after the ReLU
    std::vector<int32_t> qpos(size_t(c.s));
    for (int64_t i = 0; i < c.s; ++i) qpos[size_t(i)] = int32_t(c.t - c.s + i);  // causal tail
    if (c.s >= 3) qpos[0] = -1, qpos[1] = int32_t(c.t + 5);                      // fully masked; all keys allowed
    std::vector<float> want = nan_vec(size_t(c.s * ld));
    IndexerScoresParams p;
    p.q = q.data(), p.weights = w.data(), p.k = k.data(), p.q_pos = qpos.data();
    p.scores = want.data(), p.s = c.s, p.t = c.t, p.n_heads = c.heads, p.head_dim = c.dim;
    p.ld_scores = ld;
    ref->indexer_scores(p);
    Dev<float> dq(*gpu, q), dk(*gpu, k), dw(*gpu, w), ds(*gpu, nan_vec(want.size()));
    Dev<int32_t> dp(*gpu, qpos);
    IndexerScoresParams g = p;
    g.q = dq.get(), g.weights = dw.get(), g.k = dk.get(), g.q_pos = dp.get(), g.scores = ds.get();
    gpu->indexer_scores(g);
    auto got = ds.host("indexer_scores");
    for (int64_t i = 0; i < c.s; ++i)  // padding columns are not written
      for (int64_t j = c.t; j < ld; ++j) got[i * ld + j] = want[i * ld + j] = 0.0f;
    const float scale = float(c.heads) * 0.3f * std::sqrt(float(c.dim));
    expect_close(got, want, 2e-6f * scale, 1e-5f,
                 "indexer_scores s=" + std::to_string(c.s) + " t=" + std::to_string(c.t) +
                     " heads=" + std::to_string(c.heads) + " dim=" + std::to_string(c.dim));
  }
}

// BF16 keys on both indexer kernels: SIMT (default) and tensor cores (GLM5_CUDA_INDEXER=tensor;
// head_dim 64 / 128 / 256, up to 64 heads, partial head tiles, partial and masked key tiles,
// contiguous and paged keys with one table per row). The reference reads the keys widened.
TEST(CudaOps, IndexerScoresBf16TensorCores) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto ref = make_reference_backend();
  struct Case {
    int64_t s, t, heads, dim;
    bool paged;
  };
  for (const char* kernel : {"simt", "tensor"}) {
    SCOPED_TRACE(std::string("GLM5_CUDA_INDEXER=") + kernel);
    ScopedEnv env("GLM5_CUDA_INDEXER", kernel), log("GLM5_CUDA_ATTENTION_LOG", "1");
    StderrCapture capture;
    auto gpu = make_cuda_backend(0);
    Rng rng(170);
    // (Shared memory: at most 163 KB a block, so that an A100 takes every case too.)
    for (const Case c : {Case{1, 1, 1, 64, false}, Case{5, 300, 8, 64, false}, Case{4, 1000, 32, 128, false},
                         Case{2, 513, 64, 128, false}, Case{3, 700, 20, 128, false}, Case{3, 700, 8, 256, false},
                         Case{6, 2000, 32, 128, true}, Case{3, 257, 50, 64, true}}) {
      const int64_t ld = c.t + 3, B = 64, max_blocks = (c.t + B - 1) / B;
      auto q = rng.floats(size_t(c.s * c.heads * c.dim));
      auto k = rng.floats(size_t(c.t * c.dim));
      std::vector<uint16_t> kb(k.size());
      for (size_t i = 0; i < k.size(); ++i) kb[i] = f32_to_bf16(k[i]), k[i] = bf16_to_f32(kb[i]);
      auto w = rng.floats(size_t(c.s * c.heads), -0.3f, 0.3f);
      std::vector<int32_t> qpos(size_t(c.s)), tables;
      for (int64_t i = 0; i < c.s; ++i) qpos[size_t(i)] = int32_t(c.t - c.s + i);
      if (c.s >= 3) qpos[0] = -1, qpos[1] = int32_t(c.t + 5);
      if (c.paged)  // row i reads block j from pool block (j + i) % max_blocks: the keys rotate per row
        for (int64_t i = 0; i < c.s; ++i)
          for (int64_t j = 0; j < max_blocks; ++j) tables.push_back(int32_t((j + i) % max_blocks));
      // The pool for paged rows: pool block b holds the keys of block b (all rows share the keys
      // by position only through their tables, so the reference gets the same tables).
      std::vector<float> want = nan_vec(size_t(c.s * ld));
      IndexerScoresParams p;
      p.q = q.data(), p.weights = w.data(), p.k = k.data(), p.q_pos = qpos.data();
      p.scores = want.data(), p.s = c.s, p.t = c.t, p.n_heads = c.heads, p.head_dim = c.dim, p.ld_scores = ld;
      if (c.paged) p.pages = KeyPages{tables.data(), max_blocks, B, DType::F32};
      std::vector<float> pool = k;
      if (c.paged) pool.resize(size_t(max_blocks * B * c.dim), 0.0f), p.k = pool.data();
      ref->indexer_scores(p);
      std::vector<uint16_t> pool_bf16(pool.size());
      for (size_t i = 0; i < pool.size(); ++i) pool_bf16[i] = f32_to_bf16(pool[i]);
      Dev<float> dq(*gpu, q), dw(*gpu, w), ds(*gpu, nan_vec(want.size()));
      Dev<int32_t> dp(*gpu, qpos), dt(*gpu, c.paged ? tables : std::vector<int32_t>{0});
      IndexerScoresParams g = p;
      g.q = dq.get(), g.weights = dw.get(), g.q_pos = dp.get(), g.scores = ds.get();
      g.k = static_cast<const float*>(gpu->upload(pool_bf16.data(), pool_bf16.size() * 2));
      g.pages = c.paged ? KeyPages{dt.get(), max_blocks, B, DType::BF16} : KeyPages{nullptr, 0, 0, DType::BF16};
      gpu->indexer_scores(g);
      auto got = ds.host("indexer_scores");
      for (int64_t i = 0; i < c.s; ++i)  // padding columns are not written (they stay NaN)
        for (int64_t j = c.t; j < ld; ++j) {
          EXPECT_TRUE(std::isnan(got[i * ld + j])) << "row " << i << " column " << j << " past t = " << c.t;
          got[i * ld + j] = want[i * ld + j] = 0.0f;
        }
      const float scale = float(c.heads) * 0.3f * std::sqrt(float(c.dim));
      expect_close(got, want, 2e-6f * scale, 1e-5f,
                   "indexer_scores bf16 keys s=" + std::to_string(c.s) + " t=" + std::to_string(c.t) + " heads=" +
                       std::to_string(c.heads) + " dim=" + std::to_string(c.dim) + (c.paged ? " paged" : ""));
    }
    const std::string err = capture.take();
    EXPECT_NE(err.find(attention_log_line("indexer_scores", kernel)), std::string::npos) << err;
    EXPECT_EQ(err.find(attention_log_line("indexer_scores", kernel == std::string("tensor") ? "simt" : "tensor")),
              std::string::npos)
        << err;
  }
}

// Runs topk on both backends over the same scores; the selections must be identical.
void check_topk(Backend& gpu, const std::vector<float>& scores, int64_t rows, int64_t cols, int64_t ld, int64_t k,
                const std::string& what) {
  auto ref = make_reference_backend();
  std::vector<int32_t> want(size_t(rows * k), -7);
  TopkParams p;
  p.scores = scores.data(), p.rows = rows, p.cols = cols, p.ld = ld, p.k = k;
  p.indices = want.data();
  ref->topk(p);
  Dev<float> ds(gpu, scores);
  Dev<int32_t> di(gpu, std::vector<int32_t>(want.size(), -7));
  TopkParams q = p;
  q.scores = ds.get(), q.indices = di.get();
  gpu.topk(q);
  expect_equal(di.host("topk " + what), want, "topk " + what);
}

// GLM5_CUDA_TOPK=multiblock: rows longer than 16k columns, fewer than half the SMs, are cut over many
// blocks; the selection must be the reference's exactly (ties to the lower index, ascending,
// -1 padded), across slice boundaries: ties spread over slices, a k-th key shared by many entries,
// masked and special values, rows with fewer finite entries than k, GLM-5's top-2048 of 128k.
TEST(CudaOps, TopkMultiBlockMatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  setenv("GLM5_CUDA_TOPK", "multiblock", 1);
  auto gpu = make_cuda_backend(0);
  unsetenv("GLM5_CUDA_TOPK");
  Rng rng(19);
  {
    const int64_t rows = 4, cols = 131072;
    check_topk(*gpu, rng.floats(size_t(rows * cols)), rows, cols, cols, 2048, "4 rows x 128k, k 2048");
    EXPECT_EQ(gpu->kernel_ran("topk"), "multi-block");
    auto plain = make_cuda_backend(0);  // the default: one block per row
    check_topk(*plain, rng.floats(size_t(rows * cols)), rows, cols, cols, 2048, "default backend");
    EXPECT_EQ(plain->kernel_ran("topk"), "one block per row");
  }
  {  // heavy ties across slices: the k-th value shared by thousands of entries
    const int64_t rows = 2, cols = 40000;
    std::vector<float> v(size_t(rows * cols));
    for (auto& x : v) x = 0.25f * float(rng.integer(-3, 3));
    check_topk(*gpu, v, rows, cols, cols, 2048, "ties over slices");
    check_topk(*gpu, v, rows, cols, cols, 30000, "ties, k large");
  }
  {  // causal decode rows: finite up to a position, fewer than k finite in one; NaN / inf / -0 / +0;
     // the padding past cols (ld > cols) large and finite: read past cols and it would win
    const int64_t rows = 3, cols = 50000, ld = 50017;
    std::vector<float> v(size_t(rows * ld), -kInf);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = cols; c < ld; ++c) v[size_t(r * ld + c)] = 1e30f;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c <= (r == 0 ? 1000 : r == 1 ? 30000 : cols - 1); ++c) {
        float x = rng.uniform();
        if (c % 97 == 0) x = std::nanf("");
        if (c % 89 == 0) x = kInf;
        if (c % 83 == 1) x = (c % 2) ? -0.0f : 0.0f;
        v[size_t(r * ld + c)] = x;
      }
    check_topk(*gpu, v, rows, cols, ld, 2048, "causal rows with specials");
  }
  {  // the k-th key among many zeros of both signs, spread over slices
    std::vector<float> v(30000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = i % 3 == 0 ? 1.0f : i % 3 == 1 ? ((i / 3) % 2 ? -0.0f : 0.0f) : -1.0f;
    check_topk(*gpu, v, 1, 30000, 30000, 15000, "k-th key among +0 / -0");
  }
  {  // low-bit differences: every radix pass decides
    std::vector<float> v(20000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + float(rng.integer(0, 5000)) * 1.1920929e-7f;
    check_topk(*gpu, v, 1, 20000, 20000, 700, "low-bit differences");
  }
}

TEST(CudaOps, TopkSmallAndEdgeCases) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  Rng rng(18);
  check_topk(*gpu, {0.5f}, 1, 1, 1, 1, "one entry");
  check_topk(*gpu, {-kInf}, 1, 1, 1, 1, "one masked entry");
  check_topk(*gpu, rng.floats(30), 3, 10, 10, 20, "k > cols");
  check_topk(*gpu, rng.floats(4 * 107), 4, 100, 107, 7, "ld > cols");
  {  // heavy ties: 5 levels, so the k-th value is shared by many entries
    std::vector<float> v(2 * 1000);
    for (auto& x : v) x = 0.25f * float(rng.integer(-2, 2));
    check_topk(*gpu, v, 2, 1000, 1000, 64, "ties");
    check_topk(*gpu, v, 2, 1000, 1000, 999, "ties, k = cols - 1");
  }
  {  // a fully masked row, a row with one finite entry, NaN / +inf / -0 / +0 mixed in
    const int64_t cols = 50;
    std::vector<float> v(size_t(4 * cols), -kInf);
    v[size_t(cols + 17)] = 3.0f;
    for (int64_t j = 0; j < cols; ++j) {
      float x = rng.uniform();
      if (j % 7 == 0) x = std::nanf("");
      if (j % 11 == 0) x = kInf;
      if (j % 5 == 1) x = (j % 2) ? -0.0f : 0.0f;
      v[size_t(2 * cols + j)] = x;
      v[size_t(3 * cols + j)] = j % 3 ? -kInf : rng.uniform();
    }
    check_topk(*gpu, v, 4, cols, cols, 16, "masked / one finite / specials / causal");
  }
  {  // causal prefill rows: row r has r + 1 finite entries, fewer than k for the first rows
    const int64_t rows = 40, cols = 40, k = 16;
    std::vector<float> v(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) v[size_t(r * cols + c)] = c <= r ? rng.uniform() : -kInf;
    check_topk(*gpu, v, rows, cols, cols, k, "causal rows");
  }
  {  // floats that differ only in the low bits (all four radix passes matter)
    std::vector<float> v(3000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + float(rng.integer(0, 2000)) * 1.1920929e-7f;
    check_topk(*gpu, v, 1, 3000, 3000, 100, "low-bit differences");
  }
}

TEST(CudaOps, TopkIndex2048Over128kContext) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  Rng rng(19);
  const int64_t cols = 131072, k = 2048;
  std::vector<float> v(size_t(3 * cols));
  for (int64_t c = 0; c < cols; ++c) {
    v[size_t(c)] = rng.uniform(0.0f, 4.0f);                              // decode row
    v[size_t(cols + c)] = c < 100000 ? rng.uniform(0.0f, 4.0f) : -kInf;  // causal
    v[size_t(2 * cols + c)] = 0.001f * float(rng.integer(0, 3000));      // many ties
  }
  check_topk(*gpu, v, 3, cols, cols, k, "2048 of 128k");
}

TEST(CudaOps, IndexerThenTopkPipeline) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  // Scores computed on the device, then top-k on the device, against top-k of those same scores
  // on the reference: checks that the two kernels compose (layout, -inf of the causal mask).
  auto gpu = make_cuda_backend(0);
  Rng rng(20);
  const int64_t s = 4, t = 3000, heads = 32, dim = 128, k = 2048;
  auto q = rng.floats(size_t(s * heads * dim)), kk = rng.floats(size_t(t * dim));
  auto w = rng.floats(size_t(s * heads), -0.2f, 0.2f);
  std::vector<int32_t> qpos = {0, 100, 2047, 2999};
  Dev<float> dq(*gpu, q), dk(*gpu, kk), dw(*gpu, w), ds(*gpu, nan_vec(size_t(s * t)));
  Dev<int32_t> dp(*gpu, qpos), di(*gpu, std::vector<int32_t>(size_t(s * k), -7));
  IndexerScoresParams p;
  p.q = dq.get(), p.weights = dw.get(), p.k = dk.get(), p.q_pos = dp.get(), p.scores = ds.get();
  p.s = s, p.t = t, p.n_heads = heads, p.head_dim = dim, p.ld_scores = t;
  gpu->indexer_scores(p);
  TopkParams tp;
  tp.scores = ds.get(), tp.rows = s, tp.cols = t, tp.ld = t, tp.k = k, tp.indices = di.get();
  gpu->topk(tp);
  const auto scores = ds.host("scores");
  const auto got = di.host("indices");
  check_topk(*gpu, scores, s, t, t, k, "pipeline recheck");
  auto ref = make_reference_backend();
  std::vector<int32_t> want(size_t(s * k));
  TopkParams rp = tp;
  rp.scores = scores.data(), rp.indices = want.data();
  ref->topk(rp);
  expect_equal(got, want, "indexer -> topk on device");
  EXPECT_EQ(got[1], -1) << "row at position 0 keeps exactly one key";
}

// ---- MLA ---------------------------------------------------------------------------------------

// Top-k lists as the indexer makes them: sorted ascending, -1 padded (reference topk of random
// causal scores), and optionally shuffled (order must not matter).
std::vector<int32_t> make_topk_lists(Rng& rng, const std::vector<int32_t>& qpos, int64_t t, int64_t len, bool shuffle) {
  const int64_t s = int64_t(qpos.size());
  std::vector<float> scores(size_t(s * t));
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j < t; ++j) scores[size_t(i * t + j)] = j <= qpos[size_t(i)] ? rng.uniform() : -kInf;
  std::vector<int32_t> out(size_t(s * len));
  auto ref = make_reference_backend();
  TopkParams p;
  p.scores = scores.data(), p.rows = s, p.cols = t, p.ld = t, p.k = len, p.indices = out.data();
  ref->topk(p);
  if (shuffle)
    for (int64_t i = 0; i < s; ++i) std::shuffle(out.begin() + i * len, out.begin() + (i + 1) * len, rng.gen);
  return out;
}

struct MlaCase {
  int64_t s, t, heads, nope, rope, v;
  int64_t topk_len;  // 0: dense causal
  bool shuffle;
};

void check_mla_prefill(Backend& gpu, const MlaCase& c, uint32_t seed) {
  Rng rng(seed);
  const int64_t dq = c.nope + c.rope, ld_k_pe = c.rope + 3;
  auto q = rng.floats(size_t(c.s * c.heads * dq));
  auto kv = rng.floats(size_t(c.t * c.heads * (c.nope + c.v)));
  auto k_pe = rng.floats(size_t(c.t * ld_k_pe));
  std::vector<int32_t> qpos(size_t(c.s));
  for (int64_t i = 0; i < c.s; ++i) qpos[size_t(i)] = int32_t(std::max<int64_t>(0, c.t - c.s + i));
  if (c.s >= 3) qpos[0] = -1, qpos[1] = int32_t(c.t + 4);  // fully masked row; beyond the keys
  std::vector<int32_t> topk;
  if (c.topk_len) topk = make_topk_lists(rng, qpos, c.t, c.topk_len, c.shuffle);
  const float scale = 1.0f / std::sqrt(float(dq));
  std::vector<float> want = nan_vec(size_t(c.s * c.heads * c.v));
  MlaPrefillParams p;
  p.q = q.data(), p.kv = kv.data(), p.k_pe = k_pe.data(), p.ld_k_pe = ld_k_pe;
  p.q_pos = qpos.data(), p.topk = c.topk_len ? topk.data() : nullptr, p.topk_len = c.topk_len;
  p.out = want.data(), p.s = c.s, p.t = c.t, p.n_heads = c.heads, p.qk_nope_head_dim = c.nope;
  p.qk_rope_head_dim = c.rope, p.v_head_dim = c.v, p.scale = scale;
  make_reference_backend()->mla_prefill(p);
  Dev<float> dq_(gpu, q), dkv(gpu, kv), dpe(gpu, k_pe), dout(gpu, nan_vec(want.size()));
  Dev<int32_t> dpos(gpu, qpos), dtk(gpu, c.topk_len ? topk : std::vector<int32_t>{0});
  MlaPrefillParams g = p;
  g.q = dq_.get(), g.kv = dkv.get(), g.k_pe = dpe.get(), g.q_pos = dpos.get();
  g.topk = c.topk_len ? dtk.get() : nullptr, g.out = dout.get();
  gpu.mla_prefill(g);
  expect_close(dout.host("mla_prefill"), want, 2e-6f, 1e-4f,
               "mla_prefill s=" + std::to_string(c.s) + " t=" + std::to_string(c.t) +
                   " heads=" + std::to_string(c.heads) + " topk_len=" + std::to_string(c.topk_len) +
                   (c.shuffle ? " shuffled" : ""));
}

// cache_dtype BF16: the cache holds bf16 values (the reference reads them widened), which with a
// top-k list and kv_lora_rank 512 takes the tensor-core kernel.
void check_mla_decode(Backend& gpu, const MlaCase& c, uint32_t seed, DType cache_dtype = DType::F32) {
  Rng rng(seed);
  const int64_t lora = c.nope, row = c.nope + c.rope;  // MlaCase.nope = kv_lora_rank here
  auto q = rng.floats(size_t(c.s * c.heads * row));
  auto cache = rng.floats(size_t(c.t * row));
  std::vector<uint16_t> cache_bf16;
  if (cache_dtype == DType::BF16) {
    for (float& v : cache) {
      cache_bf16.push_back(f32_to_bf16(v));
      v = bf16_to_f32(cache_bf16.back());
    }
  }
  std::vector<int32_t> qpos(size_t(c.s));
  for (int64_t i = 0; i < c.s; ++i) qpos[size_t(i)] = int32_t(std::max<int64_t>(0, c.t - c.s + i));
  if (c.s >= 3) qpos[0] = -1, qpos[1] = int32_t(c.t / 2);
  std::vector<int32_t> topk;
  if (c.topk_len) topk = make_topk_lists(rng, qpos, c.t, c.topk_len, c.shuffle);
  std::vector<float> want = nan_vec(size_t(c.s * c.heads * lora));
  MlaDecodeParams p;
  p.q_lat = q.data(), p.cache = cache.data(), p.q_pos = qpos.data();
  p.topk = c.topk_len ? topk.data() : nullptr, p.topk_len = c.topk_len, p.out_lat = want.data();
  p.s = c.s, p.t = c.t, p.n_heads = c.heads, p.kv_lora_rank = lora, p.qk_rope_head_dim = c.rope;
  p.scale = 1.0f / std::sqrt(float(row));
  make_reference_backend()->mla_decode(p);
  Dev<float> dq_(gpu, q), dc(gpu, cache), dout(gpu, nan_vec(want.size()));
  Dev<int32_t> dpos(gpu, qpos), dtk(gpu, c.topk_len ? topk : std::vector<int32_t>{0});
  MlaDecodeParams g = p;
  g.q_lat = dq_.get(), g.cache = dc.get(), g.q_pos = dpos.get();
  if (cache_dtype == DType::BF16) {
    g.cache = static_cast<const float*>(gpu.upload(cache_bf16.data(), cache_bf16.size() * 2));
    g.pages.dtype = DType::BF16;
  }
  g.topk = c.topk_len ? dtk.get() : nullptr, g.out_lat = dout.get();
  gpu.mla_decode(g);
  expect_close(dout.host("mla_decode"), want, 2e-6f, 1e-4f,
               "mla_decode " + std::string(dtype_name(cache_dtype)) + " cache s=" + std::to_string(c.s) +
                   " t=" + std::to_string(c.t) + " heads=" + std::to_string(c.heads) +
                   " topk_len=" + std::to_string(c.topk_len) + (c.shuffle ? " shuffled" : ""));
}

TEST(CudaOps, MlaPrefillDenseAndSparse) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  uint32_t seed = 30;
  for (const MlaCase& c :
       {MlaCase{1, 1, 1, 1, 1, 1, 0, false}, MlaCase{3, 7, 2, 5, 3, 4, 0, false},
        MlaCase{3, 7, 2, 5, 3, 4, 16, false},       // top-k wider than the context
        MlaCase{64, 64, 4, 32, 16, 32, 16, false},  // tiny-a prefill
        MlaCase{6, 300, 8, 192, 64, 256, 64, true}, MlaCase{4, 400, 64, 192, 64, 256, 2048, false},  // GLM-5 heads
        MlaCase{5, 50, 3, 0, 16, 8, 0, false}})                                                      // no nope part
    check_mla_prefill(*gpu, c, seed++);
}

TEST(CudaOps, MlaDecodeGlm5Shapes) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  uint32_t seed = 40;
  // {s, t, heads, kv_lora_rank, rope, -, topk_len, shuffle}
  for (const MlaCase& c :
       {MlaCase{1, 1, 1, 1, 0, 0, 0, false}, MlaCase{1, 80, 4, 32, 16, 0, 16, false},
        MlaCase{3, 37, 5, 7, 3, 0, 0, false}, MlaCase{3, 37, 5, 7, 3, 0, 64, true},
        MlaCase{2, 5000, 64, 512, 64, 0, 2048, false},  // GLM-5 decode
        MlaCase{3, 1500, 64, 512, 64, 0, 2048, true},   // top-k > context
        MlaCase{2, 700, 16, 512, 64, 0, 0, false},
        MlaCase{20, 300, 20, 600, 16, 0, 0, false}})  // partial head groups, latent in 2 column chunks
    check_mla_decode(*gpu, c, seed++);
}

// BF16 caches with top-k lists on both decode kernels: the SIMT one (default) and the tensor-core
// one (GLM5_CUDA_MLA_DECODE=tensor; kv_lora_rank 512). GLM-5's 64 heads and partial head groups
// (20, 5), keys in one or many 256-key splits and partial 32-key tiles, top-k wider than the
// context, rows without keys (q_pos -1) and shuffled lists with -1 holes.
TEST(CudaOps, MlaDecodeBf16CacheTensorCores) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  for (const char* kernel : {"simt", "tensor"}) {
    SCOPED_TRACE(std::string("GLM5_CUDA_MLA_DECODE=") + kernel);
    ScopedEnv env("GLM5_CUDA_MLA_DECODE", kernel), log("GLM5_CUDA_ATTENTION_LOG", "1");
    StderrCapture capture;
    auto gpu = make_cuda_backend(0);
    uint32_t seed = 140;
    // {s, t, heads, kv_lora_rank, rope, -, topk_len, shuffle}
    for (const MlaCase& c :
         {MlaCase{2, 5000, 64, 512, 64, 0, 2048, false}, MlaCase{3, 1500, 64, 512, 64, 0, 2048, true},
          MlaCase{4, 300, 20, 512, 64, 0, 256, true}, MlaCase{3, 40, 5, 512, 64, 0, 33, false},
          MlaCase{1, 1, 64, 512, 64, 0, 1, false}, MlaCase{5, 3000, 16, 512, 128, 0, 700, true}})
      check_mla_decode(*gpu, c, seed++, DType::BF16);
    const std::string err = capture.take();
    EXPECT_NE(err.find(attention_log_line("mla_decode", kernel)), std::string::npos) << err;
    EXPECT_EQ(err.find(attention_log_line("mla_decode", kernel == std::string("tensor") ? "simt" : "tensor")),
              std::string::npos)
        << err;
  }
}

// Decode rows of different sequences over paged pools (one block table per row) with GLM-5's
// attention and indexer dims. A row's output bits must not depend on the call: all 150 rows at
// once, 37 of them (rows 0..36 and 113..149) and each of rows 0..36 alone. The kernels choose how
// many heads share a block from the row count (on an H200: 64 for 150 rows, 16 for 37, 1 for one),
// so this also checks that that choice leaves every bit unchanged. F32 and BF16 caches, on the
// SIMT kernels and on the tensor-core ones (which take the BF16 cache; a decode row's splits
// follow its own keys, an indexer tile its own row).
void rows_independent_of_row_count(const char* kernel) {
  SCOPED_TRACE(std::string("GLM5_CUDA_MLA_DECODE and GLM5_CUDA_INDEXER = ") + kernel);
  ScopedEnv decode_env("GLM5_CUDA_MLA_DECODE", kernel), indexer_env("GLM5_CUDA_INDEXER", kernel),
      log("GLM5_CUDA_ATTENTION_LOG", "1");
  StderrCapture capture;
  auto gpu = make_cuda_backend(0);
  Rng rng(90);
  const int64_t S = 150, T = 3000, B = 64, max_blocks = (T + B - 1) / B, pool_blocks = 64;
  const int64_t H = 64, R = 512, dr = 64, dk = R + dr, topk = 2048, IH = 32, ID = 128;
  std::vector<int32_t> tables(size_t(S * max_blocks));
  for (int64_t i = 0; i < S; ++i) {  // each row its own order of the pool's blocks
    std::vector<int32_t> perm(static_cast<size_t>(pool_blocks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.gen);
    std::copy(perm.begin(), perm.begin() + max_blocks, tables.begin() + i * max_blocks);
  }
  std::vector<int32_t> qpos(static_cast<size_t>(S));
  for (auto& v : qpos) v = rng.integer(0, int(T - 1));
  qpos[0] = int32_t(T - 1), qpos[1] = 5, qpos[2] = -1, qpos[3] = int32_t(topk - 1);
  const auto sel = make_topk_lists(rng, qpos, T, topk, true);
  const auto q = rng.floats(size_t(S * H * dk));
  const auto latent = rng.floats(size_t(pool_blocks * B * dk));
  const auto iq = rng.floats(size_t(S * IH * ID));
  const auto iw = rng.floats(size_t(S * IH), -0.2f, 0.2f);
  const auto ik = rng.floats(size_t(pool_blocks * B * ID));
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
    return b;
  };
  Dev<float> dq(*gpu, q), diq(*gpu, iq), diw(*gpu, iw);
  Dev<int32_t> dtab(*gpu, tables), dpos(*gpu, qpos), dsel(*gpu, sel);
  for (DType cache : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string("cache ") + std::string(dtype_name(cache)));
    const void* lat = cache == DType::F32 ? gpu->upload(latent.data(), latent.size() * 4)
                                          : gpu->upload(to_bf16(latent).data(), latent.size() * 2);
    const void* idk =
        cache == DType::F32 ? gpu->upload(ik.data(), ik.size() * 4) : gpu->upload(to_bf16(ik).data(), ik.size() * 2);
    // Rows [first, first + n) in one call; outputs on the host.
    auto decode = [&](int64_t first, int64_t n) {
      Dev<float> out(*gpu, nan_vec(size_t(n * H * R)));
      MlaDecodeParams p;
      p.q_lat = dq.get() + first * H * dk, p.cache = static_cast<const float*>(lat);
      p.q_pos = dpos.get() + first, p.topk = dsel.get() + first * topk, p.topk_len = topk;
      p.out_lat = out.get(), p.s = n, p.t = T, p.n_heads = H, p.kv_lora_rank = R, p.qk_rope_head_dim = dr;
      p.scale = 1.0f / std::sqrt(float(dk));
      p.pages = KeyPages{dtab.get() + first * max_blocks, max_blocks, B, cache};
      gpu->mla_decode(p);
      return out.host("mla_decode");
    };
    auto index = [&](int64_t first, int64_t n) {
      Dev<float> out(*gpu, nan_vec(size_t(n * T)));
      IndexerScoresParams p;
      p.q = diq.get() + first * IH * ID, p.weights = diw.get() + first * IH;
      p.k = static_cast<const float*>(idk), p.q_pos = dpos.get() + first, p.scores = out.get();
      p.s = n, p.t = T, p.n_heads = IH, p.head_dim = ID, p.ld_scores = T;
      p.pages = KeyPages{dtab.get() + first * max_blocks, max_blocks, B, cache};
      gpu->indexer_scores(p);
      return out.host("indexer_scores");
    };
    const auto all = decode(0, S), all_idx = index(0, S);
    auto rows_of = [](const std::vector<float>& v, int64_t first, int64_t n, int64_t width) {
      return std::vector<float>(v.begin() + first * width, v.begin() + (first + n) * width);
    };
    for (int64_t first : {int64_t(0), S - 37}) {
      expect_equal(decode(first, 37), rows_of(all, first, 37, H * R),
                   "mla_decode rows " + std::to_string(first) + "..+37 vs the 150-row call");
      expect_equal(index(first, 37), rows_of(all_idx, first, 37, T),
                   "indexer_scores rows " + std::to_string(first) + "..+37 vs the 150-row call");
    }
    for (int64_t i = 0; i < 37; ++i) {
      expect_equal(decode(i, 1), rows_of(all, i, 1, H * R), "mla_decode row " + std::to_string(i) + " alone");
      expect_equal(index(i, 1), rows_of(all_idx, i, 1, T), "indexer_scores row " + std::to_string(i) + " alone");
    }
    {  // rows 0 and 1 against the reference (the op tests do the rest); BF16: on the widened cache
      std::vector<float> widened = latent, widened_idx = ik;
      if (cache == DType::BF16)
        for (auto* v : {&widened, &widened_idx})
          for (float& x : *v) x = bf16_to_f32(f32_to_bf16(x));
      auto ref = make_reference_backend();
      std::vector<float> want = nan_vec(size_t(2 * H * R)), want_idx = nan_vec(size_t(2 * T));
      MlaDecodeParams p;
      p.q_lat = q.data(), p.cache = widened.data(), p.q_pos = qpos.data(), p.topk = sel.data();
      p.topk_len = topk, p.out_lat = want.data(), p.s = 2, p.t = T, p.n_heads = H, p.kv_lora_rank = R;
      p.qk_rope_head_dim = dr, p.scale = 1.0f / std::sqrt(float(dk));
      p.pages = KeyPages{tables.data(), max_blocks, B, DType::F32};
      ref->mla_decode(p);
      expect_close(rows_of(all, 0, 2, H * R), want, 2e-6f, 1e-4f, "mla_decode rows 0, 1 vs reference");
      IndexerScoresParams ip;
      ip.q = iq.data(), ip.weights = iw.data(), ip.k = widened_idx.data(), ip.q_pos = qpos.data();
      ip.scores = want_idx.data(), ip.s = 2, ip.t = T, ip.n_heads = IH, ip.head_dim = ID, ip.ld_scores = T;
      ip.pages = KeyPages{tables.data(), max_blocks, B, DType::F32};
      ref->indexer_scores(ip);
      expect_close(rows_of(all_idx, 0, 2, T), want_idx, 2e-6f * float(IH) * 0.2f * std::sqrt(float(ID)), 1e-5f,
                   "indexer_scores rows 0, 1 vs reference");
    }
  }
  // The BF16 cache ran on the requested kernels (the F32 one always takes the SIMT kernels).
  const std::string err = capture.take();
  for (const char* op : {"mla_decode", "indexer_scores"})
    EXPECT_NE(err.find(attention_log_line(op, kernel)), std::string::npos) << op << ": " << err;
}

TEST(CudaOps, MlaDecodeAndIndexerRowsIndependentOfRowCount) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  for (const char* kernel : {"simt", "tensor"}) rows_independent_of_row_count(kernel);
}

// ---- memory and device-side input errors -------------------------------------------------------

TEST(CudaOps, MemoryRoundTripAndUpload) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  EXPECT_EQ(gpu->name(), "cuda");
  std::vector<uint8_t> bytes(1000003);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 2654435761u >> 13);
  const void* up = gpu->upload(bytes.data(), bytes.size());
  ASSERT_NE(up, nullptr);
  EXPECT_NE(up, static_cast<const void*>(bytes.data())) << "upload must copy to the device";
  std::vector<uint8_t> back(bytes.size());
  gpu->to_host(back.data(), up, back.size());
  EXPECT_EQ(back, bytes);
  void* p = gpu->alloc(bytes.size());
  gpu->to_device(p, bytes.data(), bytes.size());
  std::fill(back.begin(), back.end(), 0);
  gpu->to_host(back.data(), p, back.size());
  EXPECT_EQ(back, bytes);
  gpu->free(p);
  gpu->synchronize();
}

// A warm step loop: scratch of varying sizes alloc'd and freed, GEMMs of several m, indexer and
// MLA decode on 1 or 37 rows, to_device of new host data, to_host at the end. After one round of
// every size (the warm-up), further rounds make no cudaMalloc: raw_allocations() stays put.
TEST(CudaOps, WarmStepLoopMakesNoRawAllocation) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  EXPECT_NE(gpu->stream(), nullptr);
  Rng rng(77);
  const int64_t n = 256, k = 512, S = 37, T = 700, B = 64, max_blocks = (T + B - 1) / B;
  const int64_t H = 16, R = 512, dr = 64, dk = R + dr, topk = 256, IH = 8, ID = 128;
  const auto wbytes = random_weight(rng, DType::BF16, n, k);
  const uint64_t before_upload = gpu->raw_allocations();
  const Weight w{gpu->upload(wbytes.data(), wbytes.size()), DType::BF16, n, k, k};
  EXPECT_EQ(gpu->raw_allocations(), before_upload + 1) << "an upload is one cudaMalloc";
  std::vector<int32_t> tables(size_t(S * max_blocks)), qpos(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i)
    for (int64_t b = 0; b < max_blocks; ++b) tables[size_t(i * max_blocks + b)] = int32_t((b * 7 + i) % max_blocks);
  for (auto& v : qpos) v = rng.integer(0, int(T - 1));
  const auto sel = make_topk_lists(rng, qpos, T, topk, false);
  Dev<float> dx(*gpu, rng.floats(size_t(300 * k))), dq(*gpu, rng.floats(size_t(S * H * dk)));
  Dev<float> dlat(*gpu, rng.floats(size_t(max_blocks * B * dk))), diq(*gpu, rng.floats(size_t(S * IH * ID)));
  Dev<float> diw(*gpu, rng.floats(size_t(S * IH))), dik(*gpu, rng.floats(size_t(max_blocks * B * ID)));
  Dev<int32_t> dtab(*gpu, tables), dpos(*gpu, qpos), dsel(*gpu, sel);
  std::vector<int32_t> host_pos(static_cast<size_t>(S));
  float sink = 0.0f;
  auto step = [&](int it) {
    const int64_t m = std::array<int64_t, 3>{1, 37, 300}[size_t(it % 3)], s = it % 2 ? S : 1;
    std::vector<void*> scratch;
    for (size_t bytes : {size_t(1000), size_t(4096), size_t(1) << 20, (size_t(3) << 20) + 17, size_t(64) << 20,
                         size_t(300) << 20})  // the last: the exact-size path of large blocks
      scratch.push_back(gpu->alloc(bytes + size_t(it % 3) * 700));
    for (auto& v : host_pos) v = int32_t(it);  // new host data; the device copy feeds nothing
    gpu->to_device(static_cast<int32_t*>(scratch[0]), host_pos.data(), host_pos.size() * sizeof(int32_t));
    float* y = static_cast<float*>(scratch[3]);
    GemmParams g;
    g.x = dx.get(), g.ldx = k, g.w = w, g.y = y, g.ldy = n, g.m = m, g.n = n, g.k = k;
    gpu->gemm(g);
    IndexerScoresParams ip;
    ip.q = diq.get(), ip.weights = diw.get(), ip.k = dik.get(), ip.q_pos = dpos.get();
    ip.scores = static_cast<float*>(scratch[4]), ip.s = s, ip.t = T, ip.n_heads = IH, ip.head_dim = ID;
    ip.ld_scores = T, ip.pages = KeyPages{dtab.get(), max_blocks, B, DType::F32};
    gpu->indexer_scores(ip);
    MlaDecodeParams md;
    md.q_lat = dq.get(), md.cache = dlat.get(), md.q_pos = dpos.get(), md.topk = dsel.get();
    md.topk_len = topk, md.out_lat = static_cast<float*>(scratch[4]) + S * T, md.s = s, md.t = T;
    md.n_heads = H, md.kv_lora_rank = R, md.qk_rope_head_dim = dr, md.scale = 0.05f;
    md.pages = KeyPages{dtab.get(), max_blocks, B, DType::F32};
    gpu->mla_decode(md);
    gpu->to_device(scratch[5], host_pos.data(), host_pos.size() * sizeof(int32_t));
    for (size_t i = scratch.size(); i-- > 0;)  // freed while their work is still queued
      if (i != 3) gpu->free(scratch[i]);
    float v = 0.0f;
    gpu->to_host(&v, y, sizeof(float));  // waits: the step's end
    gpu->free(y);
    sink += v;
  };
  for (int it = 0; it < 6; ++it) step(it);  // warm-up: every size once (6 = the period of m and s)
  const uint64_t warm = gpu->raw_allocations();
  EXPECT_GT(warm, before_upload + 1) << "the warm-up took blocks from cudaMalloc";
  for (int it = 0; it < 60; ++it) step(it);
  EXPECT_EQ(gpu->raw_allocations(), warm) << "cudaMalloc calls in a warm step loop";
  EXPECT_TRUE(std::isfinite(sink));
}

// to_device returns once the source is read: the caller overwrites its buffer at once, while the
// copies still wait behind a long GEMM on the stream. Large copies (through every slot of the
// staging ring and around it), many small ones (sharing a slot), and device-to-device.
TEST(CudaOps, ToDeviceSourceMayBeReusedAtReturn) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  Rng rng(78);
  const int64_t m = 2048, n = 4096, k = 4096;
  const auto wbytes = random_weight(rng, DType::BF16, n, k);
  const Weight w{gpu->upload(wbytes.data(), wbytes.size()), DType::BF16, n, k, k};
  Dev<float> dx(*gpu, rng.floats(size_t(m * k))), dy(*gpu, nan_vec(size_t(m * n)));
  GemmParams g;
  g.x = dx.get(), g.ldx = k, g.w = w, g.y = dy.get(), g.ldy = n, g.m = m, g.n = n, g.k = k;
  const size_t big = (size_t(40) << 20) / sizeof(int32_t);  // 40 MiB: more than the 32 MiB ring
  std::vector<int32_t> host(big);
  std::vector<int32_t*> dev(3);
  for (auto& d : dev) d = static_cast<int32_t*>(gpu->alloc(big * sizeof(int32_t)));
  const int small = 1000;
  auto* dsmall = static_cast<int32_t*>(gpu->alloc(small * sizeof(int32_t)));
  gpu->gemm(g);  // the copies below queue behind it
  for (int c = 0; c < 3; ++c) {
    for (size_t i = 0; i < big; ++i) host[i] = int32_t(i * 2654435761u) ^ c;
    gpu->to_device(dev[size_t(c)], host.data(), big * sizeof(int32_t));
  }
  int32_t one = 0;
  for (int i = 0; i < small; ++i) {
    one = 7 * i + 1;
    gpu->to_device(dsmall + i, &one, sizeof(one));
  }
  gpu->to_device(dev[0] + big / 2, dsmall, small * sizeof(int32_t));  // device to device
  for (int c = 0; c < 3; ++c) {
    std::vector<int32_t> back(big);
    gpu->to_host(back.data(), dev[size_t(c)], big * sizeof(int32_t));
    size_t bad = 0;
    for (size_t i = 0; i < big; ++i) {
      int32_t want = int32_t(i * 2654435761u) ^ c;
      if (c == 0 && i >= big / 2 && i < big / 2 + small) want = int32_t(7 * (i - big / 2) + 1);
      bad += back[i] != want;
    }
    EXPECT_EQ(bad, 0u) << "copy " << c << ": elements that are not the source at the call";
  }
  std::vector<int32_t> back(small);
  gpu->to_host(back.data(), dsmall, small * sizeof(int32_t));
  for (int i = 0; i < small; ++i) ASSERT_EQ(back[size_t(i)], 7 * i + 1) << "small copy " << i;
  for (auto* d : dev) gpu->free(d);
  gpu->free(dsmall);
}

TEST(CudaOps, BadDeviceInputThrowsAtSynchronize) {
  if (!cuda_available()) GTEST_SKIP() << "no usable CUDA device: " << cuda_skip_reason();
  auto gpu = make_cuda_backend(0);
  auto expect_sync_error = [&](const char* needle) {
    try {
      gpu->synchronize();
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    gpu->synchronize();  // reported once, then cleared
  };
  std::vector<uint16_t> table(4 * 3, f32_to_bf16(1.0f));
  Dev<int32_t> ids(*gpu, {1, 4});
  Dev<float> out(*gpu, nan_vec(6));
  EmbeddingParams e;
  e.table = Weight{gpu->upload(table.data(), table.size() * 2), DType::BF16, 4, 3, 3};
  e.ids = ids.get(), e.m = 2, e.out = out.get();
  gpu->embedding(e);
  expect_sync_error("token id 4");

  Dev<float> src(*gpu, std::vector<float>(8, 1.0f)), dst(*gpu, nan_vec(8));
  Dev<int32_t> rows(*gpu, {0, -3});
  gpu->gather_rows(GatherRowsParams{src.get(), rows.get(), 2, 4, dst.get()});
  expect_sync_error("source row -3");

  Dev<int32_t> slots(*gpu, {0, -2});
  Dev<float> w(*gpu, {1.0f, 1.0f});
  MoeCombineParams mc;
  mc.expert_out = src.get(), mc.slots = slots.get(), mc.weights = w.get(), mc.out = dst.get();
  mc.m = 1, mc.top_k = 2, mc.d = 4;
  gpu->moe_combine(mc);
  expect_sync_error("slot -2");

  Dev<float> cache(*gpu, std::vector<float>(4 * 3, 0.5f)), q(*gpu, std::vector<float>(3, 1.0f));
  Dev<int32_t> qpos(*gpu, {3}), topk(*gpu, {0, 9});
  MlaDecodeParams md;
  md.q_lat = q.get(), md.cache = cache.get(), md.q_pos = qpos.get(), md.topk = topk.get();
  md.topk_len = 2, md.out_lat = dst.get(), md.s = 1, md.t = 4, md.n_heads = 1;
  md.kv_lora_rank = 2, md.qk_rope_head_dim = 1;
  gpu->mla_decode(md);
  expect_sync_error("topk entry 9");

  // Host-side checks throw at the call.
  GemmParams bad;
  bad.m = 1, bad.n = 2, bad.k = 3, bad.w = Weight{table.data(), DType::BF16, 5, 3, 3};
  EXPECT_THROW(gpu->gemm(bad), Error);
  RouterParams r;
  r.m = 1, r.n_experts = 10, r.top_k = 2, r.n_group = 3;
  EXPECT_THROW(gpu->router(r), Error);
}

}  // namespace
}  // namespace glm5::kernels
