// The glm5 command line as a user meets it: each bad input (model directory, config field, shard,
// tensor shape, prompt ids, sampling value, missing tokenizer, cluster config, usage) ends with one
// message naming the file / field / tensor and exit code 1 (2 for usage errors), never a signal;
// `launch` prints an mpirun line the shell reads back word for word (and --run runs it);
// `inspect` prints one row per rank; `tokenize` round-trips text. Runs the real glm5 executable.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
const std::string kTinyA = kData + "/tiny-a";
const std::string kCluster22 = kSrc + "/cluster-configs/cpu-pp2-ep2.yaml";

using glm5::testing::contains;
using glm5::testing::mpirun;
using glm5::testing::Proc;
using glm5::testing::slurp;

const glm5::testing::ScratchDir scratch("glm5_cli");

// Runs a shell command line (stdout and stderr captured apart, through files in the scratch
// folder). A plain command is exec'd by the shell, so a signal that ends it shows as `signaled`.
Proc run(const std::string& cmd, bool exec = true) {
  static int n = 0;
  ++n;
  return glm5::testing::run_captured(cmd, scratch("run" + std::to_string(n) + ".out"),
                                     scratch("run" + std::to_string(n) + ".err"), exec);
}

// A failed run as the user wants it: exit code 1 (or 2 for usage errors), no signal, no crash
// text, one error line, naming every one of `words`.
void expect_clean_failure(const Proc& p, const std::vector<std::string>& words, int want_code = 1) {
  EXPECT_FALSE(p.signaled) << p.err;
  EXPECT_EQ(p.code, want_code) << p.err;
  for (const char* crash : {"terminate called", "Segmentation", "Aborted", "core dumped"})
    EXPECT_FALSE(contains(p.err, crash)) << p.err;
  if (want_code == 1) {
    size_t lines = 0;
    std::stringstream ss(p.err);
    for (std::string l; std::getline(ss, l);) lines += contains(l, "glm5: error");
    EXPECT_EQ(lines, 1u) << "expected one error message:\n" << p.err;
  }
  for (const std::string& w : words) EXPECT_TRUE(contains(p.err, w)) << "'" << w << "' not in:\n" << p.err;
}

std::string generate(const std::string& model, const std::string& extra) {
  return kBin + " generate --model " + model + " " + extra;
}

// A copy of tiny-a in a scratch folder: config, index and tokenizer copied, shards linked unless
// named in `copy_shards` (those are copied, to be edited).
fs::path copy_of_tiny_a(const std::string& name, const std::vector<std::string>& copy_shards = {}) {
  const fs::path dir = scratch(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(kTinyA)) {
    const std::string f = e.path().filename().string();
    const bool shard = f.ends_with(".safetensors") && f.starts_with("model-");
    if (shard && std::find(copy_shards.begin(), copy_shards.end(), f) == copy_shards.end())
      fs::create_symlink(fs::absolute(e.path()), dir / f);
    else
      fs::copy_file(e.path(), dir / f);
  }
  return dir;
}

void edit_config(const fs::path& dir, const std::function<void(json&)>& edit) {
  json c = json::parse(slurp(dir / "config.json"));
  edit(c);
  std::ofstream(dir / "config.json") << c.dump(2);
}

TEST(CliErrors, MissingModelDirectory) {
  const std::string dir = scratch("no-such-model").string();
  expect_clean_failure(run(generate(dir, "--prompt-ids 1,2")), {dir + "/config.json"});
}

TEST(CliErrors, ConfigWithAMissingField) {
  const fs::path dir = copy_of_tiny_a("no-kv-lora-rank");
  edit_config(dir, [](json& c) { c.erase("kv_lora_rank"); });
  expect_clean_failure(run(generate(dir.string(), "--prompt-ids 1,2")),
                       {(dir / "config.json").string(), "kv_lora_rank", "missing"});
}

TEST(CliErrors, TruncatedShard) {
  const std::string shard = "model-00002-of-00002.safetensors";
  const fs::path dir = copy_of_tiny_a("truncated", {shard});
  fs::resize_file(dir / shard, fs::file_size(dir / shard) * 2 / 3);
  expect_clean_failure(run(generate(dir.string(), "--prompt-ids 1,2")), {(dir / shard).string(), "truncated"});
}

TEST(CliErrors, MissingShard) {
  const std::string shard = "model-00001-of-00002.safetensors";
  const fs::path dir = copy_of_tiny_a("missing-shard");
  fs::remove(dir / shard);
  expect_clean_failure(run(generate(dir.string(), "--prompt-ids 1,2")), {shard, "missing", "does not exist"});
}

