// A .safetensors file: 8-byte header length, JSON header, tensor bytes (runtime/safetensors.h).
// Every tensor the parser accepts must lie inside the file and hold dtype x shape bytes.
#include <cstdint>
#include <string_view>

#include "runtime/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  const std::string path = fuzz::write_scratch("model.safetensors", {reinterpret_cast<const char*>(data), size});
  fuzz::expect_clean("SafetensorsFile", [&] {
    runtime::SafetensorsFile f(path);
    fuzz::require(f.file_size() == size, "file_size is the file's size");
    for (const auto& [name, t] : f.tensors()) {
      fuzz::require(t.name == name, "a tensor is listed under its own name");
      const auto* first = static_cast<const uint8_t*>(f.find(name)->data);
      fuzz::require(t.nbytes == 0 || first != nullptr, "a tensor with bytes has data");
      if (t.nbytes == 0 || dtype_size(t.dtype) == 0) continue;
      fuzz::require(size_t(t.numel()) * dtype_size(t.dtype) == t.nbytes, "nbytes is numel x dtype size");
      // The bytes are inside the mapping: reading the last one must not fault.
      volatile uint8_t last = first[t.nbytes - 1];
      (void)last;
    }
  });
  return 0;
}
