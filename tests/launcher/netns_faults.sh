#!/usr/bin/env bash
# Faults between hosts: a 2 x 2 batch job (cpu-pp2-ep2) across two simulated hosts (network
# namespaces, scripts/netns-test.sh) while the links misbehave:
#   loss   5 % of the packets lost and every link shaped to 20 Mbit/s: the job finishes and its
#          records are those of the single process (TCP retransmits, nothing else notices);
#   blip   host h2 cut off for 3 s after 20 records: the same;
#   cut    h2 cut off for good after 20 records, the job run by `glm5 launch --run`: the watchdog
#          (watchdog_s 4) reports the wait, naming the peer, and aborts the job; mpirun, waiting for
#          the daemon on h2, is ended by the launcher kAbortGraceS (20) s later, exit 1; the
#          records written are whole and the single process's; a rerun over the same output
#          completes it: every request answered once, as the single process answered it.
# Exit 77 = skipped (no namespaces or no nftables here). usage: netns_faults.sh GLM5_BINARY SOURCE_DIR
set -euo pipefail
bin=$1 src=$2
model=$src/tests/data/tiny-moe
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for i in $(seq 1 300); do
  echo "{\"custom_id\": \"f$i\", \"prompt_ids\": [$((i % 40 + 1)), 7, $((i % 13 + 2))], \"max_tokens\": 32," \
       "\"temperature\": 0.8, \"seed\": $i, \"ignore_eos\": true}"
done >"$tmp/in.jsonl"

# The records keyed by custom_id without the fields that differ between runs; a key twice fails.
records() {
  python3 - "$1" <<'PY'
import json, sys
seen = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = r["custom_id"]
    if key in seen: sys.exit(f"duplicate record for {key} in {sys.argv[1]}")
    r.pop("id", None)
    if isinstance(r.get("response"), dict):
        r["response"].pop("request_id", None)
        for k in ("id", "created"): r["response"]["body"].pop(k, None)
    seen[key] = r
for k in sorted(seen): print(k, json.dumps(seen[k], sort_keys=True))
PY
}
layout() { printf 'stages: 2\nexpert_parallel: 2\nwatchdog_s: %s\n' "$1" >"$tmp/cluster-$1.yaml"; echo "$tmp/cluster-$1.yaml"; }
netns_batch() {  # OUT CLUSTER [netns-test options...]
  local out=$1 cluster=$2
  shift 2
  "$src/scripts/netns-test.sh" --hosts 2 --slots 2 --timeout 150 --mpirun-arg -x --mpirun-arg OMP_NUM_THREADS=1 "$@" -- \
    "$bin" batch --model "$model" --input "$tmp/in.jsonl" --output "$out" --cluster "$cluster"
}

"$bin" batch --model "$model" --input "$tmp/in.jsonl" --output "$tmp/ref.jsonl" 2>"$tmp/ref.log"
records "$tmp/ref.jsonl" >"$tmp/ref.rec"

rc=0
netns_batch "$tmp/loss.jsonl" "$(layout 60)" --loss 5 --shape 20mbit 2>"$tmp/loss.log" || rc=$?
[ $rc = 77 ] && { tail -n 1 "$tmp/loss.log"; exit 77; }
[ $rc = 0 ] || { echo "FAIL loss: exit $rc"; tail -n 20 "$tmp/loss.log"; exit 1; }
records "$tmp/loss.jsonl" >"$tmp/loss.rec" && cmp -s "$tmp/ref.rec" "$tmp/loss.rec" || { echo "FAIL loss: records differ"; exit 1; }
echo "loss: $(grep -o 'faults: .*' "$tmp/loss.log"); $(grep -o '[0-9]* bytes crossed the bridge' "$tmp/loss.log"); records identical"

rc=0
netns_batch "$tmp/blip.jsonl" "$(layout 60)" --partition-at "$tmp/blip.jsonl:20" --partition-for 3 2>"$tmp/blip.log" || rc=$?
[ $rc = 77 ] && { tail -n 1 "$tmp/blip.log"; exit 77; }
[ $rc = 0 ] || { echo "FAIL blip: exit $rc"; tail -n 20 "$tmp/blip.log"; exit 1; }
grep -q "h2 back" "$tmp/blip.log" || { echo "FAIL blip: the job ended before the partition healed"; exit 1; }
records "$tmp/blip.jsonl" >"$tmp/blip.rec" && cmp -s "$tmp/ref.rec" "$tmp/blip.rec" || { echo "FAIL blip: records differ"; exit 1; }
echo "blip: h2 cut off for 3 s after 20 records; records identical"

# glm5 launch starts mpirun itself: its cluster config carries the options that reach the hosts.
cat >"$tmp/launch.sh" <<EOF
#!/bin/sh
{ printf 'stages: 2\\nexpert_parallel: 2\\nwatchdog_s: 4\\nenv: {OMP_NUM_THREADS: "1"}\\nmpirun_args:\\n'
  while IFS= read -r a; do printf '  - "%s"\\n' "\$a"; done <"\$NETNS_TEST_MPIRUN_ARGS"; } >"$tmp/launch.yaml"
exec "$bin" launch --run --cluster "$tmp/launch.yaml" -- batch --model "$model" --input "$tmp/in.jsonl" \\
  --output "$tmp/cut.jsonl"
EOF
chmod +x "$tmp/launch.sh"
rc=0
start=$(date +%s)
"$src/scripts/netns-test.sh" --hosts 2 --slots 2 --timeout 150 --no-mpirun --partition-at "$tmp/cut.jsonl:20" -- \
  "$tmp/launch.sh" >"$tmp/cut.log" 2>&1 || rc=$?
took=$(($(date +%s) - start))
[ $rc = 77 ] && { tail -n 1 "$tmp/cut.log"; exit 77; }
[ $rc = 1 ] || { echo "FAIL cut: exit $rc, expected 1 (the job aborted)"; tail -n 30 "$tmp/cut.log"; exit 1; }
grep -q "launch: a rank aborted the job 20 s ago" "$tmp/cut.log" ||
  { echo "FAIL cut: the launcher did not end mpirun"; tail -n 30 "$tmp/cut.log"; exit 1; }
report=$(grep -m1 -o 'watchdog: rank [0-9]* has waited [0-9]* s with no progress for [a-z]* [a-z]* rank [0-9]*' \
  "$tmp/cut.log") || { echo "FAIL cut: no watchdog report naming the peer"; tail -n 30 "$tmp/cut.log"; exit 1; }
records "$tmp/cut.jsonl" >"$tmp/cut.rec" || { echo "FAIL cut: the output holds a cut or repeated record"; exit 1; }
kept=$(wc -l <"$tmp/cut.rec")
[ "$kept" -lt 300 ] || { echo "FAIL cut: all 300 records written although h2 was cut off"; exit 1; }
[ -z "$(LC_ALL=C comm -23 "$tmp/cut.rec" "$tmp/ref.rec")" ] || { echo "FAIL cut: a record differs from the reference"; exit 1; }
echo "cut: exit $rc after ${took} s; '$report'; $kept whole records kept"

rc=0
netns_batch "$tmp/cut.jsonl" "$(layout 60)" 2>"$tmp/rerun.log" || rc=$?
[ $rc = 0 ] || { echo "FAIL rerun: exit $rc"; tail -n 20 "$tmp/rerun.log"; exit 1; }
records "$tmp/cut.jsonl" >"$tmp/rerun.rec" && cmp -s "$tmp/ref.rec" "$tmp/rerun.rec" || { echo "FAIL rerun: records differ"; exit 1; }
echo "rerun: 300 records, each once, identical to the single process"
