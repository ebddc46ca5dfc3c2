#!/usr/bin/env bash
# Soak test: `glm5 serve` on tiny-a under mpirun (2 stages x 2 expert ranks, with an API key) gets
# M minutes of mixed load from scripts/serve_soak.py (streams, some dropped mid-stream, whole
# answers, chat, tokenizer and health endpoints, bad requests), while every rank's RSS and open
# file descriptors are sampled; then SIGTERM to rank 0 must drain and end the job with status 0.
# Prints the soak's JSON report; exits non-zero when a check failed.
#   scripts/serve_soak.sh [--minutes 30] [--clients 16] [--model DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MINUTES=30 CLIENTS=16 MODEL=tests/data/tiny-a
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    *) echo "serve_soak.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
scripts/serve_venv.sh "$BUILD/serve-venv" >/dev/null
PY=$BUILD/serve-venv/bin/python
tmp=$(mktemp -d)
JOB=""
trap '[ -z "$JOB" ] || kill "$JOB" 2>/dev/null || true; rm -rf "$tmp"' EXIT
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; model $MODEL; $CLIENTS clients, $MINUTES min" >&2
OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe --mca btl self,vader,tcp -np 4 "$BUILD/glm5" serve \
  --model "$MODEL" --cluster cluster-configs/cpu-pp2-ep2.yaml --port 0 --api-key soak-key 2>"$tmp/serve.err" &
JOB=$!
for _ in $(seq 600); do grep -q "listening on" "$tmp/serve.err" && break; sleep 0.1; done
port=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\) .*/\1/p' "$tmp/serve.err")
[ -n "$port" ] || { echo "serve_soak.sh: the server did not start" >&2; cat "$tmp/serve.err" >&2; exit 1; }
rank0=$(sed -n 's/.*pid \([0-9]*\)).*/\1/p' "$tmp/serve.err")
pids=$(pgrep -d, -f "^$BUILD/glm5 serve --model $MODEL")  # the ranks, not mpirun
rc=0
"$PY" scripts/serve_soak.py --base-url "http://127.0.0.1:$port" --model "$(basename "$MODEL")" --pids "$pids" \
  --minutes "$MINUTES" --clients "$CLIENTS" --api-key soak-key ${WARMUP_S:+--warmup-s "$WARMUP_S"} || rc=$?
kill -TERM "$rank0"
for _ in $(seq 600); do kill -0 "$JOB" 2>/dev/null || break; sleep 0.1; done
kill -0 "$JOB" 2>/dev/null && { echo "serve_soak.sh: the job still runs 60 s after SIGTERM" >&2; exit 1; }
status=0
wait "$JOB" || status=$?
echo "serve_soak.sh: SIGTERM to rank 0: mpirun's status $status" >&2
if [ "$status" != 0 ]; then tail -n 20 "$tmp/serve.err" >&2; rc=1; fi
exit $rc
