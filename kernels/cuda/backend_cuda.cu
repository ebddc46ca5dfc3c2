// The CUDA backend: device memory, one stream, cuBLASLt GEMMs and the kernels of ops_*.cu behind
// the Backend interface of ops.h. Activations stay fp32. GEMMs on bf16 weights split each fp32
// activation into bf16 terms (x = hi + mid + lo, exact with 3 terms), so tensor cores see the
// fp32 value. Quantized weights (F8_E4M3 block-scaled, Q4 / Q8 group-wise) run the fused kernel
// of ops_quant.cu by default, or are dequantized exactly into this cuBLAS path. No CUDA graphs and
// no multi-stream overlap yet.
//
// Device hygiene: every op is queued on the backend's one in-order stream and returns without
// waiting for it. Memory comes from a caching allocator (kernels/core/caching_allocator.h) over
// cudaMalloc, so a warm step loop makes no cudaMalloc / cudaFree call and no device sync: a block
// freed while queued work still uses it is handed out again only to later work on the same stream,
// which runs after that use. The host waits for the device only where it reads results (to_host,
// synchronize), where the pinned staging ring of to_device wraps onto a copy not yet executed, when
// a cudaMalloc fails (before the cache is given back to cudaFree), and at upload / destruction.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/core/caching_allocator.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kernels.cuh"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace glm5::kernels {
namespace {

using cuda::launch_gemm_combine;
using cuda::launch_gemm_split_x;

// Rows of x per cuBLAS call on the chunked GEMM path (GLM5_CUDA_GEMM=chunked). Every call has
// exactly this many rows (the last chunk is padded with zero rows in scratch), so cuBLAS sees the
// same problem shape, picks the same kernel and sums k in the same order whatever the batch size.
constexpr int64_t kChunkRows = 64;
// Upper bound on the GEMM scratch (split activations + per-term outputs); larger m loops over
// blocks of rows (each row's result does not depend on the block it is in, on either path).
constexpr size_t kGemmScratchBytes = size_t(256) << 20;
// cuBLASLt workspace, allocated once at construction; pinned algorithms that need more are refused.
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;
// Heuristic candidates looked at when pinning a cuBLASLt algorithm for a weight shape.
constexpr int kLtCandidates = 16;
// The largest m at which a pinned algorithm is validated (cublasLtMatmulAlgoCheck) besides m = 1:
// a step forwards at most max_step_tokens (8192 by default) rows; larger calls are cut into
// blocks of rows by the scratch bound anyway.
constexpr int64_t kLtCheckRows = 8192;
// Allocations of at least kExactBytes (KV pools, the largest step buffers) skip the size classes:
// a class may exceed the request by up to a quarter, gigabytes on a KV pool sized to fill the
// device. They are cudaMalloc'd in kExactGranule steps and cached by that size (a freed one serves
// a later request of up to 1/8 less, without a sync, as the cache does).
constexpr size_t kExactBytes = size_t(256) << 20;
constexpr size_t kExactGranule = size_t(2) << 20;
// Pinned staging of to_device: kStagingSlots slots of kStagingSlotBytes, used as a ring (see
// CudaBackend::to_device).
constexpr int kStagingSlots = 4;
constexpr size_t kStagingSlotBytes = size_t(8) << 20;

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// GLM5_CUDA_GEMM_TERMS: bf16 terms per activation for bf16-weight GEMMs. 3 (default) represents
// every fp32 activation exactly; 2 keeps ~16 bits (about 1e-5 relative); 1 is plain bf16
// activations (as the upstream references run); 0 uses the plain fp32 kernel instead of cuBLAS
// for every dtype (a check on cuBLAS; slow). F32 weights use an fp32 cuBLAS GEMM for 1..3.
// Without the variable: 3 in Precision::kExact, 1 in kFast (one bf16 tensor-core term, as vLLM,
// SGLang and TensorRT-LLM run).
int gemm_terms_from_env(Precision precision) {
  const char* v = std::getenv("GLM5_CUDA_GEMM_TERMS");
  if (!v || !*v) return precision == Precision::kFast ? 1 : 3;
  const std::string s = v;
  CHECK(s == "0" || s == "1" || s == "2" || s == "3",
        "environment variable GLM5_CUDA_GEMM_TERMS: expected 0, 1, 2 or 3, found '", s, "'");
  return std::stoi(s);
}

// GLM5_CUDA_GEMM: how the BF16 / F32 cuBLAS GEMMs keep every row's result independent of m.
//   lt (default): one cuBLASLt call for all rows with an algorithm pinned per weight shape (n, k,
//     ld, dtype, trans_w, alignment, terms): the first heuristic candidate for
//     GLM5_CUDA_GEMM_ALGO_ROWS rows that has no split-K and no reduction scheme and that
//     cublasLtMatmulAlgoCheck accepts at m = 1 and m = kLtCheckRows. The same kernel (tile, stages,
//     swizzle, cluster shape) then runs for every m, and each output element is summed over k by
//     one CTA in the kernel's fixed k order, so a row's bits depend on that row and the weight
//     only. The weight is read once per column tile of the whole batch (an 8192-row prefill no
//     longer reads it 128 times), but a decode-size call gets only ceil(n / tile) CTAs, since
//     split-K (which would change the order with m) is excluded. A shape with no such candidate
//     uses the chunked path, for every m.
//   chunked: cuBLAS (cublasGemmEx, its own heuristic and split-K) on fixed 64-row chunks, padded:
//     invariant because every call has the same shape; an m-row GEMM makes ceil(m / 64) calls and
//     reads the weight that many times (the cost the lt path removes), and a decode call pays a
//     64-row GEMM for one row.
// Either way the x terms and the outputs live in the backend's aligned scratch, so the caller's
// pointers and strides never change which kernel runs.
enum class GemmMode { kLt, kChunked };

// An environment variable with two allowed values: true for `first` (the default when unset or
// empty), false for `second`, a clear error otherwise.
bool env_is_first_of(const char* name, const char* first, const char* second) {
  const char* v = std::getenv(name);
  if (!v || !*v) return true;
  const std::string s = v;
  CHECK(s == first || s == second, "environment variable ", name, ": expected '", first, "' or '", second, "', found '",
        s, "'");
  return s == first;
}

GemmMode gemm_mode_from_env() {
  return env_is_first_of("GLM5_CUDA_GEMM", "lt", "chunked") ? GemmMode::kLt : GemmMode::kChunked;
}

// GLM5_CUDA_MLA_DECODE: `simt` (default: the kernel verified on an H200) or `tensor`: the
// tensor-core kernel for BF16 caches with top-k lists (kernels/cuda/ops_attention.cu), opt-in
// until its test (CudaOps.MlaDecodeBf16CacheTensorCores) has passed on a GPU.
bool tensor_decode_from_env() { return !env_is_first_of("GLM5_CUDA_MLA_DECODE", "simt", "tensor"); }
// GLM5_CUDA_INDEXER: likewise for indexer_scores over BF16 keys (CudaOps.IndexerScoresBf16TensorCores).
bool tensor_indexer_from_env() { return !env_is_first_of("GLM5_CUDA_INDEXER", "simt", "tensor"); }
// GLM5_CUDA_TOPK: `block` (default: one block per row, verified on an H200) or `multiblock`: rows of
// more than 16k columns cut over many blocks when there are fewer rows than half the SMs (decode),
// the same selection; opt-in until CudaOps.TopkMultiBlockMatchesReference has passed on a GPU.
bool topk_multiblock_from_env() { return !env_is_first_of("GLM5_CUDA_TOPK", "block", "multiblock"); }
// GLM5_CUDA_EXPERT_GEMM: how gemm_grouped (a MoE layer's expert gemms) runs. `each` (default): as
// gemm_batch, one cuBLASLt / quantized call per gemm. `grouped`: those grouped_applies to in one
// tensor-core launch (ops_grouped_gemm.cu), the rest as `each`; opt-in until the
// CudaOps.GroupedGemmTensorCores* tests have passed on a GPU.
bool grouped_gemm_from_env() { return !env_is_first_of("GLM5_CUDA_EXPERT_GEMM", "each", "grouped"); }

// Parses a positive integer environment variable (`fallback` when unset or empty).
long long positive_from_env(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  const std::string s = v;
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  CHECK(used == s.size() && n > 0, "environment variable ", name, ": expected a positive integer, found '", s, "'");
  return n;
}

// GLM5_CUDA_GEMM_ALGO_ROWS: the m for which cuBLASLt's heuristic picks the pinned algorithm
// (default 512: between decode batches and prefill steps). GLM5_CUDA_GEMM_LOG=1 prints each pinned
// algorithm (or the fallback to the chunked path) on stderr when a weight shape first runs.
int64_t gemm_algo_rows_from_env() { return positive_from_env("GLM5_CUDA_GEMM_ALGO_ROWS", 512); }
bool gemm_log_from_env() {
  const char* v = std::getenv("GLM5_CUDA_GEMM_LOG");
  return v && *v && std::string(v) != "0";
}

// GLM5_CUDA_ATTENTION_LOG=1: one line on stderr the first time a backend runs mla_decode /
// indexer_scores on each kernel ("tensor cores" or "SIMT"), so a run (or a test) shows which ran.
bool attention_log_from_env() {
  const char* v = std::getenv("GLM5_CUDA_ATTENTION_LOG");
  return v && *v && std::string(v) != "0";
}

// GLM5_CUDA_QUANT_GEMM: how GEMMs on quantized weights (F8_E4M3, Q4, Q8) run.
//   fused (default): ops_quant.cu's kernel reads the stored bytes and dequantizes in registers.
//     It is bandwidth-optimal at decode and MoE-expert sizes, and is fp32 SIMT (no tensor cores)
//     for large m.
//   dequant: blocks of weight rows are dequantized exactly (weight_at values, in bf16 where that
//     is exact, else fp32) into scratch and go through the BF16 / F32 path above (cuBLAS, with
//     GLM5_CUDA_GEMM_TERMS applying). This uses tensor cores for prefill, and pays a full
//     dequantization of W on every call.
// Either mode is used for every m, so each row's result never depends on the batch. trans_w
// always takes the dequant route (the fused kernel reads W [n, k] rows only).
enum class QuantGemmMode { kFused, kDequant };

QuantGemmMode quant_gemm_mode_from_env() {
  return env_is_first_of("GLM5_CUDA_QUANT_GEMM", "fused", "dequant") ? QuantGemmMode::kFused : QuantGemmMode::kDequant;
}

// Upper bound on the scratch of dequantized weight rows (GLM5_CUDA_QUANT_GEMM=dequant, trans_w):
// 256 MiB, or GLM5_CUDA_DEQUANT_SCRATCH bytes (tests set it small to exercise the blocking).
size_t dequant_scratch_from_env() {
  return size_t(positive_from_env("GLM5_CUDA_DEQUANT_SCRATCH", (long long)(size_t(256) << 20)));
}

// What this backend adds to validate() for a quantized weight: FP8 scales in F32, int4 / int8
// scales in BF16, F16 or F32 with one scale row per weight row.
void check_quant_weight(const Weight& w) {
  const std::string_view dt = dtype_name(w.dtype);
  if (w.dtype == DType::F8_E4M3) {
    CHECK(w.scale_dtype == DType::F32, "cuda gemm: F8_E4M3 weight scales must be F32, found ",
          dtype_name(w.scale_dtype));
    return;
  }
  CHECK(w.scale_dtype == DType::BF16 || w.scale_dtype == DType::F16 || w.scale_dtype == DType::F32, "cuda gemm: ", dt,
        " weight scales must be BF16, F16 or F32, found ", dtype_name(w.scale_dtype));
  CHECK(w.scale_block_rows == 1, "cuda gemm: ", dt, " weight has one scale row per weight row; found scale_block_rows ",
        w.scale_block_rows);
}

// Sets the device for the lifetime of a scope and restores the caller's afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) CUDA_CHECK(cudaSetDevice(device));
    changed_ = prev_ != device;
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// A cuBLASLt matrix layout for the duration of one call.
class LtLayout {
 public:
  LtLayout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_, type, rows, cols, ld));
  }
  ~LtLayout() {
    if (layout_) cublasLtMatrixLayoutDestroy(layout_);
  }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
  operator cublasLtMatrixLayout_t() const { return layout_; }

 private:
  cublasLtMatrixLayout_t layout_ = nullptr;
};

