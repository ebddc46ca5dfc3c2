// Cluster configs: every shipped YAML parses to the layout its name says; each bad input gets one
// message naming the file, the key, the expected and the found value; plan_stages splits tiny-a as
// expected (balanced and explicit) and refuses impossible layouts; layer_parameters matches the
// tensor sizes in tiny-a's checkpoint; launch_command builds the mpirun line a user would type.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kernels/core/check.h"
#include "launcher/cluster/cluster_config.h"
#include "tests/test_support.h"

namespace glm5::launcher {
namespace {

namespace fs = std::filesystem;
using glm5::testing::kData;
const std::string kConfigs = std::string(GLM5_SOURCE_DIR) + "/cluster-configs";
const char* const kBad = "bad-cluster.yaml";

using glm5::testing::expect_error;

// Parses `yaml` as the file bad-cluster.yaml and expects an error naming that file and `parts`.
void expect_yaml_error(const std::string& yaml, std::vector<std::string> parts) {
  SCOPED_TRACE(yaml);
  parts.push_back(kBad);
  expect_error([&] { parse_cluster_config(yaml, kBad); }, parts);
}

std::vector<std::pair<int, int>> pairs(const std::vector<parallel::LayerRange>& r) {
  std::vector<std::pair<int, int>> out;
  for (const auto& x : r) out.emplace_back(x.first, x.last);
  return out;
}

const runtime::ModelConfig& tiny_a() {
  static const runtime::ModelConfig mc = runtime::load_config(kData + "/tiny-a");
  return mc;
}

// ---- the shipped files --------------------------------------------------------------------------

TEST(ClusterConfigFiles, EveryShippedFileParses) {
  struct Expect {
    int stages, ep;
    const char* backend;
    const char* comm;
  };
  const std::map<std::string, Expect> expect = {
      {"cpu-1.yaml", {1, 1, "cpu", "mpi"}},
      {"cpu-pp2.yaml", {2, 1, "cpu", "mpi"}},
      {"cpu-ep2.yaml", {1, 2, "cpu", "mpi"}},
      {"cpu-pp2-ep2.yaml", {2, 2, "cpu", "mpi"}},
      {"cpu-ep4.yaml", {1, 4, "cpu", "mpi"}},
      {"cpu-pp4.yaml", {4, 1, "cpu", "mpi"}},
      {"cpu-uneven.yaml", {2, 1, "cpu", "mpi"}},
      {"cpu-pp2-ep2-ucx.yaml", {2, 2, "cpu", "mpi"}},
      {"cpu-devicelike-pp2-ep2.yaml", {2, 2, "cpu-devicelike", "nccl"}},
      {"cuda-1.yaml", {1, 1, "cuda", "nccl"}},
      {"h100x8.yaml", {1, 8, "cuda", "nccl"}},
      {"h100x16-2nodes.yaml", {2, 8, "cuda", "nccl"}},
  };
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(kConfigs)) {
    if (entry.path().extension() != ".yaml") continue;
    const std::string name = entry.path().filename().string();
    found.push_back(name);
    SCOPED_TRACE(name);
    ClusterConfig cc;
    ASSERT_NO_THROW(cc = load_cluster_config(entry.path().string()));
    EXPECT_EQ(cc.source, entry.path().string());
    // The first line says what the file is for.
    std::ifstream in(entry.path());
    std::string first;
    std::getline(in, first);
    EXPECT_EQ(first.rfind("# ", 0), 0u) << "first line: " << first;
    auto it = expect.find(name);
    if (it == expect.end()) continue;  // a new file: parsing is all we know to check
    EXPECT_EQ(cc.stages, it->second.stages);
    EXPECT_EQ(cc.expert_parallel, it->second.ep);
    EXPECT_EQ(cc.world_size(), it->second.stages * it->second.ep);
    EXPECT_EQ(cc.backend, it->second.backend);
    EXPECT_EQ(cc.comm, it->second.comm);
  }
  for (const auto& [name, e] : expect)
    EXPECT_NE(std::find(found.begin(), found.end(), name), found.end()) << name << " is missing";
}

TEST(ClusterConfigFiles, DetailsOfSpecialFiles) {
  ClusterConfig uneven = load_cluster_config(kConfigs + "/cpu-uneven.yaml");
  EXPECT_EQ(pairs(uneven.layer_ranges), (std::vector<std::pair<int, int>>{{0, 1}, {1, 4}}));

  ClusterConfig ucx = load_cluster_config(kConfigs + "/cpu-pp2-ep2-ucx.yaml");
  const std::vector<std::string> ucx_args = {"--mca",           "pml", "ucx", "--mca", "pml_ucx_tls", "any", "--mca",
                                             "pml_ucx_devices", "any"};
  EXPECT_EQ(ucx.mpirun_args, ucx_args);

  ClusterConfig two = load_cluster_config(kConfigs + "/h100x16-2nodes.yaml");
  ASSERT_EQ(two.hosts.size(), 2u);
  EXPECT_EQ(two.hosts[0].host, "node1");
  EXPECT_EQ(two.hosts[0].slots, 8);
  EXPECT_EQ(two.hosts[1].host, "node2");
  EXPECT_EQ(two.hosts[1].slots, 8);
  EXPECT_TRUE(two.env.count("UCX_TLS"));
  EXPECT_GT(two.kv_budget_gb, 0);

  ClusterConfig eight = load_cluster_config(kConfigs + "/h100x8.yaml");
  EXPECT_GT(eight.kv_budget_gb, 0);
  EXPECT_LT(eight.kv_budget_gb, 80);  // an 80 GB GPU also holds weights
}

TEST(ClusterConfigParse, FullExampleAndDefaults) {
  ClusterConfig cc = parse_cluster_config(R"(
stages: [[0, 3], [3, 4]]
expert_parallel: 2
micro_batches: 3
backend: cuda
comm: nccl
kv_budget_gb: 8.5
max_batch: 32
prefill_chunk: 128
max_step_tokens: 1024
hosts: [{host: node1, slots: 2}, "node2:3", node3]
mpirun_args: ["--mca", "pml", "ucx"]
env: {UCX_TLS: "rc,sm,self", EMPTY: }
)",
                                          "full.yaml");
  EXPECT_EQ(cc.stages, 2);
  EXPECT_EQ(pairs(cc.layer_ranges), (std::vector<std::pair<int, int>>{{0, 3}, {3, 4}}));
  EXPECT_EQ(cc.expert_parallel, 2);
  EXPECT_EQ(cc.micro_batches, 3);
  EXPECT_EQ(cc.backend, "cuda");
  EXPECT_EQ(cc.comm, "nccl");
  EXPECT_DOUBLE_EQ(cc.kv_budget_gb, 8.5);
  EXPECT_EQ(cc.max_batch, 32);
  EXPECT_EQ(cc.prefill_chunk, 128);
  EXPECT_EQ(cc.max_step_tokens, 1024);
  ASSERT_EQ(cc.hosts.size(), 3u);
  EXPECT_EQ(cc.hosts[1].host, "node2");
  EXPECT_EQ(cc.hosts[1].slots, 3);
  EXPECT_EQ(cc.hosts[2].host, "node3");
  EXPECT_EQ(cc.hosts[2].slots, 1);
  EXPECT_EQ(cc.mpirun_args, (std::vector<std::string>{"--mca", "pml", "ucx"}));
  EXPECT_EQ(cc.env.at("UCX_TLS"), "rc,sm,self");
  EXPECT_EQ(cc.env.at("EMPTY"), "");

