#!/usr/bin/env bash
# The watchdog: rank 1 of a 2-stage batch job is frozen (SIGSTOP) mid-run. Rank 0, waiting on it,
# must print what it waits for (peer, tag, bytes) and abort the job within watchdog_s + grace,
# with a non-zero exit, instead of hanging. Usage: watchdog.sh GLM5_BINARY SOURCE_DIR MPIEXEC
set -u
BIN=$1 SRC=$2 MPIEXEC=$3
D=$(mktemp -d)
cleanup() { pkill -KILL -f "$D/" 2>/dev/null; rm -rf "$D"; }
trap cleanup EXIT
printf 'stages: 2\nexpert_parallel: 1\nmicro_batches: 2\nwatchdog_s: 3\n' > "$D/cluster.yaml"
for i in $(seq 1 3000); do
  echo "{\"custom_id\": \"w$i\", \"prompt\": [1, 2, $((i % 50 + 3))], \"max_tokens\": 64, \"ignore_eos\": true}"
done > "$D/in.jsonl"
"$MPIEXEC" --allow-run-as-root --oversubscribe --mca btl self,vader,tcp -x OMP_NUM_THREADS=1 -np 2 \
  "$BIN" batch --model "$SRC/tests/data/tiny-a" --input "$D/in.jsonl" --output "$D/out.jsonl" \
  --cluster "$D/cluster.yaml" > "$D/log" 2>&1 &
JOB=$!
rank1=""
for _ in $(seq 1 200); do  # the rank-1 process, by its environment
  for p in $(pgrep -f "$D/in.jsonl"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1'; then rank1=$p; fi
  done
  [ -n "$rank1" ] && [ -s "$D/out.jsonl" ] && break
  sleep 0.1
done
[ -n "$rank1" ] || { echo "FAIL: rank 1 not found"; cat "$D/log"; exit 1; }
kill -STOP "$rank1"
start=$(date +%s)
while kill -0 "$JOB" 2>/dev/null; do
  if [ $(( $(date +%s) - start )) -gt 60 ]; then echo "FAIL: the job still runs 60 s after rank 1 froze"; cat "$D/log"; exit 1; fi
  sleep 0.2
done
wait "$JOB"; rc=$?
took=$(( $(date +%s) - start ))
cat "$D/log" | tr '\r' '\n' | grep -v '^\[glm5\] [0-9]* requests done' | tail -n 5
[ "$rc" -ne 0 ] || { echo "FAIL: exit code 0"; exit 1; }
grep -q "watchdog: rank 0 has waited [0-9]* s with no progress for recv from rank 1, tag 13" "$D/log" ||
  { echo "FAIL: no watchdog report naming the wait"; exit 1; }
grep -q "watchdog: rank 0 aborts the job" "$D/log" || { echo "FAIL: no abort line"; exit 1; }
echo "PASS: the job ended (exit $rc) ${took} s after rank 1 froze"
