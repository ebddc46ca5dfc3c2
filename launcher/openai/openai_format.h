// OpenAI request bodies and responses, shared by `glm5 batch` (JSONL lines) and `glm5 serve` (HTTP
// bodies): parsing and checking the fields we implement into an engine Request, the completion
// JSON built from its Results, and the tokenizer endpoints' JSON (vLLM's /tokenize, /detokenize,
// /tokenizer_info). Knows nothing of files or sockets.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine/engine.h"

namespace glm5::runtime {
class Tokenizer;
struct ModelConfig;
}  // namespace glm5::runtime

namespace glm5::launcher {

// One parsed request (a batch input line or a server body): a request to run, or an error.
struct BatchLine {
  int64_t line = 0;          // 1-based line number in the input (batch)
  std::string key;           // custom_id, or "line:<n>" when the line has none
  std::string custom_id;     // as given (may be empty)
  std::string url;           // "/v1/completions" or "/v1/chat/completions"
  std::string model_name;    // body.model if given
  runtime::Request request;  // what every choice runs; request.prompt is prompts[0]
  // Every prompt (a completions `prompt` may be a list of them; chat: the one chat prompt). The
  // engine runs n choices of each: choice i * n + j is prompt i's j-th sample.
  std::vector<std::vector<int32_t>> prompts;
  int64_t n = 1;                // choices (OpenAI `n`): n samples of each prompt, one record
  bool echo = false;            // completions: the prompt before the completion (text, logprobs)
  bool prompt_only = false;     // echo with max_tokens 0: the engine runs 1 token, the answer drops it
  bool stream = false;          // server only: answer as server-sent events
  bool include_usage = false;   // server only: stream_options.include_usage
  bool default_length = false;  // server only: no max_tokens given, so up to the end of the context
  std::string error;            // non-empty: answer with this error
  std::string error_code;

  int64_t choices() const { return n * int64_t(std::max<size_t>(1, prompts.size())); }
};

// Where a body comes from: which fields besides the sampling ones it may carry.
enum class BodyForm {
  plain_line,  // a plain batch line: custom_id beside the body fields
  batch_body,  // the `body` of an OpenAI Batch line
  server,      // an HTTP body: stream and stream_options too
};

// Client JSON (a batch line, an HTTP body) may be nested at most this deep: deeper values are
// refused while parsing, so nothing recursive (dump, copy, compare) ever walks a hostile depth.
constexpr int kMaxJsonDepth = 64;
// Parses client JSON: json::parse_error as json::parse, JsonTooDeep beyond kMaxJsonDepth.
struct JsonTooDeep : std::runtime_error {
  JsonTooDeep();
};
nlohmann::json parse_client_json(const std::string& text);
// A client value for an error message: a scalar as JSON, a long string or a container cut to
// about 100 characters (a container named with its size). Bounded in time and stack.
std::string describe(const nlohmann::json& v);

// Parses one JSONL line (never throws: problems become `error`).
BatchLine parse_batch_line(const std::string& text, int64_t line_no, const runtime::ModelConfig& mc,
                           const runtime::Tokenizer* tok);
// Parses a request body into b.request (b.url says completion or chat). Throws glm5::Error (or a
// json error) naming the field; a prompt too long for the context sets b.error instead, prefixed
// with `where`. default_seed: the seed when the body gives none. A server body without max_tokens
// may generate up to the end of the context (as OpenAI's API); a batch line keeps the sampler's
// default (16).
void parse_request_body(const nlohmann::json& body, BatchLine& b, BodyForm form, uint64_t default_seed,
                        const std::string& where, const runtime::ModelConfig& mc, const runtime::Tokenizer* tok);
// Most choices one line may ask for (per prompt).
constexpr int64_t kMaxChoices = 64;
// Choice j of a line samples with seed + j * kChoiceSeedStep (choice 0: the line's seed).
constexpr uint64_t kChoiceSeedStep = 0x9e3779b97f4a7c15ull;
// The engine requests of a runnable line in choice order: b.choices() of them, choice i * n + j
// running prompt i with seed + j * kChoiceSeedStep (Request::index left to the caller).
std::vector<runtime::Request> choice_requests(const BatchLine& b);
// usage.prompt_tokens: the tokens of every prompt, each once whatever n.
size_t prompt_tokens(const BatchLine& b);

// One choice of a completion: text (or message), finish_reason, token_ids, logprobs. The text is
// cut before the earliest stop string. With echo (completions): text = the prompt's text + the
// completion's, prompt_token_ids, and logprobs over the prompt's tokens, then the completion's
// (the first prompt token's token_logprobs and top_logprobs entries are null, as OpenAI and vLLM
// write them; a prompt token's top_logprobs holds the n best and the token itself, as vLLM's).
// Tokens are named by their own decoding as the client reads it (a token holding part of a
// character reads as U+FFFD). Completions logprobs carry text_offset: where each token's text
// starts in `text`, in characters (code points) of those names.
nlohmann::json choice_json(const BatchLine& in, const runtime::Result& res, const runtime::Tokenizer* tok,
                           int64_t index);
// The completion (or chat.completion) object for the results of a request's choices.
nlohmann::json completion_json(const BatchLine& in, const std::vector<runtime::Result>& results,
                               const runtime::Tokenizer* tok, const std::string& id, const std::string& model);
nlohmann::json usage_json(size_t prompt_tokens, size_t completion_tokens);
// Generated tokens a choice answers with (none for a prompt_only line).
size_t completion_tokens(const BatchLine& in, const runtime::Result& res);
// The output record for a line and its results, one per choice (none: an error record).
std::string batch_record(const BatchLine& in, const std::vector<runtime::Result>& results,
                         const runtime::Tokenizer* tok, int64_t seq_no);

// The tokenizer endpoints of `glm5 serve`, as vLLM answers them. Each throws glm5::Error naming
// the field for a bad body.
// POST /tokenize: {"prompt": text, "add_special_tokens"?, "return_token_strs"?} or {"messages":
// [...], "add_generation_prompt"?, "chat_template_kwargs"?, ...} -> {"count", "max_model_len",
// "tokens": [ids], "token_strs": null | [vocabulary strings]}. Text is encoded as prompts are
// (special tokens written in it become their ids); add_special_tokens adds nothing (the tokenizer
// has no post-processor: GLM's chat format writes its own prefix).
nlohmann::json tokenize_json(const nlohmann::json& body, const runtime::ModelConfig& mc, const runtime::Tokenizer& tok);
// POST /detokenize: {"tokens": [ids]} -> {"prompt": text} (special tokens kept, as vLLM decodes).
nlohmann::json detokenize_json(const nlohmann::json& body, const runtime::ModelConfig& mc,
                               const runtime::Tokenizer& tok);
// GET /tokenizer_info: the model directory's tokenizer_config.json (special tokens as their text,
// file paths left out) with tokenizer_class, eos_token (from config.json's eos_token_id when the
// file has none), model_max_length and chat_template (chat_template.jinja) filled in, as vLLM's.
nlohmann::json tokenizer_info_json(const runtime::ModelConfig& mc, const runtime::Tokenizer& tok);

}  // namespace glm5::launcher
