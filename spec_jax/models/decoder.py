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
    writing_into_empty_cache,
)
from spec_jax.models.config import (
    FULL_ATTENTION,
    GLOBAL_WINDOW,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    LinearRopeScaling,
    ModelConfig,
    MoeConfig,
    ProportionalRope,
    RopeScaling,
    YarnRopeScaling,
)
from spec_jax.models.gated_deltanet import DeltaNetDims, commit_delta_net, delta_net
from spec_jax.models.interface import ForwardOutput, LayerKV, chain_mask
from spec_jax.models import paged
from spec_jax.models.moe import moe_block
from spec_jax.models.paged import PAGE_SIZE
from spec_jax.models.recurrent import last_committed_index
from spec_jax.models.weights import init_from_specs, model_weight_specs

Params = Any

@struct.dataclass
class KVCache:
    """Fixed-capacity KV cache, indexed by absolute position; one array per layer.

    k, v:     L-tuples of [B, Kv, S, D]  S = capacity; heads before positions ("heads-major"), so
                                         attention contracts each head's [S, D] block in place
                                         (one per attention layer with a cache of its own)
    lengths:  [B] int32                  committed tokens per row

    A pass writes its keys/values at slots lengths .. lengths + T - 1 and attends to the committed
    slots (< lengths) plus its own keys; committed slot j holds position j. So rejected drafts are
    rolled back by setting `lengths` alone, never by clearing (`commit`).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    # Gated DeltaNet layers (Qwen3.5 / Qwen3-Next; empty for attention-only models, so their
    # cache is the same arrays as before): per such layer the convolution's last inputs
    # [B, kernel - 1, C] and the float32 state [B, Hv, dk, dv]; `record`, set by a pass and
    # cleared by commit, is what commit rebuilds the states from (`spec_jax.models.gated_deltanet`).
    conv: tuple[jax.Array, ...] = ()
    recurrent: tuple[jax.Array, ...] = ()
    record: Any = None
    # Paged (the engine's `kv_pages`; `spec_jax.models.paged`): k, v are page pools
    # [P, Kv, page, D] shared by every row, and row b's slot s is in page page_table[b, s // page].
    # None: the dense layout above.
    page_table: jax.Array | None = None

    @property
    def capacity(self) -> int:
        if self.page_table is not None:
            return self.page_table.shape[1] * self.k[0].shape[2]
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
    """An empty cache: one array per layer with a cache of its own (`cfg.kv_cache_shapes`;
    Gemma 4's full-attention layers have their own KV heads and head size, its KV-shared
    layers none)."""
    dtype = dtype or cfg.dtype
    cache = KVCache(
        k=tuple(jnp.zeros((batch, kv, capacity, d), dtype) for kv, d in cfg.kv_cache_shapes),
        v=tuple(jnp.zeros((batch, kv, capacity, d), dtype) for kv, d in cfg.kv_cache_shapes),
        lengths=jnp.zeros((batch,), jnp.int32),
    )
    linear = sum(map(cfg.is_linear_attention, range(cfg.num_layers)))
    if not linear:
        return cache
    dims = delta_net_dims(cfg)
    conv = jnp.zeros((batch, dims.conv_kernel - 1, dims.conv_channels), dtype)
    state = jnp.zeros((batch, dims.value_heads, dims.key_dim, dims.value_dim), jnp.float32)
    return cache.replace(conv=(conv,) * linear, recurrent=(state,) * linear)


def init_paged_cache(cfg: ModelConfig, batch: int, capacity: int, num_pages: int,
                     page_size: int = PAGE_SIZE, dtype: Any = None) -> KVCache:
    """An empty paged cache (`spec_jax.models.paged`): per layer with a cache of its own, a pool
    of `num_pages` pages of `page_size` slots; `batch` rows of `capacity` slots (a multiple of
    page_size), every page unallocated. Recurrent states stay per row, as in `init_cache`."""
    if capacity % page_size:
        raise ValueError(f"a paged cache's capacity {capacity} must be a multiple of its page size {page_size}.")
    dtype = dtype or cfg.dtype
    dense = init_cache(cfg, batch, 0, dtype)  # the per-row states; the zero-width KV arrays are replaced
    return dense.replace(
        k=tuple(jnp.zeros((num_pages, kv, page_size, d), dtype) for kv, d in cfg.kv_cache_shapes),
        v=tuple(jnp.zeros((num_pages, kv, page_size, d), dtype) for kv, d in cfg.kv_cache_shapes),
        page_table=jnp.full((batch, capacity // page_size), num_pages, jnp.int32),
    )


def delta_net_dims(cfg: ModelConfig) -> DeltaNetDims:
    """The static sizes of `cfg`'s Gated DeltaNet layers."""
    return DeltaNetDims(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                        cfg.linear_value_head_dim, cfg.linear_conv_kernel, cfg.rms_norm_eps)


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
    moe:              the MoE block's settings (`MoeConfig`), for the layers whose weights
                      have a `router` (None: dense)
    value_norm:       values RMS-normed without a learned scale (Gemma 4)
    """

    norm_offset: float = 0.0
    activation: str = "silu"
    query_multiplier: float | None = None
    value_norm: bool = False
    output_gate: bool = False  # q_proj gives [query, gate] per head; output times sigmoid(gate)
    moe: MoeConfig | None = None


LLAMA_STYLE = LayerStyle()


def layer_style(cfg: ModelConfig, head_dim: int | None = None) -> LayerStyle:
    """The style of `cfg`'s layers whose head size is `head_dim` (default cfg.head_dim)."""
    head_dim = head_dim or cfg.head_dim
    multiplier = None
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != head_dim:
        # attention divides scores by sqrt(head_dim); this turns that into 1/sqrt(scalar).
        multiplier = math.sqrt(head_dim / cfg.query_pre_attn_scalar)
    if isinstance(cfg.rope_scaling, YarnRopeScaling) and cfg.rope_scaling.attention_factor != 1.0:
        # YaRN multiplies cos and sin, so queries and keys, by its attention factor: every score
        # by its square, which the queries alone carry here (the cached keys stay unscaled).
        multiplier = (multiplier or 1.0) * cfg.rope_scaling.attention_factor ** 2
    return LayerStyle(cfg.norm_offset, cfg.mlp_activation, multiplier, cfg.value_norm, cfg.attn_output_gate,
                      moe=cfg.moe)


