"""EAGLE-3: a one-layer (or few-layer) chain drafter fed by three of the target's hidden states.

Pair t of a sequence is (target features of token t, token t + 1); at RoPE position t + 1 it
predicts token t + 2. Per verify step:

  fused    = fc(concat of the target's hidden states at `aux_layer_ids`)       [B, T, H]
  layer 0  = attention over q/k/v of [norm(embed(token)), hidden_norm(fused)], residual = fused
             (or the normed fused features with norm_before_residual), then the MLP;
             further layers are plain decoder layers
  logits   = lm_head(norm(out)) over the draft vocabulary, mapped onto the target's with d2t
             (target id = draft id + d2t[draft id]); ids outside the draft vocabulary get -inf
  chain    = the next pair is (out, the draft just chosen), one position further, attending to
             every real pair and to the chain so far; K drafts in all

The drafter keeps a KV cache of the real pairs (those with target features), indexed by pair:
slot t holds pair t's keys in every draft layer. The features of the last verified inputs wait in
`pending` until `propose` knows the tokens that complete their pairs (the bonus token is sampled
after `commit`), so a rejected draft is rolled back by the per-row pair count alone.

`aux_layer_ids` follow the speculators / vLLM convention: id i is the input of target layer i
(HF `hidden_states[i]`), i.e. spec_jax's capture of layer i - 1; id == num_layers is the last
layer's output before the final norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.draft_vocab import draft_logits_of, draft_vocab_specs, to_target_vocab
from spec_jax.models.config import GLOBAL_WINDOW, ModelConfig
from spec_jax.models.decoder import (
    KVCache,
    attend,
    attend_cache_and_pass,
    decoder_layer,
    einsum,
    embed,
    empty_cache,
    rms_norm,
    rope_inv_freq,
    window_mask,
    write_kv,
)
from spec_jax.drafters.tree import (
    check_tree_setting,
    expand_level,
    expansion_width,
    select_best_nodes,
    top_k,
    tree_budget,
)
from spec_jax.models.interface import Target, TargetModel, ancestor_mask
from spec_jax.models.weights import WeightSpec, init_from_specs, layer_weight_specs
from spec_jax.sampling import SamplingParams, sample_chain

Params = Any


def default_aux_layer_ids(num_target_layers: int, distinct: bool = False) -> tuple[int, ...]:
    """EAGLE-3's default feature layers (vLLM, speculators): low, middle and high, (2, L/2, L-3),
    within 1..L. Heads published without their ids were trained with exactly these (repeats
    included for shallow targets); `distinct` drops repeats, for new heads."""
    n = num_target_layers
    ids = tuple(min(max(i, 1), n) for i in (2, n // 2, n - 3))
    return tuple(sorted(set(ids))) if distinct else ids


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Static hyperparameters of an EAGLE-3 drafter (hashable).

    layer:            the draft decoder layers' config (Llama or Qwen3; vocab_size = target vocab)
    draft_vocab_size: rows of the drafter's LM head (<= the target vocabulary)
    aux_layer_ids:    target feature layers, speculators convention (see the module doc)
    own_embedding:    the checkpoint carries embed_tokens; else the target's embedding is used
    """

    layer: ModelConfig
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    own_embedding: bool = True
    num_target_layers: int | None = None
    speculative_tokens: int = 3  # the checkpoint's proposal length: the default K

    def __post_init__(self):
        # The draft layers run the plain Llama/Qwen3 math whatever the target's family (a config
        # copied from a Gemma or Qwen2 target would otherwise claim its norms and biases).
        object.__setattr__(self, "layer", self.layer.plain_decoder())
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if not self.aux_layer_ids:
            raise ValueError("EAGLE-3 aux_layer_ids is empty; name the target layers it reads.")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("EAGLE-3 norm_before_fc and fc_norm are mutually exclusive; set one.")
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(
                f"EAGLE-3 draft_vocab_size {self.draft_vocab_size} must be in 1..{self.layer.vocab_size} "
                "(the target vocabulary)."
            )
        if any(w != GLOBAL_WINDOW for w in self.layer.layer_windows):
            raise ValueError("EAGLE-3 drafters with sliding-window layers are not supported.")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of one target hidden state."""
        return self.target_hidden_size or self.layer.hidden_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """spec_jax capture ids (output of layer i) of the aux layers (input of layer i)."""
        return tuple(i - 1 for i in self.aux_layer_ids)

    @property
    def dtype(self) -> str:
        return self.layer.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Pair-cache bytes per committed token (every draft layer caches k and v)."""
        return self.layer.kv_bytes_per_token


