// `glm5 serve`: the OpenAI-compatible HTTP server over the distributed engine. World rank 0 serves
// HTTP on its own threads (launcher/serve/http_server.h, serve_api.h) and runs the engine on its main
// thread, the only one that calls MPI; every other rank runs the engine alone. SIGTERM / SIGINT /
// SIGUSR1 (the one mpirun forwards) to rank 0, or Open MPI's kill sequence after a SIGTERM / SIGINT
// to mpirun (launcher/serve/serve_signals.h): new requests get 503, finish what was accepted (at most the
// drain timeout, and cancelled in time before a SIGKILL mpirun announced), exit 0.
#pragma once

#include <memory>
#include <string>

#include "launcher/cluster/cluster_config.h"
#include "launcher/serve/http_server.h"
#include "parallel/comm.h"

namespace glm5::launcher {

struct ServeArgs {
  std::string model, cluster;
  std::string host = "127.0.0.1";
  int port = 8000;              // 0: a free port (printed)
  std::string api_key;          // empty: no auth
  std::string model_name;       // the id clients name; default: the model directory's name
  int max_queue = 256;          // requests waiting for the engine beyond which new ones get 429
  double drain_timeout_s = 25;  // under Slurm's default KillWait (30 s) between SIGTERM and SIGKILL
  int http_threads = 2;
  ClusterOverrides overrides;  // --speculative-tokens, --precision
  HttpLimits limits;
};

int run_serve(const ServeArgs& a, std::unique_ptr<parallel::Comm> world);

}  // namespace glm5::launcher
