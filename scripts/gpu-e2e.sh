#!/usr/bin/env bash
# End-to-end throughput of one GPU on a GLM-5-shaped model, from a bundle (scripts/gpu-bundle.sh):
# generates the "bench" checkpoint there (scripts/gen_tiny_model.py, numpy only: 814 M parameters,
# GLM-5's MLA and indexer geometry, index_topk 2048), makes N requests of pseudo-random prompt ids
# (longer than index_topk, so that decode takes the sparse path: the indexer, top-k and sparse MLA
# decode), and runs `glm5 batch` on the cuda backend (one rank, bf16 KV cache) for each
# attention-kernel setting (GLM5_CUDA_MLA_DECODE / GLM5_CUDA_INDEXER: simt, tensor) and max_batch.
# Prints output tokens per second, the first record's tokens and which attention kernels ran
# (GLM5_CUDA_ATTENTION_LOG); the records of every run are compared with the first run's (greedy:
# batching must not change a token; the tensor kernels round differently, so a near-tie may flip
# there). A failed run is reported and the others still run; the exit status is then 1.
#
# Usage: GLM5_BUNDLE=DIR scripts/gpu-e2e.sh [WORK_DIR]
# Env: N (requests, default 16), PROMPT (tokens, default 3072), OUT_TOKENS (default 32),
#      BATCHES (default "16 4"), KERNELS (default "simt tensor"), E2E_RUN_TIMEOUT (seconds per
#      glm5 run, default 35); for a dry run of the flow without a GPU: PRESET (default bench),
#      BACKEND (default cuda), COMM (default nccl).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle=${GLM5_BUNDLE:?set GLM5_BUNDLE to a bundle made by scripts/gpu-bundle.sh}
work=${1:-/tmp/glm5-e2e}
n=${N:-16}
prompt=${PROMPT:-3072}
out_tokens=${OUT_TOKENS:-32}
rc=0
mkdir -p "$work"
preset=${PRESET:-bench}
model=$work/$preset
if [ ! -f "$model/config.json" ]; then
  t0=$SECONDS
  python3 "$root/scripts/gen_tiny_model.py" --preset "$preset" --out "$model" > "$work/gen.log" 2>&1 ||
    { tail -5 "$work/gen.log"; exit 1; }
  echo "generated $model in $((SECONDS - t0)) s ($(du -sh "$model" | cut -f1))"
fi
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]+'/config.json'))['vocab_size'])" "$model")
python3 - "$work/requests.jsonl" "$vocab" "$n" "$prompt" "$out_tokens" <<'PY'
import json, random, sys
path, vocab, n, prompt, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rng = random.Random(7)
with open(path, "w") as f:
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(prompt)]
        f.write(json.dumps({"custom_id": f"r{i}", "prompt_ids": ids, "max_tokens": out,
                            "temperature": 0, "ignore_eos": True}) + "\n")
PY
first=""
for kern in ${KERNELS:-simt tensor}; do
  export GLM5_CUDA_MLA_DECODE=$kern GLM5_CUDA_INDEXER=$kern GLM5_CUDA_ATTENTION_LOG=1
  for b in ${BATCHES:-16 4}; do
    echo "== attention kernels $kern, max_batch $b"
    cfg=$work/cuda-b$b.yaml
    printf 'stages: 1\nexpert_parallel: 1\nmicro_batches: 1\nbackend: %s\ncomm: %s\nkv_dtype: bf16\nkv_budget_gb: 16\nmax_batch: %d\nprefill_chunk: 2048\n' \
      "${BACKEND:-cuda}" "${COMM:-nccl}" "$b" > "$cfg"
    out=$work/out-$kern-b$b.jsonl
    rm -f "$out"
    t0=$(date +%s.%N)
    if ! timeout "${E2E_RUN_TIMEOUT:-35}" "$bundle/run.sh" glm5 batch --model "$model" --input "$work/requests.jsonl" \
      --output "$out" --cluster "$cfg" --report "$work/report-$kern-b$b.json" > "$work/run-$kern-b$b.log" 2>&1; then
      echo "max_batch $b: failed (exit or time limit)"
      tail -5 "$work/run-$kern-b$b.log"
      rc=1
      continue
    fi
    grep '^glm5 cuda: ' "$work/run-$kern-b$b.log" | sed 's/^/  /' || true
    t1=$(date +%s.%N)
    python3 - "$out" "$t0" "$t1" "$b" "${first:-}" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
toks = {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"] for r in recs}
n = sum(len(v) for v in toks.values())
wall = float(sys.argv[3]) - float(sys.argv[2])
line = f"max_batch {sys.argv[4]}: {len(recs)} records, {n} output tokens in {wall:.2f} s (process wall, load included): {n / wall:.1f} tok/s"
if sys.argv[5]:
    ref = {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"]["choices"][0]["token_ids"] for l in open(sys.argv[5])}
    same = sum(ref.get(k) == v for k, v in toks.items())
    line += f"; {same} of {len(toks)} records token-identical to the first run"
print(line)
print("  r0:", toks.get("r0", [])[:16])
PY
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r=r[0] if isinstance(r,list) else r; rk=r.get("ranks",[r])[0] if isinstance(r,dict) else r; print("  report:", {k: rk.get(k) for k in ("wall_s","tokens_generated","tokens_per_s")})' "$work/report-$kern-b$b.json" 2>/dev/null || true
    [ -n "$first" ] || first=$out
  done
done
exit $rc
