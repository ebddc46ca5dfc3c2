#!/usr/bin/env bash
# Decode tok/s of glm5's quantized checkpoints beside llama.cpp's Q4_K_M / Q8_0 of the same model, same
# machine, same run: ROUNDS interleaved rounds of [llama-bench decode for each GGUF, then glm5's
# bench_cpu for each glm5 checkpoint]; prints the median of each, the CPU, and glm5 / llama.cpp ratios
# (int4 vs Q4_K_M, int8 vs Q8_0, bf16 vs BF16).
#
# Environment:
#   LLAMA_CPP_BUILD  llama.cpp build dir (has bin/llama-bench)                        required
#   GGUF_DIR         dir with the model's *Q8_0*.gguf / *Q4_K_M*.gguf (*BF16*.gguf too) required
#                    (scripts/hf_to_gguf.py MODEL_DIR X.f32.gguf, then llama-quantize)
#   MODEL_DIR        the HF checkpoint the GGUFs were made from (printed; glm5's bf16 model when
#                    GLM5_MODELS is unset)
#   GLM5_MODELS      "label=dir ..." glm5 checkpoints, e.g. "bf16=/m/speed-a int4=/m/speed-a-int4"
#                    (default: "bf16=$MODEL_DIR")
#   GLM5_BUILD       glm5 build dir with bench_cpu (default: build)
#   THREADS=2 ROUNDS=3 PROMPT=512 DECODE=64
#   LLAMA_DEPTH      llama-bench -d: context filled before the timed decode (default: PROMPT, as
#                    bench_cpu decodes after a PROMPT-token prefill); 0 = llama-bench's plain tg
#   LLAMA_ARGS       extra llama-bench arguments (e.g. "-fa on")
#   GGUF_TYPES       default "Q4_K_M Q8_0 BF16" (types without a file in GGUF_DIR are skipped)
#
# Note: llama-bench at 6ea215d has no flag or environment variable for llama.cpp's extra CPU buffer
# types (AMX, repack): `-ot .*=CPU` does not do it (the loader picks the extra types again for CPU
# overrides), and common's --no-repack is not parsed by llama-bench. Where Q8_0 / Q4_K_M abort with
# GGML_ASSERT(*cur_backend_id != -1) (seen on an AMX CPU), turn them off at build time:
# -DGGML_CPU_REPACK=OFF, and leave AMX out of the target (the AMX type is compiled in only when the
# compiler targets AMX, e.g. -march=native on an AMX CPU: use GGML_NATIVE=OFF with the AVX-512 options).
# Say so next to the figures: they then understate llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${LLAMA_CPP_BUILD:?set LLAMA_CPP_BUILD to the llama.cpp build dir}"
: "${GGUF_DIR:?set GGUF_DIR to the dir with the Q8_0 / Q4_K_M GGUFs}"
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
PROMPT=${PROMPT:-512}
DECODE=${DECODE:-64}
LLAMA_DEPTH=${LLAMA_DEPTH:-$PROMPT}
LLAMA_ARGS=${LLAMA_ARGS:-}
GGUF_TYPES=${GGUF_TYPES:-"Q4_K_M Q8_0 BF16"}
GLM5_BUILD=${GLM5_BUILD:-build}
if [ -z "${GLM5_MODELS:-}" ]; then
  : "${MODEL_DIR:?set GLM5_MODELS (label=dir ...) or MODEL_DIR}"
  GLM5_MODELS="bf16=$MODEL_DIR"
fi

LLAMA_BENCH="$LLAMA_CPP_BUILD/bin/llama-bench"
[ -x "$LLAMA_BENCH" ] || LLAMA_BENCH="$LLAMA_CPP_BUILD/llama-bench"
[ -x "$LLAMA_BENCH" ] || { echo "no llama-bench under $LLAMA_CPP_BUILD" >&2; exit 1; }
[ -x "$GLM5_BUILD/bench_cpu" ] || { echo "no $GLM5_BUILD/bench_cpu (build the bench_cpu target)" >&2; exit 1; }

# A private copy of bench_cpu, so that a rebuild during the run cannot swap it (it links the project
# statically; shared libraries are the system's).
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
cp "$GLM5_BUILD/bench_cpu" "$D/bench_cpu"

