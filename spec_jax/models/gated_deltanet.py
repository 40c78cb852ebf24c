"""Gated DeltaNet (Qwen3.5 / Qwen3-Next "linear_attention" layers) under the cache contract.

A layer keeps, per row, a float32 state S [Hv, dk, dv] and the last `kernel - 1` inputs of its
short causal convolution. Token t updates (the gated delta rule, HF `torch_recurrent_gated_delta_rule`):

    S' = exp(g_t) S_parent;  delta_t = beta_t (v_t - S'^T k_t);  S_t = S' + k_t delta_t^T;  o_t = S_t^T q_t

Unrolled over a pass, with G_t the summed log-decay of t's ancestors-or-self in the pass:

    S_t = exp(G_t) S_0 + sum_{j <= t} exp(G_t - G_j) k_j delta_j^T        (j <= t: j is t or an ancestor)
    delta + beta * A delta = beta * (v - exp(G) K S_0),  A_tj = exp(G_t - G_j) k_t.k_j (strict ancestors)

so one pass solves a unit lower-triangular system for all deltas at once (the chunked "WY" form
of prefill kernels) under the pass's in-pass mask: a causal mask for a chain, the ancestor mask
for a token tree, whose nodes then each continue their parent's state. Prefill runs it over
chunks of `CHUNK` tokens; shorter passes are one chunk.

Rollback (the pass record, `spec_jax.models.recurrent`): the pass keeps k, delta and G for each
token and the state at each chunk's start, so commit rebuilds the state after any committed
token with the sum above (one weighted [T, dk] x [T, dv] contraction per head), and the
convolution's state from the pass's inputs along the token's branch. Per row and layer that is
T * Hv * (dk + dv + 1) + T * conv_channels numbers beyond the state itself (a pass of up to
CHUNK tokens starts from the cache's state; a longer one keeps one state per chunk):
`rollback_bytes_per_row`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.models.attention import einsum
from spec_jax.models.recurrent import ancestors, pass_parents

CHUNK = 64  # tokens per chunk of a long (prefill) pass


@dataclasses.dataclass(frozen=True)
class DeltaNetDims:
    """Static sizes of a Gated DeltaNet layer (HF `linear_*` config fields)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def rollback_bytes_per_row(dims: DeltaNetDims, pass_len: int, dtype_bytes: int = 4) -> int:
    """Bytes one row's pass record takes in one Gated DeltaNet layer beyond its state: per token
    k, delta and the summed decay (float32) and the convolution's input (model dtype); a pass
    longer than CHUNK tokens also keeps each chunk's start state."""
    chunks = -(-pass_len // CHUNK) if pass_len > CHUNK else 0
    per_token = 4 * dims.value_heads * (dims.key_dim + dims.value_dim + 1) + dtype_bytes * dims.conv_channels
    return pass_len * per_token + 4 * chunks * dims.value_heads * dims.key_dim * dims.value_dim


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_norm(x: jax.Array, weight: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """RMSNorm(x) * weight * silu(gate), computed in float32 (HF `RMSNormGated`)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    normed = weight * x32.astype(x.dtype)
    return (normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """The inverse of unit lower-triangular matrices [..., n, n] by recursive 2 x 2 blocking
    (inv [[A, 0], [C, D]] = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]), both halves of a level inverted
    as one batch: log2(n) levels of batched matmuls. (XLA:CPU's triangular_solve took 0.9 s for
    32 x 32 systems over 32 heads, this 7 ms, as accurate in float32.) n is padded to a power of
    two with an identity block."""
    n = lower.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        pad = [(0, 0)] * (lower.ndim - 2) + [(0, size - n)] * 2
        lower = jnp.pad(lower, pad) + jnp.diag((jnp.arange(size) >= n).astype(lower.dtype))

    def inverse(m):
        if m.shape[-1] == 1:
            return jnp.ones_like(m)
        h = m.shape[-1] // 2
        both = inverse(jnp.stack([m[..., :h, :h], m[..., h:, h:]]))
        top_left, bottom_right = both[0], both[1]
        bottom_left = -einsum("...ij,...jk->...ik", bottom_right,
                              einsum("...ij,...jk->...ik", m[..., h:, :h], top_left))
        top = jnp.concatenate([top_left, jnp.zeros_like(top_left)], axis=-1)
        return jnp.concatenate([top, jnp.concatenate([bottom_left, bottom_right], axis=-1)], axis=-2)

    return inverse(lower)[..., :n, :n]


def delta_rule_chunk(q, k, v, g, beta, state, visible):
    """One chunk of the gated delta rule under an in-pass mask.

    q, k [B, H, T, dk] (normalised; q scaled), v [B, H, T, dv], g, beta [B, H, T], state
    [B, H, dk, dv] (float32, the state before the chunk), visible [B or 1, T, T] (t sees j: j is
    t or an ancestor). -> (out [B, H, T, dv], delta [B, H, T, dv], G [B, H, T])."""
    t = q.shape[2]
    seen = visible[:, None]  # [B, 1, T, T]
    G = einsum("bhj,bhtj->bht", g, jnp.broadcast_to(seen, g.shape[:2] + (t, t)).astype(g.dtype))
    decay = jnp.where(seen, jnp.exp(jnp.where(seen, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
    strict = seen & ~jnp.eye(t, dtype=bool)
    a = jnp.where(strict, einsum("bhtd,bhjd->bhtj", k, k) * decay, 0.0) * beta[..., None]
    rhs = beta[..., None] * (v - jnp.exp(G)[..., None] * einsum("bhtd,bhdv->bhtv", k, state))
    delta = einsum("bhtj,bhjv->bhtv", unit_lower_inverse(a + jnp.eye(t, dtype=a.dtype)), rhs)
    scores = jnp.where(seen, einsum("bhtd,bhjd->bhtj", q, k) * decay, 0.0)
    out = jnp.exp(G)[..., None] * einsum("bhtd,bhdv->bhtv", q, state) + einsum("bhtj,bhjv->bhtv", scores, delta)
    return out, delta, G


def gated_delta_rule(q, k, v, g, beta, state, mask):
    """The gated delta rule over a pass: `mask` [B, T, T] (a tree) or a short chain -> one chunk;
    a long chain (prefill) -> chunks of CHUNK, each from the state the previous one left.

    -> (out [B, H, T, dv], record): record holds per token k [B, H, T', dk], delta [B, H, T', dv],
    G [B, H, T'] (the log-decay summed since its chunk's start) and, for a chunked pass, each
    chunk's start state [B, C, H, dk, dv] (T' = T rounded up to whole chunks)."""
    b, h, t, _ = q.shape
    if mask is not None or t <= CHUNK:
        visible = jnp.tril(jnp.ones((t, t), bool))[None] if mask is None else mask.astype(bool)
        out, delta, G = delta_rule_chunk(q, k, v, g, beta, state, visible)
        # One chunk starts from the state before the pass, which the cache still holds.
        return out, {"keys": k, "deltas": delta, "decays": G}
    chunks = -(-t // CHUNK)
    pad = chunks * CHUNK - t

    def split(x):  # [B, H, T, ...] -> [C, B, H, CHUNK, ...]; padded tokens (beta 0, g 0) change nothing
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(b, h, chunks, CHUNK, *x.shape[3:]), 2, 0)

    causal = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))[None]

    def step(s, xs):
        qc, kc, vc, gc, bc = xs
        out, delta, G = delta_rule_chunk(qc, kc, vc, gc, bc, s, causal)
        decay = jnp.exp(G[..., -1:] - G)  # [B, H, CHUNK] from each token to the chunk's end
        end = jnp.exp(G[..., -1])[..., None, None] * s + einsum("bhjd,bhjv->bhdv", kc * decay[..., None], delta)
        return end, (out, delta, G, s)

    _, (out, delta, G, starts) = jax.lax.scan(step, state, tuple(split(x) for x in (q, k, v, g, beta)))

    def join(x):  # [C, B, H, CHUNK, ...] -> [B, H, C * CHUNK, ...]
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(b, h, chunks * CHUNK, *x.shape[4:])

    record = {"keys": join(split(k)), "deltas": join(delta), "decays": join(G),
              "chunk_states": jnp.moveaxis(starts, 0, 1)}
    return join(out)[:, :, :t], record


def delta_net(lp: Any, h: jax.Array, conv_state: jax.Array, state: jax.Array, mask: jax.Array | None,
              dims: DeltaNetDims) -> tuple[jax.Array, dict]:
    """The token mixer of a "linear_attention" layer on the normed input h [B, T, H].

    conv_state [B, kernel - 1, C] (the last inputs before the pass), state [B, Hv, dk, dv]
    float32; mask None (a chain) or the in-pass ancestor mask [B, T, T]. Weights: `linear_qkv`
    [H, C] and `linear_z` [H, Hv * dv] (Qwen3.5) or `linear_qkvz` [H, Hk, ...] grouped per key head
    (Qwen3-Next), likewise `linear_b`/`linear_a` [H, Hv] or `linear_ba`, `conv` [C, 1, kernel],
    `dt_bias`, `A_log` [Hv], `linear_norm` [dv], `linear_out` [Hv * dv, H].
    -> (output [B, T, H], the pass record for commit)."""
    b, t, _ = h.shape
    hk, hv, dk, dv = dims.key_heads, dims.value_heads, dims.key_dim, dims.value_dim
    if "linear_qkvz" in lp:  # Qwen3-Next: [q, k, v, z] and [b, a] interleaved per key head
        grouped = einsum("bth,hgc->btgc", h, lp["linear_qkvz"])
        r = hv // hk
        q, k, v, z = jnp.split(grouped, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1)
        beta_in, a_in = jnp.split(einsum("bth,hgc->btgc", h, lp["linear_ba"]), 2, axis=-1)
        beta_in, a_in = beta_in.reshape(b, t, hv), a_in.reshape(b, t, hv)
    else:
        mixed = einsum("bth,hc->btc", h, lp["linear_qkv"])  # [B, T, C] before the convolution
        z = einsum("bth,hc->btc", h, lp["linear_z"])
        beta_in, a_in = einsum("bth,hc->btc", h, lp["linear_b"]), einsum("bth,hc->btc", h, lp["linear_a"])
    z = z.reshape(b, t, hv, dv)
    # The short causal convolution, along each token's branch (its ancestors in a tree).
    kernel = dims.conv_kernel
    parents = pass_parents(mask, t)
    window = ancestors(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), parents, kernel)
    inputs = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)  # [B, kernel - 1 + T, C]
    taps = inputs[jnp.arange(b)[:, None, None], kernel - 1 + window]  # [B, T, kernel, C]
    conv = jax.nn.silu(jnp.einsum("btkc,ck->btc", taps, lp["conv"][:, 0, :].astype(taps.dtype)))
    q, k, v = jnp.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
    f32 = jnp.float32
    q = l2_normalize(q.reshape(b, t, hk, dk).astype(f32)) * dk ** -0.5
    k = l2_normalize(k.reshape(b, t, hk, dk).astype(f32))
    q, k = (jnp.repeat(x, hv // hk, axis=2).transpose(0, 2, 1, 3) for x in (q, k))  # [B, Hv, T, dk]
    v = v.reshape(b, t, hv, dv).astype(f32).transpose(0, 2, 1, 3)
    beta = jax.nn.sigmoid(beta_in.astype(f32)).transpose(0, 2, 1)  # [B, Hv, T]
    g = -jnp.exp(lp["A_log"].astype(f32)) * jax.nn.softplus(a_in.astype(f32) + lp["dt_bias"].astype(f32))
    out, record = gated_delta_rule(q, k, v, g.transpose(0, 2, 1), beta, state, mask)
    out = gated_norm(out.transpose(0, 2, 1, 3).astype(h.dtype), lp["linear_norm"], z, dims.eps)
    record.update(conv_inputs=mixed, parents=jnp.broadcast_to(parents, (b, t)),
                  visible=None if mask is None else mask.astype(bool))
    return einsum("bti,ih->bth", out.reshape(b, t, hv * dv), lp["linear_out"]), record


def commit_delta_net(conv_state: jax.Array, state: jax.Array, record: dict,
                     last: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer's (conv state, state) after each row's last committed pass token `last` [B]
    (-1: none, the states before the pass stay)."""
    b = last.shape[0]
    rows = jnp.arange(b)
    keys, deltas, G = record["keys"], record["deltas"], record["decays"]
    padded = keys.shape[2]
    i = jnp.maximum(last, 0)
    if "chunk_states" in record:  # a chunked (long) pass
        chunk = padded // record["chunk_states"].shape[1]
        start = record["chunk_states"][rows, i // chunk]  # [B, H, dk, dv]
    else:
        chunk, start = padded, state
    j = jnp.arange(padded)
    if record["visible"] is None:
        member = (j[None] <= i[:, None]) & (j[None] // chunk == (i // chunk)[:, None])  # [B, T']
    else:
        member = record["visible"][rows, i]
    g_last = G[rows, :, i]  # [B, H]
    weight = jnp.where(member[:, None], jnp.exp(jnp.where(member[:, None], g_last[..., None] - G, 0.0)), 0.0)
    rebuilt = jnp.exp(g_last)[..., None, None] * start + einsum("bhjd,bhjv->bhdv", keys * weight[..., None], deltas)
    new_state = jnp.where((last >= 0)[:, None, None, None], rebuilt, state)
    kernel = conv_state.shape[1] + 1
    inputs = jnp.concatenate([conv_state, record["conv_inputs"].astype(conv_state.dtype)], axis=1)
    window = ancestors(last[:, None], record["parents"], kernel - 1)[:, 0]  # [B, kernel - 1]
    new_conv = inputs[rows[:, None], kernel - 1 + window]
    return new_conv, new_state
