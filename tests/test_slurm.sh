#!/usr/bin/env bash
# scripts/slurm/train.sbatch under a real Slurm: a one-node cluster on this machine (munged,
# slurmctld and slurmd from a slurm.conf generated in a temporary directory, stopped
# afterwards) runs a 2-rank job through the script's own launch path (srun with PMIx, the
# site default here as on most clusters) and preempts it as a cluster does:
#   preempt:    scancel --signal=USR1 --batch while it trains;
#   time limit: --time=1 --signal=B:USR1@50, the warning before the limit (the test then raises
#               the limit so that the requeued run can finish).
# Each time the job must checkpoint, exit 75, requeue itself (scontrol requeue), resume from
# the checkpoint and complete (JobState=COMPLETED, ExitCode 0:0, Restarts=1), with weights and
# Adam moments bitwise equal to an uninterrupted run's (srun, same layout).
#
# Not covered here: several nodes (one slurmd), cgroup process tracking and task binding
# (proctrack/linuxproc and task/none, as a container allows), and the hard end of a time limit
# (SIGTERM then SIGKILL after KillWait), which the script does not rely on.
#
#   bash tests/test_slurm.sh TRAINER_BINARY
# Exit 0: passed; 1: failed; 77: skipped (not root, or Slurm/munge not installed).
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
trainer=${1:?usage: test_slurm.sh TRAINER_BINARY}
skip() {
  echo "SKIPPED: $*"
  exit 77
}
((EUID == 0)) || skip "slurmd and munged run as root here; not root"
for c in munged slurmctld slurmd sbatch srun scontrol scancel sinfo; do
  command -v "$c" >/dev/null || skip "$c not found (scripts/install_deps.sh installs slurm-wlm and munge)"
done
/usr/bin/python3 -c "import h5py" 2>/dev/null || skip "python3-h5py not installed"

tmp=$(mktemp -d /tmp/trainer_slurm.XXXXXX)
chmod 755 "$tmp"
failures=0
fail() {
  printf 'FAIL %s: %s\n' "$1" "$2"
  failures=$((failures + 1))
}
pass() { printf 'PASS %s\n' "$1"; }

