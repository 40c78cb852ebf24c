"""Prompt lookup in front of a model drafter (`--drafter dflash+ngram`, `draft-model+ngram`, ...).

Much of what a small chat model writes about code repeats its context: the signature and the
docstring it was given, names it already wrote. There the n-gram lookup drafts whole runs that a
small learned drafter misses, and elsewhere the learned drafter is far better than the lookup
(the two combined accept more than either alone; benchmarks/RESULTS.md). So each row, each step, takes the lookup's drafts
when its last `min_match` or more tokens occurred earlier, and the model drafter's otherwise.

Exactness: the choice depends only on the committed tokens, never on the drafts themselves, so
the drafts of a row come from one proposal distribution -- a point mass (the lookup) or the model
drafter's q -- and the usual acceptance rule keeps the output the target's (token-identical under
greedy, the same distribution when sampling).

Cost: the lookup is a few [B, S] compares. Behind DFlash, whose propose leaves its state unchanged
(`stateless_propose`), or a draft model in a loop that switches depth, whose next propose catches
up what it missed (`catches_up`), a step where every row takes the lookup skips the model drafter
altogether (a `lax.cond`); other model drafters run every step, since their state follows their
own drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.drafters.tree import TreeDraft, branch_first, chain_tree
from spec_jax.models.interface import TargetModel


@dataclasses.dataclass(frozen=True)
class LookupFirstDrafter:
    """`model`: the drafter used where the lookup finds nothing (DFlash, a draft model, EAGLE-3);
    its params, state, capture layers and weight specs are this drafter's.
    k: drafts per step for both (default the model drafter's K).
    min_match / max_ngram: the shortest / longest suffix the lookup matches. Chosen on held-out
    prompts that are not the bench's (`benchmarks/lookup_replay.py`, HumanEval[20:40], K=7): one
    token matches too often by chance (tau 3.38 against 3.76 for two, 3.72 for three); a longest
    match of 6 instead of 4 added 0.05."""

    model: Any
    k: int | None = None
    min_match: int = 2
    max_ngram: int = 4
    tree: Any = None  # the model drafter's tree setting (None: the model's own); see propose_tree

    def __post_init__(self):
        if self.k is None:
            object.__setattr__(self, "k", self.model.k)
        elif self.model.k != self.k:  # `generate(k=...)` replaces k here: the model drafter follows
            object.__setattr__(self, "model", dataclasses.replace(self.model, k=self.k))
        if self.tree is None:
            object.__setattr__(self, "tree", getattr(self.model, "tree", 0))
        elif self.tree != getattr(self.model, "tree", 0):  # `generate(tree=...)` lands here too
            if not hasattr(self.model, "propose_tree"):
                raise ValueError(f"{type(self.model).__name__} drafts chains only; it cannot draft trees.")
            object.__setattr__(self, "model", dataclasses.replace(self.model, tree=self.tree))

    @property
    def model_skippable(self) -> bool:
        """Whether a step may skip the model drafter's propose: its propose leaves its state as it
        was (`stateless_propose`: DFlash), or its next propose catches up what it missed (a draft
        model in a loop that switches depth: `catches_up`)."""
        return bool(getattr(self.model, "stateless_propose", False) or self.catches_up)

    @property
    def lookup(self) -> NGramDrafter:
        return NGramDrafter(k=self.k, max_ngram=self.max_ngram, min_ngram=self.min_match)

    # The two hooks a lookup that reads params overrides (`suffix.SuffixFirstDrafter`).
    def front(self, params, tokens, lengths):
        """(the lookup's drafts [B, K], the match length found [B], 0 for none)."""
        return self.lookup.lookup(tokens, lengths)

    def model_params(self, params):
        """The model drafter's part of this drafter's params."""
        return params

    @property
    def cfg(self) -> Any:  # the model drafter's config (`spec-jax info` reads its cache size)
        return self.model.cfg

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.model.capture_layers

    def weight_specs(self) -> Any:
        return self.model.weight_specs()

    def validate(self, target: TargetModel, capacity: int) -> None:
        if self.model.weight_specs() is None:
            raise ValueError(
                f"Prompt lookup goes in front of a model drafter (DFlash, draft model, EAGLE-3), "
                f"not {type(self.model).__name__}; use the n-gram drafter on its own instead."
            )
        self.lookup.validate(target, capacity)
        self.model.validate(target, capacity)

    def init(self, params, target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        return self.model.init(self.model_params(params), target, prompt_tokens, prompt_lengths,
                               prefill_captured, capacity)

    def propose(self, params, target, state, tokens, lengths, key, sampling):
        looked_up, matched = self.front(params, tokens, lengths)
        use_lookup = matched >= self.min_match  # [B]

        def point_mass(probs):  # the lookup's drafts as probabilities shaped like the model's
            return jax.nn.one_hot(looked_up, probs.shape[-1], dtype=probs.dtype)

        def lookup_and_model():
            drafts, probs, new_state = self.model.propose(
                self.model_params(params), target, state, tokens, lengths, key, sampling
            )
            drafts = jnp.where(use_lookup[:, None], looked_up, drafts)
            if probs is not None:
                probs = jnp.where(use_lookup[:, None, None], point_mass(probs), probs)
            return drafts, probs, new_state

        if not self.model_skippable:
            return lookup_and_model()

        # On steps where every row takes the lookup, skip the model drafter (43% of steps on the
        # default model at batch 1).
        def lookup_only():
            probs = jax.eval_shape(lookup_and_model)[1]
            probs = None if probs is None else point_mass(probs)
            return looked_up, probs, state

        return jax.lax.cond(jnp.all(use_lookup), lookup_only, lookup_and_model)

    def propose_tree(self, params, target, state, tokens, lengths, key, sampling):
        """The lookup's branch alongside the model's tree: where the lookup matches, its K drafts
        are the root's first child chain and the model's tree keeps its first N - K nodes behind
        it (all N of them where it does not match; a tree budget of K or less takes the lookup's
        first N drafts alone). The choice depends on committed tokens only, so it stays exact."""
        looked_up, matched = self.front(params, tokens, lengths)
        use_lookup = matched >= self.min_match  # [B]
        tree, state = self.model.propose_tree(self.model_params(params), target, state, tokens, lengths,
                                              key, sampling)
        budget = tree.budget
        if budget > self.k:
            return branch_first(tree, looked_up, use_lookup), state
        lookup_chain = chain_tree(looked_up[:, :budget])
        use = use_lookup[:, None]
        return TreeDraft(tokens=jnp.where(use, lookup_chain.tokens, tree.tokens),
                         parents=jnp.where(use, lookup_chain.parents, tree.parents)), state

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return self.model.commit(self.model_params(params), target, state, start, num_accepted,
                                 verify_captured)

    # The adaptive depth (`spec_jax.decoding.depth`): the model drafter's own hooks when it has them.
    def at_depth(self, depth: int, max_depth: int) -> "LookupFirstDrafter":
        at = getattr(self.model, "at_depth", None)
        model = at(depth, max_depth) if at is not None else dataclasses.replace(self.model, k=depth)
        return dataclasses.replace(self, model=model, k=depth)

    # Two kinds of drafts, told apart before drafting (the adaptive depth keeps an acceptance
    # rate for each: on chat prompts the lookup's drafts were worth 2.8 tokens a K = 7 step, the
    # model's 1.2, benchmarks/RESULTS.md): 0 = the model drafter's, 1 = the lookup's.
    draft_sources = 2

    @property
    def free_draft_sources(self) -> tuple[int, ...]:
        """Sources whose drafts cost no model pass: the lookup's, where propose skips the model."""
        return (1,) if self.model_skippable else ()

    def free_drafts(self, params, tokens, lengths):
        """[B, K] the lookup's drafts: what a row whose source is free (1) drafts, with no model
        pass (a shadow probe where every live row takes them; other rows' are never read)."""
        return self.front(params, tokens, lengths)[0]

    def draft_source(self, params, tokens, lengths):
        """[B] int32: 1 where the lookup's drafts go out this step, 0 where the model's do."""
        return (self.front(params, tokens, lengths)[1] >= self.min_match).astype(jnp.int32)

    def keep_current(self, params, target, state, tokens, lengths):
        keep = getattr(self.model, "keep_current", None)
        return state if keep is None else keep(self.model_params(params), target, state, tokens, lengths)

    @property
    def catches_up(self) -> bool:
        return bool(getattr(self.model, "catches_up", False))

    def catch_up(self, params, target, state, tokens, lengths, rows=None):
        return self.model.catch_up(self.model_params(params), target, state, tokens, lengths, rows)
