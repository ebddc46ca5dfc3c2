#!/usr/bin/env bash
# Paged-KV benchmarks on the long-context model of scripts/bench_long_context.sh (GLM-5 attention
# geometry, 2 layers), one process, one thread:
#  1. decode tokens/s after a 1k and a 32k-token prompt (time of max_tokens 257 minus max_tokens 1);
#  2. a job of N requests sharing a P-token prefix (each with its own 16-token suffix, 8 tokens
#     out), with prefix_caching off and on: wall time, prefix hits, identical outputs.
# Usage: scripts/bench_prefix_decode.sh [BUILD_DIR] [MODEL_DIR] [N] [P]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-/tmp/glm5-long}
N=${3:-64}
P=${4:-4096}
[ -f "$MODEL/config.json" ] || scripts/bench_long_context.sh "$BUILD" "$MODEL" 16 > /dev/null
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
run() {  # run NAME CLUSTER_YAML: batch over $D/NAME.jsonl; prints wall seconds
  rm -f "$D/$1.out"
  printf '%b' "$2" > "$D/$1.yaml"
  local t0 t1
  t0=$(date +%s.%N)
  OMP_NUM_THREADS=1 "$BUILD/glm5" batch --model "$MODEL" --input "$D/$1.jsonl" --output "$D/$1.out" \
    --cluster "$D/$1.yaml" --report "$D/$1.report" 2> "$D/$1.log" || { cat "$D/$1.log"; exit 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }'
}
prompt() {  # prompt LEN SEED: comma-separated random ids
  awk -v n="$1" -v s="$2" 'BEGIN { srand(s); for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), int(rand() * 2000) }'
}

echo "### Decode after a long prompt"
echo "| context | prefill + 1 token s | prefill + 257 tokens s | decode tok/s |"
echo "|---|---|---|---|"
for n in ${DECODE_CONTEXTS:-1024 32768}; do
  ids=$(prompt "$n" 7)
  for k in 1 257; do
    echo "{\"custom_id\": \"d\", \"max_tokens\": $k, \"temperature\": 0, \"ignore_eos\": true, \"prompt\": [$ids]}" > "$D/dec$k.jsonl"
  done
  a=$(run dec1 "stages: 1\n")
  b=$(run dec257 "stages: 1\n")
  awk -v n="$n" -v a="$a" -v b="$b" 'BEGIN { printf "| %d | %.2f | %.2f | %.1f |\n", n, a, b, 256 / (b - a) }'
done
[ "${SKIP_PREFIX:-0}" = 1 ] && exit 0

echo
echo "### $N requests sharing a $P-token prefix"
prefix=$(prompt "$P" 11)
for i in $(seq 1 "$N"); do
  echo "{\"custom_id\": \"p$i\", \"max_tokens\": 8, \"temperature\": 0, \"ignore_eos\": true, \"prompt\": [$prefix,$(prompt 16 $((100 + i)))]}"
done > "$D/off.jsonl"
cp "$D/off.jsonl" "$D/on.jsonl"
off=$(run off "stages: 1\nmax_batch: $N\nprefix_caching: false\n")
on=$(run on "stages: 1\nmax_batch: $N\nprefix_caching: true\n")
hits=$(/usr/bin/python3 -c "import json; print(json.load(open('$D/on.report'))['ranks'][0]['prefix_hit_tokens'])")
same=$(/usr/bin/python3 - "$D/off.out" "$D/on.out" <<'PY'
import json, sys
def ids(p):
    return {j["custom_id"]: j["response"]["body"]["choices"][0]["token_ids"] for j in map(json.loads, open(p))}
print("identical" if ids(sys.argv[1]) == ids(sys.argv[2]) else "DIFFERENT")
PY
)
echo "| prefix_caching | wall s | prefix-hit tokens | speed-up | outputs |"
echo "|---|---|---|---|---|"
echo "| false | $off | 0 | 1.00x | |"
awk -v a="$off" -v b="$on" -v h="$hits" -v s="$same" 'BEGIN { printf "| true | %.2f | %d | %.2fx | %s |\n", b, h, a / b, s }'
