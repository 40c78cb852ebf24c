#!/usr/bin/env bash
# Run `spec-jax generate` and `spec-jax bench --mesh ...` on a Cloud TPU VM, copy results back.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"

usage() {
  cat <<USAGE
Usage: $(basename "$0") --name NAME [options]

On every worker of the TPU VM (multi-host slices run one process per worker; process 0 prints
and writes), run spec-jax generate and spec-jax bench sharded over --mesh, then copy the results
directory from worker 0 back with gcloud compute tpus tpu-vm scp.

Options:
  --name NAME            TPU VM name (required)
  --zone ZONE            zone (default: us-central1-a)
  --project PROJECT      GCP project (default: gcloud's configured project)
  --mesh data=D,model=M  device mesh; D*M = chips in the slice (default: data=1,model=8 for v5e-8/v6e-8;
                         v5p-8 has 4 chips: data=1,model=4)
  --prompt TEXT          prompt for spec-jax generate (default: a short coding request)
  --max-new-tokens N     new tokens per prompt (default: 128)
  --drafters LIST        spec-jax bench --drafters (default: ngram)
  --num-prompts N        spec-jax bench --num-prompts (default: 10)
  --results DIR          local directory for the results (default: ./tpu_results/NAME)
  --dry-run              print the commands instead of running them
  -h, --help             show this help
USAGE
}

NAME=""
ZONE="us-central1-a"
PROJECT=""
MESH="data=1,model=8"
PROMPT="Write a Python function that checks whether a number is prime."
MAX_NEW_TOKENS=128
DRAFTERS="ngram"
NUM_PROMPTS=10
RESULTS=""
REMOTE_RESULTS="spec_jax_results"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME="$2"; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE="$2"; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT="$2"; shift 2 ;;
    --mesh) need_value "$1" "${2:-}"; MESH="$2"; shift 2 ;;
    --prompt) need_value "$1" "${2:-}"; PROMPT="$2"; shift 2 ;;
    --max-new-tokens) need_value "$1" "${2:-}"; MAX_NEW_TOKENS="$2"; shift 2 ;;
    --drafters) need_value "$1" "${2:-}"; DRAFTERS="$2"; shift 2 ;;
    --num-prompts) need_value "$1" "${2:-}"; NUM_PROMPTS="$2"; shift 2 ;;
    --results) need_value "$1" "${2:-}"; RESULTS="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ -n "${NAME}" ]] || { usage >&2; die "--name is required"; }
RESULTS="${RESULTS:-./tpu_results/${NAME}}"

where=(--zone="${ZONE}")
[[ -n "${PROJECT}" ]] && where+=(--project="${PROJECT}")

# The remote command line; %q keeps the prompt and mesh one argument each on the worker.
remote="mkdir -p ~/${REMOTE_RESULTS}"
remote+=" && spec-jax generate --mesh $(quote "${MESH}")"
remote+=" --max-new-tokens $(quote "${MAX_NEW_TOKENS}") --json $(quote "${PROMPT}")"
remote+=" > ~/${REMOTE_RESULTS}/generate.json"
remote+=" && spec-jax bench --mesh $(quote "${MESH}") --drafters $(quote "${DRAFTERS}")"
remote+=" --num-prompts $(quote "${NUM_PROMPTS}") --max-new-tokens $(quote "${MAX_NEW_TOKENS}")"
remote+=" --no-progress --out ~/${REMOTE_RESULTS}"

run gcloud compute tpus tpu-vm ssh "${NAME}" --worker=all "${where[@]}" --command="${remote}"
run mkdir -p "${RESULTS}"
run gcloud compute tpus tpu-vm scp --recurse "${NAME}:~/${REMOTE_RESULTS}" "${RESULTS}" \
  --worker=0 "${where[@]}"
