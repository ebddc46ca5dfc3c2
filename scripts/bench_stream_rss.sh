#!/usr/bin/env bash
# Rank-0 memory of a batch job against its input size: the input is read lazily (a bounded window
# of requests in flight), so a 1,000,000-line job should need about what a 1,000-line one does.
# Usage: scripts/bench_stream_rss.sh [BUILD_DIR] [LINES...]   (default: build, 1000 1000000)
# Each line: 3-token id prompt, max_tokens 1, greedy, a custom_id. Prints lines, wall time and
# rank 0's peak RSS (from --report) per run.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
shift || true
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(1000 1000000)
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
printf 'stages: 2\nexpert_parallel: 1\nmicro_batches: 2\nmax_batch: 256\n' > "$D/cluster.yaml"
echo "| lines | wall s | requests/s | rank-0 peak RSS | rank-1 peak RSS |"
echo "|---|---|---|---|---|"
for n in "${SIZES[@]}"; do
  awk -v n="$n" 'BEGIN { for (i = 0; i < n; i++)
    printf "{\"custom_id\": \"req-%d\", \"prompt\": [%d, 2, 3], \"max_tokens\": 1, \"temperature\": 0}\n", i, i % 500 + 1 }' \
    > "$D/in.jsonl"
  rm -f "$D/out.jsonl"
  start=$(date +%s.%N)
  mpirun --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -np 2 "$BUILD/glm5" batch \
    --model tests/data/tiny-a --cluster "$D/cluster.yaml" --input "$D/in.jsonl" --output "$D/out.jsonl" \
    --report "$D/report.json" 2> "$D/log"
  end=$(date +%s.%N)
  got=$(wc -l < "$D/out.jsonl")
  [ "$got" -eq "$n" ] || { echo "expected $n records, got $got"; tail "$D/log"; exit 1; }
  /usr/bin/python3 - "$D/report.json" "$n" "$start" "$end" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["ranks"]
n, t = int(sys.argv[2]), float(sys.argv[4]) - float(sys.argv[3])
rss = {x["rank"]: x["peak_rss_kb"] / 1024 for x in r}
print(f"| {n} | {t:.1f} | {n / t:.0f} | {rss[0]:.1f} MiB | {rss[1]:.1f} MiB |")
PY
done
