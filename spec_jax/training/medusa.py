"""Training Medusa heads on the frozen target's own continuations (self-distillation data).

The heads read the target's last-layer hidden state of token t (captured before the final norm)
and head i (1..K) learns the token at t + i + 1, the i-th token after the one the target's LM head
predicts there; the target never trains. Labels are answer tokens only (the data's continuations
are the target's own, greedy or sampled, so they are what verification accepts). Loss:
cross-entropy per head, head i weighted `head_decay ** (i - 1)` (the deeper heads matter less:
a draft counts only when all before it were accepted), at `positions` answer positions per
sequence drawn anew each step (the shared LM head over the vocabulary dominates the cost).

    spec-jax train medusa --data DATA --out runs/medusa --k 4     # K heads, exported to runs/medusa/drafter
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters.medusa import MedusaConfig, head_hidden
from spec_jax.models.interface import TargetModel
from spec_jax.models.resolve import as_target_model
from spec_jax.training.draft_model import sample_positions
from spec_jax.training.trainer import TrainConfig, TrainResult, cross_entropy, masked_mean


@dataclasses.dataclass(frozen=True)
class MedusaLoss:
    """loss(params, target_params, batch, key); batch = dict(tokens [B, T], lengths [B],
    prompt_lengths [B], captured [B, T, H] the target's last-layer hidden states)."""

    cfg: MedusaConfig
    target_model: TargetModel  # a built-in ModelConfig is wrapped in Decoder
    head_decay: float = 0.8
    positions: int = 32  # hidden states per sequence that get the heads' losses

    def __post_init__(self):
        object.__setattr__(self, "target_model", as_target_model(self.target_model))

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        cfg = self.cfg
        tokens, lengths, prompt_lengths = batch["tokens"], batch["lengths"], batch["prompt_lengths"]
        b, t = tokens.shape
        rows = jnp.arange(b)[:, None]
        # Step 1: the positions t whose first head has a label t + 2 in the answer (as at inference,
        # where the first state is the last prompt token's and its head 1 drafts the second answer
        # token); later heads' labels may run past the sequence and are masked per head.
        steps = jnp.arange(t)[None, :]
        first_label = steps + 2
        usable = (first_label < lengths[:, None]) & (first_label >= prompt_lengths[:, None])
        idx = sample_positions(key, usable, self.positions)  # [B, P]
        picked = usable[rows, idx]  # [B, P] (False only for sequences with no usable position)

        # Step 2: the K heads over the picked hidden states, through the target's LM head.
        hidden = batch["captured"][rows, idx].astype(params["heads"][0]["norm"].dtype)  # [B, P, H]
        logits = self.target_model.logits(target_params, head_hidden(cfg, params, hidden))  # [B, P, K, V]

        # Step 3: head i (1-based) learns token idx + i + 1.
        total, weight_sum, metrics, leading = 0.0, 0.0, {}, None
        for i in range(1, cfg.num_heads + 1):
            label_pos = idx + i + 1
            labels = tokens[rows, jnp.minimum(label_pos, t - 1)]
            valid = picked & (label_pos < lengths[:, None])
            head_logits = logits[:, :, i - 1]
            ce = masked_mean(cross_entropy(head_logits, labels), valid)
            weight = self.head_decay ** (i - 1)
            total, weight_sum = total + weight * ce, weight_sum + weight
            correct = (jnp.argmax(head_logits, -1) == labels) & valid
            metrics[f"acc_{i}"] = masked_mean(correct, valid)
            leading = correct if leading is None else leading & correct
            metrics[f"run_{i}"] = masked_mean(leading, picked)
        loss = total / weight_sum
        metrics["ce"] = loss
        metrics["accuracy"] = metrics["acc_1"]
        # Expected accepted drafts per step under greedy verification (leading correct heads).
        metrics["accept_run"] = sum(metrics[f"run_{i}"] for i in range(1, cfg.num_heads + 1))
        return loss, metrics


def train_medusa(
    target: Any,
    data: Any,
    out_dir: str | Path,
    cfg: TrainConfig,
    num_heads: int = 4,
    num_res_blocks: int = 1,
    head_decay: float = 0.8,
    positions: int = 32,
    eval_prompts: int = 4,
    eval_tokens: int = 64,
    features: str = "auto",
    feature_cache: str | Path | None = None,
    progress: bool = True,
    init_from: str | Path | None = None,
) -> tuple[Any, Any, TrainResult]:
    """Train K Medusa heads for a loaded target and export them to out_dir/drafter
    (`spec_jax.checkpoints.medusa`). Fresh heads start as the target's LM head (zero blocks, norms
    from its final norm); init_from: an exported Medusa dir (same shape) to continue from.
    Resumable: re-running with the same settings continues from out_dir's latest checkpoint."""
    from spec_jax.checkpoints.medusa import load_medusa, save_medusa
    from spec_jax.drafters.medusa import (
        MedusaDrafter,
        check_compatible,
        identity_medusa_params,
        target_final_norm,
    )
    from spec_jax.training.run import (
        _loss_and_batches,
        feature_mode,
        held_out_prompts,
        held_out_tau,
        run_provenance,
        write_report,
    )
    from spec_jax.checkpoints import CheckpointError
    from spec_jax.training.trainer import train

    out_dir = Path(out_dir)
    medusa_cfg = MedusaConfig.for_target(target.cfg, num_heads=num_heads, num_res_blocks=num_res_blocks)
    check_compatible(medusa_cfg, target.cfg)
    if init_from is not None:  # a mismatched --init-from fails before the target feature pass
        saved, init = load_medusa(init_from)
        if dataclasses.replace(saved.cfg, dtype=medusa_cfg.dtype) != medusa_cfg:
            raise CheckpointError(
                f"--init-from {init_from}: those heads ({saved.cfg}) differ from the ones this run trains "
                f"({medusa_cfg}); pass matching --k/--layers or drop --init-from."
            )
        init = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), init)
    else:
        init = jax.device_get(identity_medusa_params(medusa_cfg, target_final_norm(target.target)))
    data, prompts, eval_source = held_out_prompts(target, data, eval_prompts, cfg.seed, cfg.seq_len)
    capture = (medusa_cfg.capture_layer,)
    mode = feature_mode(features, data, capture, target.cfg.hidden_size)
    loss, batches, feature_s = _loss_and_batches(
        MedusaLoss(medusa_cfg, target.cfg, head_decay=head_decay, positions=positions),
        target, data, capture, cfg, mode, progress, out_dir, feature_cache,
    )
    drafter = MedusaDrafter(medusa_cfg)
    result = train(
        loss, init, target.params, batches, cfg, out_dir,
        run_config={"kind": "medusa", **run_provenance(target, data),
                    "drafter": dataclasses.asdict(medusa_cfg), "head_decay": head_decay,
                    "positions": positions, "data_tokens": data.num_tokens,
                    "init_from": str(init_from) if init_from else None},
        evaluate=lambda params, step: held_out_tau(target, drafter, params, prompts, eval_tokens),
        progress=progress,
    )
    params = jax.device_get(result.state.params)
    save_medusa(out_dir / "drafter", medusa_cfg, params, overwrite=True)
    write_report(out_dir, "Medusa", result, {
        "kind": "medusa", "data_sequences": len(data), "data_tokens": data.num_tokens,
        "num_heads": num_heads, "num_res_blocks": num_res_blocks, "head_decay": head_decay,
        "positions": positions, "init_from": str(init_from) if init_from else None,
        "target_features": mode, "feature_seconds": feature_s, "held_out": eval_source,
        "eval_tokens": eval_tokens, "backend": jax.default_backend(), "train": dataclasses.asdict(cfg),
    })
    return drafter, params, result
