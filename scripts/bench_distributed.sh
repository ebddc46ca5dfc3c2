#!/usr/bin/env bash
# Distributed CPU benchmarks of glm5 under mpirun, each against a reference measured in the same run:
#   1. total CPU time (user+sys of mpirun and all ranks) and wall time of one batch job on the 2x2
#      layout (cluster-configs/cpu-pp2-ep2.yaml) over the 1x1 layout (cpu-1.yaml), with MPI
#      receivers busy-polling (mpi_yield_when_idle 0) and yielding (1); outputs must be identical;
#   2. bench_alltoall: MoeExchange dispatch+combine against plain MPI_Alltoallv, -np 2 and 4;
#   3. pipeline bubble on a 2-stage pipeline (cpu-pp2.yaml) with micro_batches 1 and 2, MPI
#      receivers busy-polling and yielding.
# Every number is the median of REPS runs (default 3), the layouts interleaved within a repetition.
#
#   scripts/bench_distributed.sh MODEL_DIR [BUILD_DIR]      (BUILD_DIR default: build)
#   env: REPS=3  SKIP_ALLTOALL=1  SKIP_BUBBLE=1  ALLTOALL_ARGS="--tokens 64,256,1024 --hidden 1024,6144"
#        REQUESTS=32  MAX_TOKENS=16 (the batch job's size)
# Needs glm5 and bench_alltoall built in BUILD_DIR, mpirun (Open MPI), /usr/bin/time and python3.
# The batch job: REQUESTS requests of token ids (prompts of 2 to 200 tokens), greedy, MAX_TOKENS
# tokens each, ignore_eos (every request generates them all whatever the weights).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
MODEL=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${2:-$ROOT/build}
REPS=${REPS:-3}
REQUESTS=${REQUESTS:-32}
MAX_TOKENS=${MAX_TOKENS:-16}
GLM5=$BUILD/glm5
A2A=$BUILD/bench_alltoall
for f in "$GLM5" "$MODEL/config.json"; do
  [[ -e $f ]] || { echo "bench_distributed: $f not found" >&2; exit 2; }
done
[[ -n ${SKIP_ALLTOALL:-} || -x $A2A ]] || { echo "bench_distributed: $A2A not found (build target bench_alltoall)" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/glm5-bench-dist.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
MPI=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader,tcp -x OMP_NUM_THREADS=1)

echo "== machine"
echo "cores: $(nproc), load average: $(cut -d' ' -f1-3 /proc/loadavg), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "memory: $(free -g | awk '/Mem:/ {print $2 " GiB total, " $7 " GiB available"}'), $(mpirun --version 2>&1 | head -1)"

