// `glm5 convert`: a checkpoint rewritten in another storage format, tensor by tensor.
//
// 1. Plan: every input tensor (the schema's, the MTP layers' by the same schema, then the rest)
//    becomes an Item: copied as stored, or dequantized and written as plain BF16/F32, FP8 blocks or
//    int4/int8 groups (runtime/quant_plan.h decides which). Items are grouped into output shards: by
//    size, or with --cluster by the rank that loads them (a stage's common tensors, each rank's
//    experts), so a rank maps only its own files. The plan, and so every output byte, depends only
//    on the input and the flags; it is recorded in the output (.glm5-convert.json).
// 2. Write: shard by shard through SafetensorsWriter (resumable: a rerun skips finished shards
//    and goes on after the last whole tensor of an interrupted one). Copies go straight from the
//    mmap; converted matrices go 128 rows at a time; input pages are dropped as they are used, so
//    the peak RSS is about one tensor whatever the checkpoint's size.
// 3. Finish: config.json (with the quantization_config of what the output holds), the other files
//    of the model directory, the index last (it marks the output complete), then the loader's own
//    checks on the output.
#include "launcher/convert/convert.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kernels/core/check.h"
#include "kernels/core/quant.h"
#include "launcher/cluster/cluster_config.h"
#include "runtime/name_table.h"
#include "runtime/quant_plan.h"
#include "runtime/quantize.h"
#include "runtime/safetensors.h"

