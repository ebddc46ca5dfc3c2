// Prompt logprobs ("echo") for /v1/completions and the tokenizer endpoints, as lm-evaluation-harness's
// local-completions model uses them: parsing (echo, max_tokens 0, the four prompt forms, the
// refusals), the choice JSON (prompt text first, prompt_token_ids, logprobs over prompt then
// completion tokens with null first entries, text_offset), /tokenize, /detokenize and
// /tokenizer_info's JSON, and `glm5 batch` with echo lines: prompt logprobs equal to the log-softmax
// of `glm5 generate --dump-logits`' prefill logits, the same records 1x1 and 2x2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "launcher/openai/openai_format.h"
#include "runtime/chat.h"
#include "runtime/config.h"
#include "runtime/safetensors.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using glm5::launcher::BatchLine;
using glm5::testing::contains;
using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSrc;
using glm5::testing::sh;
using glm5::testing::slurp;

const std::string kModel = kData + "/tiny-a";
const glm5::testing::ScratchDir scratch("glm5_echo");

struct Tiny {
  glm5::runtime::ModelConfig mc = glm5::runtime::load_config(kModel);
  glm5::runtime::Tokenizer tok = glm5::runtime::Tokenizer::load(kModel);
};
const Tiny& tiny() {
  static const Tiny t;
  return t;
}

BatchLine parse(const std::string& line) { return glm5::launcher::parse_batch_line(line, 2, tiny().mc, &tiny().tok); }

void expect_line_error(const std::string& line, const std::vector<std::string>& words) {
  SCOPED_TRACE(line);
  const BatchLine b = parse(line);
  EXPECT_EQ(b.error_code, "invalid_request") << b.error;
  for (const std::string& w : words) EXPECT_TRUE(contains(b.error, w)) << "'" << w << "' in " << b.error;
}

// A made-up engine result for a line: `generated` tokens with logprobs, and prompt logprobs
// (entry t - 1 scores prompt token t with -t / 10, its best alternative id 7 at -0.01).
glm5::runtime::Result fake_result(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated) {
  glm5::runtime::Result r;
  r.tokens = generated;
  r.finish_reason = "length";
  for (size_t i = 0; i < generated.size(); ++i) {
    r.logprobs.push_back(-0.5f * float(i + 1));
    r.top_logprobs.push_back({{generated[i], -0.5f * float(i + 1)}});
  }
  for (size_t t = 1; t < prompt.size(); ++t) r.prompt_logprobs.push_back({prompt[t], -float(t) / 10, {{7, -0.01f}}});
  return r;
}

// Code points of a UTF-8 string (what text_offset counts).
int64_t chars(const std::string& s) {
  int64_t n = 0;
  for (char c : s) n += (uint8_t(c) & 0xC0) != 0x80;
  return n;
}

