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
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

Params = Any
Cache = Any


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
        indices), move those nodes' keys/values to contiguous slots first."""
        ...

    def weight_specs(self) -> Any:
        """The WeightSpec tree of the params (`spec_jax.models.weights`), or None: then a mesh
        run leaves placing the params to the user."""
        ...


@struct.dataclass
class Target:
    """A target model (static) with its params (traced): what the loop and drafters hold.

    Drafters reach the target's embedding and head only through `embed` and `logits`."""

    params: Params
    model: TargetModel = struct.field(pytree_node=False)

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
    """parents [B, N] (node i's parent index, < i; the root's is -1) -> [B, N, N] bool: node i
    sees node j when j is i or one of its ancestors (the in-pass mask of a token tree)."""
    batch, n = parents.shape
    nodes = jnp.arange(n)
    mask = jnp.broadcast_to(nodes[:, None] == nodes[None, :], (batch, n, n))
    ancestor = parents  # [B, N]: each node's ancestor one more generation up per iteration
    for _ in range(n - 1):
        mask = mask | ((ancestor[:, :, None] == nodes) & (ancestor[:, :, None] >= 0))
        up = jnp.take_along_axis(parents, jnp.maximum(ancestor, 0), axis=1)
        ancestor = jnp.where(ancestor >= 0, up, -1)
    return mask
