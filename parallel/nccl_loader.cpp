// make_nccl_comm of nccl_comm.h in builds with CUDA: the communicator itself is in the CUDA
// plugin (kernels/cuda_plugin.h, parallel/nccl_comm.cpp), loaded on first use.
#include <string>

#include "kernels/core/check.h"
#include "kernels/cuda_plugin.h"
#include "parallel/nccl_comm.h"

namespace glm5::parallel {

std::unique_ptr<Comm> make_nccl_comm(Comm& host_comm, int device, void* work_stream) {
  void* sym = nullptr;
  std::string error;
  try {
    sym = kernels::cuda_plugin_symbol("glm5_cuda_make_nccl_comm");
  } catch (const Error& e) {
    error = e.what();
  }
  if (!sym) {
    // Take part in the set-up agreement (the first collective of the plugin's make_nccl_comm)
    // so that the other ranks throw too instead of waiting for this one.
    int ok = 0;
    host_comm.all_reduce(&ok, 1, ReduceDType::I32, ReduceOp::Min);
    throw Error("nccl: rank " + std::to_string(host_comm.rank()) + ": " + error);
  }
  auto make = reinterpret_cast<Comm* (*)(Comm*, int, void*)>(sym);
  return std::unique_ptr<Comm>(make(&host_comm, device, work_stream));
}

}  // namespace glm5::parallel
