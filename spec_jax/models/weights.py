"""One description per weight: shape, logical axes and initializer.

Random init, sharding (see `spec_jax.sharding`) and checkpoint shape checks are all derived from the
tree returned by `model_weight_specs` / `layer_weight_specs`, so target models, draft models and the
DFlash drafter (which reuses the decoder layers) never describe a weight twice.

Decoder layers are a list with one dict of arrays per layer, not arrays stacked on a layer axis:
on XLA:GPU any slice of a stacked weight that feeds a matmul (dynamic inside `lax.scan`, or static)
is materialised as a copy, so a decode step over stacked weights moves every weight several times
(benchmarks/RESULTS.md). The forward passes unroll the
layer loop at trace time over these arrays.

Logical axis names:
  embed    model width (hidden size)       vocab     vocabulary
  q_heads  query heads                     mlp       MLP width
  head_dim per-head width                  kv_heads  key/value heads
  expert   experts of a MoE layer (spec_jax.models.moe)
  None     never sharded
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" (scaled by fan-in), "ones", "zeros"

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def is_spec(x: Any) -> bool:
    return isinstance(x, WeightSpec)


def layer_weight_specs(
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    qk_norm: bool,
    qkv_bias: bool = False,
    sandwich_norms: bool = False,
    norm_init: str = "ones",
) -> dict[str, WeightSpec]:
    """One decoder layer's weights; shared by targets, draft models and DFlash.

    qkv_bias: q/k/v projection biases (Qwen2). sandwich_norms: `post_attn_norm` on the attention
    output and `post_mlp_norm` on the MLP output (Gemma). norm_init: "zeros" for norms that scale
    by (1 + w) (Gemma), so a random model's norms are the identity as Llama's "ones" are.
    """
    H, N, K, D, F = hidden, num_heads, num_kv_heads, head_dim, intermediate
    specs = {
        "attn_norm": WeightSpec((H,), (None,), norm_init),
        "wq": WeightSpec((H, N, D), ("embed", "q_heads", "head_dim")),
        "wk": WeightSpec((H, K, D), ("embed", "kv_heads", "head_dim")),
        "wv": WeightSpec((H, K, D), ("embed", "kv_heads", "head_dim")),
        "wo": WeightSpec((N, D, H), ("q_heads", "head_dim", "embed")),
        "mlp_norm": WeightSpec((H,), (None,), norm_init),
        "w_gate": WeightSpec((H, F), ("embed", "mlp")),
        "w_up": WeightSpec((H, F), ("embed", "mlp")),
        "w_down": WeightSpec((F, H), ("mlp", "embed")),
    }
    if qk_norm:
        specs["q_norm"] = WeightSpec((D,), (None,), norm_init)
        specs["k_norm"] = WeightSpec((D,), (None,), norm_init)
    if qkv_bias:
        # Sharded like the heads of the projection they are added to.
        specs["bq"] = WeightSpec((N, D), ("q_heads", "head_dim"), "zeros")
        specs["bk"] = WeightSpec((K, D), ("kv_heads", "head_dim"), "zeros")
        specs["bv"] = WeightSpec((K, D), ("kv_heads", "head_dim"), "zeros")
    if sandwich_norms:
        specs["post_attn_norm"] = WeightSpec((H,), (None,), norm_init)
        specs["post_mlp_norm"] = WeightSpec((H,), (None,), norm_init)
    return specs


def per_layer_specs(num_layers: int, **layer_kwargs: Any) -> list[dict[str, WeightSpec]]:
    """`num_layers` layers' weight specs: a list with one dict per layer (see the module doc)."""
    return [layer_weight_specs(**layer_kwargs) for _ in range(num_layers)]


def decoder_layer_specs(cfg: ModelConfig, layer: int) -> dict[str, WeightSpec]:
    """Decoder layer `layer`'s weights. The same for every layer except in Gemma 4, whose
    full-attention layers have their own head size / KV heads (and no `wv` with
    attention_k_eq_v), whose KV-shared layers have no `wk`/`wv`/`k_norm` (and a double-wide MLP
    with double_wide_mlp), plus the per-layer-embedding branch and the layer scalar."""
    norm_init = "zeros" if cfg.norm_offset == 1.0 else "ones"
    if cfg.is_linear_attention(layer):
        return delta_net_layer_specs(cfg, norm_init)
    specs = layer_weight_specs(
        hidden=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.layer_kv_heads(layer),
        head_dim=cfg.layer_head_dim(layer),
        intermediate=cfg.layer_intermediate_size(layer),
        qk_norm=cfg.qk_norm,
        qkv_bias=cfg.qkv_bias,
        sandwich_norms=cfg.sandwich_norms,
        norm_init=norm_init,
    )
    if cfg.kv_source(layer) != layer:
        for name in ("wk", "wv", "k_norm", "bk", "bv"):
            specs.pop(name, None)
    elif cfg.attention_k_eq_v and cfg.is_full_attention(layer):
        specs.pop("wv")
    if cfg.o_bias:  # gpt-oss
        specs["bo"] = WeightSpec((cfg.hidden_size,), (None,), "zeros")
    if cfg.attention_sinks:  # gpt-oss: one sink logit per query head
        specs["sinks"] = WeightSpec((cfg.num_heads,), ("q_heads",), "zeros")
    if cfg.attn_output_gate:  # Qwen3.5 / Qwen3-Next: q_proj holds [query, gate] per head
        H, N, D = cfg.hidden_size, cfg.num_heads, cfg.layer_head_dim(layer)
        specs["wq"] = WeightSpec((H, N, 2 * D), ("embed", "q_heads", "head_dim"))
    if cfg.per_layer_input_size:
        P = cfg.per_layer_input_size
        specs["per_layer_gate"] = WeightSpec((cfg.hidden_size, P), ("embed", None))
        specs["per_layer_proj"] = WeightSpec((P, cfg.hidden_size), (None, "embed"))
        specs["per_layer_norm"] = WeightSpec((cfg.hidden_size,), (None,), norm_init)
    if cfg.layer_scalar:
        specs["layer_scalar"] = WeightSpec((1,), (None,), "ones")
    return specs