TEST(CliErrors, TensorShapeDoesNotMatchConfig) {
  const fs::path dir = copy_of_tiny_a("misshaped");
  edit_config(dir, [](json& c) { c["hidden_size"] = 128; });
  // The first tensor checked names both shapes: [vocab, 128] from the config, [vocab, 256] found.
  const Proc p = run(generate(dir.string(), "--prompt-ids 1,2"));
  expect_clean_failure(p, {"tensor ", "[512, 128]", "[512, 256]", (dir / "config.json").string()});
  EXPECT_TRUE(std::regex_search(p.err, std::regex("tensor model\\.[a-z_.0-9]+weight"))) << p.err;
}

TEST(CliErrors, BadPromptIds) {
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1,x")), {"--prompt-ids", "'x'"});
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1,-3")), {"--prompt-ids", "'-3'"});
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1,,2")), {"--prompt-ids", "found ''"});
}

TEST(CliErrors, TokenIdOutsideTheVocabulary) {
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1,512")), {"--prompt-ids", "512", "[0, 512)"});
}

TEST(CliErrors, InvalidSamplingValues) {
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1,2 --temperature -1")), {"temperature", "-1"});
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1,2 --top-p 2")), {"top_p", "2"});
}

TEST(CliErrors, TextPromptWithoutTokenizer) {
  expect_clean_failure(run(generate(kData + "/tiny-b", "--prompt hello")),
                       {"--prompt", "tiny-b/tokenizer.json", "--prompt-ids"});
}

