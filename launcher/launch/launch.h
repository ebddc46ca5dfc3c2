// `glm5 launch`: the mpirun command line (or a Slurm script) that runs a glm5 command on a cluster
// config, and with --run the job itself, supervised: signals become a clean stop, and a job that a
// rank's watchdog aborted ends even when mpirun cannot reach a host (RELIABILITY.md).
#pragma once

#include <string>
#include <vector>

namespace glm5::launcher {

// Prints the command (or writes the Slurm script `slurm`); with run, runs it and returns its exit
// status. serve and batch run supervised (launch.cpp); other commands replace this process.
int run_launch(const std::string& cluster, const std::vector<std::string>& args, bool run, const std::string& argv0,
               const std::string& slurm = "", bool srun = false);

// Seconds mpirun gets to exit after a rank's watchdog aborted the job, before the launcher ends it.
constexpr int kAbortGraceS = 20;

// Whether a line of the job's stderr is a rank's watchdog aborting the job (parallel/mpi_comm.cpp).
bool is_watchdog_abort(const std::string& line);

}  // namespace glm5::launcher
