// OpenAI request bodies and responses, shared by `glm5 batch` (JSONL lines) and `glm5 serve` (HTTP
// bodies): the fields we implement and their checks (one message naming the field, the expected and
// the found value), tokenization of prompts and chat messages, and the completion JSON. Leaves out
// the transport: where the bytes come from and go.
#include "launcher/openai_format.h"

#include <algorithm>
#include <ctime>
#include <limits>
#include <map>
#include <set>

#include "core/check.h"
#include "runtime/chat.h"
#include "runtime/config.h"
#include "runtime/tokenizer.h"

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
  if (v.is_array()) out += " (an array of " + std::to_string(v.size()) + " elements)";
  else if (v.is_object()) out += " (an object of " + std::to_string(v.size()) + " fields)";
  else if (v.is_string()) out += " (" + std::to_string(v.get_ref<const std::string&>().size()) + " bytes)";
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
      err = std::string("field '") + key + "': expected an integer in [" +
            std::to_string(lim::min()) + ", " + std::to_string(lim::max()) + "], found " + describe(v);
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
    CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < vocab, "field '",
          field, "': expected token ids in [0, ", vocab, "), found ", describe(x));
    ids.push_back(x.get<int32_t>());
  }
  return ids;
}

// Fields the request body may carry: what we implement, metadata we may ignore, and OpenAI
// fields we accept only at their default value. Anything else is an error, never ignored.
void check_supported_fields(const json& body, BodyForm form) {
  static const std::set<std::string> implemented = {
      "model", "prompt", "prompt_ids", "messages", "max_tokens", "max_completion_tokens", "temperature",
      "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
      "stop", "logprobs", "top_logprobs", "ignore_eos", "chat_template_kwargs", "user", "metadata", "n",
      "best_of"};
  static const std::map<std::string, json> only_default = {
      {"stream", false}, {"echo", false}, {"suffix", nullptr},
      {"logit_bias", json::object()}, {"stream_options", nullptr}};
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

}  // namespace

