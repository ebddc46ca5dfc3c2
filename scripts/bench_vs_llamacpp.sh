#!/usr/bin/env bash
# glm5 beside llama.cpp on one CPU, same weights, same run: builds llama.cpp CPU-only from a source
# tree you give (nothing of it enters this project), converts the same Hugging Face checkpoint to GGUF
# (BF16, Q8_0, Q4_K_M) and to glm5's int8 / int4 (group 128; int8 also with F32 scales, convert
# --scale-dtype f32, set against Q8_0 as well), then runs both interleaved, ROUNDS rounds:
#   llama-bench pp512 + tg128 per GGUF  |  bench_cpu --prompt 512 (pp512) and --prompt 1 --decode 128
#   (tg128: decode from an empty context, as llama-bench's tg128 does) per glm5 checkpoint; each pp512
#   one untimed pass, then one timed (llama-bench -r 1 after its warm-up run; bench_cpu --prefill-reps 1)
# with 2 and 1 threads, then (BF16 only, DEPTH_ROUNDS rounds) decode after 512, 4k and 16k tokens of context
# (llama-bench -p 0 -n 32 -d N  |  bench_cpu --prompt N --decode 32, beyond the first depth with
# --beside FIRST: glm5's ratio to the first depth also step by step in one process). Prints one
# markdown table of medians with glm5 / llama.cpp ratios and the read bandwidth / FMA peak
# bench_cpu measured, and what those limits allow in this run: each tg128's read-bandwidth bound
# against llama.cpp's tg128, and the share of the FMA peak that 2x llama.cpp's BF16 pp512 would take.
# glm5 runs in both precisions (bench_cpu --precision exact | fast; rows "glm5" and "glm5 fast").
# Then the main job itself, BATCH_ROUNDS rounds: `glm5 batch` (start-up included) on 32 requests of 256
# prompt + 64 generated tokens, in both precisions, beside llama-batched-bench -npp 256 -ntg 64 -npl 32
# on the BF16 GGUF (load excluded), same threads.
# The script exits 1 (after its table) when a glm5 path falls under half of its own bound: tg128 under
# half its read-bandwidth bound, or pp512 under half the FMA peak (fp32; for BF16 weights in fast,
# twice that where the CPU has AVX512-BF16 or AMX).
# Both decode pseudo-random tokens (llama-bench's tg does; bench_cpu's default --decode-tokens random),
# so that each step routes to experts the step before did not leave in the L3.
#
#   scripts/bench_vs_llamacpp.sh LLAMA_CPP_SRC [MODEL_DIR]
#     MODEL_DIR  a GLM-5-shaped BF16 checkpoint (default: speed-a generated into $WORK/speed-a by
#                scripts/gen_tiny_model.py: the speed-a shape of BENCHMARKS.md, 1.83 GB, 32k positions)
#   env: WORK (default /tmp/glm5-vs-llamacpp: llama.cpp build, GGUFs, glm5 conversions; reused when
#        present), GLM5_BUILD (default build), PYTHON (a python3 with scripts/requirements-gguf.txt;
#        default: a venv made in $WORK), THREADS_LIST="2 1", ROUNDS=3, DEPTHS="512 4096 16384"
#        (ascending: the first is the reference for the depth ratios) DEPTH_ROUNDS=1, BATCH_ROUNDS=1,
#        PRECISIONS="exact fast", LLAMA_CMAKE_ARGS (extra cmake options for llama.cpp), PREPARE_ONLY=1
#        (build llama.cpp and make every checkpoint, measure nothing: a quiet run can follow)
#
# llama.cpp is built with -DGGML_NATIVE=ON (its best kernels for this CPU). On CPUs with AMX, its Q8_0 /
# Q4_K_M runs abort with GGML_ASSERT(*cur_backend_id != -1) while its repacked (AMX) buffer types are
# on, so there the quantized runs get llama-bench --repack 0 (its AVX-512 VNNI kernels; the table
# says so). LLAMA_QUANT_ARGS overrides those extra llama-bench arguments.
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=${1:?usage: scripts/bench_vs_llamacpp.sh LLAMA_CPP_SRC [MODEL_DIR]}
SRC=$(cd "$SRC" && pwd)
WORK=${WORK:-/tmp/glm5-vs-llamacpp}
MODEL=${2:-$WORK/speed-a}
GLM5_BUILD=${GLM5_BUILD:-build}
THREADS_LIST=${THREADS_LIST:-"2 1"}
ROUNDS=${ROUNDS:-3}
DEPTHS=${DEPTHS:-"512 4096 16384"}
DEPTH_ROUNDS=${DEPTH_ROUNDS:-1}
BATCH_ROUNDS=${BATCH_ROUNDS:-1}
PRECISIONS=${PRECISIONS:-"exact fast"}
mkdir -p "$WORK"
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
fail() { tail -20 "$1" >&2; echo "failed: see $1" >&2; exit 1; }

