#!/usr/bin/env bash
# Validation of `glm5 simulate` on this CPU: calibrates the machine (glm5 simulate --calibrate),
# then for 6 layouts (1x1, 2x1, 1x2, 2x2, 4x1, 1x4; P stages x E expert-parallel, micro_batches = P)
# and 2 workloads (decode-heavy and prefill-heavy) runs the real batch job under mpirun and the
# simulator, and prints measured vs predicted generated tokens/s with the error. Writes
# OUT_DIR/validation.csv and the 2x2 run's profiled report (OUT_DIR/profile-2x2.json) for
# scripts/plot_scaling.py.
#
#   scripts/bench_simulate.sh MODEL_DIR OUT_DIR [BUILD_DIR]        (BUILD_DIR default: build)
#   env: REPS=2 (measured runs per case, median)  WORKLOADS="decode=prompts=16,in=32,out=48 prefill=prompts=8,in=512,out=4"
#        LAYOUTS="1x1 2x1 1x2 2x2 4x1 1x4"
# Measured: generated tokens (summed over the columns' stage-0 ranks) / the longest rank's engine
# wall time in the batch --report. Needs mpirun (Open MPI) and python3.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
MODEL=$1
OUT=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${3:-$ROOT/build}
REPS=${REPS:-2}
WORKLOADS=${WORKLOADS:-"decode=prompts=16,in=32,out=48 prefill=prompts=8,in=512,out=4"}
LAYOUTS=${LAYOUTS:-"1x1 2x1 1x2 2x2 4x1 1x4"}
GLM5=$BUILD/glm5
for f in "$GLM5" "$MODEL/config.json"; do
  [[ -e $f ]] || { echo "bench_simulate: $f not found" >&2; exit 2; }
done
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/glm5-bench-sim.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# shellcheck source=scripts/bench_load.sh
source "$ROOT/scripts/bench_load.sh"
unset OMP_NUM_THREADS  # each rank takes cores / ranks-on-host threads, as the simulator assumes
MPI=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader,tcp --bind-to none)  # as glm5 launch runs it

echo "== machine"
echo "cores: $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(mpirun --version 2>&1 | head -1)"
load_start

