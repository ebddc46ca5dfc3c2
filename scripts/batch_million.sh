#!/usr/bin/env bash
# A million-line batch with a stop and a resume: N plain lines (prompt ids, 2 sampled tokens each)
# through `glm5 batch` on tiny-a; SIGTERM to the job once a third of the records are out (it must
# stop at a record boundary, exit 75), then the same command again (it must finish, exit 0). The
# output must hold every custom_id exactly once, each record whole. Prints the counts, both runs'
# times and the job's peak RSS.
#   scripts/batch_million.sh [--lines 1000000] [--np 1|4]   (4: 2 stages x 2 expert ranks)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
N=1000000 NP=1
while [ $# -gt 0 ]; do
  case "$1" in
    --lines) N=$2; shift 2 ;;
    --np) NP=$2; shift 2 ;;
    *) echo "batch_million.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
tmp=$(mktemp -d)
JOB=""
trap '[ -z "$JOB" ] || kill "$JOB" 2>/dev/null || true; rm -rf "$tmp"' EXIT
awk -v n="$N" 'BEGIN { for (i = 1; i <= n; i++)
  printf "{\"custom_id\": \"m%d\", \"prompt_ids\": [%d, %d, 7], \"max_tokens\": 2, \"temperature\": 0.9, \"seed\": %d, \"ignore_eos\": true}\n",
         i, i % 97 + 1, i % 89 + 1, i }' >"$tmp/in.jsonl"
run=("$BUILD/glm5")
cl=()
if [ "$NP" -gt 1 ]; then
  run=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader,tcp -x OMP_NUM_THREADS=1 -np "$NP" "$BUILD/glm5")
  cl=(--cluster cluster-configs/cpu-pp2-ep2.yaml)
fi
job=("${run[@]}" batch --model tests/data/tiny-a "${cl[@]}" --input "$tmp/in.jsonl" --output "$tmp/out.jsonl")
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $N lines, $NP rank(s)" >&2

t0=$(date +%s.%N)
"${job[@]}" --report "$tmp/report-1.json" 2>"$tmp/run1.log" &  # not in a function: $! must be the job itself
JOB=$!
until [ "$(wc -l 2>/dev/null <"$tmp/out.jsonl" || echo 0)" -ge $((N / 3)) ]; do
  kill -0 "$JOB" 2>/dev/null || { echo "FAIL: the job ended before a third of the records" >&2; exit 1; }
  sleep 0.5
done
kill -TERM "$JOB" || true  # it may have ended just now: its status says how
rc=0
wait "$JOB" || rc=$?
JOB=""
t1=$(date +%s.%N)
first=$(wc -l <"$tmp/out.jsonl")
grep -o 'stopped by SIGTERM.*' "$tmp/run1.log" >&2 || true
# 75: glm5's clean stop; under mpirun, Open MPI's own 1 after it forwarded the signal.
[ "$rc" = 75 ] || { [ "$NP" -gt 1 ] && [ "$rc" = 1 ]; } ||
  { echo "FAIL: the stopped run exited $rc, expected 75" >&2; tail "$tmp/run1.log" >&2; exit 1; }
rc=0
"${job[@]}" --report "$tmp/report-2.json" 2>"$tmp/run2.log" || rc=$?
t2=$(date +%s.%N)
[ "$rc" = 0 ] || { echo "FAIL: the resumed run exited $rc" >&2; tail "$tmp/run2.log" >&2; exit 1; }
python3 - "$tmp/out.jsonl" "$N" <<'PY'
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
seen = set()
with open(path) as f:
    for k, line in enumerate(f, 1):
        r = json.loads(line)  # a cut record fails here
        key = r["custom_id"]
        if key in seen: sys.exit(f"FAIL: {key} answered twice (line {k})")
        if r.get("error") is not None or r["response"]["status_code"] != 200: sys.exit(f"FAIL: {key}: {r}")
        seen.add(key)
missing = n - len(seen)
if missing or any(f"m{i}" not in seen for i in range(1, n + 1)): sys.exit(f"FAIL: {missing} ids missing")
print(f"records: {len(seen)}, each id once, none cut")
PY
rss=$(python3 -c 'import json,sys; print(round(max(r.get("peak_rss_kb", 0) for f in sys.argv[1:] for r in json.load(open(f))["ranks"]) / 1024, 1))' \
  "$tmp"/report-*.json 2>/dev/null || echo "?")
printf 'first run: %d records in %.0f s (stopped by SIGTERM); resumed run: %d more in %.0f s; peak RSS %s MiB\n' \
  "$first" "$(echo "$t1 - $t0" | bc -l)" $((N - first)) "$(echo "$t2 - $t1" | bc -l)" "$rss"
