// Safetensors reader and checkpoint: the tiny-a checkpoint loads through its index; copies of it
// damaged on purpose (truncated or missing shard, corrupt header, misshaped / FP8 / unknown
// tensors) are refused with messages naming the file and the tensor; write_safetensors round-trips.
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kernels/core/check.h"
#include "runtime/config.h"
#include "runtime/name_table.h"
#include "runtime/safetensors.h"
#include "tests/test_support.h"

namespace glm5::runtime {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kTinyA = std::string(GLM5_TEST_DATA) + "/tiny-a";
const std::string kShard1 = "model-00001-of-00002.safetensors";
const std::string kShard2 = "model-00002-of-00002.safetensors";

using glm5::testing::expect_error;
using glm5::testing::slurp;

// A fresh directory under the system temp dir, removed with its contents at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("glm5-test-safetensors-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// A writable copy of tiny-a.
struct TinyACopy : TempDir {
  TinyACopy() {
    for (const auto& e : fs::directory_iterator(kTinyA)) {
      fs::copy_file(e.path(), path / e.path().filename());
      fs::permissions(path / e.path().filename(), fs::perms::owner_write, fs::perm_options::add);
    }
  }
  json index() const {
    std::ifstream in(file("model.safetensors.index.json"));
    return json::parse(in);
  }
  void write_index(const json& j) const { std::ofstream(file("model.safetensors.index.json")) << j.dump(1); }
  std::string shard_of(const std::string& tensor) const { return index()["weight_map"][tensor]; }
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
}

uint64_t header_len(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
  return n;
}

// Rewrites the JSON header of a safetensors file (data bytes unchanged; offsets are relative).
void edit_header(const std::string& path, const std::function<void(json&)>& edit) {
  std::string bytes = read_bytes(path);
  uint64_t n = header_len(bytes);
  json h = json::parse(bytes.substr(8, n));
  edit(h);
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint64_t(text.size()) >> (8 * i));
  write_bytes(path, out + text + bytes.substr(8 + n));
}

TEST(SafetensorsTest, LoadsTinyAThroughIndex) {
  Checkpoint ck(kTinyA);
  EXPECT_EQ(ck.dir(), kTinyA);
  EXPECT_EQ(ck.names().size(), 292u);
  EXPECT_TRUE(ck.has("lm_head.weight"));
  EXPECT_FALSE(ck.has("model.layers.0.mlp.gate.weight"));  // layer 0 is dense
  EXPECT_EQ(ck.bytes_loaded(), 0u);

  const TensorInfo& norm = ck.get("model.norm.weight", {256});
  EXPECT_EQ(norm.dtype, DType::BF16);
  EXPECT_EQ(norm.dtype_name, "BF16");
  EXPECT_EQ(norm.nbytes, 512u);
  EXPECT_EQ(norm.numel(), 256);
  EXPECT_EQ(ck.bytes_loaded(), 512u);
  const auto* w = static_cast<const uint16_t*>(norm.data);
  double sum = 0;
  for (int i = 0; i < 256; ++i) {
    float v = bf16_to_f32(w[i]);
    ASSERT_TRUE(std::isfinite(v));
    sum += std::fabs(v);
  }
  EXPECT_GT(sum, 0.0);

  const TensorInfo& bias = ck.get("model.layers.1.mlp.gate.e_score_correction_bias", {16});
  EXPECT_EQ(bias.dtype, DType::F32);
  EXPECT_EQ(ck.bytes_loaded(), 512u + 64u);
  const TensorInfo& emb = ck.get("model.embed_tokens.weight", {512, 256});
  EXPECT_EQ(emb.nbytes, size_t(512 * 256 * 2));
  EXPECT_NE(emb.file.find("model-0000"), std::string::npos);

  // find(): header entry without checks and without counting.
  const size_t before = ck.bytes_loaded();
  ASSERT_NE(ck.find("lm_head.weight"), nullptr);
  EXPECT_EQ(ck.find("lm_head.weight")->shape, (std::vector<int64_t>{512, 256}));
  EXPECT_EQ(ck.find("no.such.tensor"), nullptr);
  EXPECT_EQ(ck.bytes_loaded(), before);
}

