#!/usr/bin/env bash
# Sets up the machine, builds glm5, and runs a batch job on the embedded small trained GLM-5
# (tests/data/glm5-kjv: every GLM-5 part, trained on the King James Bible) with 4 MPI ranks
# (2 pipeline stages x 2 expert-parallel ranks), printing each prompt and its completion.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
out=$(mktemp -d)/out.jsonl
ROOT_FLAGS=()
if [ "$(id -u)" = 0 ]; then ROOT_FLAGS=(--allow-run-as-root); fi
mpirun "${ROOT_FLAGS[@]}" --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \
  build/glm5 batch --model tests/data/glm5-kjv --cluster cluster-configs/cpu-pp2-ep2.yaml \
  --input tests/data/glm5-kjv/demo-batch.jsonl --output "$out"
echo "== $out (OpenAI Batch output records)"
# Each prompt and its completion, as text.
python3 - tests/data/glm5-kjv/demo-batch.jsonl "$out" <<'EOF'
import json, sys
bold, end = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
prompts = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    body = r.get("body", r)
    prompts[r["custom_id"]] = body.get("prompt") or body["messages"][-1]["content"]
for line in open(sys.argv[2]):
    r = json.loads(line)
    body = r["response"]["body"] if r.get("response") else {}
    choice = (body.get("choices") or [{}])[0]
    text = choice.get("text", choice.get("message", {}).get("content", ""))
    print(f"--- {r['custom_id']}\n{prompts[r['custom_id']]}{bold}{text}{end}\n" if text else f"--- {r['custom_id']}: {r.get('error')}")
EOF
