#!/usr/bin/env bash
# The sanitizer build: clang with AddressSanitizer + UndefinedBehaviorSanitizer (any report ends the
# process with an error) and libFuzzer's coverage on every library, so that the same build holds the
# unit tests, glm5 itself and the fuzz targets of tests/fuzz. Runs the tests under it, then replays
# every fuzz corpus and fuzzes each target briefly (scripts/fuzz.sh).
#
# usage: scripts/sanitize.sh [--quick | --thread] [--configure-only] [--fuzz-seconds S] [BUILD_DIR]
#   BUILD_DIR         default build-sanitize in the repository (build-tsan with --thread)
#   --quick           what CI runs: every test of the four test binaries (the layouts and signals
#                     run glm5 under mpirun), the MPI tests (1-4 ranks) and the watchdog job, each
#                     binary in one process; without ctest's extra suites (the same tests on other
#                     kernel paths), the Python serve suites and netns
#   --thread          ThreadSanitizer instead, for the threads glm5 runs beside the engine: the
#                     HTTP server's (the serve_api and serve_load suites: many clients, streams,
#                     disconnects, drains), the batch input reader and the signal handling of
#                     serve and batch under mpirun (test_launcher's Signals.*, Batch.*, Jobs.*)
#   --configure-only  configure BUILD_DIR and stop (scripts/fuzz.sh uses it)
#   --fuzz-seconds S  each target runs its whole corpus, then fuzzes from a fixed seed (so that a run
#                     repeats) until S seconds have passed since it started (default 10; 0: the
#                     corpus only)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="" quick=0 thread=0 configure_only=0 fuzz_seconds=10
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1; shift ;;
    --thread) thread=1; shift ;;
    --configure-only) configure_only=1; shift ;;
    --fuzz-seconds) fuzz_seconds=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "sanitize.sh: unknown option '$1'" >&2; exit 2 ;;
    *) build=$(realpath -m "$1"); shift ;;
  esac
done

# The cores to use (nproc counts OMP_NUM_THREADS, which the runs below set to 1, and OMP_THREAD_LIMIT).
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
[ "$quick$thread" != 11 ] || { echo "sanitize.sh: --quick and --thread are two different builds; pick one" >&2; exit 2; }
[ -n "$build" ] || build=$root/$([ "$thread" = 1 ] && echo build-tsan || echo build-sanitize)

# -O1 and line tables only: the build takes half the time of -O2 -g, and reports still name the
# file and line of every frame.
flags="-O1 -gline-tables-only -fno-omit-frame-pointer -fsanitize=address,undefined,fuzzer-no-link"
flags="$flags -fno-sanitize-recover=undefined"
# The kernels (kernels/) without four UBSan checks, for speed: with them a model forward in the
# hot loops runs 5x slower and the two gemm files take 75 s each to compile. What is given up:
# pointer-overflow (address wraparound, an offset on a null pointer), alignment (typed loads from
# misaligned addresses), null (a null dereference, which ASan still reports when it reads or
# writes memory) and object-size (ASan's shadow memory finds those reads past an object too).
# Shifts, signed overflow, float-to-int conversions (quantization), array bounds and the rest stay.
kernels_flags="-fno-sanitize=pointer-overflow,alignment,null,object-size"
# The test drivers (tests/, not the libraries they test) at -O0 and without the fuzzers' coverage:
# they were 427 of the build's 1,030 CPU-seconds; their own code compares results, emulates a few
# kernels in scalar code and starts processes.
tests_flags="-O0;-fno-sanitize=fuzzer-no-link"
launcher_flags=""
test_sources=""
fuzz=ON
if [ "$thread" = 1 ]; then
  flags="-O1 -gline-tables-only -fno-omit-frame-pointer -fsanitize=thread"
  # The kernels uninstrumented: they run on the engine's thread only (one OpenMP thread here), on
  # buffers no other thread touches, and their loops are most of the run time.
  # The launcher (launcher/: commands, HTTP server, JSON, YAML) at -O0: it is most of this build
  # (a Boost.Beast file: 50 s at -O1, 22 s at -O0). (Not in the ASan build: there its tests ran
  # 140 s longer than the 70 s it saved, and its fuzz targets 12x fewer inputs a second.)
  fuzz=OFF kernels_flags="-fno-sanitize=thread" tests_flags="-O0" launcher_flags="-O0"
  test_sources="launcher/(serve/test_signals|batch/test_batch|cli/test_jobs)\\.cpp$"  # what it runs
fi
want=$([ "$thread" = 1 ] && echo thread || echo address)
generator=()
if [ -f "$build/CMakeCache.txt" ]; then
  grep -q "^CMAKE_CXX_FLAGS:.*-fsanitize=$want" "$build/CMakeCache.txt" ||
    { echo "sanitize.sh: $build is not a -fsanitize=$want build; remove it or name another folder" >&2; exit 2; }
elif command -v ninja >/dev/null; then
  generator=(-G Ninja)  # (a folder keeps the generator it was made with)
fi
# Every time, so that a folder made before a change of these flags gets them.
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=None -DGLM5_CUDA=OFF -DGLM5_FUZZ=$fuzz \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
  -DGLM5_KERNELS_FLAGS="$kernels_flags" -DGLM5_LAUNCHER_FLAGS="$launcher_flags" -DGLM5_TESTS_FLAGS="$tests_flags" \
  -DGLM5_TEST_SOURCES="$test_sources" >/dev/null