  ClusterConfig empty = parse_cluster_config("# nothing but a comment\n", "empty.yaml");
  EXPECT_EQ(empty.world_size(), 1);
  EXPECT_EQ(empty.backend, "cpu");
  EXPECT_EQ(empty.comm, "mpi");

  ClusterConfig d = default_cluster_config();
  EXPECT_EQ(d.stages, 1);
  EXPECT_EQ(d.expert_parallel, 1);
  EXPECT_EQ(d.backend, "cpu");
  EXPECT_EQ(d.comm, "mpi");
  EXPECT_TRUE(d.layer_ranges.empty());
}

// ---- validation errors: file, key, expected, found ---------------------------------------------

TEST(ClusterConfigErrors, MissingFile) {
  expect_error([] { load_cluster_config("/nonexistent/dir/cluster.yaml"); },
               {"/nonexistent/dir/cluster.yaml", "cannot open"});
}

TEST(ClusterConfigErrors, NotYaml) {
  expect_yaml_error("stages: [1, 2\n", {"not valid YAML", "line"});
  expect_yaml_error("- 1\n- 2\n", {"(top level)", "a map of keys", "a list of 2"});
}

TEST(ClusterConfigErrors, UnknownKeyListsAllowedOnes) {
  expect_yaml_error("stages: 1\nexpert_paralel: 2\n",
                    {"key 'expert_paralel'", "unknown key 'expert_paralel'", "line 2",
                     "stages, expert_parallel, micro_batches, backend, comm, kv_budget_gb, "
                     "max_batch, prefill_chunk, hosts, mpirun_args, env"});
}

