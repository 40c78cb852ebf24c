"""The one decoder implementation: pure functions over a params pytree.

Each decoder layer has its own weight arrays (`params["layers"][i]`, see `spec_jax.models.weights`)
and its own KV-cache arrays, and the layer loop is unrolled at trace time, so no slice of a stacked
weight (which XLA:GPU copies before the matmul) is left in the compiled step. `decoder_layer` is the
one layer implementation: targets, draft models and the DFlash drafter differ only in what the
queries attend to. The pieces (`rms_norm`, `rope`, `project_qkv`, `attend`, `mlp`) are public too.

Precision: a float32 model means float32 matmuls. XLA:GPU would otherwise run float32 dots as TF32
(about 10 mantissa bits), so every einsum here goes through `einsum`, which asks for full precision
when its operands are float32 and keeps the fast default for bfloat16.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.models.config import ModelConfig, RopeScaling
from spec_jax.models.weights import init_from_specs, model_weight_specs

Params = Any

NEG_INF = -1e30  # finite so fully-masked rows (padding) stay NaN-free


@struct.dataclass
class KVCache:
    """Fixed-capacity KV cache, indexed by absolute position; one array per layer.

    k, v:     L-tuples of [B, Kv, S, D]  S = capacity; heads before positions ("heads-major"), so
                                         attention contracts each head's [S, D] block in place
    lengths:  [B] int32                  committed tokens per row

    Slot j holds the key/value of position j. A forward pass over consecutive positions
    p0..p0+T-1 writes its keys/values at those positions and then attends causally to slots <= its
    own position: slots < p0 are committed, later slots are masked. So rejected drafts are rolled
    back by setting `lengths` alone, never by clearing.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=lengths.astype(jnp.int32))


def empty_cache(
    num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: Any
) -> KVCache:
    shape = (batch, num_kv_heads, capacity, head_dim)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype: Any = None) -> KVCache:
    return empty_cache(
        cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype or cfg.dtype
    )


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 1.0) -> Params:
    return init_from_specs(model_weight_specs(cfg), key, jnp.dtype(cfg.dtype), scale)


# ----------------------------------------------------------------------------- pieces
def float32_precision() -> jax.lax.Precision | None:
    """The dot precision that computes float32 in float32 on the backend being traced for.

    HIGHEST on GPU and TPU, whose DEFAULT rounds float32 operands (TF32, bfloat16 passes). None
    (DEFAULT) on CPU: XLA:CPU's DEFAULT float32 dot is already exact float32 (bit-identical to
    HIGHEST, tested), and HIGHEST there selects a slower kernel: 2.7x slower at batch 32, 1.3x
    at batch 1 on the 2-core VM (benchmarks/RESULTS.md)."""
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST


def einsum(
    subscripts: str, x: jax.Array, y: jax.Array, preferred_element_type: Any = None
) -> jax.Array:
    """`jnp.einsum` at the precision the operands' dtype promises: float32 products in float32
    (`float32_precision`), the backend's fast default for bfloat16."""
    full = jnp.result_type(x, y) == jnp.float32
    precision = float32_precision() if full else None
    return jnp.einsum(
        subscripts, x, y, precision=precision, preferred_element_type=preferred_element_type
    )


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
    q = einsum("bth,hnd->btnd", x, lp["wq"])
    k = einsum("bth,hkd->btkd", x, lp["wk"])
    v = einsum("bth,hkd->btkd", x, lp["wv"])
    return q, k, v


def heads_major(x: jax.Array) -> jax.Array:
    """Keys/values [B, T, Kv, D] -> the cache layout [B, Kv, T, D]."""
    return jnp.swapaxes(x, -3, -2)


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Write new [B, Kv, T, D] into one layer's cache [B, Kv, S, D] at positions [B, T] (one
    scatter, in place; positions past the capacity are dropped)."""
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    # Indexing dims 0 and 2 (split by a slice) puts the indexed [B, T] first: [B, T, Kv, D].
    updates = jnp.swapaxes(new, 1, 2).astype(cache.dtype)
    return cache.at[rows, :, positions].set(updates, mode="drop")


AttentionParts = Sequence[tuple[jax.Array, jax.Array, jax.Array]]


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


def attention_output(lp: Params, attn: jax.Array) -> jax.Array:
    """attn [B, T, N, D] -> [B, T, H]. Flattened (N*D) so XLA does not transpose wo every step."""
    b, t, n, d = attn.shape
    return einsum("bti,ih->bth", attn.reshape(b, t, n * d), lp["wo"].reshape(n * d, -1))


def mlp(lp: Params, x: jax.Array) -> jax.Array:
    gate = einsum("bth,hf->btf", x, lp["w_gate"])
    up = einsum("bth,hf->btf", x, lp["w_up"])
    return einsum("btf,fh->bth", jax.nn.silu(gate) * up, lp["w_down"])


def causal_window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | jax.Array) -> jax.Array:
    """q_pos [B, T], k_pos [B, S] -> [B, T, S]: key visible when q - window < k <= q."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    return (diff >= 0) & (diff < window)


