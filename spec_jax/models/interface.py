"""The target interface: what the loop, the drafters, sharding and training may ask of a model.

A target is a static, hashable model object (a `jax.jit` static argument) plus a params pytree
that travels separately. spec_jax's own decoder (`spec_jax.models.Decoder`) is one implementation;
a user's Flax NNX / Linen or plain-JAX model is another (docs/bring_your_own_model.md), checked
with `spec_jax.testing.check_target`. This module is the contract only: it imports no
implementation (`spec_jax.models.resolve` turns what users pass into a `Target`).

The cache contract (one pass = one call of `forward`):

- A cache has a fixed capacity and a per-row committed length `lengths[B]` (`cache_lengths`).
- A pass over `tokens [B, T]` at `positions [B, T]` writes its T keys/values into each row's
  slots `lengths .. lengths + T - 1` (slot = index in the pass; position = the RoPE position,
  equal to the slot for a chain, `start + depth` for a token tree). It leaves `lengths` alone.
- Query t of a row sees the row's committed slots (`< lengths`, within the layer's window) plus
  the pass's own tokens j with `mask[b, t, j]`: lower-triangular for a chain of drafts (the
  default, `mask=None`), an ancestor mask for a token tree. Tree verification is a change of
  mask, not of model.
- `commit(cache, lengths, path)` sets the committed lengths. For a chain it is length arithmetic
  (rejected drafts are rolled back by a shorter length; a draft model re-feeding tokens rewinds
  the same way). For a tree, `path [B, P]` names the accepted nodes (in-pass indices, root
  first); their keys/values move from slot `old + path[b, i]` to `old + i` first, with fixed
  shapes, so the committed slots stay contiguous.
- Recurrent layers (`spec_jax.models.recurrent`) may keep a state per row instead of, or beside,
  keys/values. A pass then also returns, in its cache, a pass record: what commit needs to
  rebuild the state after any of the pass's tokens (e.g. the state after each token). A row
  commits n = lengths - old of the pass's tokens; commit sets its state to the one after the
  last of them (pass index n - 1 for a chain, node path[b, n - 1] for a tree; n = 0 keeps the
  state from before the pass) and drops the record, so the committed cache has `init_cache`'s
  structure. In a tree pass each node continues its parent's state. Lengths only grow across
  commits for such a model (no rewinding below a committed length), so it cannot be the
  draft-model drafter's draft model (that drafter rewinds).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

Params = Any
Cache = Any


# A capture id for the final-normed hidden states (what `forward` returns as `hidden`, the LM head's
# input; HF `hidden_states[-1]`). The loop answers it itself, so a target never sees it.
FINAL_HIDDEN = -1


class ForwardOutput(NamedTuple):
    """hidden:   [B, T, H] final-normed hidden states (`logits(params, hidden)` gives the logits)
    captured: [B, T, len(capture) * H] the hidden states after each requested layer
              (HF `hidden_states[id + 1]`), concatenated in the requested order, or None
    cache:    the cache with this pass's keys/values written (committed lengths unchanged)"""

    hidden: jax.Array
    captured: jax.Array | None
    cache: Cache


@runtime_checkable
class TargetModel(Protocol):
    """A model the speculative loop can verify with. Frozen and hashable: keep only static
    configuration on it, never arrays (params travel separately)."""

    vocab_size: int  # logits width
    hidden_size: int  # width of `hidden` and of each captured layer
    num_layers: int  # capture ids are 0 .. num_layers - 1
    max_positions: int  # positions must stay below this
    stop_ids: tuple[int, ...]  # default stop ids (EOS); generate's `stop_ids` overrides them

    def init_cache(self, batch: int, capacity: int) -> Cache:
        """An empty cache (all lengths 0) for `batch` rows of `capacity` slots."""
        ...

    def cache_lengths(self, cache: Cache) -> jax.Array:
        """[B] int32 committed lengths."""
        ...

    def forward(
        self,
        params: Params,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32
        cache: Cache,
        *,
        mask: jax.Array | None = None,  # [B, T, T] bool in-pass visibility; None = causal chain
        capture: Sequence[int] = (),
    ) -> ForwardOutput: ...

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        """Hidden states [..., H] -> float32 logits [..., V]."""
        ...

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Token ids [...] -> input embeddings [..., H] (any scaling the model applies included)."""
        ...

    def commit(self, cache: Cache, lengths: jax.Array, path: jax.Array | None = None) -> Cache:
        """Set the committed lengths [B]; with `path` [B, P] (a tree's accepted nodes, in-pass
        indices), move those nodes' keys/values to contiguous slots first. Recurrent layers take
        the state after each row's last committed token from the pass record."""
        ...

    def weight_specs(self) -> Any:
        """The WeightSpec tree of the params (`spec_jax.models.weights`), or None: then a mesh
        run leaves placing the params to the user."""
        ...


