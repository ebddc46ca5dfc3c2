#!/usr/bin/env bash
# The quality table of BENCHMARKS.md: what each storage / cache / sparsity choice costs on held-out text, measured
# on the trained small model (tests/data/glm5-kjv) against its BF16 weights with `glm5 perplexity`: perplexity,
# mean and 99th-percentile KL divergence, top-1 agreement. Prints a markdown table (each row with the command that
# produced it) and writes perplexity against index_topk as a PNG.
#
#   scripts/quality_table.sh [BUILD_DIR] [OUT_DIR]    (defaults: build, /tmp/glm5-quality)
# Environment: MODEL (tests/data/glm5-kjv), TEXT ($MODEL/heldout.txt), CTX (1024), CHUNKS (0: all windows).
# Needs: a built glm5, mpirun (the layout rows), and for the plot a python3 with matplotlib (PYTHON=...).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-/tmp/glm5-quality}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-tests/data/glm5-kjv}
TEXT=${TEXT:-$MODEL/heldout.txt}
CTX=${CTX:-1024}
CHUNKS=${CHUNKS:-0}  # 0: every window of the text
GLM5=$BUILD/glm5
mkdir -p "$OUT"
ROOT_FLAGS=()
if [ "$(id -u)" = 0 ]; then ROOT_FLAGS=(--allow-run-as-root); fi

ppl() {  # ppl NAME MODEL_DIR [extra glm5 perplexity args...]: one JSON result in $OUT/NAME.json
  local name=$1 dir=$2
  shift 2
  "$GLM5" perplexity --model "$dir" --file "$TEXT" --ctx "$CTX" --chunks "$CHUNKS" --json "$@" > "$OUT/$name.json"
}

