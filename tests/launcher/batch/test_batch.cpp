// `glm5 batch` as a user runs it: the 200-line mixed file (tests/data/batch/requests-200.jsonl,
// made by scripts/make_batch_requests.py) gives one record per non-blank line, the same records
// 1x1 and 2x2, error records that name the line and the problem; a SIGKILLed job rerun with the
// same command ends with each request answered once and the records of an uninterrupted run; a
// model without tokenizer serves id prompts only; a seeded request samples the same tokens
// whatever else is in the file. Runs the real glm5 executable (and mpirun).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "launcher/batch/batch_job.h"
#include "runtime/config.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
const std::string kModel = kData + "/tiny-a";
const std::string kRequests = kData + "/batch/requests-200.jsonl";
const std::string kCluster22 = kSrc + "/cluster-configs/cpu-pp2-ep2.yaml";

using glm5::testing::contains;
using glm5::testing::mpirun;
using glm5::testing::sh;
using glm5::testing::slurp;

const glm5::testing::ScratchDir scratch("glm5_batch");

std::string batch_cmd(const std::string& model, const fs::path& in, const fs::path& out) {
  return kBin + " batch --model " + model + " --input " + in.string() + " --output " + out.string();
}

// Runs `glm5 batch` to completion (1x1, or 2x2 under mpirun) and asserts exit code 0.
void run_batch(const std::string& model, const fs::path& in, const fs::path& out, bool distributed) {
  const fs::path log = out.string() + ".log";
  const std::string cmd =
      distributed ? mpirun(4) + batch_cmd(model, in, out) + " --cluster " + kCluster22 : batch_cmd(model, in, out);
  ASSERT_EQ(0, sh(cmd, log)) << cmd << "\n" << slurp(log);
}

// The input's lines (1-based), with whether each is blank and its JSON if it parses.
struct InputLine {
  int64_t line = 0;
  bool blank = false;
  bool parsed = false;
  json j;
};
std::vector<InputLine> read_input(const fs::path& p) {
  std::vector<InputLine> out;
  std::ifstream f(p);
  std::string text;
  int64_t n = 0;
  while (std::getline(f, text)) {
    InputLine l;
    l.line = ++n;
    l.blank = text.find_first_not_of(" \t\r") == std::string::npos;
    if (!l.blank) {
      try {
        l.j = json::parse(text);
        l.parsed = l.j.is_object();
      } catch (const json::exception&) {}
    }
    out.push_back(std::move(l));
  }
  return out;
}

// Output records by input line, the volatile fields (id, created, request_id) removed. Every
// line of the file must be a whole JSON record and each input line may have only one record.
std::map<int64_t, json> read_records(const fs::path& p) {
  std::map<int64_t, json> out;
  std::ifstream f(p);
  std::string text;
  int64_t n = 0;
  while (std::getline(f, text)) {
    ++n;
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      ADD_FAILURE() << p << " line " << n << " is not a JSON record: " << text.substr(0, 120);
      continue;
    }
    const int64_t line = j.at("line").get<int64_t>();
    EXPECT_EQ(out.count(line), 0u) << "a second record for input line " << line;
    j.erase("id");
    if (j["response"].is_object()) {
      j["response"].erase("request_id");
      j["response"]["body"].erase("id");
      j["response"]["body"].erase("created");
    }
    out[line] = std::move(j);
  }
  return out;
}

const json& body_of(const InputLine& l) { return l.j.contains("body") ? l.j["body"] : l.j; }
const json& choice_of(const json& rec) { return rec["response"]["body"]["choices"][0]; }
std::vector<int32_t> tokens_of(const json& rec) { return choice_of(rec)["token_ids"].get<std::vector<int32_t>>(); }

// The uninterrupted single-process run of the 200-line file, made once per test process.
const fs::path& reference_output() {
  static const fs::path out = [] {
    fs::path p = scratch("reference.jsonl");
    fs::remove(p);
    run_batch(kModel, kRequests, p, false);
    return p;
  }();
  return out;
}

