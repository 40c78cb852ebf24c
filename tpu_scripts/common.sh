#!/usr/bin/env bash
# Shared helpers for the spec_jax TPU / GPU host scripts (sourced, not run).
#
# run CMD ARGS...            runs the command, or with DRY_RUN=1 prints it (shell-quoted) instead.
# run_to FILE CMD ARGS...    the same, with stdout written to FILE.

DRY_RUN="${DRY_RUN:-0}"

# quote ARG: ARG as one POSIX shell word (bare when safe, else in single quotes).
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./=:,@%+~-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

run() {
  if [[ "${DRY_RUN}" == "1" ]]; then
    local quoted=()
    local arg
    for arg in "$@"; do
      quoted+=("$(quote "${arg}")")
    done
    echo "+ ${quoted[*]}"
  else
    "$@"
  fi
}

run_to() {
  local out="$1"
  shift
  if [[ "${DRY_RUN}" == "1" ]]; then
    DRY_RUN=1 run "$@" | sed "s|\$| > $(quote "${out}")|"
  else
    "$@" >"${out}"
  fi
}

die() {
  echo "error: $*" >&2
  exit 2
}

need_value() {
  # need_value FLAG VALUE: a flag that takes a value got one.
  [[ -n "${2:-}" && "${2:0:2}" != "--" ]] || die "$1 needs a value (see -h)"
}
