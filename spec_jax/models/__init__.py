"""One decoder implementation; Llama and Qwen3 are configs of it."""

from spec_jax.models.config import GLOBAL_WINDOW, ModelConfig, RopeScaling
from spec_jax.models.decoder import KVCache, forward, init_cache, init_params
from spec_jax.models.weights import WeightSpec, model_weight_specs

__all__ = [
    "GLOBAL_WINDOW",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "WeightSpec",
    "forward",
    "init_cache",
    "init_params",
    "model_weight_specs",
]