TEST(ClusterConfigErrors, DuplicateKey) {
  expect_yaml_error("stages: 1\nstages: 2\n", {"key 'stages'", "each key once", "twice"});
}

TEST(ClusterConfigErrors, WrongTypes) {
  expect_yaml_error("stages: two\n", {"key 'stages'", "an integer >= 1", "found 'two'"});
  expect_yaml_error("stages: {a: 1}\n", {"key 'stages'", "an integer >= 1", "a map"});
  expect_yaml_error("expert_parallel: 1.5\n", {"key 'expert_parallel'", "an integer", "'1.5'"});
  expect_yaml_error("micro_batches: [1]\n", {"key 'micro_batches'", "an integer", "a list"});
  expect_yaml_error("max_batch: true\n", {"key 'max_batch'", "an integer", "'true'"});
  expect_yaml_error("prefill_chunk:\n", {"key 'prefill_chunk'", "an integer", "an empty value"});
  expect_yaml_error("max_step_tokens: 0\n", {"key 'max_step_tokens'", "an integer >= 1", "'0'"});
  // A step must hold one decode token of every running sequence.
  expect_yaml_error("max_batch: 64\nmax_step_tokens: 32\n",
                    {"key 'max_step_tokens'", "line 2", "at least max_batch (64", "found 32"});
  expect_yaml_error("max_batch: 9000\n", {"key 'max_step_tokens'", "at least max_batch (9000", "found 8192"});
  expect_yaml_error("kv_budget_gb: lots\n", {"key 'kv_budget_gb'", "a number >= 0", "'lots'"});
  expect_yaml_error("backend: [cpu]\n", {"key 'backend'", "one of cpu, cuda", "a list"});
  expect_yaml_error("hosts: node1\n", {"key 'hosts'", "a list of {host: NAME, slots: N}", "'node1'"});
  expect_yaml_error("mpirun_args: --oversubscribe\n", {"key 'mpirun_args'", "a list of strings", "'--oversubscribe'"});
  expect_yaml_error("mpirun_args: [[a]]\n", {"key 'mpirun_args[0]'", "a string", "a list"});
  expect_yaml_error("env: [A=1]\n", {"key 'env'", "a map of NAME: value", "a list"});
  expect_yaml_error("env: {A: [1, 2]}\n", {"key 'env.A'", "a string", "a list"});
  expect_yaml_error("env: {1A: x}\n", {"key 'env'", "a variable name", "'1A'"});
}

TEST(ClusterConfigErrors, CountsBelowOne) {
  expect_yaml_error("stages: 0\n", {"key 'stages'", "an integer >= 1", "found '0'"});
  expect_yaml_error("stages: -2\n", {"key 'stages'", "an integer >= 1", "found '-2'"});
  expect_yaml_error("stages: []\n", {"key 'stages'", "layer ranges", "a list of 0"});
  expect_yaml_error("expert_parallel: 0\n", {"key 'expert_parallel'", "an integer >= 1", "found '0'"});
  expect_yaml_error("micro_batches: 0\n", {"key 'micro_batches'", "an integer >= 1", "found '0'"});
  expect_yaml_error("max_batch: 0\n", {"key 'max_batch'", "an integer >= 1", "found '0'"});
}

