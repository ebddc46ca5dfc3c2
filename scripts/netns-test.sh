#!/usr/bin/env bash
# Runs a program under mpirun across simulated hosts on one machine: N network namespaces ("hosts"
# h1..hN, eth0 = 10.77.0.i/24) joined by veth links to a bridge in its own namespace. mpirun runs in
# h1 and starts the other hosts' daemons through an rsh agent that enters the namespace instead of
# ssh; MPI traffic is confined to the veth addresses. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN),
# `ip` and `unshare`; otherwise exits 77 ("skipped: <reason>"). Leaves no namespace behind.
#
# usage: scripts/netns-test.sh [--hosts 2] [--slots 2] [--np N] [--transport tcp|shm|ucx]
#                              [--timeout 300] [--mpirun-arg ARG]... -- PROGRAM [ARGS...]
#   --hosts N       simulated hosts (namespaces), 1..254 (default 2)
#   --slots S       ranks per host in the hostfile (default 2)
#   --np N          ranks (default hosts x slots; more than that oversubscribes)
#   --transport T   tcp: ob1 + btl self,tcp (default); shm: ob1 + btl self,vader,tcp (each host
#                   gets its own hostname, so shared-memory segments do not clash); ucx: UCX PML
#                   over eth0
#   --timeout S     kill the run after S seconds (exit 124)
#   --mpirun-arg A  one more mpirun argument (repeat for several)
#   --no-mpirun     run PROGRAM itself on h1 instead of under mpirun, for a program that starts
#                   mpirun (glm5 launch --run): NETNS_TEST_MPIRUN_ARGS names a file with the mpirun
#                   options that reach the hosts (hostfile, rsh agent, interfaces, transport), one
#                   per line
# Faults on the links (each host's eth0; traffic inside a host is untouched):
#   --loss P        each host drops P % of the packets it sends (tc netem where the kernel has
#                   it, else an nftables rule `numgen random mod 100 < P drop`)
#   --delay MS      each host delays what it sends by MS ms (tc netem; exit 77 without it)
#   --shape RATE    each host sends at most RATE (tc tbf, e.g. 20mbit, 50 ms of queue): bursts
#                   wait, and what overflows the queue is dropped
#   --partition-at WHEN   cut host h2 off (every packet in and out of its eth0 dropped) at WHEN:
#                   S (seconds after mpirun starts) or FILE:N (once FILE has N lines)
#   --partition-for S     heal the partition after S seconds (default: never)
# Example: scripts/netns-test.sh --hosts 3 --slots 1 -- \
#            sh -c 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname) $(readlink /proc/self/ns/net)"'
# SC2015: `a && b || die` is meant; SC2054: commas are MCA list values; SC2317: trap functions.
# shellcheck disable=SC2015,SC2054,SC2317
set -euo pipefail

usage() { sed -n '8,32p' "$0" | sed 's/^# \{0,1\}//'; }
skip() { echo "netns-test: skipped: $*" >&2; exit 77; }
die() { echo "netns-test: error: $*" >&2; exit 2; }

hosts=2 slots=2 np="" transport=tcp timeout_s=300
loss="" delay="" shape="" part_at="" part_for="" no_mpirun=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) hosts=${2:?--hosts needs a value}; shift 2 ;;
    --slots) slots=${2:?--slots needs a value}; shift 2 ;;
    --np) np=${2:?--np needs a value}; shift 2 ;;
    --transport) transport=${2:?--transport needs a value}; shift 2 ;;
    --timeout) timeout_s=${2:?--timeout needs a value}; shift 2 ;;
    --mpirun-arg) extra+=("${2?--mpirun-arg needs a value}"); shift 2 ;;
    --no-mpirun) no_mpirun=1; shift ;;
    --loss) loss=${2:?--loss needs a value}; shift 2 ;;
    --delay) delay=${2:?--delay needs a value}; shift 2 ;;
    --shape) shape=${2:?--shape needs a value}; shift 2 ;;
    --partition-at) part_at=${2:?--partition-at needs a value}; shift 2 ;;
    --partition-for) part_for=${2:?--partition-for needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) usage >&2; die "unknown option '$1' (put the program after --)" ;;
  esac