TEST(CliErrors, UsageErrorsExitWith2) {
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1 --max-new-tokens abc")), {"--max-new-tokens", "abc"}, 2);
  expect_clean_failure(run(kBin + " generate --prompt-ids 1"), {"--model"}, 2);
  expect_clean_failure(run(generate(kTinyA, "--prompt-ids 1 --no-such-flag")), {"--no-such-flag"}, 2);
  expect_clean_failure(run(kBin), {"subcommand"}, 2);
  const Proc help = run(kBin + " --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_TRUE(contains(help.out, "batch")) << help.out;
}

TEST(CliErrors, BatchFilesThatCannotBeOpened) {
  const std::string in = scratch("no-such-input.jsonl").string();
  expect_clean_failure(
      run(kBin + " batch --model " + kTinyA + " --input " + in + " --output " + scratch("o.jsonl").string()),
      {"--input", in});
  const std::string out = scratch("no-such-dir/o.jsonl").string();
  fs::remove_all(scratch("no-such-dir"));
  expect_clean_failure(
      run(kBin + " batch --model " + kTinyA + " --input " + kData + "/batch/requests-200.jsonl --output " + out),
      {"--output", out});
}

TEST(CliErrors, WorldSizeDoesNotMatchTheClusterConfig) {
  // Every rank must stop (no hang: `timeout` would exit 124) with a non-zero code and say why.
  const Proc p = run("timeout 120 " + mpirun(2) + generate(kTinyA, "--prompt-ids 1,2 --cluster " + kCluster22));
  EXPECT_NE(p.code, 0) << p.err;
  EXPECT_NE(p.code, 124) << "the job hung:\n" << p.err;
  EXPECT_LT(p.code, 128) << p.err;
  EXPECT_TRUE(contains(p.err, "of 2: cluster config " + kCluster22)) << p.err;
  EXPECT_TRUE(contains(p.err, "= 4 ranks, but the job has 2 ranks")) << p.err;
  EXPECT_FALSE(contains(p.err, "Segmentation")) << p.err;
}

TEST(CliErrors, UnknownKeyInClusterConfig) {
  const fs::path yaml = scratch("typo.yaml");
  std::ofstream(yaml) << "stages: 2\nstagez: 3\n";
  expect_clean_failure(run(kBin + " inspect --model " + kTinyA + " --cluster " + yaml.string()),
                       {yaml.string(), "line 2", "'stagez'", "expert_parallel"});
}

TEST(CliErrors, TokenizeBadInput) {
  const fs::path in = scratch("tok-bad.jsonl");
  std::ofstream(in) << "{\"text\": \"fine\"}\n{\"text\": 5}\n";
  expect_clean_failure(run(kBin + " tokenize --tokenizer " + kTinyA + " < " + in.string()),
                       {"stdin line 2", "\"text\""});
  std::ofstream(in, std::ios::trunc) << "{\"ids\": [1, 999]}\n";
  expect_clean_failure(run(kBin + " tokenize --decode --tokenizer " + kTinyA + " < " + in.string()),
                       {"stdin line 1", "999", "[0, 512)"});
  expect_clean_failure(run(kBin + " tokenize --tokenizer " + kData + "/tiny-b < /dev/null"), {"tiny-b/tokenizer.json"});
}

// The words a POSIX shell reads from `line`.
std::vector<std::string> shell_words(const std::string& line) {
  const fs::path script = scratch("words.sh");
  std::ofstream(script) << "set -- " << line << "\nfor w in \"$@\"; do printf '%s\\0' \"$w\"; done\n";
  const Proc p = run("sh " + script.string(), false);
  EXPECT_EQ(p.code, 0) << p.err;
  std::vector<std::string> words;
  std::string w;
  for (char c : p.out) {
    if (c == '\0') {
      words.push_back(w);
      w.clear();
    } else {
      w += c;
    }
  }
  return words;
}

// A CPU run never loads the CUDA libraries, even from a build with the CUDA backend (it is a
// plugin loaded on first use): they would cost every rank ~150 MiB of RSS and start-up time.
TEST(Cli, CpuRunsDoNotLoadCudaLibraries) {
  Proc p = run("env LD_DEBUG=files " + kBin + " generate --model " + kTinyA +
               " --prompt-ids 1,2,3 --max-new-tokens 2 --temperature 0");
  ASSERT_EQ(p.code, 0) << p.err.substr(0, 2000);
  EXPECT_TRUE(contains(p.err, "libmpi")) << "LD_DEBUG output missing: " << p.err.substr(0, 500);
  for (const char* lib : {"libcublas", "libcudart", "libnccl", "libglm5_cuda"})
    EXPECT_FALSE(contains(p.err, lib)) << lib << " was loaded by a CPU run";
}

// A one-rank cluster config started by hand needs no MPI runtime: it runs on a self
// communicator and gives what the run without --cluster gives.
TEST(Cli, OneRankClusterConfigWithoutMpirun) {
  const std::string args = " generate --model " + kTinyA + " --prompt-ids 1,2,3 --max-new-tokens 4 --temperature 0";
  const Proc plain = run(kBin + args);
  const Proc one = run("env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK " + kBin + args + " --cluster " + kSrc +
                       "/cluster-configs/cpu-1.yaml");
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_EQ(plain.out, one.out);
}

TEST(CliErrors, CudaBackendWithoutItsPlugin) {
  Proc p = run("env GLM5_CUDA_PLUGIN=/nonexistent/libglm5_cuda.so " + kBin + " generate --model " + kTinyA +
               " --prompt-ids 1,2,3 --max-new-tokens 2 --cluster " + kSrc + "/cluster-configs/cuda-1.yaml");
#ifdef GLM5_HAVE_CUDA
  expect_clean_failure(
      p, {"libglm5_cuda.so could not be loaded", "GLM5_CUDA_PLUGIN", "/nonexistent/libglm5_cuda.so: no such file"});
#else
  expect_clean_failure(p, {"backend: cuda", "no CUDA support"});
#endif
}

TEST(Cli, LaunchPrintsAnMpirunLineTheShellReadsBack) {
  const std::string cfg = "cluster-configs/cpu-pp2-ep2.yaml";
  const std::vector<std::string> args = {"batch",    "--model",         "my model", "--input", "it's.jsonl",
                                         "--output", "o$x \"q\".jsonl", "--report", ""};
  std::string cmd = "cd " + kSrc + " && " + kBin + " launch --cluster " + cfg + " --";
  for (const std::string& a : args) cmd += " '" + std::regex_replace(a, std::regex("'"), "'\\''") + "'";
  const Proc p = run(cmd, false);
  ASSERT_EQ(p.code, 0) << p.err;
  ASSERT_EQ(std::count(p.out.begin(), p.out.end(), '\n'), 1) << p.out;
  const std::vector<std::string> words = shell_words(p.out);
  ASSERT_GE(words.size(), 4 + args.size() + 2) << p.out;
  EXPECT_EQ(words[0], "mpirun");
  EXPECT_EQ(words[1], "-np");
  EXPECT_EQ(words[2], "4");
  if (geteuid() == 0) {
    EXPECT_NE(std::find(words.begin(), words.end(), "--allow-run-as-root"), words.end());
  }
  // ... glm5 <args> --cluster FILE at the end, each argument one word as given.
  const size_t n = words.size();
  EXPECT_EQ(words[n - 2], "--cluster");
  EXPECT_EQ(words[n - 1], cfg);
  const std::vector<std::string> tail(words.end() - 2 - long(args.size()), words.end() - 2);
  EXPECT_EQ(tail, args) << p.out;
  EXPECT_TRUE(fs::equivalent(words[n - 3 - args.size()], kBin)) << p.out;
}

TEST(Cli, LaunchRunGivesWhatOneProcessGives) {
  const std::string gen_args =
      "generate --model " + kTinyA + " --prompt-ids 3,1,4,1,5,9,2,6 --max-new-tokens 4 --temperature 0";
  const Proc one = run(kBin + " " + gen_args);
  ASSERT_EQ(one.code, 0) << one.err;
  // `launch --run` execs "mpirun" from PATH: put the configured one first.
  const std::string path = fs::path(GLM5_MPIRUN).parent_path().string() + ":" + std::getenv("PATH");
  const Proc four = run("cd " + kSrc + " && PATH='" + path + "' timeout 120 " + kBin +
                            " launch --run --cluster cluster-configs/cpu-pp2-ep2.yaml -- " + gen_args,
                        false);
  ASSERT_EQ(four.code, 0) << four.err;
  // The printed mpirun line, then the result.
  std::stringstream ss(four.out);
  std::string first, result;
  std::getline(ss, first);
  std::getline(ss, result);
  EXPECT_TRUE(first.starts_with("mpirun -np 4")) << four.out;
  EXPECT_EQ(json::parse(result), json::parse(one.out));
}

// `launch --slurm` writes an sbatch script: the header from the config (tasks, nodes, node list),
// the env exported, then mpirun (or srun --mpi=pmix) with glm5's words as given; the mpirun form,
// run by bash outside Slurm (Open MPI told by its environment to allow root and oversubscription),
// gives what one process gives.
TEST(Cli, LaunchWritesASlurmScript) {
  const fs::path script = scratch("slurm.sbatch");
  Proc p = run("cd " + kSrc + " && " + kBin + " launch --cluster cluster-configs/h100x16-2nodes.yaml --slurm " +
                   script.string() + " -- batch --model /m --input 'in put.jsonl' --output o.jsonl",
               false);
  ASSERT_EQ(p.code, 0) << p.err;
  std::string text = slurp(script);
  for (const char* want : {"#!/bin/bash\n", "\n#SBATCH --ntasks=16\n", "\n#SBATCH --nodes=2\n",
                           "\n#SBATCH --ntasks-per-node=8\n", "\n#SBATCH --nodelist=node1,node2\n",
                           "\nexport UCX_TLS=rc,sm,self\n", "\nmpirun -np 16 --mca pml ucx", " -x UCX_TLS ",
                           " batch --model /m --input 'in put.jsonl' --output o.jsonl --cluster "
                           "cluster-configs/h100x16-2nodes.yaml\n"})
    EXPECT_NE(text.find(want), std::string::npos) << want << " not in:\n" << text;
  EXPECT_EQ(text.find("--host"), std::string::npos) << text;  // the allocation gives mpirun its hosts

  p = run("cd " + kSrc + " && " + kBin + " launch --cluster cluster-configs/cpu-pp2-ep2.yaml --slurm " +
              script.string() + " --srun -- generate --model x",
          false);
  ASSERT_EQ(p.code, 0) << p.err;
  text = slurp(script);
  EXPECT_NE(text.find("\n#SBATCH --nodes=1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nsrun --mpi=pmix --ntasks=4 "), std::string::npos) << text;

  const std::string gen_args =
      "generate --model " + kTinyA + " --prompt-ids 3,1,4,1,5,9,2,6 --max-new-tokens 4 --temperature 0";
  const Proc one = run(kBin + " " + gen_args);
  ASSERT_EQ(one.code, 0) << one.err;
  p = run("cd " + kSrc + " && " + kBin + " launch --cluster cluster-configs/cpu-pp2-ep2.yaml --slurm " +
              script.string() + " -- " + gen_args,
          false);
  ASSERT_EQ(p.code, 0) << p.err;
  const std::string path = fs::path(GLM5_MPIRUN).parent_path().string() + ":" + std::getenv("PATH");
  const Proc four = run("cd " + kSrc + " && PATH='" + path +
                            "' OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                            "OMPI_MCA_rmaps_base_oversubscribe=1 timeout 120 bash " +
                            script.string(),
                        false);
  ASSERT_EQ(four.code, 0) << four.err << slurp(script);
  EXPECT_EQ(json::parse(four.out), json::parse(one.out));
  fs::remove(script);
}

// Rows "rank stage column layers ..." of `glm5 inspect`.
std::vector<std::vector<std::string>> rank_rows(const std::string& out) {
  std::vector<std::vector<std::string>> rows;
  std::stringstream ss(out);
  bool table = false;
  for (std::string l; std::getline(ss, l);) {
    std::stringstream ls(l);
    std::vector<std::string> cols;
    for (std::string c; ls >> c;) cols.push_back(c);
    if (!cols.empty() && cols[0] == "rank")
      table = true;
    else if (table && !cols.empty())
      rows.push_back(cols);
  }
  return rows;
}

TEST(Cli, InspectPrintsOneRowPerRank) {
  const Proc p = run(kBin + " inspect --model " + kTinyA + " --cluster " + kCluster22);
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_TRUE(contains(p.out, "2 stage(s) x 2 expert-parallel = 4 rank(s)")) << p.out;
  const auto rows = rank_rows(p.out);
  ASSERT_EQ(rows.size(), 4u) << p.out;
  const char* want[4][4] = {
      {"0", "0", "0", "0-1"}, {"1", "0", "1", "0-1"}, {"2", "1", "0", "2-3"}, {"3", "1", "1", "2-3"}};
  for (int r = 0; r < 4; ++r) {
    ASSERT_GE(rows[size_t(r)].size(), 4u);
    for (int c = 0; c < 4; ++c) EXPECT_EQ(rows[size_t(r)][size_t(c)], want[r][c]) << p.out;
  }
  // Without --cluster: the single process.
  const Proc one = run(kBin + " inspect --model " + kTinyA);
  ASSERT_EQ(one.code, 0) << one.err;
  const auto one_rows = rank_rows(one.out);
  ASSERT_EQ(one_rows.size(), 1u) << one.out;
  EXPECT_EQ(one_rows[0][3], "0-3");
}

TEST(Cli, TokenizeRoundTrip) {
  const std::vector<std::string> texts = {"hello", "Hello, world! The capital of France is",
                                          "h\u00e9llo \u4e16\u754c\ttabs\nand newlines", "  spaces  ", "<|user|>hi"};
  const fs::path in = scratch("tok-in.jsonl");
  {
    std::ofstream f(in);
    for (const std::string& t : texts) f << json({{"text", t}}).dump() << "\n";
  }
  // Encode alone: ids inside the vocabulary, "hello" in few tokens.
  const Proc enc = run(kBin + " tokenize --tokenizer " + kTinyA + " < " + in.string());
  ASSERT_EQ(enc.code, 0) << enc.err;
  std::stringstream ss(enc.out);
  std::vector<json> ids;
  for (std::string l; std::getline(ss, l);) ids.push_back(json::parse(l));
  ASSERT_EQ(ids.size(), texts.size());
  for (const json& j : ids) {
    ASSERT_TRUE(j.contains("ids") && !j["ids"].empty()) << j.dump();
    for (const json& x : j["ids"]) EXPECT_TRUE(x.get<int>() >= 0 && x.get<int>() < 512) << j.dump();
  }
  EXPECT_LT(ids[0]["ids"].size(), 5u);
  // Encode | decode, as a user pipes it (directory on one side, tokenizer.json on the other).
  const Proc dec = run(kBin + " tokenize --tokenizer " + kTinyA + " < " + in.string() + " | " + kBin +
                           " tokenize --decode --tokenizer " + kTinyA + "/tokenizer.json",
                       false);
  ASSERT_EQ(dec.code, 0) << dec.err;
  std::stringstream ds(dec.out);
  size_t i = 0;
  for (std::string l; std::getline(ds, l); ++i) {
    ASSERT_LT(i, texts.size());
    EXPECT_EQ(json::parse(l)["text"], texts[i]);
  }
  EXPECT_EQ(i, texts.size());
}

}  // namespace

