"""Named architecture presets: the shapes of well-known checkpoints, for random-weight targets.

    cfg = PRESETS["llama-3.2-1b"].replace(dtype="bfloat16")
    target = load_target("random:llama-3.2-1b", dtype="bfloat16")   # random weights, no download

A random-weight target has the exact shapes (and so the exact memory traffic and FLOPs) of the
real model, which is all a speed measurement needs; its tokens are meaningless, so use it with
`--prompt-ids`/`ignore_eos`. The values are those of each model's HF `config.json`.
"""

from __future__ import annotations

from spec_jax.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    LinearRopeScaling,
    ModelConfig,
    MoeConfig,
    ProportionalRope,
    RopeScaling,
    gemma4_moe,
)

_LLAMA3_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _gemma3(num_layers: int, window: int, **fields) -> ModelConfig:
    """A Gemma 3 text decoder: five sliding layers (local RoPE base 10k) then one full layer."""
    types = tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(num_layers))
    return ModelConfig(
        num_layers=num_layers, layer_types=types, sliding_window=window, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        sliding_rope_theta=10_000.0, tie_embeddings=True, qk_norm=True, architecture="gemma3",
        bos_token_id=2, eos_token_ids=(1, 106), norm_offset=1.0, sandwich_norms=True,
        mlp_activation="gelu_tanh", scale_embeddings=True, **fields,
    )


def _gpt_oss(num_layers: int, num_experts: int) -> ModelConfig:
    """A gpt-oss model from its published config.json's values (the rest are GptOssConfig's
    defaults, which those files share)."""
    return ModelConfig.from_hf_config({
        "architectures": ["GptOssForCausalLM"], "num_hidden_layers": num_layers, "num_local_experts": num_experts,
        "bos_token_id": 199998, "eos_token_id": 200002,
    })


def _gemma4(num_layers: int, full_every: int, window: int, **fields) -> ModelConfig:
    """A dense Gemma 4 text decoder: `full_every - 1` sliding layers (head 256, RoPE base 10k)
    then one full layer (head 512, proportional RoPE on a quarter of it, base 1M); the last
    layer is full."""
    types = tuple(FULL_ATTENTION if (i + 1) % full_every == 0 else SLIDING_ATTENTION for i in range(num_layers))
    return ModelConfig(
        vocab_size=262144, num_layers=num_layers, head_dim=256, global_head_dim=512, layer_types=types,
        sliding_window=window, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_scaling=ProportionalRope(0.25),
        sliding_rope_theta=10_000.0, tie_embeddings=True, qk_norm=True, architecture="gemma4", bos_token_id=2,
        eos_token_ids=(1, 106), sandwich_norms=True, mlp_activation="gelu_tanh", scale_embeddings=True,
        query_pre_attn_scalar=1.0, final_logit_softcapping=30.0, value_norm=True, layer_scalar=True, **fields,
    )


