#include "launcher/simulate.h"

#include <stdexcept>

namespace glm5::launcher {

int run_simulate(const SimulateArgs&) { throw std::runtime_error("simulate: not implemented yet"); }

}  // namespace glm5::launcher
