// GPU binding of a rank (gpu_binding.h): node-local rank -> CUDA device index.
#include "launcher/cluster/gpu_binding.h"

#include <dlfcn.h>
#include <mpi.h>

#include <cstdlib>

#include "kernels/core/check.h"

namespace glm5::launcher {

namespace {

// A non-negative integer, or -1 when `s` is not one.
int parse_index(const std::string& s) {
  if (s.empty() || s.size() > 9) return -1;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

std::string visible_text(const GpuBindingEnv& env) {
  return env.cuda_visible_set ? "CUDA_VISIBLE_DEVICES=" + env.cuda_visible_devices : "CUDA_VISIBLE_DEVICES unset";
}

// Devices the CUDA driver shows this process (it applies CUDA_VISIBLE_DEVICES), -1 when no
// driver can be loaded or asked. Loads libcuda only; the runtime libraries stay in the plugin.
int driver_device_count() {
  void* h = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return -1;
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  auto init = reinterpret_cast<Init>(::dlsym(h, "cuInit"));
  auto count = reinterpret_cast<Count>(::dlsym(h, "cuDeviceGetCount"));
  if (!init || !count) return -1;
  const int rc = init(0);
  if (rc == 100) return 0;  // CUDA_ERROR_NO_DEVICE
  int n = 0;
  if (rc != 0 || count(&n) != 0) return -1;
  return n;
}

}  // namespace

int cuda_device_for(const GpuBindingEnv& env) {
  if (!env.device_override.empty()) {
    const int d = parse_index(env.device_override);
    CHECK(d >= 0, "GLM5_CUDA_DEVICE: expected a device index (0, 1, ...), found '", env.device_override, "'");
    CHECK(env.visible_devices <= 0 || d < env.visible_devices, "GLM5_CUDA_DEVICE=", d, ", but the CUDA driver shows ",
          env.visible_devices, " device(s) (", visible_text(env), "; indices are relative to it)");
    return d;
  }
  if (env.visible_devices <= 0 || env.local_rank < env.visible_devices) return env.local_rank;
  GLM5_FAIL("backend cuda: local rank ", env.local_rank, " (", env.local_rank_from,
            ") has no GPU of its own: the "
            "CUDA driver shows ",
            env.visible_devices, " device(s) on this node (", visible_text(env),
            "; device indices are relative to it); run at most ", env.visible_devices,
            " rank(s) per node, one per GPU, or set GLM5_CUDA_DEVICE to choose a device (e.g. 0 when the "
            "launcher gives every rank its own CUDA_VISIBLE_DEVICES)");
}

GpuBindingEnv read_gpu_binding_env(const std::function<const char*(const char*)>& getenv_fn, bool query_driver) {
  auto get = [&](const char* name) -> const char* { return getenv_fn ? getenv_fn(name) : std::getenv(name); };
  GpuBindingEnv env;
  env.local_rank_from = "single process";
  bool found = false;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* v = get(name);
    if (!v) continue;
    const int r = parse_index(v);
    CHECK(r >= 0, name, ": expected a non-negative local rank, found '", v, "'");
    env.local_rank = r;
    env.local_rank_from = name;
    found = true;
    break;
  }
  if (!found) {
    int init = 0, fin = 0, size = 1;
    MPI_Initialized(&init);
    if (init) MPI_Finalized(&fin);
    if (init && !fin) MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (init && !fin && size > 1) {  // ranks sharing this node's memory
      MPI_Comm local;
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
      MPI_Comm_rank(local, &env.local_rank);
      MPI_Comm_free(&local);
      env.local_rank_from = "rank in MPI_COMM_TYPE_SHARED";
    }
  }
  if (const char* v = get("CUDA_VISIBLE_DEVICES")) {
    env.cuda_visible_set = true;
    env.cuda_visible_devices = v;
  }
  if (const char* v = get("GLM5_CUDA_DEVICE")) env.device_override = v;
  if (query_driver) env.visible_devices = driver_device_count();
  return env;
}

int cuda_device_for_this_rank() { return cuda_device_for(read_gpu_binding_env()); }

}  // namespace glm5::launcher