// A world past kMaxWorldSize ranks (found by fuzzing: stages x expert_parallel overflowed int).
TEST(ClusterConfigErrors, WorldTooLarge) {
  expect_yaml_error("stages: 1111111112\nexpert_parallel: 2\n",
                    {"key 'stages x expert_parallel'", "at most 1048576 ranks", "1111111112 x 2 = 2222222224"});
  expect_yaml_error("stages: 1024\nexpert_parallel: 1025\n", {"at most 1048576 ranks", "1024 x 1025"});
  EXPECT_EQ(parse_cluster_config("stages: 1024\nexpert_parallel: 1024\n", "ok.yaml").world_size(), 1 << 20);
}

TEST(ClusterConfigErrors, BackendAndComm) {
  expect_yaml_error("backend: tpu\n", {"key 'backend'", "one of cpu, cuda", "found 'tpu'"});
  expect_yaml_error("comm: gloo\n", {"key 'comm'", "one of mpi, nccl", "found 'gloo'"});
  expect_yaml_error("backend: cpu\ncomm: nccl\n",
                    {"key 'comm'", "mpi with backend cpu", "nccl needs device memory", "found 'nccl'"});
  // The default backend is cpu, so nccl alone is the same mistake.
  expect_yaml_error("comm: nccl\n", {"key 'comm'", "nccl needs device memory", "found 'nccl'"});
  EXPECT_NO_THROW(parse_cluster_config("backend: cuda\ncomm: mpi\n", "ok.yaml"));
  EXPECT_EQ(parse_cluster_config("backend: cpu-devicelike\ncomm: nccl\n", "ok.yaml").comm, "nccl");
}

TEST(ClusterConfigErrors, NegativeKvBudget) {
  expect_yaml_error("kv_budget_gb: -1\n", {"key 'kv_budget_gb'", "a number >= 0", "found '-1'"});
  expect_yaml_error("kv_budget_gb: .nan\n", {"key 'kv_budget_gb'", "a number >= 0", "'.nan'"});
  EXPECT_DOUBLE_EQ(parse_cluster_config("kv_budget_gb: 0\n", "ok.yaml").kv_budget_gb, 0.0);
}

TEST(ClusterConfigErrors, MalformedHosts) {
  expect_yaml_error("hosts: [{host: a, slots: 0}]\n", {"key 'hosts[0].slots'", "an integer >= 1", "'0'"});
  expect_yaml_error("hosts: [{host: a, slots: many}]\n", {"key 'hosts[0].slots'", "'many'"});
  expect_yaml_error("hosts: [{host: a}, {slots: 2}]\n", {"key 'hosts[1].host'", "a host name", "no 'host' key"});
  expect_yaml_error("hosts: [{host: a, name: b}]\n", {"key 'hosts[0]'", "only the keys host, slots", "'name'"});
  expect_yaml_error("hosts: [\"a:x\"]\n", {"key 'hosts[0]'", "NAME:SLOTS", "'a:x'"});
  expect_yaml_error("hosts: [\"a:0\"]\n", {"key 'hosts[0]'", "SLOTS an integer >= 1", "'a:0'"});
  expect_yaml_error("hosts: [[a, 2]]\n", {"key 'hosts[0]'", "{host: NAME, slots: N}", "a list"});
  expect_yaml_error("hosts: [{host: \"a b\"}]\n", {"key 'hosts[0].host'", "without spaces", "'a b'"});
  expect_yaml_error("hosts: [{host: \"\"}]\n", {"key 'hosts[0].host'", "a host name", "''"});
}

