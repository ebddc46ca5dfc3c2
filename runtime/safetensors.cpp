// Safetensors reading (mmap, header validation, sharded checkpoints) and writing.
// Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end)}, "__metadata__": {str: str}}, then the data; offsets are relative to
// the data start. No dtype conversion here: callers get the raw bytes and the dtype.
#include "runtime/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kernels/core/check.h"

namespace glm5::runtime {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

bool is_uint(const json& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0); }

// One header entry -> TensorInfo; `data_size` is the number of bytes after the header.
TensorInfo parse_entry(const std::string& path, const std::string& name, const json& e, const uint8_t* data,
                       uint64_t data_size) {
  TensorInfo t;
  t.name = name;
  t.file = path;
  CHECK(e.is_object(), path, ": tensor '", name, "': header entry must be an object, found ", e.dump());
  auto dt = e.find("dtype");
  CHECK(dt != e.end() && dt->is_string(), path, ": tensor '", name, "': field 'dtype': expected a string, found ",
        dt == e.end() ? "nothing" : dt->dump());
  t.dtype_name = dt->get<std::string>();
  t.dtype = dtype_from_name(t.dtype_name);

  auto sh = e.find("shape");
  CHECK(sh != e.end() && sh->is_array(), path, ": tensor '", name,
        "': field 'shape': expected a list of non-negative integers, found ", sh == e.end() ? "nothing" : sh->dump());
  // numel with overflow guard: a corrupt header must not wrap around into a small size.
  unsigned __int128 numel = 1;
  for (const json& d : *sh) {
    CHECK(is_uint(d), path, ": tensor '", name, "': field 'shape': expected a list of non-negative integers, found ",
          sh->dump());
    uint64_t v = d.get<uint64_t>();
    CHECK(v <= uint64_t(INT64_MAX), path, ": tensor '", name, "': dimension ", v, " is too large");
    t.shape.push_back(int64_t(v));
    numel *= v;
    if (numel > (unsigned __int128)(UINT64_MAX)) numel = (unsigned __int128)(UINT64_MAX);
  }

  auto off = e.find("data_offsets");
  CHECK(off != e.end() && off->is_array() && off->size() == 2 && is_uint((*off)[0]) && is_uint((*off)[1]), path,
        ": tensor '", name, "': field 'data_offsets': expected [begin, end], found ",
        off == e.end() ? "nothing" : off->dump());
  uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
  CHECK(begin <= end, path, ": tensor '", name, "': data_offsets [", begin, ", ", end, "] end before they begin");
  CHECK(end <= data_size, path, ": tensor '", name, "': data_offsets [", begin, ", ", end,
        "] go beyond the end of the data (", data_size, " bytes after the header): the file is truncated");
  if (t.dtype != DType::Unknown) {
    unsigned __int128 expect = numel * dtype_size(t.dtype);
    CHECK(expect == end - begin, path, ": tensor '", name, "': ", t.dtype_name, " ", shape_str(t.shape), " needs ",
          uint64_t(std::min<unsigned __int128>(expect, UINT64_MAX)), " bytes, but data_offsets [", begin, ", ", end,
          "] hold ", end - begin);
  }
  t.data = data + begin;
  t.nbytes = size_t(end - begin);
  return t;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0, path, ": cannot open safetensors file: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    GLM5_FAIL(path, ": not a regular file");
  }
  size_ = size_t(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    GLM5_FAIL(path, ": truncated safetensors file: ", size_, " bytes, expected at least 8 (the header length)");
  }
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);
  CHECK(m != MAP_FAILED, path, ": mmap of ", size_, " bytes failed: ", std::strerror(map_errno));
  map_ = m;

  // From here on a failure must unmap: the destructor does not run for a throwing constructor.
  try {
    const uint8_t* base = static_cast<const uint8_t*>(map_);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | base[i];
    CHECK(n <= size_ - 8, path, ": safetensors header length ", n, " goes beyond the end of the file (", size_,
          " bytes): truncated or not a safetensors file");
    json header;
    try {
      header = json::parse(base + 8, base + 8 + n);
    } catch (const json::exception& e) {
      GLM5_FAIL(path, ": safetensors header (", n, " bytes) is not valid JSON: ", e.what());
    }
    CHECK(header.is_object(), path, ": safetensors header must be a JSON object, found ", header.type_name());
    const uint8_t* data = base + 8 + n;
    const uint64_t data_size = size_ - 8 - n;
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      tensors_.emplace(it.key(), parse_entry(path, it.key(), it.value(), data, data_size));
    }
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

