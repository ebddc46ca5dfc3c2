// Which CUDA device a rank drives: its node-local rank, as an index among the devices the CUDA
// driver shows this process (CUDA_VISIBLE_DEVICES is applied by the driver: indices are relative
// to it). More local ranks than visible devices is an error naming both, never two ranks quietly
// sharing one GPU (the memory plan counts one rank per device); GLM5_CUDA_DEVICE=N picks the
// device outright (a launcher that gives each rank its own CUDA_VISIBLE_DEVICES sets it to 0).
#pragma once

#include <functional>
#include <string>

namespace glm5::launcher {

struct GpuBindingEnv {
  int local_rank = 0;                // this rank's index on its node
  std::string local_rank_from;       // "OMPI_COMM_WORLD_LOCAL_RANK", ..., or "single process"
  int visible_devices = -1;          // devices the driver shows; -1 = unknown (no driver loaded)
  bool cuda_visible_set = false;     // CUDA_VISIBLE_DEVICES is set ...
  std::string cuda_visible_devices;  // ... to this
  std::string device_override;       // GLM5_CUDA_DEVICE, "" when unset
};

// The device index for `env` (pure). With an unknown or zero device count it returns the local
// rank and leaves the CUDA backend to report what it finds. Throws glm5::Error with the local
// rank, where it came from, the visible count and CUDA_VISIBLE_DEVICES when they do not match.
int cuda_device_for(const GpuBindingEnv& env);

// The environment of this process: the local rank from OMPI_COMM_WORLD_LOCAL_RANK,
// MPI_LOCALRANKID (MPICH), SLURM_LOCALID, else (MPI initialised) the rank within
// MPI_COMM_TYPE_SHARED of MPI_COMM_WORLD (collective!), else 0; the device count from the CUDA
// driver (libcuda, loaded only here). `getenv` is replaceable for tests.
GpuBindingEnv read_gpu_binding_env(const std::function<const char*(const char*)>& getenv_fn = nullptr,
                                   bool query_driver = true);

// cuda_device_for(read_gpu_binding_env()): every rank of a job calls it at the same point.
int cuda_device_for_this_rank();

}  // namespace glm5::launcher
