// model.safetensors.index.json beside one valid shard (runtime/safetensors.h, Checkpoint): the
// index names the shard of every tensor; the checkpoint must refuse what does not hold together.
#include <cstdint>
#include <cstring>
#include <string>

#include "runtime/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

// One shard with two F32 tensors, "a" [2] and "b" [1, 1]: header length, header, 12 bytes.
std::string valid_shard() {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1,1],"data_offsets":[8,12]}})";
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  return bytes + header + std::string(12, '\0');
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  static const std::string dir = [] {
    std::filesystem::create_directories(fuzz::scratch_dir() / "ckpt");
    fuzz::write_scratch("ckpt/model-00001-of-00001.safetensors", valid_shard());
    return (fuzz::scratch_dir() / "ckpt").string();
  }();
  fuzz::write_scratch("ckpt/model.safetensors.index.json", {reinterpret_cast<const char*>(data), size});
  fuzz::expect_clean("Checkpoint", [&] {
    runtime::Checkpoint ck(dir);
    for (const std::string& name : ck.names()) {
      fuzz::require(ck.has(name), "every listed name is there");
      fuzz::expect_clean("Checkpoint::find", [&] {
        const runtime::TensorInfo* t = ck.find(name);
        fuzz::require(t == nullptr || t->name == name, "find returns the tensor asked for");
        // The one shard there is: nothing outside the folder is ever opened.
        fuzz::require(t == nullptr || t->file.rfind(dir, 0) == 0, "shards are inside the checkpoint folder");
      });
      fuzz::expect_clean("Checkpoint::get", [&] { ck.get(name, {2}); });
    }
  });
  return 0;
}
