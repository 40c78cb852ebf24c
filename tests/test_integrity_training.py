"""Training runs and their caches carry their provenance: the run config records the target's
weights hash and the data's hash; a damaged checkpoint is told apart from another shape and the
previous step resumes; schedule-only settings do not block a resume; a resumed run's log keeps
its history; every interval is checked up front; cached target features are checksummed."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.training.trainer import TrainConfig, train

CFG = TrainConfig(steps=6, batch_size=2, seq_len=2, learning_rate=0.1, warmup_steps=1, save_every=2,
                  log_every=1)
INIT = {"w": jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 10}


def loss_fn(params, frozen, batch, key):
    err = batch["x"] @ params["w"] - batch["y"]
    return jnp.mean(err**2), {"accuracy": jnp.mean(jnp.abs(err) < 0.1)}


def batches(start):
    step = start
    while True:
        rng = np.random.RandomState(step)
        yield {"x": rng.randn(2, 4).astype(np.float32), "y": rng.randn(2, 3).astype(np.float32)}
        step += 1


def run(out, run_config, cfg=CFG, init=INIT, **kwargs):
    return train(loss_fn, init, None, batches, cfg, out, run_config, progress=False, **kwargs)


RUN = {"kind": "toy", "target_sha256": "a" * 64, "data_sha256": "b" * 64, "drafter": {"ids": (1, 2)}}


def test_runs_record_target_and_data_and_refuse_another_target(monkeypatch, models):
    """Issue 33, case 4: a run resumed with another target (weights x 1.01) continued silently."""
    import spec_jax.training.run as run_lib
    from spec_jax.training.data import TokenDataset
    from spec_jax.training.provenance import weights_sha256

    seen = {}

    def capture(loss, init, frozen, batches, cfg, out_dir, run_config=None, **kwargs):
        seen.update(run_config)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_lib, "train", capture)
    monkeypatch.setattr(run_lib, "init_draft_from_target", lambda *args: {})  # not what this test is about
    rng = np.random.RandomState(0)
    data = TokenDataset.from_sequences([rng.randint(0, 100, 12) for _ in range(8)], [4] * 8, ["t"] * 8)
    target = dataclasses.make_dataclass("T", ["cfg", "params", "tokenizer"])(models.cfg, models.params, None)
    student = models.draft_cfg.replace(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)
    cfg = dataclasses.replace(CFG, seq_len=12)
    with pytest.raises(KeyboardInterrupt):
        run_lib.train_draft_model(target, data, "unused", cfg, student, kl_weight=0.0, progress=False)
    trained_on = run_lib.held_out_prompts(target, data, 4, cfg.seed, cfg.seq_len)[0]  # the held-out split removed
    assert seen["target_sha256"] == weights_sha256(models.params)
    assert seen["data_sha256"] == trained_on.content_sha256()
    other = jax.tree_util.tree_map(lambda x: x * 1.01, models.params)
    assert weights_sha256(other) != seen["target_sha256"]


def test_another_target_or_settings_are_refused_with_a_normalised_diff(tmp_path):
    run(tmp_path, RUN, stop_after=2)
    with pytest.raises(ValueError, match=r"different run.*'target_sha256': \('aaaa"):
        run(tmp_path, {**RUN, "target_sha256": "c" * 64})
    with pytest.raises(ValueError, match="different run") as error:
        run(tmp_path, {**RUN, "kind": "other"})
    assert "drafter" not in str(error.value)  # (1, 2) saved as a JSON list is the same value


def test_schedule_only_settings_do_not_block_a_resume_and_the_log_is_merged(tmp_path):
    full = run(None, RUN)
    first = run(tmp_path, RUN, stop_after=4)
    assert first.summary.startswith("trained 4 steps")
    later = dataclasses.replace(CFG, save_every=3, eval_every=5, log_every=1)
    resumed = run(tmp_path, RUN, cfg=later)
    assert resumed.start_step == 4 and resumed.summary.startswith("resumed from step 4, trained 2 steps")
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert np.array_equal(resumed.state.params["w"], full.state.params["w"])


def test_checkpoints_from_before_provenance_resume_with_a_warning(tmp_path):
    old = {k: v for k, v in RUN.items() if k not in ("target_sha256", "data_sha256")}
    run(tmp_path, old, stop_after=2)
    with pytest.warns(UserWarning, match="predates the record of target_sha256, data_sha256"):
        assert run(tmp_path, RUN).start_step == 2


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_step(tmp_path):
    full = run(None, RUN)
    run(tmp_path, RUN, stop_after=4)  # steps 2 and 4 saved
    for f in (tmp_path / "checkpoints" / "4" / "state").rglob("d/*"):
        raw = bytearray(f.read_bytes())
        for i in range(len(raw) // 3, len(raw)):
            raw[i] ^= 0x5A
        f.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match=r"checkpoints/4 is damaged \(.{0,260}\)\. Resuming from step 2") as warned:
        resumed = run(tmp_path, RUN)
    assert all(len(str(w.message)) < 700 for w in warned)
    assert resumed.start_step == 2 and int(resumed.state.step) == CFG.steps
    assert np.array_equal(resumed.state.params["w"], full.state.params["w"])  # bit-identical
    assert [p.name.split("-")[0] for p in (tmp_path / "checkpoints-corrupt").iterdir()] == ["4"]


def test_another_shape_is_not_called_damage(tmp_path):
    run(tmp_path, RUN, stop_after=2)
    with pytest.raises(ValueError, match=r"does not match this model: opt_state/.*w is \(4, 3\) there, \(4, 5\) here"):
        run(tmp_path, RUN, init={"w": jnp.zeros((4, 5))})
    assert not (tmp_path / "checkpoints-corrupt").exists()


@pytest.mark.parametrize("field, value", [("save_every", 0), ("log_every", 0), ("eval_every", -1),
                                          ("warmup_steps", -1), ("learning_rate", float("nan")),
                                          ("seed", 2**40), ("steps", 2.5)])
def test_every_training_setting_is_checked_up_front(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CFG, **{field: value})


def test_cli_save_every_zero_is_one_error_line_before_any_work(tmp_path, capsys):
    from spec_jax.app.main import main

    code = main(["train", "dflash", "--target", str(tmp_path / "never-loaded"), "--data", str(tmp_path / "d.npz"),
                 "--out", str(tmp_path / "out"), "--save-every", "0", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: save_every must be an integer >= 1 and <= 2147483647, got 0."]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- target features
@pytest.fixture
def feature_store(models, tmp_path):
    from spec_jax.training.data import TokenDataset
    from spec_jax.training.features import compute_features

    rng = np.random.RandomState(1)
    data = TokenDataset.from_sequences([rng.randint(0, 100, 10) for _ in range(6)], [3] * 6, ["t"] * 6)
    store = tmp_path / "store"

    def compute():
        return compute_features(models.params, models.cfg, data, (0,), 8, progress=False, store=store, batch_size=8)

    return store, compute, compute()


def test_flipped_feature_bytes_are_refused(feature_store):
    """Issue 33, case 5: bytes flipped in a cached captured.npy were trained on silently."""
    store, compute, first = feature_store
    raw = bytearray((store / "captured.npy").read_bytes())
    raw[-40] ^= 0xFF
    (store / "captured.npy").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"store is damaged \(rows 0..48 of captured.npy differ from their "
                                         r"recorded sha256\); delete that directory"):
        compute()


def test_broken_feature_cache_files_name_themselves(feature_store):
    store, compute, _ = feature_store
    with open(store / "final.npy", "r+b") as f:
        f.truncate(200)
    with pytest.raises(ValueError, match=r"store is damaged \(final.npy: .*\); delete that directory"):
        compute()
    (store / "features.json").write_text('{"target_sha256": ')
    with pytest.raises(ValueError, match=r"features.json is damaged \(JSONDecodeError"):
        compute()


def test_a_feature_store_from_before_checksums_is_reused_and_gets_them(feature_store, monkeypatch):
    import spec_jax.training.features as features_lib

    store, compute, first = feature_store
    manifest = json.loads((store / "features.json").read_text())
    (store / "features.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "chunks"}))
    monkeypatch.setattr(features_lib, "jitted_target_features", None)  # a rerun would call it
    again = compute()
    np.testing.assert_array_equal(again.captured, first.captured)
    assert json.loads((store / "features.json").read_text())["chunks"] == manifest["chunks"]


def test_a_feature_pass_refuses_a_second_writer(models, tmp_path):
    import os
    import socket

    from spec_jax.training.data import TokenDataset
    from spec_jax.training.features import compute_features
    from spec_jax.training.provenance import LOCK_NAME

    store = tmp_path / "store"
    store.mkdir()
    (store / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    data = TokenDataset.from_sequences([np.arange(6)] * 2, [2] * 2, ["t"] * 2)
    with pytest.raises(ValueError, match="being written by another `target-feature pass`"):
        compute_features(models.params, models.cfg, data, (0,), 8, progress=False, store=store)
    assert not (store / "features.json").exists()
