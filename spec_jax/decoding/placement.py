"""Placing the jitted loop's arguments on a mesh.

`generate(..., mesh=mesh)` calls `place_generate_inputs` before compiling: target and drafter params
follow their WeightSpec trees, prompts and prompt lengths are split over `data`, the rest
(PRNG key, sampling values, caps, stop ids, the adaptive depth's costs) is replicated. With every
argument committed to the mesh, XLA propagates those shardings through prefill and the while
loop: the KV caches come out [B/data, Kv/model, S, D] per layer and device without any
constraint inside the loop.

This sits in `decoding` (it knows the loop's inputs) and uses `spec_jax.sharding`'s rules; the
sharding package never imports the loop.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spec_jax.decoding.loop import LoopInputs
from spec_jax.models.interface import TargetModel
from spec_jax.sharding.placement import batch_sharding
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


def place_generate_inputs(
    inputs: LoopInputs,
    model: TargetModel,
    drafter: Any,
    mesh: Mesh,
    rules: ShardingRules | None = None,
) -> LoopInputs:
    """The loop's inputs with every leaf committed to `mesh`: weights per their WeightSpec trees
    (the target's from `model.weight_specs()`, the drafter's from its own `weight_specs()`),
    prompts over the batch rule, the rest replicated. A target model without weight specs keeps
    its params as the caller placed them."""
    rules = rules or DEFAULT_RULES
    rep = replicated_sharding(mesh)
    target_specs = model.weight_specs()
    if target_specs is None:
        logger.info("Sharding: target %s has no weight specs; its params stay where they are.",
                    type(model).__name__)
        target_params = inputs.target_params
    else:
        target_params = shard_params(inputs.target_params, target_specs, mesh, rules)
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
        target_params=target_params,
        drafter_params=shard_params(inputs.drafter_params, drafter_specs, mesh, rules),
        prompt_tokens=place(
            inputs.prompt_tokens, batch_sharding(mesh, rules, tuple(np.shape(inputs.prompt_tokens)))
        ),
        prompt_lengths=place(lengths, lengths_sharding),
        key=place(inputs.key, rep),
        sampling=jax.tree_util.tree_map(lambda x: place(x, rep), inputs.sampling),
        max_new_tokens=place(inputs.max_new_tokens, rep),
        stop_ids=place(inputs.stop_ids, rep),
        depth_costs=None if inputs.depth_costs is None else place(inputs.depth_costs, rep),
    )
