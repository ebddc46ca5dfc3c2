#!/usr/bin/env bash
# A self-contained GPU bundle: builds here (sm_90 SASS, the CUDA toolkit of this machine) the glm5
# binary, the CUDA plugin, the kernel test binary and the kernel benchmark, and collects every shared library they need
# except the CUDA ones (libcuda from the GPU machine's driver; cudart, cuBLAS, cuBLASLt and NCCL
# from its toolkit or its Python packages nvidia-cuda-runtime / nvidia-cublas / nvidia-nccl-cu13),
# the C library and its loader included, so the bundle runs on a machine with none of our packages
# (no MPI, yaml-cpp, PCRE2, GoogleTest) and any glibc. `BUNDLE/run.sh PROGRAM ARGS` runs one of
# them through the bundled loader with the bundle's libraries first, then the CUDA libraries it
# finds there (`BUNDLE/run.sh --where` prints them). The bundle must stay under the 64 MiB that
# travel to the GPU machine with one call.
#
# Usage: scripts/gpu-bundle.sh [BUNDLE_DIR]      (default: build-bundle/bundle; gitignored)
#        scripts/gpu-bundle.sh --dry-run [BUNDLE_DIR]: also runs it here in an empty environment
#        (only the bundle on the library path): the CUDA tests must skip, a CPU generate must run and
#        a cuda-backend generate must fail with one clear message, so no GPU minute is lost on a
#        missing library.
# Env: BUILD (default build-bundle), CUDA_ARCH (default 90), JOBS (default 2).
# The build targets a generic x86-64-v3 CPU (AVX2 + FMA, every H200 host has it), not this one.
set -euo pipefail

dry=0
if [ "${1:-}" = --dry-run ]; then
  dry=1
  shift
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD:-$root/build-bundle}
out=${1:-$build/bundle}
arch=${CUDA_ARCH:-90}
jobs=${JOBS:-2}

echo "== configure $build (sm_$arch, -march=x86-64-v3)" >&2
mkdir -p "$build"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGLM5_NATIVE=OFF -DCMAKE_CXX_FLAGS="-march=x86-64-v3" \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" > "$build/configure.log" 2>&1 || { tail -30 "$build/configure.log" >&2; exit 1; }
grep -q "CUDA backend ON" "$build/configure.log" || { echo "the CUDA backend is not configured (nvcc/NCCL missing?)" >&2; exit 1; }
echo "== build glm5, glm5_cuda, test_kernels, bench_cuda" >&2
cmake --build "$build" -j "$jobs" --target glm5 glm5_cuda test_kernels bench_cuda > "$build/build.log" 2>&1 ||
  { tail -30 "$build/build.log" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp "$build/glm5" "$build/tests/test_kernels" "$build/bench_cuda" "$out/bin/"
cp "$build/libglm5_cuda.so" "$out/lib/"
# Every library they load, but the CUDA ones (the GPU machine's own: they must match its driver).
cuda_libs='^(linux-vdso|libcuda\.|libcudart\.|libcublas\.|libcublasLt\.|libnccl\.)'
for elf in "$out/bin/glm5" "$out/bin/test_kernels" "$out/bin/bench_cuda" "$out/lib/libglm5_cuda.so"; do
  ldd "$elf" | awk '{ if ($2 == "=>") print $1, $3; else print $1, $1 }' | while read -r name path; do
    [[ $name =~ $cuda_libs ]] && continue
    [ -f "$path" ] || { echo "$elf needs $name, not found here" >&2; exit 1; }
    cp -L "$path" "$out/lib/$(basename "$name")"
  done
done
# The loader under a fixed name (ldd lists it by its absolute path).
cp -L /lib64/ld-linux-x86-64.so.2 "$out/lib/ld-linux-x86-64.so.2"

cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# BUNDLE/run.sh PROGRAM ARGS: runs bin/PROGRAM through the bundled loader; the bundle's libraries
# first, then the CUDA libraries of this machine: GLM5_CUDA_LIBDIR (colon-separated, searched first),
# the toolkit's (CUDA_HOME, /usr/local/cuda), the Python packages' (nvidia/*/lib under the
# site-packages of every python3 / python3.N on PATH and of the usual prefixes: NCCL often comes only
# with PyTorch, whose interpreter need not be the first python3), then the driver's libcuda through
# the system's loader cache. `run.sh --where` prints the library path.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cuda=""
[ -n "${GLM5_CUDA_LIBDIR:-}" ] && cuda=":$GLM5_CUDA_LIBDIR"
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" "${CUDA_HOME:-/usr/local/cuda}/lib"; do
  [ -e "$d/libcublas.so.13" ] && cuda="$cuda:$d"
done
pys=""  # every python3 and python3.N on PATH, each directory's (conda beside /usr)
for name in python3 $(compgen -c python3. 2> /dev/null | grep -E '^python3\.[0-9]+$' | sort -u || true); do
  pys="$pys $(type -ap "$name" 2> /dev/null | tr '\n' ' ' || true)"
done
for py in $(printf '%s\n' $pys | awk '!seen[$0]++'); do
  for d in $("$py" - 2> /dev/null <<'PY'
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
print("\n".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib"))})))
PY
  ); do case ":$cuda:" in *":$d:"*) ;; *) cuda="$cuda:$d" ;; esac; done
