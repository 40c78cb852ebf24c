"""Drafter training: loss goes down, checkpoints restore exactly, resume == uninterrupted,
bad checkpoints fail clearly, and exported drafters load and stay exact."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.checkpoints.dflash import load_dflash
from spec_jax.decoding import generate
from spec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_layers, init_dflash_params
from spec_jax.drafters.draft_vocab import head_rows
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.models import Decoder, ModelConfig, Target, init_params
from spec_jax.training.data import TokenDataset, frequent_draft_vocab, iterate_batches
from spec_jax.training.dflash import DFlashLoss
from spec_jax.training.draft_model import DraftModelLoss
from spec_jax.training.eagle3 import Eagle3Loss
from spec_jax.training.features import compute_features, gather_features
from spec_jax.training.trainer import Checkpointer, TrainConfig, TrainState, make_optimizer, train

SEQ_LEN = 40
TARGET = ModelConfig(
    vocab_size=101, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16, architecture="qwen3", qk_norm=True, eos_token_ids=(),
)
DFLASH = DFlashConfig(
    layer=dflash_layers(1, 64, 4, 2, 16, 128, vocab_size=101),
    block_size=4, target_layer_ids=(1, 2), mask_token_id=100, num_target_layers=4,
)
# An EAGLE-3 head over the same features (aux ids 2, 3 = captures 1, 2) and all 101 tokens.
EAGLE3 = Eagle3Config(layer=TARGET.replace(num_layers=1),
                      draft_vocab_size=101, aux_layer_ids=(2, 3), own_embedding=False)
STUDENT = ModelConfig(
    vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16, tie_embeddings=True,
)


@pytest.fixture(scope="module")
def setup():
    target_params = init_params(TARGET, jax.random.key(0), scale=3.0)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, 100, rng.randint(3, 9))) for _ in range(32)]
    out = generate((TARGET, target_params), prompts, max_new_tokens=24)
    data = TokenDataset.from_sequences(
        [p + g for p, g in zip(prompts, out.generated_ids)], [len(p) for p in prompts], ["test"] * 32
    )
    features = compute_features(target_params, TARGET, data, DFLASH.target_layer_ids, SEQ_LEN, progress=False)
    return target_params, data, features, prompts


def _batches(data, features, cfg):
    def batches(start):
        for b in iterate_batches(data, cfg.batch_size, cfg.seq_len, cfg.seed, start):
            captured, final = gather_features(data, features, b.picks, cfg.seq_len)
            yield dict(tokens=b.tokens, lengths=b.lengths, prompt_lengths=b.prompt_lengths,
                       captured=captured, final=final)
    return batches


CFG = TrainConfig(steps=40, batch_size=8, seq_len=SEQ_LEN, learning_rate=3e-3, warmup_steps=5,
                  save_every=10, log_every=10)


def _tree_equal(a, b) -> bool:
    return all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)))


def _eagle3_float_params(key):
    params = init_eagle3_params(EAGLE3, key)
    params.pop("d2t")  # the vocabulary map is the loss's, not a trained weight
    return params


@pytest.mark.parametrize("kind", ["dflash", "dflash_draft_vocab", "draft_model", "eagle3"])
def test_a_few_steps_reduce_the_loss(setup, kind):
    target_params, data, features, _ = setup
    if kind == "dflash":
        loss, params = DFlashLoss(DFLASH, TARGET, num_anchors=4, kl_weight=0.5), init_dflash_params(DFLASH, jax.random.key(1))
    elif kind == "dflash_draft_vocab":  # its own head over 60 of the 101 tokens, KL restricted to them
        cfg = dataclasses.replace(DFLASH, draft_vocab_size=60)
        ids = frequent_draft_vocab(data, 60)
        loss = DFlashLoss(cfg, TARGET, num_anchors=4, kl_weight=0.5, draft_ids=tuple(int(i) for i in ids))
        params = init_dflash_params(cfg, jax.random.key(1))
        params.pop("d2t")  # the vocabulary map is the loss's, not a trained weight
        params["lm_head"] = jnp.asarray(head_rows(Target(target_params, Decoder(TARGET)), ids))  # as `train dflash` starts it
    elif kind == "eagle3":
        loss, params = Eagle3Loss(EAGLE3, TARGET, tuple(range(101))), _eagle3_float_params(jax.random.key(1))
    else:
        loss, params = DraftModelLoss(STUDENT, TARGET), init_params(STUDENT, jax.random.key(1))
    result = train(loss, params, target_params, _batches(data, features, CFG), CFG, None, progress=False)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    assert last < 0.9 * first, (first, last)
    # Accuracy on one fixed batch, averaged over many anchor/position draws (a single training
    # step's accuracy is too noisy to compare), before and after training.
    batch = next(_batches(data, features, CFG)(0))
    evaluate = jax.jit(lambda p, b, key: loss(p, target_params, b, key)[1]["accuracy"])
    keys = jax.random.split(jax.random.key(42), 16)
    before = float(np.mean([evaluate(params, batch, k) for k in keys]))
    after = float(np.mean([evaluate(result.state.params, batch, k) for k in keys]))
    assert after > before, (before, after)


@pytest.mark.parametrize("kind", ["dflash", "draft_model"])
def test_grown_drafter_starts_as_the_saved_one(setup, kind):
    """identity_layers_appended: a 1-layer drafter grown to 3 layers gives the same loss and
    accuracy on the same batch (the new layers add nothing to the residual stream), and training
    moves the zeroed projections at once."""
    from spec_jax.training.run import identity_layers_appended

    target_params, data, features, _ = setup
    if kind == "dflash":
        deep_cfg = dataclasses.replace(DFLASH, layer=DFLASH.layer.replace(num_layers=3, layer_types=()))
        shallow, deep_loss = init_dflash_params(DFLASH, jax.random.key(1)), DFlashLoss(deep_cfg, TARGET, num_anchors=4)
        shallow_loss, fresh = DFlashLoss(DFLASH, TARGET, num_anchors=4), init_dflash_params(deep_cfg, jax.random.key(2))
    else:
        deep_cfg = STUDENT.replace(num_layers=3)
        shallow, deep_loss = init_params(STUDENT, jax.random.key(1)), DraftModelLoss(deep_cfg, TARGET)
        shallow_loss, fresh = DraftModelLoss(STUDENT, TARGET), init_params(deep_cfg, jax.random.key(2))
    grown = identity_layers_appended(jax.device_get(shallow), fresh["layers"][1:])
    assert len(grown["layers"]) == 3 and _tree_equal(grown["layers"][0], shallow["layers"][0])
    batch = next(_batches(data, features, CFG)(0))
    key = jax.random.key(5)
    # Under jit, as the train step runs them (eagerly each op of the losses compiles on its own).
    before = jax.jit(shallow_loss)(shallow, target_params, batch, key)
    after = jax.jit(deep_loss)(jax.tree_util.tree_map(jnp.asarray, grown), target_params, batch, key)
    np.testing.assert_allclose(float(after[0]), float(before[0]), rtol=1e-6)
    np.testing.assert_allclose(float(after[1]["accuracy"]), float(before[1]["accuracy"]))
    grads = jax.jit(jax.grad(lambda p, t, b, k: deep_loss(p, t, b, k)[0]))(
        jax.tree_util.tree_map(jnp.asarray, grown), target_params, batch, key)
    assert float(jnp.abs(grads["layers"][2]["w_down"]).max()) > 0


def test_save_restore_is_exact(tmp_path, setup):
    params = init_dflash_params(DFLASH, jax.random.key(3))
    opt = make_optimizer(CFG)
    opt_state = opt.init(params)
    # Take one update so the optimizer state is not all zeros.
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    state = TrainState(step=jnp.asarray(7, jnp.int32), params=params, opt_state=opt_state)
    ckpt = Checkpointer(tmp_path, {"run": "a"})
    ckpt.save(state)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state)
    restored = ckpt.restore(abstract)
    ckpt.close()
    assert int(restored.step) == 7
    assert _tree_equal(restored.params, state.params)
    assert _tree_equal(restored.opt_state, state.opt_state)


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, setup):
    target_params, data, features, _ = setup
    loss = DFlashLoss(DFLASH, TARGET, num_anchors=4)
    p0 = init_dflash_params(DFLASH, jax.random.key(1))
    batches = _batches(data, features, CFG)
    full = train(loss, p0, target_params, batches, CFG, None, progress=False)
    partial = train(loss, p0, target_params, batches, CFG, tmp_path, {"r": 1}, stop_after=20, progress=False)
    assert int(partial.state.step) == 20
    resumed = train(loss, p0, target_params, batches, CFG, tmp_path, {"r": 1}, progress=False)
    assert int(resumed.state.step) == CFG.steps
    assert _tree_equal(full.state.params, resumed.state.params)
    assert _tree_equal(full.state.opt_state, resumed.state.opt_state)


def test_corrupt_or_mismatched_checkpoint_is_a_clear_error(tmp_path, setup):
    target_params, data, features, _ = setup
    loss = DFlashLoss(DFLASH, TARGET, num_anchors=4)
    p0 = init_dflash_params(DFLASH, jax.random.key(1))
    batches = _batches(data, features, CFG)
    train(loss, p0, target_params, batches, CFG, tmp_path / "run", {"r": 1}, stop_after=10, progress=False)
    # Same directory, other settings: refuses to mix runs.
    with pytest.raises(ValueError, match="different run"):
        train(loss, p0, target_params, batches, CFG, tmp_path / "run", {"r": 2}, progress=False)
    # Same settings, but a drafter of another shape.
    wide = dataclasses.replace(DFLASH, layer=DFLASH.layer.replace(intermediate_size=96))
    with pytest.raises(ValueError, match="does not match"):
        train(DFlashLoss(wide, TARGET, num_anchors=4), init_dflash_params(wide, jax.random.key(1)),
              target_params, batches, CFG, tmp_path / "run", {"r": 1}, progress=False)
    # Corrupt: the saved files are clobbered.
    step_dir = next(p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt|does not match|different run"):
        train(loss, p0, target_params, batches, CFG, tmp_path / "run", {"r": 1}, progress=False)


def test_dataset_roundtrip_and_missing_file(tmp_path, setup):
    _, data, _, _ = setup
    data.save(tmp_path / "d.npz")
    back = TokenDataset.load(tmp_path / "d.npz")
    assert np.array_equal(back.tokens, data.tokens) and np.array_equal(back.offsets, data.offsets)
    train_part, held = data.split(0.25)
    assert len(train_part) + len(held) == len(data)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenDataset.load(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a spec_jax token dataset"):
        TokenDataset.load(tmp_path / "bad.npz")


def test_trained_dflash_exports_loads_and_stays_exact(tmp_path, setup):
    from spec_jax.checkpoints.dflash import save_dflash

    target_params, data, features, prompts = setup
    loss = DFlashLoss(DFLASH, TARGET, num_anchors=4)
    result = train(loss, init_dflash_params(DFLASH, jax.random.key(1)), target_params,
                   _batches(data, features, CFG), CFG, None, progress=False)
    save_dflash(tmp_path / "drafter", DFLASH, jax.device_get(result.state.params))
    drafter, params = load_dflash(tmp_path / "drafter")
    assert drafter.cfg == DFLASH
    ar = generate((TARGET, target_params), prompts[:8], max_new_tokens=24)
    before = generate((TARGET, target_params), prompts[:8], DFlashDrafter(DFLASH),
                      init_dflash_params(DFLASH, jax.random.key(1)), max_new_tokens=24)
    spec = generate((TARGET, target_params), prompts[:8], drafter, params, max_new_tokens=24)
    assert spec.generated_ids == ar.generated_ids
    # Training on the target's own continuations makes its drafts accepted more often.
    assert spec.stats.tau > before.stats.tau


def test_trained_eagle3_multi_step_stays_exact_and_drafts_better(setup):
    """Multi-step training: the chain's later drafts (fed the drafter's own features) are
    accepted more often than an untrained head's, and generation stays AR-identical."""
    target_params, data, features, prompts = setup
    loss = Eagle3Loss(EAGLE3, TARGET, tuple(range(101)), ttt_steps=3)
    p0 = _eagle3_float_params(jax.random.key(1))
    cfg = dataclasses.replace(CFG, steps=80)
    result = train(loss, p0, target_params, _batches(data, features, cfg), cfg, None, progress=False)
    assert result.history[-1]["acc_2"] > result.history[0]["acc_2"]  # the third chain step learned
    d2t = jnp.zeros((101,), jnp.int32)
    drafter = Eagle3Drafter(EAGLE3, k=3)
    ar = generate((TARGET, target_params), prompts[:8], max_new_tokens=24)
    before = generate((TARGET, target_params), prompts[:8], drafter, {**p0, "d2t": d2t}, max_new_tokens=24)
    spec = generate((TARGET, target_params), prompts[:8], drafter, {**result.state.params, "d2t": d2t},
                    max_new_tokens=24)
    assert spec.generated_ids == ar.generated_ids
    assert spec.stats.tau > before.stats.tau
    assert spec.stats.acceptance_histogram[2] + spec.stats.acceptance_histogram[3] > 0  # chains accepted


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, setup):
    """kind -> (the `spec-jax train KIND` arguments without --out/--steps, the out dir of a 6-step
    run with them, the target dir): each kind trains once, shared by the tests that load it and
    continue from it. No held-out tau (--eval-prompts 0: each would compile a decoding loop; the
    tests decode the exports themselves, and test_medusa / test_registry run the CLI's tau)."""
    from spec_jax.app.main import main
    from spec_jax.checkpoints import save_hf_dir

    target_params, data, _, _ = setup
    root = tmp_path_factory.mktemp("cli_runs")
    save_hf_dir(root / "target", TARGET, jax.device_get(target_params))
    data.save(root / "data.npz")
    runs = {}

    def run(kind):
        if kind not in runs:
            common = ["train", kind, "--target", str(root / "target"), "--data", str(root / "data.npz"),
                      "--batch-size", "4", "--seq-len", str(SEQ_LEN), "--block-size", "4", "--layers", "1",
                      "--hidden", "64", "--eval-every", "0", "--eval-prompts", "0", "--no-progress"]
            assert main(common + ["--out", str(root / kind), "--steps", "6"]) == 0
            runs[kind] = (common, root / kind, root / "target")
        return runs[kind]

    return run


