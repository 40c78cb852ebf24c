"""The real Qwen3-8B target with its DFlash drafter runs the whole loop abstractly (no allocation)."""

from __future__ import annotations

import functools

import jax

from spec_jax.decoding.loop import abstract_inputs, generate_loop
from spec_jax.sampling import SamplingParams
from spec_jax.drafters.dflash import DFlashDrafter, check_compatible, dflash_weight_specs
from spec_jax.models.config import ModelConfig
from spec_jax.models.weights import count_params
# z-lab/Qwen3-8B-DFlash-b16 as stated in the task (5 Qwen3-8B-shaped layers; the layer ids are
# also what the default rule gives for 36 target layers and 5 draft layers).
from tiny_configs import QWEN3_8B_DFLASH

# Qwen/Qwen3-8B config.json values.
QWEN3_8B = ModelConfig(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
    tie_embeddings=False, architecture="qwen3", max_position_embeddings=40960,
)


def test_qwen3_8b_dflash_generate_loop_eval_shape():
    drafter = DFlashDrafter(QWEN3_8B_DFLASH)
    check_compatible(drafter.cfg, QWEN3_8B)
    specs = dflash_weight_specs(drafter.cfg)
    assert specs["fc"].shape == (5 * 4096, 4096)
    assert 1.0e9 < count_params(specs) < 1.2e9  # ~1.05B drafter params
    batch, prompt_len, capacity = 4, 512, 1024
    inputs = abstract_inputs(
        QWEN3_8B, specs, batch=batch, prompt_len=prompt_len,
        sampling=SamplingParams.create(0.6, 20, 0.95),
    )
    out = jax.eval_shape(
        functools.partial(generate_loop, model=QWEN3_8B, drafter=drafter, capacity=capacity), inputs
    )
    assert out.tokens.shape == (batch, capacity)
    assert out.stats.histogram.shape == (batch, 16)
    assert out.stats.position_accepted.shape == (batch, 15)
