"""Recurrent layers under the cache contract: what a state-keeping layer needs to roll back.

A recurrent layer (Gated DeltaNet, an SSM, a gated linear recurrence) keeps a state per row
instead of, or beside, keys/values. Rejected drafts cannot be dropped by a shorter length, so a
pass keeps a *pass record* in the cache it returns: enough to rebuild the state after any of the
pass's tokens. `commit(cache, lengths, path)` then picks, per row, the state after the last
committed token and drops the record, so the committed cache has `init_cache`'s structure again.

- A row commits n = lengths - old of the pass's tokens (old = the committed length before the
  pass; 0 = none, the state before the pass stays). The last of them is pass index n - 1 for a
  chain and node path[b, n - 1] for a tree (`last_committed_index`).
- In a tree pass each node continues its *parent's* state (`pass_parents`), never the state of
  the node before it in the pass: the pass runs the recurrence along every node's ancestors at
  once, so N nodes cost one pass.

These helpers serve any recurrent target (the built-in Gated DeltaNet layers use them, and so does
the test suite's own gated-linear-recurrence target); docs/bring_your_own_model.md walks through
the contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pass_parents(mask: jax.Array | None, length: int) -> jax.Array:
    """Each pass token's parent in the pass: [B or 1, T] int32, -1 = continues the state from
    before the pass. A chain (`mask=None`): t - 1. A tree (`mask` [B, T, T], the ancestor mask):
    the nearest ancestor, i.e. the largest j < t with mask[b, t, j]."""
    index = jnp.arange(length, dtype=jnp.int32)
    if mask is None:
        return (index - 1)[None]
    earlier = mask.astype(bool) & (index[None, :] < index[:, None])  # [B, T, T]: j < t seen by t
    return jnp.max(jnp.where(earlier, index, -1), axis=-1).astype(jnp.int32)


def pass_depths(mask: jax.Array | None, length: int) -> jax.Array:
    """Each pass token's depth below the first: [B or 1, T] int32 (its number of ancestors in
    the pass; t for a chain)."""
    if mask is None:
        return jnp.arange(length, dtype=jnp.int32)[None]
    return jnp.sum(mask.astype(jnp.int32), axis=-1) - 1


def last_committed_index(old_lengths: jax.Array, lengths: jax.Array,
                         path: jax.Array | None) -> jax.Array:
    """[B] the in-pass index of the last token a row commits, -1 when it commits none.

    old_lengths [B]: committed lengths before the pass (the cache's); lengths [B]: after commit;
    path [B, P]: a tree's accepted nodes, root first (None: a chain)."""
    kept = (lengths - old_lengths).astype(jnp.int32)  # [B] tokens of the pass committed
    if path is None:
        return jnp.where(kept > 0, kept - 1, -1)
    at = jnp.clip(kept - 1, 0, path.shape[1] - 1)
    node = jnp.take_along_axis(path.astype(jnp.int32), at[:, None], axis=1)[:, 0]
    return jnp.where(kept > 0, node, -1)


def select_state(before: jax.Array, per_token: jax.Array, last: jax.Array) -> jax.Array:
    """The state after each row's last committed token: before [B, ...] (the state before the
    pass), per_token [B, T, ...] (the state after each pass token), last [B] (-1 = before)."""
    rows = jnp.arange(before.shape[0])
    picked = per_token[rows, jnp.maximum(last, 0)].astype(before.dtype)
    keep = (last >= 0).reshape((-1,) + (1,) * (before.ndim - 1))
    return jnp.where(keep, picked, before)


def ancestors(start: jax.Array, parents: jax.Array, steps: int) -> jax.Array:
    """In-pass indices of nodes `start` [B, M] and their `steps - 1` nearest ancestors, oldest
    first: [B, M, steps]; -1 - d stands for the d-th token before the pass (d = 0, 1, ..), and a
    start of -1 for the last token before the pass. parents [B or 1, T] (`pass_parents`). A short
    causal convolution reads its inputs at these indices (in a tree, along the node's branch)."""
    batch = start.shape[0]
    parents = jnp.broadcast_to(parents, (batch, parents.shape[-1]))
    rows = jnp.arange(batch)[:, None]
    out = [start]
    node = start
    for _ in range(steps - 1):
        up = parents[rows, jnp.maximum(node, 0)]
        node = jnp.where(node >= 0, up, node - 1)  # below the pass: one more token back
        out.append(node)
    return jnp.stack(out[::-1], axis=-1)