TEST(SafetensorsTest, ShardFilesParse) {
  SafetensorsFile a(kTinyA + "/" + kShard1), b(kTinyA + "/" + kShard2);
  EXPECT_EQ(a.tensors().size() + b.tensors().size(), 292u);
  EXPECT_EQ(a.file_size(), fs::file_size(kTinyA + "/" + kShard1));
  for (const SafetensorsFile* f : {&a, &b})
    for (const auto& [name, t] : f->tensors()) {
      EXPECT_EQ(t.name, name);
      EXPECT_EQ(t.nbytes, size_t(t.numel()) * dtype_size(t.dtype)) << name;
    }
}

TEST(SafetensorsTest, TruncatedShard) {
  TinyACopy d;
  const std::string shard = d.shard_of("lm_head.weight");
  fs::resize_file(d.file(shard), fs::file_size(d.file(shard)) / 2);
  Checkpoint ck(d.str());  // shards are opened lazily: construction still succeeds
  expect_error(
      [&] {
        ck.get("lm_head.weight", {512, 256});
      },
      {shard, "truncated", "while loading tensor 'lm_head.weight'"});
  expect_error([&] { SafetensorsFile f(d.file(shard)); }, {shard, "truncated", "tensor '"});
}

TEST(SafetensorsTest, ShardShorterThanItsHeaderLength) {
  TinyACopy d;
  fs::resize_file(d.file(kShard2), 5);
  // Listed shards are checked at construction: present and at least 8 bytes.
  expect_error([&] { Checkpoint ck(d.str()); }, {kShard2, "truncated", "at least 8", "needed for tensor '"});
  expect_error([&] { SafetensorsFile f(d.file(kShard2)); }, {kShard2, "truncated", "5 bytes"});
}

TEST(SafetensorsTest, GarbageHeaderJson) {
  TinyACopy d;
  std::string bytes = read_bytes(d.file(kShard1));
  bytes.replace(8, 12, "#garbage!{[ ");
  write_bytes(d.file(kShard1), bytes);
  Checkpoint ck(d.str());
  // A tensor in the intact shard still loads; the corrupt one is reported when first used.
  const std::string in2 = SafetensorsFile(d.file(kShard2)).tensors().begin()->first;
  EXPECT_NO_THROW(ck.get(in2, ck.find(in2)->shape));
  const std::string in1 = SafetensorsFile(kTinyA + "/" + kShard1).tensors().begin()->first;
  expect_error([&] { ck.find(in1); }, {kShard1, "not valid JSON", in1});
}

TEST(SafetensorsTest, HeaderLengthBeyondFile) {
  TinyACopy d;
  std::string bytes = read_bytes(d.file(kShard1));
  const uint64_t bogus = bytes.size() + 100;
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char(bogus >> (8 * i));
  write_bytes(d.file(kShard1), bytes);
  expect_error([&] { SafetensorsFile f(d.file(kShard1)); },
               {kShard1, "header length " + std::to_string(bogus), "beyond the end of the file"});
  // An absurd length (would overflow 8 + n) is caught the same way.
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char(0xff);
  write_bytes(d.file(kShard1), bytes);
  expect_error([&] { SafetensorsFile f(d.file(kShard1)); }, {kShard1, "beyond the end of the file"});
}

TEST(SafetensorsTest, MissingShard) {
  TinyACopy d;
  fs::remove(d.file(kShard2));
  // The message names the shard and one tensor that needs it (the first by name).
  std::string needed;
  const json index = d.index();
  for (const auto& [name, file] : index["weight_map"].items())
    if (file == kShard2 && (needed.empty() || name < needed)) needed = name;
  expect_error([&] { Checkpoint ck(d.str()); },
               {"model.safetensors.index.json", kShard2, "is missing", "'" + needed + "'"});
}

