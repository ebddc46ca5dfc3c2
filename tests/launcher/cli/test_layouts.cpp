// Layout invariance: greedy `generate` (with --dump-logits) and a multi-prompt `batch` under
// mpirun give bitwise the same logits and the same tokens for every P x E layout as the single
// process. Runs the real glm5 executable under real mpirun processes.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/safetensors.h"
#include "tests/launcher/batch/batch_records.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
using glm5::testing::read_records;

using glm5::testing::mpirun;
using glm5::testing::slurp;
using glm5::testing::test_precision;

const glm5::testing::ScratchDir scratch("glm5_layouts");

// Runs a shell command with stdout and stderr to the scratch folder's last.log; returns its exit code.
int sh(const std::string& cmd) { return glm5::testing::sh(cmd, scratch("last.log")); }
std::string last_log() { return slurp(scratch("last.log")); }

// Bitwise equality of every tensor of two safetensors files.
void expect_same_tensors(const fs::path& a, const fs::path& b) {
  glm5::runtime::SafetensorsFile fa(a.string()), fb(b.string());
  ASSERT_EQ(fa.tensors().size(), fb.tensors().size());
  for (auto& [name, ta] : fa.tensors()) {
    const auto* tb = fb.find(name);
    ASSERT_NE(tb, nullptr) << name;
    ASSERT_EQ(ta.shape, tb->shape) << name;
    EXPECT_EQ(0, std::memcmp(ta.data, tb->data, ta.nbytes)) << "tensor " << name << " differs";
  }
}

struct Layout {
  const char* config;
  int np;
};

const Layout kLayouts[] = {{"cpu-1.yaml", 1},   {"cpu-pp2.yaml", 2}, {"cpu-ep2.yaml", 2}, {"cpu-pp2-ep2.yaml", 4},
                           {"cpu-ep4.yaml", 4}, {"cpu-pp4.yaml", 4}, {"uneven", 2},       {"shared-start", 3}};

std::string prompt_ids(int n, int vocab, int seed) {
  std::string s;
  unsigned x = unsigned(seed) * 2654435761u + 1;
  for (int i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s += (i ? "," : "") + std::to_string((x >> 8) % unsigned(vocab));
  }
  return s;
}

void write_batch_file(const fs::path& p, int vocab) {
  std::ofstream f(p);
  for (int i = 0; i < 7; ++i) {
    json body = {{"prompt", json::array()},
                 {"max_tokens", 3 + i % 4},
                 {"temperature", i % 2 ? 0.0 : 0.8},
                 {"seed", 100 + i},
                 {"logprobs", 2}};
    int n = 5 + 11 * i;  // mixed lengths, some above index_topk
    unsigned x = unsigned(i) * 7919u + 3;
    for (int t = 0; t < n; ++t) {
      x = x * 1664525u + 1013904223u;
      body["prompt"].push_back(int((x >> 8) % unsigned(vocab)));
    }
    f << json({{"custom_id", "req-" + std::to_string(i)},
               {"method", "POST"},
               {"url", "/v1/completions"},
               {"body", body}})
             .dump()
      << "\n";
  }
  f << "{not json\n";
}

class LayoutTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LayoutTest, GenerateAndBatchMatchSingleProcess) {
  const std::string model = kData + "/" + GetParam();
  ASSERT_TRUE(fs::exists(model)) << model;
  json cfg = json::parse(std::ifstream(model + "/config.json"));
  const int vocab = cfg["vocab_size"];
  const std::string ids = prompt_ids(int(cfg["index_topk"]) + 20, vocab, 7);
  const fs::path ref = scratch(GetParam() + "_ref.safetensors");
  const std::string gen = " generate --model " + model + " --prompt-ids " + ids +
                          " --max-new-tokens 6 --temperature 0 --precision " + test_precision() + " --dump-logits ";
  ASSERT_EQ(0, sh(kBin + gen + ref.string())) << last_log();

  const fs::path batch_in = scratch(GetParam() + "_batch.jsonl");
  write_batch_file(batch_in, vocab);
  const fs::path batch_ref = scratch(GetParam() + "_batch_ref.jsonl");
  ASSERT_EQ(0, sh(kBin + " batch --model " + model + " --precision " + test_precision() + " --input " +
                  batch_in.string() + " --output " + batch_ref.string()))
      << last_log();
  auto want = read_records(batch_ref);
  ASSERT_EQ(want.size(), 8u);