@pytest.mark.parametrize("kind", ["dflash", "draft-model", "eagle3"])
def test_cli_train_exports_a_drafter_generate_loads(setup, capsys, cli_run, kind):
    from spec_jax.app.main import main

    prompts = setup[3]
    _, out, target_dir = cli_run(kind)
    assert (out / "training_curve.png").stat().st_size > 0
    assert (out / "training_log.json").is_file()
    ids = ",".join(map(str, prompts[0]))
    common = ["generate", "--target", str(target_dir), "--prompt-ids", ids,
              "--max-new-tokens", "12", "--json"]
    capsys.readouterr()
    assert main(common) == 0
    ar = capsys.readouterr().out
    assert main(common + ["--drafter", f"{kind}={out / 'drafter'}"]) == 0
    spec = capsys.readouterr().out
    import json

    assert json.loads(spec)["results"][0]["generated_ids"] == json.loads(ar)["results"][0]["generated_ids"]


@pytest.mark.parametrize("kind", ["dflash", "draft-model", "eagle3"])
def test_cli_init_from_continues_from_an_exported_drafter(tmp_path, setup, capsys, cli_run, kind):
    """--init-from starts from the exported drafter's exact weights (the schedule's first step has
    learning rate 0, so a 1-step run exports them unchanged), a DFlash one also into another block
    size; a drafter of another shape and a bad --data-sequences are clear errors."""
    import json

    from spec_jax.app.main import main
    from spec_jax.checkpoints.hf import load_hf_dir

    data = setup[1]
    common, first, _ = cli_run(kind)
    second = tmp_path / "second"
    assert main(common + ["--out", str(second), "--steps", "1", "--init-from", str(first / "drafter"),
                          "--data-sequences", "20"]) == 0

    def exported(run):
        if kind == "dflash":
            return load_dflash(run / "drafter")[1]
        if kind == "eagle3":
            from spec_jax.checkpoints.eagle3 import load_eagle3

            return load_eagle3(run / "drafter")[1]
        return load_hf_dir(run / "drafter", "float32")[1]

    assert _tree_equal(exported(first), exported(second))
    meta = json.loads((second / "training_log.json").read_text())
    assert meta["init_from"] == str(first / "drafter") and meta["data_sequences"] < len(data)
    assert meta["evals"] == [] and meta["held_out"].startswith("none")
    if kind == "dflash":  # no DFlash weight depends on the block size: block 4 warm-starts block 8
        wider = common + ["--out", str(tmp_path / "wider"), "--steps", "1", "--init-from", str(first / "drafter")]
        wider[wider.index("--block-size") + 1] = "8"
        assert main(wider) == 0
        drafter, params = load_dflash(tmp_path / "wider" / "drafter")
        assert drafter.cfg.block_size == 8 and _tree_equal(params, exported(first))
    if kind == "eagle3":  # one fixed layer: nothing to grow
        return

    # A larger --layers grows the saved drafter: its layer carries over, the new one starts as
    # the identity (zero output projections; unchanged by the lr-0 first step).
    deeper = common + ["--out", str(tmp_path / "deeper"), "--steps", "1", "--init-from", str(first / "drafter")]
    deeper[deeper.index("--layers") + 1] = "2"
    assert main(deeper) == 0
    grown = exported(tmp_path / "deeper")
    assert len(grown["layers"]) == 2 and _tree_equal(grown["layers"][0], exported(first)["layers"][0])
    assert not np.any(grown["layers"][1]["wo"]) and not np.any(grown["layers"][1]["w_down"])
    assert np.any(grown["layers"][1]["wq"])

    capsys.readouterr()
    other = common + ["--out", str(tmp_path / "bad"), "--steps", "1", "--init-from", str(tmp_path / "deeper" / "drafter")]
    assert main(other) == 2  # fewer layers than the saved drafter: not a growth
    err = capsys.readouterr().err
    assert "--init-from" in err and "num_layers: 2 there, 1 here" in err, err
    assert not (tmp_path / "bad" / "drafter").exists()
    assert main(common + ["--out", str(tmp_path / "bad"), "--data-sequences", "1000"]) == 2
    assert f"holds {len(data)} sequences" in capsys.readouterr().err