def _pairs_and_passes(
    cache: KVCache, pass_k: list[list[jax.Array]], pass_v: list[list[jax.Array]],
    position: jax.Array, visible: jax.Array,
):
    """layer i -> its attend_to for a drafting pass at `position` [B, T]: the pass's keys/values
    join layer i's earlier passes (pass_k[i], pass_v[i]), and the queries see every real pair in
    `cache` plus the passes' keys that `visible` [B, T, all so far] allows."""

    def for_layer(i: int):
        def attend_to(q, k, v):
            pass_k[i].append(k)
            pass_v[i].append(v)
            own = (jnp.concatenate(pass_k[i], axis=2), jnp.concatenate(pass_v[i], axis=2))
            # cache.lengths = last_pair + 1: every real pair; pair index = position - 1.
            out = attend_cache_and_pass(
                q, cache.k[i], cache.v[i], cache.lengths, position - 1, GLOBAL_WINDOW, *own, visible,
            )
            return out, None
        return attend_to

    return for_layer


def eagle3_weight_specs(cfg: Eagle3Config) -> dict[str, Any]:
    """The drafter's weights. Layer 0 projects q/k/v from 2H inputs and has a hidden_norm; its
    attn_norm is the input_layernorm applied to the token embedding."""
    c = cfg.layer
    H, n, F = c.hidden_size, len(cfg.aux_layer_ids), cfg.feature_size
    layer_kwargs = dict(hidden=H, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                        head_dim=c.head_dim, intermediate=c.intermediate_size, qk_norm=c.qk_norm)
    first = layer_weight_specs(**layer_kwargs)
    for name in ("wq", "wk", "wv"):
        first[name] = WeightSpec((2 * H,) + first[name].shape[1:], first[name].axes)
    first["hidden_norm"] = WeightSpec((H,), (None,), "ones")
    specs: dict[str, Any] = {
        "fc": WeightSpec((n * F, H), (None, "embed")),
        "layers": [first] + [layer_weight_specs(**layer_kwargs) for _ in range(c.num_layers - 1)],
        "norm": WeightSpec((H,), (None,), "ones"),
        **draft_vocab_specs(H, cfg.draft_vocab_size),
    }
    if cfg.norm_before_fc:
        specs["input_norm"] = WeightSpec((n * F,), (None,), "ones")
    if cfg.fc_norm:
        specs["fc_norms"] = [WeightSpec((F,), (None,), "ones") for _ in range(n)]
    if cfg.own_embedding:
        specs["embed"] = WeightSpec((c.vocab_size, H), ("vocab", "embed"))
    return specs


def init_eagle3_params(cfg: Eagle3Config, key: jax.Array, scale: float = 1.0) -> Params:
    params = init_from_specs(eagle3_weight_specs(cfg), key, jnp.dtype(cfg.dtype), scale)
    params["d2t"] = jnp.zeros((cfg.draft_vocab_size,), jnp.int32)  # identity map onto the target
    return params


