"""Named architecture presets: the shapes of well-known checkpoints, for random-weight targets.

    cfg = PRESETS["llama-3.2-1b"].replace(dtype="bfloat16")
    target = load_target("random:llama-3.2-1b", dtype="bfloat16")   # random weights, no download

A random-weight target has the exact shapes (and so the exact memory traffic and FLOPs) of the
real model, which is all a speed measurement needs; its tokens are meaningless, so use it with
`--prompt-ids`/`ignore_eos`. The values are those of each model's HF `config.json`.
"""

from __future__ import annotations

from spec_jax.models.config import ModelConfig, RopeScaling

_LLAMA3_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

PRESETS: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (the default target's shapes).
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    # meta-llama/Llama-3.2-1B: the "1B-class" target of the GPU measurements.
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        tie_embeddings=True, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001,),
    ),
    # meta-llama/Llama-3.1-8B.
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001,),
    ),
    # Qwen/Qwen3-8B (the target of the published z-lab DFlash drafter).
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
        architecture="qwen3", max_position_embeddings=40960, eos_token_ids=(151645,),
    ),
    # A few-MB model for smoke tests of the measuring scripts.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, tie_embeddings=True, eos_token_ids=(1,),
    ),
}


def preset_config(name: str, dtype: str = "float32") -> ModelConfig:
    """The preset `name` in `dtype`; an unknown name is an error listing the known ones."""
    if name not in PRESETS:
        raise ValueError(
            f"Unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}."
        )
    return PRESETS[name].replace(dtype=dtype)