# The GGUFs, by type.
declare -A GGUF
for t in $GGUF_TYPES; do
  for f in "$GGUF_DIR"/*"$t"*.gguf; do
    [ -f "$f" ] && GGUF[$t]=$f && break
  done
  [ -n "${GGUF[$t]:-}" ] || echo "note: no *$t*.gguf in $GGUF_DIR, skipped" >&2
done
[ ${#GGUF[@]} -gt 0 ] || { echo "no GGUF of types $GGUF_TYPES in $GGUF_DIR" >&2; exit 1; }
for pair in $GLM5_MODELS; do
  dir=${pair#*=}
  [ -f "$dir/config.json" ] || { echo "glm5 model $pair: no config.json" >&2; exit 1; }
done

cpu=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p')
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512|amx)' | sort | tr '\n' ' ')
echo "CPU: $cpu, $(nproc) cpus; $flags"
echo "glm5 $(git rev-parse --short HEAD 2> /dev/null || echo '?')$(git diff --quiet 2> /dev/null || echo ' (dirty tree)'), bench_cpu from $GLM5_BUILD"
echo "model: ${MODEL_DIR:-?}; GGUFs:$(for t in $GGUF_TYPES; do [ -z "${GGUF[$t]:-}" ] || printf ' %s' "${GGUF[$t]}"; done)"
echo "llama.cpp: $LLAMA_BENCH; llama-bench -t $THREADS -p 0 -n $DECODE -d $LLAMA_DEPTH -r 1 $LLAMA_ARGS"
echo "glm5: OMP_NUM_THREADS=$THREADS bench_cpu --model DIR --prompt $PROMPT --decode $DECODE --prefill-reps 0"
# shellcheck source=scripts/bench_load.sh
. scripts/bench_load.sh
load_start

# One line per sample: "<engine> <label> <round> <decode tok/s> [read GB/s]".
R="$D/results.txt"
: > "$R"
for round in $(seq 1 "$ROUNDS"); do
  for t in $GGUF_TYPES; do
    [ -n "${GGUF[$t]:-}" ] || continue
    # shellcheck disable=SC2086
    out=$("$LLAMA_BENCH" -m "${GGUF[$t]}" -t "$THREADS" -p 0 -n "$DECODE" -d "$LLAMA_DEPTH" -r 1 $LLAMA_ARGS \
      -o csv 2> "$D/llama.err") || { cat "$D/llama.err" >&2; echo "llama-bench failed on ${GGUF[$t]}" >&2; exit 1; }
    ts=$(printf '%s\n' "$out" | python3 -c 'import csv, sys; print(list(csv.DictReader(sys.stdin))[-1]["avg_ts"])')
    echo "llama.cpp $t $round $ts" >> "$R"
    echo "round $round: llama.cpp $t $ts tok/s"
  done
  for pair in $GLM5_MODELS; do
    label=${pair%%=*}
    dir=${pair#*=}
    out=$(OMP_NUM_THREADS=$THREADS "$D/bench_cpu" --model "$dir" --prompt "$PROMPT" --decode "$DECODE" --prefill-reps 0)
    ts=$(printf '%s\n' "$out" | sed -n 's/^decode  batch 1 ([a-z]* tokens): \([0-9.]*\) tok\/s.*/\1/p')
    bw=$(printf '%s\n' "$out" | sed -n 's/.*read bandwidth \([0-9.]*\) GB\/s.*/\1/p')
    [ -n "$ts" ] || { printf '%s\n' "$out" >&2; echo "bench_cpu gave no decode figure for $dir" >&2; exit 1; }
    echo "glm5 $label $round $ts $bw" >> "$R"
    echo "round $round: glm5 $label $ts tok/s (read bandwidth $bw GB/s)"
  done
done
load_report
echo

python3 - "$R" <<'PY'
import statistics, sys
samples = {}  # (engine, label) -> [tok/s]
bw = []
for line in open(sys.argv[1]):
    f = line.split()
    samples.setdefault((f[0], f[1]), []).append(float(f[3]))
    if len(f) > 4 and f[4]:
        bw.append(float(f[4]))
med = {k: statistics.median(v) for k, v in samples.items()}
print(f"| engine | weights | decode tok/s (median of {max(len(v) for v in samples.values())}) | samples |")
print("|---|---|---|---|")
for (engine, label), v in samples.items():
    print(f"| {engine} | {label} | {med[(engine, label)]:.2f} | {' '.join(f'{x:.2f}' for x in v)} |")
if bw:
    print(f"\nread bandwidth (bench_cpu, median of {len(bw)}): {statistics.median(bw):.1f} GB/s")
pairs = {"int4": "Q4_K_M", "int8": "Q8_0", "bf16": "BF16"}
lines = []
for (engine, label), m in med.items():
    peer = pairs.get(label)
    if engine == "glm5" and peer and ("llama.cpp", peer) in med:
        lines.append(f"  glm5 {label} / llama.cpp {peer}: {m / med[('llama.cpp', peer)]:.2f}x")
if lines:
    print("\nratios (medians):")
    print("\n".join(lines))
PY
