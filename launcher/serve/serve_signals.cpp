// Stop signals of serve and batch: async-signal-safe handlers that write one record per signal to a
// pipe, and a watcher thread that reads them, tells Open MPI's kill sequence from job control and
// calls the job's callback (launcher/serve/serve_signals.h).
#include "launcher/serve/serve_signals.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kernels/core/check.h"

namespace glm5::launcher {

namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1, SIGCONT};

struct Record {
  int sig = 0;  // 0: the watcher's quit message
  pid_t pid = 0;
  int code = 0;
};

std::atomic<int> g_write_fd{-1};
struct sigaction g_previous[sizeof kSignals / sizeof kSignals[0]];

void on_signal(int sig, siginfo_t* info, void*) {
  const int saved = errno;
  Record r;
  r.sig = sig;
  r.pid = info ? info->si_pid : 0;
  r.code = info ? info->si_code : 0;
  const int fd = g_write_fd.load();
  if (fd >= 0) {
    // One record is far below PIPE_BUF: written whole or (pipe full, never in practice) not at all.
    [[maybe_unused]] const ssize_t n = ::write(fd, &r, sizeof r);
  }
  errno = saved;
}

bool from_sender(const Record& r) { return r.code == SI_USER || r.code == SI_QUEUE || r.code == SI_TKILL; }

// The Open MPI daemon that started this process (mpirun or an orted): its session directory,
// .../pid.<pid>, is in PMIX_SERVER_TMPDIR; 0 when not found. Its kill sequence signals the rank's
// whole process group, so the sender is the daemon even when a wrapper script is the parent.
pid_t open_mpi_daemon() {
  const char* dir = std::getenv("PMIX_SERVER_TMPDIR");
  if (!dir) return 0;
  const char* at = std::strstr(dir, "/pid.");
  if (!at) return 0;
  char* end = nullptr;
  const long pid = std::strtol(at + 5, &end, 10);
  return end && (*end == '\0' || *end == '/') && pid > 1 ? pid_t(pid) : 0;
}

}  // namespace

const char* StopSignals::name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    case SIGCONT: return "SIGCONT";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

std::string StopEvent::what() const {
  const std::string n = StopSignals::name(sig);
  if (from_launcher && sig == SIGCONT)
    return "SIGCONT from mpirun: its kill sequence (mpirun got SIGTERM or SIGINT, or a rank failed)";
  if (from_launcher) return n + " from mpirun (its kill sequence)";
  return n;
}

double StopSignals::launcher_kill_step_s() {
  // ORTE (Open MPI 4.x) puts its contact URIs in every rank's environment.
  if (!std::getenv("OMPI_MCA_orte_hnp_uri") && !std::getenv("OMPI_MCA_orte_local_daemon_uri")) return -1;
  const char* t = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  if (!t || !*t) return 1;
  char* end = nullptr;
  const double v = std::strtod(t, &end);
  return end && *end == '\0' && v >= 0 ? v : 1;
}

StopClock::duration StopSignals::kill_margin(double step_s) {
  const double s = std::clamp(step_s / 2, 0.0, 2.0);
  return std::chrono::duration_cast<StopClock::duration>(std::chrono::duration<double>(s));
}

void StopSignals::ignore() {
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) ::signal(sig, SIG_IGN);
}

StopSignals::StopSignals(std::function<void(const StopEvent&)> on_stop) : on_stop_(std::move(on_stop)) {
  CHECK(g_write_fd.load() < 0, "internal: two StopSignals at once");
  CHECK(::pipe2(pipe_, O_CLOEXEC) == 0, "cannot create a pipe for the signal handlers: ", std::strerror(errno));
  ::fcntl(pipe_[1], F_SETFL, ::fcntl(pipe_[1], F_GETFL) | O_NONBLOCK);  // a handler never blocks
  g_write_fd.store(pipe_[1]);
  thread_ = std::thread([this] { watch(); });
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &sa, &g_previous[i]);
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  Record quit;
  while (::write(pipe_[1], &quit, sizeof quit) < 0 && errno == EINTR) {}
  thread_.join();
  g_write_fd.store(-1);
  ::close(pipe_[0]);
  ::close(pipe_[1]);
}

// Wakes at least every 50 ms: a wake that comes kStoppedGap or more after the last one means this
// process was stopped (or starved; then a SIGCONT is only taken for job control, and the launcher's
// SIGTERM T seconds later still stops the job).
void StopSignals::watch() {
  const double step = launcher_kill_step_s();
  const pid_t parent = ::getppid(), daemon = open_mpi_daemon();
  const auto step_d =
      std::chrono::duration_cast<StopClock::duration>(std::chrono::duration<double>(std::max(step, 0.0)));
  auto last = StopClock::now();
  auto resumed = last - std::chrono::hours(1);  // never (min() would overflow the subtraction)
  bool seen = false;
  pollfd p{pipe_[0], POLLIN, 0};
  for (;;) {
    const int rc = ::poll(&p, 1, 50);
    const auto now = StopClock::now();
    if (now - last >= kStoppedGap) resumed = now;
    last = now;
    if (rc <= 0) continue;
    Record r;
    const ssize_t n = ::read(pipe_[0], &r, sizeof r);
    if (n != ssize_t(sizeof r)) continue;
    if (r.sig == 0) return;
    StopEvent e;
    e.sig = r.sig;
    e.sender = from_sender(r) ? int(r.pid) : 0;
    const bool from_open_mpi = step >= 0 && from_sender(r) && r.pid > 1 && (r.pid == parent || r.pid == daemon);
    if (r.sig == SIGCONT) {
      // Only Open MPI's kill sequence: not the end of a stop, not from anyone else.
      if (!from_open_mpi || now - resumed < 2 * kStoppedGap) continue;
      e.from_launcher = true;
      e.kill_at = now + 2 * step_d;
    } else if (r.sig == SIGTERM && from_open_mpi) {  // mpirun never forwards SIGTERM: its kill sequence
      e.from_launcher = true;
      e.kill_at = now + step_d;
    }
    e.repeat = seen;
    seen = true;
    on_stop_(e);
  }
}

}  // namespace glm5::launcher
