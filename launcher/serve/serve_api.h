// The OpenAI-compatible endpoints of `glm5 serve`: POST /v1/completions and /v1/chat/completions
// (whole answers or server-sent events), GET /v1/models, /health and /metrics, vLLM's POST
// /tokenize and /detokenize and GET /tokenizer_info, Bearer auth, and OpenAI-style error objects.
// Request bodies are parsed as batch lines are (launcher/openai/openai_format.h); the requests go to the engine
// through the ServeQueue. Runs on the HTTP threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "launcher/openai/openai_format.h"
#include "launcher/serve/http_server.h"
#include "launcher/serve/serve_metrics.h"
#include "launcher/serve/serve_queue.h"

namespace glm5::runtime {
class Tokenizer;
struct ModelConfig;
}  // namespace glm5::runtime

namespace glm5::launcher {

// {"error": {"message", "type", "param", "code"}} as the OpenAI API writes it.
std::string error_json(const std::string& message, const std::string& type, const std::string& param,
                       const std::string& code);
// The error type and code OpenAI uses for an HTTP status (400 invalid_request_error, ...).
std::string error_for_status(int status, const std::string& message);

struct ApiOptions {
  std::string api_key;   // empty: no auth
  std::string model_id;  // the one model /v1/models lists and requests may name
};

class ServeApi {
 public:
  ServeApi(ServeQueue& queue, ServeMetrics& metrics, const runtime::ModelConfig& mc, const runtime::Tokenizer* tok,
           ApiOptions opt);
  void handle(HttpRequest&& req, std::shared_ptr<Exchange> ex);

 private:
  void completion(const HttpRequest& req, const std::shared_ptr<Exchange>& ex, const std::string& url);
  void models(const std::shared_ptr<Exchange>& ex);
  void tokenizer(const HttpRequest& req, const std::shared_ptr<Exchange>& ex, const std::string& path);
  void cap_default_length(BatchLine& b) const;
  bool authorized(const HttpRequest& req) const;

  ServeQueue& queue_;
  ServeMetrics& metrics_;
  const runtime::ModelConfig& mc_;
  const runtime::Tokenizer* tok_;
  ApiOptions opt_;
  std::atomic<uint64_t> seq_{0};  // request ids and default seeds
};

}  // namespace glm5::launcher