namespace glm5::launcher {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using runtime::Checkpoint;
using runtime::StoredTensor;
using runtime::TensorHeader;
using runtime::TensorSpec;

namespace {

constexpr const char* kPlanFile = ".glm5-convert.json";

// One input tensor and what becomes of it.
struct Item {
  TensorSpec spec;
  StoredTensor in;
  DType out = DType::Unknown;  // Unknown: copy every stored part unchanged
  std::vector<TensorHeader> outputs;
  std::string group;  // output file set ("" or "s01-common", "s01-rank03")
};

std::vector<TensorHeader> stored_parts(const StoredTensor& st, const TensorSpec& spec) {
  std::vector<TensorHeader> h{{st.data->name, st.data->dtype, st.data->shape}};
  if (st.scale) h.push_back({st.scale->name, st.scale->dtype, st.scale->shape});
  if (st.dtype == DType::Q4 || st.dtype == DType::Q8)
    h.push_back({runtime::packed_name(spec.name, "shape"), DType::I64, {2}});
  return h;
}

// The outputs of a matrix written as `out` (plan target), named after spec.name = X.weight.
std::vector<TensorHeader> converted_parts(const TensorSpec& s, DType out, int64_t group, DType scale_dtype) {
  const int64_t rows = s.shape[0], cols = s.shape[1];
  switch (out) {
    case DType::Q4:
    case DType::Q8: {
      const int64_t per = out == DType::Q4 ? 8 : 4;
      return {{runtime::packed_name(s.name, "packed"), DType::I32, {rows, (cols + per - 1) / per}},
              {runtime::packed_name(s.name, "scale"), scale_dtype, {rows, cols / group}},
              {runtime::packed_name(s.name, "shape"), DType::I64, {2}}};
    }
    case DType::F8_E4M3: {
      const int64_t b = quant::kFp8Block;
      return {{s.name, DType::F8_E4M3, {rows, cols}},
              {runtime::fp8_scale_name(s.name), DType::F32, {(rows + b - 1) / b, (cols + b - 1) / b}}};
    }
    default: return {{s.name, out, s.shape}};
  }
}

// Decides an item's output: convert when the plan says so and the stored form differs.
void decide(Item& it, const runtime::QuantPlan& plan, bool in_schema) {
  const StoredTensor& st = it.in;
  // Outside the schema (an MTP layer's copy of lm_head) only the plain targets apply (every matrix).
  bool convert = in_schema ? plan.converts(it.spec) : !plan.quantized_target();
  if (convert && plan.stored_as_target(st.dtype, st.group, st.scale ? st.scale->dtype : DType::Unknown))
    convert = false;  // already stored that way
  if (convert && it.spec.shape.size() == 2) {
    it.out = plan.target;
    it.outputs = converted_parts(it.spec, plan.target, plan.group_size, plan.scale_dtype);
  } else {
    it.outputs = stored_parts(st, it.spec);
  }
}

// Tensors outside the schema (in MTP layers): a matrix X.weight with its stored parts, or a plain tensor.
std::vector<TensorSpec> extra_specs(Checkpoint& ckpt, const std::set<std::string>& taken) {
  std::vector<TensorSpec> out;
  auto ends_with = [](const std::string& s, const std::string& suf) {
    return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
  };
  for (const std::string& name : ckpt.names()) {
    if (taken.count(name) || ends_with(name, "_scale_inv") || ends_with(name, ".weight_scale") ||
        ends_with(name, ".weight_shape"))
      continue;
    if (ends_with(name, ".weight_packed")) {
      const std::string base = name.substr(0, name.size() - 7);  // X.weight
      const runtime::TensorInfo* sh = ckpt.find(runtime::packed_name(base, "shape"));
      const std::vector<int64_t> d = sh ? runtime::stored_shape(*sh) : std::vector<int64_t>();
      CHECK(d.size() == 2, ckpt.dir(), ": tensor '", name, "' needs an I64 (or I32) [2] ",
            runtime::packed_name(base, "shape"), " beside it, found ",
            sh ? sh->dtype_name + " " + std::to_string(sh->numel()) + " element(s)" : std::string("none"));
      out.push_back({base, d});
      continue;
    }
    out.push_back({name, ckpt.find(name)->shape});
  }
  return out;
}

// The output file set of a tensor under a cluster layout (empty layout: one set).
std::string file_group(const TensorSpec& s, const runtime::ModelConfig& cfg, const ClusterConfig* cc,
                       const std::vector<parallel::LayerRange>& stages) {
  if (!cc) return "";
  int stage = s.layer < 0 ? (s.role == runtime::Role::Embedding ? 0 : cc->stages - 1) : cc->stages - 1;
  for (int i = 0; i < int(stages.size()); ++i)
    if (s.layer >= stages[size_t(i)].first && s.layer < stages[size_t(i)].last) stage = i;
  char buf[64];
  if (s.expert >= 0) {
    const int64_t per = cfg.n_routed_experts / cc->expert_parallel;
    const int rank = stage * cc->expert_parallel + int(s.expert / per);
    std::snprintf(buf, sizeof buf, "s%02d-rank%03d", stage, rank);
  } else {
    std::snprintf(buf, sizeof buf, "s%02d-common", stage);
  }
  return buf;
}

struct Shard {
  std::string file;
  std::vector<size_t> items;
  size_t bytes = 0;
};

// Items cut into shards of at most `limit` bytes (a bigger tensor gets a shard of its own), per group.
std::vector<Shard> make_shards(const std::vector<Item>& items, size_t limit) {
  std::map<std::string, std::vector<std::vector<size_t>>> by_group;
  std::map<std::string, size_t> fill;
  std::vector<std::string> order;
  for (size_t i = 0; i < items.size(); ++i) {
    size_t b = 0;
    for (const TensorHeader& h : items[i].outputs) b += h.nbytes();
    auto& g = by_group[items[i].group];
    if (g.empty()) order.push_back(items[i].group);
    if (g.empty() || (fill[items[i].group] + b > limit && fill[items[i].group] > 0)) {
      g.emplace_back();
      fill[items[i].group] = 0;
    }
    g.back().push_back(i);
    fill[items[i].group] += b;
  }
  std::vector<Shard> shards;
  for (const std::string& name : order) {
    const auto& g = by_group[name];
    for (size_t k = 0; k < g.size(); ++k) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "model-%s%s%05zu-of-%05zu.safetensors", name.c_str(), name.empty() ? "" : "-",
                    k + 1, g.size());
      Shard sh{buf, g[k], 0};
      for (size_t i : g[k])
        for (const TensorHeader& h : items[i].outputs) sh.bytes += h.nbytes();
      shards.push_back(std::move(sh));
    }
  }
  return shards;
}

// Rows of a converted matrix at a time, so only the output and one block of float32 rows are held
// (128 rows: FP8's scale blocks); the input rows' pages are dropped as soon as they are used.
constexpr int64_t kBlockRows = quant::kFp8Block;

// The bytes of an item's outputs, in order: views of the mmapped input for copies, owned buffers
// for what is computed.
struct Part {
  std::vector<uint8_t> own;
  std::vector<float> values;  // --quant f32: the dequantized values themselves
  const void* data = nullptr;
  size_t size = 0;
};

