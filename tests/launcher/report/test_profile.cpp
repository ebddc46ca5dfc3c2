// `glm5 batch --profile --trace`: every rank's report carries per-layer phase times of what it runs
// (attention phases on every rank of a stage, experts where its layers are MoE, lm_head on the
// last stage), the trace is valid Chrome trace JSON with one named track per rank, and
// `glm5 report` prints it (and refuses a file that is not a report, naming it).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using glm5::testing::mpirun;
using glm5::testing::sh;
using glm5::testing::slurp;

namespace {

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
const glm5::testing::ScratchDir scratch("glm5_profile");

void check_run(const std::string& tag, const std::string& launch, const std::string& cluster, int ranks) {
  const fs::path in = scratch(tag + ".jsonl"), out = scratch(tag + ".out.jsonl"), rep = scratch(tag + ".report.json");
  const fs::path trace = scratch(tag + ".trace.json"), log = scratch(tag + ".log");
  {
    std::ofstream f(in);
    for (int r = 0; r < 4; ++r)
      f << "{\"custom_id\":\"r" << r << "\",\"body\":{\"max_tokens\":4,\"prompt\":[3,1,4,1,5," << r << "]}}\n";
  }
  const std::string cmd = launch + kBin + " batch --model " + kData + "/tiny-a --input " + in.string() + " --output " +
                          out.string() + " --report " + rep.string() + " --trace " + trace.string() +
                          (cluster.empty() ? "" : " --cluster " + cluster);
  ASSERT_EQ(0, sh(cmd, log)) << cmd << "\n" << slurp(log);
  const json report = json::parse(slurp(rep));
  ASSERT_EQ(report.at("ranks").size(), size_t(ranks));
  for (const json& r : report.at("ranks")) {
    ASSERT_TRUE(r.contains("profile")) << r.dump();
    EXPECT_FALSE(r.contains("trace"));  // moved into the trace file
    std::set<std::string> phases;
    for (const json& p : r.at("profile")) {
      phases.insert(p.at("phase").get<std::string>());
      EXPECT_GE(p.at("seconds").get<double>(), 0.0);
      EXPECT_GT(p.at("calls").get<int64_t>(), 0);
    }
    for (const char* want : {"projections", "kv_write", "attention_naive", "o_proj"})
      EXPECT_TRUE(phases.count(want)) << "rank " << r.at("rank") << " has no " << want;
    const bool last_stage = ranks == 1 || r.at("stage").get<int>() == 1;
    EXPECT_EQ(phases.count("lm_head"), last_stage ? 1u : 0u) << r.at("rank");
    EXPECT_EQ(phases.count("experts"), 1u) << r.at("rank");  // tiny-a: MoE layers in both stages
    if (ranks > 1) {  // the pipeline: every rank waits and sends; the second stage receives hidden states
      EXPECT_EQ(phases.count("pipeline_wait"), 1u) << r.at("rank");
      EXPECT_EQ(phases.count("pipeline_send"), 1u) << r.at("rank");
      EXPECT_EQ(phases.count("pipeline_recv"), last_stage ? 1u : 0u) << r.at("rank");
    }
  }
  for (const json& r : report.at("ranks")) {  // the phases are disjoint parts of the rank's run
    double sum = 0;
    for (const json& p : r.at("profile")) sum += p.at("seconds").get<double>();
    EXPECT_LE(sum, r.at("wall_s").get<double>() + 1e-3) << r.at("rank");
  }
  const json t = json::parse(slurp(trace));
  std::map<int, std::vector<std::pair<double, double>>> spans;  // per track: (ts, dur)
  std::set<int> tracks, named;
  for (const json& e : t.at("traceEvents")) {
    if (e.at("ph") == "M") {
      named.insert(e.at("pid").get<int>());
      continue;
    }
    ASSERT_EQ(e.at("ph"), "X");
    EXPECT_TRUE(e.at("name").is_string());
    EXPECT_GE(e.at("dur").get<double>(), 0.0);
    EXPECT_GE(e.at("ts").get<double>(), 0.0);
    tracks.insert(e.at("pid").get<int>());
    spans[e.at("pid").get<int>()].push_back({e.at("ts").get<double>(), e.at("dur").get<double>()});
  }
  for (auto& [pid, v] : spans) {  // no phase inside or across another (nothing timed twice)
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i)
      ASSERT_LE(v[i - 1].first + v[i - 1].second, v[i].first + 0.01) << "track " << pid << ", event " << i;
  }
  EXPECT_EQ(tracks.size(), size_t(ranks));
  EXPECT_EQ(named, tracks);
  const fs::path printed = scratch(tag + ".printed");
  ASSERT_EQ(0, sh(kBin + " report " + rep.string(), printed)) << slurp(printed);
  const std::string text = slurp(printed);
  EXPECT_NE(text.find("rank 0 profile"), std::string::npos) << text;
  EXPECT_NE(text.find("| experts |"), std::string::npos) << text;
  EXPECT_NE(text.find("MoE routing (16 experts, k = 4"), std::string::npos) << text;
}

TEST(Profile, OneProcess) { check_run("one", "", "", 1); }

TEST(Profile, TwoByTwo) { check_run("four", mpirun(4), kSrc + "/cluster-configs/cpu-pp2-ep2.yaml", 4); }

TEST(Profile, ReportRefusesOtherFiles) {
  const fs::path bad = scratch("not-a-report.json"), log = scratch("bad.log");
  std::ofstream(bad) << "{\"hello\": 1}\n";
  EXPECT_EQ(1, sh(kBin + " report " + bad.string(), log));
  EXPECT_NE(slurp(log).find("not-a-report.json: no \"ranks\" array"), std::string::npos) << slurp(log);
}

}  // namespace
