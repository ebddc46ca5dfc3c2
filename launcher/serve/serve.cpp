// glm5 serve: the job, the HTTP threads of rank 0, the engine loop and the drain.
#include "launcher/serve/serve.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include "kernels/core/check.h"
#include "launcher/cli/commands.h"
#include "launcher/serve/serve_api.h"
#include "launcher/serve/serve_queue.h"
#include "launcher/serve/serve_signals.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::launcher {

namespace net = boost::asio;

namespace {

// Rank 0's stop requests (launcher/serve/serve_signals.h): the first one drains, bounded by the drain
// timeout and, under Open MPI's kill sequence, by the SIGKILL it announces (cancelled in time to
// answer every client); a second signal from anyone but mpirun cancels what is left at once.
class Drain {
 public:
  Drain(net::io_context& ioc, HttpServer& server, ServeQueue& queue, double timeout_s)
      : strand_(net::make_strand(ioc)),
        timer_(strand_),
        server_(server),
        queue_(queue),
        timeout_s_(timeout_s),
        signals_([this](const StopEvent& e) { net::post(strand_, [this, e] { on_stop(e); }); }) {}

  // When the launcher's SIGKILL is due, if a signal said (max() otherwise).
  StopClock::time_point kill_at() const { return StopClock::time_point(StopClock::duration(kill_at_.load())); }