def test_cli_dflash_draft_vocab_from_a_full_vocabulary_drafter(tmp_path, setup, capsys, cli_run):
    """`train dflash --draft-vocab N --init-from FULL`: the full-vocabulary drafter's weights carry
    over, its head becomes the target's rows of the data's N most frequent answer tokens, the export
    is in the speculators format and generates AR-identically; continuing from it keeps its vocabulary."""
    import json

    from spec_jax.app.main import main
    from spec_jax.training.run import held_out_prompts

    target_params, data, _, prompts = setup
    common, full, _ = cli_run("dflash")  # 6 steps of the full-vocabulary drafter
    reduced, again = tmp_path / "reduced", tmp_path / "again"
    assert main(common + ["--out", str(reduced), "--steps", "1", "--draft-vocab", "40",
                          "--init-from", str(full / "drafter")]) == 0
    assert json.loads((reduced / "drafter" / "config.json").read_text())["speculators_model_type"] == "dflash"
    full_drafter, full_params = load_dflash(full / "drafter")
    drafter, params = load_dflash(reduced / "drafter")
    assert drafter.cfg.draft_vocab_size == 40
    ids = np.arange(40) + params["d2t"]
    trained_on, _, _ = held_out_prompts(None, data, 0, 0, SEQ_LEN)  # no held-out split: all of it
    np.testing.assert_array_equal(ids, frequent_draft_vocab(trained_on, 40))
    np.testing.assert_array_equal(params["lm_head"], np.asarray(target_params["lm_head"])[:, ids])
    assert _tree_equal({k: v for k, v in params.items() if k not in ("lm_head", "d2t")}, full_params)
    ar = generate((TARGET, target_params), prompts[:8], max_new_tokens=16)
    spec = generate((TARGET, target_params), prompts[:8], drafter, params, max_new_tokens=16)
    assert spec.generated_ids == ar.generated_ids
    assert main(common + ["--out", str(again), "--steps", "1", "--draft-vocab", "40",
                          "--init-from", str(reduced / "drafter"), "--data-sequences", "20"]) == 0
    assert _tree_equal(load_dflash(again / "drafter")[1], params)


