// Speculative decoding with the MTP layer changes nothing but the speed. A batch job with k = 1..4
// draft tokens per step gives bitwise the records of plain decoding (token ids, text, logprobs and
// their top lists, finish reasons; greedy and seeded sampling, stop strings, n > 1), in one process
// and under mpirun on pp2 x 2 micro-batches, ep2 and pp2 x ep2, at batch 1 and under load. Models:
// a golden tiny model (a random MTP layer: drafts mostly rejected, so every step rolls back) and
// the trained model (most drafts accepted). Runs the real glm5 executable under real mpirun.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/launcher/batch/batch_records.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
using glm5::testing::mpirun;
using glm5::testing::read_records;
using glm5::testing::slurp;

const glm5::testing::ScratchDir scratch("glm5_speculative");

int sh(const std::string& cmd) { return glm5::testing::sh(cmd, scratch("last.log")); }
std::string last_log() { return slurp(scratch("last.log")); }

// custom_id -> the record without its ids and timestamps.
// n requests: text prompts (trained model) or token ids, greedy and seeded at temperature 0.8,
// logprobs 2, a stop string on some, n = 2 on one.
void write_requests(const fs::path& p, const std::string& model, int n, int max_tokens) {
  const json cfg = json::parse(std::ifstream(model + "/config.json"));
  const bool text = fs::exists(model + "/heldout.txt");
  std::vector<std::string> lines;
  if (text) {
    std::ifstream held(model + "/heldout.txt");
    for (std::string l; std::getline(held, l) && int(lines.size()) < n;)
      if (l.size() > 60) lines.push_back(l.substr(0, 40 + lines.size() % 3 * 25));
  }
  std::ofstream f(p);
  for (int i = 0; i < n; ++i) {
    json body = {{"max_tokens", max_tokens - i % 5},
                 {"temperature", i % 3 == 1 ? 0.8 : 0.0},
                 {"seed", 1000 + i},
                 {"logprobs", 2}};
    if (text) {
      body["prompt"] = lines.at(size_t(i));
      if (i % 4 == 3) body["stop"] = {" LORD"};
    } else {
      body["prompt"] = json::array();
      unsigned x = unsigned(i) * 7919u + 3;
      for (int t = 0; t < 5 + 9 * (i % 4); ++t) {
        x = x * 1664525u + 1013904223u;
        body["prompt"].push_back(int((x >> 8) % unsigned(cfg["vocab_size"].get<int>())));
      }
    }
    if (i == 2) body["n"] = 2;
    f << json({{"custom_id", "req-" + std::to_string(i)},
               {"method", "POST"},
               {"url", "/v1/completions"},
               {"body", body}})
             .dump()
      << "\n";
  }
}

struct SpecRun {
  const char* layout;  // cluster-configs file
  int np;
  int k;  // --speculative-tokens
  int max_batch;
};

class Speculative : public ::testing::TestWithParam<std::string> {};