  for (const Layout& l : kLayouts) {
    SCOPED_TRACE(l.config);
    std::string cluster = kSrc + "/cluster-configs/" + l.config;
    if (std::string(l.config) == "uneven") {  // 2 stages: layer 0 | the rest
      cluster = scratch(GetParam() + "_uneven.yaml").string();
      std::ofstream(cluster) << "stages: [[0, 1], [1, " << int(cfg["num_hidden_layers"]) << "]]\n"
                             << "expert_parallel: 1\nmicro_batches: 2\n";
    }
    if (std::string(l.config) == "shared-start") {  // IndexShare: stages 2 and 3 begin with shared layers
      if (!cfg.contains("indexer_types")) continue;
      cluster = scratch(GetParam() + "_shared.yaml").string();
      std::ofstream(cluster) << "stages: [[0, 4], [4, 5], [5, 8]]\nexpert_parallel: 1\nmicro_batches: 2\n";
    }
    const fs::path out = scratch(GetParam() + "_" + l.config + ".safetensors");
    ASSERT_EQ(0, sh(mpirun(l.np) + kBin + gen + out.string() + " --cluster " + cluster)) << last_log();
    expect_same_tensors(ref, out);
    const fs::path bout = scratch(GetParam() + "_" + l.config + ".jsonl");
    ASSERT_EQ(0, sh(mpirun(l.np) + kBin + " batch --model " + model + " --precision " + test_precision() + " --input " +
                    batch_in.string() + " --output " + bout.string() + " --cluster " + cluster))
        << last_log();
    EXPECT_EQ(read_records(bout), want);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, LayoutTest, ::testing::Values("tiny-a", "tiny-moe", "tiny-glm52"));

// The device-like backend (device memory rules on the CPU) under mpirun: with comm nccl its
// MoE payloads and hidden states go over the device communicator's stand-in, with comm mpi they
// are staged through host memory; both give the single cpu process's logits and records bitwise,
// and the report says which transport ran and what went through host memory.
TEST(DeviceLikeLayouts, MatchSingleCpuProcessOverBothTransports) {
  const std::string model = kData + "/tiny-a";
  json cfg = json::parse(std::ifstream(model + "/config.json"));
  const int vocab = cfg["vocab_size"];
  const std::string gen = " generate --model " + model + " --prompt-ids " +
                          prompt_ids(int(cfg["index_topk"]) + 20, vocab, 7) +
                          " --max-new-tokens 6 --temperature 0 --dump-logits ";
  const fs::path ref = scratch("dl_ref.safetensors"), batch_in = scratch("dl_batch.jsonl"),
                 batch_ref = scratch("dl_batch_ref.jsonl");
  ASSERT_EQ(0, sh(kBin + gen + ref.string())) << last_log();
  write_batch_file(batch_in, vocab);
  ASSERT_EQ(0,
            sh(kBin + " batch --model " + model + " --input " + batch_in.string() + " --output " + batch_ref.string()))
      << last_log();
  const auto want = read_records(batch_ref);
  struct Case {
    int stages, ep;
  };
  for (const Case c : {Case{1, 2}, Case{2, 1}, Case{2, 2}}) {
    std::map<std::string, json> reports;
    for (const std::string comm : {"nccl", "mpi"}) {
      const std::string name = "dl_" + std::to_string(c.stages) + "x" + std::to_string(c.ep) + "_" + comm;
      SCOPED_TRACE(name);
      const fs::path cluster = scratch(name + ".yaml"), out = scratch(name + ".safetensors"),
                     bout = scratch(name + ".jsonl"), rep = scratch(name + "_report.json");
      std::ofstream(cluster) << "stages: " << c.stages << "\nexpert_parallel: " << c.ep
                             << "\nmicro_batches: 2\nbackend: cpu-devicelike\ncomm: " << comm << "\n";
      const int np = c.stages * c.ep;
      ASSERT_EQ(0, sh(mpirun(np) + kBin + gen + out.string() + " --cluster " + cluster.string())) << last_log();
      expect_same_tensors(ref, out);
      ASSERT_EQ(0, sh(mpirun(np) + kBin + " batch --model " + model + " --input " + batch_in.string() + " --output " +
                      bout.string() + " --cluster " + cluster.string() + " --report " + rep.string()))
          << last_log();
      EXPECT_EQ(read_records(bout), want);
      reports[comm] = json::parse(std::ifstream(rep));
      for (const json& r : reports[comm]["ranks"]) {
        const json& t = r["transport"];
        EXPECT_EQ(r["backend"], "cpu-devicelike");
        EXPECT_EQ(t["control"], "mpi");
        const std::string moved = comm == "nccl" ? "device-like" : "mpi-staged";
        EXPECT_EQ(t["moe"], c.ep > 1 ? moved : "none");
        EXPECT_EQ(t["hidden"], c.stages > 1 ? moved : "none");
        if (comm == "nccl")
          EXPECT_EQ(t["staged_bytes"], 0) << r.dump();
        else
          EXPECT_GT(t["staged_bytes"].get<uint64_t>(), 0u) << r.dump();
      }
    }
    // With nccl a stage-0 rank reads back only expert ids and a later stage's rank receives its
    // hidden states in device memory; staging moves every payload row through the host.
    for (size_t i = 0; i < size_t(c.stages * c.ep); ++i) {
      const json& a = reports["nccl"]["ranks"][i]["transport"]["host_transfers"];
      const json& b = reports["mpi"]["ranks"][i]["transport"]["host_transfers"];
      const char* key = i < size_t(c.ep) ? "to_host_bytes" : "to_device_bytes";
      EXPECT_LT(10 * a[key].get<uint64_t>(), b[key].get<uint64_t>()) << "rank " << i << ": " << a << " vs " << b;
    }
  }
}

}  // namespace

