// OpenAI request bodies and responses, shared by `glm5 batch` (JSONL lines) and `glm5 serve` (HTTP
// bodies): the fields we implement and their checks (one message naming the field, the expected and
// the found value), tokenization of prompts and chat messages, the completion JSON (echo: the
// prompt and its logprobs first), and the JSON of vLLM's tokenizer endpoints. Leaves out the
// transport: where the bytes come from and go.
#include "launcher/openai/openai_format.h"

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>

#include "kernels/core/check.h"
#include "runtime/chat.h"
#include "runtime/config.h"
#include "runtime/detokenizer.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::launcher {

using json = nlohmann::json;

JsonTooDeep::JsonTooDeep()
    : std::runtime_error("JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels (the limit)") {}

// nlohmann's parser keeps its own stack, but dump(), copies and comparisons recurse: a value
// nested 200,000 deep would overflow the thread's stack there. The callback sees every container
// as it opens, at its depth (the top level is 0), and stops the parse at the limit.
json parse_client_json(const std::string& text) {
  const json::parser_callback_t bound = [](int depth, json::parse_event_t event, json&) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth)
      throw JsonTooDeep();
    return true;
  };
  return json::parse(text, bound);
}

namespace {

constexpr size_t kDescribeChars = 100;

// Writes v as JSON into out until out reaches `limit` characters (the caller cuts the rest).
void preview(const json& v, std::string& out, size_t limit, int depth) {
  if (out.size() >= limit) return;
  if (depth > kMaxJsonDepth) {  // a value not from parse_client_json: stay bounded anyway
    out += "...";
    return;
  }
  if (!v.is_structured()) {
    std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
    out.append(s, 0, std::min(s.size(), limit - out.size() + 1));
    return;
  }
  const bool obj = v.is_object();
  out += obj ? '{' : '[';
  bool first = true;
  for (auto it = v.begin(); it != v.end() && out.size() < limit; ++it) {
    if (!first) out += ',';
    first = false;
    if (obj) out += json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ':';
    preview(*it, out, limit, depth + 1);
  }
  out += obj ? '}' : ']';
}

}  // namespace

std::string describe(const json& v) {
  std::string out;
  preview(v, out, kDescribeChars, 0);
  if (out.size() <= kDescribeChars) return out;
  out.resize(kDescribeChars);
  out += "...";
  if (v.is_array())
    out += " (an array of " + std::to_string(v.size()) + " elements)";
  else if (v.is_object())
    out += " (an object of " + std::to_string(v.size()) + " fields)";
  else if (v.is_string())
    out += " (" + std::to_string(v.get_ref<const std::string&>().size()) + " bytes)";
  return out;
}

namespace {

template <typename T>
bool read_number(const json& body, const char* key, T& out, std::string& err) {
  if (!body.contains(key) || body[key].is_null()) return true;
  const json& v = body[key];
  if (!v.is_number()) {
    err = std::string("field '") + key + "': expected a number, found " + describe(v);
    return false;
  }
  if constexpr (std::is_integral_v<T>) {
    // Out-of-range integers would wrap (max_tokens 4294967297 -> 1, seed -1 -> 2^64-1).
    using lim = std::numeric_limits<T>;
    bool fits = false;
    if (v.is_number_unsigned()) {
      fits = v.get<uint64_t>() <= uint64_t(lim::max());
    } else if (v.is_number_integer()) {
      const int64_t x = v.get<int64_t>();
      fits = x < 0 ? std::is_signed_v<T> && x >= int64_t(lim::min()) : uint64_t(x) <= uint64_t(lim::max());
    }
    if (!v.is_number_integer() || !fits) {
      err = std::string("field '") + key + "': expected an integer in [" + std::to_string(lim::min()) + ", " +
            std::to_string(lim::max()) + "], found " + describe(v);
      return false;
    }
  }
  out = v.get<T>();
  return true;
}

std::vector<int32_t> ids_from_json(const json& v, const char* field, int64_t vocab) {
  CHECK(v.is_array(), "field '", field, "': expected a list of token ids, found ", describe(v));
  std::vector<int32_t> ids;
  for (const json& x : v) {
    CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < vocab, "field '", field,
          "': expected token ids in [0, ", vocab, "), found ", describe(x));
    ids.push_back(x.get<int32_t>());
  }
  return ids;
}

