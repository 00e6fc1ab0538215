#!/usr/bin/env bash
# Control-flow test of scripts/supervise.sh with small shell commands standing in for the
# trainer (no build needed): retries, exit codes 0/2/75, signal names, signal forwarding,
# the attempt variable, --log, the run's status file and the wait for what a launcher leaves
# behind, and argument errors. Prints PASS/FAIL per case; exits 1 if
# any case failed. Runs in a few seconds.
# The child commands are single-quoted on purpose: they expand in the child.
# shellcheck disable=SC2016
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
sup="$here/scripts/supervise.sh"
tmp=$(mktemp -d)
bg_pids=()
cleanup() {
  local p
  for p in "${bg_pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

failures=0
pass() { printf 'PASS %s\n' "$1"; }
fail() {
  printf 'FAIL %s: %s\n' "$1" "$2"
  if [[ -f $tmp/err ]]; then sed 's/^/    stderr: /' "$tmp/err"; fi
  failures=$((failures + 1))
}

# Runs the supervisor in the foreground (bounded by a timeout); sets rc, stderr in $tmp/err.
run_sup() {
  rc=0
  timeout 15 bash "$sup" "$@" 2>"$tmp/err" >/dev/null || rc=$?
}

# Starts the supervisor in the background with SIGINT at its default (a background job of a
# script would otherwise start with SIGINT ignored, and then bash cannot trap it).
start_sup() {
  (
    trap - INT QUIT
    exec bash "$sup" "$@" 2>"$tmp/err" >/dev/null
  ) &
  sup_pid=$!
  bg_pids+=("$sup_pid")
}

# Waits up to 5 s for a file to appear.
wait_for() {
  local i
  for ((i = 0; i < 100; i++)); do
    [[ -e $1 ]] && return 0
    sleep 0.05
  done
  return 1
}

# Waits up to 5 s for the background supervisor; sets rc (124 when it did not end).
wait_sup() {
  local i
  for ((i = 0; i < 100; i++)); do
    kill -0 "$sup_pid" 2>/dev/null || break
    sleep 0.05
  done
  if kill -0 "$sup_pid" 2>/dev/null; then
    kill -KILL "$sup_pid" 2>/dev/null
    wait "$sup_pid" 2>/dev/null
    rc=124
    return
  fi
  rc=0
  wait "$sup_pid" || rc=$?
}

count() { if [[ -f $1 ]]; then wc -l <"$1" | tr -d ' '; else echo 0; fi; }
has() { grep -qF -- "$1" "$tmp/err"; }

# --- fails twice with 1, then succeeds ---------------------------------------------------
name=flaky_then_success
c="$tmp/$name"
run_sup --delay 0 -- bash -c 'echo x >>"$1"; [ "$(wc -l <"$1")" -ge 3 ] || exit 1' _ "$c"
if [[ $rc != 0 ]]; then fail $name "exit $rc, want 0"
elif [[ $(count "$c") != 3 ]]; then fail $name "$(count "$c") attempts, want 3"
elif ! has "supervise: attempt 1/4 exited with 1; restarting in 0 s" ||
  ! has "supervise: attempt 2/4 exited with 1; restarting in 0 s" ||
  ! has "supervise: attempt 3/4 exited with 0; done"; then fail $name "messages"
else pass $name; fi

# --- exit 2 (bad input): no retry ---------------------------------------------------------
name=bad_input_no_retry
c="$tmp/$name"
run_sup --delay 0 -- bash -c 'echo x >>"$1"; exit 2' _ "$c"
if [[ $rc != 2 ]]; then fail $name "exit $rc, want 2"
elif [[ $(count "$c") != 1 ]]; then fail $name "$(count "$c") attempts, want 1"
elif ! has "attempt 1/4 exited with 2 (bad input); not retrying"; then fail $name "message"
else pass $name; fi

# --- a diverged run (exit 3) is not retried either ----------------------------------------
name=diverged_no_retry
c="$tmp/$name"
run_sup --delay 0 -- bash -c 'echo x >>"$1"; exit 3' _ "$c"
if [[ $rc != 3 ]]; then fail $name "exit $rc, want 3"
elif [[ $(count "$c") != 1 ]]; then fail $name "$(count "$c") attempts, want 1"
elif ! has "attempt 1/4 exited with 3 (training diverged); not retrying"; then fail $name "message"
else pass $name; fi

# --- always fails: retries+1 attempts, then the last code ---------------------------------
name=always_fails_gives_up
c="$tmp/$name"
run_sup --retries 2 --delay 0 -- bash -c 'echo x >>"$1"; exit 4' _ "$c"
if [[ $rc != 4 ]]; then fail $name "exit $rc, want 4"
elif [[ $(count "$c") != 3 ]]; then fail $name "$(count "$c") attempts, want 3"
elif ! has "supervise: attempt 2/3 exited with 4; restarting in 0 s" ||
  ! has "supervise: giving up after 3 attempts, last exit 4" ||
  has "attempt 4/"; then fail $name "messages"
else pass $name; fi

# --- --retries 0: a single attempt ----------------------------------------------------------
name=retries_zero
c="$tmp/$name"
run_sup --retries 0 --delay 0 -- bash -c 'echo x >>"$1"; exit 1' _ "$c"
if [[ $rc != 1 || $(count "$c") != 1 ]]; then fail $name "exit $rc after $(count "$c") attempts"
elif ! has "giving up after 1 attempts, last exit 1"; then fail $name "message"
else pass $name; fi

# --- killed by SIGKILL: restarted, the message names the signal ---------------------------
name=sigkill_restarts
c="$tmp/$name"
run_sup --delay 0 -- bash -c 'echo x >>"$1"; [ "$(wc -l <"$1")" -ge 2 ] || kill -9 $$' _ "$c"
if [[ $rc != 0 ]]; then fail $name "exit $rc, want 0"
elif [[ $(count "$c") != 2 ]]; then fail $name "$(count "$c") attempts, want 2"
elif ! has "supervise: attempt 1/4 exited with 137 (SIGKILL); restarting in 0 s"; then
  fail $name "message"
else pass $name; fi

# --- exit 75 without a signal to the supervisor: restarted, counts as an attempt ----------
name=exit75_restarts
c="$tmp/$name"
run_sup --retries 1 --delay 0 -- bash -c 'echo x >>"$1"; exit 75' _ "$c"
if [[ $rc != 75 ]]; then fail $name "exit $rc, want 75"
elif [[ $(count "$c") != 2 ]]; then fail $name "$(count "$c") attempts, want 2"
elif ! has "attempt 1/2 exited with 75 (stopped after checkpoint); restarting in 0 s"; then
  fail $name "message"
else pass $name; fi

# --- the attempt number in the environment ------------------------------------------------
name=attempt_variable
c="$tmp/$name"
run_sup --delay 0 -- bash -c 'echo "$TRAINER_SUPERVISE_ATTEMPT" >>"$1"; [ "$TRAINER_SUPERVISE_ATTEMPT" = 3 ]' _ "$c"
seen=$(tr '\n' ' ' <"$c")
if [[ $rc != 0 || $seen != "1 2 3 " ]]; then fail $name "exit $rc, saw '$seen', want '1 2 3 '"
else pass $name; fi

# --- --log appends the same lines -----------------------------------------------------------
name=log_file
c="$tmp/$name"
echo "earlier line" >"$c.log"
run_sup --delay 0 --log "$c.log" -- bash -c 'echo x >>"$1"; [ "$(wc -l <"$1")" -ge 2 ] || exit 1' _ "$c"
if [[ $rc != 0 ]]; then fail $name "exit $rc, want 0"
elif [[ $(head -n1 "$c.log") != "earlier line" ]]; then fail $name "log was truncated"
elif ! diff <(tail -n +2 "$c.log") <(grep '^supervise: ' "$tmp/err") >/dev/null; then
  fail $name "log differs from stderr"
elif [[ $(count "$c.log") != 3 ]]; then fail $name "$(count "$c.log") log lines, want 3"
else pass $name; fi

# A child that writes a checkpoint-like marker and exits 75 on SIGTERM/SIGUSR1, like the
# trainer; the inner sleep is killed so that nothing outlives the test.
graceful='echo x >>"$1"; trap '\''kill $! 2>/dev/null; exit 75'\'' TERM USR1; sleep 30 & wait $!; exit 1'

# --- SIGTERM to the supervisor: forwarded, the child's 75 returned, no restart ------------
for sig in TERM USR1; do
  name=sig${sig}_forwarded
  c="$tmp/$name"
  start=$SECONDS
  start_sup --delay 0 -- bash -c "$graceful" _ "$c"
  if ! wait_for "$c"; then fail $name "child did not start"; continue; fi
  sleep 0.2 # let the child install its trap
  kill -s "$sig" "$sup_pid"
  wait_sup
  if [[ $rc != 75 ]]; then fail $name "exit $rc, want 75"
  elif [[ $(count "$c") != 1 ]]; then fail $name "$(count "$c") attempts, want 1 (restarted?)"
  elif ((SECONDS - start > 4)); then fail $name "took $((SECONDS - start)) s"
  elif ! has "attempt 1/4 exited with 75 (stopped after checkpoint) after SIG$sig; not restarting"; then
    fail $name "message"
  else pass $name; fi
done

# --- SIGINT reaches a plain child (background jobs start with SIGINT ignored) -------------
name=sigint_forwarded
c="$tmp/$name"
start_sup --delay 0 -- bash -c 'echo x >>"$1"; exec sleep 30' _ "$c"
if ! wait_for "$c"; then fail $name "child did not start"
else
  sleep 0.2
  kill -INT "$sup_pid"
  wait_sup
  if [[ $rc != 130 ]]; then fail $name "exit $rc, want 130 (child killed by SIGINT)"
  elif [[ $(count "$c") != 1 ]]; then fail $name "$(count "$c") attempts, want 1"
  elif ! has "attempt 1/4 exited with 130 (SIGINT) after SIGINT; not restarting"; then
    fail $name "message"
  else pass $name; fi
fi

# --- a signal during the delay between attempts: no further attempt, exits at once ------
name=signal_during_delay
c="$tmp/$name"
start=$SECONDS
start_sup --delay 30 -- bash -c 'echo x >>"$1"; exit 1' _ "$c"
if ! wait_for "$c"; then fail $name "child did not start"
else
  for ((i = 0; i < 100; i++)); do has "restarting in 30 s" && break; sleep 0.05; done
  kill -TERM "$sup_pid"
  wait_sup
  if [[ $rc != 1 ]]; then fail $name "exit $rc, want 1"
  elif [[ $(count "$c") != 1 ]]; then fail $name "$(count "$c") attempts, want 1"
  elif ((SECONDS - start > 4)); then fail $name "took $((SECONDS - start)) s"
  elif ! has "received SIGTERM before attempt 2/4; exiting with 1"; then fail $name "message"
  else pass $name; fi
fi

# --- the trainer's status decides, not the launcher's code -------------------------------
# A launcher that exits 1 while the run's status (written by "rank 0" in $TRAINER_STATUS_FILE)
# says it stopped after a checkpoint: restarted as a 75, and the status is reported.
name=status_overrides_launcher_code
c="$tmp/$name"
run_sup --retries 1 --delay 0 -- bash -c 'echo x >>"$1"
  echo "{\"code\":75,\"reason\":\"stopped by a signal\",\"state\":\"stopped\",\"step\":4}" >"$TRAINER_STATUS_FILE"
  exit 1' _ "$c"
if [[ $rc != 75 ]]; then fail $name "exit $rc, want 75"
elif [[ $(count "$c") != 2 ]]; then fail $name "$(count "$c") attempts, want 2"
elif ! has "attempt 1/2: trainer status stopped: stopped by a signal" ||
  ! has "attempt 1/2: the command exited with 1; the trainer's status: 75 (stopped after checkpoint); restarting in 0 s"; then
  fail $name "messages"
else pass $name; fi

# A status left "running" (a crash) leaves the launcher's code.
name=running_status_is_a_crash
c="$tmp/$name"
run_sup --retries 0 --delay 0 -- bash -c 'echo x >>"$1"
  echo "{\"code\":null,\"state\":\"running\",\"step\":4}" >"$TRAINER_STATUS_FILE"; exit 9' _ "$c"
if [[ $rc != 9 ]]; then fail $name "exit $rc, want 9"
elif has "trainer status"; then fail $name "reported a status"
else pass $name; fi

# The launcher returns before its "ranks": the supervisor waits for every process of the
# command's session, and only then reads the status they wrote.
name=waits_for_processes_the_launcher_left
c="$tmp/$name"
start=$SECONDS
run_sup --retries 0 --delay 0 -- bash -c 'echo x >>"$1"
  (sleep 1; echo "{\"code\":0,\"state\":\"finished\",\"step\":8}" >"$TRAINER_STATUS_FILE") &
  exit 1' _ "$c"
if [[ $rc != 0 ]]; then fail $name "exit $rc, want 0"
elif ((SECONDS - start < 1)); then fail $name "did not wait"
elif ! has "the trainer's status: 0; done"; then fail $name "message"
else pass $name; fi

# ... but not longer than --grace.
name=grace_bounds_the_wait
c="$tmp/$name"
start=$SECONDS
run_sup --retries 0 --delay 0 --grace 1 -- bash -c 'echo x >>"$1"; (exec sleep 30) & exit 1' _ "$c"
if [[ $rc != 1 ]]; then fail $name "exit $rc, want 1"
elif ((SECONDS - start > 5)); then fail $name "took $((SECONDS - start)) s"
elif ! has "processes of attempt 1 still running after --grace 1 s"; then fail $name "message"
else pass $name; fi
pkill -f "^sleep 30$" 2>/dev/null || true

# --- argument errors: one line on stderr, exit 2 -------------------------------------------
bad_usage() {
  local name=$1
  shift
  run_sup "$@"
  if [[ $rc != 2 ]]; then fail "$name" "exit $rc, want 2"
  elif [[ $(count "$tmp/err") != 1 ]] || ! has "usage: supervise.sh"; then
    fail "$name" "want one usage line on stderr"
  else pass "$name"; fi
}
bad_usage usage_no_separator true
bad_usage usage_no_command --retries 1 --
bad_usage usage_unknown_option --bogus -- true
bad_usage usage_bad_retries --retries x -- true
bad_usage usage_negative_delay --delay -1 -- true
bad_usage usage_bad_grace --grace 1.5 -- true
bad_usage usage_missing_value --log
bad_usage usage_command_not_found -- /nonexistent/trainer

if ((failures > 0)); then
  printf '%d case(s) failed\n' "$failures"
  exit 1
fi
echo "all passed"
