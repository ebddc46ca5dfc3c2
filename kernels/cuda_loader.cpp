// make_cuda_backend / cuda_available of ops.h for builds with CUDA: they load libglm5_cuda.so
// on first use (see cuda_plugin.h) and call its extern "C" entry points (kernels/cuda/plugin.cpp).
#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/core/check.h"
#include "kernels/cuda_plugin.h"
#include "kernels/ops.h"

namespace glm5::kernels {

namespace {

std::string exe_dir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return {};
  std::string path(buf, size_t(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

void* plugin_handle() {
  static std::once_flag once;
  static void* handle = nullptr;
  static std::string error;
  std::call_once(once, [] {
    std::vector<std::string> tried;
    if (const char* env = std::getenv("GLM5_CUDA_PLUGIN"); env && *env) {
      tried.push_back(env);  // asked for: that one or none
    } else {
      if (std::string dir = exe_dir(); !dir.empty()) tried.push_back(dir + "/libglm5_cuda.so");
#ifdef GLM5_CUDA_PLUGIN_BUILD_PATH
      tried.push_back(GLM5_CUDA_PLUGIN_BUILD_PATH);
#endif
    }
    std::string why;
    for (const std::string& path : tried) {
      if (::access(path.c_str(), F_OK) != 0) {
        why += (why.empty() ? " " : "; ") + path + ": no such file";
        continue;
      }
      handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle) return;
      why += (why.empty() ? " " : "; ") + path + ": " + ::dlerror();
    }
    error =
        "the CUDA backend plugin libglm5_cuda.so could not be loaded (set GLM5_CUDA_PLUGIN "
        "to its path); tried" +
        why;
  });
  if (!handle) GLM5_FAIL(error);
  return handle;
}

}  // namespace

void* cuda_plugin_symbol(const char* name) {
  void* handle = plugin_handle();
  ::dlerror();
  void* sym = ::dlsym(handle, name);
  CHECK(sym, "the CUDA backend plugin has no symbol ", name, " (", ::dlerror(),
        "): it comes from another build of glm5");
  return sym;
}

std::unique_ptr<Backend> make_cuda_backend(int device, Precision precision) {
  auto make = reinterpret_cast<Backend* (*)(int, int)>(cuda_plugin_symbol("glm5_cuda_make_backend_p"));
  return std::unique_ptr<Backend>(make(device, precision == Precision::kFast ? 1 : 0));
}

bool cuda_available() {
  try {
    auto available = reinterpret_cast<bool (*)()>(cuda_plugin_symbol("glm5_cuda_available"));
    return available();
  } catch (const Error&) {
    return false;  // no plugin: no CUDA
  }
}

}  // namespace glm5::kernels
