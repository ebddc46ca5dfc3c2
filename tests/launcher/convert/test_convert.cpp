// `glm5 convert` end to end with the real binary: int4 / int8 / FP8 outputs load and run bitwise
// like their own float32 dequantization; our int4 bytes are compressed-tensors' bytes; a
// checkpoint written by compressed-tensors and one in the GLM-5-FP8 layout (written by torch, not
// by us) load and match their dequantized runs, on one process and on 2 x 2 ranks; an interrupted
// conversion resumes to identical bytes; --cluster writes one file set per rank; bad flags and
// output folders get one clear message.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "runtime/name_table.h"
#include "runtime/safetensors.h"
#include "tests/test_support.h"

namespace {

namespace fs = std::filesystem;
using glm5::runtime::Checkpoint;
using glm5::testing::contains;
using glm5::testing::slurp;

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
const glm5::testing::ScratchDir scratch("glm5_convert");

glm5::testing::Proc run(const std::string& cmd, const std::string& tag) {
  return glm5::testing::run_captured(cmd, scratch(tag + ".out"), scratch(tag + ".err"), false);
}

// Converts `in` into scratch/<name> (once per test process) and returns the output folder.
std::string convert(const std::string& in, const std::string& name, const std::string& flags) {
  const fs::path out = scratch(name);
  if (!fs::exists(out / "model.safetensors.index.json")) {
    auto p =
        run(kBin + " convert --no-progress --model " + in + " --out " + out.string() + " " + flags, "conv-" + name);
    EXPECT_EQ(p.code, 0) << p.err;
  }
  return out.string();
}

// prefill_logits and decode_tokens of a greedy generate (optionally under mpirun with a cluster).
struct Logits {
  std::vector<float> prefill, decode;
  std::vector<int32_t> tokens;
};
Logits logits_of(const std::string& model, const std::string& tag, const std::string& cluster = "") {
  const fs::path dump = scratch(tag + ".logits.safetensors");
  const std::string prefix = cluster.empty() ? "" : glm5::testing::mpirun(4);
  auto p = run(prefix + kBin + " generate --model " + model + " --prompt-ids 1,5,9,200,33,7,88,4 --max-new-tokens 6" +
                   " --temperature 0 --ignore-eos --dump-logits " + dump.string() +
                   (cluster.empty() ? "" : " --cluster " + kSrc + "/cluster-configs/" + cluster),
               tag);
  EXPECT_EQ(p.code, 0) << p.err;
  Logits l;
  if (p.code != 0) return l;
  glm5::runtime::SafetensorsFile f(dump.string());
  auto floats = [&](const char* n) {
    const auto* t = f.find(n);
    const float* d = static_cast<const float*>(t->data);
    return std::vector<float>(d, d + t->numel());
  };
  l.prefill = floats("prefill_logits");
  l.decode = floats("decode_logits");
  const auto* t = f.find("decode_tokens");
  l.tokens.assign(static_cast<const int32_t*>(t->data), static_cast<const int32_t*>(t->data) + t->numel());
  return l;
}

void expect_bitwise(const Logits& a, const Logits& b, const std::string& what) {
  ASSERT_FALSE(a.prefill.empty()) << what;
  ASSERT_EQ(a.prefill.size(), b.prefill.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.prefill.data(), b.prefill.data(), a.prefill.size() * 4)) << what << ": prefill logits";
  ASSERT_EQ(a.decode.size(), b.decode.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.decode.data(), b.decode.data(), a.decode.size() * 4)) << what << ": decode logits";
  EXPECT_EQ(a.tokens, b.tokens) << what;
}

// Every file of a folder, name -> bytes (the convert plan file included).
std::map<std::string, std::string> files(const fs::path& dir) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::directory_iterator(dir)) m[e.path().filename().string()] = slurp(e.path());
  return m;
}

// The runs below compare a checkpoint with its F32 copy bitwise: on the fp32 gemm path, where BF16
// and F32 weights share the recipe. (On the AMX path BF16 weights left unquantized go through
// the tiles, their F32 copies not: the same within tolerance, not bitwise.)
struct Fp32GemmPath {
  const char* old = std::getenv("GLM5_CPU_GEMM");
  const std::string saved = old ? old : "";
  Fp32GemmPath() { setenv("GLM5_CPU_GEMM", "fp32", 1); }
  ~Fp32GemmPath() { old ? setenv("GLM5_CPU_GEMM", saved.c_str(), 1) : unsetenv("GLM5_CPU_GEMM"); }
};