class LayerKV(NamedTuple):
    """One target layer's keys/values as its cache holds them (`CacheReader.cache_view`).

    k, v:    [B, Kv, S, D] the cache's own arrays (S = capacity): committed slot j of row b
             (j < lengths[b]) holds position j's key (after any k-norm and RoPE) and value
    lengths: [B] int32 committed slots per row
    window:  the layer's attention window in tokens (static; a huge number for full attention)
    page_table: None, or (a paged cache, `spec_jax.models.paged`) [B, pages_per_row] with k, v
             page pools [P, Kv, page, D]: pass it on to `attend_cache_and_pass`"""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    window: int
    page_table: jax.Array | None = None


@runtime_checkable
class CacheReader(Protocol):
    """Reading the target's cache: what a target adds (optionally) for drafters that attend to its
    own keys/values instead of keeping a cache (Gemma 4's assistant). Such a drafter names target
    layers by attention type ("the last sliding and the last full attention layer":
    `last_layer_of_type`) and, during `propose`, reads them through `Target.cache_view(layer)`:
    the cache's own arrays for that layer (a view inside the jitted loop, never a copy) with the
    committed lengths. A target that does not offer it is refused by name before anything
    compiles (`require_cache_reader`); `spec_jax.testing.check_target` checks it where offered."""

    layer_types: tuple[str, ...]  # per layer: "full_attention" or "sliding_attention"

    def cache_view(self, cache: Cache, layer: int) -> LayerKV:
        """The keys/values layer `layer` attends to (for a layer that reuses another layer's,
        that layer's), as the cache's arrays: no copy, no slicing by length."""
        ...


def last_layer_of_type(model: CacheReader, layer_type: str) -> int:
    """The index of the target's last layer of `layer_type`; ValueError if it has none."""
    types = tuple(model.layer_types)
    if layer_type not in types:
        raise ValueError(f"the target has no {layer_type} layer (its layer types: {sorted(set(types))}).")
    return len(types) - 1 - types[::-1].index(layer_type)


def require_cache_reader(model: Any, drafter: str, needs: str) -> CacheReader:
    """`model` if it offers `CacheReader`, else a ValueError naming the drafter that needs it."""
    if not isinstance(model, CacheReader):
        raise ValueError(
            f"{drafter} reads the target's cache ({needs}), and the target "
            f"{type(model).__name__} does not offer it: give the model `layer_types` and "
            "`cache_view(cache, layer)` (docs/bring_your_own_model.md, \"Drafters that read the "
            "target's cache\"), or pick a drafter that keeps its own state."
        )
    return model


@struct.dataclass
class Target:
    """A target model (static) with its params (traced): what the loop and drafters hold.

    Drafters reach the target's embedding and head only through `embed` and `logits`. During
    `propose` / `propose_tree` the loop also hands them the target's committed cache (`cache`),
    which a drafter reads through `cache_view` (None elsewhere)."""

    params: Params
    model: TargetModel = struct.field(pytree_node=False)
    cache: Cache = None

    def cache_view(self, layer: int) -> LayerKV:
        """Layer `layer`'s committed keys/values (`CacheReader.cache_view`), inside the loop."""
        if self.cache is None:
            raise ValueError("the target's cache is handed to drafters during propose only.")
        return self.model.cache_view(self.cache, layer)

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.model.embed(self.params, tokens)

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.model.logits(self.params, hidden)

    def forward(self, tokens, positions, cache, *, mask=None, capture=()) -> ForwardOutput:
        return self.model.forward(self.params, tokens, positions, cache, mask=mask, capture=capture)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


def chain_mask(length: int) -> jax.Array:
    """[1, T, T] lower-triangular: each token of a chain sees itself and the tokens before it."""
    return jnp.tril(jnp.ones((length, length), bool))[None]


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """parents [B, N] (node i's parent index, < i; a root's is -1) -> [B, N, N] bool: node i
    sees node j when j is i or one of its ancestors (the in-pass mask of a token tree).

    By pointer doubling: after k rounds each row holds the ancestors fewer than 2^k generations
    up, so ceil(log2 N) rounds cover the deepest path. A walk one generation per round took N - 1
    rounds of small dependent ops, each about a kernel on a GPU (RESULTS.md, issue 46)."""
    batch, n = parents.shape
    nodes = jnp.arange(n)
    rows = jnp.arange(batch)[:, None]
    mask = jnp.broadcast_to(nodes[:, None] == nodes[None, :], (batch, n, n))  # fewer than 1 generation up
    jump = parents.astype(jnp.int32)  # the ancestor 2^k generations up, -1 where there is none
    span = 1
    while span < n:
        mask = mask | (mask[rows, jnp.maximum(jump, 0)] & (jump >= 0)[:, :, None])
        jump = jnp.where(jump >= 0, jump[rows, jnp.maximum(jump, 0)], -1)
        span *= 2
    return mask


def tree_depths(mask: jax.Array) -> jax.Array:
    """An ancestor mask [B, N, N] -> each node's depth [B, N] (its ancestors; a root's is 0)."""
    return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
