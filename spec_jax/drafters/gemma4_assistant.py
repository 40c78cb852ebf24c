"""Gemma 4's assistant: a multi-token-prediction drafter that reads the target's own cache.

Google ships each Gemma 4 model with an "assistant" (`Gemma4AssistantForCausalLM`, e.g.
`google/gemma-4-e2b-it-assistant`): a few Gemma 4 decoder layers that keep no cache. Per draft:

  x      = pre_projection(concat[target.embed(token), state])          [B, T, H]  (state: Hb wide)
  layers = Gemma 4 layers whose queries attend to the TARGET's keys/values: a layer of type
           "sliding_attention" reads the target's last sliding layer, one of type "full_attention"
           its last full layer (their committed slots; a sliding layer the last window + 1 of them)
  out    = final_norm(x);  logits = out @ embed^T (tied head), or centroid-sparse (below)
  state' = post_projection(out)                                          [B, Hb]

The first draft's state is the target's final hidden state (what its LM head reads) at the token
before the last committed one, and its token is the last committed token; each further draft
chains the state the previous one produced and the token it drafted. Every draft sits at the
last committed token's position (its queries' RoPE position): the assistant attends to nothing
of its own, so its drafts never enter any cache, and `propose` leaves the state alone.

Centroid-sparse logits (`use_ordered_embeddings`): the vocabulary is split into `num_centroids`
clusters of V / C tokens (`token_ordering` lists cluster c's tokens at c * V/C ..); the top
`centroid_top_k` clusters by `out @ centroids` are scored exactly and every other token gets
(the row's lowest scored logit - 1), as transformers does (which takes the lowest over the whole
batch; here it is per row, so a row's drafts never depend on another row).

`spec_jax.checkpoints.gemma4_assistant` loads the HF format; `--drafter mtp=PATH` names it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.tree import check_tree_setting, expand_tree
from spec_jax.models.attention import attend_cache_and_pass, einsum
from spec_jax.models.config import FULL_ATTENTION, GLOBAL_WINDOW, SLIDING_ATTENTION, ProportionalRope
from spec_jax.models.decoder import LayerStyle, decoder_layer, rms_norm, rope_inv_freq
from spec_jax.models.interface import (
    FINAL_HIDDEN,
    LayerKV,
    Target,
    TargetModel,
    last_layer_of_type,
    require_cache_reader,
)
from spec_jax.models.weights import WeightSpec, init_from_specs
from spec_jax.sampling import SamplingParams, sample_chain

Params = Any
NAME = "Gemma 4 assistant (--drafter mtp)"
READS = "the keys/values of its last sliding-window and last full-attention layers"


@dataclasses.dataclass(frozen=True)
class Gemma4AssistantConfig:
    """Static hyperparameters of a Gemma 4 assistant (hashable; HF `Gemma4AssistantConfig`).

    layer_types: per assistant layer, the target layer type it reads ("sliding_attention" or
      "full_attention"); head_dim / num_kv_heads are the sliding layers', global_head_dim /
      num_global_kv_heads the full layers' (the target's cache shapes for those types).
    sliding_rope_theta; full_rope_theta with full_partial_rotary_factor: RoPE of each layer type
      (Gemma 4: default RoPE on sliding layers, proportional RoPE on full ones).
    backbone_hidden_size: the target's width (its hidden state and embeddings).
    num_centroids / centroid_top_k: the centroid-sparse head (use_ordered_embeddings)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dim: int
    num_kv_heads: int
    backbone_hidden_size: int
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    sliding_window: int | None = None
    sliding_rope_theta: float = 10_000.0
    full_rope_theta: float = 1_000_000.0
    full_partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    use_ordered_embeddings: bool = False
    num_centroids: int = 0
    centroid_top_k: int = 0
    tie_embeddings: bool = True
    num_assistant_tokens: int = 4  # the default K
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if not self.layer_types:
            raise ValueError("a Gemma 4 assistant needs at least one layer (layer_types is empty).")
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(f"assistant layer types {unknown} are not supported; use "
                             f"'{SLIDING_ATTENTION}' or '{FULL_ATTENTION}'.")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("the assistant has sliding-attention layers but no sliding_window.")
        for layer in range(self.num_layers):
            if self.num_heads % self.layer_kv_heads(layer):
                raise ValueError(f"num_heads={self.num_heads} is not a multiple of the "
                                 f"{self.layer_kv_heads(layer)} KV heads its layer {layer} reads.")
        if self.use_ordered_embeddings:
            if not 0 < self.centroid_top_k <= self.num_centroids or self.vocab_size % self.num_centroids:
                raise ValueError(
                    f"centroid-sparse logits need 0 < centroid_top_k ({self.centroid_top_k}) <= "
                    f"num_centroids ({self.num_centroids}) and num_centroids dividing the vocabulary "
                    f"({self.vocab_size})."
                )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layer_head_dim(self, layer: int) -> int:
        if self.layer_types[layer] == FULL_ATTENTION and self.global_head_dim:
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        if self.layer_types[layer] == FULL_ATTENTION and self.num_global_kv_heads:
            return self.num_global_kv_heads
        return self.num_kv_heads

    def layer_window(self, layer: int) -> int:
        """What a query at position p sees of the target's committed slots s < p: p - s < this
        (transformers' bidirectional window of `sliding_window` keys, flipped onto the past)."""
        return self.sliding_window + 2 if self.layer_types[layer] == SLIDING_ATTENTION else GLOBAL_WINDOW

    def layer_inv_freq(self, layer: int) -> jax.Array:
        if self.layer_types[layer] == SLIDING_ATTENTION:
            return rope_inv_freq(self.layer_head_dim(layer), self.sliding_rope_theta, None)
        return rope_inv_freq(self.layer_head_dim(layer), self.full_rope_theta,
                             ProportionalRope(self.full_partial_rotary_factor))

    def layer_style(self, layer: int) -> LayerStyle:
        # Gemma 4 scores are q.k unscaled: undo attention's 1 / sqrt(head_dim).
        return LayerStyle(activation="gelu_tanh", query_multiplier=math.sqrt(self.layer_head_dim(layer)))


