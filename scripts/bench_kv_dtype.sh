#!/usr/bin/env bash
# bf16 KV cache drift against float32: the same greedy generation (a P-token random prompt, N new
# tokens, EOS ignored) with kv_dtype f32 and bf16, logits dumped; prints the prefill-logit deltas,
# the decode-logit deltas up to the first diverging token, and where the tokens first differ.
# Also the KV bytes per token of each dtype. Usage: scripts/bench_kv_dtype.sh [BUILD] [MODEL] [P] [N]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-/tmp/glm5-long}
P=${3:-1024}
N=${4:-256}
[ -f "$MODEL/config.json" ] || scripts/bench_long_context.sh "$BUILD" "$MODEL" 16 > /dev/null
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
ids=$(awk -v n="$P" 'BEGIN { srand(3); for (i = 0; i < n; i++) printf "%s%d", (i ? "," : ""), int(rand() * 2000) }')
for dt in f32 bf16; do
  printf 'stages: 1\nkv_dtype: %s\n' "$dt" > "$D/$dt.yaml"
  OMP_NUM_THREADS=1 "$BUILD/glm5" generate --model "$MODEL" --cluster "$D/$dt.yaml" --prompt-ids "$ids" \
    --max-new-tokens "$N" --temperature 0 --ignore-eos --dump-logits "$D/$dt.safetensors" > /dev/null
  "$BUILD/glm5" inspect --model "$MODEL" --cluster "$D/$dt.yaml" | grep '^kv cache'
done
python3 - "$D/f32.safetensors" "$D/bf16.safetensors" <<'PY'
import json, struct, sys
import numpy as np
def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        dt = {"F32": np.float32, "I32": np.int32}[t["dtype"]]
        out[name] = np.frombuffer(data[a:b], dtype=dt).reshape(t["shape"])
    return out
f, b = load(sys.argv[1]), load(sys.argv[2])
pf = np.abs(f["prefill_logits"] - b["prefill_logits"])
agree = f["prefill_logits"].argmax(1) == b["prefill_logits"].argmax(1)
print(f"prefill logits: max |delta| {pf.max():.4f}, mean {pf.mean():.5f}, argmax agreement {agree.mean() * 100:.1f}% of {len(agree)} rows")
tf, tb = f["decode_tokens"], b["decode_tokens"]
diff = np.nonzero(tf != tb)[0]
first = int(diff[0]) if len(diff) else len(tf)
d = np.abs(f["decode_logits"][:first] - b["decode_logits"][:first]) if first else np.zeros(1)
print(f"greedy tokens: identical for the first {first} of {len(tf)} generated tokens; "
      f"decode logits before that: max |delta| {d.max():.4f}, mean {d.mean():.5f}")
PY