# What one layer's queries attend to: given the layer's new keys/values [B, Kv, T, D] (normed,
# rotated), return the attention parts and anything the caller wants back (e.g. updated caches).
AttendTo = Callable[[jax.Array, jax.Array], tuple[AttentionParts, Any]]


def decoder_layer(
    lp: Params,
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    eps: float,
    attend_to: AttendTo,
    attn_input: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer: RMSNorm -> GQA attention (per-head q/k RMSNorm when the layer
    has `q_norm`/`k_norm`, RoPE at `positions` [B, T]) -> residual -> RMSNorm -> SwiGLU -> residual.

    The one layer of targets, draft models, DFlash and EAGLE-3; `attend_to` says what the queries
    see. `attn_input`, when given, is what q/k/v are projected from instead of norm(x) (EAGLE-3's
    first layer: [norm(embedding), norm(fused target features)], with x as the residual).
    x [B, T, H] -> (x [B, T, H], what `attend_to` returned besides the parts).
    """
    with jax.named_scope("attention"):
        h = rms_norm(x, lp["attn_norm"], eps) if attn_input is None else attn_input
        q, k, v = project_qkv(lp, h)  # q [B, T, N, D]; k, v [B, T, Kv, D]
        if "q_norm" in lp:
            q = rms_norm(q, lp["q_norm"], eps)
            k = rms_norm(k, lp["k_norm"], eps)
        q = rope(q, positions, inv_freq)
        k, v = heads_major(rope(k, positions, inv_freq)), heads_major(v)  # [B, Kv, T, D]
        parts, aux = attend_to(k, v)
        x = x + attention_output(lp, attend(q, parts)).astype(x.dtype)
    with jax.named_scope("mlp"):
        x = x + mlp(lp, rms_norm(x, lp["mlp_norm"], eps)).astype(x.dtype)
    return x, aux


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final-normed hidden states [B, T, H] -> float32 logits [B, T, V]."""
    # Contract the tied embedding as stored ([V, H]): a transposed view would be copied every step.
    if cfg.tie_embeddings:
        return einsum("bth,vh->btv", x, params["embed"], preferred_element_type=jnp.float32)
    return einsum("bth,hv->btv", x, params["lm_head"], preferred_element_type=jnp.float32)


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
    b, _ = tokens.shape
    positions = positions.astype(jnp.int32)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    slots = jnp.broadcast_to(jnp.arange(cache.capacity, dtype=jnp.int32), (b, cache.capacity))
    masks = {}  # one mask per distinct window: [B, T, S]
    x = embed(params, tokens)
    captured: dict[int, jax.Array] = {}
    new_k, new_v = [], []
    for i, lp in enumerate(params["layers"]):
        window = cfg.layer_windows[i]
        if window not in masks:
            masks[window] = causal_window_mask(positions, slots, window)

        # Write this pass's keys/values first, then attend to the cache: the attention reads
        # the written buffer, so XLA updates it in place (no copy of the cache per layer).
        def write_then_read(k, v, i=i, mask=masks[window]):
            k_cache = write_kv(cache.k[i], k, positions)
            v_cache = write_kv(cache.v[i], v, positions)
            return [(k_cache, v_cache, mask)], (k_cache, v_cache)

        with jax.named_scope(f"layer_{i}"):
            x, (k_cache, v_cache) = decoder_layer(
                lp, x, positions, inv_freq, cfg.rms_norm_eps, write_then_read
            )
        new_k.append(k_cache)
        new_v.append(v_cache)
        if i in capture:
            captured[i] = x
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=positions[:, -1] + 1)
    if not capture:
        return x, None, new_cache
    # [B, T, n * H], layer order as requested.
    return x, jnp.concatenate([captured[i] for i in capture], axis=-1), new_cache
