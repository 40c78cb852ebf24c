#!/usr/bin/env bash
# GPU-host variant: install spec-jax with the `cuda` extra on a GPU machine, run generate and
# bench there (sharded over its GPUs with --mesh) and copy the results back.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"

usage() {
  cat <<USAGE
Usage: $(basename "$0") [--host USER@HOST] [options]

Copy this checkout to a GPU host over ssh, pip-install it with the cuda extra, run
spec-jax generate and spec-jax bench --mesh ..., then spec-jax bench --roofline on one GPU
(a random-weight preset in bfloat16: AR step vs the HBM floor, verify cost for 1..64
tokens; see benchmarks/RESULTS.md), and scp the results back. Without --host
everything runs on this machine. One process drives all GPUs of a host; for several hosts
run this once per host with SPEC_JAX_COORDINATOR, SPEC_JAX_NUM_PROCESSES and
SPEC_JAX_PROCESS_ID set (see docs/sharding.md).

Options:
  --host USER@HOST       GPU machine to use over ssh (default: this machine)
  --mesh data=D,model=M  device mesh; D*M = GPUs (default: data=1,model=8)
  --prompt TEXT          prompt for spec-jax generate
  --max-new-tokens N     new tokens per prompt (default: 128)
  --drafters LIST        spec-jax bench --drafters (default: ngram)
  --num-prompts N        spec-jax bench --num-prompts (default: 10)
  --roofline PRESET      preset measured by bench --roofline (default: llama-3.2-1b;
                         none to skip)
  --source DIR           spec_jax checkout to install (default: the repository holding this script)
  --results DIR          local directory for the results (default: ./gpu_results/HOST)
  --skip-install         do not copy and install, only run
  --dry-run              print the commands instead of running them
  -h, --help             show this help
USAGE
}

HOST=""
MESH="data=1,model=8"
PROMPT="Write a Python function that checks whether a number is prime."
MAX_NEW_TOKENS=128
DRAFTERS="ngram"
NUM_PROMPTS=10
ROOFLINE="llama-3.2-1b"
SOURCE_DIR="$(cd "${SCRIPT_DIR}/.." && pwd)"
RESULTS=""
SKIP_INSTALL=0
REMOTE_DIR="spec_jax"
REMOTE_RESULTS="spec_jax_results"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --host) need_value "$1" "${2:-}"; HOST="$2"; shift 2 ;;
    --mesh) need_value "$1" "${2:-}"; MESH="$2"; shift 2 ;;
    --prompt) need_value "$1" "${2:-}"; PROMPT="$2"; shift 2 ;;
    --max-new-tokens) need_value "$1" "${2:-}"; MAX_NEW_TOKENS="$2"; shift 2 ;;
    --drafters) need_value "$1" "${2:-}"; DRAFTERS="$2"; shift 2 ;;
    --num-prompts) need_value "$1" "${2:-}"; NUM_PROMPTS="$2"; shift 2 ;;
    --roofline) need_value "$1" "${2:-}"; ROOFLINE="$2"; shift 2 ;;
    --source) need_value "$1" "${2:-}"; SOURCE_DIR="$2"; shift 2 ;;
    --results) need_value "$1" "${2:-}"; RESULTS="$2"; shift 2 ;;
    --skip-install) SKIP_INSTALL=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
RESULTS="${RESULTS:-./gpu_results/${HOST:-local}}"

install="cd ~/${REMOTE_DIR} && python3 -m pip install --upgrade pip && python3 -m pip install -e '.[cuda]'"
job="mkdir -p ~/${REMOTE_RESULTS}"
job+=" && spec-jax generate --mesh $(quote "${MESH}")"
job+=" --max-new-tokens $(quote "${MAX_NEW_TOKENS}") --json $(quote "${PROMPT}")"
job+=" > ~/${REMOTE_RESULTS}/generate.json"
job+=" && spec-jax bench --mesh $(quote "${MESH}") --drafters $(quote "${DRAFTERS}")"
job+=" --num-prompts $(quote "${NUM_PROMPTS}") --max-new-tokens $(quote "${MAX_NEW_TOKENS}")"
job+=" --no-progress --out ~/${REMOTE_RESULTS}"
if [[ "${ROOFLINE}" != "none" ]]; then
  job+=" && spec-jax bench --roofline --target $(quote "random:${ROOFLINE}") --dtype bfloat16"
  job+=" --no-progress --out ~/${REMOTE_RESULTS}/roofline > ~/${REMOTE_RESULTS}/roofline.txt"
fi

if [[ -z "${HOST}" ]]; then
  if [[ "${SKIP_INSTALL}" == "0" ]]; then
    run python3 -m pip install -e "${SOURCE_DIR}[cuda]"
  fi
  run mkdir -p "${RESULTS}"
  run_to "${RESULTS}/generate.json" \
    spec-jax generate --mesh "${MESH}" --max-new-tokens "${MAX_NEW_TOKENS}" --json "${PROMPT}"
  run spec-jax bench --mesh "${MESH}" --drafters "${DRAFTERS}" --num-prompts "${NUM_PROMPTS}" \
    --max-new-tokens "${MAX_NEW_TOKENS}" --no-progress --out "${RESULTS}"
  if [[ "${ROOFLINE}" != "none" ]]; then
    run_to "${RESULTS}/roofline.txt" spec-jax bench --roofline --target "random:${ROOFLINE}" \
      --dtype bfloat16 --no-progress --out "${RESULTS}/roofline"
  fi
  exit 0
fi

if [[ "${SKIP_INSTALL}" == "0" ]]; then
  run ssh "${HOST}" "mkdir -p ~/${REMOTE_DIR}"
  run rsync -az --delete --exclude=.git --exclude=__pycache__ "${SOURCE_DIR}/" \
    "${HOST}:${REMOTE_DIR}/"
  run ssh "${HOST}" "${install}"
fi
run ssh "${HOST}" "${job}"
run mkdir -p "${RESULTS}"
run scp -r "${HOST}:${REMOTE_RESULTS}/." "${RESULTS}/"
