"""Medusa heads: the head math, the state's position (an oracle that knows the answer from the
state alone gets every draft accepted), greedy chain and tree decoding token-identical to AR,
sampling exact in distribution, checks, checkpoints, and `spec-jax train medusa` end to end."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import VOCAB, make_prompts
from spec_jax.checkpoints import CheckpointError
from spec_jax.checkpoints.medusa import load_medusa, save_medusa
from spec_jax.decoding import generate
from spec_jax.drafters.medusa import (
    MedusaConfig,
    MedusaDrafter,
    identity_medusa_params,
    init_medusa_params,
    target_final_norm,
)
from spec_jax.drafters.tree import tree_from_logprobs
from spec_jax.models import Decoder, Target
from spec_jax.models.decoder import rms_norm
from spec_jax.training.features import target_features
from test_sampling_stats import (  # noqa: F401  (e2e is a fixture)
    E2E_CFG,
    PROMPT,
    V_E2E,
    chi_square_ok,
    e2e,
    exact_joint,
)

NEW = 40
PROMPTS = {1: make_prompts([3], seed=0), 3: make_prompts([3, 16], seed=0) + [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]}


@pytest.fixture(scope="module")
def cfg(models):
    return MedusaConfig.for_target(models.cfg, num_heads=4, num_res_blocks=2)


@pytest.fixture(scope="module")
def heads(cfg):
    return init_medusa_params(cfg, jax.random.key(7), scale=3.0)


@pytest.fixture(scope="module")
def ar(models):
    return {b: generate(models.target, p, max_new_tokens=NEW) for b, p in PROMPTS.items()}


# ------------------------------------------------------------------ the heads
def test_head_logits_match_a_direct_numpy_computation(models, cfg, heads):
    target = Target(models.params, Decoder(models.cfg))
    state = np.asarray(jax.random.normal(jax.random.key(3), (2, cfg.hidden_size)) * 5)
    got = np.asarray(MedusaDrafter(cfg, k=3).draft_logits(heads, target, jnp.asarray(state)))
    assert got.shape == (2, 3, VOCAB)
    lm_head = np.asarray(models.params["lm_head"], np.float64)  # [H, V] (the tiny target is untied)
    for i in range(3):
        h = heads["heads"][i]
        x = state / np.sqrt(np.mean(state**2, -1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(h["norm"])
        for block in h["blocks"]:
            z = x @ np.asarray(block["w"], np.float64) + np.asarray(block["b"])
            x = x + z / (1 + np.exp(-z))
        np.testing.assert_allclose(got[:, i], x @ lm_head, rtol=2e-4, atol=2e-4)


def test_untrained_heads_are_the_targets_lm_head(models, cfg):
    """Training starts each head as the LM head: zero blocks, norms from the target's final norm."""
    target = Target(models.params, Decoder(models.cfg))
    params = identity_medusa_params(cfg, target_final_norm(target))
    state = jax.random.normal(jax.random.key(4), (3, cfg.hidden_size))
    got = MedusaDrafter(cfg).draft_logits(params, target, state)
    normed = rms_norm(state, models.params["final_norm"], models.cfg.rms_norm_eps)
    want = target.logits(normed)  # the target's own head over its own final norm
    np.testing.assert_allclose(got, jnp.broadcast_to(want[:, None], got.shape), rtol=1e-5, atol=1e-5)


def test_init_and_commit_keep_the_state_before_the_last_committed_token(cfg):
    drafter = MedusaDrafter(cfg, k=3)
    captured = jnp.arange(3 * 6 * cfg.hidden_size, dtype=jnp.float32).reshape(3, 6, cfg.hidden_size)
    state = drafter.init(None, None, jnp.zeros((3, 6), jnp.int32), jnp.asarray([2, 6, 4]), captured, 64)
    np.testing.assert_array_equal(state, captured[jnp.arange(3), jnp.asarray([1, 5, 3])])
    verify = captured[:, :4]
    state = drafter.commit(None, None, state, jnp.asarray([9, 9, 9]), jnp.asarray([0, 3, 2]), verify)
    np.testing.assert_array_equal(state, verify[jnp.arange(3), jnp.asarray([0, 3, 2])])


