// How `glm5 serve` and `glm5 batch` hear that they should stop (RELIABILITY.md, Signals). World rank
// 0 decides for the whole job and ends it through the engine's own stop (serve: the drain; batch:
// the next record boundary); the other ranks ignore these signals, so a signal to every rank at
// once (Slurm's scancel) is the same as one to rank 0.
//
// Stop requests: SIGTERM, SIGINT and SIGUSR1 from anyone (SIGUSR1 is what mpirun forwards: `glm5
// launch --run` turns its own SIGTERM / SIGINT / SIGHUP into it), and Open MPI's kill sequence.
// Open MPI 4.1's mpirun never forwards SIGTERM / SIGINT: it answers them (and a failed rank) by
// sending every rank's process group SIGCONT at once, SIGTERM `odls_base_sigkill_timeout` seconds
// later (T, default 1) and SIGKILL T seconds after that, then exits 1 whatever the ranks did. A
// rank started by Open MPI (ORTE's variables in its environment) therefore reads a SIGCONT from
// the Open MPI daemon that started it (mpirun or an orted: its parent, or the pid in
// PMIX_SERVER_TMPDIR's pid.<N> under a wrapper script) that does not end a stop as "mpirun is
// ending the job, SIGKILL in 2T", and a SIGTERM from that daemon as "SIGKILL in T". Job control
// (Ctrl-Z / fg of mpirun: SIGSTOP, then SIGCONT from mpirun) is told apart by the stop itself: a
// watcher thread sees its own clock jump by kStoppedGap or more. A stop shorter than that, or a
// bare SIGCONT sent to a running mpirun, is read as the kill sequence (the job drains / stops).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>

namespace glm5::launcher {

using StopClock = std::chrono::steady_clock;

struct StopEvent {
  int sig = 0;
  int sender = 0;              // the sending pid, when the kernel says (0 otherwise)
  bool from_launcher = false;  // a step of mpirun's (orted's) kill sequence
  bool repeat = false;         // an earlier event came before this one
  // When the launcher's SIGKILL is due (its kill sequence), if this event says.
  std::optional<StopClock::time_point> kill_at;
  // "SIGTERM", "SIGTERM from mpirun", "mpirun's kill sequence (SIGCONT: mpirun got SIGTERM or SIGINT)".
  std::string what() const;
};

// Installs handlers for SIGTERM, SIGINT, SIGUSR1 and SIGCONT in this process and calls on_stop on a
// thread of its own for each stop request, in order; restores the previous handlers when destroyed.
// One instance at a time.
class StopSignals {
 public:
  explicit StopSignals(std::function<void(const StopEvent&)> on_stop);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The ranks other than 0: SIGTERM, SIGINT and SIGUSR1 ignored (rank 0 ends the job).
  static void ignore();
  // Seconds between the steps of Open MPI's kill sequence (its odls_base_sigkill_timeout, as
  // mpirun passes it to the ranks' environment; 1 when unset); < 0 when not started by Open MPI.
  static double launcher_kill_step_s();
  // Time to keep before a known SIGKILL for the last answers, the output and the report.
  static StopClock::duration kill_margin(double step_s);
  static const char* name(int sig);

  static constexpr std::chrono::milliseconds kStoppedGap{250};

 private:
  void watch();
  std::function<void(const StopEvent&)> on_stop_;
  int pipe_[2] = {-1, -1};
  std::thread thread_;
};

}  // namespace glm5::launcher
