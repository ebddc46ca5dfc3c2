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

// Copies tiny-a and overwrites tensor `name` with NaNs in its shard.
fs::path model_with_nan(const std::string& name) {
  const fs::path src = fs::path(GLM5_TEST_DATA) / "tiny-a";
  const fs::path dst = fs::temp_directory_path() / ("glm5_nan_model_" + std::to_string(getpid()));
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
  f.seekp(std::streamoff(8 + n + off[0].get<uint64_t>()));
  const uint16_t nan_bf16 = 0x7fc0;
  for (uint64_t i = off[0]; i < off[1].get<uint64_t>(); i += 2) f.write(reinterpret_cast<const char*>(&nan_bf16), 2);
  return dst;
}

// The mpirun prefix for np ranks followed by the glm5 executable.
std::string mpirun(int np) { return glm5::testing::mpirun(np) + GLM5_BINARY; }

}  // namespace

// The final norm lives only on the last stage (rank 1 of 2): its NaN guard fires there while
// rank 0 waits for tokens; the job must end, naming rank 1 and the cause.
TEST(Failure, NanOnLastStageEndsTheJob) {
  fs::path model = model_with_nan("model.norm.weight");
  JobRun r = run_job(mpirun(2) + " generate --model " + model.string() + " --prompt-ids 1,2,3,4 " +
              "--max-new-tokens 4 --temperature 0 --cluster " + GLM5_SOURCE_DIR + "/cluster-configs/cpu-pp2.yaml");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << "timed out (hang): " << r.output;
  EXPECT_LT(r.seconds, 30.0);
  EXPECT_NE(r.output.find("error on rank 1 of 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("non-finite logits"), std::string::npos) << r.output;
  fs::remove_all(model);
}

// A rank that cannot load its tensors (here: a checkpoint whose shard vanished) stops everyone.
TEST(Failure, MissingShardEndsTheJob) {
  fs::path model = model_with_nan("model.norm.weight");
  json index = json::parse(std::ifstream(model / "model.safetensors.index.json"));
  fs::remove(model / index["weight_map"]["lm_head.weight"].get<std::string>());
  JobRun r = run_job(mpirun(4) + " generate --model " + model.string() + " --prompt-ids 1,2,3 " +
              "--max-new-tokens 2 --temperature 0 --cluster " + GLM5_SOURCE_DIR + "/cluster-configs/cpu-pp2-ep2.yaml");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << "timed out (hang): " << r.output;
  EXPECT_LT(r.seconds, 30.0);
  EXPECT_NE(r.output.find("error on rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("safetensors"), std::string::npos) << r.output;
  fs::remove_all(model);
}
