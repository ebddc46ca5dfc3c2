#!/usr/bin/env bash
# The whole GPU check for one short lease of a GPU machine without our packages, as one command:
# unpacks a bundle archive (scripts/gpu-bundle.sh, then `tar -cJf bundle.tar.xz bundle` in its
# folder, carried with the call), runs scripts/gpu-check.sh from it (GPU tests, goldens,
# real-dims, kernel figures), then scripts/gpu-e2e.sh (glm5 batch on a generated GLM-5-shaped
# checkpoint, both attention-kernel settings), each step under its own time limit so that what
# ran comes back. With OUT set, $OUT gets steps.txt, summary.txt, e2e.txt and gpu-check-logs.tgz.
# On a leased machine: `run` with carry build-bundle/bundle.tar.xz, command scripts/gpu-lease.sh,
# timeout_s 590 (the limits below add up to less unless a step hangs).
#
# Usage: scripts/gpu-lease.sh [BUNDLE_ARCHIVE]   (default: build-bundle/bundle.tar.xz)
# Env: TESTS_TIMEOUT (default 240), RUN_TIMEOUT (30: each generate of gpu-check), BENCH_TIMEOUT
#      (120), E2E_TIMEOUT (180: the whole of gpu-e2e), E2E=0 to skip it.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
archive=${1:-$root/build-bundle/bundle.tar.xz}
dir=$(mktemp -d)
tar -xJf "$archive" -C "$dir" || { echo "cannot unpack $archive" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | head -3
export GLM5_BUNDLE=$dir/bundle
TESTS_TIMEOUT=${TESTS_TIMEOUT:-240} RUN_TIMEOUT=${RUN_TIMEOUT:-30} BENCH_TIMEOUT=${BENCH_TIMEOUT:-120} \
  "$root/scripts/gpu-check.sh" "$dir/gc"
rc=$?
if [ "${E2E:-1}" != 0 ]; then
  timeout "${E2E_TIMEOUT:-180}" "$root/scripts/gpu-e2e.sh" "$dir/e2e" 2>&1 | tee "${OUT:-$dir}/e2e.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