done
[ $# -gt 0 ] || { usage >&2; die "no program given after --"; }
isnum() { case "$1" in ''|*[!0-9]*) return 1 ;; *) return 0 ;; esac; }
isnum "$hosts" && [ "$hosts" -ge 1 ] && [ "$hosts" -le 254 ] || die "--hosts: expected 1..254, found '$hosts'"
isnum "$slots" && [ "$slots" -ge 1 ] || die "--slots: expected an integer >= 1, found '$slots'"
isnum "$timeout_s" && [ "$timeout_s" -ge 1 ] || die "--timeout: expected seconds >= 1, found '$timeout_s'"
[ -n "$np" ] || np=$((hosts * slots))
[ -z "$loss" ] || { isnum "$loss" && [ "$loss" -le 100 ]; } || die "--loss: expected a percentage 0..100, found '$loss'"
[ -z "$delay" ] || isnum "$delay" || die "--delay: expected milliseconds, found '$delay'"
[ -z "$part_for" ] || isnum "$part_for" || die "--partition-for: expected seconds, found '$part_for'"
[ -z "$part_at" ] || [ "$hosts" -ge 2 ] || die "--partition-at needs --hosts 2 or more"
case "$part_at" in
  '') ;;
  *:*) isnum "${part_at##*:}" || die "--partition-at: expected S or FILE:N (N lines), found '$part_at'" ;;
  *) isnum "$part_at" || die "--partition-at: expected S (seconds) or FILE:N, found '$part_at'" ;;
esac
isnum "$np" && [ "$np" -ge 1 ] || die "--np: expected an integer >= 1, found '$np'"
case "$transport" in
  tcp) tflags=(--mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include 10.77.0.0/24) ;;
  shm) tflags=(--mca pml ob1 --mca btl self,vader,tcp --mca btl_tcp_if_include 10.77.0.0/24) ;;
  ucx) tflags=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any -x UCX_NET_DEVICES=eth0) ;;
  *) die "--transport: expected tcp, shm or ucx, found '$transport'" ;;
esac

# What we need before touching anything.
[ "$(id -u)" = 0 ] || skip "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
command -v unshare >/dev/null || skip "no 'unshare' command (util-linux)"
command -v mpirun >/dev/null || skip "no 'mpirun' on PATH"
command -v timeout >/dev/null || skip "no 'timeout' command (coreutils)"

# Names unique to this run, so concurrent runs do not collide (interface names live inside the
# namespaces, so only the namespace names must differ).
prefix="g5nt$$"
sw="${prefix}sw"
work=$(mktemp -d "${TMPDIR:-/tmp}/netns-test.XXXXXX")
created=()

