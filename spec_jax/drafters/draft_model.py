"""A small language model (or the target itself, "self") as drafter, with its own KV cache."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.sampling import SamplingParams, sample, split_key, warp
from spec_jax.models.attention import into_empty_cache
from spec_jax.models.config import ModelConfig
from spec_jax.models.decoder import Decoder
from spec_jax.drafters.tree import (
    check_tree_setting,
    expand_level,
    expansion_width,
    select_best_nodes,
    top_k,
    tree_budget,
)
from spec_jax.models.interface import Target, TargetModel, ancestor_mask


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """K sequential steps of a draft LM per verify step; drafts sampled from its warped logits.

    model: any `TargetModel` sharing the target's tokenizer (a built-in `ModelConfig` is wrapped
    in `Decoder`), with its params as the drafter params.

    The draft cache follows the same contract as the target's, so rejected drafts roll back by
    length alone. Each propose rewinds the cache and re-feeds the last K+1 committed tokens, all a
    verify step can add: the draft model has not seen the bonus token (nor d_K after a fully
    accepted block), and the committed tokens need not be its own drafts at all when prompt lookup
    replaced them (`LookupFirstDrafter`). A fixed K+1-token pass keeps shapes static.
    """

    model: Any
    k: int = 4
    tree: Any = 0  # 0: a chain; N: an EAGLE-2-style tree of N nodes (`propose_tree`)
    # Tokens each propose re-feeds (None: K + 1). A loop whose steps switch depth sets it to its
    # largest depth + 1, all a step at any depth can add (`at_depth`).
    refeed: int | None = None

    def __post_init__(self):
        if isinstance(self.model, ModelConfig):
            object.__setattr__(self, "model", Decoder(self.model))
        check_tree_setting(self.tree, self.k, static_ok=False, name="The draft model")

    @property
    def cfg(self) -> ModelConfig | None:
        """The built-in decoder's config (`spec-jax info` reads its size), else None."""
        return getattr(self.model, "cfg", None)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def weight_specs(self) -> Any:
        return self.model.weight_specs()

    def validate(self, target: TargetModel, capacity: int) -> None:
        if self.k < 1:
            raise ValueError(f"K must be >= 1 for a draft model, got {self.k}.")
        cfg = getattr(self.model, "cfg", None)
        if isinstance(cfg, ModelConfig) and any(map(cfg.is_linear_attention, range(cfg.num_layers))):
            raise ValueError(
                "the draft model has Gated DeltaNet (linear_attention) layers: the draft-model drafter "
                "rewinds its cache to re-feed tokens, which a recurrent state cannot do. Use an "
                "attention-only draft model (a recurrent model is fine as the target)."
            )
        small, large = sorted((self.model.vocab_size, target.vocab_size))
        # Checkpoints pad vocabularies to multiples of 64/128; a bigger gap is another tokenizer.
        if large - small > 256:
            raise ValueError(
                f"Draft model vocab ({self.model.vocab_size}) and target vocab "
                f"({target.vocab_size}) differ by more than padding: the drafter must use the "
                "target's tokenizer. Pick a draft model from the same family."
            )

    def _draft_probs(self, logits: jax.Array, target_vocab: int, sampling: SamplingParams) -> jax.Array:
        """Draft logits [B, V_d] -> warped probs over the target's vocabulary [B, V_t]."""
        vd = logits.shape[-1]
        if vd > target_vocab:
            logits = logits[:, :target_vocab]
        elif vd < target_vocab:
            logits = jnp.pad(logits, ((0, 0), (0, target_vocab - vd)), constant_values=-jnp.inf)
        return warp(logits, sampling)

    @property
    def refeed_width(self) -> int:
        return self.k + 1 if self.refeed is None else self.refeed

    def at_depth(self, depth: int, max_depth: int) -> "DraftModelDrafter":
        """This drafter at K = depth in a loop whose steps draft up to max_depth: it re-feeds
        max_depth + 1 tokens, since the previous step may have committed that many."""
        return dataclasses.replace(self, k=depth, refeed=max_depth + 1)

    @property
    def catches_up(self) -> bool:
        """Inside a loop whose steps switch depth (`refeed` set by `at_depth`): a plain step (K = 0)
        leaves the cache alone and the next propose feeds it what it missed (`catch_up`). A
        fixed-K loop never falls behind: each propose re-feeds all a step can add."""
        return self.refeed is not None

    def catch_up(self, params, target: Target, state, tokens, lengths, rows=None):
        """Feed the committed tokens the cache has not seen, `refeed_width` (R) at a time, until it
        holds every position below L - R, where `_refeed` starts. The cache's committed length
        says how far it is current (propose leaves it at L). After n plain steps this costs
        ceil(n / R) passes of R tokens where feeding each plain step's token would cost n
        one-token passes, and a run of plain steps that never drafts again costs nothing.
        `rows` [B] bool: only these catch up (default all). A row not behind re-feeds its last R
        committed tokens, the same keys again, while another catches up."""
        model = self.model
        width = self.refeed_width
        need = lengths - width  # [B] the cache must hold every position below this
        if rows is not None:
            need = jnp.where(rows, need, -width)

        def behind(cache):
            return jnp.any(model.cache_lengths(cache) < need)

        def feed(cache):
            fed = model.cache_lengths(cache)
            lag = fed < need
            out = self._feed(params, cache, tokens, lengths, jnp.where(lag, fed, jnp.maximum(lengths - width, 0)))
            return model.commit(out.cache, jnp.where(lag, fed + width, fed))

        return jax.lax.while_loop(behind, feed, state)

    def _feed(self, params, cache, tokens, lengths, start):
        """The draft model's pass over the committed tokens at positions start .. start + R - 1
        (R = `refeed_width`; past L - 1: repeats of the last token, written beyond the committed
        length and never seen), the cache rewound to `start` first -> its ForwardOutput."""
        rows = jnp.arange(tokens.shape[0])
        pos = start[:, None] + jnp.arange(self.refeed_width, dtype=jnp.int32)  # [B, R]
        inputs = tokens[rows[:, None], jnp.minimum(pos, lengths[:, None] - 1)]
        return self.model.forward(params, inputs, pos, self.model.commit(cache, start))

    def _refeed(self, params, state, tokens, lengths):
        """Rewind to L-R (R = K+1 unless `refeed` says more; 0 for short prompts) and re-feed
        the committed tokens from there, R slots (past L-1 on short prompts: repeats of the last
        token, written beyond the committed length and never seen). -> (float32 logits at
        position L-1 [B, V_d], the cache with the first L tokens committed)."""
        model = self.model
        if self.catches_up:
            state = self.catch_up(params, None, state, tokens, lengths)
        rows = jnp.arange(tokens.shape[0])
        width = self.refeed_width
        start = jnp.maximum(lengths - (width - 1) - 1, 0)  # [B] (two steps: K = fixed keeps its program)
        out = self._feed(params, state, tokens, lengths, start)
        logits = model.logits(params, out.hidden[rows, lengths - 1 - start])  # [B, V_d]
        return logits, model.commit(out.cache, lengths)

    def init(self, params, target: Target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        batch, prompt_len = prompt_tokens.shape
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
        # Behind a barrier, as the target's in the loop's prefill: constant zero lengths would let
        # XLA fold the fully masked cache attention on the host, slowly, at large batches.
        cache = jax.lax.optimization_barrier(self.model.init_cache(batch, capacity))
        with into_empty_cache():  # the prompt's attention reads its own keys only (no cache path compiled)
            cache = self.model.forward(params, prompt_tokens, positions, cache).cache
        return self.model.commit(cache, prompt_lengths)

    def propose(self, params, target: Target, state, tokens, lengths, key, sampling):
        model = self.model
        vocab = target.vocab_size
        keys = split_key(key, self.k)
        # Draft step 1: re-feed the committed tokens the draft model has not all seen.
        logits, cache = self._refeed(params, state, tokens, lengths)
        probs = self._draft_probs(logits, vocab, sampling)  # [B, V]
        draft = sample(keys[0], probs)

        # Draft steps 2..K: feed the previous draft at the next position.
        def step(carry, step_key):
            cache, draft, position = carry
            out = model.forward(params, draft[:, None], position[:, None], cache)
            probs = self._draft_probs(model.logits(params, out.hidden[:, 0]), vocab, sampling)
            nxt = sample(step_key, probs)
            return (model.commit(out.cache, position + 1), nxt, position + 1), (nxt, probs)

        (drafted, _, _), (rest, rest_probs) = jax.lax.scan(step, (cache, draft, lengths), keys[1:])
        drafts = jnp.concatenate([draft[:, None], rest.T], axis=1)  # [B, K]
        draft_probs = jnp.concatenate([probs[:, None], jnp.moveaxis(rest_probs, 0, 1)], axis=1)
        # Catching up reads the committed length as "current up to here": the drafts' keys past L
        # are not committed tokens' (a fixed K keeps its program: the next re-feed rewinds anyway).
        return drafts, draft_probs, (model.commit(drafted, lengths) if self.catches_up else drafted)

    def _target_logprobs(self, logits: jax.Array, target_vocab: int) -> jax.Array:
        """Draft logits [..., V_d] -> log-probabilities over the target's vocabulary [..., V_t]."""
        vd = logits.shape[-1]
        if vd > target_vocab:
            logits = logits[..., :target_vocab]
        elif vd < target_vocab:
            pad = [(0, 0)] * (logits.ndim - 1) + [(0, target_vocab - vd)]
            logits = jnp.pad(logits, pad, constant_values=-jnp.inf)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    def propose_tree(self, params, target: Target, state, tokens, lengths, key, sampling):
        """An EAGLE-2-style tree: level by level, the top-W children of the W best frontier nodes
        are scored by path log-probability and the W best kept (W from the budget and K, 2..8);
        then the `tree` budget's best nodes of all levels form the tree (top-k candidates:
        deterministic). Level d runs one draft pass over every node so far under their ancestor
        mask, so each node sees the committed context and its own ancestors only."""
        model, k, budget = self.model, self.k, tree_budget(self.tree)
        width = expansion_width(budget, k)
        batch = tokens.shape[0]
        vocab = target.vocab_size
        root_logits, cache = self._refeed(params, state, tokens, lengths)  # root committed
        lp, tok = top_k(self._target_logprobs(root_logits, vocab), width)  # [B, W]
        node_tokens, node_parents, node_scores = tok, jnp.full((batch, width), -1, jnp.int32), lp
        node_depths = jnp.ones((batch, width), jnp.int32)
        frontier = jnp.broadcast_to(jnp.arange(width), (batch, width))
        for _ in range(k - 1):
            pass_parents = jnp.where(node_parents >= 0, node_parents, -1)
            # Nodes see the committed context (the root included) plus their in-pass ancestors.
            out = model.forward(
                params, node_tokens, lengths[:, None] - 1 + node_depths, cache,
                mask=ancestor_mask(pass_parents),
            )
            hidden = jnp.take_along_axis(out.hidden, frontier[:, :, None], axis=1)  # [B, W, H]
            level_lp = self._target_logprobs(model.logits(params, hidden), vocab)
            new_tok, new_parent, new_score = expand_level(node_scores, frontier, level_lp, width)
            frontier = node_tokens.shape[1] + jnp.broadcast_to(jnp.arange(width), (batch, width))
            node_depths = jnp.concatenate(
                [node_depths, jnp.take_along_axis(node_depths, new_parent, axis=1) + 1], axis=1)
            node_tokens = jnp.concatenate([node_tokens, new_tok], axis=1)
            node_parents = jnp.concatenate([node_parents, new_parent], axis=1)
            node_scores = jnp.concatenate([node_scores, new_score], axis=1)
        tree = select_best_nodes(node_tokens, node_parents, node_scores, node_depths, budget)
        return tree, cache

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        # Nothing to do: the next propose rewinds to what it re-feeds from.
        return state


def self_drafter(target: Any, k: int = 4) -> DraftModelDrafter:
    """The target drafting for itself (its model or config; pass its params as the drafter
    params): a diagnostic whose every draft must be accepted."""
    if isinstance(target, Target):
        target = target.model
    elif isinstance(getattr(target, "target", None), Target):  # a loaded checkpoint
        target = target.target.model
    return DraftModelDrafter(model=target, k=k)


def _probe_ids(tokenizer: Any, text: str) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=False)
    # transformers tokenizers return a list; a raw `tokenizers.Tokenizer` an Encoding (no __eq__).
    return list(getattr(encoded, "ids", encoded))


def check_same_tokenizer(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raise when drafter and target tokenize differently (ids would mean different text).

    Accepts transformers tokenizers and raw `tokenizers.Tokenizer` objects."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    probe = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # é 中"
    a = _probe_ids(target_tokenizer, probe)
    b = _probe_ids(draft_tokenizer, probe)
    if a != b or target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            "The draft model's tokenizer differs from the target's, so its token ids mean "
            "different text. Use a draft model trained with the target's tokenizer."
        )