# ----------------------------------------------------------------------------- pieces
def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis; `weight` None: no learned scale (Gemma 4's value norm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return x32.astype(x.dtype)
    if offset:
        # Gemma: (x * (offset + w)) in float32, then cast (HF Gemma3RMSNorm).
        return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | LinearRopeScaling | ProportionalRope | None
) -> jax.Array:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, ProportionalRope):
        # The first partial_rotary_factor of the pairs rotate as in the full head; the rest get
        # frequency 0 (cos 1, sin 0: left as they are).
        rotated = int(scaling.partial_rotary_factor * head_dim // 2)
        return jnp.where(jnp.arange(head_dim // 2) < rotated, inv_freq, 0.0) / scaling.factor
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnRopeScaling):
        return yarn_inv_freq(inv_freq, head_dim, theta, scaling)
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


def yarn_inv_freq(inv_freq: jax.Array, head_dim: int, theta: float, scaling: YarnRopeScaling) -> jax.Array:
    """YaRN frequencies (transformers' `_compute_yarn_parameters`): dimension pairs that turn
    more than `beta_fast` times over the original context keep their frequency, those turning
    fewer than `beta_slow` times are divided by `factor`, a linear ramp blends those between.
    (Its attention factor scales cos and sin: `layer_style` folds it into the queries.)"""

    def pair_of_rotations(rotations: float) -> float:  # the dimension that turns `rotations` times
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = pair_of_rotations(scaling.beta_fast), pair_of_rotations(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [B, T, N, D], positions: [B, T]. With fewer than D/2
    frequencies (partial RoPE, Qwen3.5 / Qwen3-Next) the first 2 * len(inv_freq) dims turn and
    the rest pass through."""
    rotated = 2 * inv_freq.shape[-1]
    if rotated < x.shape[-1]:
        return jnp.concatenate([rope(x[..., :rotated], positions, inv_freq), x[..., rotated:]], axis=-1)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def project_qkv(lp: Params, x: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """x: [B, T, H] -> q [B, T, N, D], k/v [B, T, Kv, D] (before q/k norm and RoPE), plus the
    biases [N or Kv, D] when the layer has them (Qwen2). A layer without `wv` takes its values
    from the key projection (Gemma 4's attention_k_eq_v); one without `wk` reads another layer's
    keys/values (Gemma 4's KV sharing): k and v are None then."""
    q = einsum("bth,hnd->btnd", x, lp["wq"])
    k = einsum("bth,hkd->btkd", x, lp["wk"]) if "wk" in lp else None
    v = einsum("bth,hkd->btkd", x, lp["wv"]) if "wv" in lp else k
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    return q, k, v


def heads_major(x: jax.Array) -> jax.Array:
    """Keys/values [B, T, Kv, D] -> the cache layout [B, Kv, T, D]."""
    return jnp.swapaxes(x, -3, -2)


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array, page_table: jax.Array | None = None) -> jax.Array:
    """Write new [B, Kv, T, D] into one layer's cache [B, Kv, S, D] at positions [B, T] (one
    scatter, in place; positions past the capacity are dropped). With `page_table`, the cache is
    a page pool written through it (`paged.write_slots`)."""
    if page_table is not None:
        return paged.write_slots(cache, new, page_table, positions)
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    # Indexing dims 0 and 2 (split by a slice) puts the indexed [B, T] first: [B, T, Kv, D].
    updates = jnp.swapaxes(new, 1, 2).astype(cache.dtype)
    return cache.at[rows, :, positions].set(updates, mode="drop")


def attention_output(lp: Params, attn: jax.Array) -> jax.Array:
    """attn [B, T, N, D] -> [B, T, H], plus the bias when the layer has one (`bo`, gpt-oss).
    Flattened (N*D) so XLA does not transpose wo every step."""
    b, t, n, d = attn.shape
    out = einsum("bti,ih->bth", attn.reshape(b, t, n * d), lp["wo"].reshape(n * d, -1))
    return out + lp["bo"] if "bo" in lp else out


def activate(x: jax.Array, activation: str) -> jax.Array:
    """SiLU, or tanh-approximated GELU ("gelu_tanh")."""
    return jax.nn.silu(x) if activation == "silu" else jax.nn.gelu(x, approximate=True)


def mlp(lp: Params, x: jax.Array, activation: str = "silu") -> jax.Array:
    """Gated MLP: down(act(gate(x)) * up(x)); act = SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    gate = einsum("bth,hf->btf", x, lp["w_gate"])
    up = einsum("bth,hf->btf", x, lp["w_up"])
    return einsum("btf,fh->bth", activate(gate, activation) * up, lp["w_down"])


def feed_forward(lp: Params, x: jax.Array, h: jax.Array, eps: float, style: "LayerStyle") -> jax.Array:
    """A layer's feed-forward output for the residual stream x [B, T, H] and its MLP norm h: the
    dense MLP, or (its weights have a router) the MoE block in its place, or with Gemma 4's
    `experts_norm` both side by side (`MoeConfig.beside_dense_mlp`)."""
    if "router" not in lp:
        return mlp(lp, h, style.activation)
    if "experts_norm" not in lp:
        return moe_block(lp, h, style.moe)
    # Gemma 4: the router and the experts read the residual stream, not h; each branch has its own
    # output norm (transformers' Gemma4TextDecoderLayer / Gemma4TextRouter).
    offset = style.norm_offset
    dense = rms_norm(mlp(lp, h, style.activation), lp["mlp_out_norm"], eps, offset)
    router_x = rms_norm(x, None, eps) * (lp["router_norm"] * x.shape[-1] ** -0.5).astype(x.dtype)
    routed = moe_block(lp, rms_norm(x, lp["experts_norm"], eps, offset), style.moe, router_x=router_x)
    return dense + rms_norm(routed, lp["experts_out_norm"], eps, offset)


def per_layer_branch(lp: Params, x: jax.Array, per_layer_input: jax.Array, eps: float, style: "LayerStyle") -> jax.Array:
    """Gemma 4's per-layer-embedding branch: norm(proj(act(gate(x)) * per_layer_input)),
    x [B, T, H], per_layer_input [B, T, P] -> [B, T, H] (added to the residual)."""
    gate = activate(einsum("bth,hp->btp", x, lp["per_layer_gate"]), style.activation)
    out = einsum("btp,ph->bth", gate * per_layer_input.astype(gate.dtype), lp["per_layer_proj"])
    return rms_norm(out, lp["per_layer_norm"], eps, style.norm_offset)


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
    per_layer_input: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer: RMSNorm -> GQA attention (q/k/v biases when the layer has
    `bq`/`bk`/`bv`, per-head q/k RMSNorm when it has `q_norm`/`k_norm`, RoPE at `positions`
    [B, T]) -> [post_attn_norm] -> residual -> RMSNorm -> gated MLP -> [post_mlp_norm] -> residual.
    The bracketed norms are Gemma's "sandwich", present when the layer has those weights; `style`
    holds the rest of a family's math (norm offset, MLP activation, query scale, value norm).
    Gemma 4 adds, when the layer has their weights: the per-layer-embedding branch fed by
    `per_layer_input` [B, T, P] and the output times `layer_scalar`; a layer without `wk` gets
    k = v = None and its `attend_to` supplies the keys/values it reads.

    The one layer of targets, draft models, DFlash and EAGLE-3; `attend_to` says what the queries
    see. `attn_input`, when given, is what q/k/v are projected from instead of norm(x) (EAGLE-3's
    first layer: [norm(embedding), norm(fused target features)], with x as the residual).
    x [B, T, H] -> (x [B, T, H], what `attend_to` returned besides the attention output).
    """
    offset = style.norm_offset
    with jax.named_scope("attention"):
        h = rms_norm(x, lp["attn_norm"], eps, offset) if attn_input is None else attn_input
        q, k, v = project_qkv(lp, h)  # q [B, T, N, D]; k, v [B, T, Kv, D]
        if style.output_gate:  # Qwen3.5 / Qwen3-Next: [query, gate] per head
            q, gate = jnp.split(q, 2, axis=-1)
        if "q_norm" in lp:
            q = rms_norm(q, lp["q_norm"], eps, offset)
        if "k_norm" in lp:
            k = rms_norm(k, lp["k_norm"], eps, offset)
        if style.value_norm and v is not None:
            v = rms_norm(v, None, eps)
        q = rope(q, positions, inv_freq)
        if style.query_multiplier is not None:
            q = q * jnp.asarray(style.query_multiplier, q.dtype)
        if k is not None:
            k, v = heads_major(rope(k, positions, inv_freq)), heads_major(v)  # [B, Kv, T, D]
        attn, aux = attend_to(q, k, v)
        if style.output_gate:
            attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
        out = attention_output(lp, attn)
        if "post_attn_norm" in lp:
            out = rms_norm(out, lp["post_attn_norm"], eps, offset)
        x = x + out.astype(x.dtype)
    with jax.named_scope("mlp"):
        h = rms_norm(x, lp["mlp_norm"], eps, offset)
        out = feed_forward(lp, x, h, eps, style)
        if "post_mlp_norm" in lp:
            out = rms_norm(out, lp["post_mlp_norm"], eps, offset)
        x = x + out.astype(x.dtype)
    if "per_layer_gate" in lp:
        with jax.named_scope("per_layer_input"):
            x = x + per_layer_branch(lp, x, per_layer_input, eps, style).astype(x.dtype)
    if "layer_scalar" in lp:
        x = x * lp["layer_scalar"].astype(x.dtype)
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
    per_layer_input: jax.Array | None = None,
    page_table: jax.Array | None = None,
    *,
    eps: float,
    window: int,
    style: LayerStyle,
    keep_pass_kv: bool = False,
    cache_empty: bool = False,
    chain: bool = False,
) -> tuple[jax.Array, ...]:
    """One target layer of `forward_hidden`: (x, this layer's written k cache, v cache), and with
    `keep_pass_kv` the pass's own keys/values [B, Kv, T, D] too (for the layers that share them).
    cache_empty: the cache holds nothing yet; chain: the pass is causal (no tree mask). The
    attention may read the pass's keys from the cache it writes them to (`attend_cache_and_pass`)."""

    # Write this pass's keys/values first, then attend: the attention reads the written buffer
    # (its committed slots, and on the accelerators' buckets path the pass's own slots too), so
    # XLA updates the cache in place (no copy per layer).
    def write_then_attend(q, k, v):
        k_written, v_written = write_kv(k_cache, k, slots, page_table), write_kv(v_cache, v, slots, page_table)
        out = attend_cache_and_pass(q, k_written, v_written, lengths, positions, window, k, v, pass_mask,
                                    sinks=lp.get("sinks"), page_table=page_table, cache_empty=cache_empty,
                                    pass_in_cache=True, causal_pass=chain)
        return out, (k_written, v_written, k, v)

    x, (k_written, v_written, k, v) = decoder_layer(
        lp, x, positions, inv_freq, eps, write_then_attend, style=style, per_layer_input=per_layer_input
    )
    return (x, k_written, v_written, k, v) if keep_pass_kv else (x, k_written, v_written)


def shared_kv_layer_pass(
    lp: Params,
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    shared_kv: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    lengths: jax.Array,
    pass_mask: jax.Array,
    per_layer_input: jax.Array | None = None,
    page_table: jax.Array | None = None,
    *,
    eps: float,
    window: int,
    style: LayerStyle,
    cache_empty: bool = False,
    chain: bool = False,
) -> jax.Array:
    """A Gemma 4 KV-shared layer: its queries attend to another layer's written cache and pass
    keys/values `shared_kv` = (k cache, v cache, k pass, v pass); it writes nothing. -> x."""

    def attend_shared(q, _k, _v):
        k_cache, v_cache, k_pass, v_pass = shared_kv
        return attend_cache_and_pass(q, k_cache, v_cache, lengths, positions, window, k_pass, v_pass, pass_mask,
                                     page_table=page_table, cache_empty=cache_empty, pass_in_cache=True,
                                     causal_pass=chain), None

    x, _ = decoder_layer(lp, x, positions, inv_freq, eps, attend_shared, style=style, per_layer_input=per_layer_input)
    return x


# Layers of equal shapes and switches share one trace: JAX caches a jitted function's jaxpr by its
# arguments' shapes, so a 30-layer model traces one layer instead of 30 (a start's tracing, which
# the persistent compilation cache cannot skip, went 7.3 s -> 5.2 s for the default model's loop
# under load on the 2-core CPU, 2026-11-26).
# XLA inlines the call, so the compiled program (and the in-place cache write) is unchanged.
cached_layer_pass = jax.jit(layer_pass, static_argnames=("eps", "window", "style", "keep_pass_kv", "cache_empty",
                                                        "chain"))


def delta_net_layer_pass(lp: Params, x: jax.Array, conv_state: jax.Array, state: jax.Array,
                         mask: jax.Array | None, *, eps: float, style: LayerStyle,
                         dims: DeltaNetDims) -> tuple[jax.Array, dict]:
    """One Gated DeltaNet layer (Qwen3.5 / Qwen3-Next "linear_attention"): RMSNorm -> the
    recurrent token mixer -> residual -> RMSNorm -> MLP -> residual. mask: None for a chain, the
    in-pass ancestor mask for a tree. -> (x, the layer's pass record for `commit`)."""
    with jax.named_scope("linear_attention"):
        out, record = delta_net(lp, rms_norm(x, lp["attn_norm"], eps, style.norm_offset), conv_state,
                                state, mask, dims)
        x = x + out.astype(x.dtype)
    with jax.named_scope("mlp"):
        h = rms_norm(x, lp["mlp_norm"], eps, style.norm_offset)
        out = moe_block(lp, h, style.moe) if "router" in lp else mlp(lp, h, style.activation)
        x = x + out.astype(x.dtype)
    return x, record


cached_delta_net_layer_pass = jax.jit(delta_net_layer_pass, static_argnames=("eps", "style", "dims"))
cached_shared_kv_layer_pass = jax.jit(shared_kv_layer_pass, static_argnames=("eps", "window", "style",
                                                                           "cache_empty", "chain"))


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


def per_layer_inputs(params: Params, cfg: ModelConfig, tokens: jax.Array, x: jax.Array) -> jax.Array:
    """Gemma 4's per-layer inputs [B, T, L, P] from tokens [B, T] and their (scaled) input
    embeddings x [B, T, H], as HF mixes them: (the tokens' rows of the per-layer table times
    sqrt(P) + RMSNorm(x @ projection / sqrt(H))) / sqrt(2)."""
    b, t = tokens.shape
    shape = (b, t, cfg.num_layers, cfg.per_layer_input_size)
    rows = jnp.take(params["per_layer_embed"], tokens, axis=0)
    rows = rows * jnp.asarray(math.sqrt(cfg.per_layer_input_size), jnp.float32).astype(rows.dtype)
    projected = einsum("bth,hp->btp", x, params["per_layer_model_proj"]) * (cfg.hidden_size ** -0.5)
    projected = rms_norm(projected.reshape(shape), params["per_layer_proj_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return (projected + rows.reshape(shape)) * (2.0 ** -0.5)


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final-normed hidden states [..., H] -> float32 logits [..., V] (soft-capped when the config
    says so)."""
    # Contract the tied embedding as stored ([V, H]): a transposed view would be copied every step.
    # (On CPU `load_target` unties the head instead: XLA:CPU's [V, H] product is slow for 2-7 rows.)
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


def checked_capture(cfg: ModelConfig, capture: Sequence[int]) -> tuple[int, ...]:
    """The capture ids as a tuple; a ValueError for one outside the model's layers."""
    capture = tuple(capture)
    for layer_id in capture:
        if not 0 <= layer_id < cfg.num_layers:
            raise ValueError(f"capture layer {layer_id} outside the model's {cfg.num_layers} layers")
    return capture


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
    capture = checked_capture(cfg, capture)
    t = tokens.shape[1]
    positions = positions.astype(jnp.int32)
    head_dims = [cfg.layer_head_dim(i) for i in range(cfg.num_layers)]
    styles = {d: layer_style(cfg, d) for d in dict.fromkeys(head_dims)}
    # One per distinct (rotated dims, base, scaling): Gemma 3's sliding and full layers differ.
    layer_ropes = [(int(head_dims[i] * cfg.partial_rotary_factor), *cfg.layer_rope(i)) for i in range(cfg.num_layers)]
    inv_freqs = {r: rope_inv_freq(*r) for r in dict.fromkeys(layer_ropes)}
    slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T] where the pass goes
    pass_mask = chain_mask(t) if mask is None else mask.astype(bool)
    pass_masks = {}  # one in-pass mask per distinct window: [B or 1, T, T]
    x = embed_tokens(params, cfg, tokens)
    per_layer = per_layer_inputs(params, cfg, tokens, x) if cfg.per_layer_input_size else None
    kv_sources = [cfg.kv_source(i) for i in range(cfg.num_layers)]
    shared_kv = {}  # Gemma 4: layer -> (k cache, v cache, k pass, v pass) that later layers read
    captured: dict[int, jax.Array] = {}
    new_k, new_v = [], []
    # Attention layer i's index into cache.k / cache.v (Gated DeltaNet layers keep none).
    kv_slot = {i: i - sum(map(cfg.is_linear_attention, range(i))) for i in range(cfg.num_layers)}
    records: list[dict] = []  # the Gated DeltaNet layers' pass records
    pass_kind = dict(cache_empty=writing_into_empty_cache(), chain=mask is None)  # the layers' static flags
    for i, lp in enumerate(params["layers"]):
        window = cfg.layer_windows[i]
        if window not in pass_masks:
            pass_masks[window] = pass_mask & window_mask(positions, positions, window)
        extra = {} if per_layer is None else {"per_layer_input": per_layer[:, :, i]}
        if cache.page_table is not None:
            extra["page_table"] = cache.page_table
        static = dict(eps=cfg.rms_norm_eps, window=window, style=styles[head_dims[i]], **pass_kind)
        inv_freq = inv_freqs[layer_ropes[i]]
        with jax.named_scope(f"layer_{i}"):
            if cfg.is_linear_attention(i):  # Gated DeltaNet: a recurrent state, no keys/values
                x, record = cached_delta_net_layer_pass(lp, x, cache.conv[len(records)], cache.recurrent[len(records)],
                                                        mask, eps=cfg.rms_norm_eps, style=static["style"], dims=delta_net_dims(cfg))
                records.append(record)
            elif kv_sources[i] != i:
                x = cached_shared_kv_layer_pass(
                    lp, x, positions, inv_freq, shared_kv[kv_sources[i]], cache.lengths,
                    pass_masks[window], **extra, **static,
                )
            elif i in kv_sources[i + 1:]:
                x, k_cache, v_cache, k_pass, v_pass = cached_layer_pass(
                    lp, x, positions, inv_freq, cache.k[kv_slot[i]], cache.v[kv_slot[i]], cache.lengths, slots,
                    pass_masks[window], **extra, **static, keep_pass_kv=True,
                )
                shared_kv[i] = (k_cache, v_cache, k_pass, v_pass)
            else:
                x, k_cache, v_cache = cached_layer_pass(
                    lp, x, positions, inv_freq, cache.k[kv_slot[i]], cache.v[kv_slot[i]], cache.lengths, slots,
                    pass_masks[window], **extra, **static,
                )
        if kv_sources[i] == i and not cfg.is_linear_attention(i):
            new_k.append(k_cache)
            new_v.append(v_cache)
        if i in capture:
            captured[i] = x
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    new_cache = cache.replace(k=tuple(new_k), v=tuple(new_v), record=tuple(records) or None)
    if not capture:
        return ForwardOutput(x, None, new_cache)
    # [B, T, n * H], layer order as requested.
    return ForwardOutput(x, jnp.concatenate([captured[i] for i in capture], axis=-1), new_cache)


def commit(cache: KVCache, lengths: jax.Array, path: jax.Array | None = None) -> KVCache:
    """Set the committed lengths [B]. With `path` [B, P] (in-pass indices of a tree's accepted
    nodes, root first), the keys/values of node path[b, i], written at slot old + path[b, i],
    move to slot old + i first (old = the lengths before the pass); entries past the new length
    are moved too but stay uncommitted. Gated DeltaNet layers take the states after each row's
    last committed token from the pass record (`spec_jax.models.recurrent`)."""
    if cache.record is not None:
        last = last_committed_index(cache.lengths, lengths, path)
        conv, recurrent = zip(*(commit_delta_net(c, s, r, last)
                                for c, s, r in zip(cache.conv, cache.recurrent, cache.record)))
        cache = cache.replace(conv=conv, recurrent=recurrent, record=None)
    if path is None:
        return cache.with_lengths(lengths)
    old = cache.lengths[:, None]
    source = old + path.astype(jnp.int32)  # [B, P]
    dest = old + jnp.arange(path.shape[1], dtype=jnp.int32)
    rows = jnp.arange(path.shape[0])[:, None]

    def move(layer_cache: jax.Array) -> jax.Array:
        if cache.page_table is not None:  # within the row's own pages
            return paged.move_slots(layer_cache, cache.page_table, source, dest)
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

    def init_paged_cache(self, batch: int, capacity: int, num_pages: int, page_size: int = PAGE_SIZE) -> KVCache:
        """A paged cache (the engine's `kv_pages`; `init_paged_cache`)."""
        return init_paged_cache(self.cfg, batch, capacity, num_pages, page_size)

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

    # Reading the cache (`spec_jax.models.interface.CacheReader`): each layer's own arrays.
    @property
    def layer_types(self) -> tuple[str, ...]:
        # The window tells full from sliding (Mistral slides on every layer without layer_types).
        types = self.cfg.layer_types or (FULL_ATTENTION,) * self.cfg.num_layers
        return tuple(t if t == LINEAR_ATTENTION else FULL_ATTENTION if w == GLOBAL_WINDOW else SLIDING_ATTENTION
                     for t, w in zip(types, self.cfg.layer_windows))

    def cache_view(self, cache: KVCache, layer: int) -> LayerKV:
        if self.cfg.is_linear_attention(layer):
            raise ValueError(f"layer {layer} is a linear-attention layer: it keeps no keys/values to view.")
        source = self.cfg.kv_source(layer)  # a KV-shared layer (Gemma 4) reads an earlier one's
        slot = source - sum(map(self.cfg.is_linear_attention, range(source)))  # Gated DeltaNet layers have none
        return LayerKV(cache.k[slot], cache.v[slot], cache.lengths, self.cfg.layer_windows[layer], cache.page_table)

    def weight_specs(self) -> Any:
        return model_weight_specs(self.cfg)