def _qwen3_5(num_layers: int, **fields) -> ModelConfig:
    """A dense Qwen3.5 text decoder: three Gated DeltaNet layers (16 key / 32 value heads of
    128) then one gated full-attention layer (16 query / 4 KV heads of 256, RoPE on a quarter
    of each head), (1 + w) RMSNorms."""
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers))
    defaults = dict(vocab_size=248320, num_heads=16, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6,
                    rope_theta=10_000_000.0, qk_norm=True, architecture="qwen3_5", norm_offset=1.0,
                    max_position_embeddings=262144, linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128, attn_output_gate=True,
                    partial_rotary_factor=0.25)
    return ModelConfig(num_layers=num_layers, layer_types=types, **{**defaults, **fields})

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
    # google/gemma-3-1b-it.
    "gemma-3-1b": _gemma3(
        26, 512, vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_heads=4,
        num_kv_heads=1, head_dim=256, query_pre_attn_scalar=256.0, max_position_embeddings=32768,
    ),
    # google/gemma-3-27b-it's text decoder (global layers: linear RoPE scaling x8).
    "gemma-3-27b": _gemma3(
        62, 1024, vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_heads=32,
        num_kv_heads=16, head_dim=128, query_pre_attn_scalar=168.0, rope_scaling=LinearRopeScaling(8.0),
        max_position_embeddings=131072,
    ),
    # google/gemma-4-E2B-it's text decoder: per-layer embeddings, the last 20 layers reading the
    # KV of layers 13 / 14 with double-wide MLPs. (Gemma 4 shapes: the published config.json
    # text_config values, as quoted by third-party loaders; see README "Model families".)
    "gemma-4-e2b": _gemma4(
        35, 5, 512, hidden_size=1536, intermediate_size=6144, num_heads=8, num_kv_heads=1,
        num_kv_shared_layers=20, double_wide_mlp=True, per_layer_input_size=256,
        per_layer_vocab_size=262144, max_position_embeddings=131072,
    ),
    # google/gemma-4-E4B-it's text decoder (the last 18 layers share KV).
    "gemma-4-e4b": _gemma4(
        42, 6, 512, hidden_size=2560, intermediate_size=10240, num_heads=8, num_kv_heads=2,
        num_kv_shared_layers=18, per_layer_input_size=256, per_layer_vocab_size=262144,
        max_position_embeddings=131072,
    ),
    # google/gemma-4-31B-it's text decoder, the largest dense one (full layers: 4 KV heads whose
    # values are the keys' projection).
    "gemma-4-31b": _gemma4(
        60, 6, 1024, hidden_size=5376, intermediate_size=21504, num_heads=32, num_kv_heads=16,
        num_global_kv_heads=4, attention_k_eq_v=True, max_position_embeddings=262144,
    ),
    # google/gemma-4-26B-A4B-it's text decoder, the MoE one: on every layer 128 experts (top 8, width
    # 704) beside a dense MLP of 2112; full layers as 31B's with 2 KV heads.
    "gemma-4-26b-a4b": _gemma4(
        30, 6, 1024, hidden_size=2816, intermediate_size=2112, num_heads=16, num_kv_heads=8,
        num_global_kv_heads=2, attention_k_eq_v=True, max_position_embeddings=262144,
        moe=gemma4_moe(128, 8, 704),
    ),
    # Qwen/Qwen2.5-7B-Instruct (sliding window off, as shipped).
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qkv_bias=True,
        architecture="qwen2", max_position_embeddings=32768, bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
    # Qwen/Qwen3.5-9B and -4B (the text decoder of the multimodal checkpoints): 24 Gated DeltaNet
    # + 8 gated full-attention layers.
    "qwen3.5-9b": _qwen3_5(32, hidden_size=4096, intermediate_size=12288, eos_token_ids=(248044,)),
    "qwen3.5-4b": _qwen3_5(32, hidden_size=2560, intermediate_size=9216, tie_embeddings=True,
                           eos_token_ids=(248046,)),
    # Qwen3.5-9B's layers (DeltaNet heads and state at full size, so the rollback memory per layer
    # is the real model's) at hidden 1024, 8 of its 32 layers and a 16k vocabulary: the verify-cost
    # curve on a CPU (benchmarks/RESULTS.md, "Issue 44").
    "qwen3.5-9b-scaled": _qwen3_5(8, vocab_size=16384, hidden_size=1024, intermediate_size=3072,
                                  eos_token_ids=(1,)),
    # Qwen/Qwen3-Next-80B-A3B: 36 Gated DeltaNet + 12 gated attention layers (16 query / 2 KV heads),
    # 512 experts of width 512, 10 per token, a gated shared expert (80B parameters, 3B active).
    "qwen3-next-80b-a3b": _qwen3_5(48, vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_kv_heads=2,
                                   architecture="qwen3_next", eos_token_ids=(151645,), bos_token_id=151643,
                                   moe=MoeConfig(512, 10, 512, normalize_top_k=True,
                                                 shared_expert_intermediate_size=512, shared_expert_gate=True)),
    # mistralai/Mistral-7B-v0.1 (a 4096-token sliding window on every layer).
    "mistral-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, layer_types=(SLIDING_ATTENTION,) * 32, sliding_window=4096,
        architecture="mistral",
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
    ),
    # openai/gpt-oss-20b and -120b: sinks, alternating sliding (128) / full layers, YaRN, top-4
    # clamped-SwiGLU experts (32 / 128 of them); 20.9B / 116.8B parameters.
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 per token, renormalised (30.5B parameters,
    # 3.3B active per token).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
        architecture="qwen3_moe", max_position_embeddings=40960, bos_token_id=151643,
        eos_token_ids=(151645,), moe=MoeConfig(128, 8, 768, normalize_top_k=True),
    ),
    # Its routing (128 experts, 8 per token) at a quarter of its widths, 8 of its 48 layers and a
    # 16k vocabulary: the verify-cost curve of its expert reads on a CPU (benchmarks/RESULTS.md).
    "qwen3-30b-a3b-scaled": ModelConfig(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
        architecture="qwen3_moe", max_position_embeddings=40960, eos_token_ids=(1,),
        moe=MoeConfig(128, 8, 192, normalize_top_k=True),
    ),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14336, 2 per token (46.7B, 12.9B active).
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, architecture="mixtral",
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
        moe=MoeConfig(8, 2, 14336, normalize_top_k=True),
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
