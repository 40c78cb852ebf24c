"""gpt-oss (`GptOssForCausalLM`) as a configuration of the one decoder: attention sinks in every
attention path, YaRN RoPE, MXFP4 expert weights dequantised on load.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.checkpoints.mxfp4 import dequantize_mxfp4, mxfp4_float_shape, quantize_mxfp4
from spec_jax.models.attention import attend_cache_and_pass, cache_visibility
from spec_jax.models.config import GLOBAL_WINDOW
from test_live_attention import HEADS, case


def sink_reference(q, k_cache, v_cache, lengths, positions, window, k_pass, v_pass, mask, sinks):
    """Attention with sinks written out in numpy: softmax over [visible scores, the head's sink],
    the sink's probability dropped."""
    q, k_cache, v_cache, k_pass, v_pass = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache, k_pass, v_pass))
    visible = np.concatenate(
        [np.asarray(cache_visibility(lengths, positions, k_cache.shape[2], window)),
         np.broadcast_to(np.asarray(mask), (q.shape[0], q.shape[1], k_pass.shape[2]))], axis=-1)
    keys, values = np.concatenate([k_cache, k_pass], axis=2), np.concatenate([v_cache, v_pass], axis=2)
    groups = q.shape[2] // keys.shape[1]
    keys, values = np.repeat(keys, groups, axis=1), np.repeat(values, groups, axis=1)  # [B, N, S, D]
    scores = np.einsum("btnd,bnsd->bnts", q, keys) / np.sqrt(q.shape[-1])
    scores = np.where(visible[:, None], scores, -np.inf)
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (*scores.shape[:3], 1))
    joint = np.concatenate([scores, sink], axis=-1)
    probs = np.exp(joint - joint.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bnsd->btnd", probs[..., :-1], values)


def test_sinks_in_every_attention_path():
    """Dense, live blocks and live buckets with sinks equal the written-out reference (chain and
    tree masks, a sliding window, ragged lengths); blocks' custom gradient of the sinks equals
    the dense one."""
    sinks = jnp.asarray(np.random.RandomState(7).randn(HEADS), jnp.float32)
    # The window goes in traced, so each path compiles once.
    attention = {impl: jax.jit(functools.partial(attend_cache_and_pass, impl=impl, block=16))
                 for impl in ("dense", "blocks", "buckets")}
    for tree, window in ((False, GLOBAL_WINDOW), (True, 20)):
        args = case(3, 100, [0, 37, 100, 5], "float32", tree, window)
        expected = sink_reference(*args, sinks)
        for impl in ("dense", "blocks", "buckets"):
            out = attention[impl](*args, sinks=sinks)
            np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, err_msg=f"{impl} tree={tree}")
    grads = {impl: jax.jit(jax.grad(lambda s, impl=impl: attention[impl](*args, sinks=s).sum()))(sinks)
             for impl in ("dense", "blocks")}
    np.testing.assert_allclose(grads["blocks"], grads["dense"], atol=1e-5)


