"""The mixture-of-experts feed-forward block: a static switch of the one decoder.

A layer whose params hold a `router` runs `moe_block` at the MLP site (`decoder_layer`); its
static settings are the model's `MoeConfig` (`spec_jax.models.config`), carried to the layer in
`LayerStyle.moe`. The weights (`spec_jax.models.weights.moe_layer_specs`):

  router          [H, E]      (+ router_bias [E])       replicated on every device
  experts_w_gate  [E, H, F]   experts_w_up [E, H, F]    experts over the `expert` logical axis
  experts_w_down  [E, F, H]   (+ experts_b_gate / _b_up [E, F], experts_b_down [E, H])
  shared_w_gate / shared_w_up [H, Fs], shared_w_down [Fs, H] (+ shared_gate [H, 1]): a dense
                  expert every token runs, scaled by sigmoid(x @ shared_gate) (Qwen2-MoE)
  router_norm [H], router_expert_scale [E]: Gemma 4's router input scale and per-expert weight
                  scale (`MoeConfig.router_input_norm`; the norm itself is `decoder.feed_forward`'s)

Routing is per token: softmax over the router's logits, the top k, renormalised to sum 1 or not
(`MoeConfig.normalize_top_k`); or gpt-oss's order, the top k logits then a softmax over them.
There is no capacity factor and nothing is dropped, so a token's output never depends on what
else is in the pass: a verify pass of K + 1 tokens gives each token what a one-token decode step
would (the property speculative exactness rests on; tests/test_moe.py checks it).

Which experts' weights a pass reads is the cost that matters for decoding: a step reads only the
routed experts' weights, so one token reads k of E experts per layer and a verify pass of T
tokens the union of their choices (`expected_distinct_experts`). The expert computation has
three forms with equal results, picked statically per backend and per pass size
(`expert_path`):

  "loop"    a `lax.map` over the pass's (token, expert) pairs, each reading its expert's slices
            in place (dynamic slices of the stacked weights: no copy on XLA:CPU). Reads only
            the routed experts. The CPU path at every size: on this 2-core CPU it beat the other
            forms from 1 to 256 tokens (benchmarks/RESULTS.md, "Issue 43").
  "gather"  the routed experts' weights gathered per pair ([P, H, F]) and one batched matmul:
            reads only the routed experts (plus a copy of them), in a few kernels. Accelerators,
            while the pass has fewer pairs than experts (decode and verify).
  "dense"   every expert on every token, weighted by the router (zero off the top k): reads
            each expert once whatever the pass size, at E / k times the needed FLOPs. GPU
            prefill.
  `jax.lax.ragged_dot` (tokens sorted by expert, one grouped matmul) is the TPU's prefill
  form, where XLA has a grouped-matmul kernel for it. On CPU and GPU, JAX 0.10 lowers it to a
  dense masked dot over every expert plus a transposed copy of all expert weights per call: it
  was the slowest form here at every size (251 ms vs 3 ms for one token at scaled
  Qwen3-30B-A3B shapes), so it is not used there.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.models.attention import einsum
from spec_jax.models.config import MoeConfig

Params = Any

LOOP, GATHER, DENSE, RAGGED = "loop", "gather", "dense", "ragged"


def expert_path(pairs: int, num_experts: int, backend: str | None = None) -> str:
    """The expert computation for a pass of `pairs` (token, expert) pairs on `backend`
    (default: the backend being traced for); see the module doc for why."""
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return LOOP
    if pairs < num_experts:  # fewer routed slices than experts: read only those
        return GATHER
    return RAGGED if backend == "tpu" else DENSE


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens route to in one layer, each choosing
    `top_k` of `num_experts` uniformly and independently: E * (1 - (1 - k/E) ** T). Real routers
    are skewed and tokens of one text correlate, so measured unions are smaller; this is the
    upper envelope a verify pass's expert reads grow along (1 token: k experts; many: all E)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


# ----------------------------------------------------------------------------- routing
def route(lp: Params, x: jax.Array, moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """Router over tokens x [N, H] -> (weights [N, k] float32, experts [N, k] int32), each row
    in descending router order."""
    logits = einsum("nh,he->ne", x, lp["router"]).astype(jnp.float32)  # [N, E]
    if "router_bias" in lp:
        logits = logits + lp["router_bias"].astype(jnp.float32)
    if moe.router_scoring == "topk_softmax":  # gpt-oss: the top k logits, softmax over them
        top, experts = jax.lax.top_k(logits, moe.top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    # Qwen-MoE, Mixtral: softmax over every expert, then the top k (renormalised or not).
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), moe.top_k)
    if moe.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if "router_expert_scale" in lp:  # Gemma 4: after renormalising, so the weights need not sum 1
        weights = weights * jnp.take(lp["router_expert_scale"].astype(jnp.float32), experts)
    return weights, experts.astype(jnp.int32)


def expert_activation(gate: jax.Array, up: jax.Array, moe: MoeConfig) -> jax.Array:
    """The experts' gated activation: SwiGLU (silu(gate) * up) unless the family says otherwise."""
    if moe.expert_activation == "silu":
        return jax.nn.silu(gate) * up
    if moe.expert_activation == "clamped_swiglu":  # gpt-oss: clamped, sigmoid gain alpha, (up + 1)
        gate = jnp.minimum(gate, moe.swiglu_limit)
        up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
        return gate * jax.nn.sigmoid(gate * moe.swiglu_alpha) * (up + 1)
    if moe.expert_activation == "gelu_tanh":  # Gemma 4's GeGLU experts
        return jax.nn.gelu(gate, approximate=True) * up
    raise ValueError(f"expert activation {moe.expert_activation!r} has no implementation in moe.py")


