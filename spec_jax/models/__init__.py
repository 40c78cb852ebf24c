"""The target interface (`TargetModel`, `Target`) and its first implementation, the one
built-in decoder (`Decoder`; Llama and Qwen3 are configs of it)."""

from spec_jax.models.config import GLOBAL_WINDOW, ModelConfig, RopeScaling
from spec_jax.models.decoder import Decoder, KVCache, forward, init_cache, init_params
from spec_jax.models.interface import (
    FINAL_HIDDEN,
    CacheReader,
    ForwardOutput,
    LayerKV,
    Target,
    TargetModel,
    ancestor_mask,
    chain_mask,
    tree_depths,
)
from spec_jax.models.resolve import as_target_model, resolve_target
from spec_jax.models.weights import WeightSpec, model_weight_specs

__all__ = [
    "CacheReader",
    "Decoder",
    "FINAL_HIDDEN",
    "ForwardOutput",
    "GLOBAL_WINDOW",
    "KVCache",
    "LayerKV",
    "ModelConfig",
    "RopeScaling",
    "Target",
    "TargetModel",
    "WeightSpec",
    "ancestor_mask",
    "as_target_model",
    "chain_mask",
    "forward",
    "init_cache",
    "init_params",
    "model_weight_specs",
    "resolve_target",
    "tree_depths",
]
