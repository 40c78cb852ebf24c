"""Frozen-target features (the target never trains), computed once per dataset or per step.

For every token of every sequence: the target's hidden states after `capture_layers` (what a DFlash
drafter reads) and the target's final-normed hidden state (its logits are `lm_head` of it, so
distillation losses recompute teacher logits for just the positions they need).

Precomputing (`compute_features`) pays the target's forward pass once and reuses it every epoch,
but holds `tokens x (layers + 1) x hidden` values in host memory (only the first seq_len tokens of
each sequence, the ones training reads; float32, or bfloat16 at half the memory, which is what an
accelerator's bfloat16 target would hand the drafter anyway); `WithTargetFeatures` runs the
target inside each jitted training step instead (the choice for accelerators and large data).
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
    """captured [rows, n*H] and final [rows, H]: sequence i's first min(len, seq_len) tokens are
    rows offsets[i] .. offsets[i + 1]."""

    capture_layers: tuple[int, ...]
    captured: np.ndarray
    final: np.ndarray
    offsets: np.ndarray


def target_features(
    params: Any, cfg: ModelConfig, tokens: jax.Array, capture_layers: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """(captured [B, T, n*H], final [B, T, H]) of the target over `tokens` [B, T]."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    final, captured, _ = forward_hidden(
        params, cfg, tokens, positions, init_cache(cfg, b, t), tuple(capture_layers)
    )
    if captured is None:
        captured = jnp.zeros((b, t, 0), final.dtype)
    return jax.lax.stop_gradient(captured), jax.lax.stop_gradient(final)


@dataclasses.dataclass(frozen=True)
class WithTargetFeatures:
    """A loss whose batch gets `captured` and `final` from the frozen target inside the step."""

    loss: Any
    target_cfg: ModelConfig
    capture_layers: tuple[int, ...]

    def __call__(self, params: Any, target_params: Any, batch: dict, key: jax.Array):
        captured, final = target_features(target_params, self.target_cfg, batch["tokens"], self.capture_layers)
        return self.loss(params, target_params, {**batch, "captured": captured, "final": final}, key)


def precompute_fits(
    num_tokens: int, capture_layers: Sequence[int], hidden: int, limit_gb: float = 4.0, bytes_per_value: int = 4
) -> bool:
    """Whether precomputed features of a dataset stay under `limit_gb` of host memory."""
    return num_tokens * (len(capture_layers) + 1) * hidden * bytes_per_value <= limit_gb * 2**30


def compute_features(
    params: Any,
    cfg: ModelConfig,
    data: TokenDataset,
    capture_layers: Sequence[int],
    seq_len: int,
    batch_size: int = 8,
    progress: bool = True,
    dtype: Any = np.float32,
) -> TargetFeatures:
    """dtype: how they are stored (np.float32 or ml_dtypes.bfloat16); batches get float32."""
    from tqdm.auto import tqdm

    capture = tuple(capture_layers)
    run = jax.jit(lambda params, tokens: target_features(params, cfg, tokens, capture))

    n_cap = len(capture_layers) * cfg.hidden_size
    kept = np.minimum(np.diff(data.offsets), seq_len)
    offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    captured = np.zeros((int(offsets[-1]), n_cap), dtype)
    final = np.zeros((int(offsets[-1]), cfg.hidden_size), dtype)
    indices = list(range(len(data)))
    for start in tqdm(range(0, len(indices), batch_size), desc="target features", disable=not progress):
        rows = indices[start : start + batch_size]
        tokens = np.zeros((batch_size, seq_len), np.int32)
        for r, i in enumerate(rows):
            seq = data.sequence(i)[:seq_len]
            tokens[r, : len(seq)] = seq
        cap, fin = jax.device_get(run(params, jnp.asarray(tokens)))
        for r, i in enumerate(rows):
            lo, hi = offsets[i], offsets[i + 1]
            captured[lo:hi] = cap[r, : hi - lo]
            final[lo:hi] = fin[r, : hi - lo]
    return TargetFeatures(tuple(capture_layers), captured, final, offsets)


def gather_features(
    data: TokenDataset, features: TargetFeatures, picks: Sequence[int], seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-batch feature arrays [B, seq_len, n*H] and [B, seq_len, H] for sequences `picks`."""
    cap = np.zeros((len(picks), seq_len, features.captured.shape[1]), np.float32)
    fin = np.zeros((len(picks), seq_len, features.final.shape[1]), np.float32)
    for r, i in enumerate(picks):
        lo, hi = features.offsets[i], features.offsets[i + 1]
        n = min(hi - lo, seq_len)
        cap[r, :n] = features.captured[lo : lo + n]
        fin[r, :n] = features.final[lo : lo + n]
    return cap, fin