// What fixes a pinned cuBLASLt algorithm: everything about a GEMM but m. `align` is the largest
// power of two (<= 256) dividing the weight pointer; the operands the backend owns (x terms,
// outputs, workspace) are always 256-byte aligned.
struct LtKey {
  bool f32 = false, trans = false;
  int terms = 0;  // bf16 terms of x (0: one fp32 copy, F32 weights)
  int64_t n = 0, k = 0, ldw = 0;
  uint32_t align = 256;
  bool operator<(const LtKey& o) const {
    return std::tie(f32, trans, terms, n, k, ldw, align) < std::tie(o.f32, o.trans, o.terms, o.n, o.k, o.ldw, o.align);
  }
};

// The pinned algorithm of one LtKey (ok = false: none qualified, the chunked path runs instead).
struct LtPlan {
  bool ok = false;
  bool probed = false;  // the bitwise check across m has run (on the first call's weights)
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr;  // the weight as stored (column-major view)
  cublasLtMatmulAlgo_t algo{};
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    if (w) cublasLtMatrixLayoutDestroy(w);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

uint32_t pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

class CudaBackend final : public Backend {
 public:
  bool host_memory() const override { return false; }
  Precision precision() const override { return precision_; }
  CudaBackend(int device, Precision precision)
      : device_(device),
        precision_(precision),
        // Raw allocations of the cache. On failure the allocator gives its cached blocks back to
        // cudaFree and tries once more: queued work may still use those blocks, so wait for the
        // stream first (the only sync in the allocation path, and only when memory runs out).
        cache_(
            [this](size_t bytes) -> void* {
              void* p = nullptr;
              const cudaError_t e = cudaMalloc(&p, bytes);
              if (e == cudaSuccess) return p;
              cudaGetLastError();
              last_alloc_error_ = e;
              if (stream_ && cudaStreamSynchronize(stream_) != cudaSuccess) cudaGetLastError();
              // The large exact-size blocks are not in the allocator's own count: after giving
              // them back, try here once more (the allocator retries only for its own cache).
              if (release_exact_cached() && cudaMalloc(&p, bytes) == cudaSuccess) return p;
              cudaGetLastError();
              return nullptr;
            },
            [](void* p) { cudaFree(p); }) {
    int n = 0;
    CUDA_CHECK(cudaGetDeviceCount(&n));
    CHECK(device >= 0 && device < n, "backend cuda: device ", device, " requested, but ", n,
          " CUDA device(s) are visible");
    CUDA_CHECK(cudaSetDevice(device));
    cudaFuncAttributes attr;
    const cudaError_t probe = cudaFuncGetAttributes(&attr, cuda::probe_kernel());
    if (probe != cudaSuccess) {
      cudaGetLastError();
      cudaDeviceProp prop;
      CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
      GLM5_FAIL("backend cuda: this build has no kernels for device ", device, " (", prop.name, ", compute capability ",
                prop.major, ".", prop.minor, "): ", cudaGetErrorString(probe),
                "; configure with -DCMAKE_CUDA_ARCHITECTURES=", prop.major, prop.minor);
    }
    gemm_terms_ = gemm_terms_from_env(precision);
    gemm_mode_ = gemm_mode_from_env();
    tensor_decode_ = tensor_decode_from_env();
    tensor_indexer_ = tensor_indexer_from_env();
    topk_multiblock_ = topk_multiblock_from_env();
    grouped_gemm_ = grouped_gemm_from_env();
    if (grouped_gemm_ && !cuda::device_has_bf16_mma()) {
      std::fprintf(stderr,
                   "glm5 cuda: GLM5_CUDA_EXPERT_GEMM=grouped needs bf16 MMA (compute capability >= 8.0 and code "
                   "built for it); device %d runs the expert gemms one call each\n",
                   device);
      grouped_gemm_ = false;
    }
    CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
    lt_ref_rows_ = gemm_algo_rows_from_env();
    gemm_log_ = gemm_log_from_env();
    attention_log_ = attention_log_from_env();
    quant_mode_ = quant_gemm_mode_from_env();
    dequant_scratch_ = dequant_scratch_from_env();
    // A blocking stream: work on the legacy default stream (NCCL, cudaMemcpy) orders with it.
    CUDA_CHECK(cudaStreamCreate(&stream_));
    CUBLAS_CHECK(cublasCreate(&cublas_));
    CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));            // fp32 GEMMs: no TF32
    CUBLAS_CHECK(cublasSetAtomicsMode(cublas_, CUBLAS_ATOMICS_NOT_ALLOWED));  // deterministic
    CUBLAS_CHECK(cublasLtCreate(&lt_));
    // Made here, so not counted by raw_allocations(): the error word, the cuBLASLt workspace and
    // the pinned staging ring of to_device.
    CUDA_CHECK(cudaMalloc(&error_word_, 4 * sizeof(int)));
    CUDA_CHECK(cudaMemset(error_word_, 0, 4 * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&error_host_, 4 * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&lt_workspace_, kLtWorkspaceBytes));
    CUDA_CHECK(cudaMallocHost(&staging_, kStagingSlots * kStagingSlotBytes));
    for (cudaEvent_t& e : staging_done_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    for (void* p : uploads_) cudaFree(p);
    for (void* p : {xs_, cs_, wq_, keys_, partials_, grouped_items_}) cache_.free(p);
    release_exact_cached();
    for (const auto& [p, size] : exact_live_) cudaFree(p);
    lt_plans_.clear();
    for (cudaEvent_t e : staging_done_)
      if (e) cudaEventDestroy(e);
    if (staging_) cudaFreeHost(staging_);
    cudaFree(lt_workspace_);
    cudaFree(error_word_);
    cudaFreeHost(error_host_);
    if (lt_) cublasLtDestroy(lt_);
    if (cublas_) cublasDestroy(cublas_);
    if (stream_) cudaStreamDestroy(stream_);
    // cache_ (declared before these handles, destroyed after this body) returns its blocks to
    // cudaFree, the stream having drained above.
  }