# ----------------------------------------------------------------------------- experts
def _expert_ffn(x: jax.Array, weight: Any, biases: bool, moe: MoeConfig | None) -> jax.Array:
    """x [..., H] through the expert weights `weight(name)` returns for it ([..., H, F] and
    [..., F, H]; biases [..., F] / [..., H] when `biases`) -> [..., H]. `moe` None: SwiGLU (the
    shared expert), else the family's expert activation."""
    gate = einsum("...h,...hf->...f", x, weight("experts_w_gate"))
    up = einsum("...h,...hf->...f", x, weight("experts_w_up"))
    if biases:
        gate, up = gate + weight("experts_b_gate"), up + weight("experts_b_up")
    act = jax.nn.silu(gate) * up if moe is None else expert_activation(gate, up, moe)
    out = einsum("...f,...fh->...h", act, weight("experts_w_down"))
    return out + weight("experts_b_down") if biases else out


def _routed_loop(lp: Params, x: jax.Array, experts: jax.Array, moe: MoeConfig) -> jax.Array:
    """x [P, H] (one row per (token, expert) pair), experts [P] -> each pair's expert output
    [P, H], one pair at a time, its expert's slices read in place."""

    def one_pair(args):
        x_p, e = args  # [H], []
        return _expert_ffn(x_p, lambda name: jax.lax.dynamic_index_in_dim(lp[name], e, keepdims=False),
                           "experts_b_gate" in lp, moe)

    return jax.lax.map(one_pair, (x, experts))


def _routed_gather(lp: Params, x: jax.Array, experts: jax.Array, moe: MoeConfig) -> jax.Array:
    """As `_routed_loop`, with the pairs' expert weights gathered ([P, H, F]) for batched matmuls."""
    return _expert_ffn(x, lambda name: jnp.take(lp[name], experts, axis=0), "experts_b_gate" in lp, moe)


def _routed_ragged(lp: Params, x: jax.Array, experts: jax.Array, moe: MoeConfig) -> jax.Array:
    """As `_routed_loop`, with the pairs sorted by expert and grouped matmuls (`ragged_dot`)."""
    num_experts = lp["experts_w_gate"].shape[0]
    order = jnp.argsort(experts, stable=True)
    sorted_experts = experts[order]
    sizes = jnp.bincount(experts, length=num_experts).astype(jnp.int32)
    xs = x[order]
    gate = jax.lax.ragged_dot(xs, lp["experts_w_gate"], sizes)
    up = jax.lax.ragged_dot(xs, lp["experts_w_up"], sizes)
    if "experts_b_gate" in lp:
        gate = gate + lp["experts_b_gate"][sorted_experts]
        up = up + lp["experts_b_up"][sorted_experts]
    out = jax.lax.ragged_dot(expert_activation(gate, up, moe), lp["experts_w_down"], sizes)
    if "experts_b_down" in lp:
        out = out + lp["experts_b_down"][sorted_experts]
    return jnp.zeros_like(out).at[order].set(out)  # back in pair order


