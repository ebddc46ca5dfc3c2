// `glm5 report FILE`: a batch --report file as tables.
#pragma once

#include <string>

namespace glm5::launcher {

// Per-rank time, profile phases and MoE health (report.cpp); returns 0. A file that cannot be read
// or is not a report fails with a message naming it.
int run_report(const std::string& path);

}  // namespace glm5::launcher
