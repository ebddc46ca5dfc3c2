// HTTP/1.1 sessions on Beast: read a request (size limits, read timeout), hand it to the handler,
// watch the socket while the answer is made (a client gone cancels its work), write the answer
// (a whole response or a chunked event stream, write timeout), then the next request (keep-alive).
#include "launcher/serve/http_server.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <optional>
#include <variant>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "kernels/core/check.h"

namespace glm5::launcher {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {
class Session;
std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}
}  // namespace

struct HttpServer::Shared {
  HttpLimits limits;
  HttpHandler handler;
  ErrorBody error_body;
  std::atomic<int> connections{0}, busy{0};
  std::atomic<bool> closing{false};
  std::mutex mu;
  std::set<std::weak_ptr<Session>, std::owner_less<std::weak_ptr<Session>>> sessions;
};

namespace {

class Session : public std::enable_shared_from_this<Session>, public Exchange {
 public:
  Session(tcp::socket&& socket, std::shared_ptr<HttpServer::Shared> shared, bool over_capacity)
      : stream_(std::move(socket)),
        timer_(stream_.get_executor()),
        shared_(std::move(shared)),
        over_capacity_(over_capacity) {
    ++shared_->connections;
  }
  ~Session() override {
    if (in_exchange_) --shared_->busy;
    --shared_->connections;
  }

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
      if (!self->over_capacity_) return self->read_request();
      // The request is not read; closing with it unread would send a reset that the client may
      // see before the answer. Linger as after a body over the limit: read and drop, then close.
      self->keep_alive_ = false;
      self->linger_ = true;
      self->in_exchange_ = true;
      ++self->shared_->busy;
      self->reply(503, self->shared_->error_body(503, "too many connections; retry later"), "application/json");
    });
  }
  // At shutdown: an idle connection closes now (a busy one after its answer).
  void close_if_idle() {
    net::post(stream_.get_executor(), [self = shared_from_this()] {
      if (!self->in_exchange_) self->close();
    });
  }

  // Exchange
  net::any_io_executor executor() override { return stream_.get_executor(); }
  void reply(int status, std::string body, const std::string& content_type) override {
    auto res = std::make_shared<http::response<http::string_body>>(http::int_to_status(unsigned(status)), 11);
    res->set(http::field::server, "glm5");
    res->set(http::field::content_type, content_type);
    res->keep_alive(keep_alive_ && !shared_->closing);
    res->body() = std::move(body);
    res->prepare_payload();
    push(Out{res});
  }
  void begin_stream() override {
    auto h = std::make_shared<Header>();
    h->res.result(http::status::ok);
    h->res.version(11);
    h->res.set(http::field::server, "glm5");
    h->res.set(http::field::content_type, "text/event-stream");
    h->res.set(http::field::cache_control, "no-cache");
    h->res.keep_alive(keep_alive_ && !shared_->closing);
    h->res.chunked(true);
    push(Out{h});
  }
  void stream_data(std::string bytes) override {
    if (!bytes.empty()) push(Out{std::make_shared<std::string>(std::move(bytes))});
  }
  void end_stream() override { push(Out{Last{}}); }
  void on_gone(std::function<void()> f) override { on_gone_ = std::move(f); }
  bool gone() const override { return gone_; }

 private:
  struct Header {
    http::response<http::empty_body> res;
    std::optional<http::response_serializer<http::empty_body>> sr;
  };
  struct Last {};
  using Full = std::shared_ptr<http::response<http::string_body>>;
  using Chunk = std::shared_ptr<std::string>;
  struct Out {
    std::variant<Full, std::shared_ptr<Header>, Chunk, Last> v;
    bool ends() const { return std::holds_alternative<Full>(v) || std::holds_alternative<Last>(v); }
  };

  // While the server drains a connection still reads its request: the handler answers 503 (and
  // /health says draining) and the connection closes after that answer (finish()).
  void read_request() {
    parser_.emplace();
    parser_->header_limit(std::uint32_t(shared_->limits.header_bytes));
    parser_->body_limit(shared_->limits.body_bytes);
    stream_.expires_after(seconds(shared_->limits.read_timeout_s));
    http::async_read_header(stream_, buffer_, *parser_,
                            beast::bind_front_handler(&Session::on_header, shared_from_this()));
  }

  // A client that asks "Expect: 100-continue" (curl does for bodies over 1 KiB) waits for the
  // interim answer before it sends the body; the read timeout still covers the whole request.
  void on_header(beast::error_code ec, size_t) {
    if (ec) return read_failed(ec);
    const auto& h = parser_->get();
    const auto expect = h.find(http::field::expect);
    if (expect == h.end() || !beast::iequals(expect->value(), "100-continue")) return read_body();
    auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_, 11);
    http::async_write(stream_, *cont, [self = shared_from_this(), cont](beast::error_code e, size_t) {
      if (e) return self->close();
      self->read_body();
    });
  }
  void read_body() {
    http::async_read(stream_, buffer_, *parser_, beast::bind_front_handler(&Session::on_read, shared_from_this()));
  }

  void on_read(beast::error_code ec, size_t) {
    if (ec) return read_failed(ec);
    stream_.expires_never();  // the answer may take long; the watch and the write timer take over
    HttpRequest req = parser_->release();
    parser_.reset();
    keep_alive_ = req.keep_alive();
    in_exchange_ = true;
    ++shared_->busy;
    watch();
    shared_->handler(std::move(req), shared_from_this());
  }

  // A request that cannot be read: the limits answer with their status, a malformed request with
  // 400; a timeout, a closed or reset connection just end it.
  void read_failed(beast::error_code ec) {
    int status = 0;
    std::string why;
    if (ec == http::error::body_limit) {
      status = 413;
      why = "request body larger than " + std::to_string(shared_->limits.body_bytes) + " bytes";
    } else if (ec == http::error::header_limit) {
      status = 431;
      why = "request header larger than " + std::to_string(shared_->limits.header_bytes) + " bytes";
    } else if (ec.category() == http::make_error_code(http::error::bad_target).category() &&
               ec != http::error::end_of_stream && ec != http::error::partial_message) {
      status = 400;
      why = "malformed HTTP request: " + ec.message();
    }
    if (status == 0) return close();
    stream_.expires_never();
    keep_alive_ = false;  // the rest of what the client sent cannot be parsed
    linger_ = true;       // ... but it is read and dropped, so the client gets to read the answer
    in_exchange_ = true;
    ++shared_->busy;
    reply(status, shared_->error_body(status, why), "application/json");
  }

  // Reads while the answer is made: bytes a pipelining client sends are kept for the next request;
  // an end of stream or an error means the client went away.
  void watch() {
    if (buffer_.size() >= 64 * 1024) return;  // enough kept; a gone client shows at the next write
    watching_ = true;
    stream_.socket().async_read_some(buffer_.prepare(4096),
                                     beast::bind_front_handler(&Session::on_watch, shared_from_this()));
  }
  void on_watch(beast::error_code ec, size_t n) {
    watching_ = false;
    if (!ec) {
      buffer_.commit(n);
      if (in_exchange_) return watch();
      return read_request();
    }
    if (!in_exchange_ && ec == net::error::operation_aborted) return read_request();  // cancelled by finish()
    client_gone();
  }

  void client_gone() {
    if (closed_) return;
    if (in_exchange_ && !gone_) {
      gone_ = true;
      if (on_gone_) std::exchange(on_gone_, nullptr)();
    }
    close();
  }

  void push(Out o) {
    if (gone_ || closed_) return;
    out_.push_back(std::move(o));
    if (!writing_) write_next();
  }

  void write_next() {
    if (out_.empty() || closed_) return;
    writing_ = true;
    const uint64_t gen = ++write_gen_;
    timer_.expires_after(seconds(shared_->limits.write_timeout_s));
    timer_.async_wait([self = shared_from_this(), gen](beast::error_code ec) {
      if (!ec && self->writing_ && self->write_gen_ == gen) self->client_gone();  // stopped reading
    });
    auto done = beast::bind_front_handler(&Session::on_write, shared_from_this());
    Out& o = out_.front();
    if (auto* f = std::get_if<Full>(&o.v)) return http::async_write(stream_, **f, std::move(done));
    if (auto* h = std::get_if<std::shared_ptr<Header>>(&o.v)) {
      (*h)->sr.emplace((*h)->res);
      return http::async_write_header(stream_, *(*h)->sr, std::move(done));
    }
    if (auto* c = std::get_if<Chunk>(&o.v))
      return net::async_write(stream_, http::make_chunk(net::buffer(**c)), std::move(done));
    net::async_write(stream_, http::make_chunk_last(), std::move(done));
  }

  void on_write(beast::error_code ec, size_t) {
    writing_ = false;
    timer_.cancel();
    if (ec) return client_gone();
    const bool ended = out_.front().ends();
    out_.pop_front();
    if (ended) return finish();
    write_next();
  }

  // The answer is out: the next request, or close.
  void finish() {
    in_exchange_ = false;
    --shared_->busy;
    on_gone_ = nullptr;
    if (linger_) return linger();
    if (!keep_alive_ || shared_->closing) return close();
    if (watching_) {
      stream_.socket().cancel();  // on_watch goes on with the next request
      return;
    }
    read_request();
  }

  // After an error answer to a request that is still arriving (a body over the limit): no more
  // sending, and what the client still sends is read and dropped for a while (bounded in time
  // and bytes), so that it can finish sending and read the answer instead of a reset.
  void linger() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.expires_after(seconds(std::min(5.0, shared_->limits.read_timeout_s)));
    drop_rest();
  }
  void drop_rest() {
    if (dropped_ > (64u << 20)) return close();
    buffer_.consume(buffer_.size());
    stream_.async_read_some(buffer_.prepare(64 * 1024), [self = shared_from_this()](beast::error_code ec, size_t n) {
      if (ec) return self->close();
      self->dropped_ += n;
      self->drop_rest();
    });
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
    timer_.cancel();
  }

  beast::tcp_stream stream_;
  net::steady_timer timer_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<HttpServer::Shared> shared_;
  std::deque<Out> out_;
  std::function<void()> on_gone_;
  uint64_t write_gen_ = 0;
  size_t dropped_ = 0;
  bool over_capacity_ = false, keep_alive_ = true, in_exchange_ = false, watching_ = false, writing_ = false;
  bool gone_ = false, closed_ = false, linger_ = false;
};

}  // namespace

