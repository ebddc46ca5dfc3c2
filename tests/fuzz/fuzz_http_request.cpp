// Raw bytes on the server's port: Boost.Beast's request parser with the limits `glm5 serve` sets
// (launcher/serve/http_server.cpp), then every request it completes through the API
// (launcher/serve/serve_api.h) with the tiny model's config and tokenizer. The API must answer
// every request the client got wrong with a 4xx and never with a 5xx (503 is the one 5xx it may
// send: draining or full), or queue it for the engine.
#include <cstdint>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/parser.hpp>
#include <nlohmann/json.hpp>

#include "launcher/serve/serve_api.h"
#include "runtime/config.h"
#include "runtime/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

using namespace glm5;

// Records the answer; a stream counts as a 200.
struct RecordingExchange : launcher::Exchange {
  boost::asio::io_context& ioc;
  int status = 0;
  explicit RecordingExchange(boost::asio::io_context& c) : ioc(c) {}
  boost::asio::any_io_executor executor() override { return ioc.get_executor(); }
  void reply(int s, std::string body, const std::string& type) override {
    fuzz::require(status == 0, "one answer per request");
    status = s;
    if (type != "application/json") return;
    const auto j = nlohmann::json::parse(body, nullptr, false);
    fuzz::require(!j.is_discarded(), "a JSON answer parses");
    fuzz::require(s < 400 || (j.is_object() && j.contains("error") && j["error"].is_object()),
                  "an error answer carries an OpenAI error object");
  }
  void begin_stream() override { status = 200; }
  void stream_data(std::string) override {}
  void end_stream() override {}
  void on_gone(std::function<void()>) override {}
  bool gone() const override { return false; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace http = boost::beast::http;
  static const runtime::ModelConfig mc = runtime::load_config(fuzz::kData + "/tiny-a");
  static const runtime::Tokenizer tok = runtime::Tokenizer::load(fuzz::kData + "/tiny-a");
  static boost::asio::io_context ioc;
  const launcher::HttpLimits limits;
  launcher::ServeMetrics metrics;
  launcher::ServeQueue queue(64, metrics);
  launcher::ServeApi api(queue, metrics, mc, &tok, {"secret", "glm5"});

  // Several requests may follow each other on one connection (keep-alive).
  boost::asio::const_buffer in(data, size);
  for (int requests = 0; requests < 4 && in.size() > 0; ++requests) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(uint32_t(limits.header_bytes));
    parser.body_limit(limits.body_bytes);
    parser.eager(true);
    boost::beast::error_code ec;
    const size_t used = parser.put(in, ec);
    if (ec == http::error::need_more) {  // the client closes the connection here
      ec = {};
      parser.put_eof(ec);
    }
    if (ec || !parser.is_done()) return 0;  // the transport answers 400 / 413 / 431 itself
    in += used;
    auto ex = std::make_shared<RecordingExchange>(ioc);
    fuzz::expect_clean("ServeApi::handle", [&] { api.handle(parser.release(), ex); });
    fuzz::require(ex->status == 0 || (ex->status >= 200 && ex->status < 500) || ex->status == 503,
                  "no 5xx but 503 for a client's request");
  }
  return 0;
}