TEST(SafetensorsTest, BadIndex) {
  TinyACopy d;
  write_bytes(d.file("model.safetensors.index.json"), "{\"weight_map\": {");
  expect_error([&] { Checkpoint ck(d.str()); }, {"model.safetensors.index.json", "not valid JSON"});
  d.write_index(json{{"metadata", json::object()}});
  expect_error([&] { Checkpoint ck(d.str()); }, {"model.safetensors.index.json", "'weight_map'"});
  d.write_index(json{{"weight_map", {{"lm_head.weight", 3}}}});
  expect_error([&] { Checkpoint ck(d.str()); }, {"model.safetensors.index.json", "lm_head.weight", "shard file name"});
}

// The index names files inside the checkpoint folder: a shard outside it (an absolute path, a
// path through '..', which a hostile download could hold) is refused before anything is opened.
TEST(SafetensorsTest, IndexShardOutsideTheFolderRefused) {
  TinyACopy d;
  for (const std::string& outside : {d.file(kShard2), std::string("../") + kShard2, std::string("sub/../../x")}) {
    d.write_index(json{{"weight_map", {{"lm_head.weight", outside}}}});
    expect_error([&] { Checkpoint ck(d.str()); },
                 {"model.safetensors.index.json", "lm_head.weight", outside, "inside the checkpoint folder"});
  }
}

TEST(SafetensorsTest, NoCheckpointInDirectory) {
  TempDir d;
  expect_error([&] { Checkpoint ck(d.str()); }, {d.str(), "model.safetensors.index.json", "model.safetensors"});
}

TEST(SafetensorsTest, MissingTensor) {
  Checkpoint ck(kTinyA);
  expect_error(
      [&] {
        ck.get("model.layers.0.self_attn.q_proj.weight", {192, 256});
      },
      {kTinyA + ": tensor 'model.layers.0.self_attn.q_proj.weight' not found (expected shape [192, 256])"});
}

TEST(SafetensorsTest, TensorListedInIndexButNotInShard) {
  TinyACopy d;
  const std::string shard = d.shard_of("model.norm.weight");
  edit_header(d.file(shard), [](json& h) { h.erase("model.norm.weight"); });
  Checkpoint ck(d.str());
  expect_error([&] { ck.get("model.norm.weight", {256}); },
               {shard, "'model.norm.weight'", "model.safetensors.index.json", "not in its header"});
}

TEST(SafetensorsTest, MisshapedTensor) {
  TinyACopy d;
  const std::string shard = d.shard_of("model.norm.weight");
  // Same byte count, other shape: the header is consistent, the checkpoint is not.
  edit_header(d.file(shard), [](json& h) { h["model.norm.weight"]["shape"] = {16, 16}; });
  Checkpoint ck(d.str());
  expect_error([&] { ck.get("model.norm.weight", {256}); },
               {"model.norm.weight", shard, "expected shape [256]", "found [16, 16]"});
  ModelConfig cfg = load_config(d.str());
  expect_error([&] { check_checkpoint(ck, cfg); },
               {"model.norm.weight", shard, "expected shape [256]", "found [16, 16]"});
}

TEST(SafetensorsTest, OffsetsNotMatchingDtypeTimesShape) {
  TinyACopy d;
  const std::string shard = d.shard_of("model.norm.weight");
  edit_header(d.file(shard), [](json& h) { h["model.norm.weight"]["shape"] = {128}; });
  expect_error([&] { SafetensorsFile f(d.file(shard)); },
               {shard, "'model.norm.weight'", "BF16 [128] needs 256 bytes", "hold 512"});
  edit_header(d.file(shard), [](json& h) {
    h["model.norm.weight"]["shape"] = {256};
    h["model.norm.weight"]["data_offsets"] = {10, 2};
  });
  expect_error([&] { SafetensorsFile f(d.file(shard)); }, {shard, "'model.norm.weight'", "[10, 2]"});
  edit_header(d.file(shard), [](json& h) { h["model.norm.weight"]["data_offsets"] = "0-512"; });
  expect_error([&] { SafetensorsFile f(d.file(shard)); }, {shard, "'model.norm.weight'", "'data_offsets'"});
  edit_header(d.file(shard), [](json& h) { h["model.norm.weight"]["shape"] = {-256}; });
  expect_error([&] { SafetensorsFile f(d.file(shard)); }, {shard, "'model.norm.weight'", "'shape'"});
}