// Error records the 200-line file must produce: custom_id -> (code, words the message names).
struct WantError {
  std::string code;
  std::vector<std::string> words;
};
const std::map<std::string, WantError> kWantErrors = {
    {"bad-no-prompt", {"invalid_request", {"missing field 'prompt'"}}},
    {"bad-temperature", {"invalid_request", {"temperature", "-1"}}},
    {"bad-top-p", {"invalid_request", {"top_p", "2"}}},
    {"bad-token-id", {"invalid_request", {"prompt_ids", "512", "515"}}},
    {"bad-url", {"invalid_request", {"url", "/v1/embeddings"}}},
    {"long-ids", {"context_length_exceeded", {"4100", "context", "4096"}}},
    {"long-prompt-list", {"context_length_exceeded", {"4100", "context", "4096"}}},
    {"long-with-max-tokens", {"context_length_exceeded", {"4090", "max_tokens 10", "4096"}}},
};

// Checks the records of the 200-line file against its input line by line.
void check_records_against_input(const std::map<int64_t, json>& recs) {
  const std::vector<InputLine> input = read_input(kRequests);
  ASSERT_EQ(input.size(), 200u);
  size_t non_blank = 0, errors = 0, served = 0, stopped = 0, with_logprobs = 0;
  std::set<std::string> ids_seen;
  for (const InputLine& l : input) {
    SCOPED_TRACE("input line " + std::to_string(l.line));
    if (l.blank) {
      EXPECT_EQ(recs.count(l.line), 0u) << "a blank line got a record";
      continue;
    }
    ++non_blank;
    auto it = recs.find(l.line);
    ASSERT_NE(it, recs.end()) << "no record";
    const json& rec = it->second;
    const std::string line_ref = "line " + std::to_string(l.line);
    if (!l.parsed) {  // not JSON
      ++errors;
      ASSERT_TRUE(rec["error"].is_object());
      EXPECT_EQ(rec["error"]["code"], "invalid_json");
      const std::string msg = rec["error"]["message"];
      EXPECT_TRUE(contains(msg, line_ref) && contains(msg, "JSON")) << msg;
      continue;
    }
    const std::string cid = l.j.at("custom_id");
    EXPECT_EQ(rec["custom_id"], cid);
    const bool duplicate = !ids_seen.insert(cid).second;
    if (duplicate || kWantErrors.count(cid)) {
      ++errors;
      ASSERT_TRUE(rec["error"].is_object()) << rec.dump();
      EXPECT_TRUE(rec["response"].is_null());
      const std::string msg = rec["error"]["message"];
      EXPECT_TRUE(contains(msg, line_ref)) << "the message should name the line: " << msg;
      if (duplicate) {
        EXPECT_EQ(rec["error"]["code"], "duplicate_custom_id");
        EXPECT_TRUE(contains(msg, cid)) << msg;
      } else {
        const WantError& w = kWantErrors.at(cid);
        EXPECT_EQ(rec["error"]["code"], w.code) << msg;
        for (const std::string& word : w.words) EXPECT_TRUE(contains(msg, word)) << "'" << word << "' in " << msg;
      }
      continue;
    }
    // A served request.
    ++served;
    ASSERT_TRUE(rec["error"].is_null()) << rec.dump();
    ASSERT_EQ(rec["response"]["status_code"], 200);
    const json& b = body_of(l);
    const json& body = rec["response"]["body"];
    const json& ch = choice_of(rec);
    const bool chat = l.j.value("url", "") == "/v1/chat/completions";
    EXPECT_EQ(body["object"], chat ? "chat.completion" : "text_completion");
    const std::vector<int32_t> toks = tokens_of(rec);
    const int max_tokens = b["max_tokens"];
    ASSERT_GE(toks.size(), 1u);
    ASSERT_LE(toks.size(), size_t(max_tokens));
    for (int32_t t : toks) EXPECT_TRUE(t >= 0 && t < 512) << t;
    EXPECT_EQ(body["usage"]["completion_tokens"], toks.size());
    const json* ids = b.contains("prompt_ids")                           ? &b["prompt_ids"]
                      : (b.contains("prompt") && b["prompt"].is_array()) ? &b["prompt"]
                                                                         : nullptr;
    if (ids) {
      EXPECT_EQ(body["usage"]["prompt_tokens"], ids->size());
    } else {
      EXPECT_GE(body["usage"]["prompt_tokens"].get<int>(), 1);
    }
    const std::string finish = ch["finish_reason"];
    EXPECT_TRUE(finish == "length" || finish == "stop") << finish;
    if (toks.size() < size_t(max_tokens)) {
      EXPECT_EQ(finish, "stop") << "ended early";
    }
    const std::string text = chat ? ch["message"]["content"].get<std::string>() : ch["text"].get<std::string>();
    if (b.contains("stop")) {
      std::vector<std::string> stops =
          b["stop"].is_string() ? std::vector<std::string>{b["stop"]} : b["stop"].get<std::vector<std::string>>();
      for (const std::string& s : stops) EXPECT_FALSE(contains(text, s)) << "stop '" << s << "' in " << text;
      stopped += finish == "stop";
    }
    const bool want_lp = b.contains("logprobs") && !(b["logprobs"].is_boolean() && !b["logprobs"].get<bool>());
    if (want_lp) {
      ++with_logprobs;
      ASSERT_TRUE(ch["logprobs"].is_object()) << rec.dump();
      const auto lps = ch["logprobs"]["token_logprobs"].get<std::vector<double>>();
      ASSERT_EQ(lps.size(), toks.size());
      for (double x : lps) EXPECT_LE(x, 0.0);
    } else {
      EXPECT_TRUE(ch["logprobs"].is_null());
    }
  }
  EXPECT_EQ(recs.size(), non_blank) << "one record per non-blank input line";
  EXPECT_EQ(errors, 10u);  // 6 malformed, 3 over-long, 1 duplicate
  EXPECT_GE(served, 180u);
  EXPECT_GE(with_logprobs, 10u);
  EXPECT_GE(stopped, 1u) << "no request ended on a stop string";
}