def check_compatible(cfg: Eagle3Config, target_cfg: TargetModel | ModelConfig) -> None:
    """Raise a ValueError naming every way `cfg` cannot draft for the target (a TargetModel or
    the built-in decoder's ModelConfig: both name vocab_size, hidden_size and num_layers)."""
    problems = []
    if cfg.layer.vocab_size != target_cfg.vocab_size:
        problems.append(
            f"its vocabulary ({cfg.layer.vocab_size} tokens) differs from the target's "
            f"({target_cfg.vocab_size})"
        )
    if cfg.feature_size != target_cfg.hidden_size:
        problems.append(
            f"it reads {cfg.feature_size}-wide target hidden states, the target's are "
            f"{target_cfg.hidden_size} wide"
        )
    if not cfg.own_embedding and cfg.hidden_size != target_cfg.hidden_size:
        problems.append(
            f"it has no embedding of its own and its width {cfg.hidden_size} differs from the "
            f"target's {target_cfg.hidden_size}"
        )
    bad = [i for i in cfg.aux_layer_ids if not 1 <= i <= target_cfg.num_layers]
    if bad:
        problems.append(
            f"aux layer ids {bad} are outside 1..{target_cfg.num_layers} (the inputs of the "
            "target's layers 1.. and its last layer's output; id 0, the embedding, is not supported)"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target_cfg.num_layers:
        problems.append(
            f"it was made for a {cfg.num_target_layers}-layer target, this target has "
            f"{target_cfg.num_layers} layers"
        )
    if problems:
        raise ValueError(
            "EAGLE-3 drafter does not fit this target: " + "; ".join(problems)
            + ". Use the EAGLE-3 checkpoint trained for this target model."
        )


# ----------------------------------------------------------------------------- the network
def fuse_features(cfg: Eagle3Config, params: Params, captured: jax.Array) -> jax.Array:
    """Concatenated target hidden states [B, T, n*F] -> fused features [B, T, H]."""
    x = captured.astype(params["fc"].dtype)
    eps = cfg.layer.rms_norm_eps
    if cfg.norm_before_fc:  # one norm over the concatenation (gpt-oss heads)
        x = rms_norm(x, params["input_norm"], eps)
    if cfg.fc_norm:  # one norm per target layer
        chunks = jnp.split(x, len(cfg.aux_layer_ids), axis=-1)
        x = jnp.concatenate([rms_norm(c, w, eps) for c, w in zip(chunks, params["fc_norms"])], -1)
    return einsum("btc,ch->bth", x, params["fc"])


def eagle3_layers(
    cfg: Eagle3Config,
    params: Params,
    token_embeds: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    attend_to: Any,
) -> tuple[jax.Array, list[Any]]:
    """The draft layers over pairs: token embeddings and hidden inputs (fused target features, or
    the previous chain step's output) [B, T, H] at RoPE positions [B, T]. attend_to(i) gives
    layer i's `decoder_layer` attend_to. -> (output hidden [B, T, H] before the final norm, what
    each layer's attend_to returned)."""
    c = cfg.layer
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    first = params["layers"][0]
    normed_hidden = rms_norm(hidden, first["hidden_norm"], c.rms_norm_eps)
    attn_input = jnp.concatenate(
        [rms_norm(token_embeds, first["attn_norm"], c.rms_norm_eps), normed_hidden], axis=-1
    )
    residual = normed_hidden if cfg.norm_before_residual else hidden
    with jax.named_scope("eagle3_layer_0"):
        x, aux = decoder_layer(first, residual, positions, inv_freq, c.rms_norm_eps, attend_to(0),
                               attn_input=attn_input)
    auxes = [aux]
    for i, lp in enumerate(params["layers"][1:], start=1):
        with jax.named_scope(f"eagle3_layer_{i}"):
            x, aux = decoder_layer(lp, x, positions, inv_freq, c.rms_norm_eps, attend_to(i))
        auxes.append(aux)
    return x, auxes


def eagle3_head(cfg: Eagle3Config, params: Params, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Layer output [B, T, H] -> (draft-vocabulary logits [B, T, Vd] f32, the hidden state the
    next chain step reads: normed with norm_output, else the raw output)."""
    normed = rms_norm(out, params["norm"], cfg.layer.rms_norm_eps)
    return draft_logits_of(params, normed), normed if cfg.norm_output else out


# ----------------------------------------------------------------------------- the drafter
@struct.dataclass
class Eagle3State:
    """cache: per draft layer k/v [B, Kv, capacity, D] of the real pairs, slot = pair index;
    `cache.lengths` [B] = pairs in it. pending [B, K+1, n*F]: target features of pairs
    lengths.. not yet run (their count is the loop's lengths - 1 - cache.lengths)."""

    cache: KVCache
    pending: jax.Array


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter:
    """The EAGLE-3 drafter (see the module docstring). Hashable: a static argument of the loop.

    k: drafts per verify step (default: the checkpoint's speculative_tokens).
    sample_drafts: at temperature > 0, sample each chain draft from the warped draft distribution
    (mapped onto the target vocabulary) and return those probabilities; False keeps argmax drafts.
    """

    cfg: Eagle3Config
    k: int | None = None
    sample_drafts: bool = True
    tree: Any = 0  # 0: a chain; N: an EAGLE-2-style tree of N nodes (`propose_tree`)

    def __post_init__(self):
        if self.k is None:
            object.__setattr__(self, "k", self.cfg.speculative_tokens)
        if self.k < 1:
            raise ValueError(f"EAGLE-3 K must be >= 1, got {self.k}.")
        check_tree_setting(self.tree, self.k, static_ok=False, name="EAGLE-3")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.capture_layers

    def weight_specs(self) -> dict[str, Any]:
        return eagle3_weight_specs(self.cfg)

    def validate(self, target: TargetModel, capacity: int) -> None:
        check_compatible(self.cfg, target)

    def _embed(self, params: Params, target: Target, tokens: jax.Array) -> jax.Array:
        """The drafter's own embedding when it has one, else the target's."""
        x = embed(params, tokens) if self.cfg.own_embedding else target.embed(tokens)
        return x.astype(params["fc"].dtype)

    def init(self, params, target: Target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        c = self.cfg.layer
        batch, prompt_len = prompt_tokens.shape
        # Behind a barrier, as the target's cache in the loop's prefill (constant folding).
        cache = jax.lax.optimization_barrier(
            empty_cache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, params["fc"].dtype))
        if prompt_len > 1:  # pairs 0 .. P-2 are complete: (features of token t, token t + 1)
            pairs = jnp.broadcast_to(jnp.arange(prompt_len - 1, dtype=jnp.int32), (batch, prompt_len - 1))
            hidden = fuse_features(self.cfg, params, prefill_captured[:, :-1])
            token_embeds = self._embed(params, target, prompt_tokens[:, 1:])
            visible = window_mask(pairs, pairs, GLOBAL_WINDOW)

            def write_and_attend(i):
                def attend_to(q, k, v):
                    return attend(q, [(k, v, visible)]), (k, v)
                return attend_to

            _, kvs = eagle3_layers(self.cfg, params, token_embeds, hidden, pairs + 1, write_and_attend)
            cache = cache.replace(
                k=tuple(write_kv(ck, k, pairs) for ck, (k, _) in zip(cache.k, kvs)),
                v=tuple(write_kv(cv, v, pairs) for cv, (_, v) in zip(cache.v, kvs)),
            )
        rows = jnp.arange(batch)
        # The last prompt token's pair waits for the first sampled token.
        pending = jnp.zeros((batch, self.k + 1, prefill_captured.shape[-1]), prefill_captured.dtype)
        pending = pending.at[:, 0].set(prefill_captured[rows, prompt_lengths - 1])
        return Eagle3State(cache=cache.with_lengths(prompt_lengths - 1), pending=pending)

    def commit(self, params, target: Target, state: Eagle3State, start, num_accepted, verify_captured):
        # Pairs start .. start + n (their tokens are the accepted drafts and the bonus token) wait
        # for propose; the cache already holds every pair before `start`.
        return state.replace(pending=verify_captured.astype(state.pending.dtype))

    def _run_pending(self, params: Params, target: Target, state: Eagle3State, tokens, lengths):
        """Run the pending pairs (the verified tokens the cache has not seen): they attend to the
        cached pairs and causally to each other, and their keys are written at their slots
        (padding writes past the last pair, never visible, later overwritten). -> (the cache
        holding every real pair, the last pair's draft logits [B, 1, Vd] and hidden [B, 1, H])."""
        cfg = self.cfg
        cache: KVCache = state.cache
        batch, seq = tokens.shape
        rows = jnp.arange(batch)
        done = cache.lengths  # [B] pairs in the cache
        last_pair = lengths - 2  # [B] the newest complete pair: (features of L-2, token L-1)
        window = self.k + 1
        pairs = done[:, None] + jnp.arange(window, dtype=jnp.int32)  # [B, K+1]; > last_pair: padding

        hidden = fuse_features(cfg, params, state.pending)
        token_embeds = self._embed(params, target, tokens[rows[:, None], jnp.minimum(pairs + 1, seq - 1)])
        own_visible = window_mask(pairs, pairs, GLOBAL_WINDOW)

        def pending_attend(i):
            def attend_to(q, k, v):  # the cached pairs (< done, the live part only) and their own
                out = attend_cache_and_pass(
                    q, cache.k[i], cache.v[i], done, pairs, GLOBAL_WINDOW, k, v, own_visible
                )
                return out, (k, v)
            return attend_to

        out, kvs = eagle3_layers(cfg, params, token_embeds, hidden, pairs + 1, pending_attend)
        cache = cache.replace(
            k=tuple(write_kv(ck, k, pairs) for ck, (k, _) in zip(cache.k, kvs)),
            v=tuple(write_kv(cv, v, pairs) for cv, (_, v) in zip(cache.v, kvs)),
        ).with_lengths(last_pair + 1)
        last = jnp.clip(last_pair - done, 0, window - 1)
        step_logits, step_hidden = eagle3_head(cfg, params, out[rows, last][:, None])  # [B, 1, .]

        return cache, step_logits, step_hidden

    def draft_logits(
        self,
        params: Params,
        target: Target,
        state: Eagle3State,
        tokens: jax.Array,
        lengths: jax.Array,
        choose: Any = None,
    ) -> tuple[jax.Array, jax.Array, Eagle3State]:
        """Run the pending pairs, then the chain. -> (target-vocabulary logits [B, K, V] f32,
        drafts [B, K], new state). choose(step, logits [B, V]) -> draft [B] picks each chain
        input (default argmax); tests pass the true tokens to compare with teacher forcing."""
        choose = choose or (lambda step, logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
        cfg = self.cfg
        batch = tokens.shape[0]
        last_pair = lengths - 2  # [B] the newest complete pair: (features of L-2, token L-1)
        cache, step_logits, step_hidden = self._run_pending(params, target, state, tokens, lengths)

        # 2) The chain: each draft becomes the next pair's token, one position further; it sees
        # every real pair and the chain's own keys.
        chain_k: list[list[jax.Array]] = [[] for _ in params["layers"]]
        chain_v: list[list[jax.Array]] = [[] for _ in params["layers"]]
        logits_out, drafts = [], []
        for step in range(self.k):
            logits = to_target_vocab(step_logits[:, 0], params["d2t"], cfg.layer.vocab_size)  # [B, V]
            draft = choose(step, logits)
            logits_out.append(logits)
            drafts.append(draft)
            if step == self.k - 1:
                break
            position = (last_pair + 2 + step)[:, None]  # [B, 1]
            chain_attend = _pairs_and_passes(cache, chain_k, chain_v, position,
                                             jnp.ones((batch, 1, step + 1), bool))
            out, _ = eagle3_layers(cfg, params, self._embed(params, target, draft[:, None]),
                                   step_hidden, position, chain_attend)
            step_logits, step_hidden = eagle3_head(cfg, params, out)
        return jnp.stack(logits_out, 1), jnp.stack(drafts, 1), Eagle3State(cache=cache, pending=state.pending)

    def propose_tree(self, params, target: Target, state: Eagle3State, tokens, lengths, key, sampling):
        """An EAGLE-2-style tree: the top-W children of the root, then level by level the top-W
        children of the W frontier nodes, keeping the W best by path log-probability (W from the
        budget and K); the `tree` budget's best nodes of all levels form the tree (top-k
        candidates: deterministic). A level's nodes run in one pass: each reads its parent's
        output hidden state and sees the real pairs plus its own fed ancestors."""
        cfg, k, budget = self.cfg, self.k, tree_budget(self.tree)
        width = expansion_width(budget, k)
        batch = tokens.shape[0]
        rows = jnp.arange(batch)[:, None]
        last_pair = lengths - 2
        cache, step_logits, step_hidden = self._run_pending(params, target, state, tokens, lengths)

        def logprobs(draft_logits):  # [B, T, Vd] -> [B, T, V] over the target vocabulary
            mapped = to_target_vocab(draft_logits, params["d2t"], cfg.layer.vocab_size)
            return jax.nn.log_softmax(mapped.astype(jnp.float32), axis=-1)

        lp, tok = top_k(logprobs(step_logits)[:, 0], width)  # the root's children
        node_tokens, node_scores = tok, lp
        node_parents = jnp.full((batch, width), -1, jnp.int32)
        node_depths = jnp.ones((batch, width), jnp.int32)
        # Hidden state each node's children read: the root's for level 1, then each fed node's.
        parent_hidden = jnp.broadcast_to(step_hidden, (batch, width, step_hidden.shape[-1]))
        fed_k: list[list[jax.Array]] = [[] for _ in params["layers"]]
        fed_v: list[list[jax.Array]] = [[] for _ in params["layers"]]
        fed_hidden = []
        for level in range(1, k):
            frontier = (level - 1) * width + jnp.arange(width)  # this level's nodes
            fed = level * width  # nodes fed once this pass runs: levels 1..level
            visible = ancestor_mask(node_parents)[:, frontier, :fed]  # [B, W, fed]
            position = (last_pair + 1 + level)[:, None] + jnp.zeros((1, width), jnp.int32)
            level_attend = _pairs_and_passes(cache, fed_k, fed_v, position, visible)
            level_tokens = node_tokens[:, (level - 1) * width:]
            out, _ = eagle3_layers(cfg, params, self._embed(params, target, level_tokens),
                                   parent_hidden, position, level_attend)
            level_logits, level_hidden = eagle3_head(cfg, params, out)  # [B, W, .]
            fed_hidden.append(level_hidden)
            new_tok, new_parent, new_score = expand_level(
                node_scores, jnp.broadcast_to(frontier, (batch, width)), logprobs(level_logits), width
            )
            all_hidden = jnp.concatenate(fed_hidden, axis=1)  # [B, fed, H]
            parent_hidden = all_hidden[rows, new_parent]
            node_depths = jnp.concatenate([node_depths, node_depths[rows, new_parent] + 1], axis=1)
            node_tokens = jnp.concatenate([node_tokens, new_tok], axis=1)
            node_parents = jnp.concatenate([node_parents, new_parent], axis=1)
            node_scores = jnp.concatenate([node_scores, new_score], axis=1)
        tree = select_best_nodes(node_tokens, node_parents, node_scores, node_depths, budget)
        return tree, Eagle3State(cache=cache, pending=state.pending)

    def propose(self, params, target: Target, state: Eagle3State, tokens, lengths, key, sampling: SamplingParams):
        if not self.sample_drafts:
            logits, drafts, state = self.draft_logits(params, target, state, tokens, lengths)
            return drafts, None, state
        (_, drafts, state), probs = sample_chain(
            lambda choose: self.draft_logits(params, target, state, tokens, lengths, choose), self.k, key, sampling)
        return drafts, probs, state