def delta_net_layer_specs(cfg: ModelConfig, norm_init: str) -> dict[str, WeightSpec]:
    """A Gated DeltaNet ("linear_attention") layer: its mixer (`spec_jax.models.gated_deltanet`)
    in Qwen3.5's layout (Qwen3-Next's grouped `linear_qkvz` / `linear_ba` when architecture is
    qwen3_next), the two norms and the MLP. The conv weight keeps HF's [C, 1, kernel]."""
    H, F = cfg.hidden_size, cfg.intermediate_size
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    channels = 2 * hk * dk + hv * dv
    specs = {
        "attn_norm": WeightSpec((H,), (None,), norm_init),
        "conv": WeightSpec((channels, 1, cfg.linear_conv_kernel), (None, None, None)),
        "dt_bias": WeightSpec((hv,), (None,), "ones"),
        "A_log": WeightSpec((hv,), (None,), "zeros"),
        "linear_norm": WeightSpec((dv,), (None,), "ones"),
        "linear_out": WeightSpec((hv * dv, H), (None, "embed")),
        "mlp_norm": WeightSpec((H,), (None,), norm_init),
        "w_gate": WeightSpec((H, F), ("embed", "mlp")),
        "w_up": WeightSpec((H, F), ("embed", "mlp")),
        "w_down": WeightSpec((F, H), ("mlp", "embed")),
    }
    if cfg.architecture == "qwen3_next":
        r = hv // hk
        specs["linear_qkvz"] = WeightSpec((H, hk, 2 * dk + 2 * r * dv), ("embed", None, None))
        specs["linear_ba"] = WeightSpec((H, hk, 2 * r), ("embed", None, None))
    else:
        specs["linear_qkv"] = WeightSpec((H, channels), ("embed", None))
        specs["linear_z"] = WeightSpec((H, hv * dv), ("embed", None))
        specs["linear_b"] = WeightSpec((H, hv), ("embed", None))
        specs["linear_a"] = WeightSpec((H, hv), ("embed", None))
    return specs


def moe_layer_specs(cfg: ModelConfig, layer: int, specs: dict[str, WeightSpec]) -> dict[str, WeightSpec]:
    """Layer `layer`'s weights with the MoE block (`spec_jax.models.moe`) in place of the dense
    MLP (beside it with `beside_dense_mlp`, Gemma 4), unless it is one of `cfg.moe.dense_layers`.
    Experts are stacked on a leading `expert` axis; the router is replicated."""
    moe = cfg.moe
    if not moe.is_moe_layer(layer):
        return specs
    H, E, F = cfg.hidden_size, moe.num_experts, moe.expert_intermediate_size
    if not moe.beside_dense_mlp:
        specs = {name: spec for name, spec in specs.items() if name not in ("w_gate", "w_up", "w_down")}
    specs["router"] = WeightSpec((H, E), ("embed", None))
    specs["experts_w_gate"] = WeightSpec((E, H, F), ("expert", "embed", "mlp"))
    specs["experts_w_up"] = WeightSpec((E, H, F), ("expert", "embed", "mlp"))
    specs["experts_w_down"] = WeightSpec((E, F, H), ("expert", "mlp", "embed"))
    if moe.router_bias:
        specs["router_bias"] = WeightSpec((E,), (None,), "zeros")
    if moe.router_input_norm:
        specs["router_norm"] = WeightSpec((H,), (None,), "ones")
        specs["router_expert_scale"] = WeightSpec((E,), (None,), "ones")
    if moe.beside_dense_mlp:  # the dense MLP's output norm, the experts' input and output norms
        norm_init = "zeros" if cfg.norm_offset == 1.0 else "ones"
        for name in ("mlp_out_norm", "experts_norm", "experts_out_norm"):
            specs[name] = WeightSpec((H,), (None,), norm_init)
    if moe.expert_bias:
        specs["experts_b_gate"] = WeightSpec((E, F), ("expert", "mlp"), "zeros")
        specs["experts_b_up"] = WeightSpec((E, F), ("expert", "mlp"), "zeros")
        specs["experts_b_down"] = WeightSpec((E, H), ("expert", "embed"), "zeros")
    if moe.shared_expert_intermediate_size:
        S = moe.shared_expert_intermediate_size
        specs["shared_w_gate"] = WeightSpec((H, S), ("embed", "mlp"))
        specs["shared_w_up"] = WeightSpec((H, S), ("embed", "mlp"))
        specs["shared_w_down"] = WeightSpec((S, H), ("mlp", "embed"))
        if moe.shared_expert_gate:
            specs["shared_gate"] = WeightSpec((H, 1), ("embed", None))
    return specs


