#!/usr/bin/env bash
# Configures, builds and runs the whole test suite (unit, golden, MPI layouts, multi-host netns).
# CUDA code is compiled when nvcc is present; GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
generator=()
if [ ! -f "$BUILD/CMakeCache.txt" ] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # (nproc alone counts those two)
cmake --build "$BUILD" -j"$jobs"
cd "$BUILD"
ctest --output-on-failure -j"$jobs" "$@"