def assistant_config_for_target(
    target_cfg: Any, hidden_size: int = 256, num_layers: int = 2, k: int = 4, dtype: str = "float32"
) -> Gemma4AssistantConfig:
    """A fresh assistant for a built-in Gemma 4 target (`spec-jax train mtp` from scratch): its
    layers sliding, the last full (all full without sliding target layers), reading the target's
    KV heads and head sizes with the target's query heads, RoPE and window; a dense tied head."""
    sliding = SLIDING_ATTENTION in target_cfg.layer_types
    types = (SLIDING_ATTENTION,) * (num_layers - 1) + (FULL_ATTENTION,) if sliding else (FULL_ATTENTION,) * num_layers
    rope = target_cfg.rope_scaling
    return Gemma4AssistantConfig(
        vocab_size=target_cfg.vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_heads=target_cfg.num_heads, layer_types=types, head_dim=target_cfg.head_dim,
        num_kv_heads=target_cfg.num_kv_heads, backbone_hidden_size=target_cfg.hidden_size,
        global_head_dim=target_cfg.global_head_dim, num_global_kv_heads=target_cfg.num_global_kv_heads,
        sliding_window=target_cfg.sliding_window if sliding else None,
        sliding_rope_theta=target_cfg.sliding_rope_theta or target_cfg.rope_theta,
        full_rope_theta=target_cfg.rope_theta,
        full_partial_rotary_factor=rope.partial_rotary_factor if isinstance(rope, ProportionalRope) else 1.0,
        rms_norm_eps=target_cfg.rms_norm_eps, num_assistant_tokens=k, dtype=dtype,
    )


