# Sourced by the benchmark scripts: how busy the machine was with other work during a run.
#   load_start        before the measured part (remembers the machine's and this script's CPU time)
#   load_report       after it: load average, CPU-seconds other processes used, and a WARNING when
#                     they took more than 5 % of the CPUs (the figures are then disturbed)
# CPU time of everything else = busy jiffies of the machine minus this script's own (its children's
# included), so a run disturbed by other work on a shared machine shows as such.
busy_jiffies() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
own_jiffies() { awk '{print $14 + $15 + $16 + $17}' "/proc/$$/stat"; }
load_start() {
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  LOAD_J0=$(busy_jiffies)
  LOAD_O0=$(own_jiffies)
  LOAD_T0=$(date +%s)
}
load_report() {
  local hz others wall
  hz=$(getconf CLK_TCK)
  others=$(( ($(busy_jiffies) - LOAD_J0 - ($(own_jiffies) - LOAD_O0)) / hz ))
  wall=$(( $(date +%s) - LOAD_T0 ))
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg); other processes used ${others} cpu-s of the $((wall * $(nproc))) available during the ${wall} s run"
  if [ $((others * 20)) -gt $((wall * $(nproc))) ]; then
    echo "WARNING: other work took more than 5% of the CPUs during the run: the figures are disturbed, run again"
  fi
}