std::vector<Part> produce(const Item& it) {
  std::vector<Part> out(it.outputs.size());
  auto own = [&](size_t i) -> uint8_t* {
    out[i].own.resize(it.outputs[i].nbytes());
    out[i].data = out[i].own.data();
    out[i].size = out[i].own.size();
    return out[i].own.data();
  };
  if (it.out == DType::Unknown) {  // copy as stored
    out[0].data = it.in.data->data;
    out[0].size = it.in.data->nbytes;
    if (it.in.scale) {
      out[1].data = it.in.scale->data;
      out[1].size = it.in.scale->nbytes;
    }
  } else {
    const int64_t rows = it.spec.shape[0], cols = it.spec.shape[1];
    const kernels::Weight w = runtime::weight_view(it.in, rows, cols);
    uint8_t* o0 = it.out == DType::F32 ? nullptr : own(0);
    uint8_t* o1 = it.outputs.size() > 1 && it.out != DType::F32 ? own(1) : nullptr;
    if (it.out == DType::F32) {
      out[0].values.resize(size_t(rows * cols));
      out[0].data = out[0].values.data();
      out[0].size = out[0].values.size() * 4;
    }
    std::vector<float> block(size_t(std::min(rows, kBlockRows) * cols));
    const size_t in_row = quant::row_bytes(w.dtype, w.ld);
    for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
      const int64_t n = std::min(kBlockRows, rows - r0);
      float* f = it.out == DType::F32 ? out[0].values.data() + r0 * cols : block.data();
      kernels::weight_rows(w, r0, n, f, w.cols);
      Checkpoint::release_bytes(static_cast<const uint8_t*>(w.data) + size_t(r0) * in_row, size_t(n) * in_row);
      switch (it.out) {
        case DType::Q4:
        case DType::Q8: {
          const int64_t words = it.outputs[0].shape[1], groups = it.outputs[1].shape[1];
          const DType sd = it.outputs[1].dtype;
          runtime::quantize_int_group(f, n, cols, quant::bits(it.out), cols / groups,
                                      reinterpret_cast<int32_t*>(o0) + r0 * words, sd,
                                      o1 + size_t(r0 * groups) * dtype_size(sd));
          break;
        }
        case DType::F8_E4M3:  // r0 is a multiple of 128: whole scale rows
          runtime::quantize_fp8_block(f, n, cols, o0 + r0 * cols,
                                      reinterpret_cast<float*>(o1) + (r0 / kBlockRows) * it.outputs[1].shape[1]);
          break;
        case DType::BF16: {
          uint16_t* o = reinterpret_cast<uint16_t*>(o0) + r0 * cols;
          for (int64_t i = 0; i < n * cols; ++i) o[i] = f32_to_bf16(f[i]);
          break;
        }
        default: break;  // F32: dequantized in place
      }
    }
  }
  const DType form = it.out == DType::Unknown ? it.in.dtype : it.out;
  if (form == DType::Q4 || form == DType::Q8) {  // X.weight_shape
    const int64_t shape[2] = {it.spec.shape[0], it.spec.shape[1]};
    std::memcpy(own(out.size() - 1), shape, 16);
  }
  return out;
}

// quantization_config for the output's config.json (null: none). It describes the output's
// pack-quantized tensors when there are any (compressed-tensors; FP8 tensors kept beside them are
// found by glm5 from their `_scale_inv` names), else its FP8 ones. Such a mixed output (FP8 input,
// --quant int4 of the experts) loads in glm5; other engines want one format (convert from BF16).
json quantization_config(const std::vector<Item>& items) {
  const Item* first_int = nullptr;
  bool fp8 = false;
  std::vector<std::string> not_int, not_fp8;  // Linear modules (names without ".weight")
  for (const Item& it : items) {
    const DType form = it.out == DType::Unknown ? it.in.dtype : it.out;
    const bool linear = it.spec.shape.size() == 2 && it.spec.role != runtime::Role::Embedding &&
                        it.spec.name.size() > 7 && it.spec.name.compare(it.spec.name.size() - 7, 7, ".weight") == 0;
    if ((form == DType::Q4 || form == DType::Q8) && !first_int) first_int = &it;
    fp8 = fp8 || form == DType::F8_E4M3;
    if (!linear) continue;
    const std::string module = it.spec.name.substr(0, it.spec.name.size() - 7);
    if (form != DType::Q4 && form != DType::Q8) not_int.push_back(module);
    if (form != DType::F8_E4M3) not_fp8.push_back(module);
  }
  if (first_int) {
    const DType form = first_int->out == DType::Unknown ? first_int->in.dtype : first_int->out;
    const int64_t group = first_int->out == DType::Unknown ? first_int->in.group
                                                           : first_int->spec.shape[1] / first_int->outputs[1].shape[1];
    json weights = {{"num_bits", quant::bits(form)}, {"type", "int"},    {"symmetric", true},   {"strategy", "group"},
                    {"group_size", group},           {"dynamic", false}, {"actorder", nullptr}, {"observer", "minmax"}};
    return {{"quant_method", "compressed-tensors"},
            {"format", "pack-quantized"},
            {"quantization_status", "compressed"},
            {"config_groups",
             {{"group_0",
               {{"targets", {"Linear"}},
                {"weights", weights},
                {"input_activations", nullptr},
                {"format", "pack-quantized"}}}}},
            {"ignore", not_int}};
  }
  if (fp8)
    return {{"quant_method", "fp8"},
            {"fmt", "e4m3"},
            {"activation_scheme", "dynamic"},
            {"weight_block_size", {128, 128}},
            {"modules_to_not_convert", not_fp8}};
  return nullptr;
}

