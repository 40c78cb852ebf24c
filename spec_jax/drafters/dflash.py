"""DFlash: a block-diffusion drafter that proposes a whole block of tokens in one forward pass.

A few Qwen3-style decoder layers (built from the pieces of `spec_jax.models.decoder`) read the
target's own hidden states as context. Per step:

  context  = hidden_norm(fc(concat of the target's hidden states after `target_layer_ids`))
  block    = target_embed([last committed token, mask, ..., mask]) at positions start..start+b-1
  out      = draft layers: queries from the block; keys/values = [context (cached), block]
  drafts   = target_lm_head(norm(out))[:, 1:1+K]   (or the drafter's own head over a reduced
             draft vocabulary, mapped back with d2t: see `spec_jax.drafters.draft_vocab`)

The drafter keeps a KV cache of context entries only, indexed by absolute position: slot p holds
the k/v of the context feature of position p in every draft layer, so rejected tokens are rolled
back by the per-row context length alone. Context features enter attention as keys/values without
`input_layernorm` (only the block goes through it); `k_norm` and RoPE apply to both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.tree import check_tree_setting, tree_from_logprobs
from spec_jax.sampling import SamplingParams, sample, warp
from spec_jax.drafters.draft_vocab import draft_logits_of, draft_vocab_specs, to_target_vocab
from spec_jax.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from spec_jax.models.decoder import (
    KVCache,
    attend,
    attend_cache_and_pass,
    decoder_layer,
    einsum,
    empty_cache,
    heads_major,
    layer_style,
    project_qkv,
    rms_norm,
    rope,
    rope_inv_freq,
    window_mask,
    write_kv,
)
from spec_jax.models.interface import Target, TargetModel
from spec_jax.models.weights import WeightSpec, init_from_specs, per_layer_specs

Params = Any

def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Target layers to read when a config names none: the middle layer for a one-layer drafter,
    else L ids spread evenly over 1 .. N-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(
        int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)
    )


def dflash_layers(
    num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    intermediate_size: int, **fields: Any,
) -> ModelConfig:
    """The `ModelConfig` of DFlash draft layers: Qwen3 layers (q/k norms) with the z-lab
    config's defaults; `fields` override any of them (vocab_size: the target's, 0 = unknown)."""
    defaults = dict(vocab_size=0, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                    max_position_embeddings=40960, architecture="qwen3", qk_norm=True)
    return ModelConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, intermediate_size=intermediate_size, **{**defaults, **fields},
    )


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Static hyperparameters of a DFlash drafter (hashable; `spec_jax.checkpoints.dflash` maps
    it to and from z-lab and speculators config.json).

    layer: the draft layers, a `ModelConfig` of the one decoder (`dflash_layers` builds one). Its
    vocab_size is the target's (0: unknown), its final_logit_softcapping caps the draft logits;
    per layer `layer_types` says "full_attention" (all context, non-causal within the block) or
    "sliding_attention" (causal, limited to `sliding_window` tokens; no window when it is None).
    is_causal: when set, overrides the causality of every layer.
    draft_vocab_size: None drafts through the target's own LM head (z-lab); a size < the target's
    vocabulary gives the drafter its own head over that many tokens plus a d2t map (speculators'
    reduced draft vocabulary).
    """

    layer: ModelConfig
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    is_causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self):
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= (self.vocab_size or 0):
            raise ValueError(
                f"DFlash draft_vocab_size {self.draft_vocab_size} needs vocab_size (the target's) set "
                f"and must be in 1..vocab_size (vocab_size={self.vocab_size})."
            )
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"DFlash block_size must be >= 2 (one anchor + drafts), got {self.block_size}.")
        if not self.target_layer_ids:
            raise ValueError("DFlash target_layer_ids is empty; name at least one target layer.")

    # What the loop, sharding and training read of any drafter config.
    num_layers = property(lambda self: self.layer.num_layers)
    hidden_size = property(lambda self: self.layer.hidden_size)
    dtype = property(lambda self: self.layer.dtype)

    @property
    def vocab_size(self) -> int | None:
        """The target vocabulary the drafter was made for, or None when its config does not say."""
        return self.layer.vocab_size or None

    @property
    def kv_bytes_per_token(self) -> int:
        """Context-cache bytes per committed token."""
        return self.layer.kv_bytes_per_token

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.layer.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        if self.is_causal is not None:
            return (bool(self.is_causal),) * self.num_layers
        return tuple(t == SLIDING_ATTENTION for t in self.layer_types)