# 1. llama.cpp, CPU only: llama-bench and llama-quantize.
LB=$WORK/llama-build
if [ ! -x "$LB/bin/llama-bench" ] || [ ! -x "$LB/bin/llama-quantize" ] || [ ! -x "$LB/bin/llama-batched-bench" ]; then
  log "building llama.cpp from $SRC into $LB"
  # shellcheck disable=SC2086
  cmake -S "$SRC" -B "$LB" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF ${LLAMA_CMAKE_ARGS:-} > "$WORK/llama-cmake.log" 2>&1 || fail "$WORK/llama-cmake.log"
  cmake --build "$LB" -j"$(nproc)" --target llama-bench llama-quantize llama-batched-bench > "$WORK/llama-build.log" 2>&1 \
    || fail "$WORK/llama-build.log"
fi
LLAMA_REV=$(git -C "$SRC" rev-parse --short HEAD 2> /dev/null || echo unknown)

# 2. The checkpoint, its GGUFs and glm5's quantized conversions (the generator and the GGUF writer
# need numpy and gguf: a venv in $WORK unless PYTHON names a python3 that has them).
need_python() {  # sets PYTHON, making the venv the first time it is needed
  if [ -z "${PYTHON:-}" ]; then
    if [ ! -f "$WORK/venv/.ready" ]; then
      python3 -m venv "$WORK/venv" && "$WORK/venv/bin/pip" install -q -r scripts/requirements-gguf.txt && touch "$WORK/venv/.ready"
    fi
    PYTHON=$WORK/venv/bin/python3
  fi
}
if [ ! -f "$MODEL/config.json" ]; then
  need_python
  log "generating speed-a into $MODEL"
  "$PYTHON" scripts/gen_tiny_model.py --out "$MODEL" --seed 1 --hidden-size 2048 --num-hidden-layers 8 \
    --first-k-dense-replace 1 --num-attention-heads 16 --q-lora-rank 512 --kv-lora-rank 256 --qk-nope-head-dim 64 \
    --qk-rope-head-dim 32 --v-head-dim 64 --index-n-heads 8 --index-head-dim 64 --index-topk 256 \
    --intermediate-size 4096 --moe-intermediate-size 256 --n-routed-experts 64 --num-experts-per-tok 8 --n-group 1 \
    --topk-group 1 --n-shared-experts 1 --vocab-size 32000 --max-position-embeddings 32768 --rope-theta 1000000 \
    --routed-scaling-factor 2.5 --rms-norm-eps 1e-5 --num-nextn-predict-layers 0 --shards 4 > /dev/null
fi
G=$WORK/gguf
mkdir -p "$G"
if [ ! -f "$G/model.f32.gguf" ] && [ ! -f "$G/model.BF16.gguf" ]; then
  need_python
  log "converting $MODEL to GGUF"
  "$PYTHON" scripts/hf_to_gguf.py "$MODEL" "$G/model.f32.gguf.tmp" > "$WORK/gguf.log" 2>&1 || fail "$WORK/gguf.log"
  mv "$G/model.f32.gguf.tmp" "$G/model.f32.gguf"
