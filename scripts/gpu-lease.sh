#!/usr/bin/env bash
# The whole GPU check for a GPU machine without our packages, as one command: unpacks a bundle
# archive (scripts/gpu-bundle.sh, then `tar -cJf bundle.tar.xz bundle` in its folder), runs
# scripts/gpu-check.sh from it (GPU tests, goldens, real-dims, kernel figures), then
# scripts/gpu-e2e.sh (glm5 batch on a generated GLM-5-shaped checkpoint, both attention-kernel
# settings). Every step has its own time limit, so that what ran is reported even when a step
# hangs; the limits add up to about 590 s (tests 180, five generate runs of 30, kernel figures 100,
# four batch runs of 35, plus the checkpoint generation). With OUT set, $OUT gets steps.txt,
# summary.txt, e2e.txt and gpu-check-logs.tgz.
#
# Usage: scripts/gpu-lease.sh [BUNDLE_ARCHIVE]   (default: build-bundle/bundle.tar.xz)
# Env: TESTS_TIMEOUT, RUN_TIMEOUT, BENCH_TIMEOUT (gpu-check's), E2E_RUN_TIMEOUT (gpu-e2e's), E2E=0
#      to skip the end-to-end runs.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
archive=${1:-$root/build-bundle/bundle.tar.xz}
dir=$(mktemp -d)
tar -xJf "$archive" -C "$dir" || { echo "cannot unpack $archive" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | head -3
export GLM5_BUNDLE=$dir/bundle
TESTS_TIMEOUT=${TESTS_TIMEOUT:-180} RUN_TIMEOUT=${RUN_TIMEOUT:-30} BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} \
  "$root/scripts/gpu-check.sh" "$dir/gc"
rc=$?
if [ "${E2E:-1}" != 0 ]; then
  E2E_RUN_TIMEOUT=${E2E_RUN_TIMEOUT:-35} "$root/scripts/gpu-e2e.sh" "$dir/e2e" 2>&1 | tee "${OUT:-$dir}/e2e.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
