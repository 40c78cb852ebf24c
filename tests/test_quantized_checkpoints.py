"""Quantized weights (int8 per channel, int4 per group: how the shipped drafters are stored) load
as float ones; a drafter kind that does not ship is a clear error."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors import safe_open

from spec_jax.checkpoints import LoadedModel, save_hf_dir
from spec_jax.checkpoints.hf import load_hf_dir
from spec_jax.checkpoints.quantized import (
    INT4_GROUP,
    SCALE_SUFFIX,
    dequantize,
    quantize,
    quantize_checkpoint_file,
)
from spec_jax.checkpoints.shipped import ASSETS, SHIPPED_DRAFTERS, load_drafter
from spec_jax.models import ModelConfig, init_params

CFG = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("bits, levels, group", [("int8", 127, 64), ("int4", 7, INT4_GROUP)])
def test_quantize_is_within_half_a_step_of_each_scale(bits, levels, group):
    w = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32)
    w[2] = 0.0  # an all-zero row keeps a usable scale
    stored, scale = quantize(w, bits)
    assert scale.shape == (6, 64 // group)
    back = dequantize(stored, scale)
    step = np.repeat(scale, group, axis=1)
    assert np.all(np.abs(back - w) <= step / 2 + 1e-7) and not back[2].any()
    assert np.isclose(np.abs(back).max(), np.abs(w).max())  # the largest weight is a level


def test_a_quantized_checkpoint_loads_as_the_dequantized_float_one(tmp_path):
    params = jax.device_get(init_params(CFG, jax.random.key(0)))
    save_hf_dir(tmp_path / "ckpt", CFG, params)
    quantize_checkpoint_file(tmp_path / "ckpt" / "model.safetensors", int4=["model.embed_tokens.weight"])
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "numpy") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["model.embed_tokens.weight"] == "U8" and dtypes["model.norm.weight"] == "F32"
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "I8"
    assert dtypes["model.embed_tokens.weight" + SCALE_SUFFIX] == "F32"

    cfg, loaded = load_hf_dir(tmp_path / "ckpt")  # float shapes; the _scale tensors are not unknown
    assert cfg == CFG
    embed = np.asarray(params["embed"], np.float32)
    np.testing.assert_array_equal(loaded["embed"], dequantize(*quantize(embed, "int4")))
    np.testing.assert_array_equal(loaded["final_norm"], params["final_norm"])  # vectors as they were
    for ours, original in zip(jax.tree.leaves(loaded["layers"]), jax.tree.leaves(params["layers"])):
        original = np.asarray(original, np.float32)
        step = np.abs(original).max() / 127  # no row's int8 scale exceeds the largest row's
        np.testing.assert_allclose(ours, original, atol=step / 2 + 1e-7, rtol=0)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint_file(tmp_path / "ckpt" / "model.safetensors")
    save_hf_dir(tmp_path / "float", CFG, params)
    with pytest.raises(ValueError, match="no tensor"):
        quantize_checkpoint_file(tmp_path / "float" / "model.safetensors", int4=["nope.weight"])


def test_shipped_drafters_are_quantized():
    for name in SHIPPED_DRAFTERS.values():
        with safe_open(str(ASSETS / name / "model.safetensors"), "numpy") as f:
            matrices = [n for n in f.keys()
                        if len(f.get_slice(n).get_shape()) == 2 and not n.endswith(SCALE_SUFFIX)]
            assert matrices and all(f.get_slice(n).get_dtype() in ("I8", "U8") for n in matrices), name


def test_eagle3_without_a_path_says_none_ships():
    default = LoadedModel(CFG, None, None, None, "default:model.gguf")
    for kind in ("eagle3", "eagle3+ngram"):
        with pytest.raises(ValueError, match="no EAGLE-3 drafter ships") as e:
            load_drafter(kind, default)
        assert "--drafter eagle3=" in str(e.value) and "spec-jax train eagle3" in str(e.value)