void write_text(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    CHECK(out.good(), tmp.string(), ": write failed (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  CHECK(!ec, path.string(), ": cannot rename ", tmp.string(), " to it: ", ec.message());
}

// A progress line on stderr, at most twice a second (every 10 % when stderr is not a terminal).
struct Progress {
  bool on;
  size_t total, done = 0, skipped = 0;  // skipped: finished by an earlier run (not in the rate)
  int last_decile = -1;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now(), shown = start;
  void add(size_t bytes, const std::string& what) {
    done += bytes;
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - start).count();
    const int decile = total ? int(10 * done / total) : 10;
    const bool tty = ::isatty(2);
    if (tty ? std::chrono::duration<double>(now - shown).count() < 0.5 && done < total : decile == last_decile) return;
    shown = now;
    last_decile = decile;
    const double frac = total ? double(done) / double(total) : 1.0;
    char bar[21];
    for (int i = 0; i < 20; ++i) bar[i] = i < int(frac * 20) ? '#' : '.';
    bar[20] = 0;
    std::fprintf(stderr, "%s[convert] [%s] %5.1f%% %.2f / %.2f GB  %.0f MB/s  ETA %.0fs  %s%s", tty ? "\r" : "", bar,
                 100 * frac, double(done) / 1e9, double(total) / 1e9, s > 0 ? double(done - skipped) / 1e6 / s : 0.0,
                 done > skipped ? s * double(total - done) / double(done - skipped) : 0.0, what.substr(0, 48).c_str(),
                 tty ? "\033[K" : "\n");
    if (tty && done >= total) std::fputc('\n', stderr);
  }
};

// 1. The plan: the schema's tensors, then the MTP layers' the checkpoint holds, then whatever else
// it holds (copies of the embedding or lm_head in MTP layers, as DeepSeek's). cc: the layout whose
// ranks get file sets, or null.
std::vector<Item> plan_items(Checkpoint& ckpt, const runtime::ModelConfig& cfg, const runtime::QuantPlan& plan,
                             const ClusterConfig* cc, const std::vector<parallel::LayerRange>& stages) {
  std::vector<Item> items;
  std::set<std::string> taken;
  auto add = [&](const TensorSpec& s, bool in_schema) {
    Item it;
    it.spec = s;
    it.in = runtime::resolve_tensor(ckpt, s);
    decide(it, plan, in_schema);
    it.group = file_group(s, cfg, cc, stages);
    for (const TensorHeader& h : stored_parts(it.in, s)) taken.insert(h.name);
    items.push_back(std::move(it));
  };
  for (const TensorSpec& s : runtime::tensor_table(cfg)) add(s, true);
  for (const TensorSpec& s : runtime::mtp_tensors_held(ckpt, cfg)) add(s, true);
  for (TensorSpec s : extra_specs(ckpt, taken)) {
    s.layer = int(cfg.num_hidden_layers);  // with the last stage
    add(s, false);
  }
  return items;
}