// Fields the request body may carry: what we implement, metadata we may ignore, and OpenAI
// fields we accept only at their default value. Anything else is an error, never ignored.
void check_supported_fields(const json& body, BodyForm form) {
  static const std::set<std::string> implemented = {"model",
                                                    "prompt",
                                                    "prompt_ids",
                                                    "messages",
                                                    "max_tokens",
                                                    "max_completion_tokens",
                                                    "temperature",
                                                    "top_p",
                                                    "top_k",
                                                    "min_p",
                                                    "repetition_penalty",
                                                    "presence_penalty",
                                                    "frequency_penalty",
                                                    "seed",
                                                    "stop",
                                                    "logprobs",
                                                    "top_logprobs",
                                                    "ignore_eos",
                                                    "chat_template_kwargs",
                                                    "user",
                                                    "metadata",
                                                    "n",
                                                    "best_of",
                                                    "echo",
                                                    "speculative"};
  static const std::map<std::string, json> only_default = {
      {"stream", false}, {"suffix", nullptr}, {"logit_bias", json::object()}, {"stream_options", nullptr}};
  for (auto& [key, v] : body.items()) {
    if (implemented.count(key) || (form == BodyForm::plain_line && key == "custom_id")) continue;
    if (form == BodyForm::server && (key == "stream" || key == "stream_options")) continue;  // a server streams
    auto d = only_default.find(key);
    CHECK(d != only_default.end(), "field '", key, "' is not supported by this runtime");
    CHECK(v.is_null() || v == d->second, "field '", key, "': only ", d->second.dump(), " is supported, found ",
          describe(v));
  }
}

// stream (true/false) and stream_options.include_usage, which only a server takes.
void read_stream_fields(const json& body, BatchLine& b) {
  if (body.contains("stream") && !body["stream"].is_null()) {
    CHECK(body["stream"].is_boolean(), "field 'stream': expected true or false, found ", describe(body["stream"]));
    b.stream = body["stream"].get<bool>();
  }
  if (!body.contains("stream_options") || body["stream_options"].is_null()) return;
  const json& so = body["stream_options"];
  CHECK(b.stream, "field 'stream_options': only allowed with stream true");
  CHECK(so.is_object(), "field 'stream_options': expected an object, found ", describe(so));
  for (auto& [key, v] : so.items()) {
    CHECK(key == "include_usage", "field 'stream_options." + key + "' is not supported by this runtime");
    CHECK(v.is_boolean(), "field 'stream_options.include_usage': expected true or false, found ", describe(v));
    b.include_usage = v.get<bool>();
  }
}

// A body's boolean field, or `fallback` when absent or null.
bool read_bool(const json& body, const char* key, bool fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  CHECK(body[key].is_boolean(), "field '", key, "': expected true or false, found ", describe(body[key]));
  return body[key].get<bool>();
}

// messages -> the chat prompt's text, in the model's chat format (chat_template_kwargs.enable_thinking).
std::string chat_text(const json& body, bool add_generation_prompt, const runtime::ModelConfig& mc) {
  CHECK(body.contains("messages") && body["messages"].is_array(),
        "field 'messages': expected a list of {role, content}");
  std::vector<runtime::ChatMessage> msgs;
  for (const json& m : body["messages"]) {
    CHECK(m.is_object() && m.contains("role") && m["role"].is_string() && m.contains("content") &&
              m["content"].is_string(),
          "field 'messages': each message needs string 'role' and 'content', found ", describe(m));
    runtime::ChatMessage cm;
    cm.role = m["role"];
    cm.content = m["content"];
    msgs.push_back(cm);
  }
  bool thinking = true;
  if (body.contains("chat_template_kwargs") && body["chat_template_kwargs"].contains("enable_thinking")) {
    const json& t = body["chat_template_kwargs"]["enable_thinking"];
    CHECK(t.is_boolean(), "field 'chat_template_kwargs.enable_thinking': expected true or false, found ", describe(t));
    thinking = t.get<bool>();
  }
  return runtime::format_chat(mc.model_type, msgs, add_generation_prompt, thinking);
}