# --- the batch job ---------------------------------------------------------------------------
python3 - "$MODEL/config.json" "$WORK/requests.jsonl" "$REQUESTS" "$MAX_TOKENS" <<'EOF'
import json, random, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
n_req, max_tokens = int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(7)
with open(sys.argv[2], "w") as f:
    for i in range(n_req):
        top = rng.choice([4, 16, 32, 64, 128, 200])
        n = rng.randint(max(2, top // 2), top)
        f.write(json.dumps({"custom_id": f"r{i:03d}", "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True,
                            "prompt_ids": [rng.randrange(min(vocab, 8000)) for _ in range(n)]}) + "\n")
EOF

# run_job NAME CLUSTER_YAML NP [extra mpirun args...]: one batch run; appends "NAME wall user sys"
# to $WORK/times and keeps the output and report as $WORK/NAME.{jsonl,json}.
run_job() {
  local name=$1 cluster=$2 np=$3
  shift 3
  rm -f "$WORK/$name.jsonl" "$WORK/$name.json"
  /usr/bin/time -o "$WORK/$name.time" -f "%e %U %S" "${MPI[@]}" "$@" -np "$np" "$GLM5" batch \
    --model "$MODEL" --input "$WORK/requests.jsonl" --output "$WORK/$name.jsonl" \
    --report "$WORK/$name.json" --cluster "$cluster" > "$WORK/$name.log" 2>&1 ||
    { echo "bench_distributed: run $name failed:" >&2; tail -20 "$WORK/$name.log" >&2; exit 1; }
  echo "$name $(cat "$WORK/$name.time")" >> "$WORK/times"
}

# same_tokens A B: the generated token ids of every request agree.
same_tokens() {
  python3 - "$WORK/$1.jsonl" "$WORK/$2.jsonl" "$REQUESTS" <<'EOF'
import json, sys
def load(p):
    out = {}
    for line in open(p):
        j = json.loads(line)
        out[j["custom_id"]] = j["response"]["body"]["choices"][0]["token_ids"]
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
sys.exit(0 if a == b and len(a) == int(sys.argv[3]) else 1)
EOF
}

# --- 1. CPU time of 2x2 over 1x1 ---------------------------------------------------------------
echo
echo "== 1. batch job ($REQUESTS requests, greedy, max_tokens $MAX_TOKENS): 2x2 (cpu-pp2-ep2) over 1x1 (cpu-1)"
: > "$WORK/times"
MISMATCH=0
for rep in $(seq 1 "$REPS"); do
  for y in 0 1; do
    run_job "y${y}_1x1_$rep" "$ROOT/cluster-configs/cpu-1.yaml" 1 --mca mpi_yield_when_idle "$y"
    run_job "y${y}_2x2_$rep" "$ROOT/cluster-configs/cpu-pp2-ep2.yaml" 4 --mca mpi_yield_when_idle "$y"
    same_tokens "y${y}_1x1_$rep" "y${y}_2x2_$rep" || MISMATCH=1
  done
done
python3 - "$WORK/times" "$REPS" "$MISMATCH" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, wall, user, sys_ = line.split()
    rows[name] = (float(wall), float(user), float(sys_))
reps = int(sys.argv[2])
print(f"{'yield':>5} {'layout':>6} {'wall_s':>7} {'user_s':>7} {'sys_s':>6} {'cpu_s':>6} | "
      f"{'cpu ratio':>9} {'wall ratio':>10}   (median of {reps}; ratios per repetition, then median)")
for y in (0, 1):
    med = {}
    for lay in ("1x1", "2x2"):
        r = [rows[f"y{y}_{lay}_{i}"] for i in range(1, reps + 1)]
        med[lay] = [statistics.median(x[k] for x in r) for k in range(3)]
    cr = statistics.median((rows[f"y{y}_2x2_{i}"][1] + rows[f"y{y}_2x2_{i}"][2]) /
                           (rows[f"y{y}_1x1_{i}"][1] + rows[f"y{y}_1x1_{i}"][2]) for i in range(1, reps + 1))
    wr = statistics.median(rows[f"y{y}_2x2_{i}"][0] / rows[f"y{y}_1x1_{i}"][0] for i in range(1, reps + 1))
    for lay in ("1x1", "2x2"):
        w, u, s = med[lay]
        tail = f"{cr:9.2f} {wr:10.2f}" if lay == "2x2" else ""
        print(f"{y:>5} {lay:>6} {w:7.2f} {u:7.2f} {s:6.2f} {u + s:6.2f} | {tail}")
print("outputs identical (token ids of all requests, every run):",
      "yes" if sys.argv[3] == "0" else "NO")
EOF
python3 - "$WORK" "$REPS" <<'EOF'
import json, statistics, sys
work, reps = sys.argv[1], int(sys.argv[2])
print("per-rank report of the 2x2 runs (yield 1, median over repetitions):")
print(f"{'rank':>4} {'stage':>5} {'col':>3} {'wall_s':>7} {'compute_s':>9} {'comm_s':>7} {'idle_s':>7} {'MB_sent':>8}")
runs = [json.load(open(f"{work}/y1_2x2_{i}.json"))["ranks"] for i in range(1, reps + 1)]
for k, r0 in enumerate(runs[0]):
    m = lambda key: statistics.median(run[k][key] for run in runs)
    print(f"{r0['rank']:>4} {r0['stage']:>5} {r0['column']:>3} {m('wall_s'):7.2f} {m('compute_s'):9.2f} "
          f"{m('comm_s'):7.2f} {m('idle_s'):7.3f} {m('bytes_sent') / 1e6:8.1f}")
one = [json.load(open(f"{work}/y1_1x1_{i}.json"))["ranks"][0] for i in range(1, reps + 1)]
m = lambda key: statistics.median(r[key] for r in one)
print(f"1x1: wall_s {m('wall_s'):.2f}, compute_s {m('compute_s'):.2f}, comm_s (MoE exchange copies) {m('comm_s'):.2f}")
EOF

# --- 2. MoE exchange against MPI_Alltoallv ----------------------------------------------------
if [[ -z ${SKIP_ALLTOALL:-} ]]; then
  echo
  echo "== 2. bench_alltoall (MoeExchange dispatch+combine vs two MPI_Alltoallv of one row per slot each way)"
  for np in 2 4; do
    "${MPI[@]}" -np "$np" "$A2A" --reps "$REPS" ${ALLTOALL_ARGS:-}
  done
fi

# --- 3. pipeline bubble ---------------------------------------------------------------------
if [[ -n ${SKIP_BUBBLE:-} ]]; then
  echo
  echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
  exit 0
fi
echo
echo "== 3. pipeline bubble, 2 stages x 1 (cpu-pp2 with micro_batches 1 and 2), same batch job"
for mb in 1 2; do
  sed "s/^micro_batches:.*/micro_batches: $mb/" "$ROOT/cluster-configs/cpu-pp2.yaml" > "$WORK/pp2-mb$mb.yaml"
  grep -q "^micro_batches: $mb\$" "$WORK/pp2-mb$mb.yaml" || echo "micro_batches: $mb" >> "$WORK/pp2-mb$mb.yaml"
done
: > "$WORK/times"
MISMATCH=0
for rep in $(seq 1 "$REPS"); do
  run_job "ref_1x1_$rep" "$ROOT/cluster-configs/cpu-1.yaml" 1
  for y in 0 1; do
    for mb in 1 2; do
      run_job "pp2_y${y}_mb${mb}_$rep" "$WORK/pp2-mb$mb.yaml" 2 --mca mpi_yield_when_idle "$y"
      same_tokens "ref_1x1_$rep" "pp2_y${y}_mb${mb}_$rep" || MISMATCH=1
    done
  done
done
python3 - "$WORK" "$REPS" "$MISMATCH" <<'EOF'
import json, statistics, sys
work, reps = sys.argv[1], int(sys.argv[2])
times = {l.split()[0]: [float(x) for x in l.split()[1:]] for l in open(f"{work}/times")}
print("idle = idle_s / wall_s as reported; wait = 1 - compute_s / wall_s (idle + time in blocking"
      " receives and sends); medians of", reps)
print(f"{'yield':>5} {'micro_batches':>13} {'rank':>4} {'wall_s':>7} {'compute_s':>9} {'comm_s':>7} "
      f"{'idle':>6} {'wait':>6} | {'job wall_s':>10} {'job cpu_s':>9} {'wall / 1x1':>10}")
for y in (0, 1):
    for mb in (1, 2):
        name = lambda i: f"pp2_y{y}_mb{mb}_{i}"
        runs = [json.load(open(f"{work}/{name(i)}.json"))["ranks"] for i in range(1, reps + 1)]
        jw = statistics.median(times[name(i)][0] for i in range(1, reps + 1))
        jc = statistics.median(sum(times[name(i)][1:]) for i in range(1, reps + 1))
        ratio = statistics.median(times[name(i)][0] / times[f"ref_1x1_{i}"][0] for i in range(1, reps + 1))
        for k in range(len(runs[0])):
            m = lambda f: statistics.median(f(run[k]) for run in runs)
            tail = f" | {jw:10.2f} {jc:9.2f} {ratio:10.2f}" if k == 0 else ""
            print(f"{y:>5} {mb:>13} {k:>4} {m(lambda r: r['wall_s']):7.2f} "
                  f"{m(lambda r: r['compute_s']):9.2f} {m(lambda r: r['comm_s']):7.2f} "
                  f"{m(lambda r: r['idle_s'] / r['wall_s']):6.3f} "
                  f"{m(lambda r: 1 - r['compute_s'] / r['wall_s']):6.3f}{tail}")
ref = [times[f"ref_1x1_{i}"] for i in range(1, reps + 1)]
print(f"1x1 reference: wall_s {statistics.median(r[0] for r in ref):.2f}, "
      f"cpu_s {statistics.median(r[1] + r[2] for r in ref):.2f}")
print("outputs identical to 1x1 (every run):", "yes" if sys.argv[3] == "0" else "NO")
EOF

echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