TEST(ClusterConfigErrors, ExplicitRangesShape) {
  expect_yaml_error("stages: [[0, 2], [3, 4]]\n",
                    {"key 'stages[1]'", "contiguous from layer 0", "first = 2", "found first = 3"});
  expect_yaml_error("stages: [[1, 4]]\n", {"key 'stages[0]'", "first = 0", "found first = 1"});
  expect_yaml_error("stages: [[0, 2], [2, 2]]\n", {"key 'stages[1]'", "non-empty range", "found [2, 2]"});
  expect_yaml_error("stages: [[0, 1, 2]]\n", {"key 'stages[0]'", "[first, last) pair", "a list of 3"});
  expect_yaml_error("stages: [[0, x]]\n", {"key 'stages[0][1]'", "an integer >= 0", "'x'"});
  expect_yaml_error("stages: [3]\n", {"key 'stages[0]'", "[first, last) pair", "'3'"});
}

// ---- plan_stages and layer_parameters on tiny-a
// --------------------------------------------------

// Reads the tensor shapes of every shard's safetensors header (8-byte length + JSON).
std::map<std::string, int64_t> tensor_sizes(const std::string& dir) {
  std::map<std::string, int64_t> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("model-", 0) != 0 || entry.path().extension() != ".safetensors") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    in.read(header.data(), std::streamsize(n));
    const nlohmann::json tensors = nlohmann::json::parse(header);
    for (const auto& [k, v] : tensors.items()) {
      if (k == "__metadata__") continue;
      int64_t count = 1;
      for (int64_t d : v.at("shape")) count *= d;
      out[k] = count;
    }
  }
  return out;
}

TEST(LayerParameters, MatchesTinyACheckpoint) {
  const runtime::ModelConfig& mc = tiny_a();
  std::map<int, double> per_layer;
  for (const auto& [name, count] : tensor_sizes(kData + "/tiny-a")) {
    if (name.rfind("model.layers.", 0) != 0) continue;
    per_layer[std::stoi(name.substr(13))] += double(count);
  }
  // 4 decoder layers + the MTP layer (stored as layer 4).
  ASSERT_EQ(per_layer.size(), size_t(mc.num_hidden_layers + mc.num_nextn_predict_layers));
  for (const auto& [layer, count] : per_layer) EXPECT_EQ(layer_parameters(mc, layer), count) << "layer " << layer;
  // Hand-computed from the spec shapes: dense layer 0 and MoE layers 1..3.
  EXPECT_EQ(layer_parameters(mc, 0), 305824.0);
  EXPECT_EQ(layer_parameters(mc, 1), 948912.0);
  expect_error([&] { layer_parameters(mc, 5); }, {"layer 5", "[0, 5)"});
}

TEST(PlanStages, TinyABalanced) {
  const runtime::ModelConfig& mc = tiny_a();
  using P = std::vector<std::pair<int, int>>;
  ClusterConfig cc;
  EXPECT_EQ(pairs(plan_stages(cc, mc, 1)), (P{{0, 4}}));
  // Layer 0 is dense (0.31 M) and layers 1..3 MoE (0.95 M each): {0,1} | {2,3} is the best split.
  cc.stages = 2;
  EXPECT_EQ(pairs(plan_stages(cc, mc, 2)), (P{{0, 2}, {2, 4}}));
  cc.stages = 4;
  EXPECT_EQ(pairs(plan_stages(cc, mc, 4)), (P{{0, 1}, {1, 2}, {2, 3}, {3, 4}}));
  // With expert parallelism the world grows, the ranges do not change.
  cc.stages = 2;
  cc.expert_parallel = 4;
  EXPECT_EQ(pairs(plan_stages(cc, mc, 8)), (P{{0, 2}, {2, 4}}));
}