// One prompt: text (tokenized as prompts are: special tokens written in it become their ids) or a
// list of token ids.
std::vector<int32_t> one_prompt(const json& p, const char* field, const runtime::ModelConfig& mc,
                                const runtime::Tokenizer* tok) {
  if (p.is_array()) return ids_from_json(p, field, mc.vocab_size);
  CHECK(p.is_string(), "field '", field, "': expected a string, a list of token ids or a list of those, found ",
        describe(p));
  CHECK(tok,
        "text prompts need a tokenizer, but the model directory has no tokenizer.json; "
        "give '",
        field, "' as a list of token ids");
  return tok->encode(p.get<std::string>(), true);
}

// The prompts of a completions body: prompt_ids, or prompt in OpenAI's four forms (a string, a
// list of token ids, a list of strings, a list of token-id lists).
std::vector<std::vector<int32_t>> read_prompts(const json& body, const runtime::ModelConfig& mc,
                                               const runtime::Tokenizer* tok) {
  std::vector<std::vector<int32_t>> out;
  if (body.contains("prompt_ids")) {
    out.push_back(ids_from_json(body["prompt_ids"], "prompt_ids", mc.vocab_size));
  } else {
    CHECK(body.contains("prompt"), "missing field 'prompt' (or 'prompt_ids' / 'messages')");
    const json& p = body["prompt"];
    const bool list = p.is_array() && !p.empty() && (p[0].is_array() || p[0].is_string());
    if (!list) out.push_back(one_prompt(p, "prompt", mc, tok));
    for (size_t i = 0; list && i < p.size(); ++i) {
      CHECK(p[i].is_array() || p[i].is_string(),
            "field 'prompt': a list of prompts holds strings or lists of "
            "token ids, found ",
            describe(p[i]), " at index ", i);
      out.push_back(one_prompt(p[i], "prompt", mc, tok));
    }
  }
  for (size_t i = 0; i < out.size(); ++i)
    CHECK(!out[i].empty(), "field 'prompt': the prompt is empty",
          out.size() > 1 ? " (prompt " + std::to_string(i) + ")" : std::string());
  return out;
}

// logprobs: an integer 0..20 (completions), or true with top_logprobs (chat).
void read_logprobs(const json& body, runtime::SamplingParams& s) {
  if (!body.contains("logprobs") || body["logprobs"].is_null()) return;
  const json& lp = body["logprobs"];
  std::string err;
  if (lp.is_boolean()) {
    s.logprobs = lp.get<bool>() ? 0 : -1;
    if (lp.get<bool>()) CHECK(read_number(body, "top_logprobs", s.logprobs, err), err);
    return;
  }
  // An integer as in /v1/completions; the range as OpenAI's (0..20), before any narrowing.
  CHECK(lp.is_number_integer(), "field 'logprobs': expected an integer or boolean, found ", describe(lp));
  CHECK(lp.is_number_unsigned() && lp.get<uint64_t>() <= 20, "field 'logprobs': expected an integer in [0, 20], found ",
        describe(lp));
  s.logprobs = lp.get<int32_t>();
}

// The sampling fields (numbers, n / best_of, logprobs, ignore_eos, stop) into b.
void read_sampling(const json& body, BatchLine& b, uint64_t default_seed, const runtime::Tokenizer* tok) {
  runtime::SamplingParams& s = b.request.sampling;
  s.temperature = 1.0f;
  std::string err;
  bool ok = read_number(body, "max_tokens", s.max_tokens, err) &&
            read_number(body, "max_completion_tokens", s.max_tokens, err) &&
            read_number(body, "temperature", s.temperature, err) && read_number(body, "top_p", s.top_p, err) &&
            read_number(body, "top_k", s.top_k, err) && read_number(body, "min_p", s.min_p, err) &&
            read_number(body, "repetition_penalty", s.repetition_penalty, err) &&
            read_number(body, "presence_penalty", s.presence_penalty, err) &&
            read_number(body, "frequency_penalty", s.frequency_penalty, err) && read_number(body, "seed", s.seed, err);
  CHECK(ok, err);
  if (!body.contains("seed")) s.seed = default_seed;  // reproducible per line (batch)
  int64_t best_of = -1;
  CHECK(read_number(body, "n", b.n, err) && read_number(body, "best_of", best_of, err), err);
  CHECK(b.n >= 1 && b.n <= kMaxChoices, "field 'n': expected an integer in [1, ", kMaxChoices, "], found ", b.n);
  CHECK(best_of < 0 || best_of == b.n, "field 'best_of': only best_of = n (", b.n, ") is supported, found ", best_of);
  read_logprobs(body, s);
  s.ignore_eos = read_bool(body, "ignore_eos", s.ignore_eos);
  b.request.speculative = read_bool(body, "speculative", true);  // false: no MTP drafts for it
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& st = body["stop"];
    if (st.is_string())
      s.stop.push_back(st);
    else {
      CHECK(st.is_array(), "field 'stop': expected a string or a list of strings");
      for (const json& x : st) {
        CHECK(x.is_string(), "field 'stop': expected strings, found ", describe(x));
        s.stop.push_back(x);
      }
    }
    CHECK(s.stop.empty() || tok, "field 'stop' needs a tokenizer (the model has none)");
  }
}