part_pid=""
teardown() {
  local ns
  [ -z "$part_pid" ] || kill "$part_pid" 2>/dev/null || true
  for ns in "${created[@]}"; do
    # Stray ranks or daemons of this run (a timeout, a crash) die with their namespace.
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

addns() {
  ip netns add "$1" 2>"$work/err" || {
    [ ${#created[@]} -eq 0 ] && skip "cannot create a network namespace: $(tr '\n' ' ' <"$work/err")"
    die "ip netns add $1: $(cat "$work/err")"
  }
  created+=("$1")
}

# Topology: bridge br0 in namespace $sw; host i = namespace ${prefix}h$i with eth0 = 10.77.0.i/24,
# the other veth end p$i enslaved to br0. Both ends are created in place.
addns "$sw"
if ! ip -n "$sw" link add br0 type bridge 2>"$work/err"; then
  skip "cannot create a bridge (no CAP_NET_ADMIN or no bridge support): $(tr '\n' ' ' <"$work/err")"
fi
ip -n "$sw" link set br0 up
ip -n "$sw" link set lo up
for i in $(seq 1 "$hosts"); do
  ns="${prefix}h$i"
  addns "$ns"
  if ! ip link add eth0 netns "$ns" type veth peer name "p$i" netns "$sw" 2>"$work/err"; then
    [ "$i" = 1 ] && skip "cannot create veth pairs: $(tr '\n' ' ' <"$work/err")"
    die "veth for host $i: $(cat "$work/err")"
  fi
  ip -n "$sw" link set "p$i" master br0
  ip -n "$sw" link set "p$i" up
  ip -n "$ns" link set lo up  # Open MPI needs loopback in every namespace
  ip -n "$ns" addr add "10.77.0.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  echo "10.77.0.$i slots=$slots" >>"$work/hostfile"
done
if ! ip netns exec "${prefix}h1" unshare --uts true 2>"$work/err"; then
  skip "cannot enter a namespace with a new hostname (no CAP_SYS_ADMIN?): $(tr '\n' ' ' <"$work/err")"
fi

# The rsh agent: Open MPI calls it like ssh (options, host, remote command as shell words), also
# from inside a namespace when daemons tree-spawn. It maps the host to its namespace and gives
# the process its own hostname there.
cat >"$work/nsrsh" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do
  case "\$1" in -x|-n|-T|-q|-t|-tt) shift ;; -o|-p|-l|-i) shift 2 ;; *) break ;; esac
done
host=\$1; shift
case "\$host" in
  10.77.0.*) i=\${host##*.} ;;
  h[0-9]*) i=\${host#h} ;;
  *) echo "nsrsh: unknown host \$host" >&2; exit 255 ;;
esac
exec ip netns exec "${prefix}h\$i" unshare --uts sh -c "hostname h\$i; \$*"
EOF
# The head host runs mpirun under its own hostname too.
cat >"$work/head" <<'EOF'
#!/bin/sh
hostname h1
exec "$@"
EOF
chmod +x "$work/nsrsh" "$work/head"

# Link faults. netem does loss and delay in one qdisc; without it (a kernel built without
# sch_netem), loss is an nftables rule and delay cannot be had.
has_netem() { ip netns exec "${prefix}h1" tc qdisc add dev lo root netem delay 0ms 2>/dev/null &&
  ip netns exec "${prefix}h1" tc qdisc del dev lo root 2>/dev/null; }
nft_in() { ip netns exec "$1" nft "${@:2}"; }
faults=()
if [ -n "$loss$delay$shape" ]; then
  netem=0
  has_netem && netem=1
  [ -z "$delay" ] || [ "$netem" = 1 ] || skip "--delay needs tc netem, which this kernel lacks (sch_netem)"
  [ -z "$loss" ] || [ "$netem" = 1 ] || command -v nft >/dev/null || skip "--loss needs tc netem or nftables (nft)"
  for i in $(seq 1 "$hosts"); do
    ns="${prefix}h$i"
    if [ "$netem" = 1 ] && [ -n "$loss$delay" ]; then
      ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem ${delay:+delay "${delay}ms"} ${loss:+loss "$loss%"}
      [ -z "$shape" ] || ip netns exec "$ns" tc qdisc add dev eth0 parent 1: handle 2: tbf rate "$shape" burst 32kbit latency 50ms
    else
      [ -z "$shape" ] || ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$shape" burst 32kbit latency 50ms
      if [ -n "$loss" ]; then
        nft_in "$ns" add table inet g5loss
        nft_in "$ns" 'add chain inet g5loss out { type filter hook output priority 0; }'
        nft_in "$ns" add rule inet g5loss out oifname eth0 numgen random mod 100 '<' "$loss" drop
      fi
    fi
  done
  [ -z "$loss" ] || faults+=("loss $loss% ($([ "$netem" = 1 ] && echo netem || echo nftables))")
  [ -z "$delay" ] || faults+=("delay ${delay} ms")
  [ -z "$shape" ] || faults+=("shaped to $shape")