namespace {

// Ranks on different BF16 gemm paths (as on hosts with and without AMX) run, and rank 0 says their
// results are no longer bitwise the single process; one path everywhere says nothing; an unknown
// GLM5_CPU_GEMM is one clear error.
// IndexShare's top-k across pipeline hops in device memory: tiny-glm52 on 3 stages that begin with
// layers 0, 4 and 5 (4 and 5 share layer 2's top-k) on the device-like backend, over the device
// communicator's stand-in and staged through the host: the one cpu process's logits bitwise.
TEST(DeviceLikeLayouts, SharedIndexerTopkCrossesHopsInDeviceMemory) {
  const std::string model = kData + "/tiny-glm52";
  json cfg = json::parse(std::ifstream(model + "/config.json"));
  const std::string gen = " generate --model " + model + " --prompt-ids " +
                          prompt_ids(int(cfg["index_topk"]) + 40, int(cfg["vocab_size"]), 11) +
                          " --max-new-tokens 6 --temperature 0 --dump-logits ";
  const fs::path ref = scratch("dl52_ref.safetensors");
  ASSERT_EQ(0, sh(kBin + gen + ref.string())) << last_log();
  for (const std::string comm : {"nccl", "mpi"}) {
    SCOPED_TRACE(comm);
    const fs::path cluster = scratch("dl52_" + comm + ".yaml"), out = scratch("dl52_" + comm + ".safetensors");
    std::ofstream(cluster) << "stages: [[0, 4], [4, 5], [5, 8]]\nexpert_parallel: 1\nmicro_batches: 2\n"
                           << "backend: cpu-devicelike\ncomm: " << comm << "\n";
    ASSERT_EQ(0, sh(mpirun(3) + kBin + gen + out.string() + " --cluster " + cluster.string())) << last_log();
    expect_same_tensors(ref, out);
  }
}

TEST(GemmPaths, MixedRanksWarnUniformRanksDoNot) {
  const std::string gen = kBin + " generate --model " + kData + "/tiny-a --prompt-ids 1,5,9 --max-new-tokens 2" +
                          " --temperature 0 --cluster " + kSrc + "/cluster-configs/cpu-ep2.yaml";
  const std::string mpi =
      std::string(GLM5_MPIRUN) + " --allow-run-as-root --oversubscribe --mca btl self,vader,tcp -x OMP_NUM_THREADS=1 ";
  ASSERT_EQ(sh(mpi + "-np 1 -x GLM5_CPU_GEMM=fp32 " + gen + " : -np 1 -x GLM5_CPU_GEMM=amx-emulated " + gen), 0)
      << last_log();
  EXPECT_NE(last_log().find("ranks run different BF16 gemm paths (rank 0 fp32, rank 1 amx-emulated)"),
            std::string::npos)
      << last_log();
  ASSERT_EQ(sh(mpi + "-np 2 -x GLM5_CPU_GEMM=fp32 " + gen), 0) << last_log();
  EXPECT_EQ(last_log().find("different BF16 gemm paths"), std::string::npos) << last_log();
  EXPECT_NE(sh("GLM5_CPU_GEMM=amx512 " + gen.substr(0, gen.find(" --cluster"))), 0);
  EXPECT_NE(last_log().find("GLM5_CPU_GEMM=amx512: expected auto, fp32, amx or amx-emulated"), std::string::npos)
      << last_log();
}

}  // namespace
