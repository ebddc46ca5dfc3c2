// Values users type on the command line that carry structure: convert's --quant / --group-size /
// --roles / --scale-dtype (runtime/quant_plan.h) and simulate's --workload and --acceptance
// (launcher/simulate/sim_schedule.h). The input is split at newlines into the values.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "launcher/simulate/sim_schedule.h"
#include "runtime/quant_plan.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  std::vector<std::string> v;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  for (std::string line; v.size() < 6 && std::getline(in, line);) v.push_back(line);
  v.resize(6);
  const int64_t group = v[1].empty() ? 128 : int64_t(uint8_t(v[1][0])) * 16 - 64;
  fuzz::expect_clean("parse_quant_plan", [&] {
    const runtime::QuantPlan plan = runtime::parse_quant_plan(v[0], group, v[2], v[3]);
    runtime::describe(plan);
  });
  fuzz::expect_clean("parse_workload", [&] { launcher::parse_workload(v[4]); });
  const int k = v[5].empty() ? 3 : (uint8_t(v[5][0]) % 12) - 2;
  fuzz::expect_clean("parse_acceptance", [&] { launcher::parse_acceptance(v[5].empty() ? v[5] : v[5].substr(1), k); });
  return 0;
}