fi
if [ -n "$part_at" ]; then
  command -v nft >/dev/null || skip "--partition-at needs nftables (nft)"
  faults+=("h2 cut off at $part_at${part_for:+ for ${part_for} s}")
fi

# Cuts h2 off when $part_at comes, and heals it after $part_for seconds (runs in the background).
partition() {
  local ns="${prefix}h2" file n
  case "$part_at" in
    *:*) file=${part_at%:*} n=${part_at##*:}
         until [ -f "$file" ] && [ "$(wc -l <"$file")" -ge "$n" ]; do
           kill -0 $$ 2>/dev/null || return 0  # the test is over
           sleep 0.05
         done ;;
    *) sleep "$part_at" ;;
  esac
  nft_in "$ns" add table inet g5cut
  nft_in "$ns" 'add chain inet g5cut in { type filter hook input priority 0; }'
  nft_in "$ns" 'add chain inet g5cut out { type filter hook output priority 0; }'
  nft_in "$ns" add rule inet g5cut in iifname eth0 drop
  nft_in "$ns" add rule inet g5cut out oifname eth0 drop
  echo "netns-test: h2 cut off ($(date +%T))" >&2
  [ -n "$part_for" ] || return 0
  sleep "$part_for"
  nft_in "$ns" delete table inet g5cut
  echo "netns-test: h2 back ($(date +%T))" >&2
}

cmd=(mpirun --allow-run-as-root -np "$np" --hostfile "$work/hostfile")
[ "$np" -gt $((hosts * slots)) ] && cmd+=(--oversubscribe)
cmd+=(--mca plm_rsh_agent "$work/nsrsh" --mca oob_tcp_if_include 10.77.0.0/24 "${tflags[@]}")
cmd+=("${extra[@]}")
printf '%s\n' "${cmd[@]:4}" >"$work/mpirun_args"  # what follows mpirun --allow-run-as-root -np N
if [ "$no_mpirun" = 1 ]; then
  cmd=(env NETNS_TEST_MPIRUN_ARGS="$work/mpirun_args" "$@")
else
  cmd+=("$@")
fi

bridge_bytes() {
  local total=0 i b
  for i in $(seq 1 "$hosts"); do
    b=$(ip netns exec "$sw" cat "/sys/class/net/p$i/statistics/tx_bytes" 2>/dev/null || echo 0)
    total=$((total + b))
  done
  echo "$total"
}

echo "netns-test: $hosts hosts x $slots slots, -np $np, transport $transport; hosts h1..h$hosts =" \
     "namespaces ${prefix}h1..${prefix}h$hosts (10.77.0.1-$hosts)" >&2
[ ${#faults[@]} = 0 ] || echo "netns-test: faults: $(IFS=';'; echo "${faults[*]}" | sed 's/;/; /g')" >&2
if [ -n "$part_at" ]; then
  partition &
  part_pid=$!
fi
before=$(bridge_bytes)
# In the background and waited for, so that INT/TERM reach the traps (and the teardown) at once;
# stdin stays the script's.
rc=0
timeout --kill-after=10 "$timeout_s" ip netns exec "${prefix}h1" unshare --uts "$work/head" \
  "${cmd[@]}" <&0 &
wait $! || rc=$?
[ -z "$part_pid" ] || kill "$part_pid" 2>/dev/null || true
after=$(bridge_bytes)
echo "netns-test: $([ "$no_mpirun" = 1 ] && echo "$1" || echo mpirun) exit status $rc; $((after - before)) bytes crossed the bridge" >&2
[ "$rc" = 124 ] && echo "netns-test: timed out after ${timeout_s}s" >&2
exit "$rc"
