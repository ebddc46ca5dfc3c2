#!/usr/bin/env bash
# Prefill cost against prompt length on a model with GLM-5's attention geometry (kv_lora 512,
# nope/rope/v 192/64/256, 16 heads, indexer 8 x 128, top-256), 2 layers, one thread, chunk 256:
# one `glm5 batch` request with max_tokens 1 per length (random token ids). Prints wall time, tokens/s,
# per-token cost relative to the shortest prompt, and peak RSS; then the marginal cost per token
# between consecutive lengths ((wall b - wall a) / (b - a): start-up cancels out) and the last
# marginal cost over the first (with lengths 1024 2048 4096 8192: the cost per token at 4-8k over 1-2k).
# Usage: scripts/bench_long_context.sh [BUILD_DIR] [MODEL_DIR] [LENGTHS...]
# env: PYTHON (a python3 with numpy, for the generator), PRECISION (exact | fast, default exact), THREADS (default 1), ROUNDS (default 1: each length
# once; more: the lengths interleaved, medians)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-/tmp/glm5-long}
shift 2 || true
LENS=("$@")
[ ${#LENS[@]} -gt 0 ] || LENS=(1024 4096 8192)
if [ ! -f "$MODEL/config.json" ]; then
  "${PYTHON:-python3}" scripts/gen_tiny_model.py --out "$MODEL" --seed 3 --hidden-size 1024 --num-hidden-layers 2 \
    --first-k-dense-replace 1 --num-attention-heads 16 --q-lora-rank 384 --kv-lora-rank 512 \
    --qk-nope-head-dim 192 --qk-rope-head-dim 64 --v-head-dim 256 --index-n-heads 8 --index-head-dim 128 \
    --index-topk 256 --intermediate-size 2048 --moe-intermediate-size 256 --n-routed-experts 16 \
    --num-experts-per-tok 4 --n-group 1 --topk-group 1 --n-shared-experts 1 --vocab-size 2048 \
    --max-position-embeddings 65536 --num-nextn-predict-layers 0 > /dev/null
fi
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
echo "| prompt tokens | wall s | prefill tok/s | per-token cost vs first | peak RSS |"
echo "|---|---|---|---|---|"
PRECISION=${PRECISION:-exact}
THREADS=${THREADS:-1}
ROUNDS=${ROUNDS:-1}
echo "precision $PRECISION, $THREADS thread(s), $ROUNDS round(s)"
first=""
declare -A WALLS
for round in $(seq 1 "$ROUNDS"); do
for n in "${LENS[@]}"; do
  awk -v n="$n" 'BEGIN { srand(7); printf "{\"custom_id\": \"p\", \"max_tokens\": 1, \"temperature\": 0, \"prompt\": [";
    for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), int(rand() * 2000); print "]}" }' > "$D/in.jsonl"
  rm -f "$D/out.jsonl"
  /usr/bin/time -f "%e %M" -o "$D/time.txt" env OMP_NUM_THREADS="$THREADS" "$BUILD/glm5" batch --model "$MODEL" \
    --input "$D/in.jsonl" --output "$D/out.jsonl" --precision "$PRECISION" 2> "$D/log"
  grep -q '"error":null' "$D/out.jsonl" || { cat "$D/out.jsonl" "$D/log"; exit 1; }
  read -r wall rss < "$D/time.txt"
  WALLS[$n]="${WALLS[$n]:-} $wall"
  per=$(awk -v w="$wall" -v n="$n" 'BEGIN { print w / n }')
  [ -n "$first" ] || first=$per
  awk -v n="$n" -v w="$wall" -v p="$per" -v f="$first" -v r="$rss" \
    'BEGIN { printf "| %d | %.2f | %.0f | %.2fx | %.0f MiB |\n", n, w, n / w, p / f, r / 1024 }'
done
done
# Medians over the rounds, then the marginal cost per token between consecutive lengths.
args=()
for n in "${LENS[@]}"; do args+=("$n:${WALLS[$n]}"); done
python3 - "${args[@]}" <<'PY'
import statistics, sys
pts = [(int(a.split(":")[0]), statistics.median(float(x) for x in a.split(":")[1].split())) for a in sys.argv[1:]]
marg = []
for (a, wa), (b, wb) in zip(pts, pts[1:]):
    m = (wb - wa) / (b - a)
    marg.append(m)
    print(f"marginal {a}-{b}: {1e3 * m:.3f} ms per token (median walls {wa:.2f} / {wb:.2f} s)")
if len(marg) > 1:
    print(f"marginal cost per token, {pts[-2][0]}-{pts[-1][0]} over {pts[0][0]}-{pts[1][0]}: {marg[-1] / marg[0]:.2f}x")
PY