# A copy of the model directory with config.json edited (shards linked, not copied).
variant() {  # variant DIR KEY VALUE
  local dir=$1 key=$2 value=$3
  rm -rf "$dir" && mkdir -p "$dir"
  for f in "$MODEL"/*; do ln -s "$(realpath "$f")" "$dir/"; done
  rm "$dir/config.json"
  "$PYTHON" -c "import json,sys; c=json.load(open('$MODEL/config.json')); c['$key']=$value; json.dump(c, open('$dir/config.json','w'), indent=2)"
}

declare -A CMD
echo "base (BF16 weights) ..." >&2
ppl base "$MODEL" --save-logits "$OUT/base.logprobs"
CMD[base]="glm5 perplexity --model $MODEL --file $TEXT --ctx $CTX --save-logits base.logprobs"

for q in "fp8" "int8 128" "int4 128" "int4 32"; do
  set -- $q
  name=$1${2:+-g$2}
  echo "$name ..." >&2
  "$GLM5" convert --model "$MODEL" --out "$OUT/model-$name" --quant "$1" ${2:+--group-size $2} --no-progress >&2
  cp "$MODEL/tokenizer.json" "$MODEL/tokenizer_config.json" "$OUT/model-$name/" 2>/dev/null || true
  ppl "$name" "$OUT/model-$name" --kl-base "$OUT/base.logprobs"
  CMD[$name]="glm5 convert --model $MODEL --out M --quant $1 ${2:+--group-size $2}; glm5 perplexity --model M ... --kl-base base.logprobs"
done

echo "kv bf16 ..." >&2
printf 'stages: 1\nexpert_parallel: 1\nbackend: cpu\ncomm: mpi\nkv_dtype: bf16\n' > "$OUT/kv-bf16.yaml"
ppl kv-bf16 "$MODEL" --cluster "$OUT/kv-bf16.yaml" --kl-base "$OUT/base.logprobs"
CMD[kv-bf16]="glm5 perplexity ... --cluster (kv_dtype: bf16) --kl-base base.logprobs"

# Precision fast (every gemm's inputs rounded to bf16), alone and with int4 weights / a bf16 KV cache.
echo "precision fast ..." >&2
ppl fast "$MODEL" --precision fast --kl-base "$OUT/base.logprobs"
CMD[fast]="glm5 perplexity ... --precision fast --kl-base base.logprobs"
ppl fast-int4-g128 "$OUT/model-int4-g128" --precision fast --kl-base "$OUT/base.logprobs"
CMD[fast-int4-g128]="glm5 perplexity --model M (int4 g128) ... --precision fast --kl-base base.logprobs"
ppl fast-kv-bf16 "$MODEL" --precision fast --cluster "$OUT/kv-bf16.yaml" --kl-base "$OUT/base.logprobs"
CMD[fast-kv-bf16]="glm5 perplexity ... --precision fast --cluster (kv_dtype: bf16) --kl-base base.logprobs"

echo "layout pp2 x ep2 (4 ranks) ..." >&2
mpirun "${ROOT_FLAGS[@]}" --oversubscribe -np 4 -x OMP_NUM_THREADS=1 "$GLM5" perplexity --model "$MODEL" \
  --file "$TEXT" --ctx "$CTX" --chunks "$CHUNKS" --json --cluster cluster-configs/cpu-pp2-ep2.yaml --kl-base "$OUT/base.logprobs" \
  > "$OUT/pp2-ep2.json"
CMD[pp2-ep2]="mpirun -np 4 glm5 perplexity ... --cluster cluster-configs/cpu-pp2-ep2.yaml --kl-base base.logprobs"

TOPKS=$(printf "%s\n" 16 32 48 64 96 128 256 512 "$CTX" | awk -v c="$CTX" '$1 <= c' | sort -nu | tr "\n" " ")
for k in $TOPKS; do
  echo "index_topk $k ..." >&2
  variant "$OUT/model-topk$k" index_topk "$k"
  ppl "topk$k" "$OUT/model-topk$k" --kl-base "$OUT/base.logprobs"
  CMD[topk$k]="glm5 perplexity (config.json index_topk: $k) ... --kl-base base.logprobs"
done

rows="base fp8 int8-g128 int4-g128 int4-g32 kv-bf16 fast fast-int4-g128 fast-kv-bf16 pp2-ep2"
for k in $TOPKS; do rows="$rows topk$k"; done
echo "| variant | perplexity | delta | KLD mean | KLD p99 | top-1 agreement | command |"
echo "|---|---|---|---|---|---|---|"
for r in $rows; do
  "$PYTHON" - "$OUT" "$r" "${CMD[$r]}" <<'EOF'
import json, sys
out, name, cmd = sys.argv[1:]
b = json.load(open(f"{out}/base.json"))
r = json.load(open(f"{out}/{name}.json"))
d = r["perplexity"] - b["perplexity"]
kl = f"{r['kld_mean']:.5f} ± {r['kld_stderr']:.5f}" if "kld_mean" in r else "-"
p99 = f"{r['kld_p99']:.4f}" if "kld_p99" in r else "-"
top = f"{100 * r['top1_agreement']:.2f} %" if "top1_agreement" in r else "-"
print(f"| {name} | {r['perplexity']:.4f} ± {r['perplexity_stderr']:.4f} | {d:+.4f} | {kl} | {p99} | {top} | `{cmd}` |")
EOF
done
echo "(held-out: $TEXT, $(jq -r .tokens_scored "$OUT/base.json" 2>/dev/null || true) tokens scored, --ctx $CTX)"

"$PYTHON" - "$OUT" "$TOPKS" <<'EOF' || echo "(no plot: matplotlib missing)" >&2
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
out, topks = sys.argv[1], [int(k) for k in sys.argv[2].split()]
p = [json.load(open(f"{out}/topk{k}.json")) for k in topks]
fig, ax = plt.subplots(1, 2, figsize=(10, 4))
# Paired on the same tokens: the differences are far smaller than each perplexity's standard error
# (which measures the text's spread, not the comparison), so no error bars; KL divergence beside it.
ax[0].plot(topks, [r["perplexity"] for r in p], marker="o")
ax[0].set_ylabel("held-out perplexity")
ax[1].plot(topks, [r["kld_mean"] for r in p], marker="o", color="C1")
ax[1].set_yscale("symlog", linthresh=1e-4)
ax[1].set_ylabel("mean KL divergence vs the trained top-k (nats)")
for a in ax:
    a.set_xscale("log", base=2)
    a.set_xlabel("index_topk (keys each query attends to; trained at 64)")
fig.suptitle(f"glm5-kjv: held-out quality against index_topk (ctx {p[0]['ctx']}; the largest = dense)")
fig.tight_layout()
fig.savefig(f"{out}/ppl_vs_topk.png", dpi=90)
print(f"plot: {out}/ppl_vs_topk.png", file=sys.stderr)
EOF
