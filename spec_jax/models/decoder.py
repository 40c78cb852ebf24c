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

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.models.attention import (  # noqa: F401  (the pieces are public from here too)
    NEG_INF,
    AttentionParts,
    attend,
    attend_cache_and_pass,
    einsum,
    float32_precision,
    window_mask,
)
from spec_jax.models.config import LinearRopeScaling, ModelConfig, RopeScaling
from spec_jax.models.interface import ForwardOutput, chain_mask
from spec_jax.models.weights import init_from_specs, model_weight_specs

Params = Any

@struct.dataclass
class KVCache:
    """Fixed-capacity KV cache, indexed by absolute position; one array per layer.

    k, v:     L-tuples of [B, Kv, S, D]  S = capacity; heads before positions ("heads-major"), so
                                         attention contracts each head's [S, D] block in place
    lengths:  [B] int32                  committed tokens per row

    A pass writes its keys/values at slots lengths .. lengths + T - 1 and attends to the committed
    slots (< lengths) plus its own keys; committed slot j holds position j. So rejected drafts are
    rolled back by setting `lengths` alone, never by clearing (`commit`).
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


@dataclasses.dataclass(frozen=True)
class LayerStyle:
    """The static per-family switches of `decoder_layer`'s math that its weights do not show
    (biases and sandwich norms do show: they are `lp` entries). The defaults are Llama's.

    norm_offset:      RMSNorms scale by (norm_offset + w) in float32 (Gemma: 1.0)
    activation:       "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_multiplier: queries times this before attention (Gemma's query_pre_attn_scalar ** -0.5
                      in place of head_dim ** -0.5); None = 1
    """

    norm_offset: float = 0.0
    activation: str = "silu"
    query_multiplier: float | None = None


LLAMA_STYLE = LayerStyle()


def layer_style(cfg: ModelConfig) -> LayerStyle:
    multiplier = None
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
        # attention divides scores by sqrt(head_dim); this turns that into 1/sqrt(scalar).
        multiplier = math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar)
    return LayerStyle(cfg.norm_offset, cfg.mlp_activation, multiplier)


# ----------------------------------------------------------------------------- pieces
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        # Gemma: (x * (offset + w)) in float32, then cast (HF Gemma3RMSNorm).
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | LinearRopeScaling | None
) -> jax.Array:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
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
    """x: [B, T, H] -> q [B, T, N, D], k/v [B, T, Kv, D] (before q/k norm and RoPE), plus the
    biases [N or Kv, D] when the layer has them (Qwen2)."""
    q = einsum("bth,hnd->btnd", x, lp["wq"])
    k = einsum("bth,hkd->btkd", x, lp["wk"])
    v = einsum("bth,hkd->btkd", x, lp["wv"])
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
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


def attention_output(lp: Params, attn: jax.Array) -> jax.Array:
    """attn [B, T, N, D] -> [B, T, H]. Flattened (N*D) so XLA does not transpose wo every step."""
    b, t, n, d = attn.shape
    return einsum("bti,ih->bth", attn.reshape(b, t, n * d), lp["wo"].reshape(n * d, -1))


def mlp(lp: Params, x: jax.Array, activation: str = "silu") -> jax.Array:
    """Gated MLP: down(act(gate(x)) * up(x)); act = SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    gate = einsum("bth,hf->btf", x, lp["w_gate"])
    up = einsum("bth,hf->btf", x, lp["w_up"])
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return einsum("btf,fh->bth", act * up, lp["w_down"])


