#!/usr/bin/env bash
# Install spec-jax with the `tpu` extra on every worker of a Cloud TPU VM.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"

usage() {
  cat <<USAGE
Usage: $(basename "$0") --name NAME [options]

Copy this checkout to every TPU worker and pip-install it with the tpu extra
(gcloud compute tpus tpu-vm scp/ssh --worker=all), then check that JAX sees the TPU chips.

Options:
  --name NAME        TPU VM name (required)
  --zone ZONE        zone (default: us-central1-a)
  --project PROJECT  GCP project (default: gcloud's configured project)
  --source DIR       spec_jax checkout to install (default: the repository holding this script)
  --package SPEC     install SPEC from a package index instead of copying a checkout,
                     e.g. 'spec-jax[tpu]' or 'spec-jax[tpu]==0.1.0'
  --dry-run          print the commands instead of running them
  -h, --help         show this help
USAGE
}

NAME=""
ZONE="us-central1-a"
PROJECT=""
SOURCE_DIR="$(cd "${SCRIPT_DIR}/.." && pwd)"
PACKAGE=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME="$2"; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE="$2"; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT="$2"; shift 2 ;;
    --source) need_value "$1" "${2:-}"; SOURCE_DIR="$2"; shift 2 ;;
    --package) need_value "$1" "${2:-}"; PACKAGE="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ -n "${NAME}" ]] || { usage >&2; die "--name is required"; }

where=(--zone="${ZONE}")
[[ -n "${PROJECT}" ]] && where+=(--project="${PROJECT}")

if [[ -n "${PACKAGE}" ]]; then
  install="python3 -m pip install --upgrade pip && python3 -m pip install '${PACKAGE}'"
else
  archive="${TMPDIR:-/tmp}/spec_jax_src_${NAME}.tar.gz"
  run tar -czf "${archive}" -C "${SOURCE_DIR}" --exclude=.git --exclude='*.pyc' \
    --exclude=__pycache__ --exclude=benchmarks/results .
  run gcloud compute tpus tpu-vm scp "${archive}" "${NAME}:~/spec_jax_src.tar.gz" \
    --worker=all "${where[@]}"
  install="rm -rf ~/spec_jax && mkdir -p ~/spec_jax && tar -xzf ~/spec_jax_src.tar.gz -C ~/spec_jax"
  install+=" && cd ~/spec_jax && python3 -m pip install --upgrade pip && python3 -m pip install -e '.[tpu]'"
fi
run gcloud compute tpus tpu-vm ssh "${NAME}" --worker=all "${where[@]}" --command="${install}"
# Every worker should report its local TPU chips (the slice's total over all workers).
run gcloud compute tpus tpu-vm ssh "${NAME}" --worker=all "${where[@]}" \
  --command="python3 -c 'import jax; print(jax.process_index(), jax.local_devices())'"
