"""Batch placement on a mesh, and bringing outputs back to the host.

The loop's own inputs are placed by `spec_jax.decoding.placement.place_generate_inputs`, built on
these pieces; this package never imports the loop.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

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
    """numpy copy of a tree of (possibly multi-process) arrays; every process gets all of it."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
