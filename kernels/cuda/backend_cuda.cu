// The CUDA backend: device memory, one stream, cuBLAS GEMMs and the kernels of ops_*.cu behind
// the Backend interface of ops.h. Activations stay fp32. GEMMs on bf16 weights split each fp32
// activation into bf16 terms (x = hi + mid + lo, exact with 3 terms), so tensor cores see the
// fp32 value. Quantized weights (F8_E4M3 block-scaled, Q4 / Q8 group-wise) run the fused kernel
// of ops_quant.cu by default, or are dequantized exactly into this cuBLAS path. No CUDA graphs and
// no multi-stream overlap yet.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "kernels.cuh"
#include "ops.h"

namespace glm5::kernels {
namespace {

using cuda::launch_gemm_combine;
using cuda::launch_gemm_split_x;

// Rows of x per cuBLAS call. Every call has exactly this many rows (the last chunk is padded
// with zero rows in scratch), so cuBLAS sees the same problem shape, picks the same kernel and
// sums k in the same order whatever the batch size: each output row is batch-invariant.
// 64 rows x 3 terms keeps a decode-size GEMM bound by weight bandwidth on H100/H200.
constexpr int64_t kChunkRows = 64;
// Upper bound on the GEMM scratch (split activations + per-term outputs); larger m loops.
constexpr size_t kGemmScratchBytes = size_t(256) << 20;

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// GLM5_CUDA_GEMM_TERMS: bf16 terms per activation for bf16-weight GEMMs. 3 (default) represents
// every fp32 activation exactly; 2 keeps ~16 bits (about 1e-5 relative); 1 is plain bf16
// activations (as the upstream references run); 0 uses the plain fp32 kernel instead of cuBLAS
// for every dtype (a check on cuBLAS; slow). F32 weights use an fp32 cuBLAS GEMM for 1..3.
int gemm_terms_from_env() {
  const char* v = std::getenv("GLM5_CUDA_GEMM_TERMS");
  if (!v || !*v) return 3;
  const std::string s = v;
  CHECK(s == "0" || s == "1" || s == "2" || s == "3",
        "environment variable GLM5_CUDA_GEMM_TERMS: expected 0, 1, 2 or 3, found '", s, "'");
  return std::stoi(s);
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
  const char* v = std::getenv("GLM5_CUDA_QUANT_GEMM");
  if (!v || !*v) return QuantGemmMode::kFused;
  const std::string s = v;
  CHECK(s == "fused" || s == "dequant",
        "environment variable GLM5_CUDA_QUANT_GEMM: expected 'fused' or 'dequant', found '", s, "'");
  return s == "fused" ? QuantGemmMode::kFused : QuantGemmMode::kDequant;
}

// Upper bound on the scratch of dequantized weight rows (GLM5_CUDA_QUANT_GEMM=dequant, trans_w):
// 256 MiB, or GLM5_CUDA_DEQUANT_SCRATCH bytes (tests set it small to exercise the blocking).
size_t dequant_scratch_from_env() {
  const char* v = std::getenv("GLM5_CUDA_DEQUANT_SCRATCH");
  if (!v || !*v) return size_t(256) << 20;
  const std::string s = v;
  size_t used = 0;
  long long bytes = 0;
  try {
    bytes = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  CHECK(used == s.size() && bytes > 0,
        "environment variable GLM5_CUDA_DEQUANT_SCRATCH: expected a positive byte count, found '", s, "'");
  return size_t(bytes);
}

// The checks the reference backend makes on a quantized weight, plus what this backend needs
// (FP8 scales in F32, group scale rows of one weight row each), with messages naming the format.
void check_quant_weight(const Weight& w) {
  const std::string_view dt = dtype_name(w.dtype);
  CHECK(w.group > 0 && w.scale_block_rows > 0, "cuda gemm: ", dt, " weight [", w.rows, ", ", w.cols,
        "] needs group > 0 and scale_block_rows > 0, found group ", w.group, ", scale_block_rows ",
        w.scale_block_rows);
  CHECK(w.scale_ld >= (w.cols + w.group - 1) / w.group, "cuda gemm: ", dt, " weight [", w.rows, ", ",
        w.cols, "] with group ", w.group, " needs scale_ld >= ", (w.cols + w.group - 1) / w.group,
        ", found ", w.scale_ld);
  if (w.dtype == DType::F8_E4M3) {
    CHECK(w.scale_dtype == DType::F32, "cuda gemm: F8_E4M3 weight scales must be F32, found ",
          dtype_name(w.scale_dtype));
  } else {
    CHECK(w.scale_dtype == DType::BF16 || w.scale_dtype == DType::F16 || w.scale_dtype == DType::F32,
          "cuda gemm: ", dt, " weight scales must be BF16, F16 or F32, found ", dtype_name(w.scale_dtype));
    CHECK(w.scale_block_rows == 1, "cuda gemm: ", dt, " weight has one scale row per weight row; found scale_block_rows ",
          w.scale_block_rows);
    CHECK(w.dtype != DType::Q4 || w.ld % 2 == 0, "cuda gemm: ", dt, " weight ld ", w.ld,
          " is odd (two elements per byte, rows start on a byte)");
  }
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

class CudaBackend final : public Backend {
 public:
  bool host_memory() const override { return false; }
  explicit CudaBackend(int device) : device_(device) {
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
      GLM5_FAIL("backend cuda: this build has no kernels for device ", device, " (", prop.name,
                ", compute capability ", prop.major, ".", prop.minor,
                "): ", cudaGetErrorString(probe),
                "; configure with -DCMAKE_CUDA_ARCHITECTURES=", prop.major, prop.minor);
    }
    gemm_terms_ = gemm_terms_from_env();
    quant_mode_ = quant_gemm_mode_from_env();
    dequant_scratch_ = dequant_scratch_from_env();
    // A blocking stream: work on the legacy default stream (NCCL, cudaMemcpy) orders with it.
    CUDA_CHECK(cudaStreamCreate(&stream_));
    CUBLAS_CHECK(cublasCreate(&cublas_));
    CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));            // fp32 GEMMs: no TF32
    CUBLAS_CHECK(cublasSetAtomicsMode(cublas_, CUBLAS_ATOMICS_NOT_ALLOWED));  // deterministic
    CUDA_CHECK(cudaMalloc(&error_word_, 4 * sizeof(int)));
    CUDA_CHECK(cudaMemset(error_word_, 0, 4 * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&error_host_, 4 * sizeof(int)));
  }

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    for (void* p : uploads_) cudaFree(p);
    cudaFree(xs_);
    cudaFree(cs_);
    cudaFree(wq_);
    cudaFree(keys_);
    cudaFree(error_word_);
    cudaFreeHost(error_host_);
    if (cublas_) cublasDestroy(cublas_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }

  void* alloc(size_t bytes) override {
    DeviceScope ds(device_);
    void* p = nullptr;
    if (bytes == 0) return nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      GLM5_FAIL("backend cuda: cannot allocate ", bytes, " bytes on device ", device_, " (", free_b,
                " of ", total_b, " bytes free): ", cudaGetErrorString(e));
    }
    return p;
  }

  void free(void* p) override {
    if (!p) return;
    DeviceScope ds(device_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // kernels in flight may still use p
    CUDA_CHECK(cudaFree(p));
  }

  void to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    DeviceScope ds(device_);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    synchronize();
  }

  void to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    DeviceScope ds(device_);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    synchronize();
  }

  const void* upload(const void* host, size_t bytes) override {
    void* p = alloc(bytes == 0 ? 1 : bytes);
    uploads_.push_back(p);
    if (bytes) CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
  }

  // Waits for the stream, then reports the first bad input a kernel found since the last call
  // (the reference backend rejects such input before running; a device only sees it here).
  void synchronize() override {
    DeviceScope ds(device_);
    CUDA_CHECK(cudaMemcpyAsync(error_host_, error_word_, 4 * sizeof(int), cudaMemcpyDeviceToHost,
                               stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (error_host_[0] == cuda::kDeviceOk) return;
    const int code = error_host_[0], value = error_host_[1], row = error_host_[2],
              bound = error_host_[3];
    CUDA_CHECK(cudaMemset(error_word_, 0, 4 * sizeof(int)));
    error_host_[0] = 0;
    switch (code) {
      case cuda::kEmbeddingIdOutOfRange:
        GLM5_FAIL("cuda embedding: token id ", value, " (row ", row, ") outside the table's [0, ",
                  bound, ")");
      case cuda::kGatherRowNegative:
        GLM5_FAIL("cuda gather_rows: source row ", value, " (entry ", row, ") < 0");
      case cuda::kMoeSlotInvalid:
        GLM5_FAIL("cuda moe_combine: slot ", value, " (row ", row, ") < -1");
      case cuda::kTopkEntryOutOfRange:
        GLM5_FAIL("cuda mla: topk entry ", value, " (query row ", row, ") outside [-1, ", bound,
                  ")");
      default:
        GLM5_FAIL("cuda: a kernel reported unknown error code ", code);
    }
  }

  void gemm(const GemmParams& p) override {
    CHECK(p.m >= 0 && p.n >= 0 && p.k >= 0, "cuda gemm: negative size m = ", p.m, ", n = ", p.n,
          ", k = ", p.k);
    const bool quantized = quant::is_quantized(p.w.dtype);
    CHECK(quantized || p.w.dtype == DType::BF16 || p.w.dtype == DType::F16 || p.w.dtype == DType::F32,
          "cuda gemm: weight dtype ", dtype_name(p.w.dtype),
          " is not supported (BF16, F16, F32, F8_E4M3, int4 / int8 pack-quantized)");
    if (quantized) check_quant_weight(p.w);
    const int64_t want_rows = p.trans_w ? p.k : p.n, want_cols = p.trans_w ? p.n : p.k;
    CHECK(p.w.rows == want_rows && p.w.cols == want_cols, "cuda gemm: weight is [", p.w.rows, ", ",
          p.w.cols, "] but m = ", p.m, ", n = ", p.n, ", k = ", p.k, ", trans_w = ", p.trans_w,
          " need [", want_rows, ", ", want_cols, "]");
    CHECK(p.w.ld >= p.w.cols, "cuda gemm: weight ld ", p.w.ld, " < cols ", p.w.cols);
    CHECK(p.ldx >= p.k && p.ldy >= p.n, "cuda gemm: ldx ", p.ldx, " (k ", p.k, ") or ldy ", p.ldy,
          " (n ", p.n, ") too small");
    if (p.m == 0 || p.n == 0) return;
    CHECK(p.y && (p.k == 0 || (p.x && p.w.data)), "cuda gemm: null x, y or weight data");
    CHECK(!quantized || p.k == 0 || p.w.scale, "cuda gemm: ", dtype_name(p.w.dtype),
          " weight without scales (null scale pointer)");
    DeviceScope ds(device_);
    if (quantized)
      gemm_quantized(p);
    else
      gemm_plain(p);
  }

  void rms_norm(const RmsNormParams& p) override {
    CHECK(p.m >= 0 && p.d > 0, "cuda rms_norm: need m >= 0 and d > 0, found m = ", p.m,
          ", d = ", p.d);
    CHECK(p.ldx >= p.d && p.ldy >= p.d, "cuda rms_norm: ldx ", p.ldx, " / ldy ", p.ldy, " < d ",
          p.d);
    if (p.m == 0) return;
    CHECK(p.x && p.y && p.weight, "cuda rms_norm: null pointer");
    DeviceScope ds(device_);
    cuda::launch_rms_norm(p, stream_);
  }

  void layer_norm(const LayerNormParams& p) override {
    CHECK(p.m >= 0 && p.d > 0, "cuda layer_norm: need m >= 0 and d > 0, found m = ", p.m,
          ", d = ", p.d);
    CHECK(p.ldx >= p.d && p.ldy >= p.d, "cuda layer_norm: ldx ", p.ldx, " / ldy ", p.ldy, " < d ",
          p.d);
    if (p.m == 0) return;
    CHECK(p.x && p.y && p.weight && p.bias, "cuda layer_norm: null pointer");
    DeviceScope ds(device_);
    cuda::launch_layer_norm(p, stream_);
  }

  void rope(const RopeParams& p) override {
    CHECK(p.rope_dim > 0 && p.rope_dim % 2 == 0, "cuda rope: rope_dim must be even and > 0, found ",
          p.rope_dim);
    CHECK(p.m >= 0 && p.n_heads >= 0 && p.offset >= 0, "cuda rope: negative m = ", p.m,
          ", n_heads = ", p.n_heads, " or offset = ", p.offset);
    if (p.m == 0 || p.n_heads == 0) return;
    CHECK(p.x && p.positions && p.inv_freq, "cuda rope: null pointer");
    DeviceScope ds(device_);
    cuda::launch_rope(p, stream_);
  }

  void indexer_scores(const IndexerScoresParams& p) override {
    CHECK(p.s >= 0 && p.t >= 0 && p.n_heads > 0 && p.head_dim > 0,
          "cuda indexer_scores: need s, t >= 0 and n_heads, head_dim > 0, found s = ", p.s,
          ", t = ", p.t, ", n_heads = ", p.n_heads, ", head_dim = ", p.head_dim);
    CHECK(p.ld_scores >= p.t, "cuda indexer_scores: ld_scores ", p.ld_scores, " < t ", p.t);
    if (p.s == 0 || p.t == 0) return;
    CHECK(p.q && p.weights && p.q_pos && p.scores && p.k, "cuda indexer_scores: null pointer");
    DeviceScope ds(device_);
    cuda::launch_indexer_scores(p, stream_);
  }

  void topk(const TopkParams& p) override {
    CHECK(p.rows >= 0 && p.cols >= 0 && p.k >= 0, "cuda topk: negative rows = ", p.rows,
          ", cols = ", p.cols, " or k = ", p.k);
    CHECK(p.ld >= p.cols, "cuda topk: ld ", p.ld, " < cols ", p.cols);
    CHECK(p.rows < (int64_t(1) << 31) && p.k < (int64_t(1) << 31), "cuda topk: rows = ", p.rows,
          " or k = ", p.k, " too large for one launch");
    if (p.rows == 0 || p.k == 0) return;
    CHECK(p.indices && (p.cols == 0 || p.scores), "cuda topk: null pointer");
    DeviceScope ds(device_);
    cuda::launch_topk(p, stream_);
  }

  void mla_prefill(const MlaPrefillParams& p) override {
    CHECK(p.s >= 0 && p.t >= 0 && p.n_heads > 0 && p.qk_nope_head_dim >= 0 &&
              p.qk_rope_head_dim >= 0 && p.v_head_dim > 0,
          "cuda mla_prefill: bad sizes s = ", p.s, ", t = ", p.t, ", n_heads = ", p.n_heads,
          ", qk_nope_head_dim = ", p.qk_nope_head_dim, ", qk_rope_head_dim = ", p.qk_rope_head_dim,
          ", v_head_dim = ", p.v_head_dim);
    CHECK(p.qk_rope_head_dim == 0 || p.ld_k_pe >= p.qk_rope_head_dim, "cuda mla_prefill: ld_k_pe ",
          p.ld_k_pe, " < qk_rope_head_dim ", p.qk_rope_head_dim);
    CHECK(!p.topk || p.topk_len >= 0, "cuda mla_prefill: topk_len ", p.topk_len, " < 0");
    if (p.s == 0) return;
    CHECK(p.q && p.q_pos && p.out, "cuda mla_prefill: null pointer");
    CHECK(p.t == 0 || (p.kv && (p.qk_rope_head_dim == 0 || p.k_pe)),
          "cuda mla_prefill: null kv or k_pe");
    DeviceScope ds(device_);
    cuda::launch_mla_prefill(p, key_scratch(p.s, p.topk_len, p.topk), error_word_, stream_);
  }

  void mla_decode(const MlaDecodeParams& p) override {
    CHECK(p.s >= 0 && p.t >= 0 && p.n_heads > 0 && p.kv_lora_rank > 0 && p.qk_rope_head_dim >= 0,
          "cuda mla_decode: bad sizes s = ", p.s, ", t = ", p.t, ", n_heads = ", p.n_heads,
          ", kv_lora_rank = ", p.kv_lora_rank, ", qk_rope_head_dim = ", p.qk_rope_head_dim);
    CHECK(!p.topk || p.topk_len >= 0, "cuda mla_decode: topk_len ", p.topk_len, " < 0");
    if (p.s == 0) return;
    CHECK(p.q_lat && p.q_pos && p.out_lat, "cuda mla_decode: null pointer");
    CHECK(p.t == 0 || p.cache, "cuda mla_decode: null cache");
    DeviceScope ds(device_);
    cuda::launch_mla_decode(p, key_scratch(p.s, p.topk_len, p.topk), error_word_, stream_);
  }

  void router(const RouterParams& p) override {
    CHECK(p.m >= 0 && p.n_experts > 0,
          "cuda router: need m >= 0 and n_experts > 0, found m = ", p.m,
          ", n_experts = ", p.n_experts);
    CHECK(p.n_group >= 1 && p.n_experts % p.n_group == 0, "cuda router: n_experts ", p.n_experts,
          " is not divisible by n_group ", p.n_group);
    CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group, "cuda router: topk_group ", p.topk_group,
          " not in [1, n_group = ", p.n_group, "]");
    const int64_t selectable =
        p.n_group > 1 ? p.topk_group * (p.n_experts / p.n_group) : p.n_experts;
    CHECK(p.top_k >= 1 && p.top_k <= selectable, "cuda router: top_k ", p.top_k, " not in [1, ",
          selectable, "] (experts in the kept groups)");
    CHECK(p.top_k <= 64, "cuda router: top_k ", p.top_k, " > 64 is not supported");
    if (p.m == 0) return;
    CHECK(p.logits && p.expert_ids && p.expert_weights, "cuda router: null pointer");
    DeviceScope ds(device_);
    cuda::launch_router(p, stream_);
  }

  void swiglu(const SwigluParams& p) override {
    CHECK(p.m >= 0 && p.n >= 0, "cuda swiglu: negative m = ", p.m, " or n = ", p.n);
    CHECK(p.ld_in >= p.n && p.ld_out >= p.n, "cuda swiglu: ld_in ", p.ld_in, " / ld_out ", p.ld_out,
          " < n ", p.n);
    if (p.m == 0 || p.n == 0) return;
    CHECK(p.gate && p.up && p.out, "cuda swiglu: null pointer");
    DeviceScope ds(device_);
    cuda::launch_swiglu(p, stream_);
  }

  void embedding(const EmbeddingParams& p) override {
    CHECK(
        p.table.dtype == DType::BF16 || p.table.dtype == DType::F16 || p.table.dtype == DType::F32,
        "cuda embedding: table dtype ", dtype_name(p.table.dtype),
        " is not supported (BF16, F16, F32)");
    CHECK(p.m >= 0, "cuda embedding: negative m = ", p.m);
    CHECK(p.table.ld >= p.table.cols, "cuda embedding: table ld ", p.table.ld, " < cols ",
          p.table.cols);
    if (p.m == 0 || p.table.cols == 0) return;
    CHECK(p.ids && p.out && p.table.data, "cuda embedding: null pointer");
    DeviceScope ds(device_);
    cuda::launch_embedding(p, error_word_, stream_);  // ids are checked on the device
  }

  void gather_rows(const GatherRowsParams& p) override {
    CHECK(p.n >= 0 && p.d >= 0, "cuda gather_rows: negative n = ", p.n, " or d = ", p.d);
    if (p.n == 0 || p.d == 0) return;
    CHECK(p.src && p.rows && p.dst, "cuda gather_rows: null pointer");
    DeviceScope ds(device_);
    cuda::launch_gather_rows(p, error_word_, stream_);
  }

  void moe_combine(const MoeCombineParams& p) override {
    CHECK(p.m >= 0 && p.top_k >= 0 && p.d >= 0, "cuda moe_combine: negative m = ", p.m,
          ", top_k = ", p.top_k, " or d = ", p.d);
    if (p.m == 0 || p.d == 0) return;
    CHECK(p.out && (p.top_k == 0 || (p.slots && p.weights && p.expert_out)),
          "cuda moe_combine: null pointer");
    DeviceScope ds(device_);
    cuda::launch_moe_combine(p, error_word_, stream_);
  }

  void add(const AddParams& p) override {
    CHECK(p.n >= 0, "cuda add: negative n = ", p.n);
    if (p.n == 0) return;
    CHECK(p.x && p.y, "cuda add: null pointer");
    DeviceScope ds(device_);
    cuda::launch_add(p, stream_);
  }

  void copy_2d(const Copy2dParams& p) override {
    CHECK(p.rows >= 0 && p.cols >= 0, "cuda copy_2d: negative rows = ", p.rows,
          " or cols = ", p.cols);
    CHECK(p.ld_src >= p.cols && p.ld_dst >= p.cols, "cuda copy_2d: ld_src ", p.ld_src, " / ld_dst ",
          p.ld_dst, " < cols ", p.cols);
    if (p.rows == 0 || p.cols == 0) return;
    CHECK(p.src && p.dst, "cuda copy_2d: null pointer");
    for (DType t : {p.src_dtype, p.dst_dtype})
      CHECK(t == DType::F32 || t == DType::BF16, "cuda copy_2d: elements must be F32 or BF16, found ", dtype_name(t));
    DeviceScope ds(device_);
    if (p.src_dtype != p.dst_dtype) return cuda::launch_convert_2d(p, stream_);
    const size_t es = dtype_size(p.src_dtype);
    CUDA_CHECK(cudaMemcpy2DAsync(p.dst, size_t(p.ld_dst) * es, p.src, size_t(p.ld_src) * es, size_t(p.cols) * es,
                                 size_t(p.rows), cudaMemcpyDeviceToDevice, stream_));
  }

  void paged_write(const PagedWriteParams& p) override {
    CHECK(p.n >= 0 && p.width >= 0 && p.ld_src >= p.width, "cuda paged_write: bad sizes n = ", p.n, ", width = ",
          p.width, ", ld_src = ", p.ld_src);
    if (p.n == 0 || p.width == 0) return;
    CHECK(p.src && p.pos && p.pool && p.pages.block_table && p.pages.block_size > 0,
          "cuda paged_write: null pointer or no block table");
    CHECK(p.pages.dtype == DType::F32 || p.pages.dtype == DType::BF16,
          "cuda paged_write: pool elements must be F32 or BF16, found ", dtype_name(p.pages.dtype));
    DeviceScope ds(device_);
    cuda::launch_paged_write(p, stream_);
  }

 private:
  // Per-row key sets of the attention ops: s * (topk_len + 1) ints (none for dense causal).
  int32_t* key_scratch(int64_t s, int64_t topk_len, const int32_t* topk) {
    if (!topk) return nullptr;
    reserve(&keys_, &keys_cap_, size_t(s) * size_t(topk_len + 1) * sizeof(int32_t));
    return static_cast<int32_t*>(keys_);
  }

  // Grow-only scratch; a resize waits for the stream so no kernel still reads the old buffer.
  void reserve(void** buf, size_t* cap, size_t bytes) {
    if (bytes <= *cap) return;
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaFree(*buf));
    *buf = nullptr;
    *cap = 0;
    CUDA_CHECK(cudaMalloc(buf, bytes));
    *cap = bytes;
  }

  // BF16 / F16 / F32 weights (validated).
  void gemm_plain(const GemmParams& p) {
    const bool use_cublas =
        gemm_terms_ > 0 && p.k > 0 && (p.w.dtype == DType::BF16 || p.w.dtype == DType::F32);
    if (use_cublas)
      gemm_cublas(p);
    else
      cuda::launch_gemm_simt(p, stream_);  // F16 weights, GLM5_CUDA_GEMM_TERMS=0, k = 0
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

  // y (+)= x W^T (or x W) through cuBLAS, kChunkRows rows per call. BF16 weights: x is split
  // into `terms` bf16 parts stacked as extra rows (one call, the weight read once), the fp32
  // partial outputs are summed smallest first. F32 weights: fp32 GEMM with fp32 compute.
  void gemm_cublas(const GemmParams& p) {
    const bool f32 = p.w.dtype == DType::F32;
    const int terms = f32 ? 0 : gemm_terms_;  // 0: one fp32 copy of x
    const int64_t t_rows = (terms == 0 ? 1 : terms) * kChunkRows;
    const size_t x_elem = f32 ? sizeof(float) : 2;
    const int64_t ldk = round_up(p.k, 8), ldc = round_up(p.n, 4);
    CHECK(p.n < (int64_t(1) << 31) && ldk < (int64_t(1) << 31) && p.w.ld < (int64_t(1) << 31),
          "cuda gemm: n = ", p.n, ", k = ", p.k, " or weight ld = ", p.w.ld,
          " exceed cuBLAS's 32-bit sizes");
    const size_t chunk_bytes =
        size_t(t_rows) * (size_t(ldk) * x_elem + size_t(ldc) * sizeof(float));
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
        CUBLAS_CHECK(cublasGemmEx(cublas_, op_w, CUBLAS_OP_N, int(p.n), int(t_rows), int(p.k), &one,
                                  p.w.data, dt, int(p.w.ld), xs, dt, int(ldk), &zero, cs,
                                  CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
      launch_gemm_combine(static_cast<const float*>(cs_), ldc, rows, p.n, terms, kChunkRows,
                          p.y + r0 * p.ldy, p.ldy, p.accumulate, stream_);
    }
  }

  int device_ = 0;
  int gemm_terms_ = 3;
  QuantGemmMode quant_mode_ = QuantGemmMode::kFused;
  size_t dequant_scratch_ = size_t(256) << 20;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  int* error_word_ = nullptr;  // device: see cuda::DeviceErrorCode
  int* error_host_ = nullptr;  // pinned copy read at synchronize()
  std::vector<void*> uploads_;
  void* xs_ = nullptr;
  size_t xs_cap_ = 0;
  void* cs_ = nullptr;
  size_t cs_cap_ = 0;
  void* wq_ = nullptr;  // dequantized weight rows (gemm_dequantized)
  size_t wq_cap_ = 0;
  void* keys_ = nullptr;
  size_t keys_cap_ = 0;
};

}  // namespace

}  // namespace glm5::kernels

// The plugin's entry points (kernels/cuda_plugin.h; called by kernels/cuda_loader.cpp's
// make_cuda_backend and cuda_available). The caller owns the backend.
extern "C" glm5::kernels::Backend* glm5_cuda_make_backend(int device) {
  return new glm5::kernels::CudaBackend(device);
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
