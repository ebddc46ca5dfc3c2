// config.json (runtime/config.h): every field the math reads is range-checked when parsed, so a
// config that parses can be planned from (the schema, stage balancing, the activation estimate)
// without overflow, a crash or a huge allocation.
#include <cstdint>
#include <string>

#include "launcher/cluster/cluster_config.h"
#include "runtime/config.h"
#include "runtime/memory_plan.h"
#include "runtime/name_table.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean("parse_config", [&] {
    const runtime::ModelConfig mc = runtime::parse_config(text, "config.json");
    // The planning a command does before it touches a weight.
    const auto tensors = runtime::tensor_table(mc);
    fuzz::require(!tensors.empty(), "a parsed config has tensors");
    for (int l = 0; l < mc.num_hidden_layers && l < 4; ++l) launcher::layer_parameters(mc, l);
    runtime::StepShape shape;
    runtime::estimate_activations(mc, shape);
    const launcher::ClusterConfig cc = launcher::default_cluster_config();
    if (mc.num_hidden_layers <= 512) launcher::plan_stages(cc, mc, cc.world_size());
  });
  return 0;
}
