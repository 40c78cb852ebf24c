#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or a multi-host pod slice) for spec_jax.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"

usage() {
  cat <<USAGE
Usage: $(basename "$0") --name NAME [options]

Create a Cloud TPU VM with gcloud compute tpus tpu-vm create.

Options:
  --name NAME              TPU VM name (required)
  --zone ZONE              zone (default: us-central1-a; v5e: us-west4-a, v6e: us-east5-b)
  --accelerator-type TYPE  slice type, e.g. v5litepod-8, v5p-8, v6e-8, v5litepod-16 (default: v5litepod-8)
  --version VERSION        TPU software version / runtime (default: v2-alpha-tpuv5-lite;
                           v5p: v2-alpha-tpuv5, v6e: v2-alpha-tpuv6e)
  --project PROJECT        GCP project (default: gcloud's configured project)
  --spot                   request Spot capacity
  --dry-run                print the commands instead of running them
  -h, --help               show this help

Example:
  $(basename "$0") --name spec-jax-v5e --zone us-west4-a --accelerator-type v5litepod-8
USAGE
}

NAME=""
ZONE="us-central1-a"
ACCELERATOR_TYPE="v5litepod-8"
VERSION="v2-alpha-tpuv5-lite"
PROJECT=""
SPOT=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME="$2"; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE="$2"; shift 2 ;;
    --accelerator-type) need_value "$1" "${2:-}"; ACCELERATOR_TYPE="$2"; shift 2 ;;
    --version) need_value "$1" "${2:-}"; VERSION="$2"; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT="$2"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ -n "${NAME}" ]] || { usage >&2; die "--name is required"; }

cmd=(gcloud compute tpus tpu-vm create "${NAME}"
  --zone="${ZONE}" --accelerator-type="${ACCELERATOR_TYPE}" --version="${VERSION}")
[[ -n "${PROJECT}" ]] && cmd+=(--project="${PROJECT}")
[[ "${SPOT}" == "1" ]] && cmd+=(--spot)
run "${cmd[@]}"