# Requests: random token ids, greedy, ignore_eos (every request generates exactly `out` tokens).
for wl in $WORKLOADS; do
  name=${wl%%=*}
  spec=${wl#*=}
  python3 - "$MODEL/config.json" "$WORK/$name.jsonl" "$spec" <<'PY'
import json, random, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
w = dict(kv.split("=") for kv in sys.argv[3].split(","))
rng = random.Random(11)
with open(sys.argv[2], "w") as f:
    for i in range(int(w["prompts"])):
        f.write(json.dumps({"custom_id": f"r{i:04d}", "max_tokens": int(w["out"]), "temperature": 0,
                            "ignore_eos": True,
                            "prompt_ids": [rng.randrange(min(vocab, 30000)) for _ in range(int(w["in"]))]}) + "\n")
PY
done
for lay in $LAYOUTS; do
  P=${lay%x*}
  E=${lay#*x}
  printf 'stages: %s\nexpert_parallel: %s\nmicro_batches: %s\nbackend: cpu\n' "$P" "$E" "$P" > "$WORK/$lay.yaml"
done

# quiet CMD...: runs CMD until no other process took more than 5 % of the CPUs meanwhile (up to 8
# tries, 10 s apart): OpenMP ranks lose whole barriers to one descheduled thread, so a disturbed
# run says nothing. Returns CMD's status.
quiet() {
  local try hz j0 o0 t0 others wall rc
  hz=$(getconf CLK_TCK)
  for try in 1 2 3 4 5 6 7 8; do
    j0=$(busy_jiffies) o0=$(own_jiffies) t0=$(date +%s%N)
    rc=0
    "$@" || rc=$?
    [ "$rc" = 0 ] || return "$rc"
    others=$(( $(busy_jiffies) - j0 - ($(own_jiffies) - o0) ))
    wall=$(( ($(date +%s%N) - t0) / 10000000 ))  # hundredths of a second
    if [ $((others * 100 * 20)) -le $((wall * hz * $(nproc))) ]; then return 0; fi
    echo "  other processes took $((others * 100 / hz)) cs of CPU in $wall cs; again (try $try)" >&2
    sleep 10
  done
  echo "  WARNING: no undisturbed run in 8 tries; keeping the last" >&2
}

echo
echo "== calibration (glm5 simulate --calibrate --model MODEL: its expert shape)"
quiet "$GLM5" simulate --calibrate --model "$MODEL" --out "$OUT/hardware-cpu.yaml" > "$WORK/calibrate.log" 2>&1
grep -v '^#' "$OUT/hardware-cpu.yaml"

# one_batch LAYOUT WORKLOAD TAG [extra glm5 args]: one batch run from scratch (a rerun would resume).
one_batch() {
  local lay=$1 wl=$2 tag=$3
  shift 3
  local P=${lay%x*} E=${lay#*x}
  rm -f "$WORK/$tag.out" "$WORK/$tag.json"
  "${MPI[@]}" -np $((P * E)) "$GLM5" batch --model "$MODEL" --cluster "$WORK/$lay.yaml" --input "$WORK/$wl.jsonl" \
    --output "$WORK/$tag.out" --report "$WORK/$tag.json" "$@" > "$WORK/$tag.log" 2>&1
}
# run_batch LAYOUT WORKLOAD REP [extra glm5 args]: one measured (undisturbed) run, its report kept.
run_batch() {
  local lay=$1 wl=$2 rep=$3
  shift 3
  quiet one_batch "$lay" "$wl" "$lay-$wl-$rep" "$@" ||
    { echo "bench_simulate: $lay-$wl-$rep failed:" >&2; tail -20 "$WORK/$lay-$wl-$rep.log" >&2; exit 1; }
}

echo
echo "== measured runs ($REPS per case, layouts interleaved)"
for rep in $(seq 1 "$REPS"); do
  for wl in $WORKLOADS; do
    for lay in $LAYOUTS; do
      run_batch "$lay" "${wl%%=*}" "$rep"
    done
  done
done
run_batch 2x2 "$(echo "$WORKLOADS" | cut -d' ' -f1 | cut -d= -f1)" profile --profile
cp "$WORK/2x2-$(echo "$WORKLOADS" | cut -d' ' -f1 | cut -d= -f1)-profile.json" "$OUT/profile-2x2.json"
load_report

echo
echo "== predictions (glm5 simulate --hardware $OUT/hardware-cpu.yaml, uniform routing)"
for wl in $WORKLOADS; do
  for lay in $LAYOUTS; do
    "$GLM5" simulate --model "$MODEL" --cluster "$WORK/$lay.yaml" --workload "${wl#*=}" \
      --hardware "$OUT/hardware-cpu.yaml" --json "$WORK/pred-$lay-${wl%%=*}.json" > "$WORK/pred-$lay-${wl%%=*}.txt"
  done
done

python3 - "$WORK" "$OUT/validation.csv" "$REPS" "$LAYOUTS" "$WORKLOADS" <<'PY'
import json, statistics, sys
work, csv, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
layouts, workloads = sys.argv[4].split(), [w.split("=", 1) for w in sys.argv[5].split()]
def measured(path):
    r = json.load(open(path))["ranks"]
    gen = sum(x["tokens_generated"] for x in r if x["stage"] == 0)
    return gen / max(x["wall_s"] for x in r)
rows, errs = [], []
print(f"| layout | workload | measured tok/s (median of {reps}) | predicted tok/s | error |")
print("|---|---|---|---|---|")
for name, spec in workloads:
    for lay in layouts:
        m = statistics.median(measured(f"{work}/{lay}-{name}-{i}.json") for i in range(1, reps + 1))
        p = json.load(open(f"{work}/pred-{lay}-{name}.json"))["generated_tokens_per_s"]
        e = (p - m) / m
        errs.append(abs(e))
        rows.append((lay, name, spec, m, p, e))
        print(f"| {lay} | {name} ({spec}) | {m:.1f} | {p:.1f} | {100 * e:+.1f} % |")
print(f"\nmean |error| {100 * statistics.mean(errs):.1f} %, max |error| {100 * max(errs):.1f} %, "
      f"{sum(e <= 0.25 for e in errs)} of {len(errs)} cases within 25 %")
with open(csv, "w") as f:
    f.write("layout,workload,spec,measured_tok_s,predicted_tok_s,error\n")
    for lay, name, spec, m, p, e in rows:
        f.write(f"{lay},{name},\"{spec}\",{m:.3f},{p:.3f},{e:.4f}\n")
PY
