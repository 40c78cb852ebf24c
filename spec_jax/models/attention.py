"""Attention over a KV cache plus a pass's own keys: the one function every pass goes through.

`attend` is grouped-query attention over any number of key/value parts with one joint softmax
(the dense reference). `attend_cache_and_pass` is what a decoder pass needs under the cache
contract of `spec_jax.models.interface`: each query sees the row's committed cache slots
(`slot < cache_lengths[b]`, within the layer's window) and the pass's own keys its in-pass mask
allows.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite so fully-masked rows (padding) stay NaN-free

AttentionParts = Sequence[tuple[jax.Array, jax.Array, jax.Array]]


def float32_precision() -> jax.lax.Precision | None:
    """The dot precision that computes float32 in float32 on the backend being traced for.

    HIGHEST on GPU and TPU, whose DEFAULT rounds float32 operands (TF32, bfloat16 passes). None
    (DEFAULT) on CPU: XLA:CPU's DEFAULT float32 dot is already exact float32 (bit-identical to
    HIGHEST, tested), and HIGHEST there selects a slower kernel: 2.7x slower at batch 32, 1.3x
    at batch 1 on the 2-core VM (benchmarks/RESULTS.md)."""
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST


def einsum(
    subscripts: str, x: jax.Array, y: jax.Array, preferred_element_type=None
) -> jax.Array:
    """`jnp.einsum` at the precision the operands' dtype promises: float32 products in float32
    (`float32_precision`), the backend's fast default for bfloat16."""
    full = jnp.result_type(x, y) == jnp.float32
    precision = float32_precision() if full else None
    return jnp.einsum(
        subscripts, x, y, precision=precision, preferred_element_type=preferred_element_type
    )


def attend(q: jax.Array, parts: AttentionParts) -> jax.Array:
    """Grouped-query attention over one or more key/value parts with one joint softmax.

    q: [B, T, N, D]; each part (k, v, mask): k, v [B, Kv, S_i, D] (heads-major, as cached), mask
    [B, T, S_i] bool (True = visible) -> [B, T, N, D]. Parts let a pass attend to a cache and to
    its own new keys without concatenating (copying) the cache.
    """
    b, t, n, d = q.shape
    kv_heads = parts[0][0].shape[1]
    groups = n // kv_heads
    # Queries as [B, Kv, T*G, D] (row m = t * G + g): both dots are then plain batched matmuls
    # over (B, Kv) in the cache's own layout, so XLA transposes only the small q and output,
    # never the [S]-long scores or the cache (2.3x faster attention at batch 32 on XLA:CPU).
    qh = jnp.swapaxes(q.reshape(b, t, kv_heads, groups, d), 1, 2).reshape(b, kv_heads, t * groups, d)
    scores = []
    for k, _, mask in parts:
        s = einsum("bkmd,bksd->bkms", qh, k.astype(q.dtype), preferred_element_type=jnp.float32)
        mask = jnp.broadcast_to(mask, (b, t, k.shape[2]))  # a [B, 1, S_i] mask holds for every query
        visible = jnp.repeat(mask, groups, axis=1)[:, None]  # [B, 1, T*G, S_i]
        scores.append(jnp.where(visible, s / math.sqrt(d), NEG_INF))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [B, Kv, T*G, sum S_i]
    out = 0.0
    start = 0
    for k, v, _ in parts:
        p = probs[..., start : start + k.shape[2]].astype(q.dtype)
        out = out + einsum("bkms,bksd->bkmd", p, v.astype(q.dtype))
        start += k.shape[2]
    return jnp.swapaxes(out.reshape(b, kv_heads, t, groups, d), 1, 2).reshape(b, t, n, d)


def cache_visibility(
    cache_lengths: jax.Array, q_positions: jax.Array, capacity: int, window: int
) -> jax.Array:
    """[B, T, S] bool: committed slot s (holding position s) is visible to query t of row b when
    s < cache_lengths[b] and it is inside the window: q_positions[b, t] - s < window."""
    slots = jnp.arange(capacity, dtype=jnp.int32)
    committed = slots[None, None, :] < cache_lengths[:, None, None]
    in_window = q_positions[:, :, None] - slots[None, None, :] < window
    return committed & in_window


def attend_cache_and_pass(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    q_positions: jax.Array,
    window: int,
    k_pass: jax.Array,
    v_pass: jax.Array,
    pass_mask: jax.Array,
) -> jax.Array:
    """Attention of a pass's queries over the committed cache and the pass's own keys.

    q [B, T, N, D] (rotated) at q_positions [B, T]; k_cache/v_cache [B, Kv, S, D]; cache_lengths
    [B] committed slots per row (slot s holds position s); window: the layer's attention window
    (GLOBAL_WINDOW for full attention), applied to the cache here; k_pass/v_pass [B, Kv, T', D]
    the pass's own keys; pass_mask [B or 1, T, T'] which of them each query sees (window and
    causality already folded in by the caller). -> [B, T, N, D].

    The cache may already hold the pass's own keys at slots >= cache_lengths (written first, so
    XLA updates it in place); they are not read from it.
    """
    visible = cache_visibility(cache_lengths, q_positions, k_cache.shape[2], window)
    return attend(q, [(k_cache, v_cache, visible), (k_pass, v_pass, pass_mask)])