done
for d in /usr/local/lib/python3*/dist-packages/nvidia/*/lib /usr/lib/python3/dist-packages/nvidia/*/lib \
  /opt/conda/lib/python3*/site-packages/nvidia/*/lib; do
  [ -d "$d" ] || continue
  case ":$cuda:" in *":$d:"*) ;; *) cuda="$cuda:$d" ;; esac
done
path="$here/lib$cuda"
if [ "${1:-}" = --where ]; then
  echo "$path"
  exit 0
fi
prog=${1:?usage: run.sh PROGRAM ARGS (glm5, test_kernels, bench_cuda) or --where}
shift
export GLM5_CUDA_PLUGIN=${GLM5_CUDA_PLUGIN:-$here/lib/libglm5_cuda.so}
exec "$here/lib/ld-linux-x86-64.so.2" --library-path "$path" "$here/bin/$prog" "$@"
RUN
chmod +x "$out/run.sh"

size=$(du -sb "$out" | cut -f1)
echo "bundle $out: $(find "$out" -type f | wc -l) files, $((size / 1024 / 1024)) MiB" >&2
[ "$size" -lt $((60 * 1024 * 1024)) ] || { echo "the bundle is over 60 MiB: it would not travel in one call" >&2; exit 1; }
[ $dry = 1 ] || exit 0

# Dry run: an empty environment, only the bundle (and no CUDA libraries unless this machine has them).
echo "== dry run in an empty environment" >&2
cd "$root"
run() { env -i HOME=/tmp PATH=/usr/bin:/bin "$out/run.sh" "$@"; }
log=$build/dry-run.log
run test_kernels --gtest_filter='*Cuda*:QuantGemm*' > "$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
grep -m 3 -E "PASSED|SKIPPED" "$log" >&2
run glm5 generate --model tests/data/tiny-a --prompt-ids 1,5,9 --max-new-tokens 4 --temperature 0 > "$log" 2>&1 ||
  { cat "$log" >&2; exit 1; }
echo "cpu generate: $(head -c 120 "$log")" >&2
if run glm5 generate --model tests/data/tiny-a --prompt-ids 1,5,9 --max-new-tokens 4 --temperature 0 \
  --cluster cluster-configs/cuda-1.yaml > "$log" 2>&1; then
  echo "cuda generate ran here (a GPU is present): $(head -c 120 "$log")" >&2
else
  grep -q "glm5: error" "$log" || { cat "$log" >&2; exit 1; }
  echo "cuda generate without a GPU: $(grep -m1 'glm5: error' "$log" | head -c 300)" >&2
fi
run bench_cuda > "$log" 2>&1 && { echo "bench_cuda ran here (a GPU is present)" >&2; } ||
  { grep -q "no usable CUDA device" "$log" || { cat "$log" >&2; exit 1; }; echo "bench_cuda without a GPU: $(head -c 200 "$log")" >&2; }
# The check itself, as the device machine runs it (OUT set): every step leaves its line in
# steps.txt and its log under OUT as it ends, the preflight names the plugin's CUDA libraries, the
# new kernels' tests run in a process of their own, and the whole fits its budget.
dry_out=$(mktemp -d)
t0=$SECONDS
env -i HOME=/tmp PATH=/usr/bin:/bin OUT="$dry_out" GLM5_BUNDLE="$out" bash "$root/scripts/gpu-check.sh" "$build/dry-check" \
  > "$build/dry-check.log" 2>&1 || true
for step in gpu bundle preflight; do
  grep -q "^$step " "$dry_out/steps.txt" || { cat "$build/dry-check.log" >&2; echo "dry check: no '$step' step" >&2; exit 1; }
done
if grep -q "^preflight PASS" "$dry_out/steps.txt"; then
  for step in gpu-tests new-kernels golden-tiny-a bench; do
    grep -q "^$step " "$dry_out/steps.txt" || { cat "$dry_out/steps.txt" >&2; echo "dry check: no '$step' step" >&2; exit 1; }
  done
fi
[ -f "$dry_out/summary.txt" ] && [ -d "$dry_out/gpu-check-logs" ] || { echo "dry check: no summary / logs in OUT" >&2; exit 1; }
echo "dry check ($((SECONDS - t0)) s):" >&2
sed 's/^/  /' "$dry_out/steps.txt" >&2
rm -rf "$dry_out"
echo "dry run: PASS" >&2
