// Launchers of the CUDA kernels behind CudaBackend (backend_cuda.cu). Each takes the op's params
// struct from ops.h (pointers already in device memory, shapes validated by the backend) and the
// backend's stream. Internal to kernels/cuda/; nothing outside this folder includes it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ops.h"

namespace glm5::kernels::cuda {

// Device error word written by kernels that find input the reference backend rejects but that
// only the device can see (ids, rows, slots, top-k entries): [0] = error code (0 = none),
// [1] = offending value, [2] = its row, [3] = the bound it broke. The first error wins; the
// backend reads the word at every synchronising call and throws.
enum DeviceErrorCode : int {
  kDeviceOk = 0,
  kEmbeddingIdOutOfRange = 1,  // bound: table rows
  kGatherRowNegative = 2,
  kMoeSlotInvalid = 3,       // slot < -1
  kTopkEntryOutOfRange = 4,  // mla_prefill / mla_decode; bound: t
};

// ops_rowwise.cu
void launch_rms_norm(const RmsNormParams& p, cudaStream_t st);
void launch_layer_norm(const LayerNormParams& p, cudaStream_t st);
void launch_rope(const RopeParams& p, cudaStream_t st);
void launch_router(const RouterParams& p, cudaStream_t st);
void launch_swiglu(const SwigluParams& p, cudaStream_t st);
void launch_embedding(const EmbeddingParams& p, int* error_word, cudaStream_t st);
void launch_gather_rows(const GatherRowsParams& p, int* error_word, cudaStream_t st);
void launch_moe_combine(const MoeCombineParams& p, int* error_word, cudaStream_t st);
void launch_add(const AddParams& p, cudaStream_t st);
// copy_2d between F32 and BF16 elements (round to nearest even to BF16, exact back).
void launch_convert_2d(const Copy2dParams& p, cudaStream_t st);
void launch_paged_write(const PagedWriteParams& p, cudaStream_t st);
// GEMM helpers for the cuBLAS path: split rows [0, rows) of x (fp32, row stride ldx) into `terms`
// bf16 parts (x = hi + mid + lo) into xs laid out [chunk][term][chunk_rows][ldk]; rows past `rows`
// up to a whole chunk are zero. With terms == 0 the rows are copied as fp32 (F32 weights).
void launch_gemm_split_x(const float* x, int64_t ldx, int64_t rows, int64_t k, int terms, int64_t chunk_rows, void* xs,
                         int64_t ldk, cudaStream_t st);
// y[r, :] (+)= sum over terms of cs[chunk][term][r % chunk_rows][:] (smallest term first).
void launch_gemm_combine(const float* cs, int64_t ldc, int64_t rows, int64_t n, int terms, int64_t chunk_rows, float* y,
                         int64_t ldy, bool accumulate, cudaStream_t st);
// Plain tiled fp32 GEMM that widens weights of any dtype in shared memory; k in ascending order
// for every output. Used for F16 weights and when cuBLAS is switched off.
void launch_gemm_simt(const GemmParams& p, cudaStream_t st);

// ops_grouped_gemm.cu: many independent y (+)= x W^T (W [n, k] row-major, trans_w false) in one
// tensor-core launch, every row's bits independent of m and of the other GEMMs in the launch. W is
// BF16, or quantized (F8_E4M3 block-scaled, Q4 / Q8 group-wise: weight_at's values) and rounded
// to bf16 as it is staged.
enum class GroupedWeight : int32_t { kBf16, kFp8, kQ4, kQ8 };
struct GroupedGemmItem {
  const float* x;
  int64_t ldx;
  const void* w;      // [n, ld] elements of `kind`
  int64_t w_row;      // elements per row (BF16) or stored bytes per row (quantized)
  const void* scale;  // quantized: scale [(row / scale_block_rows) * scale_ld + col / group]
  int64_t scale_ld, group, scale_block_rows;
  float* y;
  int64_t ldy;
  int64_t m, n, k;
  int64_t tile0;  // the first CTA of this GEMM (a running sum of grouped_gemm_tiles)
  GroupedWeight kind;
  DType scale_dtype;  // F32, BF16 or F16
  bool accumulate;    // y += x W^T
  bool vec;           // BF16 only: w, w_row and k allow 16-byte loads of W
};
// The CTAs of one m x n GEMM.
int64_t grouped_gemm_tiles(int64_t m, int64_t n);
// items: device memory, n_items entries in tile0 order, `tiles` CTAs in all (the last tile0 plus
// its GEMM's tiles); terms: 1..3 bf16 parts of x (see GLM5_CUDA_GEMM_TERMS).
void launch_gemm_grouped(const GroupedGemmItem* items, int n_items, int64_t tiles, int terms, cudaStream_t st);

// ops_quant.cu: quantized weights (F8_E4M3 block-scaled, Q4 / Q8 group-wise; values of weight_at).
// y (+)= x W^T (trans_w false, k > 0) read from the stored bytes and dequantized in registers. Each
// output is summed in an order that depends on k only (32 lane partials of fixed columns, each an
// ascending fmaf chain, then a fixed xor-tree warp sum): rows are batch-invariant for every m.
void launch_gemm_quant_fused(const GemmParams& p, cudaStream_t st);
// The dtype that holds w's dequantized values exactly: BF16 for Q4 / Q8 with BF16 scales (their
// values are bf16 numbers), F32 otherwise.
DType dequantized_dtype(const Weight& w);
// Rows [r0, r0 + rows) of the quantized w, dequantized, into out [rows, ldo] of
// dequantized_dtype(w).
void launch_dequantize_rows(const Weight& w, int64_t r0, int64_t rows, void* out, int64_t ldo, cudaStream_t st);

// ops_attention.cu
// Whether the tensor-core kernels (attention, indexer, grouped GEMM) can run on the current device:
// compute capability >= 8 and this build's code for it made from PTX of >= 8.0 (a build for an
// older architecture, run by JIT on a newer GPU, has kernels without the MMA). Asked once per device.
bool device_has_bf16_mma();
// Whether the tensor-core indexer kernel applies: BF16 keys stored by rows, head_dim a multiple of
// 64 up to 256, up to 64 heads, shared memory for them, compute capability >= 8.
bool indexer_mma_applies(const IndexerScoresParams& p);
// tensor_cores (only where indexer_mma_applies): the tensor-core kernel, else the SIMT one.
void launch_indexer_scores(const IndexerScoresParams& p, bool tensor_cores, cudaStream_t st);
void launch_topk(const TopkParams& p, cudaStream_t st);
// The same selection with each row's columns over several blocks (few rows, long rows: decode);
// scratch: topk_multiblock_scratch_bytes(p) bytes of device memory, free once the stream is past it.
int64_t topk_multiblock_scratch_bytes(const TopkParams& p);
void launch_topk_multiblock(const TopkParams& p, void* scratch, cudaStream_t st);
// With a top-k list, `scratch` holds s * (topk_len + 1) ints (the per-row key sets).
void launch_mla_prefill(const MlaPrefillParams& p, int32_t* scratch, int* error_word, cudaStream_t st);
// The tensor-core kernel applies to top-k lists over a BF16 cache of GLM-5's latent width
// (kv_lora_rank 512, dk % 64 == 0) on compute capability >= 8: mla_decode_partial_floats(p) is
// then > 0, and launch_mla_decode runs it when given `partials` of that many floats; with
// partials null (or 0 from the function) the SIMT kernel runs.
int64_t mla_decode_partial_floats(const MlaDecodeParams& p);
void launch_mla_decode(const MlaDecodeParams& p, int32_t* scratch, float* partials, int* error_word, cudaStream_t st);

// A kernel whose presence proves the module has code for the current device (cuda_available()).
const void* probe_kernel();

}  // namespace glm5::kernels::cuda