def dflash_weight_specs(cfg: DFlashConfig) -> dict[str, Any]:
    """The drafter's weights; its layers are the decoder's layer weights (qk_norm on)."""
    H = cfg.hidden_size
    n = len(cfg.target_layer_ids)
    own_head = draft_vocab_specs(H, cfg.draft_vocab_size) if cfg.draft_vocab_size else {}
    return {
        **own_head,
        "fc": WeightSpec((n * H, H), (None, "embed")),
        "hidden_norm": WeightSpec((H,), (None,), "ones"),
        "norm": WeightSpec((H,), (None,), "ones"),
        "layers": [
            {**layer, **({"bo": WeightSpec((H,), (None,), "zeros")} if cfg.layer.o_bias else {})}
            for layer in per_layer_specs(
                cfg.num_layers,
                hidden=H,
                num_heads=cfg.layer.num_heads,
                num_kv_heads=cfg.layer.num_kv_heads,
                head_dim=cfg.layer.head_dim,
                intermediate=cfg.layer.intermediate_size,
                qk_norm=True,
                qkv_bias=cfg.layer.qkv_bias,  # attention_bias (z-lab's gpt-oss drafters)
            )
        ],
    }


def init_dflash_params(cfg: DFlashConfig, key: jax.Array, scale: float = 1.0) -> Params:
    params = init_from_specs(dflash_weight_specs(cfg), key, jnp.dtype(cfg.dtype), scale)
    if cfg.draft_vocab_size:
        params["d2t"] = jnp.zeros((cfg.draft_vocab_size,), jnp.int32)  # identity map onto the target
    return params


