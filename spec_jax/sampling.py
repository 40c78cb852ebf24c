"""Sampling primitives shared by the loop and the drafters: traced sampling values, logit warping
(temperature -> top-k -> top-p) and drawing a token.

This module sits below both `spec_jax.decoding` and `spec_jax.drafters`, so drafters warp their
draft logits exactly as the loop warps the target's without importing the loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingParams:
    """Traced sampling values: changing them never recompiles.

    temperature: [] f32, 0 = greedy.  top_k: [] int32, 0 = off.  top_p: [] f32, 1 = off.
    Each may instead be [B], one value per row (the engine's requests each have their own);
    `warp` then applies row b's values to logits [B, ..., V] row b.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def create(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        validate_sampling(temperature, top_k, top_p)
        return cls._of(temperature, top_k, top_p)

    @classmethod
    def per_row(cls, temperature, top_k, top_p) -> "SamplingParams":
        """Values per row: three sequences of length B, each entry checked like `create`'s."""
        for t, k, p in zip(temperature, top_k, top_p, strict=True):
            validate_sampling(t, k, p)
        return cls._of(temperature, top_k, top_p)

    @classmethod
    def _of(cls, temperature, top_k, top_p) -> "SamplingParams":
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


def ordered_keys(x: jax.Array) -> jax.Array:
    """float32 values -> uint32 keys in the same order (-0.0 as +0.0, so equal values get equal
    keys): negative floats' bits inverted, positive ones' sign bit set."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _smallest_key_where(holds: Any, shape: tuple[int, ...]) -> jax.Array:
    """The smallest uint32 key t where `holds(t)` ([..., 1] bool, monotone: False below some key,
    True from it on; True at the largest key) is True, per row [..., 1]: bisection, 32 rounds, each
    one pass over the row (no sort)."""

    def halve(_, bounds):
        below, at = bounds  # holds(below) is False (or below the keys), holds(at) is True
        mid = below + (at - below) // 2
        ok = holds(mid)
        return jnp.where(ok, below, mid), jnp.where(ok, mid, at)

    start = (jnp.zeros(shape, jnp.uint32), jnp.full(shape, 0xFFFFFFFF, jnp.uint32))
    return jax.lax.fori_loop(0, 32, halve, start)[1]


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside top-k, then outside the top-p nucleus, as transformers' warpers do
    (ties with the k-th value stay in; a token stays while the mass of the tokens above it is
    under top_p, so the most likely one always does; top_p = 1 keeps all). [..., V].

    No sort: each cut is a threshold found by bisection on the values' bit order, 32 passes over
    the row. A full-vocabulary sort took 489 ms for 64 rows of 49152 on this 2-core CPU, the
    two bisections 32 (`benchmarks/sampled_step.py --warp`; benchmarks/RESULTS.md, session 38)."""
    vocab, shape = scaled.shape[-1], scaled.shape[:-1] + (1,)
    keys = ordered_keys(scaled)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)

    def kth_key(_):  # the k-th largest value's key: the smallest t with fewer than k keys above it
        return _smallest_key_where(lambda t: jnp.sum(keys > t, axis=-1, keepdims=True) < k, shape)

    in_top_k = keys >= jax.lax.cond(jnp.any(top_k > 0), kth_key, lambda _: jnp.zeros(shape, jnp.uint32), None)
    probs = jax.nn.softmax(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)

    def nucleus_key(_):  # the smallest t with less than top_p of the mass above it
        return _smallest_key_where(
            lambda t: jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1, keepdims=True) < top_p, shape)

    in_nucleus = keys >= jax.lax.cond(jnp.any(top_p < 1.0), nucleus_key, lambda _: jnp.zeros(shape, jnp.uint32), None)
    return jnp.where(in_top_k & (in_nucleus | (top_p >= 1.0)), scaled, -jnp.inf)


