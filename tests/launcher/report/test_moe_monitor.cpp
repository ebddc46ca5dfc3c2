// The MoE routing monitor: health figures from synthetic counts (CV, max / mean, per-EP-rank load,
// warnings), the Prometheus text format, and real runs: every routed row of tiny-a picks exactly
// k experts (activation ratio k / E) with the same per-expert counts on 1x1 and 2x2, and a model
// whose router bias sends every row to rank 0's experts is flagged on 1x2.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "launcher/report/moe_monitor.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using glm5::testing::mpirun;
using glm5::testing::sh;
using glm5::testing::slurp;

namespace glm5::launcher {
namespace {

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
const glm5::testing::ScratchDir scratch("glm5_moe_monitor");

TEST(MoeMonitor, HealthFromCounts) {
  // 4 experts, k = 2, EP 2 (experts 0-1 on rank 0); layer 3 counted on two ranks, layer 5 on one.
  const json ranks =
      json::array({{{"rank", 0}, {"rows_not_k", 0}, {"router", {{{"layer", 3}, {"rows", 6}, {"picks", {3, 3, 3, 3}}}}}},
                   {{"rank", 1},
                    {"rows_not_k", 0},
                    {"router",
                     {{{"layer", 3}, {"rows", 2}, {"picks", {1, 1, 1, 1}}},
                      {{"layer", 5}, {"rows", 400}, {"picks", {400, 400, 0, 0}}}}}}});
  const MoeHealth h = moe_health(ranks, 4, 2, 2, 1.5);
  ASSERT_EQ(h.layers.size(), 2u);
  EXPECT_EQ(h.layers[0].layer, 3);
  EXPECT_EQ(h.layers[0].rows, 8);
  EXPECT_EQ(h.layers[0].picks, (std::vector<int64_t>{4, 4, 4, 4}));
  EXPECT_DOUBLE_EQ(h.layers[0].activation_ratio, 0.5);
  EXPECT_DOUBLE_EQ(h.layers[0].load_cv, 0.0);
  EXPECT_DOUBLE_EQ(h.layers[0].rank_max_over_mean, 1.0);
  EXPECT_EQ(h.layers[1].rank_picks, (std::vector<int64_t>{800, 0}));
  EXPECT_EQ(h.layers[1].experts_active, 2);
  EXPECT_DOUBLE_EQ(h.layers[1].load_max_over_mean, 2.0);  // 400 of a mean of 200
  EXPECT_DOUBLE_EQ(h.layers[1].load_cv, 1.0);             // loads 400 400 0 0: std 200, mean 200
  EXPECT_DOUBLE_EQ(h.layers[1].rank_max_over_mean, 2.0);
  ASSERT_EQ(h.warnings.size(), 1u);
  EXPECT_NE(h.warnings[0].find("MoE layer 5"), std::string::npos) << h.warnings[0];
  EXPECT_NE(h.warnings[0].find("2.000x"), std::string::npos) << h.warnings[0];
  json few = ranks;  // the same skew over a few rows: no warning
  few[1]["router"][1]["rows"] = 4;
  few[1]["router"][1]["picks"] = {4, 4, 0, 0};
  EXPECT_TRUE(moe_health(few, 4, 2, 2, 1.5).warnings.empty());
  EXPECT_TRUE(moe_health(ranks, 4, 2, 1, 1.5).warnings.empty());              // one EP rank: nothing to balance
  EXPECT_TRUE(moe_health(ranks, 4, 2, 3, 1.5).layers[1].rank_picks.empty());  // 4 experts do not split over 3

  json bad = ranks;
  bad[1]["rows_not_k"] = 3;
  const MoeHealth hb = moe_health(bad, 4, 2, 2, 3.0);  // no imbalance warning at 3x
  EXPECT_EQ(hb.rows_not_k, 3);
  ASSERT_EQ(hb.warnings.size(), 1u);
  EXPECT_NE(hb.warnings[0].find("3 routings of a row in a layer did not pick 2 distinct experts"), std::string::npos)
      << hb.warnings[0];
}

// Every sample line is `name{labels} value`, every name has HELP and TYPE lines before it.
TEST(MoeMonitor, PrometheusText) {
  const json ranks = json::array({{{"rank", 0},
                                   {"tokens_generated", 12},
                                   {"compute_s", 0.25},
                                   {"rows_not_k", 0},
                                   {"router", {{{"layer", 1}, {"rows", 2}, {"picks", {1, 1, 2, 0}}}}}}});
  json report = {{"world_size", 1}, {"ranks", ranks}};
  report["moe"] = to_json(moe_health(ranks, 4, 2, 1, 1.5));
  const std::string text = prometheus_text(report);
  std::istringstream in(text);
  std::string line;
  std::set<std::string> typed;
  const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? (-?[0-9.]+(e[+-]?[0-9]+)?)$)");
  int samples = 0;
  while (std::getline(in, line)) {
    std::smatch m;
    if (line.rfind("# TYPE ", 0) == 0) {
      EXPECT_TRUE(typed.insert(line.substr(7, line.find(' ', 7) - 7)).second) << "TYPE twice: " << line;
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) continue;
    ASSERT_TRUE(std::regex_match(line, m, sample)) << line;
    EXPECT_TRUE(typed.count(m[1].str())) << "no TYPE before " << line;
    ++samples;
  }
  EXPECT_NE(text.find("glm5_tokens_generated_total{rank=\"0\"} 12\n"), std::string::npos) << text;
  EXPECT_NE(text.find("glm5_moe_expert_tokens_total{layer=\"1\",expert=\"2\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("glm5_moe_activation_ratio{layer=\"1\"} 0.5\n"), std::string::npos) << text;
  EXPECT_GT(samples, 8);
}

// 12 requests of 24 random ids, 6 tokens each.
fs::path write_requests(const std::string& name) {
  const fs::path p = scratch(name);
  std::ofstream f(p);
  for (int r = 0; r < 12; ++r) {
    f << "{\"custom_id\":\"r" << r << "\",\"body\":{\"max_tokens\":6,\"temperature\":0,\"prompt\":[";
    for (int i = 0; i < 24; ++i) f << (i ? "," : "") << (r * 131 + i * 17) % 200 + 1;  // (ids < every vocab here)
    f << "]}}\n";
  }
  return p;
}

json run_with_report(const std::string& model, const std::string& tag, const std::string& launch,
                     const std::string& cluster, std::string* log_text = nullptr) {
  const fs::path in = write_requests(tag + ".jsonl"), out = scratch(tag + ".out.jsonl");
  const fs::path rep = scratch(tag + ".report.json"), log = scratch(tag + ".log"), met = scratch(tag + ".prom");
  const std::string cmd = launch + kBin + " batch --model " + model + " --input " + in.string() + " --output " +
                          out.string() + " --report " + rep.string() + " --metrics " + met.string() +
                          (cluster.empty() ? "" : " --cluster " + cluster);
  EXPECT_EQ(0, sh(cmd, log)) << cmd << "\n" << slurp(log);
  if (log_text) *log_text = slurp(log);
  EXPECT_TRUE(fs::exists(met));
  return json::parse(slurp(rep));
}

TEST(MoeMonitor, EveryRowPicksKExpertsOnEveryLayout) {
  const std::string model = kData + "/tiny-a";
  const json one = run_with_report(model, "one", "", "");
  const json four = run_with_report(model, "four", mpirun(4), kSrc + "/cluster-configs/cpu-pp2-ep2.yaml");
  for (const json* r : {&one, &four}) {
    const json& moe = r->at("moe");
    EXPECT_EQ(moe.at("rows_not_k").get<int64_t>(), 0);
    ASSERT_EQ(moe.at("layers").size(), 3u);  // tiny-a: layers 1-3 are MoE
    for (const json& l : moe.at("layers")) {
      EXPECT_EQ(l.at("activation_ratio").get<double>(), 4.0 / 16.0) << l.dump();
      EXPECT_GT(l.at("rows").get<int64_t>(), 12 * 24);
    }
  }
  // The same rows routed the same way: identical counts per layer and expert.
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(one["moe"]["layers"][i]["rows"], four["moe"]["layers"][i]["rows"]);
    EXPECT_EQ(one["moe"]["layers"][i]["expert_tokens"], four["moe"]["layers"][i]["expert_tokens"]);
  }
  EXPECT_EQ(four["moe"]["expert_parallel"].get<int>(), 2);
}

// The other test models (another GLM-5 shape, DeepSeek-V3.2, FP8 and int4 checkpoints, tiny-moe):
// every routing picks k distinct experts, on every MoE layer.
TEST(MoeMonitor, EveryModelPicksKExperts) {
  for (const char* name : {"tiny-b", "tiny-v32", "tiny-a-fp8", "tiny-a-w4a16-ct", "tiny-moe"}) {
    const json config = json::parse(slurp(kData + "/" + name + "/config.json"));
    const int64_t E = config.at("n_routed_experts"), K = config.at("num_experts_per_tok");
    const int64_t moe_layers =
        config.at("num_hidden_layers").get<int64_t>() - config.at("first_k_dense_replace").get<int64_t>();
    const json r = run_with_report(kData + "/" + name, name, "", "");
    const json& moe = r.at("moe");
    EXPECT_EQ(moe.at("rows_not_k").get<int64_t>(), 0) << name;
    ASSERT_EQ(int64_t(moe.at("layers").size()), moe_layers) << name;
    for (const json& l : moe.at("layers"))
      EXPECT_EQ(l.at("activation_ratio").get<double>(), double(K) / double(E)) << name;
  }
}

// tiny-a with e_score_correction_bias + 100 on experts 0-7 (groups 0 and 1 of 4, topk_group 2):
// every row picks among rank 0's experts on 1x2; the report and stderr say so.
TEST(MoeMonitor, FlagsARouterThatFavoursOneRank) {
  const fs::path model = scratch("tiny-a-skewed");
  fs::copy(kData + "/tiny-a", model, fs::copy_options::recursive);
  int patched = 0;
  for (const auto& entry : fs::directory_iterator(model)) {
    if (entry.path().extension() != ".safetensors" || entry.path().filename() == "golden.safetensors") continue;
    std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
    uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    f.read(header.data(), std::streamsize(n));
    const json tensors = json::parse(header);
    for (const auto& [name, t] : tensors.items()) {
      if (name.find("e_score_correction_bias") == std::string::npos) continue;
      ASSERT_EQ(t.at("dtype"), "F32");
      ASSERT_EQ(t.at("data_offsets")[1].get<uint64_t>() - t.at("data_offsets")[0].get<uint64_t>(), 64u);
      std::vector<float> bias(16);
      const auto off = std::streamoff(8 + n + t.at("data_offsets")[0].get<uint64_t>());
      f.seekg(off);
      f.read(reinterpret_cast<char*>(bias.data()), 64);
      for (int e = 0; e < 8; ++e) bias[size_t(e)] += 100.0f;
      f.seekp(off);
      f.write(reinterpret_cast<const char*>(bias.data()), 64);
      ASSERT_TRUE(f.good()) << entry.path();
      ++patched;
    }
  }
  ASSERT_GE(patched, 3);
  std::string log;
  const json r = run_with_report(model.string(), "skewed", mpirun(2), kSrc + "/cluster-configs/cpu-ep2.yaml", &log);
  const json& moe = r.at("moe");
  EXPECT_EQ(moe.at("rows_not_k").get<int64_t>(), 0);
  for (const json& l : moe.at("layers")) {
    EXPECT_EQ(l.at("activation_ratio").get<double>(), 0.25);
    EXPECT_EQ(l.at("rank_tokens")[1].get<int64_t>(), 0) << l.dump();
    EXPECT_DOUBLE_EQ(l.at("rank_load_max_over_mean").get<double>(), 2.0);
  }
  EXPECT_EQ(moe.at("warnings").size(), 3u);
  EXPECT_NE(log.find("warning: MoE layer 1: the busiest of 2 EP ranks gets 2.000x the mean load"), std::string::npos)
      << log;
}

}  // namespace
}  // namespace glm5::launcher
