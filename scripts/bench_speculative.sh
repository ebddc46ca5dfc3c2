#!/usr/bin/env bash
# MTP speculative decoding on the trained model: `glm5 batch` over prompts from held-out text (the
# first words of a verse, 128 greedy tokens each, EOS ignored) at batch 1, 8 and 64 (max_batch), with
# k = 0 (plain) .. 4 draft tokens, speculation allowed at every batch size (speculative_max_batch
# 64); then batch 64 with the default policy. Prints tokens/s (the engine's wall, from --report),
# the ratio to plain decoding at the same batch, mean acceptance length and acceptance per draft
# position, and checks that every run's records are plain decoding's. Each figure is the best of REPS
# runs (the machine's noise between runs is +-20 %), plain and speculative runs interleaved.
# Usage: scripts/bench_speculative.sh [BUILD] [MODEL] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-tests/data/glm5-kjv}
THREADS=${3:-2}
REPS=${REPS:-3}
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
export OMP_NUM_THREADS=$THREADS
# requests N: prompts of 10 words from held-out verses
make_requests() {
  awk -v n="$1" 'NF > 12 && c < n { s = $1; for (i = 2; i <= 10; i++) s = s " " $i;
    gsub(/"/, "", s); printf "{\"custom_id\":\"r%d\",\"prompt\":\"%s\",\"max_tokens\":128,\"temperature\":0,\"ignore_eos\":true}\n", c++, s }' \
    "$MODEL/heldout.txt" > "$D/req$1.jsonl"
}
# run B N K [extra yaml]: tokens/s, mean acceptance length, per-position acceptance
run() {
  rm -f "$D/out.jsonl"  # (an existing output would be resumed)
  printf 'max_batch: %s\n%s\n' "$1" "${4:-speculative_max_batch: 64}" > "$D/c.yaml"
  "$BUILD/glm5" batch --model "$MODEL" --cluster "$D/c.yaml" --input "$D/req$2.jsonl" --output "$D/out.jsonl" \
    --report "$D/rep.json" --speculative-tokens "$3" > /dev/null 2>&1
  jq -c 'del(.id, .response.request_id, .response.body.id, .response.body.created)' "$D/out.jsonl" | sort > "$D/norm.jsonl"
  if [ "$3" = 0 ]; then cp "$D/norm.jsonl" "$D/plain$1.jsonl"
  elif ! cmp -s "$D/norm.jsonl" "$D/plain$1.jsonl"; then echo "FAIL: batch $1 k $3: records differ from plain decoding" >&2; exit 1; fi
  jq -r '.ranks[0] | "\(.tokens_per_s) \(.spec_mean_acceptance_length) \(.spec_verify_steps) \(.spec_accepted_at | map(tostring) | join(","))"' "$D/rep.json"
}
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $THREADS threads; model $MODEL"
echo
echo "| batch | k | tokens/s | vs plain | mean acceptance length | verify steps | accepted at position 1..k |"
echo "|---|---|---|---|---|---|---|"
for spec in "1 8" "8 64" "64 256"; do
  set -- $spec
  make_requests "$2"
  plain=""
  declare -A best=()
  for rep in $(seq "$REPS"); do
    for k in 0 1 2 3 4; do
      read -r tps mal steps at < <(run "$1" "$2" "$k")
      best[$k]=$(awk -v a="${best[$k]:-0 0 0 -}" -v t="$tps" -v m="$mal" -v s="$steps" -v x="$at" \
        'BEGIN { split(a, f, " "); if (t > f[1]) print t, m, s, x; else print a }')
    done
  done
  for k in 0 1 2 3 4; do
    read -r tps mal steps at <<< "${best[$k]}"
    [ -z "$plain" ] && plain=$tps
    awk -v b="$1" -v k="$k" -v t="$tps" -v p="$plain" -v m="$mal" -v s="$steps" -v a="$at" \
      'BEGIN { printf "| %d | %d | %.0f | %.2fx | %s | %s | %s |\n", b, k, t, t / p, (k ? sprintf("%.2f", m) : "-"), (k ? s : "-"), (k ? a : "-") }'
  done
done
echo
echo "Batch 64 with the default policy (speculative_max_batch: its default), best of $((2 * REPS)):"
make_requests 256
declare -A pol=([0]=0 [2]=0)
for rep in $(seq $((2 * REPS))); do
  for k in 0 2; do
    read -r tps mal steps at < <(run 64 256 "$k" "# speculative_max_batch: default")
    pol[$k]=$(awk -v a="${pol[$k]}" -v t="$tps" 'BEGIN { print (t > a ? t : a) }')
  done
done
awk -v p="${pol[0]}" -v s="${pol[2]}" 'BEGIN { printf "  plain %.0f tokens/s, k 2 %.0f tokens/s: %.3fx\n", p, s, s / p }'
