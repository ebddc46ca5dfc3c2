// Failure behaviour of distributed runs: a rank that throws ends the whole mpirun job within
// seconds, with a message naming the rank and the cause, and a non-zero exit; nothing hangs.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct JobRun {
  int rc = -1;
  double seconds = 0;
  std::string output;
};

const glm5::testing::ScratchDir scratch("glm5_failure");

// Runs cmd under `timeout 120` with stdout and stderr to one log; times it.
JobRun run_job(const std::string& cmd) {
  const fs::path log = scratch("job.log");
  auto t = std::chrono::steady_clock::now();
  JobRun r;
  r.rc = glm5::testing::sh("timeout 120 " + cmd, log);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  r.output = glm5::testing::slurp(log);
  return r;
}

// Copies tiny-a and overwrites tensor `name` (or only its row `row` when >= 0) with NaNs.
fs::path model_with_nan(const std::string& name, int64_t row = -1) {
  const fs::path src = fs::path(GLM5_TEST_DATA) / "tiny-a";
  const fs::path dst = scratch("nan-model");
  fs::remove_all(dst);
  fs::copy(src, dst, fs::copy_options::recursive);
  for (auto& e : fs::directory_iterator(dst)) fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  json index = json::parse(std::ifstream(dst / "model.safetensors.index.json"));
  const fs::path shard = dst / index["weight_map"][name].get<std::string>();
  std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), std::streamsize(n));
  json h = json::parse(header);
  const auto off = h[name]["data_offsets"];
  EXPECT_EQ(h[name]["dtype"], "BF16");
  uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  if (row >= 0) {
    const uint64_t row_bytes = 2 * h[name]["shape"][1].get<uint64_t>();
    begin += uint64_t(row) * row_bytes;
    end = begin + row_bytes;
  }
  f.seekp(std::streamoff(8 + n + begin));
  const uint16_t nan_bf16 = 0x7fc0;
  for (uint64_t i = begin; i < end; i += 2) f.write(reinterpret_cast<const char*>(&nan_bf16), 2);
  return dst;
}

// The mpirun prefix for np ranks followed by the glm5 executable.
std::string mpirun(int np) { return glm5::testing::mpirun(np) + GLM5_BINARY; }

}  // namespace

// The final norm lives only on the last stage (rank 1 of 2): every logit is NaN there. The request
// fails with an error naming the cause, the log names rank 1, and the job ends non-zero at once.
TEST(Failure, NanOnLastStageFailsTheRequestNamingTheRank) {
  fs::path model = model_with_nan("model.norm.weight");
  JobRun r =
      run_job(mpirun(2) + " generate --model " + model.string() + " --prompt-ids 1,2,3,4 " +
              "--max-new-tokens 4 --temperature 0 --cluster " + GLM5_SOURCE_DIR + "/cluster-configs/cpu-pp2.yaml");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << "timed out (hang): " << r.output;
  EXPECT_LT(r.seconds, 30.0);
  EXPECT_NE(r.output.find("[glm5] rank 1: request 0: non-finite logits (NaN or inf) at positions 0..3"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("error on rank 0 of 2: non-finite logits"), std::string::npos) << r.output;
  fs::remove_all(model);
}

// A NaN embedding row poisons only the requests whose prompt holds that token: they get error
// records naming the cause, every other request is answered exactly as on the clean model, and
// the job exits 0. One process and a 2-stage pipeline.
TEST(Failure, NanInOneRequestLeavesTheOthersAnswered) {
  const int32_t poisoned = 5;
  fs::path model = model_with_nan("model.embed_tokens.weight", poisoned);
  const fs::path in = scratch("nan_in.jsonl");
  {
    std::ofstream f(in);
    for (int i = 0; i < 24; ++i) {
      json prompt = json::array({1 + i % 4, 2, i % 3 == 0 ? poisoned : 9, 3});
      f << json({{"custom_id", "r" + std::to_string(i)},
                 {"prompt", prompt},
                 {"max_tokens", 4},
                 {"temperature", 0},
                 {"ignore_eos", true}})
               .dump()
        << "\n";
    }
  }
  auto records = [](const fs::path& p) {
    std::map<std::string, json> m;
    std::ifstream f(p);
    std::string line;
    while (std::getline(f, line)) {
      json j = json::parse(line);
      m[j["custom_id"].get<std::string>()] = j;
    }
    return m;
  };
  const fs::path clean = scratch("nan_clean.jsonl");
  fs::remove(clean);
  ASSERT_EQ(0, run_job(std::string(GLM5_BINARY) + " batch --model " + GLM5_TEST_DATA + "/tiny-a --input " +
                       in.string() + " --output " + clean.string())
                   .rc);
  const auto want = records(clean);
  for (const std::string cluster : {"", "cpu-pp2.yaml"}) {
    SCOPED_TRACE(cluster.empty() ? "one process" : cluster);
    const fs::path out = scratch("nan_out.jsonl");
    fs::remove(out);
    const std::string cmd =
        (cluster.empty() ? std::string(GLM5_BINARY) : mpirun(2)) + " batch --model " + model.string() + " --input " +
        in.string() + " --output " + out.string() +
        (cluster.empty() ? "" : " --cluster " + std::string(GLM5_SOURCE_DIR) + "/cluster-configs/" + cluster);
    JobRun r = run_job(cmd);
    ASSERT_EQ(r.rc, 0) << r.output;
    const auto got = records(out);
    ASSERT_EQ(got.size(), 24u);
    for (int i = 0; i < 24; ++i) {
      const std::string id = "r" + std::to_string(i);
      const json& g = got.at(id);
      if (i % 3 == 0) {
        ASSERT_TRUE(g["error"].is_object()) << g.dump();
        EXPECT_NE(g["error"]["message"].get<std::string>().find("non-finite logits (NaN or inf)"), std::string::npos)
            << g.dump();
      } else {
        ASSERT_TRUE(g["error"].is_null()) << g.dump();
        EXPECT_EQ(g["response"]["body"]["choices"][0]["token_ids"],
                  want.at(id)["response"]["body"]["choices"][0]["token_ids"])
            << id;
      }
    }
  }
  fs::remove_all(model);
}

// A rank that cannot load its tensors (here: a checkpoint whose shard vanished) stops everyone.
TEST(Failure, MissingShardEndsTheJob) {
  fs::path model = model_with_nan("model.norm.weight");
  json index = json::parse(std::ifstream(model / "model.safetensors.index.json"));
  fs::remove(model / index["weight_map"]["lm_head.weight"].get<std::string>());
  JobRun r =
      run_job(mpirun(4) + " generate --model " + model.string() + " --prompt-ids 1,2,3 " +
              "--max-new-tokens 2 --temperature 0 --cluster " + GLM5_SOURCE_DIR + "/cluster-configs/cpu-pp2-ep2.yaml");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << "timed out (hang): " << r.output;
  EXPECT_LT(r.seconds, 30.0);
  EXPECT_NE(r.output.find("error on rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("safetensors"), std::string::npos) << r.output;
  fs::remove_all(model);
}
