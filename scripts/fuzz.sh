#!/usr/bin/env bash
# Builds and runs the libFuzzer targets of tests/fuzz (clang, AddressSanitizer + UndefinedBehavior-
# Sanitizer, libFuzzer coverage on every library): replays the corpora, fuzzes, keeps what it finds.
#
# usage: scripts/fuzz.sh [--build DIR] [--work DIR] [--seconds S] [--replay] [--merge] [TARGET...]
#   --build DIR   the sanitizer build (default build-sanitize in the repository; configured as
#                 scripts/sanitize.sh does when missing, and the targets brought up to date)
#   --work DIR    the campaign's folder (default $TMPDIR/glm5-fuzz): seeds made from tests/data,
#                 the growing corpora, findings (crash-*, leak-*, timeout-*, oom-*), and
#                 fuzz-time.tsv (one line per run: target, wall seconds, CPU seconds, inputs
#                 executed, exit status, end time)
#   --seconds S   fuzz each target for S seconds (default 60); 0 only replays
#   --replay      replay every corpus input and seed once, no fuzzing (what CI runs first)
#   --summary     print each target's totals from WORK/fuzz-time.tsv (runs, CPU minutes, inputs,
#                 findings) and exit
#   --seed N      libFuzzer's random seed (default: a new one each run); a fixed one repeats a run
#   --merge       afterwards, merge what a run found (inputs that add coverage) into
#                 tests/fuzz/corpus/found/<target>.tar.gz, so the next run and CI start from it
#   TARGET        fuzz_config, fuzz_safetensors, ... (default: every tests/fuzz/fuzz_*.cpp)
# Exit status: 0 when nothing was found, 1 when a target crashed, leaked, hung or broke a property
# (its input is in WORK/findings and the log names it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build-sanitize work=${TMPDIR:-/tmp}/glm5-fuzz seconds=60 replay=0 merge=0 summary=0 seed=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$(realpath -m "${2:?}"); shift 2 ;;
    --work) work=$(realpath -m "${2:?}"); shift 2 ;;
    --seconds) seconds=${2:?}; shift 2 ;;
    --replay) replay=1; shift ;;
    --merge) merge=1; shift ;;
    --summary) summary=1; shift ;;
    --seed) seed=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option '$1'" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ "$summary" = 1 ]; then
  printf '%-24s %5s %9s %13s %9s\n' target runs CPU-min inputs findings
  awk -F'\t' '{ cpu[$1] += $3; n[$1]++; ex[$1] += $4; if ($5 != 0) bad[$1]++ }
    END { for (t in n) printf "%-24s %5d %9.1f %13d %9d\n", t, n[t], cpu[t] / 60, ex[t], bad[t] }' \
    "$work/fuzz-time.tsv" | sort
  exit 0