def model_weight_specs(cfg: ModelConfig) -> dict[str, Any]:
    norm_init = "zeros" if cfg.norm_offset == 1.0 else "ones"
    specs: dict[str, Any] = {
        "embed": WeightSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
        "layers": [decoder_layer_specs(cfg, i) for i in range(cfg.num_layers)],
        "final_norm": WeightSpec((cfg.hidden_size,), (None,), norm_init),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = WeightSpec((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    if cfg.per_layer_input_size:  # Gemma 4's per-layer embeddings, all layers' slices side by side
        width = cfg.num_layers * cfg.per_layer_input_size
        specs["per_layer_embed"] = WeightSpec((cfg.per_layer_vocab_size or cfg.vocab_size, width), ("vocab", None))
        specs["per_layer_model_proj"] = WeightSpec((cfg.hidden_size, width), ("embed", None))
        specs["per_layer_proj_norm"] = WeightSpec((cfg.per_layer_input_size,), (None,), norm_init)
    if cfg.moe is not None:  # experts in place of the dense MLP on the MoE layers
        specs["layers"] = [moe_layer_specs(cfg, i, layer) for i, layer in enumerate(specs["layers"])]
    return specs


def untie_embeddings(cfg: Any, params: Any) -> tuple[Any, Any]:
    """A tied model as an untied one: its LM head becomes its own [H, V] copy of the embedding.

    The logits are the same products; the weights grow by V x H. XLA:CPU multiplies 2-7 rows by
    the embedding as stored ([V, H], contracted on its minor axis) about 20x slower than by an
    [H, V] matrix (42 ms against 3.3 ms for SmolLM2's head at 2 rows), which made the narrow verify
    passes of speculation cost 3.5x a plain step (benchmarks/RESULTS.md, issue 41 part 5), so
    `load_target` does this on CPU. An untied config is returned unchanged.
    """
    if not cfg.tie_embeddings:
        return cfg, params
    head = jnp.transpose(params["embed"])  # an eager transpose: a new [H, V] buffer
    return cfg.replace(tie_embeddings=False), {**params, "lm_head": head}


def _fan_in(spec: WeightSpec) -> int:
    if spec.axes[:1] == ("expert",):  # one [in, out] matrix (or bias) per expert
        return spec.shape[1]
    # Contracted dims: for our layouts the input is the first axis, except wo whose input is
    # (q_heads, head_dim).
    if spec.axes[-1] == "embed" and len(spec.shape) == 3:  # wo [N, D, H]
        return spec.shape[0] * spec.shape[1]
    return spec.shape[0]


def init_from_specs(specs: Any, key: jax.Array, dtype: Any = jnp.float32, scale: float = 1.0) -> Any:
    """Random params for a spec tree (normal(0, scale/sqrt(fan_in)), norms at one)."""
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        if spec.init == "ones":
            out.append(jnp.ones(spec.shape, dtype))
        elif spec.init == "zeros":
            out.append(jnp.zeros(spec.shape, dtype))
        else:
            out.append(_normal(k, spec.shape, float(scale / np.sqrt(_fan_in(spec))), jnp.dtype(dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    # One small program per distinct (shape, dtype), reused by every layer: called eagerly,
    # an 8B model's init compiles a handful of these instead of one program holding all its
    # layers (37 s on this CPU, over 100 s on an H100 before its first step; issue 46).
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def abstract_from_specs(specs: Any, dtype: Any = jnp.float32) -> Any:
    """ShapeDtypeStruct tree (allocates nothing) for eval_shape and restore targets."""
    return jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec
    )


def check_params_match_specs(params: Any, specs: Any, what: str = "checkpoint") -> None:
    """Raise a clear error naming every missing, unexpected or mis-shaped weight."""
    flat_specs = {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    }
    flat_params = {
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    missing = sorted(set(flat_specs) - set(flat_params))
    unexpected = sorted(set(flat_params) - set(flat_specs))
    wrong = [
        f"{name}: expected {flat_specs[name].shape}, got {tuple(np.shape(flat_params[name]))}"
        for name in sorted(set(flat_specs) & set(flat_params))
        if tuple(np.shape(flat_params[name])) != flat_specs[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing weights {missing}")
    if unexpected:
        problems.append(f"unexpected weights {unexpected}")
    if wrong:
        problems.append("shape mismatch (config and weights disagree): " + "; ".join(wrong))
    if problems:
        raise ValueError(f"{what} does not match its config: " + ". ".join(problems))


def count_params(specs: Any) -> int:
    return int(
        sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(specs, is_leaf=is_spec))
    )