// echo (completions only): the prompt comes back before the completion and, with logprobs, the
// logprobs of its tokens (computed by the engine: Request::prompt_logprobs). max_tokens 0 then
// asks for the prompt alone: the engine still samples 1 token (its last prompt row is sampled
// anyway), which the answer leaves out.
void read_echo(const json& body, BatchLine& b) {
  b.echo = read_bool(body, "echo", false);
  if (!b.echo) return;
  CHECK(b.url == "/v1/completions", "field 'echo': not supported by ", b.url,
        " (only /v1/completions echoes the prompt)");
  CHECK(!b.stream, "field 'echo': not supported with stream true");
  runtime::SamplingParams& s = b.request.sampling;
  if (s.max_tokens == 0) {  // given as 0 (the default is 16, or the rest of the context)
    b.prompt_only = true;
    s.max_tokens = 1;
  }
  b.request.prompt_logprobs = s.logprobs;  // -1: none
}

}  // namespace

std::vector<runtime::Request> choice_requests(const BatchLine& b) {
  std::vector<runtime::Request> out;
  for (const std::vector<int32_t>& prompt : b.prompts)
    for (int64_t j = 0; j < b.n; ++j) {
      runtime::Request r = b.request;
      r.prompt = prompt;
      r.sampling.seed += uint64_t(j) * kChoiceSeedStep;
      out.push_back(std::move(r));
    }
  return out;
}

size_t prompt_tokens(const BatchLine& b) {
  size_t n = 0;
  for (const auto& p : b.prompts) n += p.size();
  return n;
}

void parse_request_body(const json& body, BatchLine& b, BodyForm form, uint64_t default_seed, const std::string& where,
                        const runtime::ModelConfig& mc, const runtime::Tokenizer* tok) {
  const bool server = form == BodyForm::server;
  check_supported_fields(body, form);
  if (body.contains("model") && body["model"].is_string()) b.model_name = body["model"];
  if (server) read_stream_fields(body, b);

  runtime::Request& r = b.request;
  if (b.url == "/v1/chat/completions") {
    CHECK(tok, "chat requests need a tokenizer, but the model directory has no tokenizer.json");
    b.prompts = {tok->encode(chat_text(body, true, mc), true)};
  } else {
    b.prompts = read_prompts(body, mc, tok);
  }
  r.prompt = b.prompts[0];
  read_sampling(body, b, default_seed, tok);
  read_echo(body, b);
  runtime::SamplingParams& s = r.sampling;
  CHECK(s.max_tokens != 0, "field 'max_tokens': 0 is allowed only with echo true (the prompt alone), found 0");
  size_t longest = 0;
  for (const auto& p : b.prompts) longest = std::max(longest, p.size());
  // A server request without a length may run to the end of the context (OpenAI, vLLM); a batch
  // line keeps the sampler's default, so batch records stay as they were.
  const bool has_length = (body.contains("max_tokens") && !body["max_tokens"].is_null()) ||
                          (body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null());
  if (server && !has_length) {
    const int64_t rest = std::max<int64_t>(1, mc.max_position_embeddings - int64_t(longest));
    s.max_tokens = int32_t(std::min<int64_t>(rest, std::numeric_limits<int32_t>::max()));
    b.default_length = true;
  }
  s.validate();
  const int64_t need = int64_t(longest) + s.max_tokens;
  if (need > mc.max_position_embeddings) {
    b.error_code = "context_length_exceeded";
    b.error = where + "prompt of " + std::to_string(longest) + " tokens + max_tokens " + std::to_string(s.max_tokens) +
              " exceeds the model's context of " + std::to_string(mc.max_position_embeddings) + " tokens";
  }
}

