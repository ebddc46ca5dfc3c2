// CUDA_CHECK / CUBLAS_CHECK: wrap every CUDA runtime and cuBLAS call; on failure they throw
// glm5::Error naming the call, the error code's name and its description. Host code only (kernels
// report errors through the backend's device error word instead, see backend_cuda.cu).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/core/check.h"

#define CUDA_CHECK(call)                                                              \
  do {                                                                                \
    const cudaError_t glm5_cuda_err_ = (call);                                        \
    if (glm5_cuda_err_ != cudaSuccess)                                                \
      GLM5_FAIL("cuda: ", #call, " failed: ", cudaGetErrorName(glm5_cuda_err_), " (", \
                cudaGetErrorString(glm5_cuda_err_), ")");                             \
  } while (0)

#define CUBLAS_CHECK(call)                                                                  \
  do {                                                                                      \
    const cublasStatus_t glm5_cublas_st_ = (call);                                          \
    if (glm5_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                           \
      GLM5_FAIL("cublas: ", #call, " failed: ", cublasGetStatusName(glm5_cublas_st_), " (", \
                cublasGetStatusString(glm5_cublas_st_), ")");                               \
  } while (0)

// After a kernel launch: catches bad launch configurations (not faults inside the kernel, which
// surface at the next synchronising call).
#define CUDA_CHECK_LAUNCH(what)                                                                \
  do {                                                                                         \
    const cudaError_t glm5_cuda_err_ = cudaGetLastError();                                     \
    if (glm5_cuda_err_ != cudaSuccess)                                                         \
      GLM5_FAIL("cuda: launch of ", what, " failed: ", cudaGetErrorName(glm5_cuda_err_), " (", \
                cudaGetErrorString(glm5_cuda_err_), ")");                                      \
  } while (0)
