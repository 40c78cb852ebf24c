"""DFlash parity with the reference `dflash` package (PyTorch), and greedy DFlash == AR.

Tiny random HF targets (Qwen3 and Llama) are saved and loaded with spec_jax's HF loader; random
reference drafters are first fitted (a few hundred torch Adam steps on the target's own greedy
continuations of the test prompts) so that acceptance lengths vary, then saved with
`save_pretrained` and loaded with `load_dflash`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from dflash_testlib import (
    MASK_ID,
    context_features,
    fit_drafter,
    greedy_choices,
    make_reference_drafter,
    spec_jax_greedy_steps,
    tiny_targets,
)
from spec_jax.checkpoints.dflash import load_dflash
from spec_jax.decoding.generate import generate
from spec_jax.models.decoder import forward, init_cache

PROMPT_LENGTHS = (5, 7, 10, 12, 9, 6, 11, 8)
SEQ_LENGTH = 80  # prompt + greedy continuation used for fitting and checked generations
MAX_NEW = 48
FIT_STEPS = {4: 150, 8: 200, 16: 300}  # by block size: enough for varied acceptance

# name -> (target kind, reference drafter kwargs)
CASES = {
    "qwen3-1layer-mha-b4": ("qwen3", dict(num_layers=1, block_size=4, num_key_value_heads=4)),
    "qwen3-3layer-gqa-sliding-b16": (
        "qwen3",
        dict(
            num_layers=3,
            block_size=16,
            num_key_value_heads=1,
            target_layer_ids=[0, 2, 4],
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            use_sliding_window=True,
            sliding_window=6,
        ),
    ),
    "llama-2layer-gqa-causal-extras-b8": (
        "llama",
        dict(
            num_layers=2,
            block_size=8,
            num_key_value_heads=2,
            is_causal=True,
            input_embedding_scale=1.5,
            output_multiplier=0.8,
            final_logit_softcapping=20.0,
        ),
    ),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """kind -> (torch model, spec_jax Target, prompts, fitting sequences)."""
    return tiny_targets(tmp_path_factory, PROMPT_LENGTHS, SEQ_LENGTH)


_FITTED: dict[str, tuple] = {}


def fitted_case(name, targets, tmp_path_factory):
    """(name, torch target, Target, prompts, reference drafter, DFlashDrafter, params), fitted once
    per test session and shared by every test of the case."""
    if name not in _FITTED:
        kind, kwargs = CASES[name]
        model, target, prompts, seqs = targets[kind]
        reference = make_reference_drafter(model, **dict(kwargs))
        t0 = time.perf_counter()
        loss = fit_drafter(reference, model, seqs, steps=FIT_STEPS[kwargs["block_size"]], lr=1e-2)
        print(f"{name}: fitted in {time.perf_counter() - t0:.1f}s, loss {loss:.2f}")
        path = tmp_path_factory.mktemp(name.replace("-", "_"))
        reference.save_pretrained(path)
        drafter, params = load_dflash(path)
        params = jax.tree.map(jnp.asarray, params)
        _FITTED[name] = (name, model, target, prompts, reference, drafter, params)
    return _FITTED[name]


@pytest.fixture(params=list(CASES))
def case(request, targets, tmp_path_factory):
    return fitted_case(request.param, targets, tmp_path_factory)


def test_draft_logits_match_reference(case, targets):
    name, model, target, prompts, reference, drafter, params = case
    seqs = targets[CASES[name][0]][3]
    b = drafter.cfg.block_size
    scale = float(reference.config.dflash_config.get("input_embedding_scale", 1.0))

    @jax.jit
    def spec_jax_logits(tokens, anchor):
        # Capture from spec_jax's own target forward, init the context, draft from the anchor.
        capacity = tokens.shape[1]
        positions = jnp.arange(capacity)[None]
        _, captured, _ = forward(
            target.params, target.model.cfg, tokens, positions, init_cache(target.model.cfg, 1, capacity),
            drafter.capture_layers,
        )
        state = drafter.init(params, target, tokens, anchor[None], captured, capacity)
        return drafter.draft_logits(params, target, state, tokens, anchor[None] + 1)

    for row, anchor in ((0, 9), (1, 27), (5, 60)):
        seq = seqs[row : row + 1]
        # Reference: context = the target's hidden states before the anchor, in one forward.
        feats = context_features(model, seq[:, :anchor], reference.target_layer_ids)
        block = torch.full((1, b), MASK_ID)
        block[0, 0] = seq[0, anchor]
        with torch.no_grad():
            hidden = reference(
                target_hidden=feats,
                noise_embedding=torch.nn.functional.embedding(block, model.get_input_embeddings().weight) * scale,
                position_ids=torch.arange(anchor + b)[None],
            )
            expected = reference.compute_logits(hidden[:, 1:], model.lm_head).numpy()
        logits = spec_jax_logits(jnp.asarray(seq.numpy(), jnp.int32), jnp.asarray(anchor))
        err = float(np.max(np.abs(np.asarray(logits) - expected)))
        print(f"{name}: anchor {anchor}: max |draft logit diff| = {err:.2e}")
        assert err < 1e-4, f"{name}: draft logits differ from the reference by {err}"


def test_greedy_generation_matches_reference(case, monkeypatch):
    import dflash.model as reference_module

    # The reference times with torch.cuda.synchronize when asked for stats; this is a CPU run.
    monkeypatch.setattr(reference_module, "_cuda_time", time.perf_counter)
    name, model, target, prompts, reference, drafter, params = case
    b = drafter.cfg.block_size
    all_steps = []
    for prompt in prompts[2:4]:
        result = reference_module.dflash_generate(
            reference, model, torch.tensor([prompt]), max_new_tokens=MAX_NEW, stop_token_ids=None,
            return_stats=True,
        )
        expected_tokens = result.output_ids[0, len(prompt) :].tolist()
        tokens, steps = spec_jax_greedy_steps(target, drafter, params, prompt, MAX_NEW)
        assert tokens == expected_tokens, f"{name}: generated tokens differ from the reference"
        # Compare the steps where the reference verified a full block and nothing was cut by the
        # length cap (its last blocks shrink to fit max_new_tokens).
        max_length = len(prompt) + MAX_NEW
        start, compared = len(prompt), 0
        for i, produced in enumerate(result.acceptance_lengths):
            if start + b + 1 > max_length:
                break
            assert steps[i] == produced, (
                f"{name}: step {i} accepted {steps[i] - 1} drafts, the reference {produced - 1}; "
                f"spec_jax {steps}, reference {result.acceptance_lengths}"
            )
            start += produced
            compared += 1
        assert compared >= 3
        all_steps += steps[:compared]
        print(f"{name}: acceptance lengths {steps[:compared]}")
    assert len(set(all_steps)) > 1, f"{name}: acceptance never varies ({all_steps}); fit the drafter longer"
    assert max(all_steps) > 1


def test_greedy_dflash_equals_autoregressive(targets, tmp_path_factory):
    name = "qwen3-3layer-gqa-sliding-b16"
    _, _, target, prompts, _, drafter, params = fitted_case(name, targets, tmp_path_factory)
    loaded = (target.model.cfg, target.params)
    model = targets[CASES[name][0]][0]
    max_new = 40
    # Plain decoding: the torch target's greedy tokens (greedy_choices: no plain loop to
    # compile), and its loop steps, one token per step after the prefill's.
    plain_steps = max_new - 1
    # Batch 1 on two prompts (a tiny fitted drafter may accept nothing on one of them), then
    # batch 8 of mixed lengths.
    accepted = {1: 0, 8: 0}
    for rows in ([2], [3], range(len(prompts))):
        batch_prompts = [prompts[i] for i in rows]
        spec = generate(loaded, batch_prompts, drafter, params, max_new_tokens=max_new, ignore_eos=True)
        assert all(len(row) == max_new for row in spec.generated_ids)
        assert spec.generated_ids == greedy_choices(model, batch_prompts, spec.generated_ids)
        assert spec.loop_steps <= plain_steps
        accepted[len(batch_prompts)] += spec.stats.accepted
        print(
            f"{name} batch {len(batch_prompts)}: tau {spec.stats.tau:.2f}, "
            f"loop steps {spec.loop_steps} vs AR {plain_steps}"
        )
    assert accepted[1] > 0 and accepted[8] > 0, f"{name}: no draft accepted ({accepted}); fit longer"


SAMPLED_ROWS, SAMPLED_SEEDS, P_FAIL = 1024, 4, 1e-4


def _warped(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """Temperature then top-k (transformers' order), as probabilities, in float64."""
    scaled = np.asarray(logits, np.float64) / temperature
    kth = np.sort(scaled)[::-1][top_k - 1]
    scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    return probs / probs.sum()


def _exact_joint(model, prompt, horizon, temperature, top_k) -> dict[tuple[int, ...], float]:
    """P(t_1..t_horizon | prompt) under the warped torch target, over its support."""
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(horizon):
            grown = {}
            for prefix, p in joint.items():
                logits = model(torch.tensor([list(prompt) + list(prefix)])).logits[0, -1].numpy()
                q = _warped(logits, temperature, top_k)
                for t in np.flatnonzero(q > 0):
                    grown[prefix + (int(t),)] = p * q[t]
            joint = grown
    return joint


def test_sampled_dflash_matches_target_distribution(targets, tmp_path_factory):
    """Temperature 0.7, top-k 3: sampled block drafts go through the exact acceptance, and the first
    3 tokens (the prefill token, then one verify step of K = 3 capped at 2 tokens) over 4 seeds x
    1024 identical rows follow the joint the torch target gives (chi-square, p > 1e-4; a token
    sequence the target cannot produce fails outright)."""
    _, model, target, prompts, _, drafter, params = fitted_case("qwen3-1layer-mha-b4", targets, tmp_path_factory)
    temperature, top_k, horizon = 0.7, 3, 3
    joint = _exact_joint(model, prompts[0], horizon, temperature, top_k)
    counts = dict.fromkeys(joint, 0)
    accepted = 0
    for seed in range(SAMPLED_SEEDS):
        out = generate(
            (target.model.cfg, target.params), [prompts[0]] * SAMPLED_ROWS, drafter, params,
            max_new_tokens=horizon, temperature=temperature, top_k=top_k, ignore_eos=True, seed=seed,
        )
        for ids in out.generated_ids:
            assert tuple(ids) in counts, f"sampled {ids}, which the warped target gives probability 0"
            counts[tuple(ids)] += 1
        accepted += out.stats.accepted
    assert accepted > 0, "no draft was accepted: the test did not exercise the acceptance rule"
    observed = np.array([counts[c] for c in joint], np.float64)
    expected = np.array([joint[c] for c in joint]) * observed.sum()
    small = expected < 5  # pooled, as chi-square needs
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    p_value = scipy_stats.chisquare(observed, expected).pvalue
    print(f"sampled DFlash: {len(joint)} sequences, {accepted} drafts accepted, chi-square p = {p_value:.3g}")
    assert p_value > P_FAIL, f"sampled DFlash output is not the target's distribution (p = {p_value:.2e})"


def _load_speculators_dflash(directory, target_model):
    """speculators' DFlashDraftModel from `directory` (eval, eager attention), with the weights
    it takes from the verifier at load time (embedding, LM head unless the drafter has its own
    reduced-vocabulary head) copied from `target_model`; its verifier-loading step would read
    the verifier from the hub, so it is skipped."""
    from unittest import mock

    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(str(directory))
    config.transformer_layer_config._attn_implementation = "eager"
    with mock.patch.object(DFlashDraftModel, "load_verifier_weights", lambda self: None):
        model = DFlashDraftModel.from_pretrained(str(directory), config=config)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        if not model.use_draft_vocab:
            model.lm_head.weight.copy_(target_model.lm_head.weight)
        verifier_head = target_model.lm_head.weight
        # speculators restricts the verifier's head to the draft vocabulary for its training targets.
        model.verifier_lm_head.weight.copy_(verifier_head[model.t2d] if model.use_draft_vocab else verifier_head)
        model.verifier_norm.weight.copy_(target_model.model.norm.weight)
    return model.float().eval()


def _check_speculators_round_trip(directory, model, target, drafter, params, seqs, tmp_path):
    """`directory` (saved by spec_jax in the speculators format) loads back unchanged, loads in
    speculators with the same draft logits at three anchors (on the draft vocabulary; -inf
    elsewhere when it is reduced), and what speculators writes loads into spec_jax unchanged."""
    loaded, loaded_params = load_dflash(directory)
    assert loaded.cfg == drafter.cfg
    host = jax.device_get(params)
    for a, b in zip(jax.tree.leaves(loaded_params), jax.tree.leaves(host)):
        np.testing.assert_array_equal(a, b)

    reference = _load_speculators_dflash(directory, model)
    b = drafter.cfg.block_size
    anchors = [9, 27, 40]
    seq = seqs[1:2]
    length = seq.shape[1]
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, anchors] = 1  # exactly these anchors (all of them are drawn, in order)
    with torch.no_grad():
        out = model(seq, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in reference.target_layer_ids], dim=-1)
        _, logits, _, _, _ = reference._backbone_forward(
            aux, seq, loss_mask, out.hidden_states[-1], torch.zeros(1, length, dtype=torch.long),
            max_anchors=len(anchors),
        )
    # What speculators itself writes loads into spec_jax with the same weights.
    reference.save_pretrained(tmp_path / "written_by_speculators")
    again, again_params = load_dflash(tmp_path / "written_by_speculators")
    assert again.cfg.target_layer_ids == drafter.cfg.target_layer_ids
    assert again.cfg.block_size == b and again.cfg.mask_token_id == drafter.cfg.mask_token_id
    assert again.cfg.draft_vocab_size == drafter.cfg.draft_vocab_size
    for x, y in zip(jax.tree.leaves(again_params), jax.tree.leaves(host)):
        np.testing.assert_allclose(x, y, rtol=0, atol=0)
    logits = logits[0].reshape(len(anchors), b, -1)[:, 1:].numpy()  # slot i predicts token a + i
    vocab = target.model.cfg.vocab_size
    draft_ids = np.arange(logits.shape[-1]) + np.asarray(host.get("d2t", np.zeros(vocab, np.int32)))
    outside = np.setdiff1d(np.arange(vocab), draft_ids)
    tokens = jnp.asarray(seq.numpy(), jnp.int32)
    _, captured, _ = forward(target.params, target.model.cfg, tokens, jnp.arange(length)[None],
                             init_cache(target.model.cfg, 1, length), drafter.capture_layers)
    for j, anchor in enumerate(anchors):
        state = drafter.init(params, target, tokens, jnp.array([anchor]), captured, length)
        ours = np.asarray(drafter.draft_logits(params, target, state, tokens, jnp.array([anchor + 1]))[0])
        np.testing.assert_allclose(ours[:, draft_ids], logits[j], atol=1e-4, rtol=1e-4,
                                   err_msg=f"anchor {anchor}")
        assert np.all(np.isneginf(ours[:, outside])), "tokens outside the draft vocabulary must get -inf"