BatchLine parse_batch_line(const std::string& text, int64_t line_no, const runtime::ModelConfig& mc,
                           const runtime::Tokenizer* tok) {
  BatchLine b;
  b.line = line_no;
  b.key = "line:" + std::to_string(line_no);
  b.url = "/v1/completions";
  b.request.index = line_no;
  try {
    json j = parse_client_json(text);  // throws on malformed or too deeply nested JSON
    CHECK(j.is_object(), "expected a JSON object, found ", j.type_name());
    if (j.contains("custom_id")) {
      CHECK(j["custom_id"].is_string(), "field 'custom_id': expected a string, found ", describe(j["custom_id"]));
      b.custom_id = j["custom_id"].get<std::string>();
      if (!b.custom_id.empty()) b.key = "id:" + b.custom_id;  // "" is no id (its record says null)
    }
    json body = j;
    if (j.contains("body")) {  // OpenAI Batch form
      CHECK(j["body"].is_object(), "field 'body': expected an object");
      body = j["body"];
      if (j.contains("url")) {
        CHECK(j["url"].is_string(), "field 'url': expected a string");
        b.url = j["url"].get<std::string>();
      }
      if (j.contains("method"))
        CHECK(j["method"] == "POST", "field 'method': expected \"POST\", found ", describe(j["method"]));
    } else if (body.contains("messages")) {
      b.url = "/v1/chat/completions";
    }
    CHECK(b.url == "/v1/completions" || b.url == "/v1/chat/completions",
          "field 'url': expected /v1/completions or /v1/chat/completions, found ", b.url);
    parse_request_body(body, b, j.contains("body") ? BodyForm::batch_body : BodyForm::plain_line, uint64_t(line_no),
                       "line " + std::to_string(line_no) + ": ", mc, tok);
  } catch (const json::parse_error& e) {
    b.error_code = "invalid_json";
    b.error = std::string("line ") + std::to_string(line_no) + ": malformed JSON: " + e.what();
  } catch (const JsonTooDeep& e) {
    b.error_code = "invalid_json";
    b.error = std::string("line ") + std::to_string(line_no) + ": " + e.what();
  } catch (const std::exception& e) {  // glm5::Error, or a json type error on a field not checked above
    b.error_code = "invalid_request";
    b.error = std::string("line ") + std::to_string(line_no) + ": " + e.what();
  }
  return b;
}

namespace {

// A token's text as the client reads it: our JSON writes bytes that are not valid UTF-8 (a token
// holding part of a character) as U+FFFD, so two such tokens read the same.
std::string client_text(const std::string& text) {
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}
int64_t code_points(const std::string& s) {
  return std::count_if(s.begin(), s.end(), [](char c) { return (uint8_t(c) & 0xC0) != 0x80; });
}

// A choice's logprobs object: with echo the prompt's tokens (the first has no logprob: null), then
// the generated ones. text_offset only for completions (chat keeps its object as it was). Tokens
// are named by their text as the client reads it, so a top_logprobs map never holds two keys that
// read the same (vLLM's maps, keyed by text, have the same limit); a prompt token's own entry is
// written last and wins such a tie.
class LogprobsJson {
 public:
  LogprobsJson(const runtime::Tokenizer* tok, bool offsets) : tok_(tok), offsets_(offsets) {}
  std::string name(int32_t id) const { return tok_ ? client_text(tok_->decode({id})) : std::to_string(id); }
  json top(const std::vector<std::pair<int32_t, float>>& best) const {
    json t = json::object();
    for (auto& [id, l] : best) t[name(id)] = l;
    return t;
  }
  void add(int32_t id, json logprob, json top) {
    const std::string text = name(id);
    lp_["tokens"].push_back(text);
    lp_["token_logprobs"].push_back(std::move(logprob));
    lp_["top_logprobs"].push_back(std::move(top));
    if (offsets_) lp_["text_offset"].push_back(offset_);
    offset_ += code_points(text);
  }
  // Prompt token t >= 1 scored by entry t - 1 of the engine's prompt logprobs: the n best and the
  // token itself (vLLM's prompt_logprobs). Null where an entry is missing.
  void add_prompt(const std::vector<int32_t>& prompt, const std::vector<runtime::Sampled>& scored) {
    add(prompt[0], nullptr, nullptr);
    for (size_t t = 1; t < prompt.size(); ++t) {
      if (t > scored.size()) {
        add(prompt[t], nullptr, nullptr);
        continue;
      }
      const runtime::Sampled& e = scored[t - 1];
      json best = top(e.top);
      best[name(e.token)] = e.logprob;
      add(prompt[t], e.logprob, std::move(best));
    }
  }
  json take() {
    for (const char* k : {"tokens", "token_logprobs", "top_logprobs"})
      if (!lp_.contains(k)) lp_[k] = json::array();
    if (offsets_ && !lp_.contains("text_offset")) lp_["text_offset"] = json::array();
    return std::move(lp_);
  }