// GLM-5.2's IndexShare: planned stages keep a full-indexer layer with the shared ones after it (so
// no top-k crosses a pipeline hop) while that costs at most 10 % over the layer-by-layer balance:
// GLM-5.2's 19 groups of about four layers allow it at 2 and 4 stages (8 would cost ~20 %); tiny-glm52's four
// uneven groups ({0}, {1}, {2..5}, {6, 7}) do not, and it is split layer by layer. Explicit ranges
// may start at a shared layer (its top-k then travels with the hidden states: test_layouts.cpp).
TEST(PlanStages, IndexShareStagesBeginAtFullLayersWhenThatBalances) {
  using P = std::vector<std::pair<int, int>>;
  const runtime::ModelConfig glm52 = runtime::load_config(kData + "/glm52-config");
  for (int stages : {2, 4}) {
    ClusterConfig cc;
    cc.stages = stages;
    for (const auto& r : plan_stages(cc, glm52, stages))
      EXPECT_TRUE(glm52.has_indexer(r.first)) << stages << " stages: one begins at shared layer " << r.first;
  }
  const runtime::ModelConfig tiny = runtime::load_config(kData + "/tiny-glm52");
  ClusterConfig cc;
  cc.stages = 2;
  EXPECT_EQ(pairs(plan_stages(cc, tiny, 2)), (P{{0, 4}, {4, 8}}));  // layer 4 shares layer 2's top-k
  cc.stages = 5;
  EXPECT_EQ(plan_stages(cc, tiny, 5).size(), 5u);
  cc = parse_cluster_config("stages: [[0, 4], [4, 8]]\n", kBad);
  EXPECT_EQ(pairs(plan_stages(cc, tiny, 2)), (P{{0, 4}, {4, 8}}));
}

TEST(PlanStages, TinyAExplicitUneven) {
  ClusterConfig cc = load_cluster_config(kConfigs + "/cpu-uneven.yaml");
  EXPECT_EQ(pairs(plan_stages(cc, tiny_a(), 2)), (std::vector<std::pair<int, int>>{{0, 1}, {1, 4}}));
}

TEST(PlanStages, ExplicitRangesMustCoverAllLayers) {
  ClusterConfig cc = parse_cluster_config("stages: [[0, 1], [1, 3]]\n", kBad);
  expect_error([&] { plan_stages(cc, tiny_a(), 2); },
               {kBad, "key 'stages'", "covering layers [0, 4)", "num_hidden_layers = 4", "ending at 3", "tiny-a"});
  cc = parse_cluster_config("stages: [[0, 2], [2, 5]]\n", kBad);
  expect_error([&] { plan_stages(cc, tiny_a(), 2); }, {kBad, "[0, 4)", "ending at 5"});
  // Ranges built in code (not from YAML) are checked for gaps too.
  ClusterConfig gap;
  gap.source = kBad;
  gap.stages = 2;
  gap.layer_ranges = {{0, 1}, {2, 4}};
  expect_error([&] { plan_stages(gap, tiny_a(), 2); },
               {kBad, "key 'stages[1]'", "starting at layer 1", "found [2, 4]"});
}

TEST(PlanStages, WorldSizeMismatch) {
  ClusterConfig cc = parse_cluster_config("stages: 2\nexpert_parallel: 2\n", "X.yaml");
  expect_error([&] { plan_stages(cc, tiny_a(), 3); },
               {"cluster config X.yaml: stages (2) x expert_parallel (2) = 4 ranks, but the job "
                "has 3 ranks (mpirun -np)"});
}

TEST(PlanStages, ExpertsNotDivisible) {
  ClusterConfig cc = parse_cluster_config("expert_parallel: 3\n", kBad);
  expect_error(
      [&] { plan_stages(cc, tiny_a(), 3); },
      {kBad, "key 'expert_parallel'", "divisor of n_routed_experts (16)", "1, 2, 4, 8, 16", "found 3", "tiny-a"});
  cc.expert_parallel = 16;
  EXPECT_NO_THROW(plan_stages(cc, tiny_a(), 16));
}

TEST(PlanStages, MoreStagesThanLayers) {
  ClusterConfig cc = parse_cluster_config("stages: 5\n", kBad);
  expect_error([&] { plan_stages(cc, tiny_a(), 5); },
               {kBad, "key 'stages'", "at most num_hidden_layers (4)", "found 5", "tiny-a"});
}

// ---- launch_command
// ------------------------------------------------------------------------------

std::ptrdiff_t index_of(const std::vector<std::string>& v, const std::string& s) {
  auto it = std::find(v.begin(), v.end(), s);
  return it == v.end() ? -1 : it - v.begin();
}

