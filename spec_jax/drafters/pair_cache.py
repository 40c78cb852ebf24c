"""Chain drafters over (target hidden state, next token) pairs with a KV cache of their own.

EAGLE-3 (`spec_jax.drafters.eagle3`) and the MTP head of Qwen3.5 / Qwen3-Next checkpoints
(`spec_jax.drafters.qwen_mtp`) are the same machine with different networks: pair t of a sequence
is (the target's features of token t, token t + 1), it predicts token t + 2, and the drafter's
layers attend over every earlier pair, so the drafter keeps a KV cache of the real pairs (those
with target features), slot = pair index. The chain: each draft becomes the next pair's token and
the drafter's own output hidden state the pair's features, one position further.

The features of the last verified inputs wait in `pending` until `propose` knows the tokens that
complete their pairs (the bonus token is sampled after `commit`); `propose` runs them first (they
attend to the cached pairs and causally to each other) and writes their keys, so a rejected draft
is rolled back by the per-row pair count alone, and the cache catches up on exactly the accepted
tokens.

A drafter class mixes `PairCacheDrafter` in and supplies the network as three methods:
`pair_features`, `pair_layers` and `pair_head` (their docstrings below; `empty_pair_cache` too
when its layers are not `cfg.layer`); it has the dataclass fields `cfg`, `k`, `sample_drafts`
and `tree`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.tree import check_tree_setting, expand_level, expansion_width, select_best_nodes, top_k
from spec_jax.drafters.tree import tree_budget
from spec_jax.models.config import GLOBAL_WINDOW
from spec_jax.models.decoder import KVCache, attend, attend_cache_and_pass, empty_cache, window_mask, write_kv
from spec_jax.models.interface import Target, ancestor_mask
from spec_jax.sampling import SamplingParams, sample_chain

Params = Any


@struct.dataclass
class PairCacheState:
    """cache: per draft layer k/v [B, Kv, capacity, D] of the real pairs, slot = pair index;
    `cache.lengths` [B] = pairs in it. pending [B, K+1, F]: target features of pairs
    lengths.. not yet run (their count is the loop's lengths - 1 - cache.lengths)."""

    cache: KVCache
    pending: jax.Array


def pairs_and_passes(
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


class PairCacheConfig:
    """Mixed into a pair-cache drafter's config (a dataclass with the field `layer`, the drafter's
    layer stack as a `ModelConfig`): the width the loop and training read, and the pair cache's
    bytes per committed token (every draft layer caches k and v), as DFlashConfig reads them."""

    hidden_size = property(lambda self: self.layer.hidden_size)
    kv_bytes_per_token = property(lambda self: self.layer.kv_bytes_per_token)


class PairCacheDrafter:
    """The drafter protocol's methods for a pair-cache chain drafter (see the module docstring).
    Pair t sits at RoPE position t + 1 (attention sees relative positions only)."""

    k: int
    sample_drafts: bool
    tree: Any

    # ------------------------------------------------------------------ the network (subclasses)
    def pair_features(self, params: Params, captured: jax.Array) -> jax.Array:
        """The target's captured hidden states [B, T, F] -> the pairs' hidden inputs [B, T, H]."""
        raise NotImplementedError

    def pair_layers(self, params: Params, target: Target, tokens: jax.Array, hidden: jax.Array,
                    positions: jax.Array, attend_to: Any) -> tuple[jax.Array, list[Any]]:
        """The draft layers over pairs: token ids [B, T], hidden inputs [B, T, H] (pair features
        or the previous chain step's hidden state) at positions [B, T]; attend_to(i) is layer i's
        `decoder_layer` attend_to. -> (output [B, T, H], what each layer's attend_to returned)."""
        raise NotImplementedError

    def pair_head(self, params: Params, target: Target, out: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Layer output [B, T, H] -> (float32 logits over the target's vocabulary [B, T, V], the
        hidden state the next chain step reads)."""
        raise NotImplementedError

    def empty_pair_cache(self, params: Params, batch: int, capacity: int) -> KVCache:
        """The drafter's empty KV cache, `capacity` pair slots: one k/v per layer of
        `self.cfg.layer` (the draft layers' `ModelConfig`) unless a subclass says otherwise."""
        c = self.cfg.layer
        return empty_cache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, params["fc"].dtype)

    def settle_k(self, default_k: int, name: str) -> None:
        """For a subclass's __post_init__: K None -> `default_k` (the checkpoint's); K >= 1; the
        tree setting fits K."""
        if self.k is None:
            object.__setattr__(self, "k", default_k)
        if self.k < 1:
            raise ValueError(f"{name} K must be >= 1, got {self.k}.")
        check_tree_setting(self.tree, self.k, static_ok=False, name=name)

    # ------------------------------------------------------------------ training (spec-jax train mtp)
    def training_logits(self, params: Params, target: Target, tokens: jax.Array, captured: jax.Array,
                        anchors: jax.Array) -> jax.Array:
        """The K chained drafts at each anchor, as `propose` makes them there
        (`spec_jax.training.mtp.MtpTrainable`): tokens [B, T], captured [B, T, F] the target's
        features of them, anchors [B, A] positions p >= 1 of a last committed token -> float32
        logits [B, A, K, V], draft j scoring token p + j + 1.

        Draft 0 is pair p - 1 (features of token p - 1, token p) at position p, run with every
        real pair (one causal pass over the sequence, as the prefill and commits fill the pair
        cache); draft j > 0 is the chain's pair (the previous draft's hidden state, token p + j)
        at position p + j, seeing the real pairs <= p - 1 and its own chain's earlier pairs, as
        `draft_logits` runs it. Its token is the data's (what it drafted, whenever the drafts
        before it were accepted: the only drafts that count)."""
        batch, seq_len = tokens.shape
        rows = jnp.arange(batch)[:, None]
        pairs = jnp.broadcast_to(jnp.arange(seq_len - 1, dtype=jnp.int32), (batch, seq_len - 1))
        real_keys: list[tuple[jax.Array, jax.Array]] = []

        def real_pairs(i):
            def attend_to(q, k, v):
                real_keys.append((k, v))
                return attend(q, [(k, v, window_mask(pairs, pairs, GLOBAL_WINDOW))]), None
            return attend_to

        out, _ = self.pair_layers(params, target, tokens[:, 1:], self.pair_features(params, captured[:, :-1]),
                                  pairs + 1, real_pairs)
        at = anchors - 1  # [B, A]: the first draft's pair
        logits, hidden = self.pair_head(params, target, out[rows, at])
        steps = [logits]
        sees_real = pairs[:, None, :] <= at[:, :, None]  # [B, A, T-1]
        own = jnp.broadcast_to(jnp.eye(at.shape[1], dtype=bool), (batch,) + at.shape[1:] * 2)
        chain_keys: list[list[tuple[jax.Array, jax.Array]]] = [[] for _ in real_keys]
        for step in range(1, self.k):
            def chain(i):
                def attend_to(q, k, v):
                    chain_keys[i].append((k, v))
                    return attend(q, [(*real_keys[i], sees_real)] + [(*kv, own) for kv in chain_keys[i]]), None
                return attend_to

            step_tokens = tokens[rows, jnp.minimum(at + 1 + step, seq_len - 1)]
            out, _ = self.pair_layers(params, target, step_tokens, hidden, at + 1 + step, chain)
            logits, hidden = self.pair_head(params, target, out)
            steps.append(logits)
        return jnp.stack(steps, axis=2)

    # ------------------------------------------------------------------ the protocol
    def init(self, params, target: Target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        batch, prompt_len = prompt_tokens.shape
        # Behind a barrier, as the target's cache in the loop's prefill (constant folding).
        cache = jax.lax.optimization_barrier(self.empty_pair_cache(params, batch, capacity))
        if prompt_len > 1:  # pairs 0 .. P-2 are complete: (features of token t, token t + 1)
            pairs = jnp.broadcast_to(jnp.arange(prompt_len - 1, dtype=jnp.int32), (batch, prompt_len - 1))
            hidden = self.pair_features(params, prefill_captured[:, :-1])
            visible = window_mask(pairs, pairs, GLOBAL_WINDOW)

            def write_and_attend(i):
                def attend_to(q, k, v):
                    return attend(q, [(k, v, visible)]), (k, v)
                return attend_to

            _, kvs = self.pair_layers(params, target, prompt_tokens[:, 1:], hidden, pairs + 1, write_and_attend)
            cache = cache.replace(
                k=tuple(write_kv(ck, k, pairs) for ck, (k, _) in zip(cache.k, kvs)),
                v=tuple(write_kv(cv, v, pairs) for cv, (_, v) in zip(cache.v, kvs)),
            )
        rows = jnp.arange(batch)
        # The last prompt token's pair waits for the first sampled token.
        pending = jnp.zeros((batch, self.k + 1, prefill_captured.shape[-1]), prefill_captured.dtype)
        pending = pending.at[:, 0].set(prefill_captured[rows, prompt_lengths - 1])
        return PairCacheState(cache=cache.with_lengths(prompt_lengths - 1), pending=pending)

    def commit(self, params, target: Target, state: PairCacheState, start, num_accepted, verify_captured):
        # Pairs start .. start + n (their tokens are the accepted drafts and the bonus token) wait
        # for propose; the cache already holds every pair before `start`. A step at a smaller
        # adaptive depth verified fewer inputs: zeros pad them to the buffer's width (the loop's
        # largest K + 1), past the last pair, where `run_pending` treats them as padding.
        pending = verify_captured.astype(state.pending.dtype)
        missing = state.pending.shape[1] - pending.shape[1]
        if missing:
            pending = jnp.pad(pending, ((0, 0), (0, missing), (0, 0)))
        return state.replace(pending=pending)

    def keep_current(self, params, target: Target, state: PairCacheState, tokens, lengths):
        """Before a step that drafts nothing (the adaptive depth's K = 0,
        `spec_jax.decoding.depth`): run the pending pairs into the cache now, since that step's
        commit replaces them with its one verified input."""
        cache, _, _ = self.run_pending(params, target, state, tokens, lengths)
        return state.replace(cache=cache)

    def run_pending(self, params: Params, target: Target, state: PairCacheState, tokens, lengths):
        """Run the pending pairs (the verified tokens the cache has not seen): they attend to the
        cached pairs and causally to each other, and their keys are written at their slots
        (padding writes past the last pair, never visible, later overwritten). -> (the cache
        holding every real pair, the last pair's logits [B, 1, V] and hidden [B, 1, H])."""
        cache: KVCache = state.cache
        batch, seq = tokens.shape
        rows = jnp.arange(batch)
        done = cache.lengths  # [B] pairs in the cache
        last_pair = lengths - 2  # [B] the newest complete pair: (features of L-2, token L-1)
        window = state.pending.shape[1]  # K + 1 (the largest K when the depth is adaptive)
        pairs = done[:, None] + jnp.arange(window, dtype=jnp.int32)  # [B, K+1]; > last_pair: padding

        hidden = self.pair_features(params, state.pending)
        pair_tokens = tokens[rows[:, None], jnp.minimum(pairs + 1, seq - 1)]
        own_visible = window_mask(pairs, pairs, GLOBAL_WINDOW)

        def pending_attend(i):
            def attend_to(q, k, v):  # the cached pairs (< done, the live part only) and their own
                out = attend_cache_and_pass(
                    q, cache.k[i], cache.v[i], done, pairs, GLOBAL_WINDOW, k, v, own_visible
                )
                return out, (k, v)
            return attend_to

        out, kvs = self.pair_layers(params, target, pair_tokens, hidden, pairs + 1, pending_attend)
        cache = cache.replace(
            k=tuple(write_kv(ck, k, pairs) for ck, (k, _) in zip(cache.k, kvs)),
            v=tuple(write_kv(cv, v, pairs) for cv, (_, v) in zip(cache.v, kvs)),
        ).with_lengths(last_pair + 1)
        last = jnp.clip(last_pair - done, 0, window - 1)
        step_logits, step_hidden = self.pair_head(params, target, out[rows, last][:, None])  # [B, 1, .]
        return cache, step_logits, step_hidden

    def draft_logits(
        self,
        params: Params,
        target: Target,
        state: PairCacheState,
        tokens: jax.Array,
        lengths: jax.Array,
        choose: Any = None,
    ) -> tuple[jax.Array, jax.Array, PairCacheState]:
        """Run the pending pairs, then the chain. -> (target-vocabulary logits [B, K, V] f32,
        drafts [B, K], new state). choose(step, logits [B, V]) -> draft [B] picks each chain
        input (default argmax); tests pass the true tokens to compare with teacher forcing."""
        choose = choose or (lambda step, logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
        batch = tokens.shape[0]
        last_pair = lengths - 2  # [B] the newest complete pair: (features of L-2, token L-1)
        cache, step_logits, step_hidden = self.run_pending(params, target, state, tokens, lengths)

        # The chain: each draft becomes the next pair's token, one position further; it sees
        # every real pair and the chain's own keys.
        num_layers = len(cache.k)
        chain_k: list[list[jax.Array]] = [[] for _ in range(num_layers)]
        chain_v: list[list[jax.Array]] = [[] for _ in range(num_layers)]
        logits_out, drafts = [], []
        for step in range(self.k):
            logits = step_logits[:, 0]  # [B, V]
            draft = choose(step, logits)
            logits_out.append(logits)
            drafts.append(draft)
            if step == self.k - 1:
                break
            position = (last_pair + 2 + step)[:, None]  # [B, 1]
            chain_attend = pairs_and_passes(cache, chain_k, chain_v, position,
                                            jnp.ones((batch, 1, step + 1), bool))
            out, _ = self.pair_layers(params, target, draft[:, None], step_hidden, position, chain_attend)
            step_logits, step_hidden = self.pair_head(params, target, out)
        return jnp.stack(logits_out, 1), jnp.stack(drafts, 1), PairCacheState(cache=cache, pending=state.pending)

    def propose_tree(self, params, target: Target, state: PairCacheState, tokens, lengths, key, sampling):
        """An EAGLE-2-style tree: the top-W children of the root, then level by level the top-W
        children of the W frontier nodes, keeping the W best by path log-probability (W from the
        budget and K); the `tree` budget's best nodes of all levels form the tree (top-k
        candidates: deterministic). A level's nodes run in one pass: each reads its parent's
        output hidden state and sees the real pairs plus its own fed ancestors."""
        k, budget = self.k, tree_budget(self.tree)
        width = expansion_width(budget, k)
        batch = tokens.shape[0]
        rows = jnp.arange(batch)[:, None]
        last_pair = lengths - 2
        cache, step_logits, step_hidden = self.run_pending(params, target, state, tokens, lengths)

        def logprobs(logits):  # [B, T, V]
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

        lp, tok = top_k(logprobs(step_logits)[:, 0], width)  # the root's children
        node_tokens, node_scores = tok, lp
        node_parents = jnp.full((batch, width), -1, jnp.int32)
        node_depths = jnp.ones((batch, width), jnp.int32)
        # Hidden state each node's children read: the root's for level 1, then each fed node's.
        parent_hidden = jnp.broadcast_to(step_hidden, (batch, width, step_hidden.shape[-1]))
        num_layers = len(cache.k)
        fed_k: list[list[jax.Array]] = [[] for _ in range(num_layers)]
        fed_v: list[list[jax.Array]] = [[] for _ in range(num_layers)]
        fed_hidden = []
        for level in range(1, k):
            frontier = (level - 1) * width + jnp.arange(width)  # this level's nodes
            fed = level * width  # nodes fed once this pass runs: levels 1..level
            visible = ancestor_mask(node_parents)[:, frontier, :fed]  # [B, W, fed]
            position = (last_pair + 1 + level)[:, None] + jnp.zeros((1, width), jnp.int32)
            level_attend = pairs_and_passes(cache, fed_k, fed_v, position, visible)
            level_tokens = node_tokens[:, (level - 1) * width:]
            out, _ = self.pair_layers(params, target, level_tokens, parent_hidden, position, level_attend)
            level_logits, level_hidden = self.pair_head(params, target, out)  # [B, W, .]
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
        return tree, PairCacheState(cache=cache, pending=state.pending)

    def propose(self, params, target: Target, state: PairCacheState, tokens, lengths, key, sampling: SamplingParams):
        if not self.sample_drafts:
            logits, drafts, state = self.draft_logits(params, target, state, tokens, lengths)
            return drafts, None, state
        (_, drafts, state), probs = sample_chain(
            lambda choose: self.draft_logits(params, target, state, tokens, lengths, choose), self.k, key, sampling)
        return drafts, probs, state