# What one layer's queries attend to: given its queries [B, T, N, D] and new keys/values
# [B, Kv, T, D] (normed, rotated), return the attention output [B, T, N, D] and anything the caller
# wants back (e.g. updated caches).
AttendTo = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def decoder_layer(
    lp: Params,
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    eps: float,
    attend_to: AttendTo,
    attn_input: jax.Array | None = None,
    style: LayerStyle = LLAMA_STYLE,
) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer: RMSNorm -> GQA attention (q/k/v biases when the layer has
    `bq`/`bk`/`bv`, per-head q/k RMSNorm when it has `q_norm`/`k_norm`, RoPE at `positions`
    [B, T]) -> [post_attn_norm] -> residual -> RMSNorm -> gated MLP -> [post_mlp_norm] -> residual.
    The bracketed norms are Gemma's "sandwich", present when the layer has those weights; `style`
    holds the rest of a family's math (norm offset, MLP activation, query scale).

    The one layer of targets, draft models, DFlash and EAGLE-3; `attend_to` says what the queries
    see. `attn_input`, when given, is what q/k/v are projected from instead of norm(x) (EAGLE-3's
    first layer: [norm(embedding), norm(fused target features)], with x as the residual).
    x [B, T, H] -> (x [B, T, H], what `attend_to` returned besides the attention output).
    """
    offset = style.norm_offset
    with jax.named_scope("attention"):
        h = rms_norm(x, lp["attn_norm"], eps, offset) if attn_input is None else attn_input
        q, k, v = project_qkv(lp, h)  # q [B, T, N, D]; k, v [B, T, Kv, D]
        if "q_norm" in lp:
            q = rms_norm(q, lp["q_norm"], eps, offset)
            k = rms_norm(k, lp["k_norm"], eps, offset)
        q = rope(q, positions, inv_freq)
        if style.query_multiplier is not None:
            q = q * jnp.asarray(style.query_multiplier, q.dtype)
        k, v = heads_major(rope(k, positions, inv_freq)), heads_major(v)  # [B, Kv, T, D]
        attn, aux = attend_to(q, k, v)
        out = attention_output(lp, attn)
        if "post_attn_norm" in lp:
            out = rms_norm(out, lp["post_attn_norm"], eps, offset)
        x = x + out.astype(x.dtype)
    with jax.named_scope("mlp"):
        out = mlp(lp, rms_norm(x, lp["mlp_norm"], eps, offset), style.activation)
        if "post_mlp_norm" in lp:
            out = rms_norm(out, lp["post_mlp_norm"], eps, offset)
        x = x + out.astype(x.dtype)
    return x, aux


def layer_pass(
    lp: Params,
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    slots: jax.Array,
    pass_mask: jax.Array,
    *,
    eps: float,
    window: int,
    style: LayerStyle,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One target layer of `forward_hidden`: (x, this layer's written k cache, v cache)."""

    # Write this pass's keys/values first, then attend: the attention reads the written buffer
    # (its committed slots only), so XLA updates the cache in place (no copy per layer).
    def write_then_attend(q, k, v):
        k_written, v_written = write_kv(k_cache, k, slots), write_kv(v_cache, v, slots)
        out = attend_cache_and_pass(q, k_written, v_written, lengths, positions, window, k, v, pass_mask)
        return out, (k_written, v_written)

    x, (k_written, v_written) = decoder_layer(lp, x, positions, inv_freq, eps, write_then_attend, style=style)
    return x, k_written, v_written