def assistant_weight_specs(cfg: Gemma4AssistantConfig) -> dict[str, Any]:
    """The assistant's weights: its layers have queries only (they read the target's keys)."""
    H, N, F, Hb = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.backbone_hidden_size

    def layer(i: int) -> dict[str, WeightSpec]:
        D = cfg.layer_head_dim(i)
        norm = WeightSpec((H,), (None,), "ones")
        return {
            "attn_norm": norm, "post_attn_norm": norm, "mlp_norm": norm, "post_mlp_norm": norm,
            "wq": WeightSpec((H, N, D), ("embed", "q_heads", "head_dim")),
            "q_norm": WeightSpec((D,), (None,), "ones"),
            "wo": WeightSpec((N, D, H), ("q_heads", "head_dim", "embed")),
            "w_gate": WeightSpec((H, F), ("embed", "mlp")),
            "w_up": WeightSpec((H, F), ("embed", "mlp")),
            "w_down": WeightSpec((F, H), ("mlp", "embed")),
            "layer_scalar": WeightSpec((1,), (None,), "ones"),
        }

    specs: dict[str, Any] = {
        "pre_projection": WeightSpec((2 * Hb, H), (None, "embed")),
        "post_projection": WeightSpec((H, Hb), ("embed", None)),
        "embed": WeightSpec((cfg.vocab_size, H), ("vocab", "embed")),
        "layers": [layer(i) for i in range(cfg.num_layers)],
        "final_norm": WeightSpec((H,), (None,), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = WeightSpec((H, cfg.vocab_size), ("embed", "vocab"))
    if cfg.use_ordered_embeddings:
        specs["centroids"] = WeightSpec((H, cfg.num_centroids), ("embed", None))
        specs["token_ordering"] = WeightSpec((cfg.vocab_size,), (None,), "zeros")  # int32
    return specs


def init_assistant_params(cfg: Gemma4AssistantConfig, key: jax.Array, scale: float = 1.0) -> Params:
    """Random weights (tests, training from scratch); a random token ordering of the clusters."""
    params = init_from_specs(assistant_weight_specs(cfg), key, jnp.dtype(cfg.dtype), scale)
    if cfg.use_ordered_embeddings:
        params["token_ordering"] = jax.random.permutation(jax.random.fold_in(key, 1), cfg.vocab_size).astype(jnp.int32)
    return params


def check_compatible(cfg: Gemma4AssistantConfig, target: TargetModel) -> None:
    """One ValueError naming every way the assistant cannot draft for `target` (which must offer
    `CacheReader`); the target's cache shapes come from `jax.eval_shape` (nothing allocated)."""
    reader = require_cache_reader(target, NAME, READS)
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary ({cfg.vocab_size} tokens) differs from the target's ({target.vocab_size})")
    if cfg.backbone_hidden_size != target.hidden_size:
        problems.append(f"it was made for a {cfg.backbone_hidden_size}-wide target (backbone_hidden_size), "
                        f"the target is {target.hidden_size} wide")
    missing = sorted(set(cfg.layer_types) - set(reader.layer_types))
    if missing:
        problems.append(f"it reads {missing} layers and the target has none (its layer types: "
                        f"{sorted(set(reader.layer_types))})")
    cache = jax.eval_shape(lambda: target.init_cache(1, 8))
    for i, kind in enumerate(cfg.layer_types):
        if kind in missing:
            continue
        view = jax.eval_shape(lambda c, layer=last_layer_of_type(reader, kind): reader.cache_view(c, layer), cache)
        want = (cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
        found = (view.k.shape[1], view.k.shape[3])
        if found != want:
            problems.append(f"its layer {i} reads {want[0]} KV heads of size {want[1]} from the target's last "
                            f"{kind} layer, which has {found[0]} of size {found[1]}")
    if problems:
        raise ValueError(f"{NAME} does not fit this target: " + "; ".join(dict.fromkeys(problems))
                         + ". Use the assistant released (or trained) for this target model.")


# ----------------------------------------------------------------------------- the network
def assistant_step(
    cfg: Gemma4AssistantConfig, params: Params, target: Target, tokens: jax.Array, state: jax.Array,
    position: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One draft for T inputs per row: tokens [B, T], their states [B, T, Hb] at `position` [B]
    (the last committed token's) -> (float32 logits [B, T, V], the next states [B, T, Hb])."""
    batch, t = tokens.shape
    embeds = target.embed(tokens).astype(params["pre_projection"].dtype)
    x = einsum("btc,ch->bth", jnp.concatenate([embeds, state.astype(embeds.dtype)], axis=-1),
               params["pre_projection"])
    positions = jnp.broadcast_to(position[:, None], (batch, t))
    for i, lp in enumerate(params["layers"]):
        view = target.cache_view(last_layer_of_type(target.model, cfg.layer_types[i]))
        window = cfg.layer_window(i)

        def read_target(q, k, v, view=view, window=window):
            # No keys of its own: one zero key hidden from every query stands in for the pass.
            empty = jnp.zeros((batch, view.k.shape[1], 1, view.k.shape[3]), q.dtype)
            hidden = jnp.zeros((1, t, 1), bool)
            return attend_cache_and_pass(q, view.k, view.v, view.lengths, positions, window,
                                         empty, empty, hidden, page_table=view.page_table), None

        with jax.named_scope(f"assistant_layer_{i}"):
            x, _ = decoder_layer(lp, x, positions, cfg.layer_inv_freq(i), cfg.rms_norm_eps, read_target,
                                 style=cfg.layer_style(i))
    out = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return assistant_logits(cfg, params, out), einsum("bth,hc->btc", out, params["post_projection"])


def assistant_logits(cfg: Gemma4AssistantConfig, params: Params, out: jax.Array) -> jax.Array:
    """Final-normed output [B, T, H] -> float32 logits [B, T, V]: the tied head, or centroid-sparse."""
    if not cfg.use_ordered_embeddings:
        if cfg.tie_embeddings:
            return einsum("...h,vh->...v", out, params["embed"], preferred_element_type=jnp.float32)
        return einsum("...h,hv->...v", out, params["lm_head"], preferred_element_type=jnp.float32)
    per_cluster = cfg.vocab_size // cfg.num_centroids
    centroid_logits = einsum("...h,hc->...c", out, params["centroids"], preferred_element_type=jnp.float32)
    _, top = jax.lax.top_k(centroid_logits, cfg.centroid_top_k)  # [B, T, k]
    clusters = params["token_ordering"].astype(jnp.int32).reshape(cfg.num_centroids, per_cluster)
    chosen = clusters[top].reshape(top.shape[:-1] + (-1,))  # [B, T, k * V/C] token ids
    head = params["embed"] if cfg.tie_embeddings else params["lm_head"].T
    scored = einsum("...h,...mh->...m", out, head[chosen], preferred_element_type=jnp.float32)
    floor = jnp.min(scored, axis=-1, keepdims=True) - 1.0
    full = jnp.broadcast_to(floor, scored.shape[:-1] + (cfg.vocab_size,))
    return jnp.put_along_axis(full, chosen, scored, axis=-1, inplace=False)


# ----------------------------------------------------------------------------- the drafter
@dataclasses.dataclass(frozen=True)
class AnchoredCache:
    """A target whose cache is {layer: LayerKV}: the views `training_logits` cut per anchor."""

    model: Any

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.model.layer_types

    def embed(self, params, tokens):
        return self.model.embed(params, tokens)

    def cache_view(self, cache, layer: int) -> LayerKV:
        return cache[layer]


@dataclasses.dataclass(frozen=True)
class Gemma4AssistantDrafter:
    """Gemma 4's assistant as a drafter (see the module docstring). Hashable.

    State: the target's final hidden state [B, Hb] of the token before the last committed one
    (from the prefill at the last prompt token, then from each verify pass at the last accepted
    node). k: drafts per step (default the config's num_assistant_tokens). sample_drafts: at
    temperature > 0 sample each draft from the warped draft distribution and return it (exact
    acceptance); False keeps argmax drafts. tree: 0 a chain; N an EAGLE-2-style tree of N nodes."""

    cfg: Gemma4AssistantConfig
    k: int | None = None
    sample_drafts: bool = True
    tree: Any = 0

    stateless_propose = True  # propose returns the state as it was (lookup-first skips it)

    def __post_init__(self):
        if self.k is None:
            object.__setattr__(self, "k", self.cfg.num_assistant_tokens)
        if self.k < 1:
            raise ValueError(f"Gemma 4 assistant K must be >= 1, got {self.k}.")
        check_tree_setting(self.tree, self.k, static_ok=False, name="Gemma 4 assistant")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (FINAL_HIDDEN,)

    def weight_specs(self) -> dict[str, Any]:
        return assistant_weight_specs(self.cfg)

    def validate(self, target: TargetModel, capacity: int) -> None:
        check_compatible(self.cfg, target)

    def step(self, params, target: Target, tokens, state, position):
        """One draft for T inputs per row (`assistant_step`); tests override it with an oracle."""
        return assistant_step(self.cfg, params, target, tokens, state, position)

    def init(self, params, target: Target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        rows = jnp.arange(prompt_tokens.shape[0])
        return prefill_captured[rows, prompt_lengths - 1]

    def commit(self, params, target: Target, state, start, num_accepted, verify_captured):
        rows = jnp.arange(verify_captured.shape[0])
        return verify_captured[rows, num_accepted]

    def draft_logits(self, params, target: Target, state, tokens, lengths, choose=None):
        """The chain: K steps from (last committed token, state). choose(step, logits [B, V]) ->
        draft [B] picks each next input (default argmax). -> (logits [B, K, V], drafts [B, K])."""
        choose = choose or (lambda step, logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
        rows = jnp.arange(tokens.shape[0])
        position = lengths - 1
        token, hidden = tokens[rows, position][:, None], state[:, None]
        logits_out, drafts = [], []
        for step in range(self.k):
            logits, hidden = self.step(params, target, token, hidden, position)
            draft = choose(step, logits[:, 0])
            logits_out.append(logits[:, 0])
            drafts.append(draft)
            token = draft[:, None]
        return jnp.stack(logits_out, 1), jnp.stack(drafts, 1)

    def training_logits(self, params, target: Target, tokens, captured, anchors):
        """The K chained drafts at each anchor, as `propose` makes them there (`spec-jax train mtp`).

        target: the frozen target with its cache after one pass over `tokens` [B, T] (every
        position's keys/values written); captured [B, T, Hb]: its final hidden states; anchors
        [B, A]: positions p >= 1 of a last committed token. -> float32 logits [B, A, K, V], draft j
        (0-based) scoring token p + j + 1. Each anchor is a row of its own that sees the target's
        cache committed up to p (slots < p, as `propose` sees it after a verify step), starts from
        the token at p and the hidden state at p - 1, and chains its own states; the token each
        later draft reads is the data's next one (what it drafted, whenever the drafts before it
        were accepted: those are the only drafts that count)."""
        batch, num_anchors = anchors.shape
        rows = jnp.repeat(jnp.arange(batch), num_anchors)  # [B * A]: each anchor's sequence
        position = anchors.reshape(-1)
        views = {}
        for kind in set(self.cfg.layer_types):
            layer = last_layer_of_type(target.model, kind)
            view = target.cache_view(layer)
            views[layer] = LayerKV(view.k[rows], view.v[rows], position, view.window)
        anchored = Target(target.params, AnchoredCache(target.model), views)
        row_tokens = tokens[rows]
        last = tokens.shape[1] - 1
        data_next = lambda step, logits: row_tokens[jnp.arange(rows.shape[0]), jnp.minimum(position + step + 1, last)]  # noqa: E731
        logits, _ = self.draft_logits(params, anchored, captured[rows, position - 1], row_tokens, position + 1,
                                      data_next)
        return logits.reshape(batch, num_anchors, self.k, -1)

    def propose(self, params, target: Target, state, tokens, lengths, key, sampling: SamplingParams):
        if not self.sample_drafts:
            _, drafts = self.draft_logits(params, target, state, tokens, lengths)
            return drafts, None, state
        (_, drafts), probs = sample_chain(
            lambda choose: self.draft_logits(params, target, state, tokens, lengths, choose), self.k, key, sampling)
        return drafts, probs, state

    def propose_tree(self, params, target: Target, state, tokens, lengths, key, sampling):
        """EAGLE-2-style: the root's top children, then level by level the best children of the
        best nodes by path log-probability (`expand_tree`); a level's nodes run in one pass, each
        with its parent's chained state (they attend to the target's cache only)."""
        rows = jnp.arange(tokens.shape[0])
        position = lengths - 1

        def step(level_tokens, parent_states):  # [B, W], [B, W, Hb] -> log-probs, states
            logits, states = self.step(params, target, level_tokens, parent_states, position)
            return jax.nn.log_softmax(logits, axis=-1), states

        tree = expand_tree(step, tokens[rows, position][:, None], state[:, None], self.k, self.tree)
        return tree, state
