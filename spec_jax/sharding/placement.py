"""Batch placement on a mesh, and bringing outputs back to the host.

The loop's own inputs are placed by `spec_jax.decoding.placement.place_generate_inputs`, built on
these pieces; this package never imports the loop.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spec_jax.sharding.rules import ShardingRules, logical_to_partition_spec

logger = logging.getLogger(__name__)


def batch_sharding(mesh: Mesh, rules: ShardingRules, shape: tuple[int, ...]) -> NamedSharding:
    """Leading dim over the batch rule (when it divides), the rest whole."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    replicated: list[str] = []
    spec = logical_to_partition_spec(shape, axes, mesh, rules, replicated)
    if replicated:
        logger.info(
            "Sharding: batch of %d rows does not divide %s; rows are replicated instead of split "
            "(pad the batch to a multiple to use data parallelism).", shape[0], replicated[0],
        )
    return NamedSharding(mesh, spec)


def gather_to_host(tree: Any) -> Any:
    """numpy copy of a tree of (possibly multi-process) arrays; every process gets all of it.
    With arrays spread over several processes this is a collective: every process must call it."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    spread = [i for i, x in enumerate(leaves) if not getattr(x, "is_fully_addressable", True)]
    if not spread:
        return jax.device_get(tree)
    # A process reads only its own devices' shards (np.asarray of a multi-process array raises), so
    # the spread leaves are first replicated onto every device, a collective across processes. One
    # program for the whole tree: multihost_utils.process_allgather compiles and runs one per leaf
    # (and stacks a host-local leaf from every process where this keeps it as it is).
    if all(isinstance(leaves[i].sharding, NamedSharding) for i in spread):
        everywhere = [NamedSharding(leaves[i].sharding.mesh, PartitionSpec()) for i in spread]
        gathered = jax.jit(_identity, out_shardings=everywhere)([leaves[i] for i in spread])
    else:
        from jax.experimental import multihost_utils

        gathered = [multihost_utils.process_allgather(leaves[i], tiled=True) for i in spread]
    for i, x in zip(spread, gathered):
        leaves[i] = x.addressable_data(0) if isinstance(x, jax.Array) else x
    return jax.device_get(jax.tree_util.tree_unflatten(treedef, leaves))


def _identity(x: Any) -> Any:
    return x
