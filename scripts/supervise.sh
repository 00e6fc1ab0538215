#!/usr/bin/env bash
# Runs a training command and relaunches it after a failure, so that a run with
# `--set checkpoint.resume=auto` continues from its newest checkpoint:
#
#   scripts/supervise.sh [--retries N] [--delay SECONDS] [--grace SECONDS] [--log FILE] \
#       -- COMMAND [ARGS...]
#   scripts/supervise.sh --retries 5 -- mpirun -np 4 build/trainer train cfg.toml \
#       --set checkpoint.resume=auto
#
# The trainer's exit codes decide what happens next:
#   0        finished                                -> exit 0
#   2        bad config, data or checkpoint          -> exit 2 at once (a retry cannot help)
#   3        training diverged                       -> exit 3 at once (it would again)
#   75       stopped by SIGTERM/SIGUSR1 after writing a checkpoint -> restart
#   anything else (a crash, a rank killed by a signal, mpirun's own codes) -> restart
# Every restart counts against --retries (default 3, so at most 4 attempts); when it is
# spent the supervisor exits with the last attempt's code.
#
# The trainer's code is read from the run's status (trainer/run_dir.h), not only from the
# command's exit: the supervisor points TRAINER_STATUS_FILE at a file of its own (unless it is
# set already), and the trainer's rank 0 writes the run's final state there once every rank
# has finished, checkpoint included. The command runs in a session of its own, and after it
# exits the supervisor waits (at most --grace seconds, default 120) until no process of that
# session is left: a launcher that returns before its ranks (mpirun given SIGTERM exits 1 at
# once while its ranks still write their checkpoint) then cannot make the supervisor report
# or restart anything while they run. A status that is final gives the code; a run that left
# "running" (a crash) or no status at all (bad input, not the trainer) leaves the command's.
#
# SIGTERM and SIGUSR1 sent to the supervisor are forwarded to the command as SIGUSR1, which
# the trainer treats like SIGTERM (finish the step, checkpoint, exit 75) and which Open MPI's
# mpirun and Slurm's srun pass on to every rank while waiting for them (on SIGTERM, mpirun
# exits at once with its own code 1). SIGINT is forwarded as SIGINT. After a forwarded signal
# the supervisor does not restart; it exits with the trainer's code (75 after a checkpoint, so
# that Slurm or whoever sent the signal can requeue the job).
#
# The command sees TRAINER_SUPERVISE_ATTEMPT=<k> (1-based) in its environment.
set -euo pipefail

usage="usage: supervise.sh [--retries N] [--delay SECONDS] [--grace SECONDS] [--log FILE] -- COMMAND [ARGS...]"

die_usage() {
  printf 'supervise: %s; %s\n' "$1" "$usage" >&2
  exit 2
}

retries=3
delay=5
grace=120
log=""

