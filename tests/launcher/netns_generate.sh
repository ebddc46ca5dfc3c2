#!/usr/bin/env bash
# Multi-host test without containers: 2 simulated hosts (network namespaces joined by veth) x 2
# ranks run `glm5 generate` on a 2 x 2 layout with MPI over the veth addresses only; the logits
# dump must be bitwise identical to the single-process run. Exit 77 = skipped (no namespaces here).
# usage: netns_generate.sh GLM5_BINARY SOURCE_DIR
set -euo pipefail
bin=$1 src=$2
model=$src/tests/data/tiny-moe
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ids=3,17,99,250,4,8,15,16,23,42,108,300,1,2,3,5,8,13,21,34,55,89,144,233,377
"$bin" generate --model "$model" --prompt-ids $ids --max-new-tokens 6 --temperature 0 \
  --dump-logits "$tmp/ref.safetensors" > "$tmp/ref.json"
set +e
"$src/scripts/netns-test.sh" --hosts 2 --slots 2 --timeout 240 --mpirun-arg -x --mpirun-arg OMP_NUM_THREADS=1 -- \
  "$bin" generate --model "$model" --prompt-ids $ids --max-new-tokens 6 --temperature 0 \
  --dump-logits "$tmp/netns.safetensors" --cluster "$src/cluster-configs/cpu-pp2-ep2.yaml" > "$tmp/netns.json"
rc=$?
set -e
[ $rc = 77 ] && exit 77
[ $rc = 0 ] || { echo "netns run failed with exit code $rc"; cat "$tmp/netns.json"; exit 1; }
cmp "$tmp/ref.safetensors" "$tmp/netns.safetensors"
diff "$tmp/ref.json" "$tmp/netns.json"
echo "netns 2 hosts x 2 ranks: logits and tokens identical to the single process: $(cat "$tmp/netns.json")"
