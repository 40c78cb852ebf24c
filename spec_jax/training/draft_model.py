"""Distilling a small draft LM into the target: cross-entropy on the target's own answers plus KL
to the target's logits (recomputed from its stored final hidden states at sampled positions)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import forward_hidden, init_cache, lm_head
from spec_jax.models.interface import TargetModel
from spec_jax.training.trainer import TargetModelLoss, cross_entropy, kl_to_teacher, masked_mean


def response_mask(tokens_shape, lengths, prompt_lengths) -> jax.Array:
    """[B, T-1]: position t predicts token t+1, which is part of the target's answer."""
    t = jnp.arange(tokens_shape[1] - 1)[None, :]
    return (t + 1 < lengths[:, None]) & (t + 1 >= prompt_lengths[:, None])


def sample_positions(key: jax.Array, valid: jax.Array, count: int) -> jax.Array:
    """[B, count] positions drawn uniformly (with replacement) where `valid` [B, T] holds."""
    logits = jnp.where(valid, 0.0, -jnp.inf)
    return jax.random.categorical(key, logits[:, None, :], axis=-1, shape=(valid.shape[0], count))


@dataclasses.dataclass(frozen=True)
class DraftModelLoss(TargetModelLoss):
    """loss(params, target_params, batch, key); batch = dict(tokens, lengths, prompt_lengths,
    final [B, T, H] target final-normed hidden states). Losses at `positions` answer positions
    per sequence, drawn anew each step."""

    student_cfg: ModelConfig
    target_model: TargetModel  # a built-in ModelConfig is wrapped in Decoder (TargetModelLoss)
    kl_weight: float = 1.0
    positions: int = 64  # answer positions per sequence that get the LM-head losses

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        tokens = batch["tokens"]
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # One pass over the whole sequence, nothing committed before it: it attends to its own
        # keys only, so a 1-slot cache (the pass's writes past it are dropped) keeps the cache
        # attention a single dense block, which is differentiable (the live-length loop over
        # longer caches has a dynamic trip count, which reverse mode cannot go through).
        cache = init_cache(self.student_cfg, b, 1)
        hidden, _, _ = forward_hidden(params, self.student_cfg, tokens, positions, cache)
        # The LM heads (student and teacher) dominate the cost: apply them at sampled answer
        # positions only. Position i predicts token i + 1.
        valid = response_mask(tokens.shape, batch["lengths"], batch["prompt_lengths"])
        idx = sample_positions(key, valid, self.positions)  # [B, P]
        rows = jnp.arange(b)[:, None]
        logits = lm_head(params, self.student_cfg, hidden[rows, idx])[..., : self.target_model.vocab_size]
        labels = tokens[rows, idx + 1]
        picked_valid = valid[rows, idx]
        ce = masked_mean(cross_entropy(logits, labels), picked_valid)
        accuracy = masked_mean(jnp.argmax(logits, -1) == labels, picked_valid)
        metrics = {"ce": ce, "accuracy": accuracy}
        loss = ce
        if self.kl_weight > 0:
            teacher = self.target_model.logits(target_params, batch["final"][rows, idx])
            kl = masked_mean(kl_to_teacher(logits, teacher), picked_valid)
            metrics["kl"] = kl
            loss = loss + self.kl_weight * kl
        return loss, metrics