def test_speculators_dflash_format_both_directions(targets, tmp_path_factory, tmp_path):
    """A drafter spec_jax saves in the speculators format (vLLM's) loads in speculators with the
    same draft logits as spec_jax's, and loads back into spec_jax unchanged."""
    _, model, target, _, _, drafter, params = fitted_case("qwen3-1layer-mha-b4", targets, tmp_path_factory)
    from spec_jax.checkpoints.dflash import save_dflash

    save_dflash(tmp_path / "speculators", drafter.cfg, jax.device_get(params), layout="speculators")
    _check_speculators_round_trip(tmp_path / "speculators", model, target, drafter, params,
                                  targets["qwen3"][3], tmp_path)


def test_speculators_dflash_reduced_draft_vocab(targets, tmp_path_factory, tmp_path):
    """speculators' reduced draft vocabulary (the drafter's own lm_head over 40 of the 128
    tokens, d2t/t2d maps): logits match speculators' on the draft ids (-inf elsewhere), the
    checkpoint loads both ways, the z-lab format refuses it, and greedy decoding with it is
    token-identical to AR at batch 1 and 8."""
    import dataclasses

    from eagle3_testlib import _draft_vocab
    from spec_jax.checkpoints.dflash import save_dflash
    from spec_jax.drafters.dflash import DFlashDrafter
    from spec_jax.drafters.draft_vocab import head_rows

    _, model, target, prompts, _, drafter, params = fitted_case("qwen3-1layer-mha-b4", targets, tmp_path_factory)
    d2t, _ = _draft_vocab(40, seed=5)
    draft_ids = np.arange(40) + d2t.numpy()
    cfg = dataclasses.replace(drafter.cfg, draft_vocab_size=40)
    noise = np.random.default_rng(0).normal(0, 0.05, (cfg.hidden_size, 40)).astype(np.float32)
    reduced = DFlashDrafter(cfg)
    reduced_params = {**jax.device_get(params), "d2t": d2t.numpy().astype(np.int32),
                      "lm_head": head_rows(target, draft_ids) + noise}
    with pytest.raises(ValueError, match="layout='speculators'"):
        save_dflash(tmp_path / "zlab", cfg, reduced_params)
    save_dflash(tmp_path / "speculators", cfg, reduced_params, layout="speculators")
    reduced_params = jax.tree.map(jnp.asarray, reduced_params)
    _check_speculators_round_trip(tmp_path / "speculators", model, target, reduced, reduced_params,
                                  targets["qwen3"][3], tmp_path)
    loaded = (target.model.cfg, target.params)
    accepted = 0
    for batch_prompts in (prompts[2:3], prompts):
        ar = generate(loaded, batch_prompts, None, max_new_tokens=32, ignore_eos=True)
        spec = generate(loaded, batch_prompts, reduced, reduced_params, max_new_tokens=32, ignore_eos=True)
        assert spec.generated_ids == ar.generated_ids
        accepted += spec.stats.accepted
    assert accepted > 0
