"""Self-distillation shard dirs carry their provenance: the target's weights hash and each shard's
sha256 in the manifest, the request inside every shard. A copied, foreign, damaged or mislabelled
shard is refused naming what differs; bad settings are refused before anything is written; a
second writer is refused; a dir from before (v1 manifest) still loads and resumes."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_library_rules import CFG, write_chat_model

import spec_jax
from spec_jax.models import init_params
from spec_jax.training.data import MANIFEST, Prompt, TokenDataset, build_dataset
from spec_jax.training.provenance import LOCK_NAME, weights_sha256

data_module = importlib.import_module("spec_jax.training.data")

PROMPTS = [Prompt(f"source{i}", f"w{i} w{i + 1}") for i in range(10, 14)]  # 4 prompts, 2 shards
KW = dict(max_new_tokens=4, batch_size=2, progress=False, shard_prompts=2)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    params = init_params(CFG, jax.random.key(0), scale=4.0)
    directory = write_chat_model(tmp_path_factory.mktemp("integrity") / "model", params, end_of_turn=9)
    return spec_jax.load_target(str(directory))


@pytest.fixture(scope="module")
def finished(chat_target, tmp_path_factory):
    """A finished shard dir (copied per test) and the dataset it holds."""
    directory = tmp_path_factory.mktemp("finished") / "shards"
    return directory, build_dataset(chat_target, PROMPTS, shard_dir=directory, **KW)


@pytest.fixture
def shard_dir(finished, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(finished[0], copy)
    return copy


def no_generation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing should be generated")

    monkeypatch.setattr(data_module, "_answer", refuse)


def test_manifest_records_target_and_every_shard_hash(chat_target, shard_dir, finished):
    manifest = json.loads((shard_dir / MANIFEST).read_text())
    assert manifest["target_sha256"] == weights_sha256(chat_target.params)
    assert manifest["target_source"] == chat_target.source
    assert sorted(manifest["shards"]) == ["shard-00000.npz", "shard-00001.npz"]
    assert not list(shard_dir.glob(".*"))  # no temporary files or lock left behind
    loaded = TokenDataset.load(shard_dir)
    assert np.array_equal(loaded.tokens, finished[1].tokens)


def test_a_copied_shard_is_refused(chat_target, shard_dir, monkeypatch):
    """Issue 33, case 1: `cp shard-00000.npz shard-00001.npz` was accepted as the second shard."""
    shutil.copy(shard_dir / "shard-00000.npz", shard_dir / "shard-00001.npz")
    with pytest.raises(ValueError, match="shard-00001.npz is not the shard manifest.json recorded.*Delete it"):
        TokenDataset.load(shard_dir)
    no_generation(monkeypatch)
    with pytest.raises(ValueError, match="shard-00001.npz is not the shard manifest.json recorded"):
        build_dataset(chat_target, PROMPTS, shard_dir=shard_dir, **KW)


def test_shards_without_their_manifest_are_checked_against_the_request(chat_target, shard_dir, monkeypatch):
    """Issue 33, case 2: with the manifest deleted, a run with other settings adopted the old
    shards and wrote a manifest claiming its own settings."""
    (shard_dir / MANIFEST).unlink()
    no_generation(monkeypatch)
    with pytest.raises(ValueError, match=r"shard-00000.npz answers another request \(differs in max_new_tokens, "
                                         r"temperature \(max_new_tokens: 4 there, 8 now"):
        build_dataset(chat_target, PROMPTS, shard_dir=shard_dir, **{**KW, "max_new_tokens": 8}, temperature=0.7)
    assert not (shard_dir / MANIFEST).exists()
    # A shard moved to another position is refused too; the same request adopts its own shards.
    os.replace(shard_dir / "shard-00001.npz", shard_dir / "keep.npz")
    shutil.copy(shard_dir / "shard-00000.npz", shard_dir / "shard-00001.npz")
    with pytest.raises(ValueError, match="holds shard 0, not shard 1"):
        build_dataset(chat_target, PROMPTS, shard_dir=shard_dir, **KW)
    os.replace(shard_dir / "keep.npz", shard_dir / "shard-00001.npz")
    build_dataset(chat_target, PROMPTS, shard_dir=shard_dir, **KW)
    assert len(json.loads((shard_dir / MANIFEST).read_text())["shards"]) == 2


def test_another_targets_answers_are_not_reused(chat_target, shard_dir, monkeypatch):
    """Issue 33, case 3: another model with the same tokenizer finished at once on the first one's answers."""
    other = dataclasses.replace(chat_target, params=jax.tree_util.tree_map(lambda x: x * 1.01, chat_target.params),
                                source="other-model")
    no_generation(monkeypatch)
    with pytest.raises(ValueError, match=r"another request \(differs in target_sha256.*written with the target"):
        build_dataset(other, PROMPTS, shard_dir=shard_dir, **KW)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty"])
