#!/usr/bin/env bash
# Builds and runs the libFuzzer targets of tests/fuzz (clang, AddressSanitizer + UndefinedBehavior-
# Sanitizer, libFuzzer coverage on every library): replays the corpora, fuzzes, keeps what it finds.
#
# usage: scripts/fuzz.sh [--build DIR] [--work DIR] [--seconds S] [--replay] [--merge] [TARGET...]
#   --build DIR   the sanitizer build (default build-sanitize in the repository; configured as
#                 scripts/sanitize.sh does when missing, and the targets brought up to date)
#   --work DIR    the campaign's folder (default $TMPDIR/glm5-fuzz): seeds made from tests/data,
#                 the growing corpora, findings (crash-*, leak-*, timeout-*, oom-*), and
#                 fuzz-time.tsv (one line per run: target, seconds, inputs executed, exit status)
#   --seconds S   fuzz each target for S seconds (default 60); 0 only replays
#   --replay      replay every corpus input and seed once, no fuzzing (what CI runs first)
#   --merge       afterwards, merge what a run found into tests/fuzz/corpus/<target> (inputs that
#                 add coverage), so the next run and CI start from it
#   TARGET        fuzz_config, fuzz_safetensors, ... (default: every tests/fuzz/fuzz_*.cpp)
# Exit status: 0 when nothing was found, 1 when a target crashed, leaked, hung or broke a property
# (its input is in WORK/findings and the log names it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build-sanitize work=${TMPDIR:-/tmp}/glm5-fuzz seconds=60 replay=0 merge=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$(realpath -m "${2:?}"); shift 2 ;;
    --work) work=$(realpath -m "${2:?}"); shift 2 ;;
    --seconds) seconds=${2:?}; shift 2 ;;
    --replay) replay=1; shift ;;
    --merge) merge=1; shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option '$1'" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ ${#targets[@]} = 0 ]; then
  for f in "$root"/tests/fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi

[ -f "$build/CMakeCache.txt" ] || "$root/scripts/sanitize.sh" --configure-only "$build"
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

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

# Longest input per target: the seeds' size, so a corpus stays small enough to fuzz fast.
max_len() {
  case "$1" in
    fuzz_tokenizer_json|fuzz_checkpoint_index) echo 32768 ;;
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
  mine=$work/corpus/$t kept=$root/tests/fuzz/corpus/$t
  mkdir -p "$mine" "$kept"
  log=$work/logs/$t.log
  common=(-rss_limit_mb=2048 -timeout=10 -max_len="$(max_len "$t")" -artifact_prefix="$work/findings/$t-")
  if [ "$replay" = 1 ] || [ "$seconds" = 0 ]; then
    # Every kept input and seed once (-runs=0: the initial corpus, no mutations).
    if "$bin" "${common[@]}" -runs=0 "$mine" "$kept" "$work/seeds/$t" >"$log" 2>&1; then
      echo "fuzz.sh: $t: replayed $(grep -o 'INITED.*' "$log" | head -1)"
    else
      status=1; echo "fuzz.sh: $t: FAILED on replay; see $log" >&2; tail -n 30 "$log" >&2
    fi
    continue
  fi
  start=$(date +%s)
  rc=0
  "$bin" "${common[@]}" -max_total_time="$seconds" -print_final_stats=1 "$mine" "$kept" "$work/seeds/$t" \
    >"$log" 2>&1 || rc=$?
  took=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  printf '%s\t%s\t%s\t%s\t%s\n' "$t" "$took" "${execs:-0}" "$rc" "$(date -u +%FT%TZ)" >>"$work/fuzz-time.tsv"
  if [ "$rc" != 0 ]; then
    status=1; echo "fuzz.sh: $t: FINDING after ${took}s (exit $rc); see $log" >&2; tail -n 40 "$log" >&2
  else
    echo "fuzz.sh: $t: ${took}s, ${execs:-?} inputs, nothing found"
  fi
  if [ "$merge" = 1 ]; then
    "$bin" -merge=1 -max_len="$(max_len "$t")" "$kept" "$mine" >"$work/logs/$t.merge.log" 2>&1 ||
      echo "fuzz.sh: $t: merge failed; see $work/logs/$t.merge.log" >&2
  fi
done
exit $status
