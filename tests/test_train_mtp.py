"""`spec-jax train mtp` (issue 40): a Gemma 4 assistant trained against a frozen tiny Gemma 4
target (KV sharing, per-layer embeddings, k_eq_v; tests/tiny_configs.py) lowers its loss on a
fixed batch, exports a checkpoint `load_drafter('mtp')` reads back, and decodes greedily exactly
as plain decoding; the CLI builds the same recipe from its flags."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from spec_jax.checkpoints import LoadedModel
from spec_jax.checkpoints.shipped import load_drafter
from spec_jax.decoding import generate
from spec_jax.models import init_params
from spec_jax.training.data import TokenDataset
from spec_jax.training.mtp import MtpRecipe, train_mtp
from spec_jax.training.trainer import TrainConfig
from tiny_configs import TINY_GEMMA4

PROMPTS = [[5, 9, 3, 7, 1, 8], [3, 4, 3, 4, 3, 4], [11, 12, 13, 14, 15, 16, 17], [7, 7, 1, 9]]
NEW = 10
CFG = TrainConfig(steps=8, batch_size=4, seq_len=16, learning_rate=1e-2, warmup_steps=1, save_every=8, log_every=1)


@pytest.fixture(scope="module")
def gemma4():
    # One program for the random weights (eager, its ~50 ops each compile on their own).
    params = jax.jit(lambda key: init_params(TINY_GEMMA4, key, scale=3.0))(jax.random.key(0))
    return LoadedModel(TINY_GEMMA4, params, None, None, "tiny")


def greedy_mismatches(target, prompts, generated) -> list[tuple[int, int]]:
    """(row, position) where a generated token is not the target's argmax after the tokens
    before it, by one full forward pass over the rows (a cheaper program than plain decoding's
    loop; the cached steps equal a full pass, check_target)."""
    rows = [p + g for p, g in zip(prompts, generated)]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    hidden = target.model.forward(target.params, tokens, positions, target.model.init_cache(*tokens.shape))[0]
    argmax = np.asarray(np.argmax(target.model.logits(target.params, hidden), -1))
    return [(i, t) for i, (p, row) in enumerate(zip(prompts, rows)) for t in range(len(p), len(row))
            if argmax[i, t - 1] != row[t]]


def test_training_lowers_the_loss_and_the_export_decodes_exactly(gemma4, tmp_path):
    """8 steps from scratch: the loss of the last steps falls below the first ones'; the export
    (an HF assistant dir, written atomically) loads through the registry with the trained
    weights, and greedy decoding with it is plain greedy decoding (every token the target's
    argmax after the ones before it)."""
    target = gemma4
    rng = np.random.RandomState(0)
    data = TokenDataset.from_sequences([p + list(rng.randint(3, 128, NEW)) for p in PROMPTS],
                                       [len(p) for p in PROMPTS], ["test"] * len(PROMPTS))
    recipe = MtpRecipe.for_target(target, hidden=32, layers=2, k=2, anchors=4)
    _, params, result = train_mtp(target, data, tmp_path, CFG, hidden=32, layers=2, k=2, anchors=4,
                                  eval_prompts=0, progress=False)
    # Every step trains on the 4 sequences (their anchors drawn anew): the loss of the last steps
    # against the first ones'.
    losses = [h["loss"] for h in result.history]
    assert len(losses) == CFG.steps and (tmp_path / "training_log.json").is_file()
    assert np.mean(losses[-2:]) < 0.7 * np.mean(losses[:2]), losses

    drafter, loaded = load_drafter("mtp", target, str(tmp_path / "drafter"), k=2)
    # (The HF format records centroid settings even for a dense head.)
    assert dataclasses.replace(drafter.cfg, num_centroids=0, centroid_top_k=0) == recipe.drafter.cfg
    exported, read = (dict(jax.tree_util.tree_leaves_with_path(p)) for p in (params, loaded))
    assert exported.keys() == read.keys()
    for name, value in exported.items():
        np.testing.assert_array_equal(np.asarray(read[name]), value, err_msg=jax.tree_util.keystr(name))
    out = generate(target, PROMPTS, drafter, loaded, max_new_tokens=NEW, ignore_eos=True)
    assert out.stats.drafted == 2 * out.stats.steps
    assert greedy_mismatches(target, PROMPTS, out.generated_ids) == []


def test_cli_builds_the_mtp_recipe_and_refuses_a_target_without_one(capsys):
    """`spec-jax train mtp` is offered (its --help) and its flags make the recipe the library
    trains; a target with no MTP drafter to shape is one clear error."""
    from spec_jax.app.main import build_parser
    from spec_jax.drafters import registry
    from tiny_configs import TINY_TARGET

    target = LoadedModel(TINY_GEMMA4, None, None, None, "tiny")  # shapes only: nothing is trained
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    assert "medusa,mtp}" in capsys.readouterr().out
    args = parser.parse_args(["train", "mtp", "--target", "x", "--data", "d.npz", "--out", "o", "--hidden", "32",
                              "--layers", "2", "--k", "3", "--anchors", "5", "--eval-prompts", "0"])
    recipe = registry.get(args.kind).recipe_class().from_flags(target, args)
    assert recipe == MtpRecipe.for_target(target, hidden=32, layers=2, k=3, anchors=5)
    assert recipe.drafter.k == 3 and recipe.drafter.cfg.layer_types == ("sliding_attention", "full_attention")
    llama = LoadedModel(TINY_TARGET, None, None, None, "llama")
    with pytest.raises(ValueError, match="no MTP drafter to shape for a 'llama' target .*--init-from"):
        registry.get("mtp").recipe_class().from_flags(llama, args)