TEST(LaunchCommand, HostsArgsEnvAndCluster) {
  ClusterConfig cc = parse_cluster_config(R"(
stages: 2
expert_parallel: 2
hosts: [{host: n1, slots: 2}, {host: n2, slots: 2}]
mpirun_args: ["--mca", "pml", "ucx"]
env: {UCX_TLS: "tcp,self", B: "x y"}
)",
                                          "conf/c.yaml");
  const std::vector<std::string> cmd =
      launch_command(cc, "/opt/glm5", {"generate", "--model", "m", "--prompt", "hi there"}, true);
  const std::vector<std::string> expect = {"mpirun",
                                           "-np",
                                           "4",
                                           "--allow-run-as-root",
                                           "--host",
                                           "n1:2,n2:2",
                                           "--mca",
                                           "pml",
                                           "ucx",
                                           "--bind-to",
                                           "none",
                                           "-x",
                                           "B=x y",
                                           "-x",
                                           "UCX_TLS=tcp,self",
                                           "/opt/glm5",
                                           "generate",
                                           "--model",
                                           "m",
                                           "--prompt",
                                           "hi there",
                                           "--cluster",
                                           "conf/c.yaml"};
  EXPECT_EQ(cmd, expect);  // slots (4) cover the world: no --oversubscribe
  EXPECT_EQ(shell_join(cmd),
            "mpirun -np 4 --allow-run-as-root --host n1:2,n2:2 --mca pml ucx --bind-to none -x 'B=x y' -x "
            "UCX_TLS=tcp,self /opt/glm5 generate --model m --prompt 'hi there' --cluster conf/c.yaml");
}

TEST(LaunchCommand, RootFlagAndOversubscription) {
  ClusterConfig cc = parse_cluster_config("stages: 2\nexpert_parallel: 2\n", "c.yaml");
  auto cmd = launch_command(cc, "glm5", {"inspect"}, false);
  EXPECT_EQ(index_of(cmd, "--allow-run-as-root"), -1);
  EXPECT_EQ(std::vector<std::string>(cmd.begin(), cmd.begin() + 3), (std::vector<std::string>{"mpirun", "-np", "4"}));
  EXPECT_EQ(index_of(cmd, "--host"), -1);
  EXPECT_EQ(index_of(cmd, "-x"), -1);
  // Without hosts, oversubscription follows the local CPU count.
  const bool more_than_cpus = 4u > std::max(1u, std::thread::hardware_concurrency());
  EXPECT_EQ(index_of(cmd, "--oversubscribe") >= 0, more_than_cpus);
  EXPECT_EQ(cmd.back(), "c.yaml");
  EXPECT_EQ(cmd[cmd.size() - 2], "--cluster");
  EXPECT_EQ(cmd[cmd.size() - 3], "inspect");

  // A world far beyond any machine's CPUs always oversubscribes locally.
  cc.expert_parallel = 4096;
  cmd = launch_command(cc, "glm5", {"inspect"}, true);
  EXPECT_GE(index_of(cmd, "--oversubscribe"), 0);
  EXPECT_EQ(cmd[2], "8192");
  EXPECT_EQ(cmd[3], "--allow-run-as-root");

  // Hosts whose slots (3) do not cover the world (4) oversubscribe.
  cc = parse_cluster_config("stages: 2\nexpert_parallel: 2\nhosts: [\"a:2\", b]\n", "c.yaml");
  cmd = launch_command(cc, "glm5", {"inspect"}, false);
  EXPECT_GE(index_of(cmd, "--oversubscribe"), 0);
  EXPECT_EQ(cmd[index_of(cmd, "--host") + 1], "a:2,b:1");
}

