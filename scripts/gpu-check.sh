#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: configure with CUDA + NCCL, build, run the GPU
# tests (ctest -R 'Cuda|nccl'), run the tiny-a, tiny-b and tiny-v32 goldens and a real-dims forward
# (against the cpu backend) on the cuda backend, print a summary (also to LOGS/summary.txt, and the
# logs under LOGS, and to $OUT when OUT is set, as on the device machine: see below).
# Needs the CI packages (MPI, yaml-cpp, json, PCRE2, GoogleTest) plus the CUDA toolkit with
# cuBLAS and NCCL. It does not install anything and does not change GPU settings.
#
# Usage: scripts/gpu-check.sh [BUILD_DIR]          (default: build-gpu in the repository)
#        GLM5_BUNDLE=DIR scripts/gpu-check.sh [LOG_DIR]: no build; runs the binaries of a bundle
#        made by scripts/gpu-bundle.sh (for a GPU machine without our packages): every CUDA test
#        of its test_kernels (--gtest_filter=*Cuda*: CudaOps, the op cases against the reference,
#        batch invariance, the one-GPU NCCL test) and the goldens through its glm5.
# Env:   CUDA_ARCH (default 90), JOBS (default nproc), GOLDEN_ATOL (default 1e-4, the goldens'
#        float32 tolerance), REAL_DIMS_ATOL (default 1e-3: cuda vs cpu over a 3000-token prompt), GLM5_RUN_PREFIX (e.g. "mpirun --allow-run-as-root -np 1"
#        if the cluster config must be launched under MPI), TESTS_TIMEOUT / NEW_TESTS_TIMEOUT /
#        RUN_TIMEOUT / BENCH_TIMEOUT (seconds: the established GPU tests; the tests of the tensor-core
#        kernels no GPU has run yet, and their rerun; each generate run (nine); the kernel
#        benchmark; default 150 / 45 / 35 / 90: 645 s if every step used all of it), CHECK_BUDGET (default 560: after the
#        build, no step runs past this many seconds, and one that has less than half its own timeout
#        left is recorded SKIP instead of starting, so that the whole check fits a 10-minute call
#        with its output intact), GLM5_CUDA_LIBDIR (bundle mode: a directory searched first for
#        the CUDA libraries, e.g. a PyTorch install's nvidia/nccl/lib).
# The GPU tests run in two processes: the established ones first, then the new tensor-core kernels'
# (*TensorCores*, *RowsIndependentOfRowCount*, *MultiBlock*), so that a fault in a new kernel (sticky in its CUDA
# context) cannot turn the established tests into failures; a failing new-kernel run is rerun with
# CUDA_LAUNCH_BLOCKING=1 to name the kernel. In bundle mode a preflight first lists the libraries
# the CUDA plugin loads through the bundled loader and stops at one that is "not found".
# With OUT set (an output folder that is copied back from the GPU machine), every step writes its
# log into $OUT/gpu-check-logs as it runs and appends its line to $OUT/steps.txt when it ends, so
# what ran comes back even if the call is cut off; summary.txt at the end.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build-gpu}
bundle=${GLM5_BUNDLE:-}
glm5_cmd="$build/glm5"
[ -n "$bundle" ] && glm5_cmd="$bundle/run.sh glm5"
arch=${CUDA_ARCH:-90}
jobs=${JOBS:-$(nproc)}
atol=${GOLDEN_ATOL:-1e-4}
tests_timeout=${TESTS_TIMEOUT:-150}
new_tests_timeout=${NEW_TESTS_TIMEOUT:-45}
run_timeout=${RUN_TIMEOUT:-35}
bench_timeout=${BENCH_TIMEOUT:-90}
budget=${CHECK_BUDGET:-560}
new_kernels='*TensorCores*:*RowsIndependentOfRowCount*:*MultiBlock*'
logs=$build/gpu-check-logs
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then logs=$OUT/gpu-check-logs; fi  # streamed back as it runs
mkdir -p "$logs"