TEST(OpenAiEcho, ParsesEchoPromptListsAndMaxTokensZero) {
  const BatchLine a = parse(R"({"prompt": [[1, 2, 3], [4, 5]], "echo": true, "logprobs": 1, "max_tokens": 0,
                               "n": 2, "seed": 9})");
  ASSERT_TRUE(a.error.empty()) << a.error;
  EXPECT_TRUE(a.echo);
  EXPECT_TRUE(a.prompt_only);
  EXPECT_EQ(a.request.sampling.max_tokens, 1);  // the engine samples one token, the answer drops it
  EXPECT_EQ(a.request.prompt_logprobs, 1);
  ASSERT_EQ(a.prompts.size(), 2u);
  EXPECT_EQ(a.prompts[1], (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(a.choices(), 4);
  EXPECT_EQ(glm5::launcher::prompt_tokens(a), 5u);
  const auto reqs = glm5::launcher::choice_requests(a);
  ASSERT_EQ(reqs.size(), 4u);
  EXPECT_EQ(reqs[0].prompt, a.prompts[0]);
  EXPECT_EQ(reqs[2].prompt, a.prompts[1]);  // choice i * n + j: prompt i
  EXPECT_EQ(reqs[0].sampling.seed, 9u);
  EXPECT_EQ(reqs[3].sampling.seed, 9u + glm5::launcher::kChoiceSeedStep);
  EXPECT_EQ(reqs[3].prompt_logprobs, 1);

  const BatchLine texts = parse(R"({"prompt": ["Hello", "Hi there"], "echo": true, "max_tokens": 3})");
  ASSERT_TRUE(texts.error.empty()) << texts.error;
  ASSERT_EQ(texts.prompts.size(), 2u);
  EXPECT_EQ(texts.prompts[1], tiny().tok.encode("Hi there"));
  EXPECT_EQ(texts.request.prompt_logprobs, -1);  // echo without logprobs: the text only
  EXPECT_FALSE(texts.prompt_only);

  const BatchLine off = parse(R"({"prompt": "Hello", "echo": false, "max_tokens": 3})");
  EXPECT_TRUE(off.error.empty()) << off.error;
  EXPECT_FALSE(off.echo);
  const BatchLine chat_off = parse(R"({"messages": [{"role": "user", "content": "Hi"}], "echo": false})");
  EXPECT_TRUE(chat_off.error.empty()) << chat_off.error;

  expect_line_error(R"({"prompt_ids": [1, 2], "max_tokens": 0})", {"line 2: ", "max_tokens", "0"});
  expect_line_error(R"({"prompt": "Hi", "echo": false, "max_tokens": 0})", {"max_tokens"});
  expect_line_error(R"({"messages": [{"role": "user", "content": "Hi"}], "echo": true})",
                    {"field 'echo'", "/v1/chat/completions"});
  expect_line_error(R"({"prompt": "x", "echo": "yes"})", {"field 'echo'", "\"yes\""});
  expect_line_error(R"({"prompt": [[1, 2], []], "echo": true})", {"field 'prompt'", "empty", "prompt 1"});
  expect_line_error(R"({"prompt": [[1, 2], 3]})", {"field 'prompt'", "index 1"});
  expect_line_error(R"({"prompt": [[1, 600]]})", {"field 'prompt'", "600"});
  expect_line_error(R"({"prompt": ["ok", {"a": 1}]})", {"field 'prompt'"});
}

TEST(OpenAiEcho, ChoicePutsThePromptBeforeTheCompletion) {
  const glm5::runtime::Tokenizer& tok = tiny().tok;
  const std::vector<int32_t> prompt = tok.encode("Hello world, again");
  ASSERT_GE(prompt.size(), 3u);
  json body = {{"prompt", prompt}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 2}};
  const BatchLine b = parse(body.dump());
  ASSERT_TRUE(b.error.empty()) << b.error;
  const std::vector<int32_t> gen = {tok.encode(" yes")[0], tok.encode(" no")[0]};
  const glm5::runtime::Result r = fake_result(prompt, gen);
  const json c = glm5::launcher::choice_json(b, r, &tok, 0);
  EXPECT_EQ(c["text"], tok.decode(prompt) + tok.decode(gen, true));
  EXPECT_EQ(c["prompt_token_ids"], json(prompt));
  EXPECT_EQ(c["token_ids"], json(gen));
  const json& lp = c["logprobs"];
  const size_t P = prompt.size();
  ASSERT_EQ(lp["tokens"].size(), P + 2);
  ASSERT_EQ(lp["token_logprobs"].size(), P + 2);
  ASSERT_EQ(lp["top_logprobs"].size(), P + 2);
  ASSERT_EQ(lp["text_offset"].size(), P + 2);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  int64_t offset = 0;
  for (size_t i = 0; i < P + 2; ++i) {
    SCOPED_TRACE(i);
    const int32_t id = i < P ? prompt[i] : gen[i - P];
    EXPECT_EQ(lp["tokens"][i], tok.decode({id}));
    EXPECT_EQ(lp["text_offset"][i], offset);
    offset += chars(tok.decode({id}));
    if (i == 0) continue;
    const float want = i < P ? -float(i) / 10 : -0.5f * float(i - P + 1);
    EXPECT_EQ(lp["token_logprobs"][i].get<float>(), want);
    const json& top = lp["top_logprobs"][i];
    EXPECT_EQ(top[tok.decode({id})].get<float>(), want);  // the token itself, as vLLM lists it
    if (i < P) {
      EXPECT_EQ(top[tok.decode({7})].get<float>(), -0.01f);
    }
  }
  EXPECT_EQ(offset, chars(c["text"]));  // ASCII text: every token's text in order
  const json whole = glm5::launcher::completion_json(b, {r}, &tok, "cmpl-1", "m");
  EXPECT_EQ(whole["usage"]["prompt_tokens"], P);
  EXPECT_EQ(whole["usage"]["completion_tokens"], 2);

  // max_tokens 0: the prompt alone, finish "length", no completion tokens in ids or usage.
  body["max_tokens"] = 0;
  const BatchLine only = parse(body.dump());
  ASSERT_TRUE(only.prompt_only) << only.error;
  const json o = glm5::launcher::completion_json(only, {r}, &tok, "cmpl-2", "m");
  const json& oc = o["choices"][0];
  EXPECT_EQ(oc["text"], tok.decode(prompt));
  EXPECT_EQ(oc["finish_reason"], "length");
  EXPECT_EQ(oc["token_ids"], json::array());
  EXPECT_EQ(oc["logprobs"]["token_logprobs"].size(), P);
  EXPECT_EQ(o["usage"]["completion_tokens"], 0);

  // Without echo: the completion alone, as before (plus text_offset).
  body.erase("echo");
  body["max_tokens"] = 2;
  const json n = glm5::launcher::choice_json(parse(body.dump()), r, &tok, 0);
  EXPECT_EQ(n["text"], tok.decode(gen, true));
  EXPECT_FALSE(n.contains("prompt_token_ids"));
  EXPECT_EQ(n["logprobs"]["token_logprobs"], json::parse("[-0.5, -1.0]"));
  EXPECT_EQ(n["logprobs"]["text_offset"], json({0, chars(tok.decode({gen[0]}))}));

  // A token holding one byte of a multi-byte character reads as U+FFFD: one character.
  std::vector<int32_t> partials;  // tokens of one continuation byte each
  for (int32_t id = 0; id < 256; ++id) {
    const std::string b = tok.decode({id});
    if (b.size() == 1 && (uint8_t(b[0]) & 0xC0) == 0x80) partials.push_back(id);
  }
  ASSERT_GE(partials.size(), 2u);
  const int32_t partial = partials[0], other = partials[1];
  const BatchLine cut = parse(
      json({{"prompt", {partial, prompt[0], partial}}, {"echo", true}, {"logprobs", 0}, {"max_tokens", 0}}).dump());
  const json cj = glm5::launcher::choice_json(cut, fake_result({partial, prompt[0], partial}, {}), &tok, 0);
  const int64_t first = chars(tok.decode({prompt[0]}));
  EXPECT_EQ(cj["logprobs"]["text_offset"], json({0, 1, 1 + first}));
  EXPECT_EQ(cj["logprobs"]["tokens"][0], "\xEF\xBF\xBD");  // U+FFFD, as the client reads it
  // Another partial byte as the best alternative reads the same: one key, the token's own value.
  glm5::runtime::Result clash = fake_result({other, other}, {});
  clash.prompt_logprobs[0].top = {{partial, -0.25f}};
  const json kj = glm5::launcher::choice_json(
      parse(json({{"prompt", {other, other}}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 0}}).dump()), clash, &tok,
      0);
  EXPECT_EQ(kj["logprobs"]["top_logprobs"][1], json({{"\xEF\xBF\xBD", clash.prompt_logprobs[0].logprob}}));

  // A list of prompts: choice i answers prompt i.
  const BatchLine two = parse(R"({"prompt": [[1, 2, 3], [4, 5]], "echo": true, "max_tokens": 0})");
  const json t = glm5::launcher::completion_json(two, {fake_result({1, 2, 3}, {9}), fake_result({4, 5}, {9})}, &tok,
                                                 "cmpl-3", "m");
  EXPECT_EQ(t["choices"][1]["prompt_token_ids"], json({4, 5}));
  EXPECT_EQ(t["choices"][1]["index"], 1);
  EXPECT_EQ(t["usage"]["prompt_tokens"], 5);
}

