"""Placing the jitted loop's arguments on a mesh, and bringing its outputs back.

`generate(..., mesh=mesh)` calls `place_generate_args` before compiling: target and drafter params
follow their WeightSpec trees, prompts and prompt lengths are split over `data`, the rest
(PRNG key, sampling values, caps, stop ids) is replicated. With every argument committed to the
mesh, XLA propagates those shardings through prefill and the while loop: the KV caches come out
[L, B/data, Kv/model, S, D] per device without any constraint inside the loop.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

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


def place_generate_args(
    args: tuple,
    cfg: ModelConfig,
    drafter: Any,
    mesh: Mesh,
    rules: ShardingRules | None = None,
) -> tuple:
    """(target_params, drafter_params, prompt_tokens, prompt_lengths, key, sampling,
    max_new_tokens, stop_ids) -> the same, every leaf committed to `mesh`."""
    rules = rules or DEFAULT_RULES
    (params, drafter_params, prompt_tokens, prompt_lengths, key, sampling, max_new, stop) = args
    rep = replicated_sharding(mesh)
    params = shard_params(params, model_weight_specs(cfg), mesh, rules)
    drafter_specs = drafter_weight_specs(drafter)
    if drafter_params is not None and drafter_specs is None and jax.tree_util.tree_leaves(
        drafter_params
    ):
        logger.info("Sharding: drafter %s has no weight specs; its params are replicated.",
                    type(drafter).__name__)
    drafter_params = shard_params(drafter_params, drafter_specs, mesh, rules)
    tokens_sharding = batch_sharding(mesh, rules, tuple(np.shape(prompt_tokens)))
    prompt_tokens = place(prompt_tokens, tokens_sharding)
    prompt_lengths = place(
        prompt_lengths, NamedSharding(mesh, logical_to_partition_spec(
            tuple(np.shape(prompt_lengths)), ("batch",), mesh, rules))
    )
    key = place(key, rep)
    sampling = jax.tree_util.tree_map(lambda x: place(x, rep), sampling)
    return (params, drafter_params, prompt_tokens, prompt_lengths, key, sampling,
            place(max_new, rep), place(stop, rep))


def gather_to_host(tree: Any) -> Any:
    """numpy copy of a tree of (possibly multi-process) arrays; every process gets all of it."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
