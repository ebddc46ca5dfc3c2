// Batch jobs under load: the pipeline cannot deadlock on big messages (the regression: pp2 with 2
// micro-batches and top_logprobs 20 hung on the blocking sends), new requests go to the least
// loaded column, a full disk stops the job cleanly and a rerun completes it, unsupported OpenAI
// fields are refused per request, and with a stop string text / token_ids / logprobs / usage agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using glm5::testing::kBin;
using glm5::testing::kSrc;
const std::string kTinyA = std::string(GLM5_TEST_DATA) + "/tiny-a";
const glm5::testing::ScratchDir scratch("glm5_jobs");

struct Job {
  int rc = -1;
  std::string log;
};

// Runs a command under `timeout 180` (124: it hung), stdout and stderr to one log.
Job run(const std::string& cmd) {
  const fs::path log = scratch("job.log");
  Job j;
  j.rc = glm5::testing::sh("timeout 180 " + cmd, log);
  j.log = glm5::testing::slurp(log);
  return j;
}

std::string batch(const fs::path& in, const fs::path& out, const std::string& cluster = "",
                  const std::string& report = "") {
  return " batch --model " + kTinyA + " --input " + in.string() + " --output " + out.string() +
         (cluster.empty() ? "" : " --cluster " + cluster) + (report.empty() ? "" : " --report " + report);
}

// n short greedy requests with top_logprobs 20 (big result messages), ids r0..r{n-1}.
void write_requests(const fs::path& p, int n, int max_tokens, bool logprobs = true) {
  std::ofstream f(p);
  for (int i = 0; i < n; ++i) {
    json body = {{"custom_id", "r" + std::to_string(i)},
                 {"prompt", {1 + i % 97, 2 + i % 13, 3}},
                 {"max_tokens", max_tokens},
                 {"temperature", 0},
                 {"ignore_eos", true}};
    if (logprobs) body["logprobs"] = true, body["top_logprobs"] = 20;
    f << body.dump() << "\n";
  }
}

// Records by custom_id; fails on a line that is not a whole record or on an id seen twice.
std::map<std::string, json> records(const fs::path& p) {
  std::map<std::string, json> m;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line)) {
    json j = json::parse(line);
    const std::string id = j["custom_id"].get<std::string>();
    EXPECT_EQ(m.count(id), 0u) << "two records for " << id;
    m[id] = j;
  }
  return m;
}

std::vector<int> token_ids(const json& rec) {
  return rec["response"]["body"]["choices"][0]["token_ids"].get<std::vector<int>>();
}

std::string cluster_file(const std::string& name, const std::string& yaml) {
  const fs::path p = scratch(name + ".yaml");
  std::ofstream(p) << yaml;
  return p.string();
}

}  // namespace

// Each layout runs a job whose result messages (top_logprobs 20 for up to 256 sequences) are far
// above MPI's eager limit. On the blocking-send pipeline the first of these hung for good; here
// every id must come back once, with the tokens of the one-process run.
TEST(Jobs, NoPipelineDeadlockWithLargeMessages) {
  struct Case {
    std::string name, yaml;
    int np, requests;
  };
  const std::vector<Case> cases = {
      {"pp2_mb2", "stages: 2\nexpert_parallel: 1\nmicro_batches: 2\nmax_batch: 256\nmax_step_tokens: 8192\n", 2, 300},
      {"pp4_mb3", "stages: 4\nexpert_parallel: 1\nmicro_batches: 3\nmax_batch: 128\n", 4, 300},
      {"pp2_ep2", "stages: 2\nexpert_parallel: 2\nmicro_batches: 2\nmax_batch: 256\n", 4, 400},
  };
  const fs::path in = scratch("big.jsonl");
  write_requests(in, 400, 4);
  const fs::path ref = scratch("big_ref.jsonl");
  fs::remove(ref);
  Job one = run(kBin + batch(in, ref));
  ASSERT_EQ(one.rc, 0) << one.log;
  const auto want = records(ref);
  ASSERT_EQ(want.size(), 400u);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path sub = scratch(c.name + "_in.jsonl"), out = scratch(c.name + "_out.jsonl");
    write_requests(sub, c.requests, 4);
    fs::remove(out);
    Job j = run(glm5::testing::mpirun(c.np) + kBin + batch(sub, out, cluster_file(c.name, c.yaml)));
    ASSERT_NE(j.rc, 124) << "the job hung: " << j.log;
    ASSERT_EQ(j.rc, 0) << j.log;
    const auto got = records(out);
    ASSERT_EQ(got.size(), size_t(c.requests));
    for (auto& [id, rec] : got) {
      ASSERT_TRUE(rec["error"].is_null()) << rec.dump();
      EXPECT_EQ(token_ids(rec), token_ids(want.at(id))) << id;
      EXPECT_EQ(rec["response"]["body"]["choices"][0]["logprobs"]["top_logprobs"].size(), 4u);
    }
  }
}