budget_start=$SECONDS  # reset after a build: the budget is for the checks
# limit SECONDS: SECONDS, cut to what is left of the budget (at least 1).
limit() {
  local left=$((budget - (SECONDS - budget_start)))
  [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 1 ] && left=1
  echo "$left"
}
# out_of_time NAME [TIMEOUT]: records NAME as not run (SKIP) when less than half its timeout (at
# least 5 s) is left of the budget.
out_of_time() {
  local need=$(((${2:-10}) / 2))
  [ "$need" -lt 5 ] && need=5
  if [ $((budget - (SECONDS - budget_start))) -lt "$need" ]; then
    record "$1" SKIP 0 "not run: the ${budget}s budget is spent"
    return 0
  fi
  return 1
}
summary=()
failed=0   # any step failed: the exit status
blocked=0  # configure or build failed: later steps cannot run

# record NAME RESULT SECONDS DETAIL (with OUT set, also appended to $OUT/steps.txt at once, so that
# the steps done come back even if the call is cut off)
record() {
  summary+=("$(printf '%-9s %-4s %5ss  %s' "$1" "$2" "$3" "$4")")
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then printf '%s\n' "${summary[-1]}" >> "$OUT/steps.txt"; fi
  if [ "$2" = FAIL ]; then failed=1; fi
}

# run_step NAME COMMAND...: runs with output to $logs/NAME.log; PASS on exit 0.
run_step() {
  local name=$1 t0=$SECONDS
  shift
  echo "== $name: $*" >&2
  if "$@" >"$logs/$name.log" 2>&1; then
    record "$name" PASS $((SECONDS - t0)) "log: $logs/$name.log"
    return 0
  fi
  record "$name" FAIL $((SECONDS - t0)) "log: $logs/$name.log (last lines below)"
  tail -n 25 "$logs/$name.log" >&2
  return 1
}

print_summary() {
  echo
  echo "gpu-check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), build $build)"
  printf '%s\n' "${summary[@]}"
  [ $failed = 0 ] && echo "RESULT: PASS" || echo "RESULT: FAIL"
}

# 1. The device.
if command -v nvidia-smi >/dev/null &&
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1); then
  record gpu PASS 0 "$(echo "$gpu" | head -n 1)"
else
  record gpu FAIL 0 "nvidia-smi found no GPU: ${gpu:-nvidia-smi not installed}"
fi

# 2. Configure (the .cu files are C++17; the rest C++20).
nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -n "$bundle" ]; then
  record bundle PASS 0 "$bundle (no build); libraries: $("$bundle/run.sh" --where)"
  # Preflight: the plugin's libraries as the bundled loader resolves them (libcudart, cuBLAS, NCCL
  # from this machine); one "not found" would make every CUDA test skip.
  "$bundle/lib/ld-linux-x86-64.so.2" --library-path "$("$bundle/run.sh" --where)" --list "$bundle/lib/libglm5_cuda.so" \
    >"$logs/preflight.log" 2>&1
  if ! grep -q "=>" "$logs/preflight.log" || grep -q "not found" "$logs/preflight.log"; then
    record preflight FAIL 0 "the CUDA plugin cannot load: $(grep 'not found' "$logs/preflight.log" | tr -s ' \t\n' ' ')(set GLM5_CUDA_LIBDIR)"
    blocked=1
  else
    record preflight PASS 0 "$(grep -oE '(libcudart|libcublasLt|libnccl)[^ ]* => [^ ]*' "$logs/preflight.log" | tr '\n' ';')"
  fi
elif ! run_step configure cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_CUDA_COMPILER="$nvcc_bin"; then
  blocked=1
elif ! grep -q "glm5: CUDA backend ON" "$logs/configure.log"; then
  record cuda-on FAIL 0 "configure did not enable the CUDA backend: $(grep 'glm5:' "$logs/configure.log")"
  blocked=1
fi

# 3. Build everything (library, glm5, tests).
[ $blocked = 0 ] && [ -z "$bundle" ] && { run_step build cmake --build "$build" -j "$jobs" || blocked=1; }
budget_start=$SECONDS