// ------------------------------------------------------------------------------------------------

namespace {

// A path the index may name: relative, and not climbing out of the checkpoint folder.
bool inside_folder(const std::string& file) {
  const fs::path p(file);
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) return false;
  for (const fs::path& part : p)
    if (part == "..") return false;
  return true;
}

}  // namespace

Checkpoint::Checkpoint(const std::string& model_dir) : dir_(model_dir) {
  const fs::path dir(model_dir), index = dir / kIndexName, single = dir / kSingleName;
  std::error_code ec;
  if (fs::exists(index, ec)) {
    std::ifstream in(index, std::ios::binary);
    CHECK(in.good(), index.string(), ": cannot open");
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      GLM5_FAIL(index.string(), ": not valid JSON: ", e.what());
    }
    auto wm = j.is_object() ? j.find("weight_map") : j.end();
    CHECK(j.is_object() && wm != j.end() && wm->is_object(), index.string(),
          ": field 'weight_map': expected an object {tensor name: shard file}, found ",
          (j.is_object() && wm != j.end()) ? wm->type_name() : "nothing");
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      CHECK(it.value().is_string() && !it.value().get<std::string>().empty(), index.string(), ": weight_map['",
            it.key(), "']: expected a shard file name, found ", it.value().dump());
      const std::string file = it.value().get<std::string>();
      CHECK(inside_folder(file), index.string(), ": weight_map['", it.key(), "']: expected a shard file inside the ",
            "checkpoint folder, found '", file, "' (an absolute path or one through '..')");
      weight_map_[it.key()] = file;
    }
    // Every listed shard must exist now (a missing download should fail before any work starts);
    // they are opened and mapped only when a tensor of theirs is asked for.
    std::map<std::string, std::string> first_tensor;  // shard -> one tensor that needs it
    for (const auto& [name, file] : weight_map_) first_tensor.emplace(file, name);
    for (const auto& [file, name] : first_tensor) {
      const fs::path p = dir / file;
      CHECK(fs::is_regular_file(p, ec), index.string(), ": shard '", file, "' (holding tensor '", name,
            "' and others) is missing: ", p.string(), " does not exist");
      uint64_t size = fs::file_size(p, ec);
      CHECK(!ec && size >= 8, p.string(), ": truncated safetensors shard: ", size,
            " bytes, expected at least 8 (needed for tensor '", name, "')");
    }
  } else if (fs::exists(single, ec)) {
    auto f = std::make_unique<SafetensorsFile>(single.string());
    for (const auto& [name, info] : f->tensors()) weight_map_[name] = kSingleName;
    shards_[kSingleName] = std::move(f);
  } else {
    GLM5_FAIL(model_dir, ": no checkpoint found: neither ", kIndexName, " nor ", kSingleName,
              " exists in this directory");
  }
}

Checkpoint::~Checkpoint() = default;

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(weight_map_.size());
  for (const auto& kv : weight_map_) out.push_back(kv.first);
  return out;
}

bool Checkpoint::has(const std::string& name) const { return weight_map_.count(name) != 0; }

SafetensorsFile& Checkpoint::shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it == shards_.end())
    it = shards_.emplace(file, std::make_unique<SafetensorsFile>((fs::path(dir_) / file).string())).first;
  return *it->second;
}

