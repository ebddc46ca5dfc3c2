// OpenAI endpoints over the engine. A completion request becomes one engine request per choice;
// its Call collects their tokens (streamed as chunks, text held back while it may still become a
// stop string or an unfinished UTF-8 character) and results (the whole answer, or the stream's end).
#include "launcher/serve/serve_api.h"

#include <algorithm>
#include <ctime>
#include <optional>
#include <vector>

#include <boost/asio/post.hpp>
#include <nlohmann/json.hpp>

#include "kernels/core/check.h"
#include "launcher/openai/openai_format.h"
#include "runtime/config.h"
#include "runtime/detokenizer.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::launcher {

using json = nlohmann::json;

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// glm5::Error messages end in " [file:line]": a client needs the message, not our source lines.
std::string client_message(const std::string& what) {
  const size_t at = what.rfind(" [");
  if (at != std::string::npos && what.back() == ']' && what.find(':', at) != std::string::npos)
    return what.substr(0, at);
  return what;
}

// The field a parse error names ("field 'top_p': ..." -> top_p), for the error's param.
std::string field_of(const std::string& message) {
  const size_t at = message.find("field '");
  if (at == std::string::npos) return "";
  const size_t end = message.find('\'', at + 7);
  return end == std::string::npos ? "" : message.substr(at + 7, end - at - 7);
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

// One completion request in flight: its choices' engine requests, on its connection's strand.
class Call final : public EngineClient, public std::enable_shared_from_this<Call> {
 public:
  Call(std::shared_ptr<Exchange> ex, BatchLine line, const runtime::Tokenizer* tok, ServeMetrics& metrics,
       ServeQueue& queue, std::string model, std::string id)
      : ex_(std::move(ex)),
        line_(std::move(line)),
        tok_(tok),
        metrics_(metrics),
        queue_(queue),
        model_(std::move(model)),
        id_(std::move(id)),
        created_(int64_t(std::time(nullptr))),
        received_(ServeClock::now()),
        chat_(line_.url == "/v1/chat/completions"),
        choices_(size_t(line_.choices()), Choice(runtime::Detokenizer(tok, line_.request.sampling.stop))),
        first_at_(choices_.size()),
        last_at_(choices_.size()),
        remaining_(int(choices_.size())) {}

  // After the queue accepted it (strand).
  void start(std::vector<int64_t> indexes) {
    indexes_ = std::move(indexes);
    ex_->on_gone([w = weak_from_this()] {
      if (auto self = w.lock()) self->queue_.cancel(self->indexes_);  // freed at the next step
    });
    if (!line_.stream) return;
    ex_->begin_stream();
    if (chat_)
      for (int64_t j = 0; j < line_.choices(); ++j)
        ex_->stream_data(
            sse(chunk(json::array({choice_delta(j, json{{"role", "assistant"}, {"content", ""}}, {}, nullptr)}))));
  }

  // Engine thread: latency figures, then the tokens to the strand (streams only).
  void tokens(int choice, std::vector<int32_t> t, ServeClock::time_point at) override {
    auto& first = first_at_[size_t(choice)];
    auto& last = last_at_[size_t(choice)];
    if (first == ServeClock::time_point{}) {
      metrics_.ttft.observe(std::chrono::duration<double>(at - received_).count());
    } else {
      const double gap = std::chrono::duration<double>(at - last).count() / double(t.size());
      for (size_t i = 0; i < t.size(); ++i) metrics_.itl.observe(gap);
    }
    if (first == ServeClock::time_point{}) first = at;
    last = at;
    if (!line_.stream) return;
    boost::asio::post(ex_->executor(),
                      [self = shared_from_this(), choice, t = std::move(t)]() mutable { self->on_tokens(choice, t); });
  }
  void result(int choice, runtime::Result r) override {
    metrics_.generation_tokens += int64_t(r.tokens.size());
    if (r.error.empty() && r.finish_reason != "cancelled")
      metrics_.e2e.observe(std::chrono::duration<double>(ServeClock::now() - received_).count());
    boost::asio::post(ex_->executor(), [self = shared_from_this(), choice, r = std::move(r)]() mutable {
      self->on_result(choice, std::move(r));
    });
  }

 private:
  struct Choice {
    explicit Choice(runtime::Detokenizer t) : text(std::move(t)) {}
    runtime::Detokenizer text;  // decoded so far, as the final text decodes it
    std::vector<int32_t> ids;
    size_t sent = 0, ids_sent = 0;
    std::optional<runtime::Result> result;
  };

  json chunk(json choices) const {
    return {{"id", id_},
            {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", model_},
            {"choices", std::move(choices)}};
  }
  json choice_delta(int64_t j, const json& delta, const std::vector<int32_t>& ids, const json& finish) const {
    json c = {{"index", j}, {"logprobs", nullptr}, {"finish_reason", finish}, {"token_ids", ids}};
    if (chat_)
      c["delta"] = delta;
    else
      c["text"] = delta.value("content", "");
    return c;
  }
  json text_delta(const std::string& text) const {
    return text.empty() && chat_ ? json::object() : json{{"content", text}};
  }

  void on_tokens(int choice, const std::vector<int32_t>& t) {
    Choice& c = choices_[size_t(choice)];
    if (c.result || ex_->gone()) return;
    for (int32_t id : t) {
      c.ids.push_back(id);
      c.text.feed(id);
    }
    const size_t end = std::max(c.sent, c.text.stable_end());
    const std::string delta(c.text.text().substr(c.sent, end - c.sent));
    std::vector<int32_t> ids(c.ids.begin() + int64_t(c.ids_sent), c.ids.end());
    if (delta.empty() && ids.empty()) return;
    c.sent = end;
    c.ids_sent = c.ids.size();
    ex_->stream_data(sse(chunk(json::array({choice_delta(choice, text_delta(delta), ids, nullptr)}))));
  }

  void on_result(int choice, runtime::Result r) {
    Choice& c = choices_[size_t(choice)];
    c.result = std::move(r);
    --remaining_;
    if (ex_->gone()) return;
    if (line_.stream) return stream_result(choice);
    if (remaining_ == 0) reply_whole();
  }

  // A failed choice: its status (a drain that timed out: 503; bad logits: 500; a request the
  // engine refused, e.g. larger than the KV cache: 400) and message.
  static std::pair<int, std::string> failure(const runtime::Result& r) {
    if (r.finish_reason == "cancelled") return {503, "the server shut down before the request finished"};
    if (r.error.rfind("non-finite", 0) == 0) return {500, r.error};
    return {400, r.error};
  }

  void stream_result(int choice) {
    Choice& c = choices_[size_t(choice)];
    const runtime::Result& r = *c.result;
    if (!r.error.empty() || r.finish_reason == "cancelled") {
      if (!failed_) ex_->stream_data("data: " + error_for_status(failure(r).first, failure(r).second) + "\n\n");
      failed_ = true;
    } else if (!failed_) {
      const json fin = choice_json(line_, r, tok_, choice);
      const std::string final_text =
          chat_ ? fin["message"]["content"].get<std::string>() : fin["text"].get<std::string>();
      // What was sent is a prefix of the final text (held-back text never went out).
      const std::string rest =
          final_text.size() > c.sent && final_text.compare(0, c.sent, c.text.text(), 0, c.sent) == 0
              ? final_text.substr(c.sent)
              : "";
      std::vector<int32_t> ids(r.tokens.begin() + int64_t(std::min(c.ids_sent, r.tokens.size())), r.tokens.end());
      ex_->stream_data(sse(chunk(json::array({choice_delta(choice, text_delta(rest), ids, fin["finish_reason"])}))));
    }
    if (remaining_ > 0) return;
    if (!failed_ && line_.include_usage) {
      size_t completion = 0;
      for (auto& ch : choices_) completion += completion_tokens(line_, *ch.result);
      json last = chunk(json::array());
      last["usage"] = usage_json(prompt_tokens(line_), completion);
      ex_->stream_data(sse(last));
    }
    ex_->stream_data("data: [DONE]\n\n");
    ex_->end_stream();
  }

  void reply_whole() {
    std::vector<runtime::Result> results;
    for (auto& c : choices_) {
      if (!c.result->error.empty() || c.result->finish_reason == "cancelled") {
        const auto [status, message] = failure(*c.result);
        metrics_.count_request(line_.url, status);
        return ex_->reply(status, error_for_status(status, message));
      }
      results.push_back(std::move(*c.result));
    }
    metrics_.count_request(line_.url, 200);
    ex_->reply(200, dump(completion_json(line_, results, tok_, id_, model_)));
  }

  std::shared_ptr<Exchange> ex_;
  BatchLine line_;
  const runtime::Tokenizer* tok_;
  ServeMetrics& metrics_;
  ServeQueue& queue_;
  const std::string model_, id_;
  const int64_t created_;
  const ServeClock::time_point received_;
  const bool chat_;
  std::vector<Choice> choices_;                             // strand
  std::vector<ServeClock::time_point> first_at_, last_at_;  // engine thread
  std::vector<int64_t> indexes_;
  int remaining_;
  bool failed_ = false;
};

}  // namespace

std::string error_json(const std::string& message, const std::string& type, const std::string& param,
                       const std::string& code) {
  return dump({{"error",
                {{"message", message},
                 {"type", type},
                 {"param", param.empty() ? json(nullptr) : json(param)},
                 {"code", code.empty() ? json(nullptr) : json(code)}}}});
}

std::string error_for_status(int status, const std::string& message) {
  switch (status) {
    case 401: return error_json(message, "invalid_request_error", "", "invalid_api_key");
    case 404: return error_json(message, "invalid_request_error", "", "not_found");
    case 405: return error_json(message, "invalid_request_error", "", "method_not_allowed");
    case 413: return error_json(message, "invalid_request_error", "", "request_too_large");
    case 429: return error_json(message, "rate_limit_error", "", "queue_full");
    case 431: return error_json(message, "invalid_request_error", "", "header_too_large");
    case 500: return error_json(message, "server_error", "", "internal_error");
    case 503: return error_json(message, "server_error", "", "unavailable");
    default: return error_json(message, "invalid_request_error", field_of(message), "");
  }
}

ServeApi::ServeApi(ServeQueue& queue, ServeMetrics& metrics, const runtime::ModelConfig& mc,
                   const runtime::Tokenizer* tok, ApiOptions opt)
    : queue_(queue), metrics_(metrics), mc_(mc), tok_(tok), opt_(std::move(opt)) {}

// Compares every byte whatever the first difference (no timing hint about the key).
bool ServeApi::authorized(const HttpRequest& req) const {
  if (opt_.api_key.empty()) return true;
  const auto it = req.find(boost::beast::http::field::authorization);
  if (it == req.end()) return false;
  const std::string got(it->value()), want = "Bearer " + opt_.api_key;
  if (got.size() != want.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < got.size(); ++i) diff |= uint8_t(got[i] ^ want[i]);
  return diff == 0;
}

void ServeApi::handle(HttpRequest&& req, std::shared_ptr<Exchange> ex) {
  namespace http = boost::beast::http;
  const std::string target(req.target());
  const std::string path = target.substr(0, target.find('?'));
  struct Route {
    const char* path;
    http::verb method;
  };
  static const Route routes[] = {{"/health", http::verb::get},
                                 {"/metrics", http::verb::get},
                                 {"/v1/models", http::verb::get},
                                 {"/v1/completions", http::verb::post},
                                 {"/v1/chat/completions", http::verb::post},
                                 {"/tokenize", http::verb::post},
                                 {"/detokenize", http::verb::post},
                                 {"/tokenizer_info", http::verb::get}};
  const Route* route = nullptr;
  for (const Route& r : routes)
    if (path == r.path) route = &r;
  const std::string label = route ? path : "other";
  auto send = [&](int status, std::string body, const std::string& type = "application/json") {
    metrics_.count_request(label, status);
    ex->reply(status, std::move(body), type);
  };
  if (path == "/health" && req.method() == http::verb::get)  // no auth: load balancers probe it
    return queue_.draining() ? send(503, R"({"status":"draining"})") : send(200, R"({"status":"ok"})");
  if (!authorized(req))
    return send(401, error_for_status(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'"));
  if (!route) return send(404, error_for_status(404, "no such endpoint: " + path));
  if (req.method() != route->method)
    return send(405, error_for_status(405, std::string(req.method_string()) + " is not allowed on " + path + "; use " +
                                               std::string(http::to_string(route->method))));
  if (path == "/metrics") return send(200, metrics_.text() + queue_.engine_metrics(), "text/plain; version=0.0.4");
  if (path == "/v1/models") return models(ex);
  if (path == "/health") return;
  if (path == "/tokenize" || path == "/detokenize" || path == "/tokenizer_info") return tokenizer(req, ex, path);
  completion(req, ex, path);
}

void ServeApi::models(const std::shared_ptr<Exchange>& ex) {
  const json m = {{"id", opt_.model_id},
                  {"object", "model"},
                  {"created", int64_t(std::time(nullptr))},
                  {"owned_by", "glm5"},
                  {"max_model_len", mc_.max_position_embeddings}};
  metrics_.count_request("/v1/models", 200);
  ex->reply(200, dump({{"object", "list"}, {"data", json::array({m})}}));
}

// /tokenize, /detokenize, /tokenizer_info (vLLM's): the tokenizer alone, no engine work.
void ServeApi::tokenizer(const HttpRequest& req, const std::shared_ptr<Exchange>& ex, const std::string& path) {
  auto reply = [&](int status, const std::string& body) {
    metrics_.count_request(path, status);
    ex->reply(status, body);
  };
  if (!tok_)
    return reply(400, error_json(path + " needs a tokenizer, but the model directory has no tokenizer.json",
                                 "invalid_request_error", "", ""));
  try {
    if (path == "/tokenizer_info") return reply(200, dump(tokenizer_info_json(mc_, *tok_)));
    const json body = parse_client_json(req.body());
    if (body.is_object() && body.contains("model") && body["model"] != opt_.model_id)
      return reply(404, error_json("model " + describe(body["model"]) + " does not exist; this server serves '" +
                                       opt_.model_id + "'",
                                   "invalid_request_error", "model", "model_not_found"));
    reply(200, dump(path == "/tokenize" ? tokenize_json(body, mc_, *tok_) : detokenize_json(body, mc_, *tok_)));
  } catch (const json::parse_error& e) {
    reply(400,
          error_json(std::string("malformed JSON body: ") + e.what(), "invalid_request_error", "", "invalid_json"));
  } catch (const JsonTooDeep& e) {
    reply(400, error_json(std::string("request body: ") + e.what(), "invalid_request_error", "", "invalid_json"));
  } catch (const std::exception& e) {
    const std::string m = client_message(e.what());
    reply(400, error_json(m, "invalid_request_error", field_of(m), ""));
  }
}

// A request without max_tokens runs to the end of the context, but no further than one
// sequence's KV cache holds (prompt + max_tokens + 1 tokens), which the engine would refuse.
void ServeApi::cap_default_length(BatchLine& b) const {
  const int64_t kv = queue_.sequence_tokens();
  if (!b.default_length || kv <= 0) return;
  size_t longest = 0;
  for (const auto& p : b.prompts) longest = std::max(longest, p.size());
  const int64_t most = kv - int64_t(longest) - 1;
  if (most >= 1 && most < b.request.sampling.max_tokens) b.request.sampling.max_tokens = int32_t(most);
}

void ServeApi::completion(const HttpRequest& req, const std::shared_ptr<Exchange>& ex, const std::string& url) {
  auto fail = [&](int status, const std::string& message, const std::string& param = "", const std::string& code = "") {
    metrics_.count_request(url, status);
    ex->reply(status, status == 400 ? error_json(message, "invalid_request_error", param, code)
                                    : error_for_status(status, message));
  };
  if (queue_.draining()) return fail(503, "the server is shutting down");
  const uint64_t seq = seq_++;
  BatchLine b;
  b.url = url;
  try {
    const json body = parse_client_json(req.body());
    CHECK(body.is_object(), "the request body must be a JSON object, found ", body.type_name());
    parse_request_body(body, b, BodyForm::server, seq, "", mc_, tok_);
  } catch (const json::parse_error& e) {
    return fail(400, std::string("malformed JSON body: ") + e.what(), "", "invalid_json");
  } catch (const JsonTooDeep& e) {
    return fail(400, std::string("request body: ") + e.what(), "", "invalid_json");
  } catch (const std::exception& e) {
    const std::string m = client_message(e.what());
    return fail(400, m, field_of(m));
  }
  const bool chat = url == "/v1/chat/completions";
  if (!b.error.empty()) return fail(400, b.error, chat ? "messages" : "prompt", b.error_code);
  if (!b.model_name.empty() && b.model_name != opt_.model_id) {
    metrics_.count_request(url, 404);
    return ex->reply(404, error_json("model " + describe(json(b.model_name)) + " does not exist; this server serves '" +
                                         opt_.model_id + "'",
                                     "invalid_request_error", "model", "model_not_found"));
  }
  // More choices than the queue holds could never be accepted: not a retryable 429.
  if (size_t(b.choices()) > queue_.max_queue())
    return fail(400,
                "field 'n': expected at most " + std::to_string(queue_.max_queue()) +
                    " (--max-queue) choices over all prompts, found " + std::to_string(b.choices()),
                "n");
  cap_default_length(b);
  if (b.stream && b.request.sampling.logprobs >= 0)
    return fail(400, "field 'logprobs': not supported with stream true", "logprobs");
  std::vector<runtime::Request> choices = choice_requests(b);
  int64_t prompt_rows = 0;
  for (runtime::Request& r : choices) {
    r.stream = true;  // tokens as they come: streams, and the latency metrics of every request
    prompt_rows += int64_t(r.prompt.size());
  }
  metrics_.prompt_tokens += prompt_rows;
  const std::string id = (url == "/v1/chat/completions" ? "chatcmpl-" : "cmpl-") + std::to_string(seq);
  auto call = std::make_shared<Call>(ex, b, tok_, metrics_, queue_, opt_.model_id, id);
  std::vector<int64_t> indexes;
  switch (queue_.submit(std::move(choices), call, indexes)) {
    case ServeQueue::Admit::full:
      metrics_.prompt_tokens -= prompt_rows;
      return fail(429, "the request queue is full; retry later");
    case ServeQueue::Admit::draining:
      metrics_.prompt_tokens -= prompt_rows;
      return fail(503, "the server is shutting down");
    case ServeQueue::Admit::ok: break;
  }
  if (b.stream) metrics_.count_request(url, 200);
  call->start(std::move(indexes));
}

}  // namespace glm5::launcher