fi
for t in BF16 Q8_0 Q4_K_M; do  # each written under a temporary name, so an interrupted run redoes it
  [ -f "$G/model.$t.gguf" ] && continue
  [ -f "$G/model.f32.gguf" ] || { echo "no $G/model.f32.gguf to quantize to $t: delete $G and rerun" >&2; exit 1; }
  "$LB/bin/llama-quantize" "$G/model.f32.gguf" "$G/model.$t.gguf.tmp" "$t" > "$WORK/quantize-$t.log" 2>&1 ||
    fail "$WORK/quantize-$t.log"
  mv "$G/model.$t.gguf.tmp" "$G/model.$t.gguf"
done
rm -f "$G/model.f32.gguf"  # 4 x the BF16 size; the three types are what is measured
for q in int8 int4 int8-f32s; do  # glm5 convert writes its index last and resumes an interrupted conversion
  scales=bf16
  [ "$q" = int8-f32s ] && scales=f32
  [ -f "$WORK/glm5-$q/model.safetensors.index.json" ] ||
    "$GLM5_BUILD/glm5" convert --model "$MODEL" --out "$WORK/glm5-$q" --quant "${q%-f32s}" --group-size 128 \
      --quantize all --scale-dtype $scales > "$WORK/convert-$q.log" 2>&1 || fail "$WORK/convert-$q.log"
done

if [ -n "${PREPARE_ONLY:-}" ]; then log "prepared in $WORK (PREPARE_ONLY): nothing measured"; exit 0; fi

# Private copies, so that a rebuild during the run cannot swap the binaries.
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
cp "$GLM5_BUILD/bench_cpu" "$D/bench_cpu"
cp "$GLM5_BUILD/glm5" "$D/glm5"
cp -r "$LB/bin" "$D/llama"  # (its libraries too: run with LD_LIBRARY_PATH on the copy)

cpu=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p')
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_tile|avx2)$' | sort | tr '\n' ' ' || true)
echo "CPU: $cpu, $(nproc) cpus; $flags"
echo "glm5 $(git rev-parse --short HEAD 2> /dev/null || echo '?')$(git diff --quiet 2> /dev/null || echo ' (dirty tree)'); llama.cpp $LLAMA_REV (GGML_NATIVE=ON ${LLAMA_CMAKE_ARGS:-})"
echo "model: $MODEL; rounds: $ROUNDS (depth rounds: $DEPTH_ROUNDS)"
# shellcheck source=scripts/bench_load.sh
. scripts/bench_load.sh
load_start

# One line per sample: "<metric> <threads> <engine> <weights> <value> [bandwidth GB/s] [fma GFLOP/s]".
R=$WORK/results.txt
: > "$R"
: > "$R.inter"  # "<depth> <first depth> <interleaved ratio>" (bench_cpu --beside)
# "<metric> <threads> <weights> <value>": glm5's own limits, from the runs above: pp512's GFLOP per
# token (GFLOP/s over tok/s), tg128's read-bandwidth bound in tok/s (weights per token / bandwidth)
: > "$R.limits"
if [ -z "${LLAMA_QUANT_ARGS+set}" ]; then
  LLAMA_QUANT_ARGS=""
  if grep -q -w amx_tile /proc/cpuinfo 2> /dev/null; then LLAMA_QUANT_ARGS="--repack 0"; fi
