"""Prompt-lookup (n-gram) drafter: propose what followed the row's last n tokens earlier on."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spec_jax.models.interface import TargetModel


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    """Matches the last n tokens (n = max_ngram down to min_ngram) against the row's prompt and
    output, takes the latest earlier occurrence, and proposes the K tokens that followed it.
    All on device with static shapes: one [B, S] comparison per n. No weights, no state.
    Without a match it proposes the last token repeated (cheap to reject)."""

    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

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

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return state