stop_cluster() {
  [[ -f $tmp/slurm.conf ]] && timeout 10 scancel --full --quiet --user=root 2>/dev/null
  local f
  for f in slurmctld slurmd munged; do
    [[ -f $tmp/$f.pid ]] && kill "$(cat "$tmp/$f.pid")" 2>/dev/null
  done
  sleep 1
}
cleanup() {
  stop_cluster
  if ((failures > 0)); then
    for f in "$tmp"/*.log; do
      printf -- '--- %s\n' "$f"
      tail -n 40 "$f"
    done
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# --- the cluster ------------------------------------------------------------------------------
# Two free ports for slurmctld and slurmd, below the kernel's ephemeral range: outgoing
# connections take ports there at any moment, and once one took slurmctld's between this check
# and its bind (slurmctld died with "Address already in use" and the test waited 600 s).
ephemeral=$(awk '{print $1}' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null)
ephemeral=${ephemeral:-32768}
free_port() {
  local p
  while :; do
    p=$((10000 + RANDOM % (ephemeral - 10002)))
    ss -tanH 2>/dev/null | awk '{print $4}' | grep -qE ":($p|$((p + 1)))\$" || break
  done
  echo "$p"
}
host=$(hostname -s)
cpus=$(nproc)
mem=$(($(free -m | awk '/^Mem:/ {print $2}') / 2))
mkdir -p "$tmp/state" "$tmp/spool"
dd if=/dev/urandom of="$tmp/munge.key" bs=1024 count=1 2>/dev/null
chmod 400 "$tmp/munge.key"
munged --force --key-file="$tmp/munge.key" --socket="$tmp/munge.sock" \
  --pid-file="$tmp/munged.pid" --log-file="$tmp/munged.log" --seed-file="$tmp/munged.seed" ||
  skip "munged does not start here"
: >"$tmp/plugstack.conf"
alive() { [[ -f $tmp/$1.pid ]] && kill -0 "$(cat "$tmp/$1.pid")" 2>/dev/null; }
export SLURM_CONF=$tmp/slurm.conf
# Up to three ports: a daemon that cannot bind its port exits, and the next try takes others.
for ((try = 1; try <= 3; try++)); do
  port=$(free_port)
  # cred_expire=5 and sched_interval=1: a requeued job is eligible again after about 6 s (the
  # default is 2 minutes). OverSubscribe: the test's own srun runs beside nothing else anyway.
  cat >"$tmp/slurm.conf" <<EOF
ClusterName=trainertest
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
AuthInfo=socket=$tmp/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
PlugStackConfig=$tmp/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=pmix
ReturnToService=2
JobRequeue=1
MinJobAge=3600
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
  rm -f "$tmp"/slurmctld.pid "$tmp"/slurmd.pid
  slurmctld -f "$SLURM_CONF" || skip "slurmctld does not start here"
  slurmd -f "$SLURM_CONF" || skip "slurmd does not start here"
  # The node comes up within 20 s, unless a daemon died (each sinfo bounded: without a
  # controller it waits for its timeouts).
  for ((i = 0; i < 100; i++)); do
    [[ $(timeout 5 sinfo -h -o %t 2>/dev/null) == idle ]] && break
    alive slurmctld && alive slurmd || break
    sleep 0.2
  done
  [[ $(timeout 5 sinfo -h -o %t 2>/dev/null) == idle ]] && break
  echo "cluster: not up on ports $port-$((port + 1)) (try $try): $(tail -n 1 "$tmp/slurmctld.log" 2>/dev/null)"
  stop_cluster
  rm -rf "$tmp/state" "$tmp/spool"
  mkdir -p "$tmp/state" "$tmp/spool"
  munged --force --key-file="$tmp/munge.key" --socket="$tmp/munge.sock" \
    --pid-file="$tmp/munged.pid" --log-file="$tmp/munged.log" --seed-file="$tmp/munged.seed"
done
[[ $(timeout 5 sinfo -h -o %t 2>/dev/null) == idle ]] || {
  fail cluster "the node did not come up: $(timeout 5 sinfo 2>&1)"
  exit 1
}
echo "cluster up: node $host, $cpus CPUs, ports $port-$((port + 1))"

# --- the run: 2 ranks (dp 2), about 2 ms a step, 10 s in all -------------------------------
"$trainer" prepare --input "$here/tests/data/pride_and_prejudice_opening.txt" \
  --out-dir "$tmp/data" >/dev/null || {
  fail prepare "trainer prepare failed"
  exit 1
}
steps=5000
config() { # NAME: a config whose run directory is $tmp/NAME
  cat >"$tmp/$1.toml" <<EOF
[run]
out_dir = "$tmp/$1"
threads = 1
peak_tflops = 1.0
[model]
seq_len = 16
n_layer = 2
n_head = 2
d_model = 32
[data]
train = "$tmp/data/train.bin"
val = "$tmp/data/val.bin"
[train]
micro_batch = 16
steps = $steps
log_every = 2000
val_every = 0
sample_every = 0
EOF
}
config full
(cd "$tmp" && timeout 300 srun -n 2 "$trainer" train "$tmp/full.toml" >"$tmp/full.log" 2>&1) || {
  fail reference "the uninterrupted srun run failed"
  exit 1
}
echo "reference run done"

# Waits (at most $2 s) until step $1 is in $3's metrics.
wait_for_step() {
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    grep -q "\"step\":$1," "$tmp/$3/metrics.jsonl" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}
# Waits (at most $2 s) until job $1 has completed; prints its state line.
wait_completed() {
  local i
  for ((i = 0; i < $2 * 5; i++)); do
    scontrol show job "$1" | grep -q "JobState=COMPLETED" && return 0
    sleep 0.2
  done
  return 1
}
same_weights() { # NAME: its final checkpoint against the reference, bitwise
  local step_dir
  step_dir=$(printf 'step_%08d' "$steps")
  /usr/bin/python3 - "$tmp/full/checkpoints/$step_dir/state.h5" \
    "$tmp/$1/checkpoints/$step_dir/state.h5" <<'EOF'
import sys, h5py, numpy as np
a, b = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
names = []
a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and
             n.split("/")[0] in ("params", "optim") else None)
bad = [n for n in names if not np.array_equal(a[n][()], b[n][()])]
print(f"{len(names)} tensors compared, {len(bad)} differ {bad[:3]}")
sys.exit(1 if bad or not names else 0)
EOF
}
# A job's first attempt has its data loader 16 ms slower a step (the same batches, the same
# weights): ~80 s, so that a signal lands mid-run even when a loaded machine's controller
# delivers it late (once in CI, 30 s late) or the time limit's warning comes 40 s in. The
# requeued attempt (SLURM_RESTART_COUNT set) trains the rest at full speed.
cat >"$tmp/trainer_first_slow" <<EOF
#!/usr/bin/env bash
((\${SLURM_RESTART_COUNT:-0} > 0)) || export TRAINER_TEST_DATA_DELAY_MS=16
exec "$trainer" "\$@"
EOF
chmod 755 "$tmp/trainer_first_slow"
submit() { # NAME SBATCH_OPTIONS...: submits train.sbatch for config NAME; prints the job id
  local name=$1
  shift
  (cd "$here" && TRAINER=$tmp/trainer_first_slow sbatch --parsable --nodes=1 --ntasks-per-node=2 \
    --output="$tmp/$name-job.log" "$@" scripts/slurm/train.sbatch "$tmp/$name.toml")
}
check_job() { # NAME ID SIGNAL: the job's record and log after one preemption
  local name=$1 id=$2 sig=$3 info log
  info=$(scontrol show job "$id")
  log=$(cat "$tmp/$name-job.log")
  if ! grep -q "ExitCode=0:0" <<<"$info" || ! grep -q "Restarts=1 " <<<"$info"; then
    fail "$name" "job record: $(grep -E 'JobState|Restarts|ExitCode' <<<"$info" | tr -s ' ')"
  elif ! grep -q "received SIG$sig; asking the trainer to checkpoint and stop" <<<"$log" ||
    ! grep -q "trainer stopped after a checkpoint (exit 75, SIG$sig); requeueing" <<<"$log" ||
    ! grep -q "restart 1 on" <<<"$log" ||
    ! grep -q "resumed from $tmp/$name/checkpoints/step_" <<<"$log" ||
    ! grep -q "training finished" <<<"$log"; then
    fail "$name" "the job log lacks a step of checkpoint, requeue, resume, finish"
  elif ! grep -q '"state":"finished"' "$tmp/$name/status.json"; then
    fail "$name" "status: $(cat "$tmp/$name/status.json")"
  elif ! same_weights "$name"; then
    fail "$name" "final weights differ from the uninterrupted run's"
  else
    pass "$name"
  fi
}

# --- preemption: USR1 to the batch shell, as a preempting scheduler sends it ------------------
config preempt
id=$(submit preempt --time=10) || fail preempt "sbatch failed"
if wait_for_step 500 60 preempt; then
  # A controller slowed by a loaded machine can drop the request ("Unexpected missing socket
  # error", seen once in CI): retried while scancel says it failed.
  for _ in 1 2 3 4 5; do
    scancel --signal=USR1 --batch "$id" && break
    sleep 2
  done
  if wait_completed "$id" 180; then
    check_job preempt "$id" USR1
  else
    fail preempt "not completed: $(scontrol show job "$id" | grep -E 'JobState|Restarts')"
  fi
else
  fail preempt "the job did not start training: $(scontrol show job "$id" | grep JobState)"
fi

# --- the time limit's warning: --signal=B:USR1@50 on a one-minute limit -----------------------
# slurmctld checks time limits every 30 s, so the warning comes 10 to 40 s after the start,
# or up to a minute early as Slurm allows (seen: 1 to 26 s); its first attempt takes about 80 s,
# so it usually lands mid-run. Once the job has requeued itself, the limit is raised so that the
# rerun can finish.
# A warning that lands in the trainer's start-up (it then stops with nothing written, the rerun
# trains from the start) does not exercise the resume: that attempt is repeated once.
for name in timelimit timelimit_again; do
  config "$name"
  id=$(submit "$name" --time=1 --signal=B:USR1@50) || {
    fail "$name" "sbatch failed"
    break
  }
  requeued=0
  for ((i = 0; i < 600; i++)); do
    if grep -q "requeueing" "$tmp/$name-job.log" 2>/dev/null; then
      requeued=1
      break
    fi
    scontrol show job "$id" | grep -q "JobState=COMPLETED" && break
    sleep 0.2
  done
  if ((!requeued)); then
    fail "$name" "no requeue before the limit: $(scontrol show job "$id" | grep -E 'JobState')"
    break
  fi
  scontrol update JobId="$id" TimeLimit=10
  if ! wait_completed "$id" 180; then
    fail "$name" "not completed: $(scontrol show job "$id" | grep -E 'JobState|Restarts')"
    break
  fi
  if [[ $name == timelimit ]] &&
    grep -q "stopped by a signal during start-up" "$tmp/$name-job.log"; then
    echo "timelimit: Slurm sent the warning during the trainer's start-up; once more"
    continue
  fi
  check_job "$name" "$id" USR1
  break
done

if ((failures > 0)); then
  printf '%d case(s) failed\n' "$failures"
  exit 1
fi
echo "all passed"
