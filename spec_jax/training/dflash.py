"""Training a DFlash drafter on the frozen target's own continuations (the published recipe).

Per sequence, `num_anchors` random anchor positions a are drawn inside the target's answer. Each
gives a block [token a, mask, ..., mask] at positions a..a+b-1 whose labels are tokens
a+1..a+b-1. Every block sees the target's context features of positions < a (exactly what it
would see at inference, where the context is every committed token but the anchor) and, within
itself, the block's own tokens. All blocks of a sequence run in one pass with a block-diagonal mask.
Loss: cross-entropy against the target's continuation, weighted by exp(-i / position_decay) for
draft position i (early drafts matter most: one miss ends the accepted run), optionally plus KL to
the target's logits. On text the target did not write (`teacher_labels`), the labels are the target's
own greedy predictions instead of the text's next tokens: acceptance is agreement with the target.
With a reduced draft vocabulary (`draft_ids`), the drafter's own head is trained over those tokens
(cross-entropy on labels inside it; KL to the target's logits restricted to it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.draft_vocab import target_to_draft
from spec_jax.drafters.dflash import DFlashConfig, context_kv, dflash_hidden, dflash_logits
from spec_jax.models.interface import Target, TargetModel
from spec_jax.training.trainer import TargetModelLoss, cross_entropy, kl_to_teacher


def block_hidden(
    cfg: DFlashConfig, params: Any, target: Target, tokens: jax.Array, captured: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """The drafter's final hidden states [B, A*b, H] for the blocks [token a, mask, ...] at
    positions a..a+b-1 of every anchor a in `anchors` [B, A], all in one pass: each block sees the
    target's context features of positions < a (what it sees at inference, where the context is
    every committed token but the anchor) and, non-causally, its own block."""
    b_size, seq_len = tokens.shape
    block, anchors_n = cfg.block_size, anchors.shape[1]
    rows = jnp.arange(b_size)[:, None]

    # Blocks [anchor token, mask, ...] at positions a..a+b-1, flattened to [B, A*b].
    positions = (anchors[:, :, None] + jnp.arange(block)).reshape(b_size, anchors_n * block)
    block_tokens = jnp.full((b_size, anchors_n, block), cfg.mask_token_id, jnp.int32)
    block_tokens = block_tokens.at[:, :, 0].set(tokens[rows, anchors])
    x = target.embed(block_tokens.reshape(b_size, -1)).astype(params["fc"].dtype)
    if cfg.input_embedding_scale is not None:
        x = x * cfg.input_embedding_scale

    # What each query may see: context before its anchor; its own block only.
    anchor_of_query = jnp.repeat(anchors, block, axis=1)  # [B, A*b]
    ctx_positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b_size, seq_len))
    ctx_visible = ctx_positions[:, None, :] < anchor_of_query[:, :, None]  # [B, A*b, T]
    block_id = jnp.repeat(jnp.arange(anchors_n), block)
    block_visible = jnp.broadcast_to(
        block_id[:, None] == block_id[None, :], (b_size, anchors_n * block, anchors_n * block)
    )
    ctx_k, ctx_v = context_kv(cfg, params, captured, ctx_positions)
    return dflash_hidden(cfg, params, x, positions, ctx_k, ctx_v, ctx_positions, ctx_visible, block_visible)


@dataclasses.dataclass(frozen=True)
class DFlashLoss(TargetModelLoss):
    """loss(params, target_params, batch, key); batch = dict(tokens [B, T], lengths [B],
    prompt_lengths [B], captured [B, T, n*H] target features, final [B, T, H] when kl_weight)."""

    cfg: DFlashConfig
    target_model: TargetModel  # a built-in ModelConfig is wrapped in Decoder (TargetModelLoss)
    num_anchors: int = 8
    position_decay: float = 4.0
    kl_weight: float = 0.0
    teacher_labels: bool = False  # labels = the target's argmax (needs batch["final"])
    draft_ids: tuple[int, ...] | None = None  # target id of draft id i (reduced draft vocabulary)

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        cfg = self.cfg
        tokens, lengths, prompt_lengths = batch["tokens"], batch["lengths"], batch["prompt_lengths"]
        b_size, seq_len = tokens.shape
        block, anchors_n = cfg.block_size, self.num_anchors
        rows = jnp.arange(b_size)[:, None]
        offsets = jnp.arange(block)

        # Step 1: anchors inside the answer, each with at least one label: a in [P-1, len-2].
        t = jnp.arange(seq_len)[None, :]
        can_anchor = (t >= prompt_lengths[:, None] - 1) & (t <= lengths[:, None] - 2)
        anchors = jax.random.categorical(
            key, jnp.where(can_anchor, 0.0, -jnp.inf)[:, None, :], axis=-1, shape=(b_size, anchors_n)
        )  # [B, A]
        target = Target(target_params, self.target_model)
        hidden = block_hidden(cfg, params, target, tokens, batch["captured"], anchors)  # [B, A*b, H]

        # Step 2: block position i+1 predicts token a+i+1 (i = 0..b-2).
        hidden = hidden.reshape(b_size, anchors_n, block, -1)[:, :, 1:]  # [B, A, b-1, H]
        reduced = self.draft_ids is not None
        logits = dflash_logits(cfg, params, target, hidden.reshape(b_size, -1, hidden.shape[-1]), draft_vocab=reduced)
        logits = logits.reshape(b_size, anchors_n, block - 1, -1)  # [B, A, b-1, V or Vd]
        label_pos = anchors[:, :, None] + offsets[None, None, 1:]  # [B, A, b-1]
        valid = label_pos < lengths[:, None, None]
        teacher = None
        if self.kl_weight > 0 or self.teacher_labels:
            # The target's logits at position a+i predict token a+i+1.
            teacher_pos = jnp.minimum(label_pos - 1, seq_len - 1)
            final = batch["final"][rows[:, :, None], teacher_pos]
            teacher = target.logits(final.reshape(b_size, -1, final.shape[-1]))
            teacher = teacher.reshape(logits.shape[:-1] + teacher.shape[-1:])
        if self.teacher_labels:
            labels = jnp.argmax(teacher, -1)
        else:
            labels = tokens[rows[:, :, None], jnp.minimum(label_pos, seq_len - 1)]
        if reduced:  # labels outside the draft vocabulary cannot be drafted: left out
            labels = target_to_draft(self.draft_ids, target.vocab_size)[labels]
            valid = valid & (labels >= 0)
            labels = jnp.maximum(labels, 0)
            if teacher is not None:
                teacher = teacher[..., jnp.asarray(self.draft_ids)]
        weight = jnp.exp(-jnp.arange(block - 1) / self.position_decay)[None, None, :] * valid
        ce = jnp.sum(cross_entropy(logits, labels) * weight) / jnp.maximum(jnp.sum(weight), 1e-6)
        correct = (jnp.argmax(logits, -1) == labels) & valid
        # Expected accepted run under greedy verification: leading correct drafts per block.
        run = jnp.sum(jnp.cumprod(correct.astype(jnp.int32), axis=-1), axis=-1)
        metrics = {
            "ce": ce,
            "accuracy": jnp.sum(correct) / jnp.maximum(jnp.sum(valid), 1),
            "accept_run": jnp.mean(run.astype(jnp.float32)),
        }
        loss = ce
        if self.kl_weight > 0:
            kl = jnp.sum(kl_to_teacher(logits, teacher) * weight) / jnp.maximum(jnp.sum(weight), 1e-6)
            metrics["kl"] = kl
            loss = loss + self.kl_weight * kl
        return loss, metrics
