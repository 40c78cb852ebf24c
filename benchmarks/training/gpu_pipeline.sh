#!/usr/bin/env bash
# Self-distillation data and drafter training for the default model (SmolLM2-135M-Instruct) on one
# GPU. Everything is the ordinary CLI; re-running resumes (data shards and orbax checkpoints).
#   benchmarks/training/gpu_pipeline.sh MODEL.gguf WORKDIR [STEPS]
# MORE_DATA=0 skips generating sampled2/3 (trains on the committed 1.27M answer tokens only).
# Starts from the committed data (benchmarks/training/selfdistill_smollm2: its shards are skipped
# when the host's prompts match, i.e. on Python 3.12), adds two more sampled answer sets and the
# standard-library text set, then trains four drafters side by side; WORKDIR/runs/NAME/ holds each
# run's training_log.json, training_curve.png and drafter/.
set -euo pipefail
GGUF=$1; W=$2; STEPS=${3:-3000}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$W/data" "$W/runs"
T=(--target "$GGUF")
GEN=(--dtype float32 --num-prompts 100000 --answer-tokens 256 --generate-batch 256 --shard-prompts 256)
for name in greedy sampled1; do
  [ -d "$W/data/$name" ] || cp -r "$HERE/selfdistill_smollm2/$name" "$W/data/$name"
done
spec-jax train data "${T[@]}" "${GEN[@]}" --data "$W/data/greedy" --temperature 0 --seed 0
SAMPLED=(1); [ "${MORE_DATA:-1}" = 1 ] && SAMPLED=(1 2 3)
for s in "${SAMPLED[@]}"; do
  spec-jax train data "${T[@]}" "${GEN[@]}" --data "$W/data/sampled$s" --temperature 0.7 --seed "$s"
done
# The cheaper signal: standard-library source as is, no generation.
[ -f "$W/data/stdlib_text.npz" ] || spec-jax train text "${T[@]}" --data "$W/data/stdlib_text.npz" \
  --seq-len 512 --text-tokens 3000000
DATA=("$W/data/greedy"); for s in "${SAMPLED[@]}"; do DATA+=("$W/data/sampled$s"); done
COMMON=(--steps "$STEPS" --batch-size 32 --seq-len 512 --eval-every $((STEPS / 6)) --save-every 500
        --target-features per-step --eval-prompts 40 --eval-tokens 128)
# Four runs share the GPU (small models leave it mostly idle one at a time).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.22
spec-jax train dflash "${T[@]}" --data "${DATA[@]}" --out "$W/runs/dflash_b8_l2" \
  --block-size 8 --layers 2 --anchors 16 "${COMMON[@]}" > "$W/runs/dflash_b8_l2.log" 2>&1 &
spec-jax train dflash "${T[@]}" --data "${DATA[@]}" --out "$W/runs/dflash_b16_l2" \
  --block-size 16 --layers 2 --anchors 8 "${COMMON[@]}" > "$W/runs/dflash_b16_l2.log" 2>&1 &
spec-jax train draft-model "${T[@]}" --data "${DATA[@]}" --out "$W/runs/draft_4x256" \
  --hidden 256 --layers 4 --answer-positions 128 "${COMMON[@]}" > "$W/runs/draft_4x256.log" 2>&1 &
spec-jax train dflash "${T[@]}" --data "$W/data/stdlib_text.npz" --out "$W/runs/dflash_b8_l2_text" \
  --block-size 8 --layers 2 --anchors 16 --teacher-labels "${COMMON[@]}" > "$W/runs/dflash_b8_l2_text.log" 2>&1 &
wait
echo PIPELINE DONE