# Layers of equal shapes and switches share one trace: JAX caches a jitted function's jaxpr by its
# arguments' shapes, so a 30-layer model traces one layer instead of 30 (a start's tracing, which
# the persistent compilation cache cannot skip, went 7.3 s -> 5.2 s for the default model's loop
# under load on the 2-core CPU, 2026-11-26).
# XLA inlines the call, so the compiled program (and the in-place cache write) is unchanged.
cached_layer_pass = jax.jit(layer_pass, static_argnames=("eps", "window", "style"))


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Rows of the embedding table, unscaled (the table lookup; `embed_tokens` is the model's)."""
    return jnp.take(params["embed"], tokens, axis=0)


def embed_tokens(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The decoder's input embeddings [B, T, H]: Gemma multiplies by sqrt(hidden_size) rounded to
    the model dtype (as HF does), so drafters that embed through the target get it too."""
    x = embed(params, tokens)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(x.dtype)
    return x


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final-normed hidden states [..., H] -> float32 logits [..., V] (soft-capped when the config
    says so)."""
    # Contract the tied embedding as stored ([V, H]): a transposed view would be copied every step.
    if cfg.tie_embeddings:
        logits = einsum("...h,vh->...v", x, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = einsum("...h,hv->...v", x, params["lm_head"], preferred_element_type=jnp.float32)
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


# ----------------------------------------------------------------------------- forward
def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    capture: Sequence[int] = (),
    mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """`forward_hidden`, then the LM head: (float32 logits [B, T, V], captured, cache)."""
    hidden, captured, cache = forward_hidden(params, cfg, tokens, positions, cache, capture, mask)
    return lm_head(params, cfg, hidden), captured, cache


def forward_hidden(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    capture: Sequence[int] = (),
    mask: jax.Array | None = None,
) -> ForwardOutput:
    """Run the decoder on `tokens` [B, T] at `positions` [B, T] (the pass contract of
    `spec_jax.models.interface`): the pass's keys/values go to each row's slots
    `cache.lengths .. + T - 1`; each query sees the committed slots and the pass tokens that
    `mask` [B or 1, T, T] allows (None: causal, a chain).

    Returns the final-normed hidden states [B, T, H]; the hidden states after each decoder layer
    in `capture` (HF `hidden_states[id + 1]`), concatenated as [B, T, len(capture) * H], or None;
    and the cache with this pass written and `lengths` unchanged (see `commit`).
    """
    capture = tuple(capture)
    for layer_id in capture:
        if not 0 <= layer_id < cfg.num_layers:
            raise ValueError(f"capture layer {layer_id} outside the model's {cfg.num_layers} layers")
    t = tokens.shape[1]
    positions = positions.astype(jnp.int32)
    style = layer_style(cfg)
    # One per distinct (base, scaling): Gemma 3's sliding and full layers differ.
    layer_ropes = [cfg.layer_rope(i) for i in range(cfg.num_layers)]
    inv_freqs = {r: rope_inv_freq(cfg.head_dim, *r) for r in dict.fromkeys(layer_ropes)}
    slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T] where the pass goes
    pass_mask = chain_mask(t) if mask is None else mask.astype(bool)
    pass_masks = {}  # one in-pass mask per distinct window: [B or 1, T, T]
    x = embed_tokens(params, cfg, tokens)
    captured: dict[int, jax.Array] = {}
    new_k, new_v = [], []
    for i, lp in enumerate(params["layers"]):
        window = cfg.layer_windows[i]
        if window not in pass_masks:
            pass_masks[window] = pass_mask & window_mask(positions, positions, window)

        with jax.named_scope(f"layer_{i}"):
            x, k_cache, v_cache = cached_layer_pass(
                lp, x, positions, inv_freqs[layer_ropes[i]], cache.k[i], cache.v[i], cache.lengths,
                slots, pass_masks[window], eps=cfg.rms_norm_eps, window=window, style=style,
            )
        new_k.append(k_cache)
        new_v.append(v_cache)
        if i in capture:
            captured[i] = x
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    new_cache = cache.replace(k=tuple(new_k), v=tuple(new_v))
    if not capture:
        return ForwardOutput(x, None, new_cache)
    # [B, T, n * H], layer order as requested.
    return ForwardOutput(x, jnp.concatenate([captured[i] for i in capture], axis=-1), new_cache)


def commit(cache: KVCache, lengths: jax.Array, path: jax.Array | None = None) -> KVCache:
    """Set the committed lengths [B]. With `path` [B, P] (in-pass indices of a tree's accepted
    nodes, root first), the keys/values of node path[b, i], written at slot old + path[b, i],
    move to slot old + i first (old = the lengths before the pass); entries past the new length
    are moved too but stay uncommitted."""
    if path is None:
        return cache.with_lengths(lengths)
    old = cache.lengths[:, None]
    source = old + path.astype(jnp.int32)  # [B, P]
    dest = old + jnp.arange(path.shape[1], dtype=jnp.int32)
    rows = jnp.arange(path.shape[0])[:, None]

    def move(layer_cache: jax.Array) -> jax.Array:
        capacity = layer_cache.shape[2]
        picked = layer_cache[rows, :, jnp.minimum(source, capacity - 1)]  # [B, P, Kv, D]
        return layer_cache.at[rows, :, dest].set(picked, mode="drop")

    return cache.replace(
        k=tuple(move(k) for k in cache.k), v=tuple(move(v) for v in cache.v)
    ).with_lengths(lengths)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """spec_jax's own decoder as a `TargetModel` (Llama, Mistral, Qwen2/3, Gemma 3 are configs
    of it)."""

    cfg: ModelConfig

    # The TargetModel attributes, read from the config.
    vocab_size = property(lambda self: self.cfg.vocab_size)
    hidden_size = property(lambda self: self.cfg.hidden_size)
    num_layers = property(lambda self: self.cfg.num_layers)
    max_positions = property(lambda self: self.cfg.max_position_embeddings)
    stop_ids = property(lambda self: self.cfg.eos_token_ids)

    @property
    def dtype(self) -> Any:
        return jnp.dtype(self.cfg.dtype)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        return init_cache(self.cfg, batch, capacity)

    def cache_lengths(self, cache: KVCache) -> jax.Array:
        return cache.lengths

    def forward(self, params, tokens, positions, cache, *, mask=None, capture=()) -> ForwardOutput:
        return forward_hidden(params, self.cfg, tokens, positions, cache, capture, mask)

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        return lm_head(params, self.cfg, hidden)

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        return embed_tokens(params, self.cfg, tokens)

    def commit(self, cache: KVCache, lengths: jax.Array, path: jax.Array | None = None) -> KVCache:
        return commit(cache, lengths, path)

    def weight_specs(self) -> Any:
        return model_weight_specs(self.cfg)
