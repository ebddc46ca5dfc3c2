#!/usr/bin/env bash
# Conversion at scale: `glm5 convert` on a checkpoint bigger than half the machine's RAM.
#
#   scripts/bench_convert.sh BIG_MODEL_DIR WORK_DIR
#
#   (a) int4: /usr/bin/time -v glm5 convert --quant int4 --no-progress -> wall time, peak RSS, GB in/out
#   (b) the same conversion into a second directory, SIGKILLed when its output reaches about half of
#       (a)'s, then rerun to completion (resume); every output file compared byte for byte with (a)'s
#   (c) fp8: as (a)
# and the largest single tensor of the input (peak RSS should be a few tensors, not the checkpoint).
#
# BIG_MODEL_DIR: a BF16 checkpoint; when it does not exist it is made with
#   python3 scripts/gen_big_checkpoint.py --out BIG_MODEL_DIR (about 14.5 GB) and removed at the end.
# WORK_DIR: outputs (removed at the end unless KEEP=1). GLM5=binary (default build/glm5; copy it
# elsewhere first if it may be rebuilt meanwhile). The report goes to stdout and WORK_DIR/report.md.
set -euo pipefail

BIG=${1:?usage: $0 BIG_MODEL_DIR WORK_DIR}
WORK=${2:?usage: $0 BIG_MODEL_DIR WORK_DIR}
GLM5=${GLM5:-build/glm5}
KEEP=${KEEP:-0}
HERE=$(cd "$(dirname "$0")" && pwd)
[[ -x $GLM5 ]] || { echo "no glm5 binary at $GLM5 (set GLM5=...)" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "needs GNU time at /usr/bin/time" >&2; exit 1; }
mkdir -p "$WORK"
REPORT=$WORK/report.md
: > "$REPORT"
say() { echo "$*" | tee -a "$REPORT"; }

GENERATED=0
if [[ ! -d $BIG ]]; then
  say "generating $BIG: python3 $HERE/gen_big_checkpoint.py --out $BIG"
  start=$(date +%s)
  python3 "$HERE/gen_big_checkpoint.py" --out "$BIG" | tail -1 | tee -a "$REPORT"
  say "generator wall time: $(($(date +%s) - start)) s"
  GENERATED=1
fi

gb() { du -sb --apparent-size "$@" | awk '{s += $1} END {printf "%.3f", s / 1e9}'; }
shard_bytes() { find "$1" -maxdepth 1 -name '*.safetensors' -printf '%s\n' | awk '{s += $1} END {printf "%.0f", s}'; }

# Largest tensors of the input, from the safetensors headers.
python3 - "$BIG" <<'EOF' | tee -a "$REPORT"
import json, os, struct, sys
d = sys.argv[1]
sizes = {}
for f in os.listdir(d):
    if f.endswith(".safetensors"):
        with open(os.path.join(d, f), "rb") as h:
            n = struct.unpack("<Q", h.read(8))[0]
            for k, v in json.loads(h.read(n)).items():
                if k != "__metadata__":
                    sizes[k] = (v["data_offsets"][1] - v["data_offsets"][0], v["dtype"], v["shape"])
big = max(sizes, key=lambda k: sizes[k][0])
exp = max((k for k in sizes if ".mlp.experts." in k), key=lambda k: sizes[k][0], default=None)
print(f"input: {len(sizes)} tensors, {sum(s[0] for s in sizes.values()) / 1e9:.3f} GB of tensor data")
print(f"largest tensor: {big} {sizes[big][1]} {sizes[big][2]} = {sizes[big][0] / 2**20:.1f} MiB")
if exp:
    print(f"largest expert matrix (what int4/fp8 convert by default): {exp} {sizes[exp][1]} {sizes[exp][2]} "
          f"= {sizes[exp][0] / 2**20:.1f} MiB ({2 * sizes[exp][0] / 2**20:.1f} MiB as float32)")
EOF
IN_GB=$(gb "$BIG")
say "input directory: $IN_GB GB"

# run_timed NAME OUT ARGS...: /usr/bin/time -v glm5 convert, then the numbers.
run_timed() {
  local name=$1 out=$2
  shift 2
  /usr/bin/time -v "$GLM5" convert --model "$BIG" --out "$out" --no-progress "$@" > "$WORK/$name.log" 2>&1 || {
    cat "$WORK/$name.log" >&2; echo "$name: convert failed" >&2; exit 1; }
  local wall rss usr sys
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$WORK/$name.log")
  rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$WORK/$name.log")
  usr=$(awk -F': ' '/User time/ {print $2}' "$WORK/$name.log")
  sys=$(awk -F': ' '/System time/ {print $2}' "$WORK/$name.log")
  say "$name: wall $wall, peak RSS $((rss / 1024)) MB ($rss KB), user ${usr}s sys ${sys}s, in $IN_GB GB -> out $(gb "$out") GB"
  grep '^\[convert\]' "$WORK/$name.log" | tee -a "$REPORT"
}

# (a) int4
OUT1=$WORK/int4-a
OUT2=$WORK/int4-b
rm -rf "$OUT1" "$OUT2"
say ""
say "## (a) int4"
run_timed int4-a "$OUT1" --quant int4

# (b) kill at about half, resume, compare
say ""
say "## (b) int4, SIGKILL at about half, then resumed"
target=$(($(shard_bytes "$OUT1") / 2))
"$GLM5" convert --model "$BIG" --out "$OUT2" --quant int4 --no-progress > "$WORK/int4-b-killed.log" 2>&1 &
pid=$!
now=0
while kill -0 "$pid" 2> /dev/null; do
  now=$(du -sb --apparent-size "$OUT2" 2> /dev/null | awk '{print $1}' || true)
  now=${now:-0}
  ((now >= target)) && break
  sleep 0.1
done
if kill -KILL "$pid" 2> /dev/null; then
  wait "$pid" 2> /dev/null || true
  say "killed pid $pid (SIGKILL) at $now of $((target * 2)) bytes ($(awk -v a="$now" -v b="$target" 'BEGIN {printf "%.0f", 50 * a / b}') %); left behind:"
  find "$OUT2" -mindepth 1 -maxdepth 1 -printf '    %s  %f\n' | sort -k2 | tee -a "$REPORT"
else
  say "WARNING: the conversion finished before it could be killed"
fi
run_timed int4-b-resumed "$OUT2" --quant int4
same=yes
if ! diff <(cd "$OUT1" && find . -type f | sort) <(cd "$OUT2" && find . -type f | sort) > "$WORK/files.diff"; then
  same=no
  say "file lists differ:"; tee -a "$REPORT" < "$WORK/files.diff"
fi
n=0
while IFS= read -r f; do
  n=$((n + 1))
  if ! cmp -s "$OUT1/$f" "$OUT2/$f"; then same=no; say "DIFFERS: $f"; fi
done < <(cd "$OUT1" && find . -type f | sort)
say "compared $n files byte for byte (cmp): identical = $same"
[[ $KEEP == 1 ]] || rm -rf "$OUT1" "$OUT2"

# (c) fp8
say ""
say "## (c) fp8"
OUT3=$WORK/fp8-a
rm -rf "$OUT3"
run_timed fp8-a "$OUT3" --quant fp8
[[ $KEEP == 1 ]] || rm -rf "$OUT3"

if [[ $GENERATED == 1 && $KEEP != 1 ]]; then rm -rf "$BIG"; say "removed $BIG"; fi
[[ $same == yes ]]