HttpServer::HttpServer(net::io_context& ioc, const std::string& host, int port, const HttpLimits& limits,
                       HttpHandler handler, ErrorBody error_body)
    : ioc_(ioc),
      shared_(std::make_shared<Shared>()),
      acceptor_(net::make_strand(ioc)),
      retry_(acceptor_.get_executor()) {
  shared_->limits = limits;
  shared_->handler = std::move(handler);
  shared_->error_body = std::move(error_body);
  CHECK(port >= 0 && port <= 65535, "--port: expected 0..65535, found ", port);
  beast::error_code ec;
  const auto addr = net::ip::make_address(host, ec);
  CHECK(!ec, "--host: expected an IP address (e.g. 127.0.0.1 or 0.0.0.0), found '", host, "'");
  const tcp::endpoint ep(addr, static_cast<unsigned short>(port));
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  CHECK(!ec, "cannot listen on ", host, ":", port, ": ", ec.message());
  port_ = acceptor_.local_endpoint().port();
}

HttpServer::~HttpServer() = default;

void HttpServer::start() { accept(); }

void HttpServer::accept() {
  acceptor_.async_accept(net::make_strand(ioc_), [this](beast::error_code ec, tcp::socket s) {
    if (ec) {
      if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;  // stop_accepting
      return accept_later(ec);
    }
    const bool over = shared_->connections.load() >= shared_->limits.max_connections;
    auto session = std::make_shared<Session>(std::move(s), shared_, over);
    {
      std::lock_guard<std::mutex> lk(shared_->mu);
      for (auto it = shared_->sessions.begin(); it != shared_->sessions.end();)
        it = it->expired() ? shared_->sessions.erase(it) : std::next(it);
      shared_->sessions.insert(session);
    }
    session->start();
    accept();
  });
}

// An accept that fails (out of file descriptors, EMFILE) fails again at once while nothing
// closes: retry after 50 ms instead of spinning, and say so once.
void HttpServer::accept_later(const boost::system::error_code& ec) {
  if (!accept_error_logged_) {
    accept_error_logged_ = true;
    std::fprintf(stderr, "[glm5] serve: accept failed (%s); retrying every 50 ms\n", ec.message().c_str());
  }
  retry_.expires_after(std::chrono::milliseconds(50));
  retry_.async_wait([this](const boost::system::error_code& e) {
    if (!e && acceptor_.is_open()) accept();
  });
}

void HttpServer::drain() {
  shared_->closing = true;
  std::lock_guard<std::mutex> lk(shared_->mu);
  for (auto& w : shared_->sessions)
    if (auto s = w.lock()) s->close_if_idle();
}

void HttpServer::stop_accepting() {
  drain();
  net::post(acceptor_.get_executor(), [this] {
    beast::error_code ec;
    acceptor_.close(ec);
    retry_.cancel();
  });
}

int HttpServer::busy() const { return shared_->busy.load(); }

}  // namespace glm5::launcher