TEST_P(Speculative, RecordsAreBitwiseThoseOfPlainDecodingOnEveryLayout) {
  const std::string model = kData + "/" + GetParam();
  const bool trained = GetParam() == "glm5-kjv";
  const fs::path in = scratch(GetParam() + "_in.jsonl");
  write_requests(in, model, 12, trained ? 40 : 24);
  const fs::path ref = scratch(GetParam() + "_ref.jsonl");
  ASSERT_EQ(0, sh(kBin + " batch --model " + model + " --input " + in.string() + " --output " + ref.string()))
      << last_log();
  const auto want = read_records(ref);
  ASSERT_EQ(want.size(), 12u);

  const SpecRun runs[] = {{"cpu-1.yaml", 1, 1, 1},   {"cpu-1.yaml", 1, 2, 1},      {"cpu-1.yaml", 1, 3, 1},
                          {"cpu-1.yaml", 1, 4, 1},   {"cpu-1.yaml", 1, 3, 8},      {"cpu-pp2.yaml", 2, 3, 8},
                          {"cpu-ep2.yaml", 2, 2, 8}, {"cpu-pp2-ep2.yaml", 4, 4, 8}};
  for (const SpecRun& r : runs) {
    const std::string name =
        GetParam() + "_" + r.layout + "_k" + std::to_string(r.k) + "_b" + std::to_string(r.max_batch);
    SCOPED_TRACE(name);
    // The layout, with speculation allowed at every batch size of the run.
    const fs::path cluster = scratch(name + ".yaml");
    std::ofstream(cluster) << slurp(kSrc + "/cluster-configs/" + r.layout) << "\nmax_batch: " << r.max_batch
                           << "\nspeculative_max_batch: 64\n";
    const fs::path out = scratch(name + ".jsonl"), report = scratch(name + ".report.json");
    const std::string cmd = kBin + " batch --model " + model + " --input " + in.string() + " --output " + out.string() +
                            " --report " + report.string() + " --cluster " + cluster.string() +
                            " --speculative-tokens " + std::to_string(r.k);
    ASSERT_EQ(0, sh((r.np > 1 ? mpirun(r.np) : std::string()) + cmd)) << last_log();
    EXPECT_EQ(read_records(out), want);
    // Drafts were verified, and on the trained model many were accepted.
    const json rep = json::parse(std::ifstream(report));
    int64_t steps = 0, drafted = 0, accepted = 0;
    for (const json& rank : rep["ranks"]) {
      steps += rank.value("spec_verify_steps", int64_t(0));
      drafted += rank.value("spec_draft_tokens", int64_t(0));
      accepted += rank.value("spec_accepted_tokens", int64_t(0));
    }
    EXPECT_GT(steps, 0);
    EXPECT_GE(drafted, steps);
    if (trained) {
      EXPECT_GT(accepted, drafted / 4) << "the trained MTP layer's drafts are mostly rejected";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Speculative, ::testing::Values("tiny-moe", "glm5-kjv", "tiny-glm52"));

// Under pressure: a KV pool too small for the batch (sequences are preempted and recomputed), long
// prompts sharing their first blocks (prefix sharing), and the policy switching speculation off
// while more than speculative_max_batch sequences decode and on again as they finish. The records
// are still plain decoding's.
TEST(SpeculativeUnderLoad, PreemptionPrefixSharingAndThePolicyKeepTheRecords) {
  const std::string model = kData + "/glm5-kjv";
  std::ifstream held(model + "/heldout.txt");
  std::string text, line;
  while (std::getline(held, line) && text.size() < 700) text += line + "\n";
  const fs::path in = scratch("load_in.jsonl");
  {
    std::ofstream f(in);
    for (int i = 0; i < 16; ++i)
      f << json({{"custom_id", "r" + std::to_string(i)},
                 {"prompt", text.substr(0, 600) + " " + std::to_string(i)},
                 {"max_tokens", 70 + 10 * (i % 4)},
                 {"temperature", i % 2 ? 0.7 : 0.0},
                 {"seed", i},
                 {"logprobs", 1}})
               .dump()
        << "\n";
  }
  const fs::path ref = scratch("load_ref.jsonl");
  ASSERT_EQ(0, sh(kBin + " batch --model " + model + " --input " + in.string() + " --output " + ref.string()))
      << last_log();
  // ~2.2 KiB per position with the MTP layer: a pool of 4 blocks of 64. A sequence (147 prompt
  // tokens, the first 128 shared, and up to 100 more) needs all 4 at its end, so any two that run
  // at once preempt, however the input reader's lines arrive (a busy machine delays them); and two
  // decoding sequences are more than speculative_max_batch.
  const fs::path cluster = scratch("load.yaml"), out = scratch("load_out.jsonl"), report = scratch("load_report.json");
  std::ofstream(cluster) << "max_batch: 8\nkv_budget_gb: 0.0006\nspeculative_max_batch: 1\n";
  ASSERT_EQ(0, sh(kBin + " batch --model " + model + " --input " + in.string() + " --output " + out.string() +
                  " --report " + report.string() + " --cluster " + cluster.string() + " --speculative-tokens 3"))
      << last_log();
  EXPECT_EQ(read_records(out), read_records(ref));
  const json rank = json::parse(std::ifstream(report))["ranks"][0];
  EXPECT_GT(rank["preemptions"].get<int64_t>(), 0);
  EXPECT_GT(rank["prefix_hit_tokens"].get<int64_t>(), 0);
  EXPECT_GT(rank["spec_verify_steps"].get<int64_t>(), 0);
}

// A model without an MTP layer cannot speculate: one clear message, exit non-zero.
TEST(SpeculativeErrors, AModelWithoutAnMtpLayerIsRefusedByName) {
  const std::string model = kData + "/real-dims";
  ASSERT_TRUE(fs::exists(model));
  EXPECT_NE(0, sh(kBin + " generate --model " + model +
                  " --prompt-ids 1,2,3 --max-new-tokens 2 --temperature 0 "
                  "--speculative-tokens 2"));
  EXPECT_TRUE(glm5::testing::contains(last_log(), "MTP layer")) << last_log();
  EXPECT_TRUE(glm5::testing::contains(last_log(), "eh_proj")) << last_log();
  EXPECT_NE(0, sh(kBin + " generate --model " + kData + "/tiny-a --prompt-ids 1,2,3 --speculative-tokens 9"));
  EXPECT_TRUE(glm5::testing::contains(last_log(), "--speculative-tokens: expected an integer in [0, 8]")) << last_log();
}

}  // namespace