fi
echo "llama.cpp Q8_0 / Q4_K_M: llama-bench ${LLAMA_QUANT_ARGS:-with no extra arguments}"
llama() {  # llama() GGUF_TYPE THREADS ARGS... -> "n_prompt n_gen avg_ts" per test, one per line
  local t=$1 th=$2 out extra=""
  shift 2
  if [ "$t" != BF16 ]; then extra=$LLAMA_QUANT_ARGS; fi
  # shellcheck disable=SC2086
  out=$(LD_LIBRARY_PATH="$D/llama" "$D/llama/llama-bench" -m "$G/model.$t.gguf" -t "$th" -r 1 $extra "$@" -o csv 2> "$D/llama.err") ||
    { cat "$D/llama.err" >&2; echo "llama-bench failed on $t" >&2; return 1; }
  printf '%s\n' "$out" | python3 -c 'import csv, sys; [print(r["n_prompt"], r["n_gen"], r["avg_ts"]) for r in csv.DictReader(sys.stdin)]'
}
glm5() {  # glm5() DIR THREADS PROMPT DECODE [BESIDE [PREFILL_REPS [PRECISION]]]
  #           -> "prefill decode bandwidth fma window% interleaved bound prefill-GFLOP/s"
  local out
  out=$(OMP_NUM_THREADS=$2 "$D/bench_cpu" --model "$1" --prompt "$3" --decode "$4" ${5:+--beside "$5"} \
    --prefill-reps "${6:-0}" --precision "${7:-exact}") ||
    { echo "bench_cpu failed on $1" >&2; return 1; }
  printf '%s\n' "$out" | sed -n 's/.*BF16 gemm path \([a-z0-9-]*\).*/\1/p' > "$WORK/gemm_path.${7:-exact}"
  printf '%s\n' "$out" | python3 -c '
import re, sys
s = sys.stdin.read()
g = lambda p: re.search(p, s).group(1)
print(g(r"prefill \d+ tokens: ([0-9.]+) tok/s"), g(r"decode  batch 1 \([a-z]+ tokens\): ([0-9.]+) tok/s"),
      g(r"read bandwidth ([0-9.]+) GB/s"), g(r"fp32 FMA peak ([0-9.]+) GFLOP/s"),
      g(r"probed around each: median ([0-9.]+)%"),
      (re.search(r"interleaved step by step \(\d+ pairs\): ([0-9.]+)", s) or [None, "-"])[1],
      g(r"bandwidth bound ([0-9.]+) tok/s"), g(r"prefill \d+ tokens: [0-9.]+ tok/s, ([0-9.]+) GFLOP/s"))'
}
declare -A GLM5_DIR=([bf16]=$MODEL [int8]=$WORK/glm5-int8 [int8-f32s]=$WORK/glm5-int8-f32s [int4]=$WORK/glm5-int4)
for round in $(seq 1 "$ROUNDS"); do
  for th in $THREADS_LIST; do
    for t in BF16 Q8_0 Q4_K_M; do
      out=$(llama "$t" "$th" -p 512 -n 128)  # (a failure stops the script: set -e)
      while read -r _ ng ts; do
        if [ "$ng" = 0 ]; then echo "pp512 $th llama.cpp $t $ts" >> "$R"; else echo "tg128 $th llama.cpp $t $ts" >> "$R"; fi
      done <<< "$out"
    done
    for w in bf16 int8 int8-f32s int4; do
      for prec in $PRECISIONS; do
        eng=glm5
        [ "$prec" = exact ] || eng=glm5-$prec
        out=$(glm5 "${GLM5_DIR[$w]}" "$th" 512 8 "" 1 "$prec")  # (pp512: one untimed pass first, as llama-bench)
        read -r pp _ bw fma _ _ _ flops <<< "$out"
        echo "pp512 $th $eng $w $pp $bw $fma" >> "$R"
        python3 -c "import sys; print('pp512', sys.argv[1], sys.argv[2], float(sys.argv[3]) / float(sys.argv[4]), sys.argv[5], float(sys.argv[6]))" \
          "$th" "$w" "$flops" "$pp" "$eng" "$flops" >> "$R.limits"
        out=$(glm5 "${GLM5_DIR[$w]}" "$th" 1 128 "" 0 "$prec")
        read -r _ tg bw fma win _ bound _ <<< "$out"
        echo "tg128 $th $eng $w $tg $bw $fma $win" >> "$R"
        echo "tg128 $th $w $bound $eng $tg" >> "$R.limits"
      done
    done
    log "round $round, $th threads done"
  done
