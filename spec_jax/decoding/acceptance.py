"""The exact speculative acceptance rule, vectorised over [B, K]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.models.interface import ancestor_mask, tree_depths
from spec_jax.sampling import sample, split_key, uniform


def accept(
    key: jax.Array,
    target_probs: jax.Array,
    drafts: jax.Array,
    draft_probs: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """The speculative acceptance rule (exact in distribution; token-identical when greedy).

    target_probs: [B, K+1, V] warped p_1..p_{K+1}
    drafts:       [B, K] int32 d_1..d_K
    draft_probs:  [B, K, V] warped q_1..q_K, or None for one-hot drafts (q_i(d_i) = 1)
    Returns (num_accepted [B] in 0..K, next_token [B]): the correction token sampled from
    norm(max(p_{n+1} - q_{n+1}, 0)) when n < K, else the bonus token from p_{K+1}.
    """
    batch, k = drafts.shape
    vocab = target_probs.shape[-1]
    accept_key, token_key = split_key(key)
    # Step 1: p_i(d_i) and q_i(d_i) for every draft.
    p_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    # Step 2: accept d_i when u_i * q_i(d_i) <= p_i(d_i); u in (0, 1] so p = 0 always rejects.
    u = 1.0 - uniform(accept_key, (batch, k))
    accepted = u * q_draft <= p_draft
    # Step 3: n = number of leading accepts (cumulative product of the accept mask).
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)
    # Step 4: the distribution the next token comes from: residual at n < K, p_{K+1} at n = K.
    rows = jnp.arange(batch)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    if draft_probs is None:
        q_next = jax.nn.one_hot(drafts[rows, jnp.minimum(num_accepted, k - 1)], vocab) if k else 0.0
    else:
        q_next = draft_probs[rows, jnp.minimum(num_accepted, k - 1)] if k else 0.0
    q_next = jnp.where((num_accepted < k)[:, None], q_next, 0.0)
    residual = jnp.maximum(p_next - q_next, 0.0)
    residual_mass = jnp.sum(residual, axis=-1, keepdims=True)
    next_dist = jnp.where(residual_mass > 0, residual / jnp.maximum(residual_mass, 1e-30), p_next)
    # Step 5: sample it (one-hot under greedy -> the target's argmax).
    next_token = sample(token_key, next_dist)
    return num_accepted.astype(jnp.int32), next_token


def accept_tree(
    key: jax.Array,
    target_probs: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    max_depth: int,
    draft_probs: jax.Array | None = None,
    mode: str = "deterministic",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The acceptance rule over a token tree: the longest accepted root-to-leaf path.

    target_probs: [B, N+1, V] warped p at every in-pass node (index 0 = the root)
    tokens:       [B, N+1] int32 the nodes' tokens (the root's is the last committed token)
    parents:      [B, N+1] int32 parent in-pass indices (the root's is -1; parents precede children)
    max_depth:    static bound on the depth of any node (the drafter's K)
    draft_probs:  [B, N+1, V] q each node was drawn from (siblings share it; row 0 unused), or
                  None for deterministic candidates (distinct siblings, one-hot q)
    mode:         "deterministic", "with_replacement" or "without_replacement" (see TreeDraft)
    Returns (num_accepted [B] = the accepted path's depth, next_token [B], path [B, max_depth+1]:
    the in-pass indices of the root and the accepted nodes, root first; entries past the path
    are 0).

    Invariant (per node, siblings tried in index order): the token emitted after reaching node x
    is distributed as p_x. Deterministic candidates c_1..c_m: accepting c_i with probability
    p'(c_i) and then zeroing it (p' <- normalise(p' - p'(c_i) e_{c_i})) is the same as drawing
    t ~ p_x once and moving to the child whose token is t, emitting t when no child has it; that
    is what runs here (one draw per node, all nodes at once). Drawn candidates: accept c_i with
    probability min(1, p'(c_i) / q_i(c_i)); after a rejection p' <- normalise(max(p' - q_i, 0)),
    where q_i = q for draws with replacement and q with c_1..c_{i-1} removed and renormalised for
    draws without replacement. The token after the last rejection comes from the final p'.
    """
    if mode == "deterministic":
        return _walk_deterministic(key, target_probs, tokens, parents, max_depth)
    if draft_probs is None or mode not in ("with_replacement", "without_replacement"):
        raise ValueError(f"tree mode {mode!r} needs draft_probs (or use 'deterministic')")
    return _walk_drawn(key, target_probs, tokens, parents, max_depth, draft_probs, mode)


