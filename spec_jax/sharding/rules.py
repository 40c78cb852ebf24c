"""Partition rules as data: logical axis names -> mesh axes, and the shardings derived from them.

Every weight is described once as a `WeightSpec(shape, axes, init)` (spec_jax.models.weights) whose
`axes` are logical names. `ShardingRules` maps each logical name to a mesh axis (or None =
replicated); `param_shardings` turns a whole WeightSpec tree into a `NamedSharding` tree. Caches
and the loop state get their shardings from the same rules via their own logical axes.

A dimension that does not divide its mesh axis (SmolLM2's 9 query / 3 KV heads on model=4) is
replicated on that axis instead, and `param_shardings` logs one note listing every such weight.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spec_jax.models.decoder import KVCache
from spec_jax.models.weights import WeightSpec, is_spec

logger = logging.getLogger(__name__)

# Logical axes of one layer's KV cache k/v [B, Kv, S, D] and of its lengths [B].
KV_CACHE_AXES = ("batch", "kv_heads", "sequence", "head_dim")  # the KVCache layout
KV_LENGTHS_AXES = ("batch",)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axis each logical axis is split over (None = replicated).

    Defaults: Megatron-style tensor parallelism over `model` (vocabulary, query and KV heads, MLP
    width) and data parallelism over `data` (batch rows). Model width (`embed`), `head_dim` and
    the cache `sequence` axis stay whole on every device.
    """

    batch: str | None = "data"
    sequence: str | None = None
    vocab: str | None = "model"
    embed: str | None = None
    q_heads: str | None = "model"
    kv_heads: str | None = "model"
    head_dim: str | None = None
    mlp: str | None = "model"
    # A MoE layer's experts (whole experts per device; docs/sharding.md says why `model`).
    expert: str | None = "model"

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        if logical not in _LOGICAL_AXES:
            raise ValueError(
                f"Unknown logical axis {logical!r}; ShardingRules knows {sorted(_LOGICAL_AXES)}."
            )
        return getattr(self, logical)


_LOGICAL_AXES = frozenset(f.name for f in dataclasses.fields(ShardingRules))
DEFAULT_RULES = ShardingRules()


