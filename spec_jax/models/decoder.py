"""The one decoder implementation: pure functions over a params pytree.

Layer weights are stacked on a leading `layers` axis and run with `lax.scan`, which keeps compile
time flat in depth. The pieces (`rms_norm`, `rope`, `project_qkv`, `attend`, `mlp`) are public so
the DFlash drafter builds its layers from this same code.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.models.config import ModelConfig, RopeScaling
from spec_jax.models.weights import init_from_specs, model_weight_specs

Params = Any

NEG_INF = -1e30  # finite so fully-masked rows (padding) stay NaN-free


@struct.dataclass
class KVCache:
    """Fixed-capacity KV cache, indexed by absolute position.

    k, v:     [L, B, Kv, S, D]  S = capacity; heads before positions ("heads-major"), so attention
                                contracts each head's [S, D] block in place, with no per-layer
                                transpose (a copy of the whole cache every step)
    lengths:  [B] int32         committed tokens per row

    Slot j holds the key/value of position j. A forward pass over consecutive positions
    p0..p0+T-1 reads only slots < p0 (committed) plus its own new keys, then writes those at their
    positions; so rejected drafts are rolled back by setting `lengths` alone, never by clearing.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=lengths.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype: Any = None) -> KVCache:
    dtype = dtype or cfg.dtype
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
    )


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 1.0) -> Params:
    return init_from_specs(model_weight_specs(cfg), key, jnp.dtype(cfg.dtype), scale)