void Checkpoint::release(const TensorInfo& t) { release_bytes(t.data, t.nbytes); }

void Checkpoint::release_bytes(const void* data, size_t n) {
  if (n == 0) return;
  const long page = ::sysconf(_SC_PAGESIZE);
  uintptr_t b = reinterpret_cast<uintptr_t>(data), e = b + n;
  b = (b + uintptr_t(page) - 1) / uintptr_t(page) * uintptr_t(page);  // whole pages inside the range only
  e = e / uintptr_t(page) * uintptr_t(page);
  if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

const TensorInfo* Checkpoint::find(const std::string& name) {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end()) return nullptr;
  SafetensorsFile* fp = nullptr;
  try {
    fp = &shard(it->second);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (while loading tensor '" + name + "')");
  }
  SafetensorsFile& f = *fp;
  const TensorInfo* t = f.find(name);
  CHECK(t, f.path(), ": tensor '", name, "' is listed in ", kIndexName, " for this shard but is not in its header");
  return t;
}

const TensorInfo& Checkpoint::get(const std::string& name, const std::vector<int64_t>& shape) {
  const TensorInfo* t = find(name);
  CHECK(t, dir_, ": tensor '", name, "' not found (expected shape ", shape_str(shape), ")");
  CHECK(t->dtype != DType::F8_E4M3, "tensor ", name, " in ", t->file,
        " is F8_E4M3 where a plain BF16, F16 or F32 tensor ", shape_str(shape), " is expected");
  CHECK(t->dtype == DType::BF16 || t->dtype == DType::F16 || t->dtype == DType::F32, "tensor ", name, " in ", t->file,
        " has dtype ", t->dtype_name, "; expected BF16, F16 or F32");
  CHECK(t->shape == shape, "tensor ", name, " in ", t->file, ": expected shape ", shape_str(shape), ", found ",
        shape_str(t->shape));
  bytes_loaded_ += t->nbytes;
  return *t;
}

// ------------------------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = header["__metadata__"];
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  std::set<std::string> seen;
  std::vector<size_t> sizes;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    CHECK(!t.name.empty() && t.name != "__metadata__", path, ": invalid tensor name '", t.name, "'");
    CHECK(seen.insert(t.name).second, path, ": tensor '", t.name, "' given twice");
    CHECK(t.dtype != DType::Unknown, path, ": tensor '", t.name, "': unknown dtype");
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      CHECK(d >= 0, path, ": tensor '", t.name, "': negative dimension in shape ", shape_str(t.shape));
      numel *= uint64_t(d);
    }
    size_t nbytes = size_t(numel * dtype_size(t.dtype));
    CHECK(nbytes == 0 || t.data, path, ": tensor '", t.name, "': no data");
    auto& e = header[t.name];
    e["dtype"] = std::string(dtype_name(t.dtype));
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + nbytes};
    offset += nbytes;
    sizes.push_back(nbytes);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  // Written beside the target and renamed, so a failed write never leaves a half file under `path`.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    CHECK(out.good(), path, ": cannot open ", tmp, " for writing: ", std::strerror(errno));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), std::streamsize(text.size()));
    for (size_t i = 0; i < tensors.size(); ++i)
      if (sizes[i]) out.write(static_cast<const char*>(tensors[i].data), std::streamsize(sizes[i]));
    out.flush();
    if (!out.good()) {
      std::error_code ec;
      fs::remove(tmp, ec);
      GLM5_FAIL(path, ": write failed (disk full?)");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    GLM5_FAIL(path, ": cannot rename ", tmp, " to it: ", ec.message());
  }
}

// ------------------------------------------------------------------------------------------------

size_t TensorHeader::nbytes() const {
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  return n * dtype_size(dtype);
}