 private:
  const runtime::Tokenizer* tok_;
  bool offsets_;
  json lp_ = json::object();
  int64_t offset_ = 0;
};

}  // namespace

size_t completion_tokens(const BatchLine& in, const runtime::Result& res) {
  return in.prompt_only ? 0 : res.tokens.size();
}

// One choice of a record. With a stop string the engine ends the request at the token that
// completes it: token_ids, logprobs and usage keep every generated token up to and including that
// one (as vLLM does); text is their decoding cut before the earliest stop string (not returned).
json choice_json(const BatchLine& in, const runtime::Result& res, const runtime::Tokenizer* tok, int64_t index) {
  const bool chat = in.url == "/v1/chat/completions";
  const std::vector<int32_t> tokens(res.tokens.begin(), res.tokens.begin() + int64_t(completion_tokens(in, res)));
  bool stopped = false;
  const std::string text = runtime::final_text(tok, tokens, in.request.sampling.stop, &stopped);
  const std::string finish = stopped ? "stop" : in.prompt_only ? "length" : res.finish_reason;
  const size_t p = in.prompts.empty() ? 0 : size_t(index / in.n);
  const std::vector<int32_t>& prompt = p < in.prompts.size() ? in.prompts[p] : in.request.prompt;
  json choice = {{"index", index}, {"finish_reason", finish}, {"token_ids", tokens}};
  if (chat)
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  else
    choice["text"] = in.echo && tok ? tok->decode(prompt, false) + text : text;
  if (in.echo) choice["prompt_token_ids"] = prompt;
  choice["logprobs"] = nullptr;
  if (in.request.sampling.logprobs < 0) return choice;
  LogprobsJson lp(tok, !chat);
  if (in.echo) lp.add_prompt(prompt, res.prompt_logprobs);
  for (size_t i = 0; i < tokens.size(); ++i)
    lp.add(tokens[i], i < res.logprobs.size() ? json(res.logprobs[i]) : json(nullptr),
           i < res.top_logprobs.size() ? lp.top(res.top_logprobs[i]) : json::object());
  choice["logprobs"] = lp.take();
  return choice;
}