def _all_experts(lp: Params, x: jax.Array, weights: jax.Array, experts: jax.Array, moe: MoeConfig) -> jax.Array:
    """Every expert on every token x [N, H], combined by the router weights (zero off each
    token's top k) -> [N, H] float32."""
    n, num_experts = x.shape[0], lp["experts_w_gate"].shape[0]
    combine = jnp.zeros((n, num_experts), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)
    gate = einsum("nh,ehf->nef", x, lp["experts_w_gate"])
    up = einsum("nh,ehf->nef", x, lp["experts_w_up"])
    if "experts_b_gate" in lp:
        gate, up = gate + lp["experts_b_gate"], up + lp["experts_b_up"]
    act = expert_activation(gate, up, moe) * combine[:, :, None].astype(gate.dtype)
    out = einsum("nef,efh->nh", act, lp["experts_w_down"]).astype(jnp.float32)
    if "experts_b_down" in lp:
        out = out + einsum("ne,eh->nh", combine, lp["experts_b_down"].astype(jnp.float32))
    return out


def routed_experts(
    lp: Params, x: jax.Array, weights: jax.Array, experts: jax.Array, moe: MoeConfig, path: str | None = None
) -> jax.Array:
    """The routed experts' outputs for tokens x [N, H], weighted and summed per token -> [N, H]
    float32. `path` forces one computation (tests); default `expert_path`."""
    n, k = experts.shape
    path = path or expert_path(n * k, moe.num_experts)
    if path == DENSE:
        return _all_experts(lp, x, weights, experts, moe)
    per_pair = {LOOP: _routed_loop, GATHER: _routed_gather, RAGGED: _routed_ragged}[path]
    pair_x = jnp.repeat(x, k, axis=0)  # [N * k, H]: row n * k + j is token n's j-th expert
    out = per_pair(lp, pair_x, experts.reshape(-1), moe).reshape(n, k, -1)
    return einsum("nkh,nk->nh", out.astype(jnp.float32), weights)


def moe_block(lp: Params, x: jax.Array, moe: MoeConfig, path: str | None = None,
              router_x: jax.Array | None = None) -> jax.Array:
    """The MoE feed-forward of one layer: x [B, T, H] (normed) -> [B, T, H]. `router_x` [B, T, H]:
    what the router reads when it is not x (Gemma 4's router has its own norm of the residual)."""
    b, t, h = x.shape
    tokens = x.reshape(b * t, h)
    with jax.named_scope("router"):
        weights, experts = route(lp, tokens if router_x is None else router_x.reshape(b * t, h), moe)
    with jax.named_scope("experts"):
        out = routed_experts(lp, tokens, weights, experts, moe, path).reshape(b, t, h)
    if "shared_w_gate" in lp:
        with jax.named_scope("shared_expert"):
            # A dense SwiGLU expert every token runs: shared_w_* in the experts' places.
            shared = _expert_ffn(x, lambda name: lp[name.replace("experts_", "shared_")], False, None)
            shared = shared.astype(jnp.float32)
            if "shared_gate" in lp:
                shared = shared * jax.nn.sigmoid(einsum("bth,ho->bto", x, lp["shared_gate"]).astype(jnp.float32))
            out = out + shared
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- accounting
def expert_param_names() -> tuple[str, ...]:
    return ("experts_w_gate", "experts_w_up", "experts_w_down", "experts_b_gate", "experts_b_up", "experts_b_down")


def param_counts(cfg: Any, tokens: int = 1) -> dict[str, float]:
    """Parameter counts of a model config: `total`, `active` per token (every non-expert weight
    plus k experts per MoE layer), and `read` by one pass of `tokens` tokens (the experts the
    expected union of their choices touches, `expected_distinct_experts`). A dense model: all three
    equal. The embedding table counts whole, as the models' published totals count it."""
    from spec_jax.models.weights import is_spec, model_weight_specs

    total = expert = 0
    for path, spec in jax.tree_util.tree_flatten_with_path(model_weight_specs(cfg), is_leaf=is_spec)[0]:
        size = math.prod(spec.shape)
        total += size
        if getattr(path[-1], "key", None) in expert_param_names():
            expert += size
    moe = getattr(cfg, "moe", None)
    if moe is None or not expert:
        return {"total": float(total), "active": float(total), "read": float(total)}
    dense = total - expert
    return {
        "total": float(total),
        "active": dense + expert * moe.top_k / moe.num_experts,
        "read": dense + expert * expected_distinct_experts(moe.num_experts, moe.top_k, tokens) / moe.num_experts,
    }