@dataclasses.dataclass(frozen=True)
class OracleMedusa(MedusaDrafter):
    """Medusa heads that recognise their state: params hold the target's last-layer hidden states
    of the AR sequences and their tokens; a state is matched to its position t and head i puts the
    token t + i + 1 first (in a tree, second behind a decoy at odd depths, so accepted paths run
    through later siblings). Every draft is accepted only if the state really is the hidden state
    of the token before the last committed one."""

    def weight_specs(self):
        return None

    def draft_logits(self, params, target, state):
        table, seq = params["table"], params["tokens"]  # [B, T, H], [B, T]
        rows = jnp.arange(state.shape[0])[:, None]
        t = jnp.argmin(jnp.sum((table - state[:, None, :]) ** 2, -1), axis=1)  # [B]
        depth = jnp.arange(self.k)
        truth = seq[rows, jnp.minimum(t[:, None] + 2 + depth, seq.shape[1] - 1)]  # [B, K]
        decoy = (truth + 1 + depth) % VOCAB
        decoy_first = (depth % 2 == 1) & bool(self.tree)
        logits = jnp.full(truth.shape + (VOCAB,), -6.0)
        logits = logits.at[rows, depth, decoy].set(jnp.where(decoy_first, -0.1, -3.0))
        return logits.at[rows, depth, truth].set(jnp.where(decoy_first, -0.2, -0.1))


def oracle_params(models, prompts, ar_result):
    rows = [p + g for p, g in zip(prompts, ar_result.generated_ids)]
    tokens = np.zeros((len(rows), 64), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    table, _ = target_features(models.params, models.cfg, jnp.asarray(tokens), (models.cfg.num_layers - 1,))
    return {"table": table, "tokens": jnp.asarray(tokens)}


@pytest.mark.parametrize("tree,batch", [(0, 3), (8, 3)])
def test_oracle_heads_get_every_draft_accepted(models, cfg, ar, tree, batch):
    prompts = PROMPTS[batch]
    r = generate(models.target, prompts, OracleMedusa(cfg, k=4, tree=tree),
                 oracle_params(models, prompts, ar[batch]), max_new_tokens=NEW)
    assert r.generated_ids == ar[batch].generated_ids
    # 5 tokens per step where the tree holds the whole answer path (a budget of 8 holds the first
    # 3 drafts: best first, the decoys' subtrees outrank the 4th), else 4; fewer where rows end.
    assert r.stats.tau > 3.5, r.stats.tau


@pytest.mark.parametrize("tree,batch", [(0, 1), (16, 3)])
def test_random_heads_greedy_equals_ar(models, cfg, heads, ar, tree, batch):
    drafter = MedusaDrafter(cfg, k=3, tree=tree)
    r = generate(models.target, PROMPTS[batch], drafter, heads, max_new_tokens=NEW)
    assert r.generated_ids == ar[batch].generated_ids
    assert r.stats.drafted == (tree or 3) * r.stats.steps


def test_tree_is_best_first_over_the_heads(models, cfg, heads):
    """propose_tree = tree_from_logprobs over the heads' log-softmax, budget or static paths."""
    target = Target(models.params, Decoder(models.cfg))
    state = jax.random.normal(jax.random.key(5), (2, cfg.hidden_size))
    logits = MedusaDrafter(cfg, k=3).draft_logits(heads, target, state)
    for setting in (6, ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))):
        drafter = MedusaDrafter(cfg, k=3, tree=setting)
        tree, _ = drafter.propose_tree(heads, target, state, None, None, None, None)
        want = tree_from_logprobs(jax.nn.log_softmax(logits, -1), setting)
        np.testing.assert_array_equal(tree.tokens, want.tokens)
        np.testing.assert_array_equal(tree.parents, want.parents)


def test_sampled_drafts_reproduce_target_joint_distribution(e2e):
    """First 3 tokens over 5 seeds x 2048 rows against the exact joint at T=0.7, top-k 3, with a
    chain of drafts sampled from the warped heads and returned with their probabilities (trees of
    top-k nodes take the generic tree acceptance, tested in test_trees.py)."""
    params, _, logits = e2e
    medusa = MedusaConfig.for_target(E2E_CFG, num_heads=2)
    drafter = MedusaDrafter(medusa)
    dparams = init_medusa_params(medusa, jax.random.key(15), scale=1.5)
    counts = np.zeros((V_E2E,) * 3)
    accepted = 0
    for seed in range(5):
        r = generate((E2E_CFG, params), [PROMPT] * 2048, drafter, dparams, max_new_tokens=3,
                     temperature=0.7, top_k=3, seed=seed, capacity=32)
        np.add.at(counts, tuple(np.asarray(r.generated_ids).T), 1)
        accepted += r.stats.accepted
    assert accepted > 0
    chi_square_ok(counts, exact_joint(logits, 0.7, 3, 1.0), "medusa sampled chain joint")