TEST(Batch, MixedFileSingleProcessAnd2x2GiveTheSameRecords) {
  const auto want = read_records(reference_output());
  check_records_against_input(want);

  const fs::path out = scratch("pp2-ep2.jsonl");
  fs::remove(out);
  run_batch(kModel, kRequests, out, true);
  const auto got = read_records(out);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [line, rec] : want) {
    auto it = got.find(line);
    ASSERT_NE(it, got.end()) << "2x2 has no record for line " << line;
    EXPECT_EQ(it->second, rec) << "line " << line << " differs between 1x1 and 2x2";
  }
}

// Starts `glm5 batch` in the background and SIGKILLs it as soon as the output holds a served
// record. Returns false when the job ended before it could be killed.
bool run_and_kill(const fs::path& in, const fs::path& out) {
  const fs::path log = out.string() + ".killed.log";
  setenv("OMP_NUM_THREADS", "1", 1);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    execl(kBin.c_str(), kBin.c_str(), "batch", "--model", kModel.c_str(), "--input", in.c_str(), "--output",
          out.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  for (int i = 0; i < 600000; ++i) {  // at most ~10 minutes
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return false;  // finished on its own
    if (contains(slurp(out), "\"status_code\":200")) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    }
    usleep(1000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return false;
}

TEST(Batch, ResumeAfterSigkillAnswersEachRequestOnce) {
  const auto want = read_records(reference_output());
  const fs::path out = scratch("resume.jsonl");
  bool killed = false;
  for (int attempt = 0; attempt < 3 && !killed; ++attempt) {
    fs::remove(out);
    killed = run_and_kill(kRequests, out);
  }
  ASSERT_TRUE(killed) << "the job always finished before it could be killed";

  std::string text = slurp(out);
  const size_t records_at_kill = size_t(std::count(text.begin(), text.end(), '\n'));
  ASSERT_LT(records_at_kill, want.size()) << "the kill came after the last record";
  // As if the kill had come earlier: drop the served record of req-012 (whose custom_id a later
  // line repeats, and whose duplicate error record is already written), then cut the last record
  // in half, as a kill in the middle of a write leaves it.
  {
    std::stringstream in(text);
    std::string l, kept;
    while (std::getline(in, l))
      if (!(contains(l, "\"custom_id\":\"req-012\"") && contains(l, "\"status_code\":200"))) kept += l + "\n";
    const size_t last = kept.rfind('\n', kept.size() - 2);
    const size_t start = last == std::string::npos ? 0 : last + 1;
    kept.resize(start + (kept.size() - start) / 2);
    std::ofstream(out, std::ios::binary | std::ios::trunc) << kept;
  }

  const fs::path log = scratch("resume.log");
  ASSERT_EQ(0, sh(batch_cmd(kModel, kRequests, out), log)) << slurp(log);
  const auto got = read_records(out);  // fails on any line that is not a whole record
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [line, rec] : want) {
    auto it = got.find(line);
    ASSERT_NE(it, got.end()) << "after the rerun there is no record for line " << line;
    EXPECT_EQ(it->second, rec) << "line " << line << " differs from the uninterrupted run";
  }

  // A third run finds everything done and leaves the file as it is.
  const std::string before = slurp(out);
  ASSERT_EQ(0, sh(batch_cmd(kModel, kRequests, out), log)) << slurp(log);
  EXPECT_EQ(slurp(out), before);
  EXPECT_TRUE(contains(slurp(log), "ran 0 requests")) << slurp(log);
}

TEST(Batch, ModelWithoutTokenizerServesTokenIdPrompts) {
  const std::string model = kData + "/tiny-b";
  ASSERT_FALSE(fs::exists(model + "/tokenizer.json"));
  const std::vector<int> ids = {5, 17, 250, 3, 699, 42, 8};
  const fs::path in = scratch("tiny-b.jsonl");
  {
    std::ofstream f(in);
    f << json({{"custom_id", "ids"}, {"prompt_ids", ids}, {"max_tokens", 5}, {"temperature", 0}, {"logprobs", 2}})
             .dump()
      << "\n";
    f << json({{"custom_id", "list"},
               {"method", "POST"},
               {"url", "/v1/completions"},
               {"body", {{"prompt", {1, 2, 3}}, {"max_tokens", 3}, {"temperature", 0.8}, {"seed", 5}}}})
             .dump()
      << "\n";
    f << json({{"custom_id", "text"},
               {"method", "POST"},
               {"url", "/v1/completions"},
               {"body", {{"prompt", "hello world"}, {"max_tokens", 3}}}})
             .dump()
      << "\n";
    f << json({{"custom_id", "chat"},
               {"method", "POST"},
               {"url", "/v1/chat/completions"},
               {"body", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 3}}}})
             .dump()
      << "\n";
    f << json({{"custom_id", "stop"}, {"prompt_ids", {4, 5}}, {"max_tokens", 3}, {"stop", "x"}}).dump() << "\n";
  }
  const fs::path out = scratch("tiny-b-out.jsonl");
  fs::remove(out);
  run_batch(model, in, out, false);
  std::map<std::string, json> by_id;
  for (auto& [line, rec] : read_records(out)) by_id[rec["custom_id"]] = rec;
  ASSERT_EQ(by_id.size(), 5u);
  for (const char* id : {"ids", "list"}) {
    SCOPED_TRACE(id);
    const json& rec = by_id[id];
    ASSERT_TRUE(rec["error"].is_null()) << rec.dump();
    EXPECT_EQ(choice_of(rec)["text"], "");
    EXPECT_FALSE(tokens_of(rec).empty());
  }
  // Without a tokenizer, logprob tokens are the ids as text.
  const json& lp = choice_of(by_id["ids"])["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), tokens_of(by_id["ids"]).size());
  EXPECT_EQ(lp["tokens"][0], std::to_string(tokens_of(by_id["ids"])[0]));
  for (const char* id : {"text", "chat", "stop"}) {
    SCOPED_TRACE(id);
    const json& rec = by_id[id];
    ASSERT_TRUE(rec["error"].is_object()) << rec.dump();
    EXPECT_TRUE(rec["response"].is_null());
    const std::string msg = rec["error"]["message"];
    EXPECT_TRUE(contains(msg, "tokenizer")) << msg;
  }
  EXPECT_TRUE(contains(by_id["text"]["error"]["message"], "'prompt'"));

  // Greedy batch tokens equal `glm5 generate` on the same prompt.
  std::string csv;
  for (int x : ids) csv += (csv.empty() ? "" : ",") + std::to_string(x);
  const fs::path log = scratch("tiny-b-generate.out"), err = scratch("tiny-b-generate.err");
  ASSERT_EQ(0, sh(kBin + " generate --model " + model + " --prompt-ids " + csv + " --max-new-tokens 5 --temperature 0",
                  log, err))
      << slurp(err);
  const json gen = json::parse(slurp(log));
  EXPECT_EQ(gen["token_ids"].get<std::vector<int32_t>>(), tokens_of(by_id["ids"]));
  EXPECT_FALSE(gen.contains("text"));
}