// Requests alternate long (32 tokens) and short (1 token): pinned by index % 2, column 0 would
// generate 32x what column 1 does. Handed to the least-loaded column, both get similar work.
TEST(Jobs, RequestsGoToTheLeastLoadedColumn) {
  const fs::path in = scratch("skew.jsonl"), out = scratch("skew_out.jsonl"), rep = scratch("skew_report.json");
  {
    std::ofstream f(in);
    for (int i = 0; i < 40; ++i)
      f << json({{"custom_id", "s" + std::to_string(i)},
                 {"prompt", {1, 2, 3}},
                 {"max_tokens", i % 2 ? 1 : 32},
                 {"temperature", 0},
                 {"ignore_eos", true}})
               .dump()
        << "\n";
  }
  fs::remove(out);
  Job j = run(glm5::testing::mpirun(2) + kBin + batch(in, out, kSrc + "/cluster-configs/cpu-ep2.yaml", rep.string()));
  ASSERT_EQ(j.rc, 0) << j.log;
  ASSERT_EQ(records(out).size(), 40u);
  json r = json::parse(std::ifstream(rep));
  int64_t t0 = r["ranks"][0]["tokens_generated"], t1 = r["ranks"][1]["tokens_generated"];
  EXPECT_EQ(t0 + t1, 20 * 32 + 20);
  EXPECT_GT(std::min(t0, t1), (t0 + t1) / 3) << "column 0: " << t0 << " tokens, column 1: " << t1;
}

// The output lives on a 16 KiB tmpfs (in a private mount namespace): the job fills it, stops
// with one message naming the file and the error, exits non-zero and leaves only whole records;
// rerun with room, it answers the rest: every id exactly once, as in an unbroken run.
TEST(Jobs, DiskFullStopsCleanlyAndARerunCompletes) {
  if (glm5::testing::sh("unshare -m true", scratch("unshare.log")) != 0) GTEST_SKIP() << "needs unshare -m (root)";
  const fs::path in = scratch("full_in.jsonl"), ref = scratch("full_ref.jsonl");
  write_requests(in, 120, 6, false);
  fs::remove(ref);
  ASSERT_EQ(run(kBin + batch(in, ref)).rc, 0);
  const auto want = records(ref);
  ASSERT_EQ(want.size(), 120u);
  ASSERT_GT(fs::file_size(ref), 40000u) << "the output must not fit the 16 KiB disk";

  const fs::path small = scratch("small"), kept = scratch("full_out.jsonl");
  fs::create_directories(small);
  fs::remove(kept);
  const fs::path on_small = small / "out.jsonl";
  const std::string script = "mount -t tmpfs -o size=16k tmpfs " + small.string() + " || exit 99; " + kBin +
                             batch(in, on_small) + "; rc=$?; cp " + on_small.string() + " " + kept.string() +
                             "; exit $rc";
  Job full = run("unshare -m sh -c '" + script + "'");
  if (full.rc == 99) GTEST_SKIP() << "cannot mount a tmpfs: " << full.log;
  EXPECT_NE(full.rc, 0) << full.log;
  EXPECT_NE(full.rc, 124) << full.log;
  EXPECT_NE(full.log.find("cannot write --output " + on_small.string() + ": No space left on device"),
            std::string::npos)
      << full.log;
  const std::string text = glm5::testing::slurp(kept);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n') << "a partial record was left behind";
  const size_t partial = records(kept).size();  // every line parses
  EXPECT_GT(partial, 0u);
  EXPECT_LT(partial, 120u);

  Job rest = run(kBin + batch(in, kept));
  ASSERT_EQ(rest.rc, 0) << rest.log;
  const auto got = records(kept);
  ASSERT_EQ(got.size(), 120u);
  for (auto& [id, rec] : want) EXPECT_EQ(token_ids(got.at(id)), token_ids(rec)) << id;
}