def test_mxfp4_dequantisation_matches_transformers():
    """MXFP4 blocks/scales read as transformers' `convert_moe_packed_tensors` reads them (a hand-
    checked byte too), and quantising its output again gives the same bytes."""
    # One byte by hand: 0x2F = low nibble 0xF (-6.0), high nibble 0x2 (+1.0); scale byte 128 = 2**1.
    blocks = np.full((1, 1, 1, 16), 0x2F, np.uint8)
    one = dequantize_mxfp4(blocks, np.full((1, 1, 1), 128, np.uint8))
    assert one.shape == (1, 32, 1) and one[0, :2, 0].tolist() == [-12.0, 2.0]

    w = np.random.RandomState(0).randn(3, 64, 40).astype(np.float32)  # [E, C, R]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    assert mxfp4_float_shape(blocks.shape) == w.shape
    ours = dequantize_mxfp4(blocks, scales)
    assert np.abs(ours - w).max() <= np.abs(w).max() / 4  # FP4: 1 mantissa bit
    np.testing.assert_array_equal(np.concatenate(quantize_mxfp4(ours)[0:1]), blocks)
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    theirs = mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours, theirs.numpy())


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_match_transformers(truncate):
    """YaRN's inverse frequencies and cos/sin factor equal transformers' `_compute_yarn_parameters`
    (gpt-oss's rope: factor 32, beta 32/1, no truncation; and truncated); other families refuse
    YaRN on RoPE of their own per layer type."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from spec_jax.models.config import ModelConfig, rope_scaling_from_hf
    from spec_jax.models.decoder import layer_style, rope_inv_freq

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    hf = transformers.GptOssConfig(head_dim=64, hidden_size=128, num_attention_heads=2, rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    scaling = rope_scaling_from_hf(rope)
    assert scaling.attention_factor == pytest.approx(factor) and scaling.truncate == truncate
    np.testing.assert_allclose(np.asarray(rope_inv_freq(64, 150000.0, scaling)), inv_freq.numpy(), rtol=1e-6)
    cfg = ModelConfig(vocab_size=8, hidden_size=128, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=64, rope_theta=150000.0, rope_scaling=scaling)
    assert layer_style(cfg).query_multiplier == pytest.approx(factor ** 2)  # cos and sin each carry it
    with pytest.raises(ValueError, match="YaRN RoPE is implemented for one RoPE"):
        cfg.replace(sliding_rope_theta=10_000.0, layer_types=("sliding_attention",), sliding_window=4)


# z-lab/gpt-oss-20b-DFlash's config.json as published (quoted by third-party loaders, e.g. an MLX
# port's tests; the file itself is not fetched here). model_type gpt_oss: transformers fills in
# GptOssConfig's defaults (alternating sliding-128 / full layers, YaRN), and so the reference
# `dflash` package's layers have them.
ZLAB_GPT_OSS_20B_DFLASH = {
    "architectures": ["DFlashDraftModel"], "attention_bias": True, "attention_dropout": 0.0, "block_size": 8,
    "bos_token_id": 199998, "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    "dtype": "bfloat16", "eos_token_id": 200002, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 7680,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_hidden_layers": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "vocab_size": 201088,
}


def test_zlab_gpt_oss_dflash_config_loads():
    """z-lab's gpt-oss-20b DFlash config reads as the reference reads it: q/k/v/o biases, YaRN,
    alternating sliding-128 / full layers; its weights are the published size (1.46 GiB in
    bf16) under the names its loader expects; the z-lab config it writes back reads the same."""
    from spec_jax.checkpoints.dflash import dflash_config_from_hf, dflash_config_to_hf, expected_dflash_shapes
    from spec_jax.drafters.dflash import init_dflash_params
    from spec_jax.models.config import SLIDING_ATTENTION, YarnRopeScaling

    dcfg = dflash_config_from_hf(ZLAB_GPT_OSS_20B_DFLASH, "bfloat16")
    assert (dcfg.block_size, dcfg.mask_token_id, dcfg.target_layer_ids) == (8, 200000, (1, 6, 11, 16, 21))
    assert dcfg.layer.qkv_bias and dcfg.layer.o_bias and isinstance(dcfg.layer.rope_scaling, YarnRopeScaling)
    assert dcfg.layer_types[::2] == (SLIDING_ATTENTION,) * 4 and dcfg.layer.sliding_window == 128
    names = expected_dflash_shapes(dcfg)
    assert names["layers.7.self_attn.o_proj.bias"] == (2880,) and names["layers.0.self_attn.k_proj.bias"] == (512,)
    params = jax.eval_shape(lambda key: init_dflash_params(dcfg, key), jax.random.key(0))
    assert abs(sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)) * 2 / 2**30 - 1.46) < 0.01
    assert dflash_config_from_hf(dflash_config_to_hf(dcfg), "bfloat16") == dcfg


def test_gpt_oss_presets_and_the_zlab_dflash_drafter_by_eval_shape():
    """random:gpt-oss-20b / -120b have the published parameter counts (20.91B / 116.83B; active
    per token without the input embedding 3.61B / 5.13B); z-lab's gpt-oss-20b DFlash drafter fits
    the 20b target and a draft block runs on the target's captured layers (shapes only: nothing
    is allocated)."""
    from spec_jax.checkpoints.dflash import dflash_config_from_hf
    from spec_jax.drafters.dflash import check_compatible, context_kv, dflash_hidden, init_dflash_params
    from spec_jax.models.decoder import forward_hidden, init_cache, init_params, lm_head
    from spec_jax.models.moe import param_counts
    from spec_jax.models.presets import preset_config

    def count(tree):
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))

    for name, total, active in (("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        cfg = preset_config(name, "bfloat16")
        shapes = jax.eval_shape(lambda key, cfg=cfg: init_params(cfg, key), jax.random.key(0))
        assert abs(count(shapes) - total) / total < 0.001, (name, count(shapes))
        embedding = cfg.vocab_size * cfg.hidden_size
        assert abs(param_counts(cfg)["active"] - embedding - active) / active < 0.005
    target = preset_config("gpt-oss-20b", "bfloat16")
    target_params = jax.eval_shape(lambda key: init_params(target, key), jax.random.key(0))

    dcfg = dflash_config_from_hf(ZLAB_GPT_OSS_20B_DFLASH, "bfloat16")
    check_compatible(dcfg, target)
    params = jax.eval_shape(lambda key: init_dflash_params(dcfg, key), jax.random.key(0))

    def draft_block(target_params, params):
        tokens = jnp.zeros((1, 16), jnp.int32)
        positions = jnp.arange(16)[None]
        out = forward_hidden(target_params, target, tokens, positions, init_cache(target, 1, 64),
                             capture=dcfg.target_layer_ids)
        ctx_k, ctx_v = context_kv(dcfg, params, out.captured, positions)
        block_positions = 16 + jnp.arange(dcfg.block_size)[None]
        visible = jnp.ones((1, dcfg.block_size, 16), bool)
        hidden = dflash_hidden(dcfg, params, jnp.zeros((1, dcfg.block_size, 2880), jnp.bfloat16), block_positions,
                               ctx_k, ctx_v, positions, visible, jnp.ones((1, dcfg.block_size, dcfg.block_size), bool))
        return lm_head(target_params, target, hidden[:, 1:])

    assert jax.eval_shape(draft_block, target_params, params).shape == (1, 7, 201088)
