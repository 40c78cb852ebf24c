"""A drafter the library has never heard of, defined only in the tests (see test_sharding.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from spec_jax.models.weights import WeightSpec


@dataclasses.dataclass(frozen=True)
class TableDrafter:
    """A drafter the library does not know, defined only here: a learned next-token table
    [vocab, vocab] chained K times from the last committed token (one-hot drafts). It reaches
    sharding and `spec-jax info` through the drafter protocol alone (`weight_specs`)."""

    vocab: int
    k: int = 3

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def weight_specs(self):
        return {"table": WeightSpec((self.vocab, self.vocab), ("vocab", None))}

    def validate(self, target_cfg, capacity) -> None:
        if target_cfg.vocab_size != self.vocab:
            raise ValueError(f"TableDrafter vocab {self.vocab} != target vocab {target_cfg.vocab_size}")

    def init(self, params, target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        return ()

    def propose(self, params, target, state, tokens, lengths, key, sampling):
        token = tokens[jnp.arange(tokens.shape[0]), lengths - 1]
        drafts = []
        for _ in range(self.k):
            token = jnp.argmax(params["table"][token], axis=-1).astype(jnp.int32)
            drafts.append(token)
        return jnp.stack(drafts, axis=1), None, state

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return state


def table_params(vocab: int, sequences) -> dict:
    """Bigram counts of `sequences` (e.g. the target's own greedy outputs), so drafts get accepted."""
    table = np.zeros((vocab, vocab), np.float32)
    for seq in sequences:
        for a, b in zip(seq[:-1], seq[1:]):
            table[a, b] += 1.0
    return {"table": jnp.asarray(table)}
