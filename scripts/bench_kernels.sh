#!/usr/bin/env bash
# Builds and runs scripts/bench_kernels.cpp (the fast CPU backend's kernels against OpenBLAS
# sgemm and the memory read bandwidth, measured in the same run) and prints a markdown table.
# The kernels are compiled from source with -O3 -march=native -ffp-contract=off, as the CMake build
# does; OpenBLAS is linked when its cblas.h is found (Debian: libopenblas-dev), else the sgemm
# column is empty.
#
#   scripts/bench_kernels.sh [OUT_DIR] [-- bench args: --reps N --quick --only decode|experts|attention|quant|prefill]   (OUT_DIR default: build)
#   env: OMP_NUM_THREADS (default: all cores), CXX (default: g++)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/build
if [[ $# -gt 0 && $1 != -- ]]; then OUT=$1; shift; fi
[[ ${1:-} == -- ]] && shift
mkdir -p "$OUT"
CXX=${CXX:-g++}
BIN=$OUT/bench_kernels

blas=(-DGLM5_NO_BLAS)
for inc in /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas /usr/include; do
  if [[ -f $inc/cblas.h ]] && echo 'int main(){}' | "$CXX" -x c++ - -lopenblas -o /dev/null 2>/dev/null; then
    blas=(-I"$inc" -lopenblas)
    break
  fi
done

"$CXX" -std=gnu++20 -O3 -march=native -ffp-contract=off -fopenmp -I"$ROOT" \
  "$ROOT/scripts/bench_kernels.cpp" "$ROOT"/kernels/cpu/*.cpp "$ROOT/kernels/validate.cpp" "$ROOT/kernels/cuda_stub.cpp" \
  "${blas[@]}" -o "$BIN"
echo "bench_kernels: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores" >&2
OPENBLAS_NUM_THREADS=${OMP_NUM_THREADS:-$(env -u OMP_THREAD_LIMIT nproc)} "$BIN" "$@"
