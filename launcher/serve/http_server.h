// The HTTP/1.1 transport of `glm5 serve` on Boost.Beast over Asio: a listener and one session per
// connection (on its own strand), with the limits a public port needs: header and body size
// limits, a read timeout for the whole request (a slow or idle client cannot hold a connection),
// a write timeout (a client that stops reading its stream is dropped), a cap on connections, and
// detection of a client that goes away while its answer is being made. It knows no endpoints: a
// Handler gets each request and answers through its Exchange. No MPI here.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

namespace glm5::launcher {

struct HttpLimits {
  size_t header_bytes = 16 * 1024;
  size_t body_bytes = 8 * 1024 * 1024;
  double read_timeout_s = 30;   // from the first byte of a request (or the end of the last answer) to its end
  double write_timeout_s = 30;  // for each write to the client
  int max_connections = 512;    // beyond: 503 and close
};

// The answer side of one request, used on its connection's strand (post to executor() from other
// threads). Either reply() once, or begin_stream(), stream_data()..., end_stream().
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual boost::asio::any_io_executor executor() = 0;
  virtual void reply(int status, std::string body, const std::string& content_type = "application/json") = 0;
  virtual void begin_stream() = 0;                  // 200, text/event-stream, chunked
  virtual void stream_data(std::string bytes) = 0;  // one chunk of the stream
  virtual void end_stream() = 0;
  // Called once if the client goes away before the answer is complete.
  virtual void on_gone(std::function<void()> f) = 0;
  virtual bool gone() const = 0;
};

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpHandler = std::function<void(HttpRequest&&, std::shared_ptr<Exchange>)>;
// The body for an error the transport answers itself (413, 431, 400, 503).
using ErrorBody = std::function<std::string(int status, const std::string& message)>;

class HttpServer {
 public:
  // Binds and listens (port 0: a free port); throws glm5::Error naming host:port when it cannot.
  HttpServer(boost::asio::io_context& ioc, const std::string& host, int port, const HttpLimits& limits,
             HttpHandler handler, ErrorBody error_body);
  ~HttpServer();
  int port() const { return port_; }
  void start();
  // Draining: idle connections close, busy ones after their answer; new connections still get
  // one request read and answered (the handler says 503: clients and load balancers see the
  // server going away instead of a refused connection), then close.
  void drain();
  // drain(), and no new connections either.
  void stop_accepting();
  // Requests read and not yet answered (nor their client gone).
  int busy() const;

  struct Shared;

 private:
  void accept();
  void accept_later(const boost::system::error_code& ec);
  boost::asio::io_context& ioc_;
  std::shared_ptr<Shared> shared_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_;  // on the acceptor's strand
  bool accept_error_logged_ = false;
  int port_ = 0;
};

}  // namespace glm5::launcher