TEST(Convert, QuantizedRunsAreBitwiseTheirDequantizedF32) {
  const Fp32GemmPath fp32;
  const std::string tiny = kData + "/tiny-a";
  for (const auto& [name, flags] : std::vector<std::pair<std::string, std::string>>{
           {"int4", "--quant int4 --group-size 32"},
           {"int8", "--quant int8 --group-size 64 --quantize all"},
           {"int8-f32-scales", "--quant int8 --group-size 32 --scale-dtype f32"},
           {"int4-f32-scales", "--quant int4 --group-size 128 --scale-dtype f32"},  // experts in nibble128
           {"fp8", "--quant fp8 --quantize attention,indexer,dense,experts,shared"}}) {
    SCOPED_TRACE(name);
    const std::string q = convert(tiny, name, flags);
    if (contains(name, "f32-scales")) {  // the scales as asked, the weights' values then q * s unrounded
      Checkpoint c(q);
      int scales = 0;
      for (const std::string& n : c.names())
        if (contains(n, ".weight_scale")) {
          EXPECT_EQ(c.find(n)->dtype, glm5::DType::F32) << n;
          ++scales;
        }
      EXPECT_GT(scales, 10);
    }
    const std::string f = convert(q, name + "-f32", "--quant f32");
    expect_bitwise(logits_of(q, name), logits_of(f, name + "-f32"), name);
    const Logits bf16 = logits_of(tiny, "bf16-" + name);
    const Logits ql = logits_of(q, name + "-again");
    ASSERT_EQ(bf16.prefill.size(), ql.prefill.size());
    EXPECT_NE(0, std::memcmp(bf16.prefill.data(), ql.prefill.data(), ql.prefill.size() * 4))
        << "quantization changed nothing: the test would not see a wrong dequantization";
  }
}

TEST(Convert, Int4BytesAreCompressedTensorsBytes) {
  // tests/data/tiny-a-w4a16-ct was written by compressed-tensors' own quantizer (README there).
  const std::string ours = convert(kData + "/tiny-a", "int4", "--quant int4 --group-size 32");
  Checkpoint a(ours), b(kData + "/tiny-a-w4a16-ct");
  int compared = 0;
  for (const std::string& n : a.names()) {
    if (!contains(n, ".weight_packed") && !contains(n, ".weight_scale")) continue;
    const auto* x = a.find(n);
    const auto* y = b.find(n);
    ASSERT_TRUE(y) << n;
    ASSERT_EQ(x->nbytes, y->nbytes) << n;
    EXPECT_EQ(0, std::memcmp(x->data, y->data, x->nbytes)) << n;
    ++compared;
  }
  EXPECT_GT(compared, 100);
}

TEST(Convert, ForeignCheckpointsMatchTheirDequantizedRuns) {
  // Written by other tools: compressed-tensors (W4A16, group 32) and torch (GLM-5-FP8 layout).
  const Fp32GemmPath fp32;
  for (const std::string name : {"tiny-a-w4a16-ct", "tiny-a-fp8", "tiny-glm52-fp8"}) {
    SCOPED_TRACE(name);
    const std::string in = kData + "/" + name;
    const std::string f = convert(in, name + "-f32", "--quant f32");
    const Logits q = logits_of(in, name);
    expect_bitwise(q, logits_of(f, name + "-f32"), name + " vs its f32");
    expect_bitwise(q, logits_of(in, name + "-2x2", "cpu-pp2-ep2.yaml"), name + " 1x1 vs 2x2");
  }
}

TEST(Convert, InterruptedConversionResumesToIdenticalBytes) {
  const std::string flags = "--quant int4 --group-size 64 --shard-size-mb 1";
  const fs::path whole = convert(kData + "/tiny-a", "resume-whole", flags);
  const auto want = files(whole);
  int shards = 0;
  for (const auto& [n, b] : want) shards += contains(n, ".safetensors") && !contains(n, "index");
  ASSERT_GE(shards, 3) << "want several shards";
  // A run killed inside shard 2: shard 1 done, shard 2 half written, nothing after.
  const fs::path cut = scratch("resume-cut");
  fs::create_directories(cut);
  for (const auto& [n, b] : want) {
    if (contains(n, "00001-of")) std::ofstream(cut / n, std::ios::binary) << b;
    if (contains(n, "00002-of"))
      std::ofstream(cut / (n + ".partial"), std::ios::binary) << b.substr(0, b.size() / 2 + 3);
    if (n == ".glm5-convert.json") std::ofstream(cut / n, std::ios::binary) << b;
  }
  auto p =
      run(kBin + " convert --no-progress --model " + kData + "/tiny-a --out " + cut.string() + " " + flags, "resume");
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(files(cut), want);
  // A rerun over a finished output changes nothing.
  p = run(kBin + " convert --no-progress --model " + kData + "/tiny-a --out " + cut.string() + " " + flags, "resume2");
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(files(cut), want);
}