 private:
  void on_stop(const StopEvent& e) {
    const auto now = StopClock::now();
    const bool nearer = e.kill_at && *e.kill_at < kill_at();
    if (nearer) kill_at_.store(e.kill_at->time_since_epoch().count());
    const double kill_in = std::chrono::duration<double>(kill_at() - now).count();
    if (started_) {
      if (!e.from_launcher) {
        std::fprintf(stderr, "[glm5] serve: signal %d again: cancelling the requests in flight\n", e.sig);
        queue_.cancel_all();
      } else if (nearer) {
        std::fprintf(stderr, "[glm5] serve: %s: its SIGKILL is due in %.1f s; what is left is cancelled before\n",
                     e.what().c_str(), kill_in);
        arm();
      }
      return;
    }
    started_ = true;
    cancel_at_ = now + std::chrono::duration_cast<StopClock::duration>(std::chrono::duration<double>(timeout_s_));
    const double limit = std::chrono::duration<double>(arm() - now).count();
    if (e.kill_at)
      std::fprintf(stderr,
                   "[glm5] serve: signal %d: draining (%s; no new requests; up to %.1f s for the accepted "
                   "ones: mpirun's SIGKILL is due in %.1f s)\n",
                   e.sig, e.what().c_str(), limit, kill_in);
    else
      std::fprintf(stderr,
                   "[glm5] serve: signal %d: draining (%s; no new requests; up to %.0f s for the accepted ones)\n",
                   e.sig, e.what().c_str(), limit);
    queue_.drain();  // first: a request read from now on gets 503
    server_.drain();
  }
  // The timer for the earlier of the drain timeout and the launcher's SIGKILL less the margin.
  StopClock::time_point arm() {
    StopClock::time_point at = cancel_at_;
    if (kill_at() != StopClock::time_point::max())
      at = std::min(at, kill_at() - StopSignals::kill_margin(std::max(StopSignals::launcher_kill_step_s(), 0.0)));
    const bool kill = at < cancel_at_;
    timer_.expires_at(at);
    timer_.async_wait([this, kill](const boost::system::error_code& ec) {
      if (ec || cancelled_) return;  // re-armed, or done already
      cancelled_ = true;
      std::fprintf(stderr, "[glm5] serve: drain timeout%s: cancelling the requests still in flight\n",
                   kill ? " (mpirun's SIGKILL is near)" : "");
      queue_.cancel_all();
    });
    return at;
  }
  net::strand<net::io_context::executor_type> strand_;  // the handlers below run one at a time
  net::steady_timer timer_;
  HttpServer& server_;
  ServeQueue& queue_;
  double timeout_s_;
  bool started_ = false, cancelled_ = false;
  StopClock::time_point cancel_at_{};
  std::atomic<StopClock::rep> kill_at_{StopClock::time_point::max().time_since_epoch().count()};
  StopSignals signals_;  // last: its thread posts to the members above
};

// Rank 0's HTTP threads. Stopped and joined on every way out of run_serve, an exception from the
// engine included (joinable threads left to unwind would std::terminate, not print the error).
struct HttpThreads {
  net::io_context& ioc;
  std::vector<std::thread> threads;
  ~HttpThreads() { stop(); }
  void stop() {
    ioc.stop();
    for (auto& t : threads)
      if (t.joinable()) t.join();
  }
};

std::string default_model_name(const std::string& dir) {
  std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace

int run_serve(const ServeArgs& a, std::unique_ptr<parallel::Comm> world) {
  CHECK(a.max_queue >= 1, "--max-queue: expected >= 1, found ", a.max_queue);
  CHECK(a.drain_timeout_s >= 0, "--drain-timeout: expected >= 0 seconds, found ", a.drain_timeout_s);
  CHECK(a.http_threads >= 1, "--http-threads: expected >= 1, found ", a.http_threads);
  const bool root = world->rank() == 0;
  // Rank 0 decides when the job ends: a signal to every rank (mpirun, Slurm) must not end the
  // others before it. Until rank 0's handler exists (after loading), a signal ends the process.
  // mpirun forwards SIGUSR1 (not SIGTERM) to every rank: it drains too (glm5 launch --run sends it).
  if (!root) StopSignals::ignore();
  auto job = make_job(a.model, a.cluster, std::move(world), false, a.overrides);
  const std::unique_ptr<runtime::Tokenizer> tok = runtime::Tokenizer::load_if_present(a.model);
  job->engine->set_tokenizer(tok.get());
  if (!root) {
    job->start_watchdog();
    job->engine->run(nullptr, [](runtime::Result&&) {});
    return 0;
  }

  ServeMetrics metrics;
  ServeQueue queue(size_t(a.max_queue), metrics);
  queue.set_engine(job->engine.get());
  const std::string name = a.model_name.empty() ? default_model_name(a.model) : a.model_name;
  ServeApi api(queue, metrics, job->config, tok.get(), {a.api_key, name});
  net::io_context ioc;
  HttpServer server(
      ioc, a.host, a.port, a.limits,
      [&api](HttpRequest&& req, std::shared_ptr<Exchange> ex) { api.handle(std::move(req), std::move(ex)); },
      [](int status, const std::string& message) { return error_for_status(status, message); });
  Drain drain(ioc, server, queue, a.drain_timeout_s);
  server.start();
  HttpThreads http{ioc, {}};
  for (int i = 0; i < a.http_threads; ++i) http.threads.emplace_back([&ioc] { ioc.run(); });
  std::fprintf(stderr, "[glm5] serve: listening on http://%s:%d (model '%s', %d rank(s), pid %d)\n", a.host.c_str(),
               server.port(), name.c_str(), job->world->size(), int(getpid()));
  std::fflush(stderr);

  job->start_watchdog();
  job->engine->run(&queue, [&queue](runtime::Result&& r) { queue.deliver(std::move(r)); });
  // Every accepted request has its result; let the connections write their answers (bounded: a
  // client that stops reading is dropped by the write timeout anyway), no new ones.
  server.stop_accepting();
  // ... and before a SIGKILL mpirun announced.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  if (drain.kill_at() != StopClock::time_point::max())
    until = std::min(until, drain.kill_at() - std::chrono::milliseconds(200));
  while (server.busy() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  http.stop();
  std::fprintf(stderr, "[glm5] serve: drained; exiting\n");
  return 0;
}

}  // namespace glm5::launcher
