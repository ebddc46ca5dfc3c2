// The CUDA backend and the NCCL communicator live in a plugin, libglm5_cuda.so, that is loaded
// (dlopen) the first time a CUDA backend or NCCL communicator is asked for, so CPU runs of a
// CUDA-enabled build never load cuBLAS, NCCL or the CUDA runtime (about 150 MiB of RSS and
// 0.1 s of start-up per process). Where: $GLM5_CUDA_PLUGIN when set, else the directory of the
// running executable, then the build tree it was built in.
#pragma once

namespace glm5::kernels {

// The address of `name` in the plugin. Throws glm5::Error naming every path tried and the
// loader's message when the plugin cannot be loaded or lacks the symbol.
void* cuda_plugin_symbol(const char* name);

}  // namespace glm5::kernels
