// `glm5 launch`. See launch.h.
#include "launcher/launch/launch.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>

#include "kernels/core/check.h"
#include "launcher/cluster/cluster_config.h"

namespace glm5::launcher {

bool is_watchdog_abort(const std::string& line) {
  return line.find("[glm5] watchdog: rank ") != std::string::npos && line.find(" aborts the job") != std::string::npos;
}

namespace {

using Clock = std::chrono::steady_clock;

// Copies the job's stderr (a pipe) to ours as it comes and notes when a rank's watchdog aborts the
// job. Progress lines end in '\r', so both '\r' and '\n' end a line. The thread's state is shared
// with it, so that it may outlive this object: a process that outlives mpirun (an rsh client to a
// host that went away) can hold the pipe open, and then the thread is left to the process's exit.
class StderrWatch {
 public:
  explicit StderrWatch(int fd) : state_(std::make_shared<State>()) {
    state_->fd = fd;
    thread_ = std::thread([st = state_] { run(*st); });
  }
  ~StderrWatch() {
    for (int i = 0; i < 40 && !state_->done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (state_->done)
      thread_.join();
    else
      thread_.detach();
  }
  // Seconds since a rank aborted the job, or -1 if none has.
  double since_abort() const {
    const int64_t t = state_->abort_ns.load();
    return t == 0 ? -1 : std::chrono::duration<double>(Clock::now().time_since_epoch()).count() - t * 1e-9;
  }

 private:
  struct State {
    int fd = -1;
    std::atomic<int64_t> abort_ns{0};
    std::atomic<bool> done{false};
  };
  static void run(State& st) {
    std::string line;
    char buf[4096];
    bool out_open = true;  // our stderr still takes bytes (its reader may go away: EPIPE)
    for (;;) {
      const ssize_t n = read(st.fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      for (ssize_t off = 0; out_open && off < n;) {
        const ssize_t w = write(STDERR_FILENO, buf + off, size_t(n - off));
        if (w > 0)
          off += w;
        else if (errno != EINTR)
          out_open = false;  // keep reading, so that mpirun never blocks on us
      }
      for (ssize_t i = 0; i < n; ++i) {
        if (buf[i] != '\n' && buf[i] != '\r') {
          if (line.size() < 4096) line += buf[i];
          continue;
        }
        if (st.abort_ns == 0 && is_watchdog_abort(line))
          st.abort_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
        line.clear();
      }
    }
    close(st.fd);
    st.done = true;
  }
  std::shared_ptr<State> state_;
  std::thread thread_;
};

// Whether the child has exited (without reaping it).
bool exited(pid_t pid) {
  siginfo_t info{};
  return waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}

// `glm5 launch --run -- serve ...` and `-- batch ...`. Open MPI's mpirun (4.1) never forwards
// SIGTERM / SIGINT: it answers them by ending the job itself (SIGCONT to every rank, SIGTERM
// odls_base_sigkill_timeout seconds later, default 1, SIGKILL as long again; then it exits 1
// whatever the ranks did). It does forward SIGUSR1 to every rank at once: serve drains on it, batch
// stops at a record boundary. So the launcher runs mpirun as its child, in a process group of its
// own (a terminal's Ctrl-C reaches the launcher only), turns SIGTERM / SIGINT / SIGHUP into SIGUSR1
// to mpirun (a second one cancels what serve has left; a third is passed on as SIGTERM, Open MPI's
// kill, in case the job cannot stop by itself) and exits with mpirun's status.
//
// A rank whose watchdog fires aborts the job (MPI_Abort), and mpirun then waits for the daemon of
// every host to confirm. A host it cannot reach (a partition, a dead node) holds it until TCP gives
// up, 15 minutes or more. So mpirun's stderr comes through the launcher, which ends mpirun
// kAbortGraceS seconds after a rank's abort line if it is still there, and exits 1.
int run_draining(std::vector<char*>& av) {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGCHLD}) sigaddset(&set, sig);
  sigprocmask(SIG_BLOCK, &set, nullptr);  // from now on they queue for sigtimedwait
  int err[2];
  CHECK(pipe2(err, O_CLOEXEC) == 0, "could not start ", av[0], ": pipe: ", std::strerror(errno));
  const pid_t pid = fork();
  CHECK(pid >= 0, "could not start ", av[0], ": fork: ", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    sigprocmask(SIG_UNBLOCK, &set, nullptr);
    dup2(err[1], STDERR_FILENO);
    execvp(av[0], av.data());
    std::fprintf(stderr, "glm5: could not execute %s: %s\n", av[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);  // also here: whichever of the two runs first
  close(err[1]);
  // Our stderr may be a pipe whose reader goes away (| tee, a log shipper): a write then fails
  // with EPIPE instead of killing the launcher and orphaning mpirun. Set after the fork: mpirun
  // keeps the default.
  signal(SIGPIPE, SIG_IGN);
  StderrWatch watch(err[0]);  // started after the mask: its thread gets none of these signals
  int signals = 0;
  const timespec tick{1, 0};
  for (;;) {
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig < 0) {  // a second without a signal
      if (exited(pid)) {
        // reaped below
      } else if (watch.since_abort() > kAbortGraceS) {
        std::fprintf(stderr,
                     "[glm5] launch: a rank aborted the job %d s ago and mpirun is still waiting, most likely for "
                     "the daemon of a host it cannot reach; ending mpirun (SIGKILL)\n",
                     kAbortGraceS);
        kill(-pid, SIGKILL);  // mpirun's process group: mpirun and the rsh clients it started
        waitpid(pid, nullptr, 0);
        return 1;
      } else {
        continue;
      }
    } else if (sig != SIGCHLD) {
      if (++signals < 3) {
        std::fprintf(stderr, "[glm5] launch: signal %d: asking the job to stop (SIGUSR1 to mpirun)\n", sig);
        kill(pid, SIGUSR1);
      } else {
        std::fprintf(stderr,
                     "[glm5] launch: signal %d, the third or later: SIGTERM to mpirun (Open MPI ends every rank)\n",
                     sig);
        kill(pid, SIGTERM);
      }
      continue;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) != pid) continue;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  }
}

}  // namespace

int run_launch(const std::string& cluster, const std::vector<std::string>& args, bool run, const std::string& argv0,
               const std::string& slurm, bool srun) {
  ClusterConfig cc = load_cluster_config(cluster);
  std::string self = argv0;
  std::error_code ec;
  auto abs = std::filesystem::canonical("/proc/self/exe", ec);
  if (!ec) self = abs.string();
  if (!slurm.empty()) {
    std::ofstream f(slurm);
    f << slurm_script(cc, self, args, srun);
    f.close();
    CHECK(f, "cannot write --slurm ", slurm);
    std::filesystem::permissions(slurm, std::filesystem::perms::owner_exec | std::filesystem::perms::group_exec,
                                 std::filesystem::perm_options::add, ec);
    std::cout << "sbatch " << shell_join({slurm}) << std::endl;
    return 0;
  }
  std::vector<std::string> cmd = launch_command(cc, self, args, geteuid() == 0);
  // serve and batch stop cleanly on a signal to the launcher (run_draining).
  const bool stoppable = !args.empty() && (args[0] == "serve" || args[0] == "batch");
  // mpirun runs in the background process group: it must not read the terminal (neither reads stdin).
  if (stoppable && run) cmd.insert(cmd.begin() + 1, {"--stdin", "none"});
  std::cout << shell_join(cmd) << std::endl;
  if (!run) return 0;
  std::vector<char*> av;
  for (auto& c : cmd) av.push_back(c.data());
  av.push_back(nullptr);
  if (stoppable) return run_draining(av);
  execvp(av[0], av.data());
  GLM5_FAIL("could not execute ", cmd[0], ": ", std::strerror(errno));
}

}  // namespace glm5::launcher