# ------------------------------------------------------------------ checks
def test_settings_and_target_mismatches_are_clear_errors(models, cfg, heads):
    with pytest.raises(ValueError, match="K must be in 1..4"):
        MedusaDrafter(cfg, k=5)
    with pytest.raises(ValueError, match="deeper than K=2"):
        MedusaDrafter(cfg, k=2, tree=((0,), (0, 0), (0, 0, 0)))
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1"):
        MedusaConfig(num_heads=0, hidden_size=64, num_target_layers=2)
    narrow = dataclasses.replace(cfg, hidden_size=32)
    with pytest.raises(ValueError, match="hidden size 32 differs from the target's 64"):
        generate(models.target, PROMPTS[1], MedusaDrafter(narrow), init_medusa_params(narrow, jax.random.key(0)),
                 max_new_tokens=4)
    deeper = dataclasses.replace(cfg, num_target_layers=3)
    with pytest.raises(ValueError, match="made for a 3-layer target"):
        generate(models.target, PROMPTS[1], MedusaDrafter(deeper), heads, max_new_tokens=4)
    with pytest.raises(ValueError, match="params lack the weight"):
        generate(models.target, PROMPTS[1], MedusaDrafter(cfg), {"heads": heads["heads"][:2]}, max_new_tokens=4)


def test_checkpoint_round_trip_and_bad_checkpoints(tmp_path, cfg, heads):
    save_medusa(tmp_path / "m", cfg, jax.device_get(heads))
    drafter, params = load_medusa(tmp_path / "m", k=2)
    assert drafter.cfg == cfg and drafter.k == 2
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, jax.device_get(heads))
    with pytest.raises(CheckpointError, match="already exists"):
        save_medusa(tmp_path / "m", cfg, heads)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_medusa(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_medusa(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_medusa(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="not a Medusa heads config"):
        load_medusa(tmp_path / "empty")
    # A config that promises more heads than the file holds names the missing tensors.
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 5}))
    with pytest.raises(CheckpointError, match="medusa_head.4.norm.weight"):
        load_medusa(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="medusa_head.0.0.linear.weight"):
        load_medusa(tmp_path / "m")


# ------------------------------------------------------------------ training, end to end
def test_cli_trains_medusa_heads_that_load_draft_better_and_stay_exact(tmp_path, capsys):
    """`spec-jax train medusa` on a tiny target's own continuations: the loss goes down, the export
    loads (and with --drafter medusa+ngram=PATH --tree 8), every output is AR's, and the trained
    heads are accepted more often than untrained ones."""
    from test_training import SEQ_LEN, TARGET

    from spec_jax.app.main import main
    from spec_jax.checkpoints import save_hf_dir
    from spec_jax.models import init_params
    from spec_jax.training.data import TokenDataset

    target_params = init_params(TARGET, jax.random.key(0), scale=3.0)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, 100, rng.randint(3, 9))) for _ in range(32)]
    out = generate((TARGET, target_params), prompts, max_new_tokens=24)
    data = TokenDataset.from_sequences([p + g for p, g in zip(prompts, out.generated_ids)],
                                       [len(p) for p in prompts], ["test"] * 32)
    save_hf_dir(tmp_path / "target", TARGET, jax.device_get(target_params))
    data.save(tmp_path / "data.npz")
    run = tmp_path / "run"
    args = ["train", "medusa", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.npz"),
            "--out", str(run), "--steps", "60", "--batch-size", "8", "--seq-len", str(SEQ_LEN),
            "--learning-rate", "1e-2", "--warmup-steps", "5", "--k", "3", "--answer-positions", "16",
            "--eval-every", "0", "--eval-prompts", "4", "--no-progress"]
    assert main(args) == 0
    log = json.loads((run / "training_log.json").read_text())
    assert log["history"][-1]["loss"] < 0.8 * log["history"][0]["loss"]
    assert log["evals"][-1]["tau"] > 1.0

    drafter, params = load_medusa(run / "drafter")
    assert drafter.k == 3 and drafter.capture_layers == (TARGET.num_layers - 1,)
    ar = generate((TARGET, target_params), prompts[:8], max_new_tokens=24)
    untrained = identity_medusa_params(drafter.cfg, target_final_norm(Target(target_params, Decoder(TARGET))))
    before = generate((TARGET, target_params), prompts[:8], drafter, untrained, max_new_tokens=24)
    spec = generate((TARGET, target_params), prompts[:8], drafter, params, max_new_tokens=24)
    assert spec.generated_ids == ar.generated_ids
    assert spec.stats.tau > before.stats.tau, (spec.stats.tau, before.stats.tau)

    # The command line loads it by kind, here as a tree behind prompt lookup.
    capsys.readouterr()
    assert main(["generate", "--target", str(tmp_path / "target"), "--prompt-ids", ",".join(map(str, prompts[0])),
                 "--max-new-tokens", "12", "--json", "--drafter", f"medusa+ngram={run / 'drafter'}",
                 "--tree", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["generated_ids"] == ar.generated_ids[0][:12]
