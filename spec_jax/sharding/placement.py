"""Placing the jitted loop's arguments on a mesh, and bringing its outputs back.

`generate(..., mesh=mesh)` calls `place_generate_inputs` before compiling: target and drafter params
follow their WeightSpec trees, prompts and prompt lengths are split over `data`, the rest
(PRNG key, sampling values, caps, stop ids) is replicated. With every argument committed to the
mesh, XLA propagates those shardings through prefill and the while loop: the KV caches come out
[B/data, Kv/model, S, D] per layer and device without any constraint inside the loop.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spec_jax.decoding.loop import LoopInputs
from spec_jax.models.config import ModelConfig
from spec_jax.models.weights import model_weight_specs
from spec_jax.sharding.rules import (
    DEFAULT_RULES,
    ShardingRules,
    drafter_weight_specs,
    logical_to_partition_spec,
    place,
    replicated_sharding,
    shard_params,
)

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


def place_generate_inputs(
    inputs: LoopInputs,
    cfg: ModelConfig,
    drafter: Any,
    mesh: Mesh,
    rules: ShardingRules | None = None,
) -> LoopInputs:
    """The loop's inputs with every leaf committed to `mesh`: weights per their WeightSpec trees
    (the drafter's from its own `weight_specs()`), prompts over the batch rule, the rest replicated."""
    rules = rules or DEFAULT_RULES
    rep = replicated_sharding(mesh)
    drafter_specs = drafter_weight_specs(drafter)
    if inputs.drafter_params is not None and drafter_specs is None and jax.tree_util.tree_leaves(
        inputs.drafter_params
    ):
        logger.info("Sharding: drafter %s has no weight specs; its params are replicated.",
                    type(drafter).__name__)
    lengths = inputs.prompt_lengths
    lengths_sharding = NamedSharding(
        mesh, logical_to_partition_spec(tuple(np.shape(lengths)), ("batch",), mesh, rules)
    )
    return LoopInputs(
        target_params=shard_params(inputs.target_params, model_weight_specs(cfg), mesh, rules),
        drafter_params=shard_params(inputs.drafter_params, drafter_specs, mesh, rules),
        prompt_tokens=place(
            inputs.prompt_tokens, batch_sharding(mesh, rules, tuple(np.shape(inputs.prompt_tokens)))
        ),
        prompt_lengths=place(lengths, lengths_sharding),
        key=place(inputs.key, rep),
        sampling=jax.tree_util.tree_map(lambda x: place(x, rep), inputs.sampling),
        max_new_tokens=place(inputs.max_new_tokens, rep),
        stop_ids=place(inputs.stop_ids, rep),
    )


def gather_to_host(tree: Any) -> Any:
    """numpy copy of a tree of (possibly multi-process) arrays; every process gets all of it."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
