#!/usr/bin/env bash
# Runs a training command and relaunches it after a failure, so that a run with
# `--set checkpoint.resume=auto` continues from its newest checkpoint:
#
#   scripts/supervise.sh [--retries N] [--delay SECONDS] [--log FILE] -- COMMAND [ARGS...]
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
# SIGTERM, SIGUSR1 and SIGINT sent to the supervisor are forwarded to the command; it then
# does not restart and exits with the command's code (75 after a checkpoint, so that Slurm
# or whoever sent the signal can requeue the job). Open MPI's mpirun forwards such a signal
# to the ranks but reports its own exit code (1) rather than theirs.
#
# The command sees TRAINER_SUPERVISE_ATTEMPT=<k> (1-based) in its environment.
set -euo pipefail

usage="usage: supervise.sh [--retries N] [--delay SECONDS] [--log FILE] -- COMMAND [ARGS...]"

die_usage() {
  printf 'supervise: %s; %s\n' "$1" "$usage" >&2
  exit 2
}

retries=3
delay=5
log=""

while (($# > 0)); do
  case "$1" in
    --retries | --delay | --log)
      (($# >= 2)) || die_usage "$1 needs a value"
      opt=$1 val=$2
      shift 2
      ;;
    --retries=* | --delay=* | --log=*)
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
  if [[ -n $child_pid ]]; then
    kill -s "$1" "$child_pid" 2>/dev/null || true
  else
    pending=$1
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
  # Asynchronous commands of a non-interactive shell start with SIGINT and SIGQUIT ignored,
  # which would make a forwarded SIGINT a no-op: restore the defaults before exec.
  (
    trap - INT QUIT
    exec "$@"
  ) &
  child_pid=$!
  if [[ -n $pending ]]; then
    kill -s "$pending" "$child_pid" 2>/dev/null || true
    pending=""
  fi
  wait_child "$child_pid"
  child_pid=""
  what="attempt $k/$attempts exited with $(describe "$rc")"

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
    last_rc=$rc
    wait_child "$sleep_pid"
    rc=$last_rc
    sleep_pid=""
  fi
done

say "giving up after $attempts attempts, last exit $rc"
exit "$rc"
