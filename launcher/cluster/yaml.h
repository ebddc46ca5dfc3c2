// yaml-cpp, included with the one warning its headers raise silenced (the launcher's YAML readers:
// cluster configs, hardware files).
#pragma once

// GCC 12 reports false -Wdangling-pointer warnings inside yaml-cpp 0.7's node iterators.
#pragma GCC diagnostic push
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic ignored "-Wdangling-pointer"
#endif
#include <yaml-cpp/yaml.h>
#pragma GCC diagnostic pop