  std::string name() const override { return "cuda"; }
  void* stream() const override { return static_cast<void*>(stream_); }

  // cudaMalloc calls made after construction: the blocks the caching allocator took from
  // cudaMalloc (alloc() and every op's scratch), the blocks of kExactBytes or more, and one per
  // upload(). The construction's own (error word, cuBLASLt workspace; pinned host memory is not
  // cudaMalloc) and the allocations cuBLAS makes internally are not counted. A warm step loop adds
  // none.
  uint64_t raw_allocations() const override { return cache_.raw_allocs() + exact_allocs_ + upload_allocs_; }

  void* alloc(size_t bytes) override {
    if (bytes == 0) return nullptr;
    DeviceScope ds(device_);
    if (bytes >= kExactBytes) return alloc_exact(bytes);
    void* p = cache_.alloc(bytes);
    if (!p) fail_out_of_memory(bytes, "allocate");
    return p;
  }

  // Back to the cache at once, without waiting: see the file comment.
  void free(void* p) override {
    if (!p) return;
    if (auto it = exact_live_.find(p); it != exact_live_.end()) {
      exact_free_.emplace(it->second, p);
      exact_live_.erase(it);
      return;
    }
    CHECK(cache_.free(p), "backend cuda: free(", p, "): not a live block of this backend's alloc()");
  }

  // Returns once `src` has been read, so the caller may reuse it at once; the copy itself runs in
  // stream order, after the work queued before it. Host memory is copied into a pinned staging
  // ring first and the DMA reads it from there: CUDA's documentation does not promise that an
  // async copy from pageable memory has read its source when it returns ("For transfers between
  // device memory and pageable host memory, the function might be synchronous with respect to
  // host", and "If pageable memory must first be staged to pinned memory, the driver may
  // synchronize with the stream and stage the copy into pinned memory"), and from pinned memory
  // it certainly has not ("For all other transfers, the function should be fully asynchronous").
  // The ring has kStagingSlots slots; small copies share a slot, and an event recorded after each
  // copy marks the slot's last reader. The host waits only when the ring wraps onto a slot whose
  // last copy the device has not run yet (as the driver's own staging would). Device memory is
  // copied device to device, in stream order.
  void to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    DeviceScope ds(device_);
    if (is_device_memory(src)) {
      CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
      return;
    }
    const char* s = static_cast<const char*>(src);
    char* d = static_cast<char*>(dst);
    for (size_t off = 0; off < bytes;) {
      const size_t n = std::min(bytes - off, kStagingSlotBytes);
      char* stage = staging_claim(n);
      std::memcpy(stage, s + off, n);
      CUDA_CHECK(cudaMemcpyAsync(d + off, stage, n, cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaEventRecord(staging_done_[staging_slot_], stream_));
      staging_pending_[staging_slot_] = true;
      off += n;
    }
  }