done
read -r th _ <<< "$THREADS_LIST"
read -r first_depth _ <<< "$DEPTHS"
for round in $(seq 1 "$DEPTH_ROUNDS"); do
  for d in $DEPTHS; do
    out=$(llama BF16 "$th" -p 0 -n 32 -d "$d")
    while read -r _ _ ts; do echo "tg32@$d $th llama.cpp BF16 $ts" >> "$R"; done <<< "$out"
    # glm5 at a deeper context also decodes beside the first depth's context, step by step in one
    # process (bench_cpu --beside): a ratio the machine's drift between runs does not reach
    if [ "$d" = "$first_depth" ]; then out=$(glm5 "$MODEL" "$th" "$d" 32); else out=$(glm5 "$MODEL" "$th" "$d" 32 "$first_depth"); fi
    read -r _ tg bw fma _ inter _ <<< "$out"
    echo "tg32@$d $th glm5 bf16 $tg $bw $fma" >> "$R"
    [ "$inter" = - ] || echo "$d $first_depth $inter" >> "$R.inter"
    log "depth $d round $round done"
  done
done
# The main job: 32 requests of 256 prompt + 64 generated tokens (random ids, greedy, EOS ignored).
python3 - "$WORK/batch32.jsonl" "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json")" <<'PY'
import json, random, sys
rng = random.Random(7)
with open(sys.argv[1], "w") as f:
    for i in range(32):
        ids = [rng.randrange(int(sys.argv[2])) for _ in range(256)]
        f.write(json.dumps({"custom_id": f"r{i}", "prompt_ids": ids, "max_tokens": 64, "temperature": 0,
                            "ignore_eos": True}) + "\n")
PY
printf 'max_batch: 32\nprefill_chunk: 256\nmax_step_tokens: 8192\n' > "$WORK/batch32.yaml"
for round in $(seq 1 "$BATCH_ROUNDS"); do
  out=$(LD_LIBRARY_PATH="$D/llama" "$D/llama/llama-batched-bench" -m "$G/model.BF16.gguf" -c 16384 -b 2048 -ub 512 \
    -npp 256 -ntg 64 -npl 32 -t "$th" --output-format jsonl 2> "$D/batched.err") ||
    { cat "$D/batched.err" >&2; echo "llama-batched-bench failed" >&2; exit 1; }
  printf '%s\n' "$out" | python3 -c 'import json, sys; [print("batch32", sys.argv[1], "llama.cpp BF16", json.loads(l)["t"]) for l in sys.stdin if l.startswith("{")]' "$th" >> "$R.batch"
  for prec in $PRECISIONS; do
    rm -f "$D/batch-out.jsonl"
    start=$(date +%s.%N)
    OMP_NUM_THREADS=$th "$D/glm5" batch --model "$MODEL" --input "$WORK/batch32.jsonl" --output "$D/batch-out.jsonl" \
      --cluster "$WORK/batch32.yaml" --precision "$prec" 2> "$D/batch.err" || { cat "$D/batch.err" >&2; exit 1; }
    end=$(date +%s.%N)
    echo "batch32 $th glm5-$prec bf16 $(python3 -c "print(float('$end') - float('$start'))")" >> "$R.batch"
  done
  log "batch round $round done"
done
load_report
echo

python3 - "$R" <<'PY'
import os, statistics, sys
from collections import defaultdict
s = defaultdict(list)
bw, fma, win = defaultdict(list), defaultdict(list), defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    s[(f[0], f[1], f[2], f[3])].append(float(f[4]))
    if len(f) > 6:
        bw[f[1]].append(float(f[5])); fma[f[1]].append(float(f[6]))
    if len(f) > 7:
        win[(f[1], f[3])].append(float(f[7]))
