"""Sampling primitives shared by the loop and the drafters: traced sampling values, logit warping
(temperature -> top-k -> top-p) and drawing a token.

This module sits below both `spec_jax.decoding` and `spec_jax.drafters`, so drafters warp their
draft logits exactly as the loop warps the target's without importing the loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingParams:
    """Traced sampling values: changing them never recompiles.

    temperature: [] f32, 0 = greedy.  top_k: [] int32, 0 = off.  top_p: [] f32, 1 = off.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def create(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        validate_sampling(temperature, top_k, top_p)
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
        )

    @property
    def greedy(self) -> jax.Array:
        return self.temperature <= 0.0


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Host-side checks, raised before anything compiles."""
    if not temperature >= 0:  # also catches NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0 = off), got {top_k}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}.")


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside top-k, then outside the top-p nucleus (HF order). [..., V]."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    rank = jnp.arange(vocab)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    in_top_k = rank < k
    sorted_probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = in_top_k & (mass_before < top_p)
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def warp(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Logits [..., V] -> probabilities [..., V] f32: temperature, then top-k, then top-p.

    Greedy (temperature 0) gives the one-hot argmax, so the acceptance rule below reduces to
    "accept while the draft equals the target's argmax" with no separate code path.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]

    def sampled(_):
        scaled = logits / jnp.maximum(sampling.temperature, 1e-6)
        needs_sort = (sampling.top_k > 0) | (sampling.top_p < 1.0)
        scaled = jax.lax.cond(
            needs_sort, lambda s: _truncate(s, sampling.top_k, sampling.top_p), lambda s: s, scaled
        )
        return jax.nn.softmax(scaled, axis=-1)

    def greedy(_):
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)

    return jax.lax.cond(sampling.greedy, greedy, sampled, None)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one token per row from probs [..., V] (one-hot probs give their argmax exactly).

    When every row has a single nonzero entry (greedy), the draw is that entry whatever the
    noise, so the Gumbel noise over the whole vocabulary (the bulk of a greedy step's sampling
    cost on CPU) is skipped; the result is the same token either way."""

    def draw(_):
        return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)

    def only_entry(_):
        return jnp.argmax(probs, axis=-1).astype(jnp.int32)

    deterministic = jnp.all(jnp.sum(probs > 0, axis=-1) == 1)
    return jax.lax.cond(deterministic, only_entry, draw, None)
