#!/usr/bin/env bash
# glm5 serve under load: C concurrent OpenAI clients (scripts/serve_load.py, half of them streaming)
# send N greedy completion requests of T tokens each (ignore_eos) on 127.0.0.1; prints the load
# generator's throughput and latency percentiles (TTFT of the streamed requests, end to end of all),
# and as the reference measured in the same run, `glm5 batch` over the same requests offline.
#   scripts/bench_serve.sh [--model DIR] [--cluster FILE --np N] [--clients 64] [--requests 4000] [--max-tokens 32]
# Run it alone on the machine (e.g. under the CPU lock the project's scripts share).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench_load.sh
BUILD=${BUILD:-build}
MODEL=tests/data/tiny-a CLUSTER="" NP=1 CLIENTS=64 REQUESTS=4000 TOKENS=32
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --cluster) CLUSTER=$2; shift 2 ;;
    --np) NP=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --max-tokens) TOKENS=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
scripts/serve_venv.sh "$BUILD/serve-venv" > /dev/null
PY=$BUILD/serve-venv/bin/python
tmp=$(mktemp -d)
trap 'kill "$SERVER" 2> /dev/null || true; rm -rf "$tmp"' EXIT
name=$(basename "$MODEL")
run=("$BUILD/glm5")
cl=()
if [ -n "$CLUSTER" ]; then
  cl=(--cluster "$CLUSTER")
  [ "$NP" -gt 1 ] && run=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader,tcp -np "$NP" "$BUILD/glm5")
fi
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; model $MODEL, ranks $NP ${CLUSTER:+($CLUSTER)}"
echo "load: $CLIENTS clients, $REQUESTS requests x $TOKENS tokens (greedy, ignore_eos), half streamed"

# The reference: the same requests as one offline batch job.
"$PY" - "$REQUESTS" "$TOKENS" "$name" > "$tmp/in.jsonl" <<'PYEOF'
import json, sys
n, t, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for i in range(n):
    body = {"model": name, "prompt": "Request %d: the quick brown fox" % i, "max_tokens": t, "temperature": 0,
            "ignore_eos": True}
    print(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body}))
PYEOF
load_start
t0=$(date +%s.%N)
"${run[@]}" batch --model "$MODEL" "${cl[@]}" --input "$tmp/in.jsonl" --output "$tmp/out.jsonl" 2> /dev/null
t1=$(date +%s.%N)
batch_s=$(echo "$t1 - $t0" | bc -l)
printf "batch (reference): %.2f s, %.1f requests/s, %.0f tokens/s\n" "$batch_s" \
  "$(echo "$REQUESTS / $batch_s" | bc -l)" "$(echo "$REQUESTS * $TOKENS / $batch_s" | bc -l)"

"${run[@]}" serve --model "$MODEL" "${cl[@]}" --port 0 --max-queue 100000 2> "$tmp/serve.err" &
SERVER=$!
for _ in $(seq 600); do grep -q "listening on" "$tmp/serve.err" && break; sleep 0.1; done
port=$(sed -n 's/.*listening on http:\/\/[0-9.]*:\([0-9]*\) .*/\1/p' "$tmp/serve.err")
pid=$(sed -n 's/.*pid \([0-9]*\)).*/\1/p' "$tmp/serve.err")
"$PY" scripts/serve_load.py --base-url "http://127.0.0.1:$port/v1" --model "$name" --clients "$CLIENTS" \
  --requests "$REQUESTS" --max-tokens "$TOKENS" | tee "$tmp/load.json"
kill -TERM "$pid"
wait "$SERVER"
load_report
"$PY" - "$tmp/load.json" "$batch_s" "$REQUESTS" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
batch_rps = float(sys.argv[3]) / float(sys.argv[2])
print("serve: %d ok, %d errors; %.1f requests/s = %.2fx batch; TTFT p50/p90/p99 %s/%s/%s ms; "
      "end to end p50/p90/p99 %s/%s/%s ms" % (r["ok"], r["errors"], r["requests_per_s"], r["requests_per_s"] / batch_rps,
                                              r["ttft_ms"]["50"], r["ttft_ms"]["90"], r["ttft_ms"]["99"],
                                              r["e2e_ms"]["50"], r["e2e_ms"]["90"], r["e2e_ms"]["99"]))
PYEOF