namespace {

// The 8-byte length and the JSON header (padded so the data start 8-byte aligned).
std::string header_bytes(const std::vector<TensorHeader>& tensors, std::vector<size_t>& ends) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const TensorHeader& t : tensors) {
    CHECK(seen.insert(t.name).second, "tensor '", t.name, "' given twice");
    CHECK(t.dtype != DType::Unknown && t.dtype != DType::Q4 && t.dtype != DType::Q8, "tensor '", t.name,
          "': ", dtype_name(t.dtype), " is not a safetensors dtype");
    auto& e = header[t.name];
    e["dtype"] = std::string(dtype_name(t.dtype));
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + t.nbytes()};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint8_t(uint64_t(text.size()) >> (8 * i)));
  out += text;
  size_t at = out.size();
  for (const TensorHeader& t : tensors) ends.push_back(at += t.nbytes());
  return out;
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    CHECK(w > 0, path, ": write failed: ", std::strerror(w < 0 ? errno : ENOSPC));
    p += w;
    n -= size_t(w);
  }
}

}  // namespace

size_t safetensors_size(const std::vector<TensorHeader>& tensors) {
  std::vector<size_t> ends;
  const std::string head = header_bytes(tensors, ends);
  return ends.empty() ? head.size() : ends.back();
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<TensorHeader> tensors)
    : path_(path), partial_(path + ".partial"), tensors_(std::move(tensors)) {
  const std::string head = header_bytes(tensors_, ends_);
  total_ = ends_.empty() ? head.size() : ends_.back();
  fd_ = ::open(partial_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  CHECK(fd_ >= 0, partial_, ": cannot open for writing: ", std::strerror(errno));
  // Resume only over the same header; keep whole tensors, cut a partial one off.
  struct stat st {};
  ::fstat(fd_, &st);
  size_t keep = 0;
  if (size_t(st.st_size) >= head.size()) {
    std::string old(head.size(), '\0');
    if (::pread(fd_, old.data(), old.size(), 0) == ssize_t(old.size()) && old == head) {
      keep = head.size();
      while (next_ < ends_.size() && ends_[next_] <= size_t(st.st_size)) keep = ends_[next_++];
    }
  }
  if (keep == 0) {
    CHECK(::ftruncate(fd_, 0) == 0, partial_, ": cannot truncate: ", std::strerror(errno));
    write_all(fd_, head.data(), head.size(), partial_);
  } else {
    CHECK(::ftruncate(fd_, off_t(keep)) == 0, partial_, ": cannot truncate: ", std::strerror(errno));
  }
  CHECK(::lseek(fd_, 0, SEEK_END) >= 0, partial_, ": seek failed: ", std::strerror(errno));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::write(const void* data, size_t nbytes) {
  CHECK(next_ < tensors_.size(), path_, ": more tensors written than declared");
  const TensorHeader& t = tensors_[next_];
  CHECK(nbytes == t.nbytes(), path_, ": tensor '", t.name, "' needs ", t.nbytes(), " bytes, given ", nbytes);
  write_all(fd_, data, nbytes, partial_);
  // On disk before the next one: a resume after a crash keeps only tensors that really are there.
  CHECK(::fdatasync(fd_) == 0, partial_, ": fdatasync failed: ", std::strerror(errno));
  ++next_;
}

void SafetensorsWriter::finish() {
  CHECK(next_ == tensors_.size(), path_, ": finish() with ", tensors_.size() - next_, " tensor(s) not written");
  CHECK(::fsync(fd_) == 0, partial_, ": fsync failed: ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  std::error_code ec;
  fs::rename(partial_, path_, ec);
  CHECK(!ec, path_, ": cannot rename ", partial_, " to it: ", ec.message());
  const int dir = ::open(fs::path(path_).parent_path().empty() ? "." : fs::path(path_).parent_path().c_str(),
                         O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {  // the rename itself, on disk
    ::fsync(dir);
    ::close(dir);
  }
}

}  // namespace glm5::runtime
