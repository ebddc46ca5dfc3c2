// OpenAI request bodies and responses, shared by `glm5 batch` (JSONL lines) and `glm5 serve` (HTTP
// bodies): parsing and checking the fields we implement into an engine Request, and the completion
// JSON built from its Results. Knows nothing of files or sockets.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.h"

namespace glm5::runtime { class Tokenizer; struct ModelConfig; }

namespace glm5::launcher {

// One parsed request (a batch input line or a server body): a request to run, or an error.
struct BatchLine {
  int64_t line = 0;        // 1-based line number in the input (batch)
  std::string key;         // custom_id, or "line:<n>" when the line has none
  std::string custom_id;   // as given (may be empty)
  std::string url;         // "/v1/completions" or "/v1/chat/completions"
  std::string model_name;  // body.model if given
  runtime::Request request;
  int64_t n = 1;           // choices (OpenAI `n`): n samples of the prompt, one record
  bool stream = false;         // server only: answer as server-sent events
  bool include_usage = false;  // server only: stream_options.include_usage
  bool default_length = false; // server only: no max_tokens given, so up to the end of the context
  std::string error;       // non-empty: answer with this error
  std::string error_code;
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
// Most choices one line may ask for.
constexpr int64_t kMaxChoices = 64;
// Choice j of a line samples with seed + j * kChoiceSeedStep (choice 0: the line's seed).
constexpr uint64_t kChoiceSeedStep = 0x9e3779b97f4a7c15ull;

// One choice of a completion: text (or message), finish_reason, token_ids, logprobs. The text is
// cut before the earliest stop string.
nlohmann::json choice_json(const BatchLine& in, const runtime::Result& res, const runtime::Tokenizer* tok,
                           int64_t index);
// The completion (or chat.completion) object for the results of a request's choices.
nlohmann::json completion_json(const BatchLine& in, const std::vector<runtime::Result>& results,
                               const runtime::Tokenizer* tok, const std::string& id, const std::string& model);
nlohmann::json usage_json(size_t prompt_tokens, size_t completion_tokens);
// The output record for a line and its results, one per choice (none: an error record).
std::string batch_record(const BatchLine& in, const std::vector<runtime::Result>& results,
                         const runtime::Tokenizer* tok, int64_t seq_no);

}  // namespace glm5::launcher