# ----------------------------------------------------------------------------- pieces
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.x: long wavelengths slowed by `factor`, short kept, a smooth blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, blended, scaled)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [B, T, N, D], positions: [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def project_qkv(lp: Params, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [B, T, H] -> q [B, T, N, D], k/v [B, T, Kv, D] (before q/k norm and RoPE)."""
    q = jnp.einsum("bth,hnd->btnd", x, lp["wq"])
    k = jnp.einsum("bth,hkd->btkd", x, lp["wk"])
    v = jnp.einsum("bth,hkd->btkd", x, lp["wv"])
    return q, k, v


def heads_major(x: jax.Array) -> jax.Array:
    """Keys/values [..., B, T, Kv, D] -> the cache layout [..., B, Kv, T, D]."""
    return jnp.swapaxes(x, -3, -2)


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Write new [L, B, Kv, T, D] into cache [L, B, Kv, S, D] at positions [B, T] (one scatter;
    positions past the capacity are dropped)."""
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    # Indexing dims 1 and 3 (split by a slice) puts the indexed [B, T] first: [B, T, L, Kv, D].
    updates = jnp.transpose(new, (1, 3, 0, 2, 4)).astype(cache.dtype)
    return cache.at[:, rows, :, positions].set(updates, mode="drop")


def attend(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """Grouped-query attention over one or more key/value parts with one joint softmax.

    q: [B, T, N, D]; each part (k, v, mask): k, v [B, Kv, S_i, D] (heads-major, as cached), mask
    [B, T, S_i] bool (True = visible) -> [B, T, N, D]. Parts let a pass attend to a cache and to
    its own new keys without concatenating (copying) the cache.
    """
    b, t, n, d = q.shape
    kv_heads = parts[0][0].shape[1]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, d)  # [B, T, Kv, G, D]
    scores = []
    for k, _, mask in parts:
        s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
        scores.append(jnp.where(mask[:, None, None, :, :], s / math.sqrt(d), NEG_INF))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [B, Kv, G, T, sum S_i]
    out = 0.0
    start = 0
    for k, v, _ in parts:
        p = probs[..., start : start + k.shape[2]].astype(q.dtype)
        out = out + jnp.einsum("bkgts,bksd->btkgd", p, v.astype(q.dtype))
        start += k.shape[2]
    return out.reshape(b, t, n, d)


def attention_output(lp: Params, attn: jax.Array) -> jax.Array:
    """attn [B, T, N, D] -> [B, T, H]. Flattened (N*D) so XLA does not transpose wo every step."""
    b, t, n, d = attn.shape
    return jnp.dot(attn.reshape(b, t, n * d), lp["wo"].reshape(n * d, -1))


def mlp(lp: Params, x: jax.Array) -> jax.Array:
    gate = jnp.einsum("bth,hf->btf", x, lp["w_gate"])
    up = jnp.einsum("bth,hf->btf", x, lp["w_up"])
    return jnp.einsum("btf,fh->bth", jax.nn.silu(gate) * up, lp["w_down"])


def causal_window_mask(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array) -> jax.Array:
    """q_pos [B, T], k_pos [B, S] -> [B, T, S]: key visible when q - window < k <= q."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    return (diff >= 0) & (diff < window)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final-normed hidden states [B, T, H] -> float32 logits [B, T, V]."""
    # Contract the tied embedding as stored ([V, H]): a transposed view would be copied every step.
    if cfg.tie_embeddings:
        return jnp.einsum("bth,vh->btv", x, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("bth,hv->btv", x, params["lm_head"], preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- forward
def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    capture: Sequence[int] = (),
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Run the decoder on `tokens` [B, T] at `positions` [B, T], reading and writing `cache`.

    Returns float32 logits [B, T, V]; the hidden states after each decoder layer in `capture`
    (HF `hidden_states[id + 1]`), concatenated as [B, T, len(capture) * H], or None; and the cache
    with this pass's keys/values written and `lengths` = last position + 1.
    """
    hidden, captured, cache = forward_hidden(params, cfg, tokens, positions, cache, capture)
    return lm_head(params, cfg, hidden), captured, cache


def forward_hidden(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    capture: Sequence[int] = (),
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """`forward` without the LM head: final-normed hidden states [B, T, H] (for losses that need
    logits at a few positions only)."""
    capture = tuple(capture)
    for layer_id in capture:
        if not 0 <= layer_id < cfg.num_layers:
            raise ValueError(f"capture layer {layer_id} outside the model's {cfg.num_layers} layers")
    b, t = tokens.shape
    positions = positions.astype(jnp.int32)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)
    k_pos = jnp.broadcast_to(slots, (b, cache.capacity))
    windows = jnp.asarray(cfg.layer_windows, jnp.int32)
    # capture_slot[layer] = index in the capture buffer, or -1.
    capture_slot = [-1] * cfg.num_layers
    for i, layer_id in enumerate(capture):
        capture_slot[layer_id] = i
    capture_slot = jnp.asarray(capture_slot, jnp.int32)
    x = embed(params, tokens)
    captured0 = jnp.zeros((max(len(capture), 1), b, t, cfg.hidden_size), x.dtype)
    # Cached slots this pass may read: those before its first position (later ones are stale
    # drafts or about to be overwritten). Positions within a row are consecutive.
    before_pass = k_pos[:, None, :] < positions[:, :1, None]  # [B, 1, S]

    def layer(carry, xs):
        x, captured = carry
        lp, k_cached, v_cached, window, slot = xs  # k/v_cached: [B, Kv, S, D], read only
        with jax.named_scope("attention"):
            h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
            q, k, v = project_qkv(lp, h)
            if cfg.qk_norm:
                q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
            q = rope(q, positions, inv_freq)
            k, v = heads_major(rope(k, positions, inv_freq)), heads_major(v)  # [B, Kv, T, D]
            cached_mask = before_pass & causal_window_mask(positions, k_pos, window)
            new_mask = causal_window_mask(positions, positions, window)
            attn = attend(q, [(k_cached, v_cached, cached_mask), (k, v, new_mask)])
            x = x + attention_output(lp, attn).astype(x.dtype)
        with jax.named_scope("mlp"):
            x = x + mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)).astype(x.dtype)
        if capture:
            idx = jnp.maximum(slot, 0)
            captured = captured.at[idx].set(jnp.where(slot >= 0, x, captured[idx]))
        return (x, captured), (k, v)

    xs = (params["layers"], cache.k, cache.v, windows, capture_slot)
    (x, captured), (new_k, new_v) = jax.lax.scan(layer, (x, captured0), xs)
    # One scatter per pass writes every layer's new keys/values at their positions (in place);
    # positions past capacity are dropped.
    k_cache = write_kv(cache.k, new_k, positions)
    v_cache = write_kv(cache.v, new_v, positions)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    new_cache = KVCache(k=k_cache, v=v_cache, lengths=positions[:, -1] + 1)
    if not capture:
        return x, None, new_cache
    # [n, B, T, H] -> [B, T, n * H], layer order as requested.
    captured = jnp.moveaxis(captured, 0, 2).reshape(b, t, len(capture) * cfg.hidden_size)
    return x, captured, new_cache