// OpenAI fields we do not implement are refused per request (never silently ignored); their
// default values and metadata pass.
TEST(Jobs, UnsupportedFieldsGetAnErrorRecord) {
  const fs::path in = scratch("fields.jsonl"), out = scratch("fields_out.jsonl");
  {
    std::ofstream f(in);
    auto line = [&](const std::string& id, json extra) {
      json b = {{"custom_id", id}, {"prompt", {1, 2, 3}}, {"max_tokens", 2}, {"temperature", 0}};
      b.update(extra);
      f << b.dump() << "\n";
    };
    line("n2", {{"n", 100}});
    line("n1", {{"n", 1}, {"stream", false}, {"user", "u"}, {"echo", false}});
    line("best_of", {{"best_of", 3}});
    line("tools", {{"tools", json::array()}});
    line("bias", {{"logit_bias", {{"5", 10}}}});
    line("stream", {{"stream", true}});
  }
  fs::remove(out);
  Job j = run(kBin + batch(in, out));
  ASSERT_EQ(j.rc, 0) << j.log;
  auto got = records(out);
  ASSERT_EQ(got.size(), 6u);
  EXPECT_TRUE(got["n1"]["error"].is_null()) << got["n1"].dump();
  const std::map<std::string, std::string> expect = {
      {"n2", "field 'n': expected an integer in [1, 64], found 100"},
      {"best_of", "field 'best_of': only best_of = n (1) is supported, found 3"},
      {"tools", "field 'tools' is not supported"},
      {"bias", "field 'logit_bias'"},
      {"stream", "field 'stream': only false"}};
  for (auto& [id, msg] : expect) {
    ASSERT_TRUE(got[id]["error"].is_object()) << id << ": " << got[id].dump();
    EXPECT_NE(got[id]["error"]["message"].get<std::string>().find(msg), std::string::npos) << got[id].dump();
  }
}

// With a stop string: token_ids, logprobs and usage describe the same tokens (up to and including
// the one that completes the stop string), and text is their decoding cut before it.
TEST(Jobs, StopStringKeepsTextTokensLogprobsAndUsageTogether) {
  const fs::path free_in = scratch("stop_free.jsonl"), free_out = scratch("stop_free_out.jsonl");
  std::ofstream(free_in)
      << json({{"custom_id", "a"}, {"prompt", "Hello"}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}})
             .dump()
      << "\n";
  fs::remove(free_out);
  ASSERT_EQ(run(kBin + batch(free_in, free_out)).rc, 0);
  const json free_rec = records(free_out)["a"];
  const std::string text = free_rec["response"]["body"]["choices"][0]["text"];
  ASSERT_GE(text.size(), 8u) << text;
  const std::string stop = text.substr(text.size() / 2, 2);  // two bytes from the middle
  const size_t at = text.find(stop);

  const fs::path in = scratch("stop.jsonl"), out = scratch("stop_out.jsonl");
  std::ofstream(in) << json({{"custom_id", "a"},
                             {"prompt", "Hello"},
                             {"max_tokens", 24},
                             {"temperature", 0},
                             {"ignore_eos", true},
                             {"stop", {stop}},
                             {"logprobs", 1}})
                           .dump()
                    << "\n";
  fs::remove(out);
  ASSERT_EQ(run(kBin + batch(in, out)).rc, 0);
  const json rec = records(out)["a"];
  const json& choice = rec["response"]["body"]["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "stop");
  EXPECT_EQ(choice["text"], text.substr(0, at));
  const auto ids = choice["token_ids"].get<std::vector<int>>();
  EXPECT_LT(ids.size(), token_ids(free_rec).size());
  EXPECT_EQ(rec["response"]["body"]["usage"]["completion_tokens"], ids.size());
  EXPECT_EQ(choice["logprobs"]["token_logprobs"].size(), ids.size());
  EXPECT_EQ(choice["logprobs"]["tokens"].size(), ids.size());
  const auto all = token_ids(free_rec);
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), all.begin()));
}