med = {k: statistics.median(v) for k, v in s.items()}
peer = {"bf16": "BF16", "int8": "Q8_0", "int8-f32s": "Q8_0", "int4": "Q4_K_M"}
print("| test | threads | glm5 weights | glm5 tok/s | llama.cpp | llama.cpp tok/s | glm5 / llama.cpp | samples glm5 / llama.cpp |")
print("|---|---|---|---|---|---|---|---|")
for (metric, th, eng, w), m in med.items():
    if not eng.startswith("glm5"):
        continue
    key = (metric, th, "llama.cpp", peer[w])
    lm = med.get(key)
    samples = " ".join(f"{x:.1f}" for x in s[(metric, th, eng, w)]) + " / " + " ".join(f"{x:.1f}" for x in s.get(key, []))
    ratio = f"**{m / lm:.2f}x**" if lm else ""
    wl = w + ("" if eng == "glm5" else " " + eng[5:])
    print(f"| {metric} | {th} | {wl} | {m:.1f} | {peer[w]} | {lm:.1f} | {ratio} | {samples} |" if lm else
          f"| {metric} | {th} | {wl} | {m:.1f} | {peer[w]} | | | {samples} |")
for (metric, th, eng, w), m in med.items():  # fast against exact, same weights, same run
    ex = med.get((metric, th, "glm5", w))
    if eng != "glm5" and eng.startswith("glm5") and ex:
        print(f"\nglm5 {w} {metric}, {th} threads: {eng[5:]} / exact = {m / ex:.2f}x", end="")
print()
for th in sorted(bw):
    print(f"\n{th} threads: read bandwidth {statistics.median(bw[th]):.1f} GB/s, fp32 FMA peak "
          f"{statistics.median(fma[th]):.0f} GFLOP/s (bench_cpu, medians)")
# What this run's limits allow, from glm5's own runs. tg128: the read-bandwidth bound (every weight
# read once per token, glm5's bytes: llama.cpp's Q8_0 / Q4_K_M read other counts) over llama.cpp's
# tg128. pp512: the FMA rate (share of the measured fp32 peak) that 2x llama.cpp's pp512 takes at
# glm5's FLOP per token.
lim = defaultdict(list)
under = []  # glm5 paths under half of their own bound
share = defaultdict(list)  # (metric, threads, engine, weights) -> tg128 share of its bound / pp512 GFLOP/s
bf16_dot = any(x in open("/proc/cpuinfo").read() for x in ("avx512_bf16", "amx_bf16"))
if os.path.exists(sys.argv[1] + ".limits"):
    for line in open(sys.argv[1] + ".limits"):
        f = line.split()
        eng = f[4] if len(f) > 4 else "glm5"
        if eng == "glm5":
            lim[(f[0], f[1], f[2])].append(float(f[3]))
        if len(f) > 5:
            share[(f[0], f[1], eng, f[2])].append(float(f[5]) / float(f[3]) if f[0] == "tg128" else float(f[5]))
for (metric, th, eng, w), v in sorted(share.items()):  # medians over the rounds (one sample is noise)
    x = statistics.median(v)
    if metric == "tg128" and x < 0.5:
        under.append(f"{eng} {w} tg128, {th} threads: {100 * x:.0f}% of its read-bandwidth bound (median of {len(v)})")
    if metric == "pp512" and fma.get(th):
        # (bf16 weights in fast run bf16 dot products; quantized weights keep float32 FMA in both modes)
        dots = eng != "glm5" and bf16_dot and w == "bf16"
        peak = statistics.median(fma[th]) * (2 if dots else 1)
        if x < 0.5 * peak:
            under.append(f"{eng} {w} pp512, {th} threads: {x:.0f} GFLOP/s (median of {len(v)}), {100 * x / peak:.0f}% of "
                         f"the {'bf16' if dots else 'fp32'} peak {peak:.0f}")