TEST(SafetensorsTest, Fp8WithoutScalesRefused) {
  TinyACopy d;
  const std::string name = "model.layers.0.self_attn.q_a_proj.weight";  // [64, 256]
  const std::string shard = d.shard_of(name);
  edit_header(d.file(shard), [&](json& h) {
    uint64_t begin = h[name]["data_offsets"][0];
    h[name]["dtype"] = "F8_E4M3";
    h[name]["data_offsets"] = {begin, begin + 64 * 256};
  });
  Checkpoint ck(d.str());
  const std::string where = "tensor " + name + " in " + d.file(shard) + " is F8_E4M3";
  expect_error(
      [&] {
        ck.get(name, {64, 256});
      },
      {where, "where a plain BF16, F16 or F32 tensor [64, 256] is expected"});
  ModelConfig cfg = load_config(d.str());
  expect_error([&] { check_checkpoint(ck, cfg); }, {where, "'" + name + "_scale_inv' are missing"});
}

TEST(SafetensorsTest, OtherDtypesRefused) {
  TinyACopy d;
  const std::string bias = "model.layers.1.mlp.gate.e_score_correction_bias";  // F32 [16]
  const std::string shard = d.shard_of(bias);
  edit_header(d.file(shard), [&](json& h) { h[bias]["dtype"] = "I32"; });
  {
    Checkpoint ck(d.str());
    expect_error([&] { ck.get(bias, {16}); }, {bias, shard, "has dtype I32", "expected BF16, F16 or F32"});
  }
  // A dtype this reader does not know is kept with its name and refused by name.
  edit_header(d.file(shard), [&](json& h) {
    h[bias]["dtype"] = "F64";
    h[bias]["shape"] = {8};
  });
  SafetensorsFile f(d.file(shard));
  ASSERT_NE(f.find(bias), nullptr);
  EXPECT_EQ(f.find(bias)->dtype, DType::Unknown);
  EXPECT_EQ(f.find(bias)->dtype_name, "F64");
  Checkpoint ck(d.str());
  expect_error([&] { ck.get(bias, {8}); }, {bias, shard, "has dtype F64"});
}

TEST(SafetensorsTest, UnknownTensorNameRefusedByCheck) {
  TinyACopy d;
  const std::string extra = "model.layers.2.self_attn.q_proj.weight";
  const std::string shard = d.shard_of("model.norm.weight");
  edit_header(d.file(shard), [&](json& h) { h[extra] = h["model.norm.weight"]; });
  json idx = d.index();
  idx["weight_map"][extra] = shard;
  d.write_index(idx);
  Checkpoint ck(d.str());
  ModelConfig cfg = load_config(d.str());
  expect_error([&] { check_checkpoint(ck, cfg); }, {d.str(), "'" + extra + "'", "1 unknown"});
}

TEST(SafetensorsTest, WriteReadRoundTrip) {
  TempDir d;
  const float f32[6] = {1.5f, -2.0f, 3.25f, 0.0f, 1e-8f, -7.0f};
  const int32_t i32[4] = {0, -1, 2147483647, 42};
  uint16_t bf16[5];
  for (int i = 0; i < 5; ++i) bf16[i] = f32_to_bf16(float(i) - 2.5f);
  const std::string path = d.file("model.safetensors");
  write_safetensors(path,
                    {{"b_logits", DType::F32, {2, 3}, f32},
                     {"a_tokens", DType::I32, {4}, i32},
                     {"c_weights", DType::BF16, {5}, bf16},
                     {"d_empty", DType::F32, {0, 3}, nullptr}},
                    {{"format", "pt"}});

  const std::string bytes = read_bytes(path);
  const uint64_t n = header_len(bytes);
  EXPECT_EQ((8 + n) % 8, 0u);  // data 8-byte aligned
  EXPECT_EQ(bytes.size(), 8 + n + 24 + 16 + 10);
  json h = json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  // Written in the given order, not sorted by name.
  EXPECT_EQ(h["b_logits"]["data_offsets"], json::array({0, 24}));
  EXPECT_EQ(h["a_tokens"]["data_offsets"], json::array({24, 40}));
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 4u);
  const TensorInfo* t = f.find("b_logits");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::F32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(t->data, f32, sizeof f32), 0);
  EXPECT_EQ(std::memcmp(f.find("a_tokens")->data, i32, sizeof i32), 0);
  EXPECT_EQ(std::memcmp(f.find("c_weights")->data, bf16, sizeof bf16), 0);
  EXPECT_EQ(f.find("d_empty")->nbytes, 0u);

  // A directory holding only model.safetensors is a checkpoint.
  Checkpoint ck(d.str());
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"a_tokens", "b_logits", "c_weights", "d_empty"}));
  EXPECT_EQ(ck.get("c_weights", {5}).dtype, DType::BF16);
  expect_error([&] { ck.get("a_tokens", {4}); }, {"a_tokens", "has dtype I32"});
}

