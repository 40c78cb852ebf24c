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
CFG = TrainConfig(steps=40, batch_size=4, seq_len=16, learning_rate=1e-2, warmup_steps=1, save_every=40,
                  log_every=1)


@pytest.fixture(scope="module")
def gemma4():
    """(the tiny Gemma 4 as a loaded model, its greedy continuations of PROMPTS)."""
    # One program for the random weights (eager, its ~50 ops each compile on their own).
    params = jax.jit(lambda key: init_params(TINY_GEMMA4, key, scale=3.0))(jax.random.key(0))
    target = LoadedModel(TINY_GEMMA4, params, None, None, "tiny")
    return target, generate(target, PROMPTS, max_new_tokens=NEW, ignore_eos=True).generated_ids


def test_training_lowers_the_loss_and_the_export_decodes_exactly_and_better(gemma4, tmp_path):
    """40 steps from scratch on the target's own answers to 4 prompts: the loss falls; the
    export (an HF assistant dir, written atomically) loads through the registry with the trained
    weights; greedy decoding with it equals plain decoding, and on those prompts its drafts are
    accepted more often than the untrained assistant's (the chains it learned are the ones
    `propose` makes: same cache view, hidden state, tokens and positions)."""
    target, greedy = gemma4
    data = TokenDataset.from_sequences([p + g for p, g in zip(PROMPTS, greedy)], [len(p) for p in PROMPTS],
                                       ["test"] * len(PROMPTS))
    recipe = MtpRecipe.for_target(target, hidden=32, layers=2, k=2, anchors=4)
    _, params, result = train_mtp(target, data, tmp_path, CFG, hidden=32, layers=2, k=2, anchors=4,
                                  eval_prompts=0, progress=False)
    losses = [h["loss"] for h in result.history]  # every step: the 4 sequences, anchors drawn anew
    assert len(losses) == CFG.steps and (tmp_path / "training_log.json").is_file()
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4]), losses

    drafter, loaded = load_drafter("mtp", target, str(tmp_path / "drafter"), k=2)
    # (The HF format records centroid settings even for a dense head.)
    assert dataclasses.replace(drafter.cfg, num_centroids=0, centroid_top_k=0) == recipe.drafter.cfg
    exported, read = (dict(jax.tree_util.tree_leaves_with_path(p)) for p in (params, loaded))
    assert exported.keys() == read.keys()
    for name, value in exported.items():
        np.testing.assert_array_equal(np.asarray(read[name]), value, err_msg=jax.tree_util.keystr(name))
    # The export is an HF assistant checkpoint: transformers' own class reads every tensor of it.
    from transformers import Gemma4AssistantForCausalLM

    _, info = Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "drafter", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    trained = generate(target, PROMPTS, drafter, loaded, max_new_tokens=NEW, ignore_eos=True)
    untrained = generate(target, PROMPTS, drafter, recipe.initial_params(target, CFG.seed, None),
                         max_new_tokens=NEW, ignore_eos=True)  # the same program, other params
    assert trained.generated_ids == greedy and untrained.generated_ids == greedy
    assert trained.stats.drafted == 2 * trained.stats.steps
    assert trained.stats.tau > untrained.stats.tau + 0.5, (trained.stats.tau, untrained.stats.tau)


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


# A Qwen3.5 text config.json (a Gated DeltaNet layer, then gated attention with q/k norms and
# partial RoPE; (1 + w) norms): its MTP head keeps a cache of its own instead of reading the target's.
QWEN3_5_HF = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 8, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def test_the_qwen_mtp_head_plugs_into_the_same_recipe(tmp_path):
    """Qwen3.5's MTP head through the recipe: a fresh head of the target's shape, its loss traced
    (shapes only: nothing compiles) to a scalar over K = 2 chained drafts, and its export (the
    target's config.json and the mtp.* tensors, atomically) read back by `--drafter mtp`."""
    import json

    from spec_jax.drafters.qwen_mtp import QwenMtpDrafter
    from spec_jax.models import ModelConfig
    from spec_jax.training.mtp import MtpLoss

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(QWEN3_5_HF))
    cfg = ModelConfig.from_hf_config(QWEN3_5_HF)
    target = LoadedModel(cfg, None, None, None, str(tmp_path / "target"))  # the recipe reads shapes only
    recipe = MtpRecipe.for_target(target, k=2, anchors=3)
    assert isinstance(recipe.drafter, QwenMtpDrafter) and recipe.drafter.k == 2
    params = recipe.initial_params(target, 0, None)
    batch = {"tokens": np.zeros((2, 12), np.int32), "lengths": np.array([12, 9]), "prompt_lengths": np.array([3, 4])}
    target_params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    loss, metrics = jax.eval_shape(MtpLoss(recipe.drafter, target.model, anchors=3), params, target_params, batch,
                                   jax.random.key(0))
    assert loss.shape == () and {"acc_1", "acc_2", "accept_run"} <= set(metrics)
    recipe.export(tmp_path / "drafter", params, target)
    drafter, loaded = load_drafter("mtp", target, str(tmp_path / "drafter"), k=2)
    assert drafter.cfg == recipe.drafter.cfg
    for (name, value), read in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(read), value, err_msg=jax.tree_util.keystr(name))


def test_fine_tuning_a_centroid_sparse_assistant_keeps_its_clusters(tmp_path):
    """--init-from an assistant with centroid-sparse logits: it trains as the dense head it
    approximates (the cluster choice has no gradient), starts from the checkpoint's weights, and
    its export writes the centroids and token ordering back unchanged; a checkpoint that does not
    fit the target is refused before anything runs."""
    from spec_jax.checkpoints.gemma4_assistant import save_gemma4_assistant
    from spec_jax.drafters.gemma4_assistant import assistant_config_for_target, assistant_weight_specs
    from spec_jax.models.weights import init_from_specs

    target = LoadedModel(TINY_GEMMA4, None, None, None, "tiny")  # shapes only
    cfg = dataclasses.replace(assistant_config_for_target(TINY_GEMMA4, 32, 2, k=2), use_ordered_embeddings=True,
                              num_centroids=8, centroid_top_k=2)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: init_from_specs(assistant_weight_specs(cfg), jax.random.key(0)))
    released = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), shapes)
    released["token_ordering"] = rng.permutation(128).astype(np.int32)
    save_gemma4_assistant(tmp_path / "released", cfg, released)

    recipe = MtpRecipe.for_target(target, init_from=tmp_path / "released", k=2)
    assert not recipe.drafter.cfg.use_ordered_embeddings and recipe.export_drafter.cfg == cfg
    start = recipe.initial_params(target, 0, tmp_path / "released")
    assert "centroids" not in start and "token_ordering" not in start
    np.testing.assert_array_equal(start["pre_projection"], released["pre_projection"])
    start["pre_projection"] = start["pre_projection"] + 1.0  # "trained"
    recipe.export(tmp_path / "drafter", start, target)
    drafter, loaded = load_drafter("mtp", target, str(tmp_path / "drafter"), k=2)
    assert drafter.cfg == cfg
    np.testing.assert_array_equal(np.asarray(loaded["token_ordering"]), released["token_ordering"])
    np.testing.assert_array_equal(np.asarray(loaded["centroids"]), released["centroids"])
    np.testing.assert_array_equal(np.asarray(loaded["pre_projection"]), released["pre_projection"] + 1.0)
    wide = LoadedModel(TINY_GEMMA4.replace(hidden_size=96), None, None, None, "wider")
    with pytest.raises(ValueError, match="made for a 64-wide target"):
        MtpRecipe.for_target(wide, init_from=tmp_path / "released", k=2)