def warp(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """Logits [..., V] -> probabilities [..., V] f32: temperature, then top-k, then top-p.

    Greedy (temperature 0) gives the one-hot argmax, so the acceptance rule below reduces to
    "accept while the draft equals the target's argmax" with no separate code path.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    per_row = jnp.ndim(sampling.temperature) > 0

    def rows(value: jax.Array) -> jax.Array:
        # [B] per-row values -> [B, 1, ..., 1] against logits [B, ..., V]; scalars stay scalars.
        return jnp.reshape(value, jnp.shape(value) + (1,) * (logits.ndim - jnp.ndim(value)))

    temperature, top_k, top_p = rows(sampling.temperature), rows(sampling.top_k), rows(sampling.top_p)

    def greedy(_):
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)

    def sampled(_):
        scaled = logits / jnp.maximum(temperature, 1e-6)
        truncates = jnp.any((sampling.top_k > 0) | (sampling.top_p < 1.0))
        scaled = jax.lax.cond(truncates, lambda s: _truncate(s, top_k, top_p), lambda s: s, scaled)
        probs = jax.nn.softmax(scaled, axis=-1)
        if per_row:  # greedy rows beside sampled ones keep their exact one-hot argmax
            probs = jnp.where(temperature <= 0.0, greedy(None), probs)
        return probs

    return jax.lax.cond(jnp.all(sampling.greedy), greedy, sampled, None)


def split_key(key: jax.Array, num: int = 2) -> jax.Array:
    """`jax.random.split` for one key ([num] keys), or for per-row keys [B] (the engine's: each
    request's own) -> [num, B], row b's keys split from row b's key alone."""
    if jnp.ndim(key) == 0:
        return jax.random.split(key, num)
    return jax.vmap(lambda row_key: jax.random.split(row_key, num), out_axes=1)(key)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """U[0, 1) of `shape`. Per-row keys [B] draw row b's numbers (shape[1:]) from row b's key
    alone, so a row's draws do not depend on which other rows share the batch or where it sits."""
    if jnp.ndim(key) == 0:
        return jax.random.uniform(key, shape)
    return jax.vmap(lambda row_key: jax.random.uniform(row_key, shape[1:]))(key)


CDF_BLOCK = 128  # vocabulary entries per block of the two-level CDF in `sample`


def _inverse_cdf_draw(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row of probs [..., V] from a single uniform per row (inverse CDF).

    Gumbel-max needs a random number per vocabulary entry; at batch 64 over 49k tokens that
    noise was most of a sampled decode step's sampling cost on CPU. The CDF is
    two-level (cumulative sums within blocks of CDF_BLOCK, then over block totals), which keeps
    float32 rounding to about 500 additions instead of V. A token of probability 0 is never
    drawn: only blocks and entries with mass are chosen.
    """
    vocab = probs.shape[-1]
    pad = -vocab % CDF_BLOCK
    if pad:
        probs = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, pad)])
    blocks = probs.reshape(probs.shape[:-1] + (-1, CDF_BLOCK))  # [..., nb, CDF_BLOCK]
    within = jnp.cumsum(blocks, axis=-1)  # CDF inside each block
    block_mass = within[..., -1]  # [..., nb]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    u = uniform(key, probs.shape[:-1]) * block_cdf[..., -1]  # in [0, total mass)

    def first_above(cdf: jax.Array, mass: jax.Array, threshold: jax.Array) -> jax.Array:
        # The first entry with mass whose CDF passes the threshold (the inverse CDF). XLA's
        # cumsum need not be monotone to the last bit, so "count the entries below" could
        # land on an entry without mass; rounding past the total takes the last entry with mass.
        hit = (cdf > threshold[..., None]) & (mass > 0)
        last = mass.shape[-1] - 1 - jnp.argmax(jnp.flip(mass > 0, axis=-1), axis=-1)
        return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last)

    b = first_above(block_cdf, block_mass, u)
    mass_before = jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[..., None], -1)[..., 0]
    rest = u - jnp.where(b > 0, mass_before, 0.0)
    within_b = jnp.take_along_axis(within, b[..., None, None], axis=-2)[..., 0, :]  # [..., CDF_BLOCK]
    probs_b = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]
    i = first_above(within_b, probs_b, rest)
    return (b * CDF_BLOCK + i).astype(jnp.int32)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one token per row from probs [..., V] (one-hot probs give their argmax exactly).

    When every row has a single nonzero entry (greedy), the draw is that entry whatever the
    random number, so it is skipped; the result is the same token either way."""

    def draw(_):
        return _inverse_cdf_draw(key, probs)

    def only_entry(_):
        return jnp.argmax(probs, axis=-1).astype(jnp.int32)

    deterministic = jnp.all(jnp.sum(probs > 0, axis=-1) == 1)
    return jax.lax.cond(deterministic, only_entry, draw, None)


def sample_chain(run_chain, k: int, key: jax.Array, sampling: SamplingParams):
    """Sample a chain drafter's K drafts. `run_chain(choose)` runs the chain, calling
    choose(step, logits [B, V]) -> draft [B] once per step; each draft is drawn from the warped
    logits (the argmax under greedy). -> (what run_chain returned, the draws' probabilities
    [B, K, V], which exact acceptance needs)."""
    keys = split_key(key, k)
    chosen_probs = []

    def choose(step, logits):
        probs = warp(logits, sampling)  # one-hot argmax under greedy
        chosen_probs.append(probs)
        return sample(keys[step], probs)

    return run_chain(choose), jnp.stack(chosen_probs, 1)