while (($# > 0)); do
  case "$1" in
    --retries | --delay | --grace | --log)
      (($# >= 2)) || die_usage "$1 needs a value"
      opt=$1 val=$2
      shift 2
      ;;
    --retries=* | --delay=* | --grace=* | --log=*)
      opt=${1%%=*} val=${1#*=}
      shift
      ;;
    -h | --help)
      printf '%s\n' "$usage"
      exit 0
      ;;
    --)
      shift
      break
      ;;
    *) die_usage "unknown option '$1' (the command goes after --)" ;;
  esac
  case "$opt" in
    --retries)
      [[ $val =~ ^[0-9]+$ ]] || die_usage "--retries wants a whole number >= 0, got '$val'"
      retries=$((10#$val))
      ;;
    --delay)
      [[ $val =~ ^[0-9]+([.][0-9]+)?$ ]] || die_usage "--delay wants seconds >= 0, got '$val'"
      delay=$val
      ;;
    --grace)
      [[ $val =~ ^[0-9]+$ ]] || die_usage "--grace wants whole seconds >= 0, got '$val'"
      grace=$((10#$val))
      ;;
    --log)
      [[ -n $val ]] || die_usage "--log wants a file name"
      log=$val
      ;;
  esac
done

# `$# == 0` here means either no `--` at all or nothing after it.
(($# > 0)) || die_usage "missing '-- COMMAND'"
# A command that does not exist fails the same way on every attempt.
command -v -- "$1" >/dev/null 2>&1 || die_usage "command not found: $1"
if [[ -n $log ]]; then
  { : >>"$log"; } 2>/dev/null || die_usage "cannot append to log file '$log'"
fi

say() {
  printf 'supervise: %s\n' "$1" >&2
  if [[ -n $log ]]; then
    printf 'supervise: %s\n' "$1" >>"$log" || true
  fi
}

# "137 (SIGKILL)" for 128+n, "75 (stopped after checkpoint)", "2 (bad input)", else "1".
describe() {
  local rc=$1 name
  if ((rc > 128)) && name=$(kill -l "$rc" 2>/dev/null); then
    printf '%s (SIG%s)' "$rc" "${name#SIG}"
  elif ((rc == 75)); then
    printf '%s (stopped after checkpoint)' "$rc"
  elif ((rc == 2)); then
    printf '%s (bad input)' "$rc"
  elif ((rc == 3)); then
    printf '%s (training diverged)' "$rc"
  else
    printf '%s' "$rc"
  fi
}

child_pid=""  # the running command, the target of forwarded signals
pending=""    # a signal that arrived before the command was started, forwarded once it is
sleep_pid=""  # the delay between attempts, cut short by a signal
signalled=""  # the last signal the supervisor received; once set, nothing is restarted
trapped=0     # set by a trap: `wait` returned early and must be repeated

# shellcheck disable=SC2317  # only reached through the traps below
on_signal() {
  signalled=$1
  trapped=1
  local forward=USR1  # TERM too: see the header
  [[ $1 == INT ]] && forward=INT
  if [[ -n $child_pid ]]; then
    kill -s "$forward" "$child_pid" 2>/dev/null || true
  else
    pending=$forward
  fi
  if [[ -n $sleep_pid ]]; then
    kill "$sleep_pid" 2>/dev/null || true
  fi
}
trap 'on_signal TERM' TERM
trap 'on_signal USR1' USR1
trap 'on_signal INT' INT

# Waits for process $1 and sets rc to its exit status. A trapped signal makes `wait` return
# early (with 128+signal) while the child still runs, so wait again; bash keeps the status of
# a finished background job, so a repeated wait also returns the right code when the child
# ended at the same moment.
wait_child() {
  while :; do
    trapped=0
    rc=0
    wait "$1" || rc=$?
    if ((trapped)) && ((rc > 128)); then
      continue
    fi
    break
  done
}

# The run's status file (trainer/run_dir.h): the trainer's own if set, else one of ours.
status_dir=""
if [[ -z ${TRAINER_STATUS_FILE:-} ]]; then
  status_dir=$(mktemp -d)
  trap 'rm -rf "$status_dir"' EXIT
  export TRAINER_STATUS_FILE=$status_dir/status.json
fi

# Waits (at most --grace seconds) until no process of session $1 is left: the ranks a launcher
# left behind finish their checkpoint and their status first.
wait_session() {
  local i
  for ((i = 0; i < grace * 10; i++)); do
    pgrep -s "$1" >/dev/null 2>&1 || return 0
    sleep 0.1
  done
  say "processes of attempt $k still running after --grace $grace s"
}

# Sets status_code and status_text from a final status ("" when there is none).
read_status() {
  status_code="" status_text=""
  [[ -f $TRAINER_STATUS_FILE ]] || return 0
  local line
  line=$(<"$TRAINER_STATUS_FILE")
  [[ $line =~ \"state\":\"(finished|stopped|failed)\" ]] || return 0
  status_text=${BASH_REMATCH[1]}
  [[ $line =~ \"code\":([0-9]+) ]] && status_code=${BASH_REMATCH[1]}
  if [[ $line =~ \"reason\":\"([^\"]*)\" ]]; then status_text+=": ${BASH_REMATCH[1]}"; fi
  return 0
}

attempts=$((retries + 1))
rc=0
for ((k = 1; k <= attempts; k++)); do
  if [[ -n $signalled ]]; then
    # Told to stop between attempts (or before the first): do not start another.
    ((k > 1)) || rc=$((128 + $(kill -l "$signalled")))
    say "received SIG$signalled before attempt $k/$attempts; exiting with $rc"
    exit "$rc"
  fi
  export TRAINER_SUPERVISE_ATTEMPT=$k
  rm -f "$TRAINER_STATUS_FILE"
  # Asynchronous commands of a non-interactive shell start with SIGINT and SIGQUIT ignored,
  # which would make a forwarded SIGINT a no-op: restore the defaults before exec. setsid
  # makes the command the leader of a new session (its pid is the session id) that its
  # local processes keep even when it exits before them.
  (
    trap - INT QUIT
    exec setsid "$@"
  ) &
  child_pid=$!
  if [[ -n $pending ]]; then
    kill -s "$pending" "$child_pid" 2>/dev/null || true
    pending=""
  fi
  wait_child "$child_pid"
  wait_session "$child_pid"
  child_pid=""
  read_status
  what="attempt $k/$attempts exited with $(describe "$rc")"
  if [[ -n $status_code ]] && ((status_code != rc)); then
    what="attempt $k/$attempts: the command exited with $rc; the trainer's status: $(describe "$status_code")"
    rc=$status_code
  fi
  [[ -n $status_text ]] && say "attempt $k/$attempts: trainer status $status_text"

  if ((rc == 0)); then
    say "$what; done"
    exit 0
  fi
  if ((rc == 2 || rc == 3)); then
    say "$what; not retrying"
    exit "$rc"
  fi
  if [[ -n $signalled ]]; then
    say "$what after SIG$signalled; not restarting"
    exit "$rc"
  fi
  if ((k == attempts)); then
    break
  fi
  say "$what; restarting in $delay s"
  if [[ $delay != 0 ]]; then
    # In the background so that a signal during the delay is handled at once.
    sleep "$delay" &
    sleep_pid=$!
    # A signal that came before sleep_pid was set found no delay to cut short: cut it now.
    if [[ -n $signalled ]]; then
      kill "$sleep_pid" 2>/dev/null || true
    fi
    last_rc=$rc
    wait_child "$sleep_pid"
    rc=$last_rc
    sleep_pid=""
  fi
done

say "giving up after $attempts attempts, last exit $rc"
exit "$rc"