TEST(Convert, ClusterWritesOneFileSetPerRank) {
  const std::string out =
      convert(kData + "/tiny-a", "cluster",
              "--quant int4 --group-size 32 --cluster " + kSrc + "/cluster-configs/cpu-pp2-ep2.yaml");
  const auto index = nlohmann::json::parse(slurp(fs::path(out) / "model.safetensors.index.json"));
  // tiny-a: 4 layers on 2 stages, 16 experts over 2 columns.
  const auto& wm = index["weight_map"];
  const std::string e3 = wm["model.layers.1.mlp.experts.3.gate_proj.weight_packed"];
  const std::string e12 = wm["model.layers.3.mlp.experts.12.gate_proj.weight_packed"];
  const std::string att = wm["model.layers.3.self_attn.q_a_proj.weight"];
  EXPECT_TRUE(contains(e3, "s00-rank000")) << e3;
  EXPECT_TRUE(contains(e12, "s01-rank003")) << e12;
  EXPECT_TRUE(contains(att, "s01-common")) << att;
  expect_bitwise(logits_of(out, "cluster-1x1"), logits_of(out, "cluster-2x2", "cpu-pp2-ep2.yaml"), "per-rank files");
}

TEST(Convert, BadFlagsAndFoldersGetOneMessage) {
  const std::string in = " --model " + kData + "/tiny-a";
  auto p = run(kBin + " convert --no-progress" + in + " --out " + scratch("bad1").string() + " --quant int3", "bad1");
  EXPECT_NE(p.code, 0);
  EXPECT_TRUE(contains(p.err, "--quant: expected int4, int8, fp8, bf16 or f32, found 'int3'")) << p.err;
  p = run(kBin + " convert --no-progress" + in + " --out " + scratch("bad2").string() + " --group-size 48", "bad2");
  EXPECT_TRUE(contains(p.err, "--group-size: expected 32, 64 or 128, found 48")) << p.err;
  p = run(kBin + " convert --no-progress" + in + " --out " + scratch("bad3").string() + " --quantize experts,router",
          "bad3");
  EXPECT_TRUE(contains(p.err, "'router' is not a quantizable role")) << p.err;
  p = run(kBin + " convert --no-progress" + in + " --out " + scratch("bad6").string() + " --scale-dtype f16", "bad6");
  EXPECT_TRUE(contains(p.err, "--scale-dtype: expected bf16 or f32, found 'f16'")) << p.err;
  p = run(
      kBin + " convert --no-progress" + in + " --out " + scratch("bad7").string() + " --quant fp8 --scale-dtype f32",
      "bad7");
  EXPECT_NE(p.code, 0);
  EXPECT_TRUE(contains(p.err, "only int4 and int8 have group scales")) << p.err;
  const fs::path full = scratch("bad4");
  fs::create_directories(full);
  std::ofstream(full / "notes.txt") << "mine";
  p = run(kBin + " convert --no-progress" + in + " --out " + full.string(), "bad4");
  EXPECT_NE(p.code, 0);
  EXPECT_TRUE(contains(p.err, "not empty and not an interrupted conversion (found notes.txt)")) << p.err;
  const std::string done = convert(kData + "/tiny-a", "int4", "--quant int4 --group-size 32");
  p = run(kBin + " convert --no-progress" + in + " --out " + done + " --quant int8", "bad5");
  EXPECT_NE(p.code, 0);
  EXPECT_TRUE(contains(p.err, "holds a conversion with other settings")) << p.err;
  p = run(kBin + " convert --no-progress" + in + " --out " + done + " --quant int4 --group-size 32 --scale-dtype f32",
          "bad8");
  EXPECT_NE(p.code, 0);
  EXPECT_TRUE(contains(p.err, "holds a conversion with other settings")) << p.err;
}

// An int checkpoint converted again to its own format and group keeps its scales byte for byte
// unless --scale-dtype asks for others.
TEST(Convert, ScaleDtypeKeptUnlessGiven) {
  const std::string f32s =
      convert(kData + "/tiny-a", "int8-f32-scales", "--quant int8 --group-size 32 --scale-dtype f32");
  const std::string kept = convert(f32s, "int8-f32-scales-again", "--quant int8 --group-size 32");
  const std::string bf16 = convert(f32s, "int8-bf16-scales", "--quant int8 --group-size 32 --scale-dtype bf16");
  Checkpoint a(f32s), b(kept), c(bf16);
  int scales = 0;
  for (const std::string& n : a.names()) {
    if (!contains(n, ".weight_packed") && !contains(n, ".weight_scale")) continue;
    ASSERT_TRUE(b.find(n) && c.find(n)) << n;
    ASSERT_EQ(a.find(n)->nbytes, b.find(n)->nbytes) << n;
    EXPECT_EQ(0, std::memcmp(a.find(n)->data, b.find(n)->data, a.find(n)->nbytes)) << n;
    if (contains(n, ".weight_scale")) {
      EXPECT_EQ(c.find(n)->dtype, glm5::DType::BF16) << n;
      ++scales;
    }
  }
  EXPECT_GT(scales, 10);
}

}  // namespace
