"""Logit warping and the exact speculative acceptance rule, vectorised over [B, K]."""

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
    """Draw one token per row from probs [..., V] (one-hot probs give their argmax exactly)."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def accept(
    key: jax.Array,
    target_probs: jax.Array,
    drafts: jax.Array,
    draft_probs: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """The speculative acceptance rule (exact in distribution; token-identical when greedy).

    target_probs: [B, K+1, V] warped p_1..p_{K+1}
    drafts:       [B, K] int32 d_1..d_K
    draft_probs:  [B, K, V] warped q_1..q_K, or None for one-hot drafts (q_i(d_i) = 1)
    Returns (num_accepted [B] in 0..K, next_token [B]): the correction token sampled from
    norm(max(p_{n+1} - q_{n+1}, 0)) when n < K, else the bonus token from p_{K+1}.
    """
    batch, k = drafts.shape
    vocab = target_probs.shape[-1]
    accept_key, token_key = jax.random.split(key)
    # Step 1: p_i(d_i) and q_i(d_i) for every draft.
    p_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    # Step 2: accept d_i when u_i * q_i(d_i) <= p_i(d_i); u in (0, 1] so p = 0 always rejects.
    u = 1.0 - jax.random.uniform(accept_key, (batch, k))
    accepted = u * q_draft <= p_draft
    # Step 3: n = number of leading accepts (cumulative product of the accept mask).
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)
    # Step 4: the distribution the next token comes from: residual at n < K, p_{K+1} at n = K.
    rows = jnp.arange(batch)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    if draft_probs is None:
        q_next = jax.nn.one_hot(drafts[rows, jnp.minimum(num_accepted, k - 1)], vocab) if k else 0.0
    else:
        q_next = draft_probs[rows, jnp.minimum(num_accepted, k - 1)] if k else 0.0
    q_next = jnp.where((num_accepted < k)[:, None], q_next, 0.0)
    residual = jnp.maximum(p_next - q_next, 0.0)
    residual_mass = jnp.sum(residual, axis=-1, keepdims=True)
    next_dist = jnp.where(residual_mass > 0, residual / jnp.maximum(residual_mass, 1e-30), p_next)
    # Step 5: sample it (one-hot under greedy -> the target's argmax).
    next_token = sample(token_key, next_dist)
    return num_accepted.astype(jnp.int32), next_token
