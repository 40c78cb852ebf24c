"""A drafter kind the library has never heard of, defined and registered only here: importing
this module adds "bigram-table" to `spec_jax.drafters.registry`, and from then on `load_drafter`,
`spec-jax generate|bench|info --drafter`, `spec-jax train bigram-table` and their help texts know
it, with no edit to spec_jax/ (tests/test_registry.py).

The drafter is `TableDrafter` (tests/table_drafter.py): a learned next-token table chained K times.
Its recipe learns the table from the data's answer tokens (no target pass) and exports it as
table.npy; its loader reads that file back."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters.registry import DrafterKind, register
from spec_jax.training.run import Recipe
from spec_jax.training.trainer import cross_entropy, masked_mean
from table_drafter import TableDrafter

KIND = "bigram-table"


def load_bigram_table(target: Any, path: str, k: int) -> tuple[TableDrafter, dict]:
    table = np.load(Path(path) / "table.npy")
    return TableDrafter(vocab=table.shape[0], k=k), {"table": jnp.asarray(table)}


def bigram_loss(params: Any, target_params: Any, batch: dict, key: jax.Array):
    """Cross-entropy of table[token t] against token t + 1 over the answer."""
    tokens = batch["tokens"]
    t = jnp.arange(tokens.shape[1] - 1)[None, :]
    answer = (t + 1 < batch["lengths"][:, None]) & (t + 1 >= batch["prompt_lengths"][:, None])
    logits = params["table"][tokens[:, :-1]]  # [B, T-1, V]
    ce = masked_mean(cross_entropy(logits, tokens[:, 1:]), answer)
    return ce, {"ce": ce, "accuracy": masked_mean(jnp.argmax(logits, -1) == tokens[:, 1:], answer)}


@dataclasses.dataclass(frozen=True)
class BigramTableRecipe(Recipe):
    kind = KIND
    title = "bigram table"
    capture_layers = None  # learns from the data's tokens alone: no target pass

    vocab: int
    k: int = 3

    @classmethod
    def from_flags(cls, target: Any, flags: Any) -> BigramTableRecipe:
        return cls(target.cfg.vocab_size, flags.k)

    @property
    def drafter(self) -> TableDrafter:
        return TableDrafter(self.vocab, self.k)

    def records(self) -> tuple[dict, dict]:
        settings = {"vocab": self.vocab}
        return settings, {"k": self.k}

    def initial_params(self, target: Any, seed: int, init_from: Any) -> dict:
        return {"table": np.zeros((self.vocab, self.vocab), np.float32)}

    def loss(self, target: Any, draft_ids: Any) -> Any:
        return bigram_loss

    def export(self, drafter_dir: Path, params: Any, target: Any) -> None:
        drafter_dir.mkdir(parents=True, exist_ok=True)
        np.save(drafter_dir / "table.npy", np.asarray(params["table"]))


ENTRY = register(DrafterKind(
    KIND, "a next-token table learned from the data (defined in the tests)", load_bigram_table,
    takes_path=True, default_k=3, recipe=BigramTableRecipe, lookup_first=True,
), replace=True)
