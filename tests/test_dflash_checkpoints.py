"""DFlash config mapping, checkpoint round trips (ours <-> the reference's format) and bad checkpoints."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from spec_jax.checkpoints.dflash import (
    canonical_weight_name,
    check_compatible,
    dflash_config_from_hf,
    dflash_config_to_hf,
    load_dflash,
    save_dflash,
)
from spec_jax.checkpoints.errors import CheckpointError
from spec_jax.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    default_target_layer_ids,
    dflash_layers,
    init_dflash_params,
)
from spec_jax.models.config import GLOBAL_WINDOW, ModelConfig

TARGET = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
    num_kv_heads=2, head_dim=16, qk_norm=True, architecture="qwen3",
)


LAYER_FIELDS = ("hidden_size", "head_dim", "layer_types", "sliding_window", "final_logit_softcapping")


def small_cfg(**changes) -> DFlashConfig:
    layer = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=128)
    layer.update({k: v for k, v in changes.items() if k in LAYER_FIELDS})
    base = dict(block_size=8, target_layer_ids=(1, 3), mask_token_id=127, num_target_layers=6)
    base.update({k: v for k, v in changes.items() if k not in LAYER_FIELDS})
    return DFlashConfig(layer=dflash_layers(**layer), **base)


@pytest.fixture
def saved(tmp_path):
    cfg = small_cfg(layer_types=("full_attention", "sliding_attention"), sliding_window=5)
    params = jax.tree.map(np.asarray, init_dflash_params(cfg, jax.random.key(0)))
    path = save_dflash(tmp_path / "ckpt", cfg, params)
    return cfg, params, path


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # z-lab Qwen3-8B-DFlash-b16
    assert default_target_layer_ids(28, 1) == (14,)
    hf = dflash_config_to_hf(small_cfg())
    del hf["dflash_config"]["target_layer_ids"]
    assert dflash_config_from_hf(hf).target_layer_ids == default_target_layer_ids(6, 2)


def test_config_round_trip_and_layer_semantics():
    cfg = small_cfg(
        layer_types=("sliding_attention", "full_attention"), sliding_window=4,
        input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0,
    )
    assert dflash_config_from_hf(json.loads(json.dumps(dflash_config_to_hf(cfg)))) == cfg
    assert cfg.layer.layer_windows == (4, GLOBAL_WINDOW)
    assert cfg.layer_causal == (True, False)
    assert small_cfg(is_causal=False, layer_types=("sliding_attention",) * 2).layer_causal == (False, False)
    assert hash(DFlashDrafter(cfg)) == hash(DFlashDrafter(cfg))
    assert DFlashDrafter(cfg).k == 7
    with pytest.raises(ValueError, match="1..7"):
        DFlashDrafter(cfg, k=8)


def test_save_load_round_trip_and_reference_loads_it(saved):
    cfg, params, path = saved
    drafter, loaded = load_dflash(path)
    assert drafter.cfg == cfg
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(loaded)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(p))
    from dflash.model import DFlashDraftModel

    reference = DFlashDraftModel.from_pretrained(path)
    assert reference.block_size == cfg.block_size
    assert list(reference.target_layer_ids) == list(cfg.target_layer_ids)
    assert reference.mask_token_id == cfg.mask_token_id
    assert reference.layers[1].self_attn.is_causal and reference.layers[1].self_attn.sliding_window == 5
    np.testing.assert_array_equal(reference.fc.weight.detach().numpy(), params["fc"].T)


def test_name_variants_load(saved, tmp_path):
    cfg, params, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {}
    for name, value in tensors.items():
        name = name.replace("layers.0.", "midlayer.").replace("fc.", "encoder.fc.")
        renamed["model." + name] = value
    save_file(renamed, str(path / "model.safetensors"))
    assert canonical_weight_name("model.midlayer.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    _, loaded = load_dflash(path)
    np.testing.assert_array_equal(loaded["fc"], params["fc"])


def _rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("layers.1.self_attn.k_norm.weight"), r"missing weights \['layers.1.self_attn.k_norm.weight'\]"),
        (lambda t: t.update({"layers.0.extra.weight": np.zeros(3, np.float32)}), r"unknown weights \['layers.0.extra.weight'\]"),
        (lambda t: t.update({"fc.weight": np.zeros((64, 64), np.float32)}), r"fc.weight: config implies \(64, 128\), file has \(64, 64\)"),
    ],
    ids=["missing", "unknown", "wrong-shape"],
)
def test_bad_weights_are_named(saved, change, message):
    _, _, path = saved
    _rewrite(path, change)
    with pytest.raises(CheckpointError, match=message):
        load_dflash(path)


def test_bad_config_is_clear(saved):
    _, _, path = saved
    hf = json.loads((path / "config.json").read_text())
    del hf["dflash_config"]["mask_token_id"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_dflash(path)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(target_layer_ids=(1, 6)), r"target_layer_ids \[6\] are outside the target's 6 layers"),
        (dict(mask_token_id=128), r"mask_token_id 128 is outside the target vocabulary \[0, 128\)"),
        (dict(hidden_size=32, head_dim=8), "hidden size 32 differs from the target's 64"),
    ],
    ids=["layer-id", "mask-id", "hidden"],
)
def test_incompatible_target_is_clear(changes, message):
    cfg = small_cfg(**changes)
    with pytest.raises(ValueError, match=message):
        check_compatible(cfg, TARGET)
    with pytest.raises(ValueError, match=message):
        DFlashDrafter(cfg).validate(TARGET, capacity=256)  # what generate() calls before compiling
    check_compatible(small_cfg(), TARGET)