// The plan's identity (a rerun over the same --out must be the same conversion): the input's
// files and sizes and each tensor's stored dtype (a re-downloaded or edited source under the same
// path is another input), with the flags that shape the output.
json plan_identity(const ConvertArgs& a, const runtime::QuantPlan& plan, const ClusterConfig* cc,
                   const std::vector<Item>& items, const std::vector<Shard>& shards) {
  json inputs = json::object();
  for (const auto& e : fs::directory_iterator(a.model))
    if (e.is_regular_file() && (e.path().extension() == ".safetensors" || e.path().filename() == "config.json"))
      inputs[e.path().filename().string()] = e.file_size();
  json ident = {
      {"format", 1},
      {"source", fs::absolute(a.model).lexically_normal().string()},
      {"inputs", inputs},
      {"plan", runtime::describe(plan)},
      {"shard_size_mb", a.shard_size_mb},
      {"cluster", cc ? json{{"stages", cc->stages}, {"expert_parallel", cc->expert_parallel}} : json(nullptr)},
      {"files", json::array()}};
  for (const Shard& sh : shards) {
    json f = {{"file", sh.file}, {"bytes", sh.bytes}, {"tensors", json::array()}};
    for (size_t i : sh.items)
      for (const TensorHeader& h : items[i].outputs)
        f["tensors"].push_back(h.name + ":" + std::string(dtype_name(h.dtype)) + " from " +
                               std::string(dtype_name(items[i].in.dtype)));
    ident["files"].push_back(f);
  }
  return ident;
}

// Claims the output folder: created, locked against a second conversion into it (the lock is held
// until the process ends), and either new or an interrupted run of this same plan.
void claim_output(const ConvertArgs& a, const fs::path& out, const json& ident) {
  std::error_code ec;
  fs::create_directories(out, ec);
  CHECK(!ec, a.out, ": cannot create the output directory: ", ec.message());
  CHECK(fs::absolute(out).lexically_normal() != fs::absolute(a.model).lexically_normal(), a.out,
        ": the output directory must differ from --model");
  const fs::path plan_path = out / kPlanFile;
  // One conversion at a time into a folder (two would cut each other's partial files).
  const int lock = ::open((out / ".glm5-convert.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  CHECK(lock >= 0 && ::flock(lock, LOCK_EX | LOCK_NB) == 0, a.out,
        ": another glm5 convert is writing into this folder (run one conversion per --out)");
  if (fs::exists(plan_path)) {
    std::ifstream in(plan_path);
    std::stringstream old;
    old << in.rdbuf();
    CHECK(old.str() == ident.dump(1), a.out, " holds a conversion with other settings or another source (", kPlanFile,
          " differs); remove the directory or choose another --out");
  } else {
    for (const auto& e : fs::directory_iterator(out)) {
      const std::string n = e.path().filename().string();
      if (n == ".glm5-convert.lock" || n == std::string(kPlanFile) + ".tmp") continue;  // ours
      CHECK(false, a.out, ": not empty and not an interrupted conversion (found ", n,
            "); choose an empty or new --out");
    }
    write_text(plan_path, ident.dump(1));
  }
}

// 2. The shards, each written whole unless an earlier run finished it. Returns the total size of
// the files; weight_map gets every output tensor's file.
size_t write_shards(Checkpoint& ckpt, const std::vector<Item>& items, const std::vector<Shard>& shards,
                    const fs::path& out, Progress& progress, std::map<std::string, std::string>& weight_map) {
  size_t total_size = 0;
  for (const Shard& sh : shards) {
    std::vector<TensorHeader> headers;
    for (size_t i : sh.items) headers.insert(headers.end(), items[i].outputs.begin(), items[i].outputs.end());
    for (const TensorHeader& h : headers) weight_map[h.name] = sh.file;
    const fs::path path = out / sh.file;
    const size_t file_bytes = runtime::safetensors_size(headers);
    total_size += file_bytes;
    if (fs::exists(path) && fs::file_size(path) == file_bytes) {  // finished in an earlier run
      for (size_t i : sh.items) {
        progress.skipped += items[i].in.nbytes();
        progress.add(items[i].in.nbytes(), items[i].spec.name);
      }
      continue;
    }
    runtime::SafetensorsWriter w(path.string(), headers);
    size_t at = 0;  // index of the item's first output among the shard's headers
    for (size_t i : sh.items) {
      const Item& it = items[i];
      const size_t n = it.outputs.size();
      if (at + n > w.next()) {
        const auto parts = produce(it);
        for (size_t k = 0; k < n; ++k)
          if (at + k >= w.next()) w.write(parts[k].data, parts[k].size);
      }
      ckpt.release(*it.in.data);
      if (it.in.scale) ckpt.release(*it.in.scale);
      progress.add(it.in.nbytes(), it.spec.name);
      at += n;
    }
    w.finish();
  }

  return total_size;
}

// 3. The config (with the quantization_config of what was written), the model's other files, and
// the index last: its presence says the conversion is complete.
void write_metadata(const ConvertArgs& a, const fs::path& out, const std::vector<Item>& items,
                    const runtime::QuantPlan& plan, const std::map<std::string, std::string>& weight_map,
                    size_t total_size) {
  std::error_code ec;
  {
    std::ifstream in(fs::path(a.model) / "config.json");
    json conf = json::parse(in);
    const json q = quantization_config(items);
    conf.erase("quantization_config");
    if (!q.is_null())
      conf["quantization_config"] = q;
    else
      conf[conf.contains("dtype") ? "dtype" : "torch_dtype"] = plan.target == DType::F32 ? "float32" : "bfloat16";
    write_text(out / "config.json", conf.dump(2) + "\n");
  }
  for (const auto& e : fs::directory_iterator(a.model)) {
    const std::string n = e.path().filename().string();
    if (!e.is_regular_file() || n == "config.json" || n == "model.safetensors.index.json" ||
        e.path().extension() == ".safetensors" || n[0] == '.' || n.rfind("golden", 0) == 0)
      continue;
    fs::copy_file(e.path(), out / n, fs::copy_options::overwrite_existing, ec);
    CHECK(!ec, (out / n).string(), ": cannot copy from ", e.path().string(), ": ", ec.message());
  }
  json index = {{"metadata", {{"total_size", total_size}, {"glm5_convert", runtime::describe(plan)}}},
                {"weight_map", weight_map}};
  write_text(out / "model.safetensors.index.json", index.dump(2));
}

void print_summary(const ConvertArgs& a, const std::vector<Item>& items, const runtime::QuantPlan& plan, size_t files,
                   size_t total, size_t total_size) {
  size_t converted = 0, indivisible = 0;
  for (const Item& it : items) {
    converted += it.out != DType::Unknown;
    indivisible += (plan.target == DType::Q4 || plan.target == DType::Q8) && it.out == DType::Unknown &&
                   it.spec.shape.size() == 2 && it.spec.shape[1] % plan.group_size != 0 &&
                   std::find(plan.roles.begin(), plan.roles.end(), it.spec.role) != plan.roles.end();
  }
  if (indivisible)
    std::fprintf(stderr,
                 "[convert] %zu matrices of the quantized roles kept as stored: their column count is not a "
                 "multiple of --group-size %lld\n",
                 indivisible, (long long)plan.group_size);
  std::fprintf(stderr, "[convert] %s: %zu of %zu tensors converted (%s), %zu file(s), %.3f GB -> %.3f GB\n",
               a.out.c_str(), converted, items.size(), runtime::describe(plan).c_str(), files, double(total) / 1e9,
               double(total_size) / 1e9);
}

}  // namespace

