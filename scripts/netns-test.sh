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
# Example: scripts/netns-test.sh --hosts 3 --slots 1 -- \
#            sh -c 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname) $(readlink /proc/self/ns/net)"'
# SC2015: `a && b || die` is meant; SC2054: commas are MCA list values; SC2317: trap functions.
# shellcheck disable=SC2015,SC2054,SC2317
set -euo pipefail

usage() { sed -n '8,19p' "$0" | sed 's/^# \{0,1\}//'; }
skip() { echo "netns-test: skipped: $*" >&2; exit 77; }
die() { echo "netns-test: error: $*" >&2; exit 2; }

hosts=2 slots=2 np="" transport=tcp timeout_s=300
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) hosts=${2:?--hosts needs a value}; shift 2 ;;
    --slots) slots=${2:?--slots needs a value}; shift 2 ;;
    --np) np=${2:?--np needs a value}; shift 2 ;;
    --transport) transport=${2:?--transport needs a value}; shift 2 ;;
    --timeout) timeout_s=${2:?--timeout needs a value}; shift 2 ;;
    --mpirun-arg) extra+=("${2?--mpirun-arg needs a value}"); shift 2 ;;
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

teardown() {
  local ns
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

cmd=(mpirun --allow-run-as-root -np "$np" --hostfile "$work/hostfile")
[ "$np" -gt $((hosts * slots)) ] && cmd+=(--oversubscribe)
cmd+=(--mca plm_rsh_agent "$work/nsrsh" --mca oob_tcp_if_include 10.77.0.0/24 "${tflags[@]}")
cmd+=("${extra[@]}" "$@")

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
before=$(bridge_bytes)
# In the background and waited for, so that INT/TERM reach the traps (and the teardown) at once;
# stdin stays the script's.
rc=0
timeout --kill-after=10 "$timeout_s" ip netns exec "${prefix}h1" unshare --uts "$work/head" \
  "${cmd[@]}" <&0 &
wait $! || rc=$?
after=$(bridge_bytes)
echo "netns-test: mpirun exit status $rc; $((after - before)) bytes crossed the bridge" >&2
[ "$rc" = 124 ] && echo "netns-test: timed out after ${timeout_s}s" >&2
exit "$rc"
