"""A reduced draft vocabulary: a drafter's own LM head over Vd of the target's V tokens.

EAGLE-3 heads and speculators DFlash drafters may draft from a subset of the target's vocabulary
(the tokens the data actually answers with), which makes their LM head V / Vd times cheaper.
Params: `lm_head` [H, Vd] and `d2t` [Vd] int offsets (target id = draft id + d2t[draft id], the
speculators convention). Draft logits are mapped onto the target vocabulary with -inf outside the
subset, so a sampled draft's probabilities cover the full vocabulary and exact acceptance holds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models.decoder import einsum
from spec_jax.models.interface import Target
from spec_jax.models.weights import WeightSpec


def draft_vocab_specs(hidden: int, draft_vocab_size: int) -> dict[str, WeightSpec]:
    return {
        "lm_head": WeightSpec((hidden, draft_vocab_size), ("embed", "vocab")),
        "d2t": WeightSpec((draft_vocab_size,), (None,), "zeros"),  # int32 offsets
    }


def draft_logits_of(params: Any, hidden: Any) -> Any:
    """Final-normed hidden [..., H] -> float32 draft-vocabulary logits [..., Vd]."""
    return einsum("...h,hv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)


def to_target_vocab(draft_logits: Any, d2t: Any, vocab_size: int) -> Any:
    """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V] (-inf for target
    tokens the drafter cannot propose, so they get zero draft probability)."""
    ids = jnp.arange(draft_logits.shape[-1], dtype=jnp.int32) + jnp.asarray(d2t).astype(jnp.int32)
    full = jnp.full(draft_logits.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(draft_logits.astype(jnp.float32))


def target_to_draft(draft_ids: Any, vocab_size: int) -> Any:
    """[V] int32: the draft id of each target id, -1 outside the draft vocabulary."""
    draft_ids = jnp.asarray(draft_ids, jnp.int32)
    table = jnp.full((vocab_size,), -1, jnp.int32)
    return table.at[draft_ids].set(jnp.arange(draft_ids.shape[0], dtype=jnp.int32))


def offsets(draft_ids: np.ndarray) -> np.ndarray:
    """Sorted target ids of the draft vocabulary -> d2t offsets (int32)."""
    draft_ids = np.asarray(draft_ids, np.int64)
    return (draft_ids - np.arange(len(draft_ids))).astype(np.int32)


def head_rows(target: Target, draft_ids: np.ndarray) -> np.ndarray:
    """The target's own output embedding of the draft tokens, [H, Vd] float32: the starting
    point of a reduced head (speculators initialises its heads the same way). Read through the
    target interface: the logits of the unit hidden states are the head's rows (a linear head)."""
    unit = jnp.eye(target.model.hidden_size, dtype=jax.tree_util.tree_leaves(target.params)[0].dtype)
    return np.asarray(target.logits(unit), np.float32)[:, np.asarray(draft_ids)]