def test_per_step_target_features_equal_precomputed(setup):
    """Running the frozen target inside the step gives the loss precomputed features give."""
    from spec_jax.training.features import WithTargetFeatures

    target_params, data, features, _ = setup
    batch = next(_batches(data, features, CFG)(0))
    tokens_only = {k: batch[k] for k in ("tokens", "lengths", "prompt_lengths")}
    params = init_dflash_params(DFLASH, jax.random.key(1))
    key = jax.random.key(3)
    loss = DFlashLoss(DFLASH, TARGET, num_anchors=4, kl_weight=0.5)
    pre, pre_metrics = loss(params, target_params, batch, key)
    now, now_metrics = WithTargetFeatures(loss, TARGET, DFLASH.target_layer_ids)(params, target_params, tokens_only, key)
    np.testing.assert_allclose(float(now), float(pre), rtol=1e-5)
    np.testing.assert_allclose(float(now_metrics["kl"]), float(pre_metrics["kl"]), rtol=1e-5, atol=1e-7)


def test_bfloat16_features_keep_the_first_seq_len_tokens_at_half_the_memory(setup):
    """precompute-bf16: only each sequence's first seq_len tokens are stored (what training
    reads), in bfloat16; batches come back float32, within bfloat16 rounding of the float32 ones,
    and the loss barely moves."""
    import ml_dtypes

    target_params, data, features, _ = setup
    short = 24  # shorter than most sequences: their tails are not stored
    f32 = compute_features(target_params, TARGET, data, DFLASH.target_layer_ids, short, progress=False)
    bf16 = compute_features(target_params, TARGET, data, DFLASH.target_layer_ids, short, progress=False,
                            dtype=ml_dtypes.bfloat16)
    assert bf16.captured.dtype == ml_dtypes.bfloat16 and bf16.captured.nbytes * 2 == f32.captured.nbytes
    assert f32.captured.shape[0] == sum(min(len(data.sequence(i)), short) for i in range(len(data))) < data.num_tokens
    picks = [0, 5, 9]
    a, b = gather_features(data, f32, picks, short), gather_features(data, bf16, picks, short)
    for x, y in zip(a, b):
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, x, rtol=1e-2, atol=1e-2)
    # The stored prefix equals the full-length features' first `short` positions.
    full_cap, _ = gather_features(data, features, picks, SEQ_LEN)
    np.testing.assert_allclose(a[0], full_cap[:, :short], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_feature_store_resumes_an_interrupted_pass_and_refuses_another(setup, tmp_path, monkeypatch, dtype):
    """On disk (memory-mapped): the stored features equal the in-memory ones; a pass interrupted
    after some sequences redoes only the rest; a finished store is reused without running the
    target; another target or dataset is refused rather than overwritten."""
    import json

    import ml_dtypes

    import spec_jax.training.features as features_lib

    target_params, data, _, _ = setup
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    layers, store = DFLASH.target_layer_ids, tmp_path / "features"
    kwargs = dict(progress=False, dtype=np_dtype, batch_size=4)
    memory = compute_features(target_params, TARGET, data, layers, SEQ_LEN, **kwargs)
    monkeypatch.setattr(features_lib, "STORE_FLUSH_EVERY", 8)  # a save every 2 batches of 4

    # Interrupt the target pass during its 5th batch: 16 sequences were saved, the 17th.. were not.
    calls = {"n": 0}
    real = features_lib.jitted_target_features

    def interrupted(*args):
        run = real(*args)

        def counted(*inputs):
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt
            return run(*inputs)

        return counted

    monkeypatch.setattr(features_lib, "jitted_target_features", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compute_features(target_params, TARGET, data, layers, SEQ_LEN, store=store, **kwargs)
    manifest = json.loads((store / features_lib.STORE_MANIFEST).read_text())
    assert manifest["sequences_done"] == 16 and not manifest["complete"]

    calls["n"] = -100  # the resumed pass runs the remaining 16 sequences only
    resumed = compute_features(target_params, TARGET, data, layers, SEQ_LEN, store=store, **kwargs)
    assert calls["n"] == -100 + 4
    assert isinstance(resumed.captured, np.memmap) and resumed.captured.dtype == np_dtype
    np.testing.assert_array_equal(resumed.offsets, memory.offsets)
    np.testing.assert_array_equal(resumed.captured, memory.captured)
    np.testing.assert_array_equal(resumed.final, memory.final)
    assert json.loads((store / features_lib.STORE_MANIFEST).read_text())["complete"]

    def must_not_run(*args):
        raise AssertionError("a finished store must be reused, not recomputed")

    monkeypatch.setattr(features_lib, "jitted_target_features", must_not_run)
    again = compute_features(target_params, TARGET, data, layers, SEQ_LEN, store=store, **kwargs)
    np.testing.assert_array_equal(again.final, memory.final)

    other = jax.tree_util.tree_map(lambda x: x * 1.01, target_params)
    with pytest.raises(ValueError, match="another pass.*target_sha256"):
        compute_features(other, TARGET, data, layers, SEQ_LEN, store=store, **kwargs)
    with pytest.raises(ValueError, match="data_sha256.*delete it"):
        compute_features(target_params, TARGET, data.subset(range(8)), layers, SEQ_LEN, store=store, **kwargs)


def test_dataset_parts_survive_joins_and_ordered_subsets(setup):
    """`parts` remembers the files/shards a dataset was joined from; ordered subsets keep them
    (empty parts dropped), an unordered pick is one part, and a bad count is refused."""
    _, data, _, _ = setup
    a, b = data.subset(range(0, 10)), data.subset(range(10, 32))
    joined = TokenDataset.concatenate([a, TokenDataset.concatenate([b.subset(range(0, 5)), b.subset(range(5, 22))])])
    assert joined.parts == (10, 5, 17)
    assert [len(p) for p in joined.part_datasets()] == [10, 5, 17]
    np.testing.assert_array_equal(joined.part_datasets()[1].tokens, b.subset(range(0, 5)).tokens)
    assert joined.subset([1, 2, 20, 31]).parts == (2, 2)
    assert joined.subset(range(10, 15)).parts == (5,)
    train_part, held = joined.split(0.25, seed=0)
    assert sum(train_part.parts) == len(train_part) and len(train_part.parts) == 3
    assert joined.subset([20, 1]).parts == (2,)
    with pytest.raises(ValueError, match="do not add up"):
        TokenDataset(data.tokens, data.offsets, data.prompt_lengths, data.sources, (3, 4))


def test_feature_pool_computes_only_the_parts_it_has_not_seen(setup, tmp_path, monkeypatch):
    """A pool keeps each data part's features in its own store: adding a part to a mix runs the
    target over the new part only, and the joined features equal a single in-memory pass."""
    import spec_jax.training.features as features_lib

    target_params, data, _, _ = setup
    layers, pool = DFLASH.target_layer_ids, tmp_path / "pool"
    first, second = data.subset(range(0, 12)), data.subset(range(12, 32))
    mixed = TokenDataset.concatenate([first, second])
    seen = {"sequences": 0}
    real = features_lib.jitted_target_features

    def counted(*args):
        run = real(*args)

        def wrapped(params, tokens):
            seen["sequences"] += int(np.sum(np.any(np.asarray(tokens) != 0, axis=1)))
            return run(params, tokens)

        return wrapped

    monkeypatch.setattr(features_lib, "jitted_target_features", counted)
    features_lib.pooled_features(target_params, TARGET, first, layers, SEQ_LEN, pool, progress=False)
    assert seen["sequences"] == 12
    pooled = features_lib.pooled_features(target_params, TARGET, mixed, layers, SEQ_LEN, pool, progress=False)
    assert seen["sequences"] == 32  # only the 20 new ones
    assert len(list(pool.iterdir())) == 2
    memory = compute_features(target_params, TARGET, mixed, layers, SEQ_LEN, progress=False)
    np.testing.assert_array_equal(pooled.offsets, memory.offsets)
    picks = [0, 11, 12, 31, 5]
    for got, want in zip(gather_features(mixed, pooled, picks, SEQ_LEN), gather_features(mixed, memory, picks, SEQ_LEN)):
        np.testing.assert_array_equal(got, want)
    # An ordered subset keeps its parts: the stored ones are reused, only changed parts rerun.
    seen["sequences"] = 0
    features_lib.pooled_features(target_params, TARGET, mixed.subset(range(0, 20)), layers, SEQ_LEN, pool,
                                 progress=False)
    assert seen["sequences"] == 8 and len(list(pool.iterdir())) == 3
    # Fewer layers (a draft model's KL needs the final states only) read the stores made for more.
    seen["sequences"] = 0
    for fewer in [(), (layers[1],)]:
        part = features_lib.pooled_features(target_params, TARGET, mixed, fewer, SEQ_LEN, pool, progress=False)
        cap, fin = gather_features(mixed, part, picks, SEQ_LEN)
        want_cap, want_fin = gather_features(mixed, memory, picks, SEQ_LEN)
        np.testing.assert_array_equal(fin, want_fin)
        np.testing.assert_array_equal(cap, want_cap[..., TARGET.hidden_size * len(layers[:1]) :][..., : TARGET.hidden_size * len(fewer)])
    assert seen["sequences"] == 0 and len(list(pool.iterdir())) == 3
    # A directory holding one store of the whole dataset (written before pools) is reused as is.
    whole = tmp_path / "whole"
    compute_features(target_params, TARGET, mixed, layers, SEQ_LEN, store=whole, progress=False)
    seen["sequences"] = 0
    again = features_lib.pooled_features(target_params, TARGET, mixed, layers, SEQ_LEN, whole, progress=False)
    assert seen["sequences"] == 0 and not list(whole.glob("part-*"))
    np.testing.assert_array_equal(again.final, memory.final)


def test_teacher_labels_are_the_targets_own_greedy_tokens(setup):
    """On the target's own greedy answers, labels from its argmax are exactly the data's labels;
    on other text they differ (that is what they are for)."""
    target_params, data, features, _ = setup
    batch = next(_batches(data, features, CFG)(0))
    params = init_dflash_params(DFLASH, jax.random.key(1))
    key = jax.random.key(3)
    plain, _ = DFlashLoss(DFLASH, TARGET, num_anchors=4)(params, target_params, batch, key)
    teacher, _ = DFlashLoss(DFLASH, TARGET, num_anchors=4, teacher_labels=True)(params, target_params, batch, key)
    np.testing.assert_allclose(float(teacher), float(plain), rtol=1e-6)
    noisy = dict(batch, tokens=np.where(np.arange(SEQ_LEN) % 3 == 2, 5, batch["tokens"]).astype(np.int32))
    a, _ = DFlashLoss(DFLASH, TARGET, num_anchors=4)(params, target_params, noisy, key)
    b, _ = DFlashLoss(DFLASH, TARGET, num_anchors=4, teacher_labels=True)(params, target_params, noisy, key)
    assert abs(float(a) - float(b)) > 1e-3


def test_draft_model_loss_differentiates_past_one_attention_block():
    """A sequence longer than the live-length attention's KV block (128 slots on CPU): the
    student's loss still has gradients (its one pass attends to its own keys only)."""
    target_params = init_params(TARGET, jax.random.key(0))
    student = init_params(STUDENT, jax.random.key(1))
    t = 160
    tokens = jax.random.randint(jax.random.key(2), (2, t), 0, TARGET.vocab_size)
    b_positions = jnp.broadcast_to(jnp.arange(t), (2, t))
    final = jnp.take(target_params["embed"], tokens, axis=0) + 0.0 * b_positions[..., None]
    batch = {"tokens": tokens, "lengths": jnp.asarray([t, t - 5]), "prompt_lengths": jnp.asarray([10, 20]),
             "final": final}
    loss = DraftModelLoss(STUDENT, TARGET, positions=8)
    # Under jit, as the train step runs: the cache lengths are traced there.
    grads = jax.jit(jax.grad(lambda p: loss(p, target_params, batch, jax.random.key(3))[0]))(student)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree_util.tree_leaves(grads))
