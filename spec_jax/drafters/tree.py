"""Token trees: what a tree-drafting step proposes, and the builders drafters share.

A step verifies the root (the last committed token, in-pass index 0) plus a static budget of N
draft nodes (in-pass indices 1..N). Node i has a token and a parent p < i (0 = the root); its
depth is one more than its parent's, and it sits at position start + depth in the verify pass,
which uses the ancestor mask (`spec_jax.models.interface.ancestor_mask`). Nodes are stored in
insertion order, so the first M nodes of any tree are a tree too (lookup-first trees rely on it).
Siblings are tried in index order by the acceptance (`spec_jax.decoding.acceptance.accept_tree`).

How a tree is chosen is a drafter's static setting `tree`:
- 0: a chain of K drafts (no tree);
- N > 0: a budget of N nodes, built the drafter's own way (best-first over per-position
  distributions for DFlash and Medusa, EAGLE-2-style expansion for the draft model and EAGLE-3,
  several earlier matches for the n-gram lookup);
- a tuple of paths: a static tree (Medusa / Sequoia style). Each path lists candidate ranks per
  depth: (0,) is the top-1 token at depth 1, (0, 1) the second-best token at depth 2 under it.
  Every prefix of a path must be a path too. Only drafters with per-position distributions take
  static trees.
The deepest a tree may go is the drafter's K, so K still bounds the tokens one step commits.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

DETERMINISTIC, WITH_REPLACEMENT, WITHOUT_REPLACEMENT = "deterministic", "with_replacement", "without_replacement"
CANDIDATE_MODES = (DETERMINISTIC, WITH_REPLACEMENT, WITHOUT_REPLACEMENT)

TreeSetting = Any  # int budget, or a tuple of paths


@struct.dataclass
class TreeDraft:
    """One step's proposal for every row.

    tokens:  [B, N] int32  the draft nodes' tokens (in-pass indices 1..N)
    parents: [B, N] int32  each node's parent's in-pass index, 0 (the root) .. its own index - 1
    probs:   [B, N, V] or None  the distribution q each node was drawn from (siblings share their
             parent's q); None when the candidates are deterministic (top-k, lookup matches)
    mode:    how siblings were chosen (static): DETERMINISTIC (distinct tokens, taken rather than
             drawn; q is one-hot), WITH_REPLACEMENT (i.i.d. draws from q) or WITHOUT_REPLACEMENT
             (draws from q, each excluding the earlier siblings' tokens)
    """

    tokens: jax.Array
    parents: jax.Array
    probs: jax.Array | None = None
    mode: str = struct.field(pytree_node=False, default=DETERMINISTIC)

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]


def check_tree_setting(tree: TreeSetting, k: int, *, static_ok: bool, name: str) -> None:
    """Host-side check of a drafter's `tree` setting (raises ValueError naming the fix)."""
    if isinstance(tree, (bool, np.bool_)):
        raise ValueError(f"{name}: tree must be a node budget (int) or a tuple of paths, got {tree!r}.")
    if isinstance(tree, (int, np.integer)):
        if tree < 0:
            raise ValueError(f"{name}: the tree budget must be >= 0 nodes (0 = a chain), got {tree}.")
        if static_ok and tree and best_first_room(int(tree), k) < tree:  # a best-first tree over K positions
            raise ValueError(f"{name}: a tree of {tree} nodes over K={k} draft position(s) holds at most "
                             f"{best_first_room(int(tree), k)} distinct nodes; lower the tree budget or raise K.")
        return
    if not static_ok:
        raise ValueError(
            f"{name} builds its own trees from a node budget; pass tree=N (an int), not a list of "
            "paths (static trees need per-position distributions: DFlash, Medusa)."
        )
    paths = [tuple(p) for p in tree]
    if not paths or any(len(p) == 0 for p in paths):
        raise ValueError(f"{name}: a static tree needs at least one non-empty path, got {tree!r}.")
    if len(set(paths)) != len(paths):
        raise ValueError(f"{name}: the static tree lists a path twice.")
    known = set(paths)
    for p in paths:
        if any((not isinstance(r, (int, np.integer))) or r < 0 for r in p):
            raise ValueError(f"{name}: path {p} must list candidate ranks (ints >= 0).")
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"{name}: path {p} needs its parent path {p[:-1]} in the tree too.")
        if len(p) > k:
            raise ValueError(f"{name}: path {p} is deeper than K={k}; raise K or shorten the path.")


def tree_budget(tree: TreeSetting) -> int:
    """The number of draft nodes a `tree` setting verifies per step (0 = a chain)."""
    if isinstance(tree, (int, np.integer)):
        return int(tree)
    return len(tuple(tree))


def with_root(tree: TreeDraft, root_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (the verify pass's tokens [B, N+1], parents [B, N+1] with the root's parent -1)."""
    tokens = jnp.concatenate([root_tokens[:, None].astype(jnp.int32), tree.tokens], axis=1)
    minus_one = jnp.full((tree.parents.shape[0], 1), -1, jnp.int32)
    return tokens, jnp.concatenate([minus_one, tree.parents.astype(jnp.int32)], axis=1)


def chain_tree(drafts: jax.Array) -> TreeDraft:
    """A chain of drafts [B, K] as a tree: node i's parent is node i - 1."""
    batch, k = drafts.shape
    parents = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
    return TreeDraft(tokens=drafts.astype(jnp.int32), parents=parents)


TOP_K_CHUNK = 128  # the two-stage top-k's chunk of the last axis


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k`, equal in values and indices (ties to the lower index), kept a top-k. On
    CPU and CUDA a wide last axis (a vocabulary) goes in two stages: over 16 x 151936, XLA:CPU's
    top-k took 2.5-9 ms where the two stages take 0.2, and on an H100 0.143 ms against 0.051
    (RESULTS.md, issue 46). TPUs keep XLA's, which nothing here has timed. Without the barrier
    XLA:CPU folds the gathers that later read (values, indices) into the sort that top_k expands
    to, which then sorts the whole last axis."""
    if x.shape[-1] % TOP_K_CHUNK or x.shape[-1] < 32 * TOP_K_CHUNK or k > 8 * TOP_K_CHUNK:
        return jax.lax.optimization_barrier(jax.lax.top_k(x, k))
    return jax.lax.optimization_barrier(jax.lax.platform_dependent(
        x, cpu=lambda x: chunked_top_k(x, k), cuda=lambda x: chunked_top_k(x, k),
        default=lambda x: tuple(jax.lax.top_k(x, k))))


def chunked_top_k(x: jax.Array, k: int, chunk: int = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """Exact top-k in two stages: the k chunks with the largest maxima, then the top k of their
    k * chunk entries (kept in index order, so ties still go to the lower index). Exact because
    an entry outside those chunks has k chunk maxima at or before it in (value desc, index asc)
    order. The last axis must be a multiple of `chunk`, with at least k chunks."""
    *lead, width = x.shape
    chunks = x.reshape(*lead, width // chunk, chunk)
    _, best = jax.lax.top_k(chunks.max(axis=-1), k)  # [..., k] chunk ids
    best = jnp.sort(best, axis=-1)  # index order: a tie between chunks goes to the lower one
    candidates = jnp.take_along_axis(chunks, best[..., None], axis=-2).reshape(*lead, k * chunk)
    values, at = jax.lax.top_k(candidates, k)
    index = (best[..., None] * chunk + jnp.arange(chunk, dtype=best.dtype)).reshape(*lead, k * chunk)
    return values, jnp.take_along_axis(index, at, axis=-1)


def best_first_levels(budget: int, depth: int, width: int = 8) -> list[int]:
    """How many nodes each level of a best-first tree keeps as candidates: the `budget` best
    children of the previous level's, down to depth min(depth, budget)."""
    width = min(width, budget)
    return [min(budget, width ** (d + 1)) for d in range(min(depth, budget))]


def best_first_room(budget: int, depth: int, width: int = 8) -> int:
    """The most distinct nodes a best-first tree over `depth` positions can hold (vocabularies of
    at least `width` tokens)."""
    return sum(best_first_levels(budget, depth, width))


def best_first_tree(logprobs: jax.Array, budget: int, width: int = 8) -> TreeDraft:
    """DDTree-style best-first tree over independent per-position distributions.

    logprobs [B, D, V]: the drafter's log-probabilities for depths 1..D (a block drafter's one
    pass, or Medusa's heads). A node's score is the sum of its path's log-probabilities; the tree
    is the `budget` highest-scoring prefixes, best first (ties: shallower, then earlier in the
    level's order below), siblings in rank order. Candidates are the top `width` tokens per depth
    (deterministic, distinct).

    Built level by level, not node by node: a node's parent scores at least as high, so a node of
    the best `budget` has its parent among them, and is among the `budget` best children of the
    previous level's `budget` best. One top-k per level over budget x width candidates, then one
    sort of the levels' nodes (`select_best_nodes`). A loop taking one node at a time ran ~30
    small kernels per node on the GPU: a tree of 32 cost 934 more kernels a step than the chain
    on the H100 (RESULTS.md, issue 46)."""
    batch, depth, _ = logprobs.shape
    width = min(width, budget, logprobs.shape[-1])
    sizes = best_first_levels(budget, depth, width)  # a node at depth d has d - 1 ancestors in the tree
    if sum(sizes) < budget:
        raise ValueError(f"a best-first tree of {budget} nodes needs more candidates than {len(sizes)} depth(s) "
                         f"of {width} tokens give ({sum(sizes)}): lower the tree budget or raise the width")
    top_lp, top_tokens = top_k(logprobs.astype(jnp.float32), width)  # [B, D, W]
    # Level 1: the root's children. Each level's nodes are in (score desc, parent, rank) order;
    # a level only needs the previous one's scores, so tokens and parents are gathered once below.
    scores = top_lp[:, 0, :sizes[0]]
    all_scores, picks = [scores], [jnp.broadcast_to(jnp.arange(sizes[0], dtype=jnp.int32), (batch, sizes[0]))]
    for d in range(1, len(sizes)):
        children = (scores[:, :, None] + top_lp[:, d, None, :]).reshape(batch, -1)  # [B, n * W]
        scores, flat = jax.lax.top_k(children, sizes[d])  # ties: the earlier parent, then the lower rank
        all_scores.append(scores)
        picks.append(flat.astype(jnp.int32))  # parent * W + rank
    level = np.repeat(np.arange(len(sizes)), sizes)  # each node's depth - 1
    first_of_level = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pick = jnp.concatenate(picks, axis=1)  # [B, M]
    parents = jnp.where(level == 0, -1, first_of_level[np.maximum(level - 1, 0)] + pick // width)
    tokens = top_tokens[jnp.arange(batch)[:, None], level, jnp.where(level == 0, pick, pick % width)]
    depths = jnp.broadcast_to(jnp.asarray(level + 1, jnp.int32), (batch, len(level)))
    return select_best_nodes(tokens, parents.astype(jnp.int32), jnp.concatenate(all_scores, axis=1), depths,
                             budget)


def static_tree_arrays(paths: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Paths (candidate ranks per depth) -> (depth-1 [N], rank [N], parent in-pass index [N]) in
    an order where parents come first (by depth, then as listed)."""
    ordered = sorted((tuple(p) for p in paths), key=len)
    index = {p: i + 1 for i, p in enumerate(ordered)}
    depth = np.asarray([len(p) - 1 for p in ordered], np.int32)
    rank = np.asarray([p[-1] for p in ordered], np.int32)
    parent = np.asarray([index[p[:-1]] if len(p) > 1 else 0 for p in ordered], np.int32)
    return depth, rank, parent


def static_tree(logprobs: jax.Array, paths: Sequence[Sequence[int]]) -> TreeDraft:
    """A fixed tree shape (Medusa / Sequoia style) filled from per-position distributions
    logprobs [B, D, V]: the node at path (r_1, .., r_d) takes the rank-r_d token at depth d."""
    depth, rank, parent = static_tree_arrays(paths)
    width = int(rank.max()) + 1
    _, top_tokens = top_k(logprobs.astype(jnp.float32), width)  # [B, D, W]
    batch = logprobs.shape[0]
    tokens = top_tokens[:, depth, rank]  # [B, N]
    return TreeDraft(tokens=tokens.astype(jnp.int32),
                     parents=jnp.broadcast_to(jnp.asarray(parent), (batch, len(parent))))


def tree_from_logprobs(logprobs: jax.Array, tree: TreeSetting, width: int = 8) -> TreeDraft:
    """A drafter's `tree` setting over per-position distributions: best-first for a budget,
    the given shape for a tuple of paths."""
    if isinstance(tree, (int, np.integer)):
        return best_first_tree(logprobs, int(tree), width)
    return static_tree(logprobs, tree)


def branch_first(tree: TreeDraft, branch: jax.Array, use_branch: jax.Array) -> TreeDraft:
    """Put a chain `branch` [B, K] (a lookup's drafts) first, as the root's first child, and keep
    the tree's first N - K nodes behind it, for rows where `use_branch` [B]; the tree is
    unchanged elsewhere. Needs N > K and a deterministic tree (a point-mass branch among sampled
    siblings would mix proposal distributions). The first nodes of a tree are a tree."""
    if tree.probs is not None:
        raise ValueError("a lookup branch goes only in front of a deterministic tree")
    k = branch.shape[1]
    keep = tree.budget - k
    chain = chain_tree(branch)
    shifted_parents = jnp.where(tree.parents[:, :keep] > 0, tree.parents[:, :keep] + k, 0)
    tokens = jnp.concatenate([chain.tokens, tree.tokens[:, :keep]], axis=1)
    parents = jnp.concatenate([chain.parents, shifted_parents], axis=1)
    use = use_branch[:, None]
    return TreeDraft(tokens=jnp.where(use, tokens, tree.tokens),
                     parents=jnp.where(use, parents, tree.parents))


def expansion_width(budget: int, depth: int) -> int:
    """Frontier width of an EAGLE-2-style expansion with a node budget and a depth of K: enough
    nodes per level that the best `budget` can spread over the levels (2..8)."""
    return int(min(8, max(2, -(-budget // depth) + 1)))


def expand_level(scores: jax.Array, frontier: jax.Array, level_logprobs: jax.Array, width: int):
    """One EAGLE-2 expansion level: the top-`width` children of each frontier node, of which the
    `width` best by path score are kept.

    scores [B, M] path log-probabilities of the nodes so far; frontier [B, F] the node indices
    (into the node list) being expanded; level_logprobs [B, F, V] their children's log-probs.
    -> (new tokens [B, width], their parents' node indices [B, width], their scores [B, width])."""
    batch, f, _ = level_logprobs.shape
    child_lp, child_tok = top_k(level_logprobs.astype(jnp.float32), width)  # [B, F, W]
    rows = jnp.arange(batch)[:, None]
    parent_score = scores[rows, frontier]  # [B, F]
    cand = (parent_score[:, :, None] + child_lp).reshape(batch, f * width)
    best, idx = top_k(cand, width)
    return child_tok.reshape(batch, f * width)[rows, idx], frontier[rows, idx // width], best


def select_best_nodes(tokens: jax.Array, parents: jax.Array, scores: jax.Array, depths: jax.Array,
                      budget: int) -> TreeDraft:
    """The `budget` best of the generated nodes by path score, as a tree in insertion order.

    tokens, parents (node-list indices, -1 = the root), scores, depths: [B, M] generated nodes.
    A node's parent scores at least as high and is shallower, so sorting by (score desc, depth)
    puts parents first and the best `budget` are closed under taking parents."""
    batch, m = tokens.shape
    rows = jnp.arange(batch)[:, None]
    order = jnp.lexsort((depths, -scores), axis=-1)[:, :budget]  # [B, N] node-list indices
    new_index = jnp.zeros((batch, m), jnp.int32).at[rows, order].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    kept_parents = parents[rows, order]
    return TreeDraft(
        tokens=tokens[rows, order].astype(jnp.int32),
        parents=jnp.where(kept_parents >= 0, new_index[rows, jnp.maximum(kept_parents, 0)], 0),
    )


def expand_tree(step: Any, root_token: jax.Array, root_state: jax.Array, depth: int, budget: int) -> TreeDraft:
    """An EAGLE-2-style tree for a drafter whose nodes need only their parent's chained state
    (no attention among the nodes): the root's top-W children, then level by level the top-W
    children of the W frontier nodes, keeping the W best by path log-probability (W from the
    budget and the depth, `expansion_width`); the `budget` best nodes of all levels form the tree
    (top-k candidates: deterministic).
    step(tokens [B, T], states [B, T, S]) -> (log-probs [B, T, V] of their children, the states
    [B, T, S] their children continue from); root_token [B, 1], root_state [B, 1, S]."""
    width = expansion_width(budget, depth)
    batch = root_token.shape[0]
    rows = jnp.arange(batch)[:, None]
    root_logprobs, root_next = step(root_token, root_state)
    node_scores, node_tokens = top_k(root_logprobs[:, 0].astype(jnp.float32), width)  # the root's children
    node_parents = jnp.full((batch, width), -1, jnp.int32)
    node_depths = jnp.ones((batch, width), jnp.int32)
    parent_states = jnp.broadcast_to(root_next, (batch, width, root_next.shape[-1]))
    fed_states = []  # the state each node's children read, in node order
    for level in range(1, depth):
        frontier = (level - 1) * width + jnp.arange(width)  # this level's nodes
        level_logprobs, level_states = step(node_tokens[:, (level - 1) * width:], parent_states)
        fed_states.append(level_states)
        new_tok, new_parent, new_score = expand_level(
            node_scores, jnp.broadcast_to(frontier, (batch, width)), level_logprobs, width
        )
        parent_states = jnp.concatenate(fed_states, axis=1)[rows, new_parent]
        node_depths = jnp.concatenate([node_depths, node_depths[rows, new_parent] + 1], axis=1)
        node_tokens = jnp.concatenate([node_tokens, new_tok], axis=1)
        node_parents = jnp.concatenate([node_parents, new_parent], axis=1)
        node_scores = jnp.concatenate([node_scores, new_score], axis=1)
    return select_best_nodes(node_tokens, node_parents, node_scores, node_depths, budget)
