// A cluster YAML (launcher/cluster/cluster_config.h): parsed, then planned against the tiny model
// and turned into the mpirun command line and Slurm script, as `glm5 launch` does.
#include <cstdint>
#include <string>

#include "launcher/cluster/cluster_config.h"
#include "runtime/config.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  static const runtime::ModelConfig mc = runtime::load_config(fuzz::kData + "/tiny-a");
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean("parse_cluster_config", [&] {
    const launcher::ClusterConfig cc = launcher::parse_cluster_config(text, "cluster.yaml");
    fuzz::require(cc.stages >= 1 && cc.expert_parallel >= 1, "a parsed layout has at least one rank");
    launcher::launch_command(cc, "glm5", {"batch"}, true);
    launcher::slurm_script(cc, "glm5", {"batch"}, false);
    const auto stages = launcher::plan_stages(cc, mc, cc.world_size());
    for (int r = 0; r < cc.world_size(); ++r) launcher::rank_shard(cc, stages, r);
  });
  return 0;
}