// OpenAI `n`: one record with n choices; choice j samples exactly as a lone request with seed
// seed + j * 0x9e3779b97f4a7c15 would; usage sums the choices; the choices share the prompt's
// full blocks (the report counts the prefix hits), and everything holds on a 2-stage pipeline.
TEST(Jobs, NChoicesShareThePromptAndMatchLoneRequests) {
  json prompt = json::array();
  for (int t = 0; t < 140; ++t) prompt.push_back((t * 37 + 11) % 500);
  const fs::path in = scratch("n_in.jsonl"), out = scratch("n_out.jsonl"), rep = scratch("n_rep.json");
  std::ofstream(in) << json({{"custom_id", "multi"},
                             {"prompt", prompt},
                             {"max_tokens", 6},
                             {"temperature", 0.9},
                             {"seed", 5},
                             {"n", 4},
                             {"ignore_eos", true},
                             {"logprobs", 0}})
                           .dump()
                    << "\n";
  const fs::path lone_in = scratch("n_lone.jsonl"), lone_out = scratch("n_lone_out.jsonl");
  {
    std::ofstream f(lone_in);
    for (uint64_t j = 0; j < 4; ++j)
      f << json({{"custom_id", "c" + std::to_string(j)},
                 {"prompt", prompt},
                 {"max_tokens", 6},
                 {"temperature", 0.9},
                 {"seed", 5 + j * 0x9e3779b97f4a7c15ull},
                 {"ignore_eos", true}})
               .dump()
        << "\n";
  }
  fs::remove(lone_out);
  ASSERT_EQ(run(kBin + batch(lone_in, lone_out)).rc, 0);
  auto lone = records(lone_out);
  for (const std::string cluster : {"", "cpu-pp2.yaml"}) {
    SCOPED_TRACE(cluster.empty() ? "one process" : cluster);
    fs::remove(out);
    const std::string cmd = cluster.empty() ? kBin + batch(in, out, "", rep.string())
                                            : glm5::testing::mpirun(2) + kBin +
                                                  batch(in, out, kSrc + "/cluster-configs/" + cluster, rep.string());
    Job j = run(cmd);
    ASSERT_EQ(j.rc, 0) << j.log;
    json rec = records(out)["multi"];
    ASSERT_TRUE(rec["error"].is_null()) << rec.dump();
    const json& choices = rec["response"]["body"]["choices"];
    ASSERT_EQ(choices.size(), 4u);
    size_t total = 0;
    std::set<std::vector<int>> distinct;
    for (int c = 0; c < 4; ++c) {
      EXPECT_EQ(choices[c]["index"], c);
      const auto ids = choices[c]["token_ids"].get<std::vector<int>>();
      EXPECT_EQ(ids, token_ids(lone["c" + std::to_string(c)])) << "choice " << c;
      EXPECT_EQ(choices[c]["logprobs"]["token_logprobs"].size(), ids.size());
      total += ids.size();
      distinct.insert(ids);
    }
    EXPECT_GT(distinct.size(), 1u) << "the choices did not sample differently";
    EXPECT_EQ(rec["response"]["body"]["usage"]["completion_tokens"], total);
    EXPECT_EQ(rec["response"]["body"]["usage"]["prompt_tokens"], 140);
    json r = json::parse(std::ifstream(rep));
    EXPECT_EQ(r["ranks"][0]["prefix_hit_tokens"], 3 * 128) << r.dump();  // 2 full blocks, 3 sharers
  }
}