# 4. GPU tests. A GPU test that skips on a GPU machine is a failure (the device was not usable).
# gtest_step NAME FILTER TIMEOUT [ENV...]: the bundle's test_kernels over FILTER; a test that skips
# on a GPU machine is a failure (the device was not usable).
gtest_step() {
  local name=$1 filter=$2 tmo=$3 t0=$SECONDS
  shift 3
  (cd "$root" && env "$@" timeout "$(limit "$tmo")" "$bundle/run.sh" test_kernels --gtest_filter="$filter") \
    >"$logs/$name.log" 2>&1
  local rc=$?
  local counts skipped
  counts=$(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]' "$logs/$name.log" | tr '\n' ' ')
  skipped=$(grep -c '^\[  SKIPPED \] .* ([0-9]* ms)$' "$logs/$name.log")  # per test, not the summary list
  if [ $rc != 0 ] || [ "$skipped" != 0 ]; then
    record "$name" FAIL $((SECONDS - t0)) "$counts; $skipped skipped; exit $rc; log: $logs/$name.log"
    grep -E '^\[  (FAILED|SKIPPED) \]|no usable CUDA device' "$logs/$name.log" | head -n 20 >&2
    return 1
  fi
  record "$name" PASS $((SECONDS - t0)) "$counts"
}

if [ $blocked = 0 ] && [ -n "$bundle" ]; then
  # The established tests (the parameterized op cases included), then the new kernels' own.
  out_of_time gpu-tests "$tests_timeout" || gtest_step gpu-tests "*Cuda*:-$new_kernels" "$tests_timeout"
  out_of_time new-kernels "$new_tests_timeout" || gtest_step new-kernels "$new_kernels" "$new_tests_timeout" ||
    { out_of_time new-kernels-sync "$new_tests_timeout" ||
        gtest_step new-kernels-sync "$new_kernels" "$new_tests_timeout" CUDA_LAUNCH_BLOCKING=1 GLM5_CUDA_ATTENTION_LOG=1; }
elif [ $blocked = 0 ] && ! out_of_time gpu-tests "$tests_timeout"; then
  t0=$SECONDS
  (cd "$build" && ctest -R 'Cuda|nccl' -j 4 --output-on-failure --timeout "$(limit "$tests_timeout")") \
    >"$logs/gpu-tests.log" 2>&1
  rc=$?
  counts=$(grep -E 'tests passed|No tests were found' "$logs/gpu-tests.log" | tail -n 1)
  skipped=$(grep -c '(Skipped)' "$logs/gpu-tests.log")
  if [ $rc != 0 ] || [ "$skipped" != 0 ] || grep -q 'No tests were found' "$logs/gpu-tests.log"; then
    record gpu-tests FAIL $((SECONDS - t0)) "$counts; $skipped skipped; log: $logs/gpu-tests.log"
    grep -E '\((Failed|Skipped|Timeout)\)|no usable CUDA device' "$logs/gpu-tests.log" |
      sed 's/  # GetParam() = .*(/ (/' | head -n 20 >&2
  else
    record gpu-tests PASS $((SECONDS - t0)) "$counts"
  fi
fi

# 5. Goldens on the cuda backend: tiny-a, tiny-b and tiny-v32 against their golden.safetensors
#    (decode tokens exact, logits within GOLDEN_ATOL), the trained model in fast, real-dims (GLM-5's
#    attention and indexer dims on a 3000-token prompt) on cuda against the same run on the cpu
#    backend; then the grouped expert GEMM (not yet run on a GPU) on tiny-a and the trained model.
cluster=$root/cluster-configs/cuda-1.yaml
compare_py=$logs/compare_logits.py
cat > "$compare_py" <<'PY'
# compare_logits.py REF GOT ATOL: decode tokens exact, prefill / decode logits within ATOL.
import json, struct, sys