def _path_result(path: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(num_accepted [B], path [B, max_depth+1]) from the per-depth node indices (0 = none)."""
    path = jnp.stack(path, axis=1)
    return jnp.sum(path[:, 1:] > 0, axis=-1).astype(jnp.int32), path


def _walk_deterministic(key, target_probs, tokens, parents, max_depth):
    """Deterministic candidates: one draw t_x ~ p_x per node, then the path down from the root
    that follows, at each node, its first child (in index order) carrying the node's draw.

    All nodes at once, not one depth at a time: node y "matches" when its token is its parent's
    draw, and is "first" when no earlier sibling matches; x is on the path when x and all its
    ancestors are first (at most one node per depth is). A walk down max_depth levels ran about
    five dependent small ops per level, each about a kernel on a GPU (RESULTS.md, issue 46)."""
    nodes = target_probs.shape[1]
    node_ids = jnp.arange(nodes)
    is_node = node_ids[None, :] > 0
    # Step 1: one draw t_x ~ p_x per node (greedy: the argmax, whatever the key).
    drawn = sample(key, target_probs)  # [B, N+1]
    parent = jnp.maximum(parents, 0)
    matches = is_node & (tokens == jnp.take_along_axis(drawn, parent, axis=1))  # [B, N+1]
    # Step 2: first matching child of its parent; on the path when every ancestor is too.
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (node_ids[None, :] < node_ids[:, None])
    first = matches & ~jnp.any(earlier_sibling & matches[:, None, :], axis=-1)
    mask = ancestor_mask(parents)  # [B, N+1, N+1]: node x sees x and its ancestors
    depth = tree_depths(mask)
    on_path = ~jnp.any(mask & ~(first | ~is_node)[:, None, :], axis=-1) & (depth <= max_depth)
    # Step 3: the path's node at each depth (0 = none), its length and the deepest node's draw.
    at_depth = on_path[:, :, None] & (depth[:, :, None] == jnp.arange(max_depth + 1))  # [B, N+1, D+1]
    path = jnp.sum(jnp.where(at_depth, node_ids[None, :, None], 0), axis=1).astype(jnp.int32)
    num_accepted = jnp.sum(on_path & is_node, axis=-1).astype(jnp.int32)
    deepest = jnp.take_along_axis(path, num_accepted[:, None], axis=1)
    return num_accepted, jnp.take_along_axis(drawn, deepest, axis=1)[:, 0], path


def _walk_drawn(key, target_probs, tokens, parents, max_depth, draft_probs, mode):
    """Drawn candidates: at each depth try the current node's children in index order
    (recursive rejection sampling), move to the first accepted one, stop at none."""
    batch, nodes, _ = target_probs.shape
    rows = jnp.arange(batch)
    node_ids = jnp.arange(nodes)
    is_node = node_ids[None, :] > 0
    # Sibling rank of each node among its parent's children (index order).
    same_parent = (parents[:, :, None] == parents[:, None, :]) & is_node[:, :, None] & is_node[:, None, :]
    rank = jnp.sum(same_parent & (node_ids[None, None, :] < node_ids[None, :, None]), axis=-1)
    max_children = nodes - 1
    keys = split_key(key, max_depth * max_children + 1)
    cur = jnp.zeros((batch,), jnp.int32)
    alive = jnp.ones((batch,), bool)
    residual = target_probs[:, 0]  # p' [B, V]
    path = [cur]
    for depth in range(max_depth):
        chosen = jnp.full((batch,), -1, jnp.int32)
        q_left = None  # without replacement: q with the tried siblings removed
        for r in range(max_children):
            is_child = is_node & (parents == cur[:, None]) & (rank == r)  # [B, N+1]
            exists = jnp.any(is_child, axis=-1) & alive & (chosen < 0)
            child = jnp.argmax(is_child, axis=-1)
            c = tokens[rows, child]
            q = draft_probs[rows, child]  # [B, V]
            if mode == "without_replacement":
                q_left = q if r == 0 else q_left  # the parent's q, less the tried siblings
                q_eff = q_left / jnp.maximum(jnp.sum(q_left, -1, keepdims=True), 1e-30)
            else:
                q_eff = q
            u = 1.0 - uniform(keys[depth * max_children + r], (batch,))
            accepted = exists & (u * q_eff[rows, c] <= residual[rows, c])
            rejected = exists & ~accepted
            chosen = jnp.where(accepted, child, chosen)
            residual = jnp.where(rejected[:, None], _residual_after_rejection(residual, q_eff), residual)
            if mode == "without_replacement":
                q_left = jnp.where(rejected[:, None], q_left.at[rows, c].set(0.0), q_left)
        found = chosen >= 0
        cur = jnp.where(found, chosen, cur)
        residual = jnp.where(found[:, None], target_probs[rows, cur], residual)
        alive &= found
        path.append(jnp.where(found, cur, 0))
    num_accepted, path = _path_result(path)
    return num_accepted, sample(keys[-1], residual), path


def _residual_after_rejection(residual: jax.Array, q: jax.Array) -> jax.Array:
    """normalise(max(p' - q, 0)) [B, V]. Zero mass means p' <= q everywhere, where a rejection
    cannot happen (p' = q), so p' stays."""
    left = jnp.maximum(residual - q, 0.0)
    mass = jnp.sum(left, -1, keepdims=True)
    return jnp.where(mass > 0, left / jnp.maximum(mass, 1e-30), residual)
