"""The tiny model and drafter configs the tests share.

Import these instead of re-typing a config: configs that are equal are one static argument, so
tests across files (and the subprocess workers) reuse each other's compiled programs. A test
pinned to numbers keeps its own values; change a config here only with every test that uses it.
"""

from __future__ import annotations

from spec_jax.drafters.dflash import DFlashConfig, dflash_layers
from spec_jax.models import ModelConfig
from spec_jax.models.config import ProportionalRope

VOCAB = 101
EOS = 2  # appears mid-way in some greedy outputs of TINY_TARGET (e.g. rows 1, 2 of
#         make_prompts([3, 16, 1], seed=0) at 12 and 21), never in most

# The decoding tests' target (conftest's `models`, the engine worker): a 2-layer Llama.
TINY_TARGET = ModelConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, eos_token_ids=(EOS,),
)
# Its one-layer draft model.
TINY_DRAFT = TINY_TARGET.replace(num_layers=1)


def small_llama(vocab_size: int, **fields) -> ModelConfig:
    """The 2-layer, 32-wide Llama the CLI, serving and library-rule tests save with a
    tokenizer's vocabulary (tied embeddings); `fields` set its positions and special tokens."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, tie_embeddings=True, **fields,
    )


def tiny_dflash(block_size: int) -> DFlashConfig:
    """A one-layer DFlash drafter for TINY_TARGET (reads both its layers; mask = the last id)."""
    return DFlashConfig(
        layer=dflash_layers(1, 64, 4, 2, 16, 128, vocab_size=VOCAB), block_size=block_size,
        target_layer_ids=(0, 1), mask_token_id=VOCAB - 1, num_target_layers=2,
    )


TINY_DFLASH = tiny_dflash(5)

# z-lab's Qwen3-8B DFlash drafter (5 layers, block 16), for shape-only checks.
QWEN3_8B_DFLASH = DFlashConfig(
    layer=dflash_layers(5, 4096, 32, 8, 128, 12288, vocab_size=151936),
    block_size=16, target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, num_target_layers=36,
)

# A tiny Gemma 4 built without transformers (tests/test_gemma4.py's HF config, as spec_jax maps it):
# 3 layers [sliding, full, full], a 5-token window, full layers with their own head size (32) and
# KV heads (1) whose values are the keys (k_eq_v) and proportional RoPE on half of each head,
# per-layer embeddings, the last layer reading layer 1's keys/values with a double-wide MLP.
TINY_GEMMA4 = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=16, global_head_dim=32, num_global_kv_heads=1, attention_k_eq_v=True,
    layer_types=("sliding_attention", "full_attention", "full_attention"), sliding_window=5,
    num_kv_shared_layers=1, double_wide_mlp=True, per_layer_input_size=8, per_layer_vocab_size=128,
    rope_theta=100_000.0, rope_scaling=ProportionalRope(0.5), sliding_rope_theta=1_000.0, rms_norm_eps=1e-6,
    tie_embeddings=True, qk_norm=True, architecture="gemma4", sandwich_norms=True, mlp_activation="gelu_tanh",
    scale_embeddings=True, query_pre_attn_scalar=1.0, final_logit_softcapping=30.0, value_norm=True,
    layer_scalar=True, max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,),
)
