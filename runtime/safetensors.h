// Safetensors checkpoints: one `model.safetensors` or shards through `model.safetensors.index.json`.
// Shards are mmapped on first use, so a rank touches only the bytes of the tensors it asks for.
// Every error names the file and the tensor, the expected and the found value.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"

namespace glm5::runtime {

struct TensorInfo {
  std::string name;
  std::string file;  // path of the shard that holds it
  DType dtype = DType::Unknown;
  std::string dtype_name;  // as written in the header (kept for messages about unknown dtypes)
  std::vector<int64_t> shape;
  const void* data = nullptr;  // into the mmapped shard
  size_t nbytes = 0;
  int64_t numel() const;
};

// One mmapped .safetensors file with its parsed header. Validates the header (JSON, offsets inside
// the file, sizes matching dtype x shape) when opened.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  size_t file_size() const { return size_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, TensorInfo> tensors_;
};

// A whole checkpoint directory.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& model_dir);
  ~Checkpoint();
  const std::string& dir() const { return dir_; }
  // Every tensor name the checkpoint declares (from the index, or the single file's header).
  std::vector<std::string> names() const;
  bool has(const std::string& name) const;
  // A plain tensor (norms, biases), checked: it exists, its shape equals `shape`, its dtype is
  // BF16, F16 or F32. Matrices, which may be stored quantized, go through resolve_tensor().
  const TensorInfo& get(const std::string& name, const std::vector<int64_t>& shape);
  // The header entry of a declared tensor (its shard is opened if needed), without the checks of
  // get() and not counted in bytes_loaded(); nullptr when the checkpoint does not declare it.
  const TensorInfo* find(const std::string& name);
  // Drops the pages of a tensor's bytes from this process's memory (they are re-read from the
  // file if touched again): streaming readers (convert) keep their RSS at a few tensors.
  void release(const TensorInfo& t);
  static void release_bytes(const void* data, size_t n);  // the same for part of a tensor
  // Total bytes of the tensors handed out by get() so far.
  size_t bytes_loaded() const { return bytes_loaded_; }

 private:
  SafetensorsFile& shard(const std::string& file);
  std::string dir_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name
  std::map<std::string, std::unique_ptr<SafetensorsFile>> shards_;
  size_t bytes_loaded_ = 0;
};

// Writes a safetensors file (used for --dump-logits, tests and generators). Tensors are written
// in the given order; data must hold numel * dtype_size bytes.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A safetensors file written tensor by tensor (the header, fixed by the list of names, dtypes and
// shapes, goes first), resumable: the data go to `path + ".partial"`, renamed to `path` by
// finish(). Opening a writer over an existing .partial with the same header keeps the tensors
// already complete in it (a partly written last tensor is cut off) and next() says where to go on.
struct TensorHeader {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  size_t nbytes() const;
};
// Size of the file a SafetensorsWriter writes for these tensors.
size_t safetensors_size(const std::vector<TensorHeader>& tensors);
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<TensorHeader> tensors);
  ~SafetensorsWriter();
  size_t next() const { return next_; }  // index of the first tensor still to write
  // Writes tensor next() (exactly its nbytes()); throws naming the file on a short write.
  void write(const void* data, size_t nbytes);
  void finish();                                // all written: fsync, rename to path
  size_t file_bytes() const { return total_; }  // the final file's size

 private:
  std::string path_, partial_;
  std::vector<TensorHeader> tensors_;
  std::vector<size_t> ends_;  // file offset where each tensor ends
  int fd_ = -1;
  size_t next_ = 0, total_ = 0;
};

}  // namespace glm5::runtime