json completion_json(const BatchLine& in, const std::vector<runtime::Result>& results, const runtime::Tokenizer* tok,
                     const std::string& id, const std::string& model) {
  const bool chat = in.url == "/v1/chat/completions";
  json choices = json::array();
  size_t completion = 0;
  for (size_t j = 0; j < results.size(); ++j) {
    choices.push_back(choice_json(in, results[j], tok, int64_t(j)));
    completion += completion_tokens(in, results[j]);
  }
  return {{"id", id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", int64_t(std::time(nullptr))},
          {"model", model},
          {"choices", choices},
          {"usage", usage_json(in.prompts.empty() ? in.request.prompt.size() : prompt_tokens(in), completion)}};
}

json usage_json(size_t prompt_tokens, size_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

std::string batch_record(const BatchLine& in, const std::vector<runtime::Result>& results,
                         const runtime::Tokenizer* tok, int64_t seq_no) {
  json rec;
  rec["id"] = "batch_req_" + std::to_string(seq_no);
  rec["custom_id"] = in.custom_id.empty() ? json(nullptr) : json(in.custom_id);
  rec["line"] = in.line;
  std::string err = in.error;
  for (const runtime::Result& r : results)  // one failed choice fails the record
    if (err.empty() && !r.error.empty()) err = "line " + std::to_string(in.line) + ": " + r.error;
  if (!err.empty() || results.empty()) {
    rec["response"] = nullptr;
    rec["error"] = {{"code", in.error_code.empty() ? "request_failed" : in.error_code}, {"message", err}};
    return rec.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  const bool chat = in.url == "/v1/chat/completions";
  const json body = completion_json(in, results, tok, (chat ? "chatcmpl-" : "cmpl-") + std::to_string(seq_no),
                                    in.model_name.empty() ? "glm5" : in.model_name);
  rec["response"] = {{"status_code", 200}, {"request_id", rec["id"]}, {"body", body}};
  rec["error"] = nullptr;
  return rec.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

// Refuses a body field outside `known` (the project's rule: never silently ignored).
void check_known_fields(const json& body, const std::set<std::string>& known) {
  for (auto& [key, v] : body.items()) CHECK(known.count(key), "field '", key, "' is not supported by this runtime");
}

// A special-token field of tokenizer_config.json as text: a string, or an AddedToken object's content.
json token_text(const json& v) {
  if (v.is_object() && v.contains("content")) return v["content"];
  return v;
}

}  // namespace

json tokenize_json(const json& body, const runtime::ModelConfig& mc, const runtime::Tokenizer& tok) {
  CHECK(body.is_object(), "the request body must be a JSON object, found ", body.type_name());
  const bool chat = body.contains("messages");
  if (chat) {
    check_known_fields(body, {"model", "messages", "add_generation_prompt", "continue_final_message",
                              "add_special_tokens", "return_token_strs", "chat_template_kwargs"});
    CHECK(!read_bool(body, "continue_final_message", false), "field 'continue_final_message': only false is supported");
  } else {
    check_known_fields(body, {"model", "prompt", "add_special_tokens", "return_token_strs"});
    CHECK(body.contains("prompt"), "missing field 'prompt' (or 'messages')");
    CHECK(body["prompt"].is_string(), "field 'prompt': expected a string, found ", describe(body["prompt"]));
  }
  read_bool(body, "add_special_tokens", !chat);  // checked; adds nothing (no post-processor)
  const std::string text =
      chat ? chat_text(body, read_bool(body, "add_generation_prompt", true), mc) : body["prompt"].get<std::string>();
  const std::vector<int32_t> ids = tok.encode(text, true);
  json strs = nullptr;
  if (read_bool(body, "return_token_strs", false)) {
    strs = json::array();
    for (int32_t id : ids) strs.push_back(tok.id_to_token(id));
  }
  return {{"count", ids.size()}, {"max_model_len", mc.max_position_embeddings}, {"tokens", ids}, {"token_strs", strs}};
}

json detokenize_json(const json& body, const runtime::ModelConfig& mc, const runtime::Tokenizer& tok) {
  CHECK(body.is_object(), "the request body must be a JSON object, found ", body.type_name());
  check_known_fields(body, {"model", "tokens"});
  CHECK(body.contains("tokens"), "missing field 'tokens'");
  return {{"prompt", tok.decode(ids_from_json(body["tokens"], "tokens", mc.vocab_size), false)}};
}

json tokenizer_info_json(const runtime::ModelConfig& mc, const runtime::Tokenizer& tok) {
  const std::filesystem::path dir = std::filesystem::path(tok.path()).parent_path();
  json info = json::object();
  std::ifstream f(dir / "tokenizer_config.json");
  if (f) {
    try {
      info = json::parse(f);
    } catch (const json::exception&) {
      info = json::object();  // unreadable: what config.json and tokenizer.json give
    }
    if (!info.is_object()) info = json::object();
  }
  for (const char* k : {"vocab_file", "merges_file", "tokenizer_file"}) info.erase(k);
  for (const char* k : {"bos_token", "eos_token", "pad_token", "unk_token"})
    if (info.contains(k)) info[k] = token_text(info[k]);
  if (!info.contains("eos_token") && !mc.eos_token_id.empty()) info["eos_token"] = tok.id_to_token(mc.eos_token_id[0]);
  if (!info.contains("tokenizer_class")) info["tokenizer_class"] = "PreTrainedTokenizerFast";
  if (!info.contains("model_max_length")) info["model_max_length"] = mc.max_position_embeddings;
  std::ifstream t(dir / "chat_template.jinja");
  if (!info.contains("chat_template") && t) info["chat_template"] = std::string(std::istreambuf_iterator<char>(t), {});
  return info;
}

}  // namespace glm5::launcher
