#!/bin/bash
# The step runner the GPU session scripts source (gpu_tests_session.sh, pallas_gpu_session.sh).
# step NAME CAP_SECONDS COMMAND...: runs COMMAND under `timeout` (SIGINT at the cap, SIGKILL 10 s later) with its
# output in $STEP_DIR/NAME.log, prints the log's last $STEP_TAIL lines (default 4) and appends "NAME rc=RC Ns" to
# $STEP_DIR/steps.tsv; a NAME listed in $SKIP (space-separated) is skipped.
step() {  # step NAME CAP_SECONDS COMMAND...
  local name=$1 cap=$2
  shift 2
  case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped"; return;; esac
  echo "== $name (cap ${cap}s): $*"
  local t0=$SECONDS
  timeout -s INT -k 10 "$cap" "$@" > "$STEP_DIR/$name.log" 2>&1
  local rc=$?
  tail -n "${STEP_TAIL:-4}" "$STEP_DIR/$name.log"
  printf '%s\trc=%s\t%ss\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEP_DIR/steps.tsv"
}