// Ranks are left unbound (Open MPI would pin a 1- or 2-rank job's ranks to one core each, with all
// of their OpenMP threads), unless mpirun_args bind them.
TEST(LaunchCommand, RanksUnboundUnlessTheConfigBinds) {
  ClusterConfig cc = parse_cluster_config("stages: 1\n", "c.yaml");
  auto cmd = launch_command(cc, "glm5", {"inspect"}, false);
  const auto at = index_of(cmd, "--bind-to");
  ASSERT_GE(at, 0);
  EXPECT_EQ(cmd[size_t(at) + 1], "none");
  cc = parse_cluster_config("stages: 1\nmpirun_args: [\"--bind-to\", \"core\", \"--map-by\", \"slot:PE=4\"]\n",
                            "c.yaml");
  cmd = launch_command(cc, "glm5", {"inspect"}, false);
  EXPECT_EQ(std::count(cmd.begin(), cmd.end(), "--bind-to"), 1);
  EXPECT_EQ(cmd[size_t(index_of(cmd, "--bind-to")) + 1], "core");
  for (const char* binds : {"[\"--map-by\", \"slot:PE=4\"]", "[\"--mca\", \"hwloc_base_binding_policy\", \"core\"]",
                            "[\"--cpus-per-rank\", \"4\"]"}) {
    cc = parse_cluster_config(std::string("stages: 1\nmpirun_args: ") + binds + "\n", "c.yaml");
    EXPECT_EQ(index_of(launch_command(cc, "glm5", {"inspect"}, false), "--bind-to"), -1) << binds;
  }
  // GPU ranks keep Open MPI's default binding (near their GPU); so does srun for them.
  cc = parse_cluster_config("stages: 1\nbackend: cuda\n", "c.yaml");
  EXPECT_EQ(index_of(launch_command(cc, "glm5", {"inspect"}, false), "--bind-to"), -1);
  EXPECT_EQ(slurm_script(cc, "glm5", {"inspect"}, true).find("--cpu-bind"), std::string::npos);
  cc = parse_cluster_config("stages: 1\n", "c.yaml");
  EXPECT_NE(slurm_script(cc, "glm5", {"inspect"}, true).find("srun --mpi=pmix --ntasks=1 --cpu-bind=none "),
            std::string::npos);
  cc = parse_cluster_config("stages: 1\nenv: {SLURM_CPU_BIND: cores}\n", "c.yaml");
  EXPECT_EQ(slurm_script(cc, "glm5", {"inspect"}, true).find("--cpu-bind"), std::string::npos);
}

TEST(LaunchCommand, RefusesASecondCluster) {
  ClusterConfig cc = parse_cluster_config("stages: 1\n", "c.yaml");
  expect_error(
      [&] {
        launch_command(cc, "glm5", {"generate", "--cluster", "x.yaml"}, false);
      },
      {"--cluster", "c.yaml"});
  expect_error([&] { launch_command(cc, "glm5", {"generate", "--cluster=x.yaml"}, false); }, {"--cluster=x.yaml"});
}

TEST(LaunchCommand, ShippedUcxConfig) {
  ClusterConfig cc = load_cluster_config(kConfigs + "/cpu-pp2-ep2-ucx.yaml");
  auto cmd = launch_command(cc, "glm5", {"generate"}, true);
  auto pml = index_of(cmd, "pml");
  ASSERT_GE(pml, 1);
  EXPECT_EQ(cmd[pml - 1], "--mca");
  EXPECT_EQ(cmd[pml + 1], "ucx");
  EXPECT_GE(index_of(cmd, "pml_ucx_tls"), 0);
  EXPECT_GE(index_of(cmd, "pml_ucx_devices"), 0);
  // mpirun flags come before the program, the program's own flags after it.
  EXPECT_LT(pml, index_of(cmd, "glm5"));
  EXPECT_EQ(cmd.back(), kConfigs + "/cpu-pp2-ep2-ucx.yaml");
}

TEST(ShellJoin, QuotesWhatTheShellWouldSplit) {
  EXPECT_EQ(shell_join({"a", "b c", "", "it's", "$HOME", "x=1,2:3/4.5-6_7@8%9+"}),
            "a 'b c' '' 'it'\\''s' '$HOME' x=1,2:3/4.5-6_7@8%9+");
}

}  // namespace
}  // namespace glm5::launcher
