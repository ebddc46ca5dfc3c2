// Built when the CUDA backend is not: the factory exists and says clearly why it cannot work.
#include "kernels/ops.h"

namespace glm5::kernels {
std::unique_ptr<Backend> make_cuda_backend(int, Precision) {
  GLM5_FAIL(
      "backend: cuda requested, but this build of glm5 has no CUDA support "
      "(configure on a machine with nvcc, CUDA toolkit and NCCL)");
}
bool cuda_available() { return false; }
}  // namespace glm5::kernels