void parse_request_body(const json& body, BatchLine& b, BodyForm form, uint64_t default_seed, const std::string& where,
                        const runtime::ModelConfig& mc, const runtime::Tokenizer* tok) {
  const bool server = form == BodyForm::server;
  check_supported_fields(body, form);
  if (body.contains("model") && body["model"].is_string()) b.model_name = body["model"];
  if (server) read_stream_fields(body, b);

  runtime::Request& r = b.request;
  if (b.url == "/v1/chat/completions") {
    CHECK(body.contains("messages") && body["messages"].is_array(),
          "field 'messages': expected a list of {role, content}");
    CHECK(tok, "chat requests need a tokenizer, but the model directory has no tokenizer.json");
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
      CHECK(t.is_boolean(), "field 'chat_template_kwargs.enable_thinking': expected true or false, found ",
            describe(t));
      thinking = t.get<bool>();
    }
    r.prompt = tok->encode(runtime::format_chat(mc.model_type, msgs, true, thinking), true);
  } else if (body.contains("prompt_ids")) {
    r.prompt = ids_from_json(body["prompt_ids"], "prompt_ids", mc.vocab_size);
  } else {
    CHECK(body.contains("prompt"), "missing field 'prompt' (or 'prompt_ids' / 'messages')");
    const json& p = body["prompt"];
    if (p.is_array()) {
      r.prompt = ids_from_json(p, "prompt", mc.vocab_size);
    } else {
      CHECK(p.is_string(), "field 'prompt': expected a string or a list of token ids, found ", describe(p));
      CHECK(tok, "text prompts need a tokenizer, but the model directory has no tokenizer.json; "
                 "give 'prompt' as a list of token ids");
      r.prompt = tok->encode(p.get<std::string>(), true);
    }
  }
  CHECK(!r.prompt.empty(), "field 'prompt': the prompt is empty");
  runtime::SamplingParams& s = r.sampling;
  s.temperature = 1.0f;
  std::string err;
  bool ok = read_number(body, "max_tokens", s.max_tokens, err) &&
            read_number(body, "max_completion_tokens", s.max_tokens, err) &&
            read_number(body, "temperature", s.temperature, err) &&
            read_number(body, "top_p", s.top_p, err) && read_number(body, "top_k", s.top_k, err) &&
            read_number(body, "min_p", s.min_p, err) &&
            read_number(body, "repetition_penalty", s.repetition_penalty, err) &&
            read_number(body, "presence_penalty", s.presence_penalty, err) &&
            read_number(body, "frequency_penalty", s.frequency_penalty, err) &&
            read_number(body, "seed", s.seed, err);
  CHECK(ok, err);
  if (!body.contains("seed")) s.seed = default_seed;  // reproducible per line (batch)
  int64_t best_of = -1;
  CHECK(read_number(body, "n", b.n, err) && read_number(body, "best_of", best_of, err), err);
  CHECK(b.n >= 1 && b.n <= kMaxChoices, "field 'n': expected an integer in [1, ", kMaxChoices, "], found ", b.n);
  CHECK(best_of < 0 || best_of == b.n, "field 'best_of': only best_of = n (", b.n,
        ") is supported, found ", best_of);
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    const json& lp = body["logprobs"];
    if (lp.is_boolean()) {
      s.logprobs = lp.get<bool>() ? 0 : -1;
      if (lp.get<bool>()) CHECK(read_number(body, "top_logprobs", s.logprobs, err), err);
    } else {
      // An integer as in /v1/completions; the range as OpenAI's (0..20), before any narrowing.
      CHECK(lp.is_number_integer(), "field 'logprobs': expected an integer or boolean, found ", describe(lp));
      CHECK(lp.is_number_unsigned() && lp.get<uint64_t>() <= 20,
            "field 'logprobs': expected an integer in [0, 20], found ", describe(lp));
      s.logprobs = lp.get<int32_t>();
    }
  }
  if (body.contains("ignore_eos")) {
    CHECK(body["ignore_eos"].is_boolean(), "field 'ignore_eos': expected true or false, found ",
          describe(body["ignore_eos"]));
    s.ignore_eos = body["ignore_eos"].get<bool>();
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& st = body["stop"];
    if (st.is_string()) s.stop.push_back(st);
    else {
      CHECK(st.is_array(), "field 'stop': expected a string or a list of strings");
      for (const json& x : st) {
        CHECK(x.is_string(), "field 'stop': expected strings, found ", describe(x));
        s.stop.push_back(x);
      }
    }
    CHECK(s.stop.empty() || tok, "field 'stop' needs a tokenizer (the model has none)");
  }
  // A server request without a length may run to the end of the context (OpenAI, vLLM); a batch
  // line keeps the sampler's default, so batch records stay as they were.
  const bool has_length = (body.contains("max_tokens") && !body["max_tokens"].is_null()) ||
                          (body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null());
  if (server && !has_length) {
    const int64_t rest = std::max<int64_t>(1, mc.max_position_embeddings - int64_t(r.prompt.size()));
    s.max_tokens = int32_t(std::min<int64_t>(rest, std::numeric_limits<int32_t>::max()));
    b.default_length = true;
  }
  s.validate();
  const int64_t need = int64_t(r.prompt.size()) + s.max_tokens;
  if (need > mc.max_position_embeddings) {
    b.error_code = "context_length_exceeded";
    b.error = where + "prompt of " + std::to_string(r.prompt.size()) +
              " tokens + max_tokens " + std::to_string(s.max_tokens) + " exceeds the model's context of " +
              std::to_string(mc.max_position_embeddings) + " tokens";
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

// One choice of a record. With a stop string the engine ends the request at the token that
// completes it: token_ids, logprobs and usage keep every generated token up to and including that
// one (as vLLM does); text is their decoding cut before the earliest stop string (not returned).
json choice_json(const BatchLine& in, const runtime::Result& res, const runtime::Tokenizer* tok, int64_t index) {
  const std::vector<int32_t>& tokens = res.tokens;
  std::string text = tok ? tok->decode(tokens, true) : "";
  std::string finish = res.finish_reason;
  size_t cut = std::string::npos;
  for (const std::string& s : in.request.sampling.stop)
    if (!s.empty()) cut = std::min(cut, text.find(s));
  if (cut != std::string::npos) {
    text.resize(cut);
    finish = "stop";
  }
  json choice = {{"index", index}, {"finish_reason", finish}, {"token_ids", tokens}};
  if (in.url == "/v1/chat/completions") choice["message"] = {{"role", "assistant"}, {"content", text}};
  else choice["text"] = text;
  choice["logprobs"] = nullptr;
  if (in.request.sampling.logprobs >= 0) {
    json lp = {{"token_logprobs", res.logprobs}, {"tokens", json::array()}, {"top_logprobs", json::array()}};
    for (size_t i = 0; i < tokens.size(); ++i) {
      lp["tokens"].push_back(tok ? tok->decode({tokens[i]}) : std::to_string(tokens[i]));
      json top = json::object();
      if (i < res.top_logprobs.size())
        for (auto& [id, l] : res.top_logprobs[i]) top[tok ? tok->decode({id}) : std::to_string(id)] = l;
      lp["top_logprobs"].push_back(top);
    }
    choice["logprobs"] = lp;
  }
  return choice;
}

json completion_json(const BatchLine& in, const std::vector<runtime::Result>& results, const runtime::Tokenizer* tok,
                     const std::string& id, const std::string& model) {
  const bool chat = in.url == "/v1/chat/completions";
  json choices = json::array();
  size_t completion = 0;
  for (size_t j = 0; j < results.size(); ++j) {
    choices.push_back(choice_json(in, results[j], tok, int64_t(j)));
    completion += results[j].tokens.size();
  }
  return {{"id", id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", int64_t(std::time(nullptr))},
          {"model", model},
          {"choices", choices},
          {"usage", usage_json(in.request.prompt.size(), completion)}};
}

json usage_json(size_t prompt_tokens, size_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens}, {"completion_tokens", completion_tokens},
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

}  // namespace glm5::launcher