// `inspect` checks the per-rank plan against `device_memory_gb`: the real GLM-5 shape (config.json
// values of spec §1.1) does not fit 8 x 80 GB in BF16; tiny-a fits anything.
TEST(Cli, InspectChecksTheDeviceMemoryPlan) {
  const fs::path dir = scratch("glm5-config/config.json").parent_path();
  json cfg = json::parse(slurp(kTinyA + "/config.json"));
  for (auto [k, v] : std::map<std::string, int64_t>{{"vocab_size", 154880},
                                                    {"hidden_size", 6144},
                                                    {"num_hidden_layers", 78},
                                                    {"num_attention_heads", 64},
                                                    {"num_key_value_heads", 64},
                                                    {"head_dim", 64},
                                                    {"qk_head_dim", 256},
                                                    {"q_lora_rank", 2048},
                                                    {"kv_lora_rank", 512},
                                                    {"qk_nope_head_dim", 192},
                                                    {"qk_rope_head_dim", 64},
                                                    {"v_head_dim", 256},
                                                    {"index_n_heads", 32},
                                                    {"index_head_dim", 128},
                                                    {"index_topk", 2048},
                                                    {"intermediate_size", 12288},
                                                    {"moe_intermediate_size", 2048},
                                                    {"n_routed_experts", 256},
                                                    {"num_experts_per_tok", 8},
                                                    {"n_group", 1},
                                                    {"topk_group", 1},
                                                    {"first_k_dense_replace", 3},
                                                    {"max_position_embeddings", 202752},
                                                    {"pad_token_id", 154820}})
    cfg[k] = v;
  cfg["eos_token_id"] = {154820, 154827, 154829};
  std::ofstream(dir / "config.json") << cfg.dump(1);
  const Proc big =
      run(kBin + " inspect --model " + dir.string() + " --cluster " + kSrc + "/cluster-configs/h100x8.yaml");
  ASSERT_EQ(big.code, 0) << big.err;
  EXPECT_TRUE(contains(big.out, "parameters 7.439e+11")) << big.out;
  EXPECT_TRUE(contains(big.out, "of 80.0 GB device memory: DOES NOT FIT")) << big.out;
  const Proc tiny = run(kBin + " inspect --model " + kTinyA + " --cluster " + kSrc + "/cluster-configs/h100x8.yaml");
  ASSERT_EQ(tiny.code, 0) << tiny.err;
  EXPECT_TRUE(contains(tiny.out, "of 80.0 GB device memory: fits")) << tiny.out;
  const fs::path yaml = scratch("fits.yaml");
  std::ofstream(yaml) << "stages: 2\nexpert_parallel: 2\ndevice_memory_gb: 80\nkv_budget_gb: 1\n";
  const Proc fits = run(kBin + " inspect --model " + kTinyA + " --cluster " + yaml.string());
  ASSERT_EQ(fits.code, 0) << fits.err;
  EXPECT_TRUE(contains(fits.out, "of 80.0 GB device memory: fits")) << fits.out;
}