for (metric, th, w), v in sorted(lim.items(), key=lambda kv: (kv[0][0], int(kv[0][1]), kv[0][2])):
    lm = med.get((metric, th, "llama.cpp", peer[w]))
    if not lm or metric not in ("pp512", "tg128") or (metric == "pp512" and w != "bf16"):
        continue
    x = statistics.median(v)
    if metric == "tg128":
        print(f"glm5 {w} tg128, {th} threads: the read-bandwidth bound in glm5's runs, {x:.1f} tok/s, is "
              f"{x / lm:.2f}x llama.cpp {peer[w]}'s tg128")
    elif fma.get(th):
        need = 2 * lm * x
        print(f"glm5 {w} pp512, {th} threads: 2x llama.cpp {peer[w]} takes {need:.0f} GFLOP/s at {x:.3f} GFLOP per "
              f"token = {100 * need / statistics.median(fma[th]):.0f}% of the fp32 FMA peak")
batch = defaultdict(list)
if os.path.exists(sys.argv[1] + ".batch"):
    for line in open(sys.argv[1] + ".batch"):
        f = line.split()
        batch[(f[1], " ".join(f[2:-1]))].append(float(f[-1]))
if batch:
    print("\n| main job: 32 x (256 prompt + 64 generated) | threads | seconds (median) | llama.cpp / this | samples |")
    print("|---|---|---|---|---|")
    for (th, eng), v in sorted(batch.items()):
        lm = batch.get((th, "llama.cpp BF16 bf16")) or batch.get((th, "llama.cpp BF16"))
        m = statistics.median(v)
        r = f"**{statistics.median(lm) / m:.2f}x**" if lm and not eng.startswith("llama") else ""
        print(f"| {eng} | {th} | {m:.2f} | {r} | {' '.join(f'{x:.2f}' for x in v)} |")
    print("(glm5: `glm5 batch` wall time, start-up and loading included; llama.cpp: llama-batched-bench's T, load excluded)")
for (th, w), v in sorted(win.items()):
    print(f"glm5 {w} decode, {th} threads: {statistics.median(v):.0f}% of the read bandwidth probed around each "
          f"window of 8 tokens (median of the runs' medians: {' '.join(f'{x:.0f}' for x in v)})")
depth = sorted({k[0] for k in med if k[0].startswith("tg32@")}, key=lambda x: int(x.split("@")[1]))
if depth:
    first = depth[0]
    for d in depth[1:]:
        for eng in ("glm5", "llama.cpp"):
            a = [v for k, v in med.items() if k[0] == d and k[2] == eng]
            b = [v for k, v in med.items() if k[0] == first and k[2] == eng]
            if a and b:
                print(f"{eng}: decode after {d[5:]} tokens of context / after {first[5:]}: {a[0] / b[0]:.2f}")
inter = defaultdict(list)
if os.path.exists(sys.argv[1] + ".inter"):
    for line in open(sys.argv[1] + ".inter"):
        d, first, r = line.split()
        inter[(int(d), int(first))].append(float(r))
for (d, first), v in sorted(inter.items()):
    print(f"glm5: decode after {d} tokens of context / after {first}, interleaved step by step in one process "
          f"(bench_cpu --beside): {statistics.median(v):.3f} (runs: {' '.join(f'{x:.3f}' for x in v)})")
for u in under:
    print(f"FAIL: {u}")
open(sys.argv[1] + ".under", "w").write("\n".join(under))
PY
echo "glm5 BF16 gemm path: exact $(cat "$WORK/gemm_path.exact" 2>/dev/null) (fp32 16-lane FMA, or amx tiles; GLM5_CPU_GEMM to choose), fast $(cat "$WORK/gemm_path.fast" 2>/dev/null) (avx512bf16, amx or portable; GLM5_CPU_FAST_GEMM)"
if [ -s "$R.under" ]; then
  echo "a glm5 path ran under half of its bound (FAIL lines above)" >&2
  exit 1
fi
