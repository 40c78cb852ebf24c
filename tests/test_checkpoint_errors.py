"""Bad checkpoints raise a clear CheckpointError naming the problem and the fix, before any compile."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from spec_jax.checkpoints import CheckpointError, CheckpointNotFoundError, load_target, save_hf_dir
from spec_jax.checkpoints.hf import load_hf_dir
from spec_jax.models import ModelConfig, init_params

import jax

CFG = ModelConfig(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ckpt"
    save_hf_dir(path, CFG, init_params(CFG, jax.random.key(0)))
    return path


@pytest.fixture
def ckpt(good_dir, tmp_path):
    """A fresh copy of a valid checkpoint that a test may break."""
    path = tmp_path / "ckpt"
    shutil.copytree(good_dir, path)
    return path


def _edit_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_good_checkpoint_loads(ckpt):
    cfg, _ = load_hf_dir(ckpt)
    assert cfg == CFG


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as e:
        load_target(str(missing))
    assert str(missing) in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):  # also a FileNotFoundError
        load_target(str(tmp_path / "model.gguf"))


def test_unsupported_architecture(ckpt):
    (ckpt / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2})
    )
    with pytest.raises(CheckpointError, match=r"Unsupported architecture.*GPT2LMHeadModel.*supports"):
        load_target(str(ckpt))


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(str(ckpt))


def test_no_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"No \*\.safetensors.*save_pretrained"):
        load_target(str(ckpt))


def test_truncated_safetensors(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated or corrupt.*re-download"):
        load_target(str(ckpt))


def test_shape_mismatch(ckpt):
    hf = json.loads((ckpt / "config.json").read_text())
    hf["intermediate_size"] = 64  # the weights were saved with 48
    (ckpt / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"shape mismatch.*mlp.gate_proj.weight.*\(64, 32\).*\(48, 32\)"):
        load_target(str(ckpt))


def test_missing_weight(ckpt):
    _edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing weights \['model.layers.1.mlp.up_proj.weight'\]"):
        load_target(str(ckpt))


def test_unknown_weight(ckpt):
    _edit_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unknown weights \['model.layers.0.self_attn.q_proj.bias'\]"):
        load_target(str(ckpt))


def test_missing_shard(tmp_path, good_dir):
    shutil.copytree(good_dir, tmp_path / "c")
    names = list(load_file(str(tmp_path / "c" / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}
    (tmp_path / "c" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"Shard model-00002-of-00002.safetensors .* is missing"):
        load_target(str(tmp_path / "c"))


def test_hub_id_offline(monkeypatch, tmp_path):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no network and not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)  # so "some-org/some-model" is not a local path
    with pytest.raises(CheckpointNotFoundError, match=r"'some-org/some-model'.*download.*local checkpoint directory"):
        load_target("some-org/some-model")


def test_save_rejects_params_that_do_not_match_config(tmp_path):
    params = init_params(CFG, jax.random.key(0))
    with pytest.raises(ValueError, match="shape mismatch"):
        save_hf_dir(tmp_path / "x", CFG.replace(hidden_size=40), params)
    assert not (tmp_path / "x").exists()
