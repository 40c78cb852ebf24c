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
from spec_jax.training.draft_model import sample_positions
from spec_jax.training.run import Recipe, train_drafter
from spec_jax.training.trainer import TargetModelLoss, TrainConfig, TrainResult, chained_draft_loss


@dataclasses.dataclass(frozen=True)
class MedusaLoss(TargetModelLoss):
    """loss(params, target_params, batch, key); batch = dict(tokens [B, T], lengths [B],
    prompt_lengths [B], captured [B, T, H] the target's last-layer hidden states)."""

    cfg: MedusaConfig
    target_model: TargetModel  # a built-in ModelConfig is wrapped in Decoder (TargetModelLoss)
    head_decay: float = 0.8
    positions: int = 32  # hidden states per sequence that get the heads' losses

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
        return chained_draft_loss(logits, tokens, idx + 2, lengths, picked, self.head_decay)


@dataclasses.dataclass(frozen=True)
class MedusaRecipe(Recipe):
    """K Medusa heads, exported in `spec_jax.checkpoints.medusa`'s format. Fresh heads start as the
    target's LM head (zero blocks, norms from its final norm); init_from: exported heads of the
    same shape."""

    kind = "medusa"
    title = "Medusa"

    cfg: MedusaConfig
    head_decay: float = 0.8
    positions: int = 32

    @classmethod
    def for_target(cls, target: Any, num_heads: int = 4, num_res_blocks: int = 1, **settings: Any) -> MedusaRecipe:
        from spec_jax.drafters.medusa import check_compatible

        medusa_cfg = MedusaConfig.for_target(target.cfg, num_heads=num_heads, num_res_blocks=num_res_blocks)
        check_compatible(medusa_cfg, target.cfg)
        return cls(medusa_cfg, **settings)

    @classmethod
    def from_flags(cls, target: Any, flags: Any) -> MedusaRecipe:
        return cls.for_target(target, flags.k, flags.layers or 1, positions=flags.answer_positions)

    @property
    def drafter(self) -> Any:
        from spec_jax.drafters.medusa import MedusaDrafter

        return MedusaDrafter(self.cfg)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.cfg.capture_layer,)

    def records(self) -> tuple[dict, dict]:
        settings = {"drafter": dataclasses.asdict(self.cfg), "head_decay": self.head_decay,
                    "positions": self.positions}
        return settings, {"num_heads": self.cfg.num_heads, "num_res_blocks": self.cfg.num_res_blocks,
                          "head_decay": self.head_decay, "positions": self.positions}

    def initial_params(self, target: Any, seed: int, init_from: str | Path | None) -> Any:
        from spec_jax.checkpoints import CheckpointError
        from spec_jax.checkpoints.medusa import load_medusa
        from spec_jax.drafters.medusa import identity_medusa_params, target_final_norm

        if init_from is None:
            return jax.device_get(identity_medusa_params(self.cfg, target_final_norm(target.target)))
        saved, init = load_medusa(init_from)
        if dataclasses.replace(saved.cfg, dtype=self.cfg.dtype) != self.cfg:
            raise CheckpointError(
                f"--init-from {init_from}: those heads ({saved.cfg}) differ from the ones this run trains "
                f"({self.cfg}); pass matching --k/--layers or drop --init-from."
            )
        return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), init)

    def loss(self, target: Any, draft_ids: np.ndarray | None) -> Any:
        return MedusaLoss(self.cfg, target.cfg, head_decay=self.head_decay, positions=self.positions)

    def export(self, drafter_dir: Path, params: Any, target: Any) -> None:
        from spec_jax.checkpoints.medusa import save_medusa

        save_medusa(drafter_dir, self.cfg, params, overwrite=True)


def train_medusa(target: Any, data: Any, out_dir: str | Path, cfg: TrainConfig, num_heads: int = 4,
                 num_res_blocks: int = 1, head_decay: float = 0.8, positions: int = 32,
                 **options: Any) -> tuple[Any, Any, TrainResult]:
    """Train K Medusa heads for a loaded target (`MedusaRecipe`) and export them to
    out_dir/drafter; options: `spec_jax.training.run.train_drafter`'s. Resumable: re-running with
    the same settings continues from out_dir's latest checkpoint."""
    recipe = MedusaRecipe.for_target(target, num_heads, num_res_blocks, head_decay=head_decay, positions=positions)
    return train_drafter(recipe, target, data, out_dir, cfg, **options)
