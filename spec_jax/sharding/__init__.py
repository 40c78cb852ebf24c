"""Meshes and partition rules, as data.

    mesh = make_mesh("data=2,model=4")              # or make_mesh() for the default layout
    result = generate(target, prompts, mesh=mesh)   # the whole loop runs sharded

See docs/sharding.md.
"""

from spec_jax.sharding.distributed import initialize_distributed, is_main_process, main_print
from spec_jax.sharding.mesh import (
    MESH_AXES,
    default_mesh_shape,
    make_mesh,
    mesh_spec_string,
    parse_mesh_spec,
)
from spec_jax.sharding.placement import batch_sharding, gather_to_host
from spec_jax.sharding.rules import (
    DEFAULT_RULES,
    KV_CACHE_AXES,
    ShardingRules,
    bytes_per_device,
    drafter_weight_specs,
    kv_cache_shardings,
    logical_to_partition_spec,
    param_shardings,
    shard_params,
    state_shardings,
)

__all__ = [
    "DEFAULT_RULES",
    "KV_CACHE_AXES",
    "MESH_AXES",
    "ShardingRules",
    "batch_sharding",
    "bytes_per_device",
    "default_mesh_shape",
    "drafter_weight_specs",
    "gather_to_host",
    "initialize_distributed",
    "is_main_process",
    "kv_cache_shardings",
    "logical_to_partition_spec",
    "main_print",
    "make_mesh",
    "mesh_spec_string",
    "param_shardings",
    "parse_mesh_spec",
    "shard_params",
    "state_shardings",
]