json probe_request(const std::string& id, uint64_t seed) {
  std::vector<int> prompt;
  for (int i = 0; i < 30; ++i) prompt.push_back((i * 37 + 11) % 503);
  return {{"custom_id", id}, {"prompt_ids", prompt}, {"max_tokens", 12},   {"temperature", 0.9}, {"top_p", 0.95},
          {"top_k", 40},     {"seed", seed},         {"ignore_eos", true}, {"logprobs", 1}};
}

TEST(Batch, SeededRequestSamplesTheSameWhateverElseIsInTheFile) {
  // Alone.
  const fs::path alone = scratch("seed-alone.jsonl"), alone_out = scratch("seed-alone-out.jsonl");
  std::ofstream(alone) << probe_request("probe", 1234).dump() << "\n";
  // Among others, at another line, with a neighbour that differs only in its seed.
  const fs::path mixed = scratch("seed-mixed.jsonl"), mixed_out = scratch("seed-mixed-out.jsonl");
  {
    std::ofstream f(mixed);
    for (int i = 0; i < 12; ++i) {
      if (i == 7) f << probe_request("probe", 1234).dump() << "\n";
      if (i == 9) f << probe_request("other-seed", 1235).dump() << "\n";
      std::vector<int> p;
      for (int t = 0; t < 1 + 13 * i; ++t) p.push_back((t * 7 + i * 101) % 503);
      f << json({{"custom_id", "n" + std::to_string(i)},
                 {"prompt_ids", p},
                 {"max_tokens", 1 + i % 7},
                 {"temperature", i % 3 ? 1.0 : 0.0},
                 {"seed", i}})
               .dump()
        << "\n";
    }
  }
  for (auto* p : {&alone_out, &mixed_out}) fs::remove(*p);
  run_batch(kModel, alone, alone_out, false);
  run_batch(kModel, mixed, mixed_out, false);
  const fs::path mixed_out22 = scratch("seed-mixed-out-2x2.jsonl");
  fs::remove(mixed_out22);
  run_batch(kModel, mixed, mixed_out22, true);

  auto find = [](const fs::path& p, const std::string& id) {
    for (auto& [line, rec] : read_records(p))
      if (rec["custom_id"] == id) return rec;
    ADD_FAILURE() << "no record " << id << " in " << p;
    return json();
  };
  const json a = find(alone_out, "probe"), m = find(mixed_out, "probe"), m22 = find(mixed_out22, "probe");
  ASSERT_TRUE(a["error"].is_null() && m["error"].is_null() && m22["error"].is_null());
  EXPECT_EQ(tokens_of(a).size(), 12u);
  EXPECT_EQ(tokens_of(m), tokens_of(a));
  EXPECT_EQ(tokens_of(m22), tokens_of(a));
  EXPECT_EQ(choice_of(m)["logprobs"], choice_of(a)["logprobs"]);
  EXPECT_NE(tokens_of(find(mixed_out, "other-seed")), tokens_of(a)) << "the seed changes nothing";

  // Seeded and greedy requests of the 200-line file, run on their own in another order, sample
  // what they sampled in the full file.
  const std::vector<InputLine> input = read_input(kRequests);
  const auto full = read_records(reference_output());
  const fs::path sub = scratch("subset.jsonl"), sub_out = scratch("subset-out.jsonl");
  std::map<std::string, std::vector<int32_t>> want;
  {
    std::ofstream f(sub);
    for (auto it = input.rbegin(); it != input.rend() && want.size() < 12; ++it) {
      if (!it->parsed || it->line % 5 != 0) continue;
      const json& b = body_of(*it);
      const bool seeded = b.contains("seed") || b.value("temperature", 1.0) == 0.0;
      auto rec = full.find(it->line);
      if (!seeded || rec == full.end() || !rec->second["error"].is_null()) continue;
      want[it->j.at("custom_id")] = tokens_of(rec->second);
      f << it->j.dump() << "\n";
    }
  }
  ASSERT_GE(want.size(), 8u);
  fs::remove(sub_out);
  run_batch(kModel, sub, sub_out, false);
  for (auto& [line, rec] : read_records(sub_out)) {
    ASSERT_TRUE(rec["error"].is_null()) << rec.dump();
    EXPECT_EQ(tokens_of(rec), want[rec["custom_id"]]) << rec["custom_id"];
  }
}

