#!/usr/bin/env bash
# Batch throughput: the same 32 requests (mixed prompt lengths, 32 output tokens each, greedy) run
# through `glm5 batch` with continuous batching at max_batch 8 and 32, against max_batch 1 (one
# request at a time), in one run. Prints output tokens/s and the speed-up over one-at-a-time.
# usage: scripts/bench_batch.sh MODEL_DIR [BUILD_DIR]
set -euo pipefail
model=${1:?usage: bench_batch.sh MODEL_DIR [BUILD_DIR]}
build=${2:-build}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]+'/config.json'))['vocab_size'])" "$model")
python3 - "$tmp/requests.jsonl" "$vocab" <<'PY'
import json, random, sys
rng = random.Random(7)
with open(sys.argv[1], "w") as f:
    for i in range(32):
        n = rng.randint(16, 256)
        ids = [rng.randrange(int(sys.argv[2])) for _ in range(n)]
        f.write(json.dumps({"custom_id": f"r{i}", "prompt_ids": ids, "max_tokens": 32,
                            "temperature": 0, "ignore_eos": True}) + "\n")
PY
printf "%-10s %10s %12s %14s\n" max_batch wall_s "output tok/s" "vs one-at-a-time"
base=""
for b in 1 8 32; do
  printf "max_batch: %d\nprefill_chunk: 256\n" "$b" > "$tmp/c$b.yaml"
  rm -f "$tmp/out$b.jsonl"
  start=$(date +%s.%N)
  "$build/glm5" batch --model "$model" --input "$tmp/requests.jsonl" --output "$tmp/out$b.jsonl" \
    --cluster "$tmp/c$b.yaml" 2> /dev/null
  end=$(date +%s.%N)
  tps=$(python3 -c '
import json, sys
n = sum(len(json.loads(l)["response"]["body"]["choices"][0]["token_ids"]) for l in open(sys.argv[1]))
print(f"{n / (float(sys.argv[3]) - float(sys.argv[2])):.2f}")' "$tmp/out$b.jsonl" "$start" "$end")
  [ -n "$base" ] || base=$tps
  printf "%-10s %10.2f %12s %13.2fx\n" "$b" "$(echo "$end - $start" | bc)" "$tps" "$(echo "$tps / $base" | bc -l)"
done
# Outputs must not depend on the batch size.
python3 - "$tmp" <<'PY'
import json, sys
def load(p):
    return {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"]["choices"][0]["token_ids"] for l in open(p)}
a, b, c = (load(f"{sys.argv[1]}/out{n}.jsonl") for n in (1, 8, 32))
assert a == b == c, "outputs differ between batch sizes"
print("outputs identical for max_batch 1, 8, 32")
PY