[ "$configure_only" = 0 ] || exit 0

# What a failed binary's log says about its failures: each failed gtest's own output (from its
# RUN line: the assertion's message and what the test printed, its last 60 lines), the sanitizer
# reports and ctest's failures; else the log's last lines.
failed_output() {
  awk '/^\[ RUN      \] / { n = 0 } { buf[n++] = $0 }
       /^\[  FAILED  \] .*\([0-9]+ ms\)$/ { for (i = (n > 60 ? n - 60 : 0); i < n; ++i) print buf[i]; print "--" }' "$1"
  grep -E -A15 'ERROR: |runtime error|\*\*\*Failed' "$1" | head -n 80
  # Neither (a crash without a report, a binary that would not start): the log's end.
  grep -q -E '^\[  FAILED  \]|ERROR: |runtime error|\*\*\*Failed' "$1" || tail -n 30 "$1"
}

# The quick run: each test binary in one process (a sanitized process takes about 2 s to start,
# which ctest's process per test pays 700 times), test_launcher in four shards (it takes three
# quarters of the time: the shards go first, so the lanes end together), the MPI tests through
# ctest, $jobs at a time. (Tests whose work must fit a time window ask for less of it in a
# sanitized build: kSanitized in tests/test_support.h.)
run_quick() {
  local dir=$1/tests logs=$1/quick-logs failed=0 name
  mkdir -p "$logs"
  {
    for i in 0 1 2 3; do
      echo "launcher-$i env GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i $dir/test_launcher"
    done
    echo "kernels $dir/test_kernels"
    echo "runtime $dir/test_runtime"
    echo "parallel $dir/parallel/test_parallel"
    echo "mpi ctest --test-dir $1 --timeout 600 --output-on-failure -R ^(mpi_comm|moe_exchange|watchdog)"
  } >"$logs/commands"
  export OMP_NUM_THREADS=1
  # shellcheck disable=SC2016
  xargs -P "$jobs" -L 1 sh -c 'name=$1; shift; if "$@" >"'"$logs"'/$name.log" 2>&1; then
      echo "sanitize.sh: $name passed"; else echo "sanitize.sh: $name FAILED"; fi' sh <"$logs/commands" |
    tee "$logs/summary"
  for name in $(sed -n 's/^sanitize.sh: \(.*\) FAILED$/\1/p' "$logs/summary"); do
    failed=1
    echo "---- $name ($logs/$name.log) ----"
    failed_output "$logs/$name.log"
  done
  return $failed
}

# Leak checking is off in the tests: MPI and OpenMP runtimes keep allocations until exit by design
# (the fuzz targets check leaks: their parsers own everything they allocate).
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
if [ "$thread" = 1 ]; then
  # One OpenMP thread everywhere: the kernels' parallel regions are not what this run checks, and
  # the OpenMP runtime is not instrumented (its barriers would read as races).
  export OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions='$root/tests/tsan.supp'"
  cmake --build "$build" -j"$jobs" --target glm5 test_launcher
  # One after the other: serve_load's 64 clients and the signal tests' drain windows each want the
  # cores to themselves (as in ctest, where serve_load runs serially).
  (cd "$build" && ctest --timeout 900 --output-on-failure -R '^(serve_venv|serve_api|serve_load)$')
  "$build/tests/test_launcher" --gtest_filter='Signals.*:Batch.*:Jobs.*'
  echo "sanitize.sh: the ThreadSanitizer run passed"
  exit 0
fi
if [ "$quick" = 1 ]; then
  # The fuzz targets too, in the same call, so that make keeps both cores busy to the end.
  cmake --build "$build" -j"$jobs" --target glm5 test_kernels test_runtime test_launcher test_parallel \
    test_mpi_comm test_moe_exchange $(cd "$root/tests/fuzz" && ls fuzz_*.cpp | sed 's/\.cpp$//')
  run_quick "$build"
else
  cmake --build "$build" -j"$jobs"
  (cd "$build" && ctest -j"$jobs" --timeout 900 --output-on-failure)
fi
unset ASAN_OPTIONS UBSAN_OPTIONS
if [ "$fuzz_seconds" = 0 ]; then
  exec "$root/scripts/fuzz.sh" --build "$build" --replay
fi
# A fuzzing run replays its whole corpus (every kept input and seed) before it mutates, so that is
# the replay too. The targets in $jobs lanes, each lane with its own work folder.
mapfile -t targets < <(cd "$root/tests/fuzz" && ls fuzz_*.cpp | sed 's/\.cpp$//')
pids=()
for ((i = 0; i < jobs; i++)); do
  lane=()
  for ((k = i; k < ${#targets[@]}; k += jobs)); do lane+=("${targets[k]}"); done
  [ ${#lane[@]} -gt 0 ] || continue
  "$root/scripts/fuzz.sh" --build "$build" --work "${TMPDIR:-/tmp}/glm5-fuzz-sanitize-$i" --seconds "$fuzz_seconds" \
    --seed 1 "${lane[@]}" &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
exit $failed