// parse_batch_line on single lines: a field of the wrong type or range is an invalid_request
// naming the line and the field (never "malformed JSON", never a wrapped value).
TEST(BatchLines, FieldErrorsNameTheLineAndTheField) {
  const glm5::runtime::ModelConfig mc = glm5::runtime::load_config(kModel);
  const glm5::runtime::Tokenizer tok = glm5::runtime::Tokenizer::load(kModel);
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {R"({"custom_id": "a", "prompt_ids": [1], "ignore_eos": "yes"})", {"ignore_eos", "\"yes\""}},
      {R"({"custom_id": "a", "prompt_ids": [1], "max_tokens": 4294967297})", {"max_tokens", "4294967297"}},
      {R"({"custom_id": "a", "prompt_ids": [1], "max_tokens": 2.5})", {"max_tokens", "2.5"}},
      {R"({"custom_id": "a", "prompt_ids": [1], "seed": -1})", {"seed", "-1"}},
      {R"({"custom_id": "a", "prompt_ids": [1], "temperature": "hot"})", {"temperature", "hot"}},
      {R"({"custom_id": "a", "prompt_ids": [1], "logprobs": true, "top_logprobs": "x"})", {"top_logprobs"}},
      {R"({"custom_id": "a", "prompt_ids": [1], "logprobs": 50})", {"logprobs", "50"}},
      {R"({"custom_id": "a", "prompt_ids": [1], "stop": [1]})", {"stop"}},
      {R"({"custom_id": "a", "prompt_ids": []})", {"prompt", "empty"}},
      {R"({"custom_id": "a", "prompt": {"text": "x"}})", {"prompt"}},
      {R"({"custom_id": 7, "prompt_ids": [1]})", {"custom_id", "7"}},
      {R"({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}],
           "chat_template_kwargs": {"enable_thinking": "no"}})",
       {"enable_thinking"}},
      {R"({"custom_id": "a", "messages": [{"role": "user"}]})", {"messages", "content"}},
      {R"({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}})", {"method", "GET"}},
      {R"([1, 2, 3])", {"JSON object"}},
  };
  for (const auto& [text, words] : bad) {
    SCOPED_TRACE(text);
    const glm5::launcher::BatchLine b = glm5::launcher::parse_batch_line(text, 3, mc, &tok);
    EXPECT_EQ(b.error_code, "invalid_request");
    EXPECT_TRUE(contains(b.error, "line 3: ")) << b.error;
    for (const std::string& w : words) EXPECT_TRUE(contains(b.error, w)) << "'" << w << "' in " << b.error;
  }
  const glm5::launcher::BatchLine cut = glm5::launcher::parse_batch_line(R"({"custom_id": "a", "pro)", 4, mc, &tok);
  EXPECT_EQ(cut.error_code, "invalid_json");
  EXPECT_TRUE(contains(cut.error, "line 4: malformed JSON")) << cut.error;

  // A good line: every field read.
  const glm5::launcher::BatchLine ok = glm5::launcher::parse_batch_line(
      R"({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": [4, 5, 6],
          "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 18446744073709551615,
          "logprobs": 2, "ignore_eos": true, "model": "m"}})",
      9, mc, &tok);
  EXPECT_TRUE(ok.error.empty()) << ok.error;
  EXPECT_EQ(ok.key, "id:x");
  EXPECT_EQ(ok.model_name, "m");
  EXPECT_EQ(ok.request.prompt, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(ok.request.sampling.max_tokens, 7);
  EXPECT_FLOAT_EQ(ok.request.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(ok.request.sampling.top_p, 0.9f);
  EXPECT_EQ(ok.request.sampling.top_k, 3);
  EXPECT_EQ(ok.request.sampling.seed, 18446744073709551615ull);
  EXPECT_EQ(ok.request.sampling.logprobs, 2);
  EXPECT_TRUE(ok.request.sampling.ignore_eos);
}

// A line nested deeper than the JSON depth limit gets an invalid_json record naming the limit (a
// value 200,000 deep overflowed the stack in the error message's dump); field errors quote a
// client value cut to ~100 characters.
TEST(BatchLines, DeepOrHugeValuesGiveBoundedErrors) {
  const glm5::runtime::ModelConfig mc = glm5::runtime::load_config(kModel);
  const glm5::runtime::Tokenizer tok = glm5::runtime::Tokenizer::load(kModel);
  const std::string deep =
      R"({"custom_id": "d", "prompt": )" + std::string(200000, '[') + std::string(200000, ']') + "}";
  const glm5::launcher::BatchLine b = glm5::launcher::parse_batch_line(deep, 5, mc, &tok);
  EXPECT_EQ(b.error_code, "invalid_json");
  EXPECT_TRUE(contains(b.error, "line 5: ")) << b.error;
  EXPECT_TRUE(contains(b.error, "64")) << b.error;
  const std::string rec = glm5::launcher::batch_record(b, {}, &tok, 0);
  EXPECT_TRUE(contains(rec, "invalid_json")) << rec;

  const std::string at_limit = R"({"prompt": )" + std::string(63, '[') + std::string(63, ']') + "}";
  const glm5::launcher::BatchLine l = glm5::launcher::parse_batch_line(at_limit, 6, mc, &tok);
  EXPECT_EQ(l.error_code, "invalid_request") << l.error;  // parsed; the prompt is still wrong

  const glm5::launcher::BatchLine h =
      glm5::launcher::parse_batch_line(R"({"prompt": {"text": ")" + std::string(100000, 'x') + "\"}}", 7, mc, &tok);
  EXPECT_EQ(h.error_code, "invalid_request");
  EXPECT_TRUE(contains(h.error, "prompt")) << h.error;
  EXPECT_LT(h.error.size(), 400u) << h.error.size();

  using glm5::launcher::describe;
  using nlohmann::json;
  EXPECT_EQ(describe(json("many")), "\"many\"");
  EXPECT_EQ(describe(json(2.5)), "2.5");
  EXPECT_EQ(describe(json::parse("[1,[2,{\"a\":null}]]")), "[1,[2,{\"a\":null}]]");
  const std::string cut = describe(json(std::string(5000, 'y')));
  EXPECT_LT(cut.size(), 130u);
  EXPECT_TRUE(contains(cut, "5000 bytes")) << cut;
  EXPECT_TRUE(contains(describe(json(std::vector<int>(1000, 7))), "an array of 1000 elements"));
}