def logical_to_partition_spec(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    mesh: Mesh,
    rules: ShardingRules,
    replicated: list[str] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` with logical `axes`.

    A dim is split over its rule's mesh axis only when that axis is in the mesh, has size > 1,
    is not already used by an earlier dim, and divides the dim; otherwise it is replicated and,
    when the axis was wanted but does not divide, described in `replicated`.
    """
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
    used: set[str] = set()
    out: list[str | None] = []
    for dim, (size, logical) in enumerate(zip(shape, axes)):
        mesh_axis = rules.mesh_axis(logical)
        if mesh_axis is None or mesh_axis not in mesh.shape or mesh_axis in used:
            out.append(None)
            continue
        parts = mesh.shape[mesh_axis]
        if parts == 1:
            out.append(None)
            continue
        if size % parts:
            out.append(None)
            if replicated is not None:
                replicated.append(f"dim {dim} ({logical}={size}) over {mesh_axis}={parts}")
            continue
        used.add(mesh_axis)
        out.append(mesh_axis)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def param_shardings(specs: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """NamedSharding tree with the structure of the WeightSpec tree `specs`.

    Dims that do not divide their mesh axis are replicated, with one log note for the whole tree.
    """
    notes: list[str] = []

    def one(path, spec: WeightSpec) -> NamedSharding:
        replicated: list[str] = []
        pspec = logical_to_partition_spec(spec.shape, spec.axes, mesh, rules, replicated)
        if replicated:
            notes.append(f"{jax.tree_util.keystr(path)} {spec.shape}: " + ", ".join(replicated))
        return NamedSharding(mesh, pspec)

    out = jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)
    if notes:
        message = (
            f"Sharding: {len(notes)} weight(s) have dims that do not divide their mesh axis and "
            "are replicated on it (correct, but those weights take full memory on every "
            "device): " + "; ".join(notes)
        )
        # One note per distinct model and mesh, not one per generate call.
        if message not in _LOGGED_NOTES:
            _LOGGED_NOTES.add(message)
            logger.warning(message)
    return out


_LOGGED_NOTES: set[str] = set()


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_params(
    params: Any, specs: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """Place `params` on `mesh` as `specs` (a WeightSpec tree of the same structure) says.

    specs=None replicates every leaf (weights without a spec tree, e.g. a third-party drafter).
    """
    if params is None:
        return None
    if specs is None:
        return jax.tree_util.tree_map(lambda x: place(x, replicated_sharding(mesh)), params)
    shardings = param_shardings(specs, mesh, rules)
    try:
        return jax.tree_util.tree_map(place, params, shardings)
    except ValueError as e:
        raise ValueError(
            f"params do not have the structure of their weight specs ({e}); check the model config."
        ) from None


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Put one array (numpy or jax, any device) onto `sharding`, also across processes."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = place(jax.random.key_data(x), NamedSharding(sharding.mesh, PartitionSpec()))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if sharding.is_fully_addressable and (
        not isinstance(x, jax.Array) or x.is_fully_addressable
    ):
        return jax.device_put(x, sharding)
    # Multi-process: every process holds the full value; each fills its own shards.
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# ----------------------------------------------------------------------------- caches and state
def kv_cache_shardings(
    mesh: Mesh,
    rules: ShardingRules = DEFAULT_RULES,
    *,
    batch: int,
    num_kv_heads: int,
    num_layers: int = 1,
    capacity: int = 1,
    head_dim: int = 1,
) -> KVCache:
    """KVCache of NamedShardings: each layer's k/v [B, Kv, S, D] batch over data, KV heads over
    model (each only when it divides), lengths [B] batch over data."""
    kv_shape = (batch, num_kv_heads, capacity, head_dim)
    kv = NamedSharding(mesh, logical_to_partition_spec(kv_shape, KV_CACHE_AXES, mesh, rules))
    lengths = NamedSharding(
        mesh, logical_to_partition_spec((batch,), KV_LENGTHS_AXES, mesh, rules)
    )
    return KVCache(k=(kv,) * num_layers, v=(kv,) * num_layers, lengths=lengths)


def state_shardings(abstract_state: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """Shardings for a loop or drafter state given as arrays or ShapeDtypeStructs.

    Every KVCache inside (the target's, a draft model's) gets `kv_cache_shardings`; every other
    array whose leading dim is the batch gets the batch rule on that dim; the rest is replicated.
    The batch is read from the first KVCache's `lengths` or, without one, from `tokens`.
    """
    batch = _find_batch(abstract_state)

    def one(x: Any) -> Any:
        if isinstance(x, KVCache):
            # Layer by layer: Gemma 4's full-attention layers have their own KV heads and head size.
            layers = [kv_cache_shardings(mesh, rules, batch=b, num_kv_heads=kv_heads, capacity=capacity,
                                         head_dim=head_dim) for b, kv_heads, capacity, head_dim in
                      (k.shape for k in x.k)]
            kv = tuple(layer.k[0] for layer in layers)
            return layers[0].replace(k=kv, v=kv)
        shape = tuple(getattr(x, "shape", ()))
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            return replicated_sharding(mesh)  # PRNG keys (the engine's one per row) go whole, as `place` puts them
        if shape and batch is not None and shape[0] == batch:
            axes = ("batch",) + (None,) * (len(shape) - 1)
            return NamedSharding(mesh, logical_to_partition_spec(shape, axes, mesh, rules))
        return replicated_sharding(mesh)

    return jax.tree_util.tree_map(one, abstract_state, is_leaf=lambda x: isinstance(x, KVCache))


def _find_batch(tree: Any) -> int | None:
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, KVCache)):
        if isinstance(leaf, KVCache):
            return int(leaf.lengths.shape[0])
    tokens = getattr(tree, "tokens", None)
    if tokens is not None:
        return int(tokens.shape[0])
    return None


def drafter_weight_specs(drafter: Any) -> Any:
    """The WeightSpec tree of a drafter's params (its own `weight_specs()`), None without one."""
    return None if drafter is None else drafter.weight_specs()


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes each device holds for a tree of jax arrays (addressable shards only)."""
    out: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
