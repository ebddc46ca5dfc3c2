#!/usr/bin/env bash
# Configures, builds and runs the whole test suite (unit, golden, MPI layouts, multi-host netns).
# CUDA code is compiled when nvcc is present; GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$(nproc)"
cd "$BUILD"
ctest --output-on-failure -j"$(nproc)" "$@"