TEST(OpenAiTokenize, TokenizeDetokenizeAndTheirErrors) {
  const Tiny& t = tiny();
  const std::string text = "[gMASK]<sop>Hello, world <|user|> again";
  const json a = glm5::launcher::tokenize_json({{"prompt", text}, {"add_special_tokens", false}}, t.mc, t.tok);
  EXPECT_EQ(a["tokens"], json(t.tok.encode(text, true)));
  EXPECT_EQ(a["count"], a["tokens"].size());
  EXPECT_EQ(a["max_model_len"], 4096);
  EXPECT_TRUE(a["token_strs"].is_null());
  EXPECT_EQ(t.tok.id_to_token(a["tokens"][0].get<int32_t>()), "[gMASK]");  // special tokens in the text are parsed
  const json back = glm5::launcher::detokenize_json({{"tokens", a["tokens"]}, {"model", "x"}}, t.mc, t.tok);
  EXPECT_EQ(back["prompt"], text);  // special tokens kept
  const json strs = glm5::launcher::tokenize_json({{"prompt", "Hi"}, {"return_token_strs", true}}, t.mc, t.tok);
  ASSERT_EQ(strs["token_strs"].size(), strs["tokens"].size());
  EXPECT_EQ(strs["token_strs"][0], t.tok.id_to_token(strs["tokens"][0].get<int32_t>()));

  const json msgs = json::array({{{"role", "user"}, {"content", "Hi"}}});
  const json chat = glm5::launcher::tokenize_json({{"messages", msgs}}, t.mc, t.tok);
  EXPECT_EQ(chat["tokens"],
            json(t.tok.encode(glm5::runtime::format_chat(t.mc.model_type, {{"user", "Hi", ""}}, true, true))));
  const json no_gen =
      glm5::launcher::tokenize_json({{"messages", msgs}, {"add_generation_prompt", false}}, t.mc, t.tok);
  EXPECT_LT(no_gen["count"].get<int>(), chat["count"].get<int>());

  using glm5::testing::expect_error;
  auto tokenize = [&](const json& body) { return [&, body] { glm5::launcher::tokenize_json(body, t.mc, t.tok); }; };
  auto detokenize = [&](const json& body) { return [&, body] { glm5::launcher::detokenize_json(body, t.mc, t.tok); }; };
  expect_error(tokenize(json::object()), {"'prompt'"});
  expect_error(tokenize({{"prompt", 5}}), {"field 'prompt'", "5"});
  expect_error(tokenize({{"prompt", "x"}, {"add_special_tokens", "yes"}}), {"field 'add_special_tokens'"});
  expect_error(tokenize({{"prompt", "x"}, {"frobnicate", 1}}), {"field 'frobnicate'"});
  expect_error(tokenize({{"messages", "hi"}}), {"field 'messages'"});
  expect_error(tokenize({{"messages", msgs}, {"continue_final_message", true}}), {"field 'continue_final_message'"});
  expect_error(tokenize(json::array()), {"JSON object"});
  expect_error(detokenize(json::object()), {"'tokens'"});
  expect_error(detokenize({{"tokens", {1, 512}}}), {"field 'tokens'", "512"});
  expect_error(detokenize({{"tokens", "abc"}}), {"field 'tokens'", "abc"});
  expect_error(detokenize({{"tokens", {1, -1}}}), {"field 'tokens'", "-1"});
}