  // The host reads the result: waits for the stream (and reports kernel input errors).
  void to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    DeviceScope ds(device_);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    synchronize();
  }

  // A copy that lives until the backend is destroyed: its own cudaMalloc (size classes would waste
  // up to a quarter of a weight), counted by raw_allocations(). cudaMemcpy waits for the copy.
  const void* upload(const void* host, size_t bytes) override {
    DeviceScope ds(device_);
    const size_t n = bytes == 0 ? 1 : bytes;
    void* p = nullptr;
    if (!raw_malloc_or_release(&p, n)) fail_out_of_memory(n, "upload");
    ++upload_allocs_;
    uploads_.push_back(p);
    if (bytes) CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
  }

  // Waits for the stream, then reports the first bad input a kernel found since the last call
  // (the reference backend rejects such input before running; a device only sees it here).
  void synchronize() override {
    DeviceScope ds(device_);
    CUDA_CHECK(cudaMemcpyAsync(error_host_, error_word_, 4 * sizeof(int), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (error_host_[0] == cuda::kDeviceOk) return;
    const int code = error_host_[0], value = error_host_[1], row = error_host_[2], bound = error_host_[3];
    CUDA_CHECK(cudaMemset(error_word_, 0, 4 * sizeof(int)));
    error_host_[0] = 0;
    switch (code) {
      case cuda::kEmbeddingIdOutOfRange:
        GLM5_FAIL("cuda embedding: token id ", value, " (row ", row, ") outside the table's [0, ", bound, ")");
      case cuda::kGatherRowNegative: GLM5_FAIL("cuda gather_rows: source row ", value, " (entry ", row, ") < 0");
      case cuda::kMoeSlotInvalid: GLM5_FAIL("cuda moe_combine: slot ", value, " (row ", row, ") < -1");
      case cuda::kTopkEntryOutOfRange:
        GLM5_FAIL("cuda mla: topk entry ", value, " (query row ", row, ") outside [-1, ", bound, ")");
      default: GLM5_FAIL("cuda: a kernel reported unknown error code ", code);
    }
  }

  void gemm(const GemmParams& p) override {
    validate(p);
    const bool quantized = quant::is_quantized(p.w.dtype);
    if (quantized) check_quant_weight(p.w);
    CHECK(p.w.layout == WeightLayout::kRowMajor, "cuda gemm: weights are row-major on this backend (layout ",
          int(p.w.layout), " is the cpu backend's)");
    if (p.m == 0 || p.n == 0) return;
    DeviceScope ds(device_);
    if (quantized)
      gemm_quantized(p);
    else
      gemm_plain(p);
  }

  using Backend::gemm_grouped;  // the vector / array overload

  // The experts' gemms (GLM5_CUDA_EXPERT_GEMM). With `grouped`, every one that grouped_applies to
  // goes into one launch of the grouped kernel; the others run as gemm(). Which way a gemm goes
  // depends on its weight and the backend's settings only, never on m or on the batch.
  void gemm_grouped(const GemmParams* ps, size_t n) override {
    if (!grouped_gemm_) return gemm_batch(ps, n);
    std::vector<cuda::GroupedGemmItem> items;
    int64_t tiles = 0;
    last_kernel_.erase("gemm_grouped");
    for (size_t i = 0; i < n; ++i) {
      const GemmParams& p = ps[i];
      if (!grouped_applies(p)) {
        gemm(p);
        continue;
      }
      validate(p);
      if (quant::is_quantized(p.w.dtype)) check_quant_weight(p.w);
      if (p.m == 0 || p.n == 0) continue;
      items.push_back(grouped_item(p, tiles));
      tiles += cuda::grouped_gemm_tiles(p.m, p.n);
    }
    if (items.empty()) return;
    DeviceScope ds(device_);
    const size_t bytes = items.size() * sizeof(cuda::GroupedGemmItem);
    reserve(&grouped_items_, &grouped_items_cap_, bytes);
    to_device(grouped_items_, items.data(), bytes);  // in stream order: the last launch has read the old table
    cuda::launch_gemm_grouped(static_cast<const cuda::GroupedGemmItem*>(grouped_items_), int(items.size()), tiles,
                              gemm_terms_, stream_);
    last_kernel_["gemm_grouped"] =
        "tensor cores (grouped: " + std::to_string(items.size()) + " of " + std::to_string(n) + " gemms)";
  }

  // Row-major, not transposed, k > 0, and weight values the kernel's bf16 operands hold as the
  // precision needs them: BF16, and Q4 / Q8 with BF16 scales (bf16 numbers), in every setting; FP8
  // and Q4 / Q8 with F16 / F32 scales (rounded to bf16 as they are staged) only in precision fast
  // on its one term, where x is rounded too (the other routes keep their fp32 values).
  bool grouped_applies(const GemmParams& p) const {
    if (gemm_terms_ == 0 || p.trans_w || p.k == 0 || p.w.layout != WeightLayout::kRowMajor) return false;
    const bool fast_one_term = precision_ == Precision::kFast && gemm_terms_ == 1;
    switch (p.w.dtype) {
      case DType::BF16: return true;
      case DType::Q4:
      case DType::Q8: return p.w.scale_dtype == DType::BF16 || fast_one_term;
      case DType::F8_E4M3: return fast_one_term;
      default: return false;
    }
  }

  static cuda::GroupedGemmItem grouped_item(const GemmParams& p, int64_t tile0) {
    using cuda::GroupedWeight;
    const bool bf16 = p.w.dtype == DType::BF16;
    const GroupedWeight kind = bf16                     ? GroupedWeight::kBf16
                               : p.w.dtype == DType::Q4 ? GroupedWeight::kQ4
                               : p.w.dtype == DType::Q8 ? GroupedWeight::kQ8
                                                        : GroupedWeight::kFp8;
    const bool vec = bf16 && reinterpret_cast<uintptr_t>(p.w.data) % 16 == 0 && p.w.ld % 8 == 0 && p.k % 8 == 0;
    return {p.x,          p.ldx,        p.w.data,  bf16 ? p.w.ld : int64_t(quant::row_bytes(p.w.dtype, p.w.ld)),
            p.w.scale,    p.w.scale_ld, p.w.group, p.w.scale_block_rows,
            p.y,          p.ldy,        p.m,       p.n,
            p.k,          tile0,        kind,      p.w.scale_dtype,
            p.accumulate, vec};
  }

  void rms_norm(const RmsNormParams& p) override {
    validate(p);
    if (p.m == 0) return;
    DeviceScope ds(device_);
    cuda::launch_rms_norm(p, stream_);
  }

  void layer_norm(const LayerNormParams& p) override {
    validate(p);
    if (p.m == 0) return;
    DeviceScope ds(device_);
    cuda::launch_layer_norm(p, stream_);
  }

  void rope(const RopeParams& p) override {
    validate(p);
    if (p.m == 0 || p.n_heads == 0) return;
    DeviceScope ds(device_);
    cuda::launch_rope(p, stream_);
  }

  void indexer_scores(const IndexerScoresParams& p) override {
    validate(p);
    if (p.s == 0 || p.t == 0) return;
    CHECK(!p.pages.tiled, "cuda indexer_scores: keys must be stored by rows, found tiled pages");
    DeviceScope ds(device_);
    const bool tensor_cores = tensor_indexer_ && cuda::indexer_mma_applies(p);
    log_attention_kernel("indexer_scores", tensor_cores);
    cuda::launch_indexer_scores(p, tensor_cores, stream_);
  }

  void topk(const TopkParams& p) override {
    validate(p);
    CHECK(p.rows < (int64_t(1) << 31) && p.k < (int64_t(1) << 31), "cuda topk: rows = ", p.rows, " or k = ", p.k,
          " too large for one launch");
    if (p.rows == 0 || p.k == 0) return;
    DeviceScope ds(device_);
    if (topk_multiblock_ && p.cols > 16384 && p.rows < int64_t(sm_count_) / 2) {
      void* scratch = alloc(size_t(cuda::topk_multiblock_scratch_bytes(p)));  // (rows < SMs / 2: launchable)
      cuda::launch_topk_multiblock(p, scratch, stream_);
      free(scratch);  // (the caching allocator reuses it in stream order)
      last_kernel_["topk"] = "multi-block";
      return;
    }
    cuda::launch_topk(p, stream_);
    last_kernel_["topk"] = "one block per row";
  }

  void mla_prefill(const MlaPrefillParams& p) override {
    validate(p);
    if (p.s == 0) return;
    DeviceScope ds(device_);
    cuda::launch_mla_prefill(p, key_scratch(p.s, p.topk_len, p.topk), error_word_, stream_);
  }

  void mla_decode(const MlaDecodeParams& p) override {
    validate(p);  // (the latent cache by rows, never tiled, on every backend)
    if (p.s == 0) return;
    DeviceScope ds(device_);
    int32_t* keys = key_scratch(p.s, p.topk_len, p.topk);
    float* partials = nullptr;
    if (const int64_t n = tensor_decode_ ? cuda::mla_decode_partial_floats(p) : 0; n > 0) {
      reserve(&partials_, &partials_cap_, size_t(n) * sizeof(float));
      partials = static_cast<float*>(partials_);
    }
    log_attention_kernel("mla_decode", partials != nullptr);
    cuda::launch_mla_decode(p, keys, partials, error_word_, stream_);
  }

  void log_attention_kernel(const char* op, bool tensor_cores) {
    last_kernel_[op] = tensor_cores ? "tensor cores" : "SIMT";
    if (!attention_log_ || !logged_kernels_.insert(std::string(op) + (tensor_cores ? "/tc" : "/simt")).second) return;
    std::fprintf(stderr, "glm5 cuda: %s on the %s kernel\n", op, tensor_cores ? "tensor cores" : "SIMT");
  }

  void router(const RouterParams& p) override {
    validate(p);
    CHECK(p.top_k <= 64, "cuda router: top_k ", p.top_k, " > 64 is not supported");
    if (p.m == 0) return;
    DeviceScope ds(device_);
    cuda::launch_router(p, stream_);
  }

  void swiglu(const SwigluParams& p) override {
    validate(p);
    if (p.m == 0 || p.n == 0) return;
    DeviceScope ds(device_);
    cuda::launch_swiglu(p, stream_);
  }

  void embedding(const EmbeddingParams& p) override {
    validate(p);
    CHECK(p.table.dtype == DType::BF16 || p.table.dtype == DType::F16 || p.table.dtype == DType::F32,
          "cuda embedding: table dtype ", dtype_name(p.table.dtype), " is not supported (BF16, F16, F32)");
    if (p.m == 0 || p.table.cols == 0) return;
    DeviceScope ds(device_);
    cuda::launch_embedding(p, error_word_, stream_);  // ids are checked on the device
  }

  void gather_rows(const GatherRowsParams& p) override {
    validate(p);
    if (p.n == 0 || p.d == 0) return;
    DeviceScope ds(device_);
    cuda::launch_gather_rows(p, error_word_, stream_);
  }

  void moe_combine(const MoeCombineParams& p) override {
    validate(p);
    if (p.m == 0 || p.d == 0) return;
    DeviceScope ds(device_);
    cuda::launch_moe_combine(p, error_word_, stream_);
  }

  void add(const AddParams& p) override {
    validate(p);
    if (p.n == 0) return;
    DeviceScope ds(device_);
    cuda::launch_add(p, stream_);
  }

  void copy_2d(const Copy2dParams& p) override {
    validate(p);
    if (p.rows == 0 || p.cols == 0) return;
    DeviceScope ds(device_);
    if (p.src_dtype != p.dst_dtype) return cuda::launch_convert_2d(p, stream_);
    const size_t es = dtype_size(p.src_dtype);
    // One run: a 1-D copy (a 4 GiB 2-D copy moved only 1.7 TB/s read + written on an H200).
    if (p.ld_src == p.cols && p.ld_dst == p.cols) {
      CUDA_CHECK(
          cudaMemcpyAsync(p.dst, p.src, size_t(p.rows) * size_t(p.cols) * es, cudaMemcpyDeviceToDevice, stream_));
      return;
    }
    CUDA_CHECK(cudaMemcpy2DAsync(p.dst, size_t(p.ld_dst) * es, p.src, size_t(p.ld_src) * es, size_t(p.cols) * es,
                                 size_t(p.rows), cudaMemcpyDeviceToDevice, stream_));
  }

  void paged_write(const PagedWriteParams& p) override {
    validate(p);
    if (p.n == 0 || p.width == 0) return;
    DeviceScope ds(device_);
    cuda::launch_paged_write(p, stream_);
  }

 private:
  // cudaMalloc; when it fails, every cached block (of the cache and the exact list) goes back to
  // cudaFree, after the stream has drained (their queued users), and it tries once more.
  bool raw_malloc_or_release(void** p, size_t bytes) {
    cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) return true;
    cudaGetLastError();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    release_exact_cached();
    cache_.release_cached();
    e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) return true;
    cudaGetLastError();
    last_alloc_error_ = e;
    return false;
  }

  // A block of kExactBytes or more: a cached one of the same kExactGranule-rounded size or up to
  // 1/8 larger, else a new cudaMalloc.
  void* alloc_exact(size_t bytes) {
    const size_t size = size_t(round_up(int64_t(bytes), int64_t(kExactGranule)));
    if (auto it = exact_free_.lower_bound(size); it != exact_free_.end() && it->first <= size + size / 8) {
      void* p = it->second;
      exact_live_.emplace(p, it->first);
      exact_free_.erase(it);
      return p;
    }
    void* p = nullptr;
    if (!raw_malloc_or_release(&p, size)) fail_out_of_memory(bytes, "allocate");
    ++exact_allocs_;
    exact_live_.emplace(p, size);
    return p;
  }

  // Cached exact blocks back to cudaFree; the caller has drained the stream. True if any went.
  bool release_exact_cached() {
    const bool any = !exact_free_.empty();
    for (const auto& [size, p] : exact_free_) cudaFree(p);
    exact_free_.clear();
    return any;
  }

  [[noreturn]] void fail_out_of_memory(size_t bytes, const char* what) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
    GLM5_FAIL("backend cuda: cannot ", what, " ", bytes, " bytes on device ", device_, " (", free_b, " of ", total_b,
              " bytes free after returning this backend's cached blocks): ", cudaGetErrorString(last_alloc_error_));
  }

  std::string kernel_ran(const std::string& op) const override {
    auto it = last_kernel_.find(op);
    return it == last_kernel_.end() ? "" : it->second;
  }

  // Whether p is device memory. A host pointer is "unregistered" (older drivers: cudaErrorInvalidValue);
  // any other error (a sticky fault left by an earlier kernel) is fatal here: taken for host memory,
  // a device pointer would be memcpy'd from and take the process, and its output, down.
  static bool is_device_memory(const void* p) {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e == cudaErrorInvalidValue) {
      cudaGetLastError();
      return false;
    }
    CUDA_CHECK(e);
    return a.type == cudaMemoryTypeDevice;
  }

  // `n` (<= kStagingSlotBytes) bytes of the staging ring that no queued copy still reads.
  char* staging_claim(size_t n) {
    const size_t need = size_t(round_up(int64_t(n), 256));
    if (staging_used_ + need > kStagingSlotBytes) {
      staging_slot_ = (staging_slot_ + 1) % kStagingSlots;
      staging_used_ = 0;
      if (staging_pending_[staging_slot_]) {  // the slot's last copy (queued a ring ago) has run
        CUDA_CHECK(cudaEventSynchronize(staging_done_[staging_slot_]));
        staging_pending_[staging_slot_] = false;
      }
    }
    char* p = staging_ + size_t(staging_slot_) * kStagingSlotBytes + staging_used_;
    staging_used_ += need;
    return p;
  }

  // Per-row key sets of the attention ops: s * (topk_len + 1) ints (none for dense causal).
  int32_t* key_scratch(int64_t s, int64_t topk_len, const int32_t* topk) {
    if (!topk) return nullptr;
    reserve(&keys_, &keys_cap_, size_t(s) * size_t(topk_len + 1) * sizeof(int32_t));
    return static_cast<int32_t*>(keys_);
  }

  // Grow-only scratch from the cache. The old block goes back to the cache without a wait: work
  // queued before may still read it, and whoever gets it next is queued after that work.
  void reserve(void** buf, size_t* cap, size_t bytes) {
    if (bytes <= *cap) return;
    cache_.free(*buf);
    *buf = nullptr;
    *cap = 0;
    void* p = cache_.alloc(bytes);
    if (!p) fail_out_of_memory(bytes, "allocate scratch of");
    *buf = p;
    *cap = bytes;
  }

  // BF16 / F16 / F32 weights (validated).
  void gemm_plain(const GemmParams& p) {
    const bool use_cublas = gemm_terms_ > 0 && p.k > 0 && (p.w.dtype == DType::BF16 || p.w.dtype == DType::F32);
    if (!use_cublas) return cuda::launch_gemm_simt(p, stream_);  // F16 weights, GLM5_CUDA_GEMM_TERMS=0, k = 0
    const bool f32 = p.w.dtype == DType::F32;
    const int terms = f32 ? 0 : gemm_terms_;  // 0: one fp32 copy of x
    if (gemm_mode_ == GemmMode::kLt) {
      const LtKey key{f32, p.trans_w, terms, p.n, p.k, p.w.ld, pointer_alignment(p.w.data)};
      LtPlan& plan = lt_plan(key);
      if (plan.ok && !plan.probed) probe_lt_invariance(key, plan, p, terms);
      if (plan.ok) return gemm_lt(p, plan, terms);
    }
    gemm_chunked(p, terms);
  }

  // Quantized weights (validated). The route depends on the mode and trans_w, never on m.
  void gemm_quantized(const GemmParams& p) {
    if (p.k == 0) {  // y = 0 (or unchanged): the plain kernel, which reads no weight element
      GemmParams q = p;
      q.w = Weight{p.w.data, DType::F32, p.w.rows, p.w.cols, p.w.ld};
      return cuda::launch_gemm_simt(q, stream_);
    }
    if (quant_mode_ == QuantGemmMode::kFused && !p.trans_w) return cuda::launch_gemm_quant_fused(p, stream_);
    gemm_dequantized(p);
  }

  // Blocks of weight rows dequantized exactly (the values of weight_at) into scratch, each through
  // gemm_plain. The blocks are fixed by the weight's shape alone. Without trans_w a block is a
  // range of output columns. With trans_w it is a range of k: the partial sums are added to y block
  // after block, in order.
  void gemm_dequantized(const GemmParams& p) {
    const DType dt = cuda::dequantized_dtype(p.w);
    const size_t es = dtype_size(dt);
    const int64_t ldw = round_up(p.w.cols, 8);  // 16-byte aligned rows for cuBLAS
    const int64_t fit = std::max<int64_t>(1, int64_t(dequant_scratch_ / (size_t(ldw) * es)));
    const int64_t block = p.w.rows <= fit ? p.w.rows : fit >= 128 ? fit / 128 * 128 : fit;
    reserve(&wq_, &wq_cap_, size_t(block) * size_t(ldw) * es);
    for (int64_t r0 = 0; r0 < p.w.rows; r0 += block) {
      const int64_t rows = std::min(block, p.w.rows - r0);
      cuda::launch_dequantize_rows(p.w, r0, rows, wq_, ldw, stream_);
      GemmParams q = p;
      q.w = Weight{wq_, dt, rows, p.w.cols, ldw};
      if (p.trans_w) {
        q.x = p.x + r0, q.k = rows, q.accumulate = p.accumulate || r0 > 0;
      } else {
        q.y = p.y + r0, q.n = rows;
      }
      gemm_plain(q);
    }
  }

  // The pinned cuBLASLt algorithm of a weight shape, chosen on first use (see GLM5_CUDA_GEMM).
  //
  // Column-major view of y = x W^T, as cuBLAS sees it: C [n, M] = op(W) [n, k] * X [k, M], where
  // M = terms * rows (the bf16 terms of x stacked as extra rows, so W is read once for all of
  // them). W row-major [n, k] (stride ld) is column-major [k, n] used transposed; with trans_w,
  // W row-major [k, n] is column-major [n, k] used as is. X is the split scratch [M, ldk] row-major
  // = column-major [k, M]; C is the output scratch [M, ldc] row-major = column-major [n, M].
  LtPlan& lt_plan(const LtKey& key) {
    auto it = lt_plans_.find(key);
    if (it != lt_plans_.end()) return *it->second;
    auto plan = std::make_unique<LtPlan>();
    const cudaDataType_t ab = key.f32 ? CUDA_R_32F : CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));  // fp32: no TF32
    const cublasOperation_t op_w = key.trans ? CUBLAS_OP_N : CUBLAS_OP_T, op_x = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_w, sizeof(op_w)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_x, sizeof(op_x)));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->w, ab, uint64_t(key.trans ? key.n : key.k),
                                            uint64_t(key.trans ? key.k : key.n), key.ldw));
    const int64_t t_count = key.terms == 0 ? 1 : key.terms;
    const int64_t ldk = round_up(key.k, 8), ldc = round_up(key.n, 4);
    const size_t x_elem = key.f32 ? sizeof(float) : 2;
    const int64_t max_rows = std::clamp<int64_t>(
        int64_t(kGemmScratchBytes / (size_t(t_count) * (size_t(ldk) * x_elem + size_t(ldc) * sizeof(float)))), 1,
        kLtCheckRows);
    auto layouts = [&](int64_t rows) {
      return std::make_pair(std::make_unique<LtLayout>(ab, uint64_t(key.k), uint64_t(t_count * rows), ldk),
                            std::make_unique<LtLayout>(CUDA_R_32F, uint64_t(key.n), uint64_t(t_count * rows), ldc));
    };
    auto runs_at = [&](const cublasLtMatmulAlgo_t& algo, int64_t rows) {
      auto [x, c] = layouts(rows);
      cublasLtMatmulHeuristicResult_t r{};
      return cublasLtMatmulAlgoCheck(lt_, plan->op, plan->w, *x, *c, *c, &algo, &r) == CUBLAS_STATUS_SUCCESS &&
             r.workspaceSize <= kLtWorkspaceBytes;
    };

    cublasLtMatmulPreference_t pref = nullptr;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kLtWorkspaceBytes;
    const uint32_t align_w = key.align, align_own = 256;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w,
                                                sizeof(align_w));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align_own, sizeof(align_own));
    cublasLtMatmulHeuristicResult_t found[kLtCandidates] = {};
    int n_found = 0;
    if (st == CUBLAS_STATUS_SUCCESS) {
      auto [x, c] = layouts(std::min(lt_ref_rows_, max_rows));
      st = cublasLtMatmulAlgoGetHeuristic(lt_, plan->op, plan->w, *x, *c, *c, pref, kLtCandidates, found, &n_found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    std::string why = st == CUBLAS_STATUS_SUCCESS
                          ? "no candidate without split-K that runs at m = 1 and m = " + std::to_string(max_rows)
                          : std::string("heuristic failed: ") + cublasGetStatusName(st);
    for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < n_found && !plan->ok; ++i) {
      if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const cublasLtMatmulAlgo_t& algo = found[i].algo;
      int32_t splitk = 0;
      uint32_t reduction = 0;
      size_t got = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &got) !=
              CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                               sizeof(reduction), &got) != CUBLAS_STATUS_SUCCESS)
        continue;  // cannot tell: not pinned
      if (splitk > 1 || reduction != CUBLASLT_REDUCTION_SCHEME_NONE) continue;
      // Whether the kernel still changes with the problem size (a tile or schedule the library
      // picks per call) is not readable from the config for every kernel family: the bitwise
      // probe on first use (probe_lt_invariance) decides.
      if (!runs_at(algo, 1) || !runs_at(algo, max_rows)) continue;
      plan->algo = algo;
      plan->ok = true;
    }
    if (gemm_log_) log_lt_plan(key, *plan, why);
    return *lt_plans_.emplace(key, std::move(plan)).first->second;
  }

  void log_lt_plan(const LtKey& key, const LtPlan& plan, const std::string& why) const {
    std::string desc = "chunked path (" + why + ")";
    if (plan.ok) {
      int32_t id = 0, splitk = 0;
      uint32_t tile = 0, stages = 0, reduction = 0, swizzle = 0, custom = 0;
      uint16_t inner = 0, cluster = 0;
      size_t got = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                           sizeof(reduction), &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle),
                                           &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom),
                                           &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof(inner),
                                           &got);
      cublasLtMatmulAlgoConfigGetAttribute(&plan.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster),
                                           &got);
      desc = "cuBLASLt algo " + std::to_string(id) + " tile " + std::to_string(tile) + " stages " +
             std::to_string(stages) + " splitK " + std::to_string(splitk) + " reduction " + std::to_string(reduction) +
             " swizzle " + std::to_string(swizzle) + " custom " + std::to_string(custom) + " inner " +
             std::to_string(inner) + " cluster " + std::to_string(cluster);
    }
    std::fprintf(stderr, "glm5 cuda gemm: %s n=%lld k=%lld ld=%lld%s terms=%d align=%u: %s\n", key.f32 ? "F32" : "BF16",
                 (long long)key.n, (long long)key.k, (long long)key.ldw, key.trans ? " trans_w" : "", key.terms,
                 key.align, desc.c_str());
  }

  // Once per weight shape, on its first call's weights: the pinned algorithm must give each row
  // the same bits whatever m is. R pseudo-random rows run as one call, R as large as the engine's
  // steps make them (up to max_step_tokens' default 8192 rows, within 256 MiB of output), then
  // rows 0 and R - 1 alone and the first 65 rows as one call; any bit that differs (a kernel or
  // schedule the library still picks by problem size) sends the shape to the chunked path. One
  // stream sync per shape.
  void probe_lt_invariance(const LtKey& key, LtPlan& plan, const GemmParams& p, int terms) {
    const size_t widest = size_t(std::max(p.n, p.k)) * sizeof(float);  // input and output rows
    const int64_t R = std::clamp<int64_t>(int64_t((size_t(256) << 20) / widest), 66, 8192);
    std::vector<float> xh(size_t(R * p.k));
    uint32_t h = 12345;
    for (float& v : xh) {
      h = h * 1664525u + 1013904223u;
      v = float(int32_t(h >> 8) % 2001 - 1000) / 997.0f;
    }
    float* x = static_cast<float*>(alloc(xh.size() * sizeof(float)));
    float* y = nullptr;
    struct Scratch {  // freed on every way out (an earlier kernel's error surfaces at to_host)
      CudaBackend* be;
      float** bufs[2];
      ~Scratch() {
        for (float** b : bufs) be->free(*b);
      }
    } scratch{this, {&x, &y}};
    y = static_cast<float*>(alloc(size_t((R + 65) * p.n) * sizeof(float)));  // R rows, then up to 65
    float* y1 = y + R * p.n;
    to_device(x, xh.data(), xh.size() * sizeof(float));
    GemmParams q = p;
    q.x = x, q.ldx = p.k, q.y = y, q.ldy = p.n, q.accumulate = false;
    auto run = [&](int64_t first, int64_t rows, float* out) {
      GemmParams r = q;
      r.x = x + first * p.k, r.y = out, r.m = rows;
      gemm_lt(r, plan, terms);
    };
    run(0, R, y);
    std::vector<float> all(size_t(R * p.n)), got(size_t(65 * p.n));
    bool same = plan.ok;
    if (same) to_host(all.data(), y, all.size() * sizeof(float));
    for (int64_t row : {int64_t(0), R - 1}) {
      if (!same) break;
      run(row, 1, y1);
      to_host(got.data(), y1, size_t(p.n) * sizeof(float));
      same = std::memcmp(got.data(), all.data() + row * p.n, size_t(p.n) * sizeof(float)) == 0;
    }
    if (same) {
      run(0, 65, y1);
      to_host(got.data(), y1, got.size() * sizeof(float));
      same = std::memcmp(got.data(), all.data(), got.size() * sizeof(float)) == 0;
    }
    plan.probed = true;
    if (!same && plan.ok) {
      plan.ok = false;
      std::fprintf(stderr,
                   "glm5 cuda gemm: the pinned cuBLASLt algorithm for n=%lld k=%lld%s gives rows that "
                   "change with m; this shape uses the chunked path\n",
                   (long long)key.n, (long long)key.k, key.trans ? " trans_w" : "");
    }
  }

  // y (+)= x W^T (or x W) through one cuBLASLt call per block of rows with the pinned algorithm.
  // BF16 weights: x is split into `terms` bf16 parts stacked as extra rows, the fp32 partial
  // outputs are summed smallest first. F32 weights (terms 0): an fp32 copy of x, fp32 compute.
  void gemm_lt(const GemmParams& p, LtPlan& plan, int terms) {
    if (!plan.ok) return gemm_chunked(p, terms);  // a call of this shape failed before
    const bool f32 = p.w.dtype == DType::F32;
    const int64_t t_count = terms == 0 ? 1 : terms;
    const size_t x_elem = f32 ? sizeof(float) : 2;
    const int64_t ldk = round_up(p.k, 8), ldc = round_up(p.n, 4);
    const size_t row_bytes = size_t(t_count) * (size_t(ldk) * x_elem + size_t(ldc) * sizeof(float));
    const int64_t block = std::clamp<int64_t>(int64_t(kGemmScratchBytes / row_bytes), 1, std::min(p.m, kLtCheckRows));
    reserve(&xs_, &xs_cap_, size_t(block * t_count * ldk) * x_elem);
    reserve(&cs_, &cs_cap_, size_t(block * t_count * ldc) * sizeof(float));
    const cudaDataType_t ab = f32 ? CUDA_R_32F : CUDA_R_16BF;
    const float one = 1.0f, zero = 0.0f;
    for (int64_t r0 = 0; r0 < p.m; r0 += block) {
      const int64_t rows = std::min(block, p.m - r0);
      // Layout [term][rows][ldk]: a single chunk of `rows` rows.
      launch_gemm_split_x(p.x + r0 * p.ldx, p.ldx, rows, p.k, terms, rows, xs_, ldk, stream_);
      const LtLayout x(ab, uint64_t(p.k), uint64_t(t_count * rows), ldk);
      const LtLayout c(CUDA_R_32F, uint64_t(p.n), uint64_t(t_count * rows), ldc);
      const cublasStatus_t st = cublasLtMatmul(lt_, plan.op, &one, p.w.data, plan.w, xs_, x, &zero, cs_, c, cs_, c,
                                               &plan.algo, lt_workspace_, kLtWorkspaceBytes, stream_);
      if (st != CUBLAS_STATUS_SUCCESS) {
        // The algorithm was checked at m = 1 and the largest block only: this shape goes chunked
        // from here on (the rest of this call too), said once.
        std::fprintf(
            stderr,
            "glm5 cuda gemm: cublasLtMatmul with the pinned algorithm failed at m = %lld (n = %lld, "
            "k = %lld%s): %s; this weight shape uses the chunked path from now on (this call's later rows already "
            "do, so its rows mix the two paths once)\n",
            (long long)rows, (long long)p.n, (long long)p.k, p.trans_w ? ", trans_w" : "", cublasGetStatusName(st));
        plan.ok = false;
        GemmParams rest = p;
        rest.x = p.x + r0 * p.ldx, rest.y = p.y + r0 * p.ldy, rest.m = p.m - r0;
        return gemm_chunked(rest, terms);
      }
      launch_gemm_combine(static_cast<const float*>(cs_), ldc, rows, p.n, terms, rows, p.y + r0 * p.ldy, p.ldy,
                          p.accumulate, stream_);
    }
  }

  // y (+)= x W^T (or x W) through cuBLAS, kChunkRows rows per call (GLM5_CUDA_GEMM=chunked, and
  // weight shapes without a pinned cuBLASLt algorithm). Terms as in gemm_lt.
  void gemm_chunked(const GemmParams& p, int terms) {
    const bool f32 = p.w.dtype == DType::F32;
    const int64_t t_rows = (terms == 0 ? 1 : terms) * kChunkRows;
    const size_t x_elem = f32 ? sizeof(float) : 2;
    const int64_t ldk = round_up(p.k, 8), ldc = round_up(p.n, 4);
    CHECK(p.n < (int64_t(1) << 31) && ldk < (int64_t(1) << 31) && p.w.ld < (int64_t(1) << 31), "cuda gemm: n = ", p.n,
          ", k = ", p.k, " or weight ld = ", p.w.ld, " exceed cuBLAS's 32-bit sizes");
    const size_t chunk_bytes = size_t(t_rows) * (size_t(ldk) * x_elem + size_t(ldc) * sizeof(float));
    const int64_t chunks = (p.m + kChunkRows - 1) / kChunkRows;
    const int64_t group = std::clamp<int64_t>(int64_t(kGemmScratchBytes / chunk_bytes), 1, chunks);
    reserve(&xs_, &xs_cap_, size_t(group) * size_t(t_rows) * size_t(ldk) * x_elem);
    reserve(&cs_, &cs_cap_, size_t(group) * size_t(t_rows) * size_t(ldc) * sizeof(float));
    const cudaDataType_t dt = f32 ? CUDA_R_32F : CUDA_R_16BF;
    const cublasOperation_t op_w = p.trans_w ? CUBLAS_OP_N : CUBLAS_OP_T;
    const float one = 1.0f, zero = 0.0f;
    for (int64_t c0 = 0; c0 < chunks; c0 += group) {
      const int64_t g = std::min(group, chunks - c0);
      const int64_t r0 = c0 * kChunkRows, rows = std::min(p.m - r0, g * kChunkRows);
      launch_gemm_split_x(p.x + r0 * p.ldx, p.ldx, rows, p.k, terms, kChunkRows, xs_, ldk, stream_);
      for (int64_t c = 0; c < g; ++c) {
        const char* xs = static_cast<const char*>(xs_) + size_t(c) * t_rows * ldk * x_elem;
        float* cs = static_cast<float*>(cs_) + size_t(c) * t_rows * ldc;
        // Column-major view: C[n, t_rows] = op(W)[n, k] * X[k, t_rows].
        CUBLAS_CHECK(cublasGemmEx(cublas_, op_w, CUBLAS_OP_N, int(p.n), int(t_rows), int(p.k), &one, p.w.data, dt,
                                  int(p.w.ld), xs, dt, int(ldk), &zero, cs, CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
      }
      launch_gemm_combine(static_cast<const float*>(cs_), ldc, rows, p.n, terms, kChunkRows, p.y + r0 * p.ldy, p.ldy,
                          p.accumulate, stream_);
    }
  }

  int device_ = 0;
  Precision precision_ = Precision::kExact;
  cudaError_t last_alloc_error_ = cudaSuccess;  // of the last failed cudaMalloc
  // Declared before the CUDA handles below, destroyed after the destructor's body has drained
  // the stream; its raw free is cudaFree.
  CachingAllocator cache_;
  std::multimap<size_t, void*> exact_free_;       // blocks of kExactBytes or more: size -> cached
  std::unordered_map<void*, size_t> exact_live_;  // handed out -> size
  uint64_t exact_allocs_ = 0, upload_allocs_ = 0;
  int gemm_terms_ = 3;
  GemmMode gemm_mode_ = GemmMode::kLt;
  bool tensor_decode_ = false;    // GLM5_CUDA_MLA_DECODE=tensor
  bool tensor_indexer_ = false;   // GLM5_CUDA_INDEXER=tensor
  bool topk_multiblock_ = false;  // GLM5_CUDA_TOPK=multiblock
  bool grouped_gemm_ = false;     // GLM5_CUDA_EXPERT_GEMM=grouped, on a device that runs the kernel
  int sm_count_ = 0;
  int64_t lt_ref_rows_ = 512;
  bool gemm_log_ = false;
  bool attention_log_ = false;                      // GLM5_CUDA_ATTENTION_LOG
  std::set<std::string> logged_kernels_;            // "op/kernel" lines printed
  std::map<std::string, std::string> last_kernel_;  // op -> the kernel it ran last (kernel_ran)
  QuantGemmMode quant_mode_ = QuantGemmMode::kFused;
  size_t dequant_scratch_ = size_t(256) << 20;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* lt_workspace_ = nullptr;
  std::map<LtKey, std::unique_ptr<LtPlan>> lt_plans_;
  int* error_word_ = nullptr;  // device: see cuda::DeviceErrorCode
  int* error_host_ = nullptr;  // pinned copy read at synchronize()
  char* staging_ = nullptr;    // pinned, kStagingSlots * kStagingSlotBytes
  cudaEvent_t staging_done_[kStagingSlots] = {};
  bool staging_pending_[kStagingSlots] = {};
  int staging_slot_ = 0;
  size_t staging_used_ = 0;
  std::vector<void*> uploads_;
  void* xs_ = nullptr;  // GEMM scratch: split x terms
  size_t xs_cap_ = 0;
  void* cs_ = nullptr;  // GEMM scratch: per-term outputs
  size_t cs_cap_ = 0;
  void* wq_ = nullptr;  // dequantized weight rows (gemm_dequantized)
  size_t wq_cap_ = 0;
  void* keys_ = nullptr;
  size_t keys_cap_ = 0;
  void* grouped_items_ = nullptr;  // the grouped gemm's table (cuda::GroupedGemmItem)
  size_t grouped_items_cap_ = 0;
  void* partials_ = nullptr;  // tensor-core mla_decode's per-split results (GLM-5 dims: 1.05 MB a row)
  size_t partials_cap_ = 0;
};

}  // namespace

}  // namespace glm5::kernels

// The plugin's entry points (kernels/cuda_plugin.h; called by kernels/cuda_loader.cpp's
// make_cuda_backend and cuda_available). The caller owns the backend.
// precision: 0 kExact, 1 kFast. (Named for its signature: a plugin from a build before the precision
// argument lacks it, and the loader says so instead of calling it with an argument it drops.)
extern "C" glm5::kernels::Backend* glm5_cuda_make_backend_p(int device, int precision) {
  return new glm5::kernels::CudaBackend(
      device, precision == 1 ? glm5::kernels::Precision::kFast : glm5::kernels::Precision::kExact);
}

// True when a device is visible and this build has kernels for it; never throws.
extern "C" bool glm5_cuda_available() {
  using namespace glm5::kernels;
  static const bool ok = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      return false;
    }
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, cuda::probe_kernel()) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }();
  return ok;
}