// `tokenize` encodes exactly as prompts are encoded: a special token written in the text becomes
// its id (<|user|> is 510 in tiny-a), as in a batch prompt; --literal-special keeps it as text.
TEST(Cli, TokenizeParsesSpecialTokensLikePrompts) {
  const fs::path in = scratch("tok-special.jsonl");
  std::ofstream(in) << json({{"text", "<|user|>hi"}}).dump() << "\n";
  const Proc dflt = run(kBin + " tokenize --tokenizer " + kTinyA + " < " + in.string());
  ASSERT_EQ(dflt.code, 0) << dflt.err;
  const auto ids = json::parse(dflt.out)["ids"].get<std::vector<int>>();
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 510);
  const Proc lit = run(kBin + " tokenize --literal-special --tokenizer " + kTinyA + " < " + in.string());
  ASSERT_EQ(lit.code, 0) << lit.err;
  const auto lit_ids = json::parse(lit.out)["ids"].get<std::vector<int>>();
  EXPECT_GT(lit_ids.size(), ids.size());
  EXPECT_EQ(std::find(lit_ids.begin(), lit_ids.end(), 510), lit_ids.end());
  // The same text as a batch prompt: the same number of prompt tokens.
  const fs::path bin = scratch("tok-batch.jsonl"), bout = scratch("tok-batch-out.jsonl");
  std::ofstream(bin) << json({{"prompt", "<|user|>hi"}, {"max_tokens", 1}, {"temperature", 0}}).dump() << "\n";
  fs::remove(bout);
  const Proc b = run(kBin + " batch --model " + kTinyA + " --input " + bin.string() + " --output " + bout.string());
  ASSERT_EQ(b.code, 0) << b.err;
  std::ifstream f(bout);
  std::string line;
  std::getline(f, line);
  EXPECT_EQ(json::parse(line)["response"]["body"]["usage"]["prompt_tokens"], ids.size());
}