def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        code = {"F32": "f", "I32": "i"}.get(e["dtype"])
        if code:
            out[name] = struct.unpack("<%d%s" % ((b - a) // 4, code), data[a:b])
    return out

ref, got, atol = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
ok = True
toks_r, toks_c = list(ref["decode_tokens"]), list(got.get("decode_tokens", []))
print("decode_tokens reference", toks_r)
print("decode_tokens cuda     ", toks_c)
ok &= toks_r == toks_c
for name in ("prefill_logits", "decode_logits"):
    r, c = ref[name], got.get(name, ())
    if len(r) != len(c):
        print(f"{name}: {len(c)} values, the reference has {len(r)}")
        ok = False
        continue
    worst = max(abs(x - y) for x, y in zip(r, c))
    print(f"{name}: max |cuda - reference| = {worst:.3g} (atol {atol:g})")
    ok &= worst <= atol
print("result:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
read_ids='import json,struct,sys
f=open(sys.argv[1],"rb"); n=struct.unpack("<Q",f.read(8))[0]; h=json.loads(f.read(n))
e=h["prompt_ids"]; f.seek(8+n+e["data_offsets"][0]); c=(e["data_offsets"][1]-e["data_offsets"][0])//4
print(",".join(str(v) for v in struct.unpack("<%di"%c,f.read(4*c))))'
count_tokens='import json,struct,sys
f=open(sys.argv[1],"rb"); n=struct.unpack("<Q",f.read(8))[0]; print(json.loads(f.read(n))["decode_tokens"]["shape"][0])'

# golden_step NAME MODEL_DIR REF_FILE IDS N ATOL [PRECISION]: generate N greedy tokens (logits dumped)
# on the cuda backend in PRECISION (default exact) and compare them with REF_FILE.
golden_step() {
  local name=$1 model=$2 ref=$3 ids=$4 n=$5 tol=$6 prec=${7:-exact} t0=$SECONDS out=$logs/$1-cuda-logits.safetensors
  out_of_time "$name" "$run_timeout" && return
  # shellcheck disable=SC2086
  if timeout "$(limit "$run_timeout")" ${GLM5_RUN_PREFIX:-} $glm5_cmd generate --model "$model" --cluster "$cluster" --prompt-ids "$ids" \
    --max-new-tokens "$n" --temperature 0 --ignore-eos --precision "$prec" --dump-logits "$out" >"$logs/$name.log" 2>&1 &&
    python3 "$compare_py" "$ref" "$out" "$tol" >>"$logs/$name.log" 2>&1; then
    record "$name" PASS $((SECONDS - t0)) "$(grep 'max |' "$logs/$name.log" | tr '\n' ';')"
  else
    record "$name" FAIL $((SECONDS - t0)) "log: $logs/$name.log"
    tail -n 15 "$logs/$name.log" >&2
  fi
}

if [ $blocked = 0 ]; then
  if { [ -z "$bundle" ] && [ ! -x "$build/glm5" ]; } || [ ! -f "$cluster" ]; then
    record golden SKIP 0 "needs $build/glm5 and cluster-configs/cuda-1.yaml"
  else
    for m in tiny-a tiny-b tiny-v32; do
      g=$root/tests/data/$m/golden.safetensors
      golden_step "golden-$m" "$root/tests/data/$m" "$g" "$(python3 -c "$read_ids" "$g")" \
        "$(python3 -c "$count_tokens" "$g")" "$atol"
    done
    # Precision fast (one bf16 term per GEMM) on the trained model, against the cpu backend's exact run
    # of the same prompt: the same greedy tokens, logits within FAST_ATOL (the cpu backend's own fast
    # run differs from its exact one by 0.39 at most on the prompt rows, 0.024 on the decode rows).
    # (The random tiny models flip expert and top-k selections under bf16 rounding: not a check.)
    kjv=$root/tests/data/glm5-kjv
    kjv_ids=$(head -c 1500 "$kjv/heldout.txt" | python3 -c 'import json, sys; print(json.dumps({"text": sys.stdin.read()}))' |
      $glm5_cmd tokenize --tokenizer "$kjv" 2>/dev/null |
      python3 -c 'import json, sys; print(",".join(map(str, json.loads(sys.stdin.readline())["ids"])))' 2>/dev/null || true)
    t0=$SECONDS
    if out_of_time golden-fast-kjv "$((2 * run_timeout))"; then
      :
    elif [ -z "$kjv_ids" ]; then
      record golden-fast-kjv FAIL 0 "glm5 tokenize gave no ids for $kjv/heldout.txt"
    elif rm -f "$logs/kjv-cpu-exact.safetensors" &&
      timeout "$(limit "$run_timeout")" $glm5_cmd generate --model "$kjv" --prompt-ids "$kjv_ids" --max-new-tokens 8 \
      --temperature 0 --ignore-eos --dump-logits "$logs/kjv-cpu-exact.safetensors" >"$logs/kjv-cpu.log" 2>&1; then
      golden_step golden-fast-kjv "$kjv" "$logs/kjv-cpu-exact.safetensors" "$kjv_ids" 8 "${FAST_ATOL:-1.0}" fast
    else
      record golden-fast-kjv FAIL $((SECONDS - t0)) "the cpu reference run failed; log: $logs/kjv-cpu.log"
    fi
    # real-dims: the cpu backend's run of the same prompt is the reference (the cpu path matches
    # the float64 reference within 6.4e-6 on the compared rows: tests/launcher/cli/test_real_dims.cpp).
    rd=$root/tests/data/real-dims
    rd_ids=$(python3 -c 'import json,sys; print(",".join(str(v) for v in json.load(open(sys.argv[1]))))' "$rd/prompt.json")
    t0=$SECONDS
    if out_of_time real-dims "$((2 * run_timeout))"; then
      :
    elif timeout "$(limit "$run_timeout")" $glm5_cmd generate --model "$rd" --prompt-ids "$rd_ids" --max-new-tokens 4 --temperature 0 --ignore-eos \
      --dump-logits "$logs/real-dims-cpu.safetensors" >"$logs/real-dims-cpu.log" 2>&1; then
      golden_step real-dims "$rd" "$logs/real-dims-cpu.safetensors" "$rd_ids" 4 "${REAL_DIMS_ATOL:-1e-3}"
    else
      record real-dims FAIL $((SECONDS - t0)) "the cpu reference run failed; log: $logs/real-dims-cpu.log"
    fi
    # The grouped expert GEMM (GLM5_CUDA_EXPERT_GEMM=grouped: one tensor-core launch per batch of
    # expert gemms; BF16 experts in both models), after the established checks: tiny-a's golden in
    # exact, the trained model in fast against this run's cpu reference.
    g=$root/tests/data/tiny-a/golden.safetensors
    GLM5_CUDA_EXPERT_GEMM=grouped golden_step golden-tiny-a-grouped "$root/tests/data/tiny-a" "$g" \
      "$(python3 -c "$read_ids" "$g")" "$(python3 -c "$count_tokens" "$g")" "$atol"
    if [ -n "$kjv_ids" ] && [ -f "$logs/kjv-cpu-exact.safetensors" ]; then
      GLM5_CUDA_EXPERT_GEMM=grouped golden_step golden-fast-kjv-grouped "$kjv" "$logs/kjv-cpu-exact.safetensors" \
        "$kjv_ids" 8 "${FAST_ATOL:-1.0}" fast
    else
      record golden-fast-kjv-grouped SKIP 0 "no cpu reference of the trained model's prompt (see golden-fast-kjv)"
    fi
  fi
fi

# 6. Kernel figures (scripts/bench/bench_cuda.cpp): MLA decode and indexer + top-k bandwidth against
#    the HBM copy bandwidth measured in the same run, expert GEMMs exact vs one bf16 term vs chunked.
if [ $blocked = 0 ] && ! out_of_time bench "$bench_timeout"; then
  bench_cmd="$build/bench_cuda"
  [ -n "$bundle" ] && bench_cmd="$bundle/run.sh bench_cuda"
  t0=$SECONDS
  if GLM5_CUDA_ATTENTION_LOG=1 timeout "$(limit "$bench_timeout")" $bench_cmd >"$logs/bench_cuda.log" 2>&1; then
    record bench PASS $((SECONDS - t0)) "tables in $logs/bench_cuda.log; $(grep -m1 '^HBM' "$logs/bench_cuda.log")"
    cat "$logs/bench_cuda.log" >&2
  else
    record bench FAIL $((SECONDS - t0)) "log: $logs/bench_cuda.log"
    tail -n 10 "$logs/bench_cuda.log" >&2
  fi
fi

print_summary | tee "$logs/summary.txt"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$logs/summary.txt" "$OUT/summary.txt"; fi
exit $failed
