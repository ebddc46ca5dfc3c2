#!/usr/bin/env bash
# Sets up the machine, builds glm5, and runs a batch job on the embedded tiny GLM-5 model with
# 4 MPI ranks (2 pipeline stages x 2 expert-parallel ranks), printing the completions.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
out=$(mktemp -d)/out.jsonl
ROOT_FLAGS=()
if [ "$(id -u)" = 0 ]; then ROOT_FLAGS=(--allow-run-as-root); fi
mpirun "${ROOT_FLAGS[@]}" --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \
  build/glm5 batch --model tests/data/tiny-a --cluster cluster-configs/cpu-pp2-ep2.yaml \
  --input tests/data/example-batch.jsonl --output "$out"
echo "== $out"
cat "$out"