int run_convert(const ConvertArgs& a) {
  const runtime::QuantPlan plan = runtime::parse_quant_plan(a.quant, a.group_size, a.quantize, a.scale_dtype);
  const runtime::ModelConfig cfg = runtime::load_config(a.model);
  Checkpoint ckpt(a.model);
  runtime::check_checkpoint(ckpt, cfg);
  std::unique_ptr<ClusterConfig> cc;
  std::vector<parallel::LayerRange> stages;
  if (!a.cluster.empty()) {
    cc = std::make_unique<ClusterConfig>(load_cluster_config(a.cluster));
    stages = plan_stages(*cc, cfg, cc->world_size());
    CHECK(cfg.n_routed_experts % cc->expert_parallel == 0, a.cluster, ": expert_parallel ", cc->expert_parallel,
          " does not divide n_routed_experts = ", cfg.n_routed_experts);
  }
  const std::vector<Item> items = plan_items(ckpt, cfg, plan, cc.get(), stages);
  const size_t shard_limit = size_t(std::max<int64_t>(1, a.shard_size_mb)) << 20;
  const std::vector<Shard> shards = make_shards(items, shard_limit);
  const fs::path out(a.out);
  claim_output(a, out, plan_identity(a, plan, cc.get(), items, shards));
  size_t total = 0;
  for (const Item& it : items) total += it.in.nbytes();
  Progress progress{a.progress, total};
  std::map<std::string, std::string> weight_map;
  const size_t total_size = write_shards(ckpt, items, shards, out, progress, weight_map);
  write_metadata(a, out, items, plan, weight_map, total_size);
  Checkpoint result(a.out);  // the loader's checks on the result
  runtime::check_checkpoint(result, runtime::load_config(a.out));
  print_summary(a, items, plan, shards.size(), total, total_size);
  return 0;
}

}  // namespace glm5::launcher