def test_a_damaged_shard_file_names_itself(shard_dir, damage):
    shard = shard_dir / "shard-00001.npz"
    raw = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(raw[: len(raw) // 2])
    elif damage == "flipped":
        shard.write_bytes(raw[:200] + bytes(b ^ 0xFF for b in raw[200:260]) + raw[260:])
    else:
        shard.write_bytes(b"")
    with pytest.raises(ValueError, match="shard-00001.npz.*(truncated or damaged|not the shard).*elete it"):
        TokenDataset.load(shard_dir)
    with pytest.raises(ValueError, match="shard-00001.npz' is not a spec_jax token dataset, or is truncated"):
        TokenDataset.load(shard)


@pytest.mark.parametrize("setting", ["shard_prompts", "batch_size", "max_new_tokens"])
def test_zero_sizes_are_refused_before_anything_is_written(chat_target, tmp_path, setting):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        build_dataset(chat_target, PROMPTS, shard_dir=tmp_path / "d", **{**KW, setting: 0})
    with pytest.raises(ValueError, match="number of prompts must be an integer >= 1"):
        build_dataset(chat_target, [], shard_dir=tmp_path / "d", **KW)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flag", ["--shard-prompts", "--generate-batch", "--num-prompts", "--answer-tokens"])
def test_cli_zero_sizes_are_one_error_line(tmp_path, capsys, flag):
    from spec_jax.app.main import main

    code = main(["train", "data", "--target", str(tmp_path / "never-loaded"), "--data", str(tmp_path / "d"),
                 flag, "0", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "must be an integer >= 1" in err[0]
    assert not (tmp_path / "d").exists()


def test_a_second_writer_is_refused_and_a_dead_ones_lock_taken_over(chat_target, tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    lock = directory / LOCK_NAME
    import socket

    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))  # a live process
    with pytest.raises(ValueError, match="being written by another `spec-jax train data`"):
        build_dataset(chat_target, PROMPTS[:2], shard_dir=directory, **KW)
    assert not (directory / MANIFEST).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    build_dataset(chat_target, PROMPTS[:2], shard_dir=directory, **KW)
    assert not lock.exists() and len(TokenDataset.load(directory)) == 2


def test_a_v1_dir_still_loads_and_resumes_with_a_warning(chat_target, shard_dir, finished, monkeypatch):
    """Dirs written before this change (v1 manifest: no target, no hashes; shards without their
    request) load as before; resuming one adopts it for this target, says so, and records hashes."""
    manifest = json.loads((shard_dir / MANIFEST).read_text())
    v1 = {k: manifest[k] for k in ("prompts_sha256", "num_prompts", "shard_prompts", "max_new_tokens",
                                   "temperature", "seed")}
    (shard_dir / MANIFEST).write_text(json.dumps({"format": "spec_jax token dataset shards v1", **v1}))
    for shard in shard_dir.glob("shard-*.npz"):
        TokenDataset.load(shard).save(shard)  # no request inside, as v1 wrote them
    assert np.array_equal(TokenDataset.load(shard_dir).tokens, finished[1].tokens)
    no_generation(monkeypatch)
    with pytest.warns(UserWarning, match="before shard dirs recorded their target"):
        build_dataset(chat_target, PROMPTS, shard_dir=shard_dir, **KW)
    upgraded = json.loads((shard_dir / MANIFEST).read_text())
    assert upgraded["format"].endswith("v2") and len(upgraded["shards"]) == 2
    assert np.array_equal(TokenDataset.load(shard_dir).tokens, finished[1].tokens)
