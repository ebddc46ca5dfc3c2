// A hardware YAML for `glm5 simulate` (launcher/simulate/hardware.h). What parses must write back
// as YAML that parses to the same text again.
#include <cstdint>
#include <string>

#include "launcher/simulate/hardware.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace glm5;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean("parse_hardware", [&] {
    const launcher::Hardware hw = launcher::parse_hardware(text, "hw.yaml");
    const std::string once = launcher::hardware_yaml(hw, "");
    std::string twice, name;
    fuzz::expect_clean("parse_hardware (written back)", [&] {
      const launcher::Hardware again = launcher::parse_hardware(once, "written.yaml");
      twice = launcher::hardware_yaml(again, "");
      name = again.name;
    });
    fuzz::require(name == hw.name, "the name written reads back as itself");
    fuzz::require(once == twice, "parse_hardware(hardware_yaml(hw)) is hw");
  });
  return 0;
}
