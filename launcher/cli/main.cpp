// The glm5 executable: generate, batch, serve, report, simulate, inspect, convert, tokenize and launch (see README.md).
// Without --cluster a command runs in this one process on the CPU backend; with --cluster it is
// one rank of an mpirun job laid out by the cluster config. Errors are printed once, naming the
// rank when distributed, and end the whole job with a non-zero exit code.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <memory>

#include "kernels/core/check.h"
#include "launcher/cli/commands.h"

int main(int argc, char** argv) { return glm5::launcher::main_entry(argc, argv); }