fi
if [ ${#targets[@]} = 0 ]; then
  for f in "$root"/tests/fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi

# One configure and build at a time: campaigns run several fuzz.sh at once on disjoint targets of
# one build.
mkdir -p "$build"
flock "$build/.fuzz-build.lock" sh -c '[ -f "$1/CMakeCache.txt" ] || "$2/scripts/sanitize.sh" --configure-only "$1"' \
  sh "$build" "$root"
flock "$build/.fuzz-build.lock" cmake --build "$build" -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" --target "${targets[@]}"

# Seeds from the repository's own inputs, so every target starts from what users really write.
seed() {
  local t=$1 d=$work/seeds/$1
  rm -rf "$d" && mkdir -p "$d"
  case "$t" in
    fuzz_config) for f in "$root"/tests/data/*/config.json; do cp "$f" "$d/$(basename "$(dirname "$f")")"; done ;;
    fuzz_checkpoint_index)
      for f in "$root"/tests/data/*/model.safetensors.index.json; do cp "$f" "$d/$(basename "$(dirname "$f")")"; done ;;
    fuzz_tokenizer_json)
      cp "$root"/tests/data/tokenizer/variants/*.json "$d/" ;;
    fuzz_cluster_yaml) cp "$root"/cluster-configs/*.yaml "$d/" ;;
    fuzz_hardware_yaml) cp "$root"/cluster-configs/hardware/*.yaml "$d/" ;;
    fuzz_batch_line)
      awk 'NR <= 60' "$root"/tests/data/example-batch.jsonl "$root"/tests/data/batch/*.jsonl | split -l 1 - "$d/line-" ;;
    fuzz_tokenizer_text)
      python3 -c 'import json,sys
for i, line in enumerate(open(sys.argv[1], encoding="utf-8")):
    if i >= 200: break
    open(f"{sys.argv[2]}/text-{i}", "wb").write(json.loads(line)["text"].encode("utf-8", "surrogatepass"))' \
        "$root/tests/data/tokenizer/deepseek_v3_reference.jsonl" "$d" ;;
  esac
}

# Longest input per target: above its largest seed (tests/data's indexes reach 94 KB, GLM-5's
# config.json 36 KB), small enough elsewhere that mutations stay fast.
max_len() {
  case "$1" in
    fuzz_checkpoint_index) echo 131072 ;;
    fuzz_config|fuzz_tokenizer_json) echo 65536 ;;
    *) echo 8192 ;;
  esac
}

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$work/findings" "$work/logs"
status=0
for t in "${targets[@]}"; do
  bin=$build/fuzz/$t
  seed "$t"
  mine=$work/corpus/$t kept=$root/tests/fuzz/corpus/$t found=$work/found/$t
  tarball=$root/tests/fuzz/corpus/found/$t.tar.gz
  mkdir -p "$mine" "$kept"
  rm -rf "$found" && mkdir -p "$found"
  [ ! -f "$tarball" ] || tar -xzf "$tarball" -C "$found"
  log=$work/logs/$t.log
  common=(-rss_limit_mb=2048 -timeout=10 -max_len="$(max_len "$t")" -artifact_prefix="$work/findings/$t-")
  [ "$seed" = 0 ] || common+=(-seed="$seed")
  if [ "$replay" = 1 ] || [ "$seconds" = 0 ]; then
    # Every kept input and seed once (-runs=0: the initial corpus, no mutations).
    if "$bin" "${common[@]}" -runs=0 "$mine" "$kept" "$found" "$work/seeds/$t" >"$log" 2>&1; then
      echo "fuzz.sh: $t: replayed $(grep -o 'INITED.*' "$log" | head -1)"
    else
      status=1; echo "fuzz.sh: $t: FAILED on replay; see $log" >&2; tail -n 30 "$log" >&2
    fi
    continue
  fi
  start=$(date +%s)
  rc=0
  TIMEFORMAT='%U %S'  # the target's own CPU time (user, system): what the campaign's figures count
  { time "$bin" "${common[@]}" -max_total_time="$seconds" -print_final_stats=1 "$mine" "$kept" "$found" \
      "$work/seeds/$t" >"$log" 2>&1; } 2>"$work/logs/$t.cpu" || rc=$?
  took=$(( $(date +%s) - start ))
  cpu=$(awk '{ printf "%d", $1 + $2 }' "$work/logs/$t.cpu")
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$took" "$cpu" "${execs:-0}" "$rc" "$(date -u +%FT%TZ)" \
    >>"$work/fuzz-time.tsv"
  if [ "$rc" != 0 ]; then
    status=1; echo "fuzz.sh: $t: FINDING after ${took}s (exit $rc); see $log" >&2; tail -n 40 "$log" >&2
  else
    echo "fuzz.sh: $t: ${took}s (${cpu} CPU-s), ${execs:-?} inputs, nothing found"
  fi
  if [ "$merge" = 1 ]; then
    # The inputs that add coverage to what the repository keeps, packed reproducibly (sorted names,
    # no times or owners), so the next run and CI start from them.
    if "$bin" -merge=1 -max_len="$(max_len "$t")" "$found" "$mine" >"$work/logs/$t.merge.log" 2>&1; then
      mkdir -p "$(dirname "$tarball")"
      tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$found" -cf - . | gzip -n >"$tarball"
    else
      echo "fuzz.sh: $t: merge failed; see $work/logs/$t.merge.log" >&2
    fi
  fi
done
exit $status
