"""Prompt-lookup (n-gram) drafter: propose what followed the row's last n tokens earlier on."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.tree import TreeDraft, check_tree_setting, top_k, tree_budget

from spec_jax.models.interface import TargetModel


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    """Matches the last n tokens (n = max_ngram down to min_ngram) against the row's prompt and
    output, takes the latest earlier occurrence, and proposes the K tokens that followed it.
    All on device with static shapes: one [B, S] comparison per n. No weights, no state.
    Without a match it proposes the last token repeated (cheap to reject).

    tree: 0 for a chain; a budget of N nodes for a tree whose branches are the continuations of
    ceil(N / K) earlier matches (longer matches first, then the latest), merged where they share
    a prefix (`propose_tree`)."""

    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    tree: Any = 0

    def __post_init__(self):
        check_tree_setting(self.tree, self.k, static_ok=False, name="The n-gram drafter")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def weight_specs(self) -> None:
        return None

    def validate(self, target: TargetModel, capacity: int) -> None:
        if self.k < 1:
            raise ValueError(f"K must be >= 1 for the n-gram drafter, got {self.k}.")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"Need 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                f"max_ngram={self.max_ngram}."
            )

    def init(self, params, target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        return ()

    def lookup(self, tokens, lengths):
        """(drafts [B, K] int32, matched n [B]: the n-gram length found, 0 for none)."""
        batch, size = tokens.shape
        rows = jnp.arange(batch)[:, None]
        starts = jnp.arange(size)[None, :]  # candidate match starts j  [1, S]
        best_start = jnp.full((batch,), -1, jnp.int32)
        best_n = jnp.zeros((batch,), jnp.int32)
        # Longer n-grams win: visit n from short to long and overwrite where longer ones match.
        for n in range(self.min_ngram, self.max_ngram + 1):
            suffix = tokens[rows, jnp.maximum(lengths[:, None] - n + jnp.arange(n), 0)]  # [B, n]
            match = jnp.ones((batch, size), bool)
            for i in range(n):
                shifted = jnp.roll(tokens, -i, axis=1)  # shifted[:, j] = tokens[:, j + i]
                match &= shifted == suffix[:, i : i + 1]
            # An earlier occurrence whose continuation starts inside the committed tokens.
            match &= (starts + n <= lengths[:, None] - 1) & (lengths[:, None] >= n)
            latest = jnp.max(jnp.where(match, starts, -1), axis=1)
            found = latest >= 0
            best_start = jnp.where(found, latest, best_start)
            best_n = jnp.where(found, n, best_n)
        follow = best_start[:, None] + best_n[:, None] + jnp.arange(self.k)  # [B, K]
        follow = jnp.minimum(follow, lengths[:, None] - 1)
        follow = jnp.where(best_start[:, None] >= 0, follow, lengths[:, None] - 1)
        return tokens[rows, follow].astype(jnp.int32), best_n

    def propose(self, params, target, state, tokens, lengths, key, sampling):
        drafts, _ = self.lookup(tokens, lengths)
        return drafts, None, state

    def match_lengths(self, tokens, lengths):
        """[B, S] int32: for each start j, the longest n (min_ngram..max_ngram) for which
        tokens[j .. j+n-1] equal the row's last n tokens, with a continuation inside the
        committed tokens (0 where none)."""
        batch, size = tokens.shape
        rows = jnp.arange(batch)[:, None]
        starts = jnp.arange(size)[None, :]
        best = jnp.zeros((batch, size), jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):
            suffix = tokens[rows, jnp.maximum(lengths[:, None] - n + jnp.arange(n), 0)]  # [B, n]
            match = jnp.ones((batch, size), bool)
            for i in range(n):
                match &= jnp.roll(tokens, -i, axis=1) == suffix[:, i : i + 1]
            match &= (starts + n <= lengths[:, None] - 1) & (lengths[:, None] >= n)
            best = jnp.where(match, n, best)
        return best

    def propose_tree(self, params, target, state, tokens, lengths, key, sampling):
        """Branches from several earlier matches: the continuations of the ceil(N / K) best
        match starts (longest match, then latest), each a chain of K, merged into a trie where
        branches share a prefix (a repeated node becomes a later duplicate sibling, which the
        acceptance never reaches), cut to the first N nodes."""
        budget, k = tree_budget(self.tree), self.k
        batch, size = tokens.shape
        rows = jnp.arange(batch)
        branches = -(-budget // k)
        n_at = self.match_lengths(tokens, lengths)  # [B, S]
        score = jnp.where(n_at > 0, n_at * size + jnp.arange(size)[None, :], -1)
        top_score, top_start = top_k(score, min(branches, size))  # [B, M]
        if top_start.shape[1] < branches:  # fewer positions than branches: repeat the last
            pad = branches - top_start.shape[1]
            top_score = jnp.pad(top_score, ((0, 0), (0, pad)), constant_values=-1)
            top_start = jnp.pad(top_start, ((0, 0), (0, pad)))
        found = top_score >= 0  # [B, M]
        n_found = n_at[rows[:, None], top_start]
        follow = top_start[:, :, None] + n_found[:, :, None] + jnp.arange(k)  # [B, M, K]
        follow = jnp.minimum(follow, lengths[:, None, None] - 1)
        follow = jnp.where(found[:, :, None], follow, lengths[:, None, None] - 1)
        conts = tokens[rows[:, None, None], follow].astype(jnp.int32)  # [B, M, K]
        return continuations_trie(conts, budget), state

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return state


def continuations_trie(conts: jax.Array, budget: int) -> TreeDraft:
    """Branches conts [B, M, K] (M continuations of K tokens, best first) merged into a trie cut
    to the first `budget` nodes: node (m, d) hangs under the first branch m' <= m that shares its
    prefix to depth d - 1 (a repeated node becomes a later duplicate sibling, which the acceptance
    never reaches). Shared by the lookup drafters (n-gram, suffix)."""
    batch, branches, k = conts.shape
    same_prefix = jnp.cumprod(conts[:, :, None, :] == conts[:, None, :, :], axis=-1)  # [B, M, M', K]
    canonical = jnp.argmax(same_prefix.astype(bool), axis=2)  # [B, M, K]: first m' (<= m)
    node_index = canonical * k + jnp.arange(k)[None, None, :] + 1  # in-pass index of (m', d)
    parents = jnp.concatenate([jnp.zeros((batch, branches, 1), jnp.int32), node_index[:, :, :-1]], axis=2)
    return TreeDraft(tokens=conts.reshape(batch, -1)[:, :budget],
                     parents=parents.reshape(batch, -1)[:, :budget].astype(jnp.int32))