TEST(OpenAiTokenize, TokenizerInfo) {
  const Tiny& t = tiny();
  const json a = glm5::launcher::tokenizer_info_json(t.mc, t.tok);  // tiny-a: no tokenizer_config.json
  EXPECT_EQ(a["eos_token"], t.tok.id_to_token(t.mc.eos_token_id[0]));
  EXPECT_EQ(a["model_max_length"], 4096);
  EXPECT_EQ(a["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_FALSE(a.contains("chat_template"));

  const fs::path dir = scratch("with-config");
  fs::create_directories(dir);
  fs::copy_file(kModel + "/tokenizer.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"eos_token": {"content": "<|endoftext|>", "special": true}, "pad_token": "<|endoftext|>",
            "vocab_file": "/somewhere/vocab.json", "model_max_length": 128000, "clean_up_tokenization_spaces": false})";
  std::ofstream(dir / "chat_template.jinja") << "{{ messages }}";
  const glm5::runtime::Tokenizer tok = glm5::runtime::Tokenizer::load(dir.string());
  const json b = glm5::launcher::tokenizer_info_json(t.mc, tok);
  EXPECT_EQ(b["eos_token"], "<|endoftext|>");
  EXPECT_EQ(b["pad_token"], "<|endoftext|>");
  EXPECT_FALSE(b.contains("vocab_file"));
  EXPECT_EQ(b["model_max_length"], 128000);
  EXPECT_EQ(b["clean_up_tokenization_spaces"], false);
  EXPECT_EQ(b["chat_template"], "{{ messages }}");
}

// log_softmax(rows[t - 1])[prompt[t]] in double, from `glm5 generate --dump-logits`.
std::vector<double> dumped_prompt_logprobs(const std::vector<int32_t>& prompt, const std::string& name) {
  const fs::path out = scratch(name + ".safetensors"), log = scratch(name + ".log");
  std::string ids;
  for (int32_t id : prompt) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(id);
  }
  const std::string cmd = kBin + " generate --model " + kModel + " --prompt-ids " + ids +
                          " --max-new-tokens 1 --temperature 0 --dump-logits " + out.string();
  EXPECT_EQ(0, sh(cmd, log)) << slurp(log);
  glm5::runtime::SafetensorsFile f(out.string());
  const glm5::runtime::TensorInfo* t = f.find("prefill_logits");
  EXPECT_TRUE(t);
  if (!t) return {};
  const int64_t V = t->shape[1];
  std::vector<float> rows(t->nbytes / sizeof(float));
  std::memcpy(rows.data(), t->data, t->nbytes);
  std::vector<double> out_lp;
  for (size_t p = 1; p < prompt.size(); ++p) {
    const float* row = rows.data() + (p - 1) * size_t(V);
    double mx = row[0], z = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < V; ++v) z += std::exp(double(row[v]) - mx);
    out_lp.push_back(double(row[prompt[p]]) - mx - std::log(z));
  }
  return out_lp;
}