// glm5 batch over a too deep line: an error record, the next line answered, and a rerun finds
// both done (the deep line is keyed by its line number on both sides).
TEST(Batch, TooDeepLineGetsAnErrorRecordAndIsNotRunAgain) {
  const fs::path in = scratch("deep.jsonl"), out = scratch("deep.out.jsonl"), log = scratch("deep.log");
  std::ofstream(in) << R"({"custom_id": "deep", "prompt": )" << std::string(200000, '[') << std::string(200000, ']')
                    << "}\n"
                    << R"({"custom_id": "ok", "prompt_ids": [1, 2, 3], "max_tokens": 2})"
                    << "\n";
  fs::remove(out);
  ASSERT_EQ(0, sh(batch_cmd(kModel, in, out), log)) << slurp(log);
  const std::string first = slurp(out);
  EXPECT_TRUE(contains(first, "nested deeper than 64")) << first.substr(0, 300);
  EXPECT_TRUE(contains(first, R"("custom_id":"ok")")) << first.substr(0, 300);
  ASSERT_EQ(0, sh(batch_cmd(kModel, in, out), log)) << slurp(log);
  EXPECT_EQ(slurp(out), first);
}

// finished_keys: records by custom_id, by line when they have none or repeat an earlier id, and a
// record cut short is not finished.
TEST(BatchLines, FinishedKeys) {
  const fs::path out = scratch("finished.jsonl");
  std::ofstream(out) << R"({"custom_id": "a", "line": 1, "error": null, "response": {}})"
                     << "\n"
                     << R"({"custom_id": null, "line": 2, "error": {"code": "invalid_json"}})"
                     << "\n"
                     << R"({"custom_id": "a", "line": 5, "error": {"code": "duplicate_custom_id"}})"
                     << "\n"
                     << R"({"custom_id": "b", "line": 6, "err)";
  EXPECT_EQ(glm5::launcher::finished_keys(out.string()), (std::vector<std::string>{"id:a", "line:2", "line:5"}));
}

// A kill between a record and its newline: the rerun keeps the record, ends its line and adds
// nothing.
TEST(Batch, WholeLastRecordWithoutItsNewlineIsKept) {
  const fs::path in = scratch("newline.jsonl"), out = scratch("newline-out.jsonl");
  {
    std::ofstream f(in);
    for (int i = 0; i < 3; ++i)
      f << json({{"custom_id", "r" + std::to_string(i)}, {"prompt_ids", {1 + i, 2, 3}}, {"max_tokens", 2}}).dump()
        << "\n";
  }
  fs::remove(out);
  run_batch(kModel, in, out, false);
  const std::string full = slurp(out);
  ASSERT_EQ(std::count(full.begin(), full.end(), '\n'), 3);
  fs::resize_file(out, full.size() - 1);
  run_batch(kModel, in, out, false);
  EXPECT_EQ(slurp(out), full);
}

}  // namespace