TEST(SafetensorsTest, WriteErrors) {
  TempDir d;
  const float x[2] = {1, 2};
  expect_error(
      [&] {
        write_safetensors(d.file("dup.safetensors"), {{"x", DType::F32, {2}, x}, {"x", DType::F32, {2}, x}});
      },
      {"dup.safetensors", "'x'", "twice"});
  expect_error(
      [&] {
        write_safetensors(d.file("no/such/dir/out.safetensors"), {{"x", DType::F32, {2}, x}});
      },
      {"no/such/dir/out.safetensors"});
  EXPECT_FALSE(fs::exists(d.file("dup.safetensors")));
}

// SafetensorsWriter: a writer opened over the .partial of an interrupted one keeps its whole
// tensors (a partial one is cut off), starts over when the header differs, and the finished file
// is the one an unbroken writer makes; the result reads back.
TEST(SafetensorsTest, WriterResumesAfterTheLastWholeTensor) {
  TempDir d;
  const std::vector<TensorHeader> hs{{"a", DType::F32, {4}}, {"b", DType::BF16, {3, 2}}, {"c", DType::I64, {2}}};
  const float a[4] = {1, 2, 3, 4};
  const uint16_t b[6] = {1, 2, 3, 4, 5, 6};
  const int64_t c[2] = {7, 8};
  const void* data[3] = {a, b, c};
  const std::string whole = d.file("whole.safetensors"), cut = d.file("cut.safetensors");
  {
    SafetensorsWriter w(whole, hs);
    for (size_t i = 0; i < hs.size(); ++i) w.write(data[i], hs[i].nbytes());
    w.finish();
  }
  EXPECT_EQ(fs::file_size(whole), safetensors_size(hs));
  {
    SafetensorsWriter w(cut, hs);
    w.write(a, 16);
    w.write(b, 12);
  }                                                                        // killed before c
  fs::resize_file(cut + ".partial", fs::file_size(cut + ".partial") - 5);  // and b half-written
  {
    SafetensorsWriter w(cut, hs);
    EXPECT_EQ(w.next(), 1u);  // a kept, b cut off
    w.write(b, 12);
    w.write(c, 16);
    w.finish();
  }
  EXPECT_FALSE(fs::exists(cut + ".partial"));
  EXPECT_EQ(slurp(cut), slurp(whole));
  SafetensorsFile f(cut);
  int64_t c1 = 0;  // (tensor data need not be 8-byte aligned in the file)
  std::memcpy(&c1, static_cast<const char*>(f.find("c")->data) + 8, 8);
  EXPECT_EQ(c1, 8);
  // Another header over the same .partial: nothing is kept.
  {
    SafetensorsWriter w(cut, hs);
    w.write(a, 16);
  }
  const std::vector<TensorHeader> other{{"a", DType::F32, {2, 2}}, {"b", DType::BF16, {3, 2}}, {"c", DType::I64, {2}}};
  SafetensorsWriter w(cut, other);
  EXPECT_EQ(w.next(), 0u);
  expect_error([&] { w.write(a, 8); }, {"tensor 'a' needs 16 bytes, given 8"});
}

}  // namespace
}  // namespace glm5::runtime