// Records by custom_id, without the fields that differ between runs.
std::map<std::string, json> records(const fs::path& p) {
  std::map<std::string, json> out;
  std::ifstream f(p);
  std::string text;
  while (std::getline(f, text)) {
    json j = json::parse(text);
    j.erase("id");
    if (j["response"].is_object()) {
      j["response"].erase("request_id");
      j["response"]["body"].erase("id");
      j["response"]["body"].erase("created");
    }
    out[j["custom_id"].get<std::string>()] = j;
  }
  return out;
}

TEST(BatchEcho, PromptLogprobsAreTheDumpedLogitsLogSoftmaxOnEveryLayout) {
  std::vector<int32_t> p1, p2;
  for (int t = 0; t < 90; ++t) p1.push_back(int32_t((t * 37 + 11) % 500));
  for (int t = 0; t < 20; ++t) p2.push_back(int32_t((t * 13 + 5) % 500));
  const fs::path in = scratch("echo.jsonl");
  {
    std::ofstream f(in);
    f << json({{"custom_id", "ids"}, {"prompt", p1}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 0}}).dump()
      << "\n";
    f << json({{"custom_id", "lm-eval"},
               {"method", "POST"},
               {"url", "/v1/completions"},
               {"body",
                {{"prompt", {p2, p1}},
                 {"echo", true},
                 {"logprobs", 1},
                 {"max_tokens", 1},
                 {"temperature", 0},
                 {"seed", 1234}}}})
             .dump()
      << "\n";
    f << json({{"custom_id", "chat"}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"echo", true}}).dump()
      << "\n";
    f << json({{"custom_id", "text"}, {"prompt", "Hello"}, {"echo", true}, {"max_tokens", 3}}).dump() << "\n";
  }
  const fs::path out1 = scratch("echo.1x1.jsonl"), out4 = scratch("echo.2x2.jsonl");
  ASSERT_EQ(0, sh(kBin + " batch --model " + kModel + " --input " + in.string() + " --output " + out1.string(),
                  scratch("echo.1x1.log")))
      << slurp(scratch("echo.1x1.log"));
  const auto recs = records(out1);
  ASSERT_EQ(recs.size(), 4u);

  const json& ids = recs.at("ids")["response"]["body"]["choices"][0];
  const auto lps = ids["logprobs"]["token_logprobs"];
  ASSERT_EQ(lps.size(), p1.size());
  EXPECT_TRUE(lps[0].is_null());
  const std::vector<double> want = dumped_prompt_logprobs(p1, "p1");
  ASSERT_EQ(want.size(), p1.size() - 1);
  for (size_t t = 1; t < p1.size(); ++t) {
    EXPECT_LE(lps[t].get<double>(), 0.0) << t;
    EXPECT_NEAR(lps[t].get<double>(), want[t - 1], 1e-5) << t;
  }
  EXPECT_EQ(ids["token_ids"], json::array());
  EXPECT_EQ(ids["prompt_token_ids"], json(p1));

  // lm-eval's request: one choice per prompt, prompt + 1 generated token; prompt 1 is the line above.
  const json& lm = recs.at("lm-eval")["response"]["body"]["choices"];
  ASSERT_EQ(lm.size(), 2u);
  EXPECT_EQ(lm[0]["logprobs"]["token_logprobs"].size(), p2.size() + 1);
  EXPECT_EQ(lm[1]["prompt_token_ids"], json(p1));
  for (size_t t = 0; t < p1.size(); ++t) EXPECT_EQ(lm[1]["logprobs"]["token_logprobs"][t], lps[t]) << t;

  const json& chat = recs.at("chat");
  EXPECT_TRUE(chat["response"].is_null());
  EXPECT_TRUE(contains(chat["error"]["message"], "field 'echo'")) << chat.dump();
  const std::string text = recs.at("text")["response"]["body"]["choices"][0]["text"];
  EXPECT_EQ(text.rfind("Hello", 0), 0u) << text;

  // 2 stages x 2 expert columns: the prompt logprobs cross the pipeline; the same records.
  const std::string cmd = glm5::testing::mpirun(4) + kBin + " batch --model " + kModel + " --input " + in.string() +
                          " --output " + out4.string() + " --cluster " + kSrc + "/cluster-configs/cpu-pp2-ep2.yaml";
  ASSERT_EQ(0, sh(cmd, scratch("echo.2x2.log"))) << slurp(scratch("echo.2x2.log"));
  EXPECT_EQ(records(out4), recs);
}

}  // namespace
