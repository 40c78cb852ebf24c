"""Frozen-target features, computed once per dataset (the target never trains).

For every token of every sequence: the target's hidden states after `capture_layers` (what a DFlash
drafter reads) and the target's final-normed hidden state (its logits are `lm_head` of it, so
distillation losses recompute teacher logits for just the positions they need).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import forward_hidden, init_cache
from spec_jax.training.data import TokenDataset


@dataclasses.dataclass
class TargetFeatures:
    """captured [num_tokens, n*H] and final [num_tokens, H], aligned with TokenDataset.tokens."""

    capture_layers: tuple[int, ...]
    captured: np.ndarray
    final: np.ndarray


def compute_features(
    params: Any,
    cfg: ModelConfig,
    data: TokenDataset,
    capture_layers: Sequence[int],
    seq_len: int,
    batch_size: int = 8,
    progress: bool = True,
) -> TargetFeatures:
    from tqdm.auto import tqdm

    capture = tuple(capture_layers)

    @jax.jit
    def run(params, tokens):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        final, captured, _ = forward_hidden(params, cfg, tokens, positions, init_cache(cfg, b, t), capture)
        if captured is None:
            captured = jnp.zeros((b, t, 0), final.dtype)
        return captured, final

    n_cap = len(capture_layers) * cfg.hidden_size
    captured = np.zeros((data.num_tokens, n_cap), np.float32)
    final = np.zeros((data.num_tokens, cfg.hidden_size), np.float32)
    indices = list(range(len(data)))
    for start in tqdm(range(0, len(indices), batch_size), desc="target features", disable=not progress):
        rows = indices[start : start + batch_size]
        tokens = np.zeros((batch_size, seq_len), np.int32)
        for r, i in enumerate(rows):
            seq = data.sequence(i)[:seq_len]
            tokens[r, : len(seq)] = seq
        cap, fin = jax.device_get(run(params, jnp.asarray(tokens)))
        for r, i in enumerate(rows):
            lo, hi = data.offsets[i], data.offsets[i + 1]
            n = min(hi - lo, seq_len)
            captured[lo : lo + n] = cap[r, :n]
            final[lo : lo + n] = fin[r, :n]
    return TargetFeatures(tuple(capture_layers), captured, final)


def gather_features(
    data: TokenDataset, features: TargetFeatures, picks: Sequence[int], seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-batch feature arrays [B, seq_len, n*H] and [B, seq_len, H] for sequences `picks`."""
    cap = np.zeros((len(picks), seq_len, features.captured.shape[1]), np.float32)
    fin = np.zeros((len(picks), seq_len, features.final.shape[1]), np.float32)
    for r, i in enumerate(picks):
        lo, hi = data.offsets[i], data.offsets[i + 1]
        n = min(hi - lo, seq_len)
        cap[r, :n] = features.captured[lo : lo + n]
        fin[r, :n] = features.final[lo : lo + n]
    return cap, fin
