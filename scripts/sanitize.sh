#!/usr/bin/env bash
# Builds glm5 and its tests with AddressSanitizer + UndefinedBehaviorSanitizer (CPU only) and runs
# ctest with both set to stop at the first report, so any report fails the test that caused it.
# Takes about 12 minutes on 2 cores (the build dominates).
#   scripts/sanitize.sh [BUILD_DIR]        (default: build-asan in the repository)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build-asan}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGLM5_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer"
cmake --build "$build" -j"$(nproc)"
# Leak checking is off: MPI and OpenMP runtimes keep allocations until exit by design.
export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
cd "$build" && ctest -j"$(nproc)" --timeout 600 --output-on-failure