def check_compatible(cfg: DFlashConfig, target_cfg: TargetModel | ModelConfig) -> None:
    """Raise a ValueError naming every way `cfg` cannot draft for the target (a TargetModel, or
    the built-in decoder's ModelConfig: both name vocab_size, hidden_size and num_layers)."""
    problems = []
    if cfg.hidden_size != target_cfg.hidden_size:
        problems.append(
            f"hidden size {cfg.hidden_size} differs from the target's {target_cfg.hidden_size} "
            "(DFlash reuses the target's embedding and LM head)"
        )
    bad_ids = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad_ids:
        problems.append(
            f"target_layer_ids {bad_ids} are outside the target's {target_cfg.num_layers} layers"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target_cfg.num_layers:
        problems.append(
            f"it was trained for a {cfg.num_target_layers}-layer target, this target has "
            f"{target_cfg.num_layers} layers"
        )
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
        problems.append(
            f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
            f"[0, {target_cfg.vocab_size})"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != target_cfg.vocab_size:
        problems.append(
            f"its vocab size {cfg.vocab_size} differs from the target's {target_cfg.vocab_size}"
        )
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > target_cfg.vocab_size:
        problems.append(
            f"its draft vocabulary ({cfg.draft_vocab_size} tokens) is larger than the target's "
            f"({target_cfg.vocab_size})"
        )
    if problems:
        raise ValueError(
            "DFlash drafter does not fit this target: " + "; ".join(problems) + ". Use the DFlash "
            "checkpoint trained for this target model."
        )


def context_kv(
    cfg: DFlashConfig, params: Params, captured: jax.Array, positions: jax.Array
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Captured target hidden states [B, T, n*H] -> context k, v: per layer [B, Kv, T, D].

    fc -> hidden_norm, then each layer's k/v projection; context features skip input_layernorm,
    k_norm and RoPE (at `positions` [B, T]) apply as to the block's own keys.
    """
    inv_freq = rope_inv_freq(cfg.layer.head_dim, cfg.layer.rope_theta, cfg.layer.rope_scaling)
    with jax.named_scope("dflash_context"):
        ctx = einsum("btc,ch->bth", captured.astype(params["fc"].dtype), params["fc"])
        ctx = rms_norm(ctx, params["hidden_norm"], cfg.layer.rms_norm_eps)  # [B, T, H]
        ks, vs = [], []
        for lp in params["layers"]:
            _, k, v = project_qkv(lp, ctx)  # [B, T, Kv, D]; q is unused (dropped by XLA)
            k = rope(rms_norm(k, lp["k_norm"], cfg.layer.rms_norm_eps), positions, inv_freq)
            ks.append(heads_major(k))  # the cache layout [B, Kv, T, D]
            vs.append(heads_major(v))
        return tuple(ks), tuple(vs)


def dflash_hidden(
    cfg: DFlashConfig,
    params: Params,
    x: jax.Array,
    positions: jax.Array,
    ctx_k: tuple[jax.Array, ...],
    ctx_v: tuple[jax.Array, ...],
    ctx_positions: jax.Array | None,
    ctx_visible: jax.Array | None,
    block_visible: jax.Array,
    ctx_lengths: jax.Array | None = None,
) -> jax.Array:
    """The draft layers over block inputs; shared by drafting (one block) and training (many).

    x [B, Tq, H] block embeddings at positions [B, Tq]; ctx_k/ctx_v per layer [B, Kv, S, D]
    context at ctx_positions [B, S]; ctx_visible [B, Tq, S] and block_visible [B, Tq, Tq] say which
    context entries and block tokens each query may see, before each layer's window/causality rules.
    Drafting gives ctx_lengths [B] instead of ctx_positions and ctx_visible: the context is a cache
    whose committed slots (< ctx_lengths; slot = position, all before the block) are visible within
    each layer's window, and only its live part is read (`attend_cache_and_pass`).
    Returns the final-normed hidden states [B, Tq, H].
    """
    inv_freq = rope_inv_freq(cfg.layer.head_dim, cfg.layer.rope_theta, cfg.layer.rope_scaling)
    style = layer_style(cfg.layer)  # the plain layer's, or with YaRN's attention factor on the queries
    layers = zip(params["layers"], ctx_k, ctx_v, cfg.layer.layer_windows, cfg.layer_causal)
    with jax.named_scope("dflash_block"):
        for i, (lp, layer_ctx_k, layer_ctx_v, window, causal) in enumerate(layers):
            block_mask = block_visible & window_mask(positions, positions, window, causal)

            # Queries see the (read-only) context cache and the block's own keys.
            def context_and_block(q, k, v, ctx=(layer_ctx_k, layer_ctx_v), own=block_mask,
                                  window=window, causal=causal):
                if ctx_lengths is not None:
                    return attend_cache_and_pass(q, *ctx, ctx_lengths, positions, window, k, v, own), None
                ctx_mask = ctx_visible & window_mask(positions, ctx_positions, window, causal)
                return attend(q, [(*ctx, ctx_mask), (k, v, own)]), None

            with jax.named_scope(f"layer_{i}"):
                x, _ = decoder_layer(lp, x, positions, inv_freq, cfg.layer.rms_norm_eps, context_and_block,
                                     style=style)
        return rms_norm(x, params["norm"], cfg.layer.rms_norm_eps)


def dflash_logits(
    cfg: DFlashConfig, params: Params, target: Target, hidden: jax.Array, draft_vocab: bool = False
) -> jax.Array:
    """Draft logits [B, T, V] f32 through the target's own LM head, or through the drafter's
    reduced head (then [B, T, Vd] with draft_vocab=True, else mapped onto the target's V with -inf
    outside); plus the optional output_multiplier and final-logit softcap."""
    if cfg.draft_vocab_size:
        logits = draft_logits_of(params, hidden)
    else:
        logits = target.logits(hidden)
    if cfg.output_multiplier is not None:
        logits = logits * cfg.output_multiplier
    if cfg.layer.final_logit_softcapping:
        cap = cfg.layer.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    if cfg.draft_vocab_size and not draft_vocab:
        logits = to_target_vocab(logits, params["d2t"], target.vocab_size)
    return logits


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    """The DFlash drafter (see the module docstring). Hashable: a static argument of the loop.

    k:            drafts per verify step, 1 .. block_size - 1 (default block_size - 1).
    sample_drafts: at temperature > 0, sample drafts from the warped draft logits and return their
                  probabilities (as the reference does); False keeps argmax drafts (one-hot q).
                  Under greedy sampling both give argmax drafts.
    tree:         0 for a chain of K drafts; a node budget N for a best-first tree over the
                  block's per-position distributions (DDTree); or a tuple of paths for a static
                  tree (`spec_jax.drafters.tree`). Tree nodes are top-k candidates (deterministic).
    State: a `KVCache` of context k/v (per layer [B, Kv, capacity, D]) whose `lengths` [B] are the context
    lengths (lengths - 1 of the loop: every committed token but the last).
    """

    cfg: DFlashConfig
    k: int | None = None
    sample_drafts: bool = True
    tree: Any = 0
    # propose returns the state it was given (the context cache changes in commit only), so a
    # wrapper may skip it on steps where it needs no drafts from this drafter (LookupFirstDrafter).
    stateless_propose = True

    def __post_init__(self):
        if self.k is None:
            object.__setattr__(self, "k", self.cfg.block_size - 1)
        if not 1 <= self.k <= self.cfg.block_size - 1:
            raise ValueError(
                f"DFlash K must be in 1..block_size-1 = 1..{self.cfg.block_size - 1} (one block "
                f"drafts block_size-1 tokens), got {self.k}."
            )
        check_tree_setting(self.tree, self.k, static_ok=True, name="DFlash")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def weight_specs(self) -> dict[str, Any]:
        return dflash_weight_specs(self.cfg)

    def validate(self, target: TargetModel, capacity: int) -> None:
        check_compatible(self.cfg, target)

    # ------------------------------------------------------------------ context cache
    def _write_context(
        self, params: Params, cache: KVCache, captured: jax.Array, positions: jax.Array
    ) -> KVCache:
        """Project captured target hidden states [B, T, n*H] and write their k/v at positions [B, T]."""
        ks, vs = context_kv(self.cfg, params, captured, positions)  # per layer [B, Kv, T, D]
        return cache.replace(
            k=tuple(write_kv(c, k, positions) for c, k in zip(cache.k, ks)),
            v=tuple(write_kv(c, v, positions) for c, v in zip(cache.v, vs)),
        )

    def init(
        self,
        params: Params,
        target: Target,
        prompt_tokens: jax.Array,
        prompt_lengths: jax.Array,
        prefill_captured: jax.Array,
        capacity: int,
    ) -> KVCache:
        cfg = self.cfg
        batch, prompt_len = prompt_tokens.shape
        cache = empty_cache(
            cfg.num_layers, batch, cfg.layer.num_kv_heads, capacity, cfg.layer.head_dim, params["fc"].dtype
        )
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
        cache = self._write_context(params, cache, prefill_captured, positions)
        # Context = the whole prompt; the first sampled token is the block's anchor.
        return cache.with_lengths(prompt_lengths)

    def commit(
        self,
        params: Params,
        target: Target,
        state: KVCache,
        start: jax.Array,
        num_accepted: jax.Array,
        verify_captured: jax.Array,
    ) -> KVCache:
        # All K+1 verified inputs are written; those past the new context length are masked out.
        offsets = jnp.arange(verify_captured.shape[1], dtype=jnp.int32)
        positions = start[:, None] + offsets  # [B, K+1]
        state = self._write_context(params, state, verify_captured, positions)
        return state.with_lengths(start + num_accepted + 1)

    # ------------------------------------------------------------------ drafting
    def draft_logits(
        self,
        params: Params,
        target: Target,
        state: KVCache,
        tokens: jax.Array,
        lengths: jax.Array,
    ) -> jax.Array:
        """Float32 logits [B, K, V] of the K drafts following tokens[b, lengths[b] - 1]."""
        cfg = self.cfg
        b = cfg.block_size
        batch = tokens.shape[0]
        rows = jnp.arange(batch)
        start = lengths - 1  # [B] position of the anchor (last committed token)
        positions = start[:, None] + jnp.arange(b, dtype=jnp.int32)  # [B, b]
        block = jnp.full((batch, b), cfg.mask_token_id, jnp.int32)
        block = block.at[:, 0].set(tokens[rows, start])  # [B, b]: anchor, mask, ..., mask
        x = target.embed(block).astype(params["fc"].dtype)  # [B, b, H]
        if cfg.input_embedding_scale is not None:
            x = x * cfg.input_embedding_scale
        block_visible = jnp.ones((batch, b, b), bool)
        x = dflash_hidden(
            cfg, params, x, positions, state.k, state.v, None, None, block_visible,
            ctx_lengths=state.lengths,  # [B] the committed context: only its live part is read
        )
        # Block position i + 1 predicts draft i; the anchor's own output is unused.
        return dflash_logits(cfg, params, target, x[:, 1 : 1 + self.k])  # [B, K, V]

    def propose(
        self,
        params: Params,
        target: Target,
        state: KVCache,
        tokens: jax.Array,
        lengths: jax.Array,
        key: jax.Array,
        sampling: SamplingParams,
    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
        logits = self.draft_logits(params, target, state, tokens, lengths)  # [B, K, V]
        if not self.sample_drafts:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, state
        probs = warp(logits, sampling)  # one-hot argmax under greedy
        return sample(key, probs), probs, state

    def propose_tree(self, params, target: Target, state: KVCache, tokens, lengths, key, sampling):
        """A tree from the block's one pass: its K per-position distributions, expanded best
        first (or into the static shape) up to the `tree` budget."""
        logits = self.draft_logits(params, target, state, tokens, lengths)  # [B, K, V]
        return tree_from_logprobs(jax.nn.log_softmax(logits, axis=-1), self.tree), state
