"""EAGLE-3 parity with the reference `speculators` package (PyTorch), checkpoints in both layouts
and both directions, and greedy EAGLE-3 == AR with acceptance lengths equal to a torch reference
loop.

Tiny random HF targets (Llama and Qwen3, 6 layers) are loaded with spec_jax's HF loader. Reference
drafters (`speculators.models.eagle3.Eagle3DraftModel`, reduced draft vocabulary of 96 of 128
tokens) are saved with `save_pretrained` and loaded with `load_eagle3`. For the generation tests
the reference drafter is first fitted (a few hundred Adam steps on the target's own greedy
continuations) so that acceptance lengths vary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_testlib import VOCAB, greedy_choices, spec_jax_greedy_steps, tiny_targets
from eagle3_testlib import (
    draft_to_target_ids,
    load_reference_eagle3,
    make_reference_eagle3,
    reference_features,
    reference_step_logits,
    save_original_eagle3_layout,
)
from spec_jax.checkpoints import CheckpointError
from spec_jax.checkpoints.eagle3 import load_eagle3, save_eagle3
from spec_jax.decoding.generate import generate
from spec_jax.models.decoder import forward, init_cache

AUX = (2, 3, 5)
DRAFT_VOCAB = 96
PROMPT_LENGTHS = (5, 7, 10, 12, 9, 6, 11, 8)
SEQ_LENGTH = 60
K = 4

# name -> (target kind, drafter layer kind, reference kwargs)
CASES = {
    "llama-1layer": ("llama", "llama", dict(num_layers=1)),
    "qwen3-2layer-norm-output": ("qwen3", "qwen3", dict(num_layers=2, norm_output=True,
                                                          norm_before_residual=True)),
    "qwen3-target-llama-head-fc-norm": ("qwen3", "llama", dict(num_layers=1, fc_norm=True)),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """kind -> (torch model, spec_jax Target, prompts, greedy sequences)."""
    return tiny_targets(tmp_path_factory, PROMPT_LENGTHS, SEQ_LENGTH)


_CASES: dict[str, tuple] = {}


def loaded_case(name, targets, tmp_path_factory, fitted=False):
    """(torch target, Target, prompts, seqs, reference drafter, Eagle3Drafter, params, dir)."""
    key = (name, fitted)
    if key not in _CASES:
        kind, head_kind, kwargs = CASES[name]
        model, target, prompts, seqs = targets[kind]
        reference = make_reference_eagle3(model, kind=head_kind, draft_vocab_size=DRAFT_VOCAB,
                                          aux_layer_ids=AUX, **kwargs)
        if fitted:
            fit_reference(reference, model, seqs)
        path = tmp_path_factory.mktemp(name.replace("-", "_"))
        reference.save_pretrained(path)
        drafter, params = load_eagle3(path, k=K, target_cfg=target.model.cfg)
        _CASES[key] = (model, target, prompts, seqs, reference, drafter,
                       jax.tree.map(jnp.asarray, params), path)
    return _CASES[key]


def fit_reference(reference, target_model, seqs, steps=300, ttt_steps=3):
    """Adam on the reference's own multi-step (teacher-forced) forward: step s at pair t learns
    token t + 2 + s of the target's greedy continuation (labels outside the draft vocab skipped)."""
    gen = torch.Generator().manual_seed(0)
    feats = reference_features(target_model, seqs, AUX)  # [N, T, 3H]
    to_draft = torch.full((VOCAB,), -100, dtype=torch.long)
    to_draft[torch.as_tensor(draft_to_target_ids(reference))] = torch.arange(DRAFT_VOCAB)
    params = [p for n, p in reference.named_parameters() if not n.startswith(("embed_tokens", "verifier"))]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    reference.train()
    n, length = seqs.shape
    for _ in range(steps):
        row = int(torch.randint(0, n, (1,), generator=gen))
        logits = []
        hook = reference.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out))
        reference(hidden_states=feats[row : row + 1, :-1], input_ids=seqs[row : row + 1, 1:],
                  document_ids=torch.zeros(1, length - 1, dtype=torch.long), ttt_steps=ttt_steps)
        hook.remove()
        loss = 0.0
        for s, step_logits in enumerate(logits):
            labels = to_draft[seqs[row, 2 + s :]]  # pair t -> token t + 2 + s
            loss = loss + torch.nn.functional.cross_entropy(
                step_logits[0, : length - 2 - s], labels, ignore_index=-100
            )
        opt.zero_grad()
        loss.backward()
        opt.step()
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)


def _chain_logits(drafter, params, target, seq, last_pair):
    """spec_jax's K target-vocab logits drafted after pair `last_pair` of `seq`, the chain fed the
    true tokens (teacher forcing, as the reference's multi-step forward)."""
    prompt = jnp.asarray(seq[None, : last_pair + 1], jnp.int32)
    capacity = 128
    _, captured, _ = forward(target.params, target.model.cfg, prompt, jnp.arange(last_pair + 1)[None],
                             init_cache(target.model.cfg, 1, capacity), drafter.capture_layers)
    state = drafter.init(params, target, prompt, jnp.array([last_pair + 1]), captured, capacity)
    tokens = jnp.zeros((1, capacity), jnp.int32).at[0, : len(seq)].set(jnp.asarray(seq))
    truth = jnp.asarray(seq, jnp.int32)
    logits, _, _ = drafter.draft_logits(
        params, target, state, tokens, jnp.array([last_pair + 2]),
        choose=lambda step, _logits: truth[last_pair + 2 + step][None],
    )
    return np.asarray(logits[0])  # [K, V]


@pytest.mark.parametrize("name", list(CASES))
def test_draft_logits_match_reference(name, targets, tmp_path_factory):
    model, target, _, seqs, reference, drafter, params, _ = loaded_case(name, targets, tmp_path_factory)
    ids = draft_to_target_ids(reference)
    seq = seqs[1].numpy()
    feats = reference_features(model, seqs[1:2], AUX)
    expected = reference_step_logits(reference, feats[:, :-1], seqs[1:2, 1:], ttt_steps=K)
    for last_pair in (3, 17, 40):
        got = _chain_logits(drafter, params, target, seq, last_pair)
        for step in range(K):
            np.testing.assert_allclose(
                got[step, ids], expected[step][last_pair], atol=1e-4, rtol=1e-4,
                err_msg=f"{name}: pair {last_pair}, chain step {step}",
            )
            outside = np.setdiff1d(np.arange(VOCAB), ids)
            assert np.all(np.isneginf(got[step, outside]))  # never drafted


def test_checkpoints_both_directions_and_layouts(targets, tmp_path_factory, tmp_path):
    model, target, _, seqs, reference, drafter, params, path = loaded_case(
        "llama-1layer", targets, tmp_path_factory
    )
    host = jax.device_get(params)
    # spec_jax -> speculators: the reference loads what spec_jax saves, with the same logits.
    save_eagle3(tmp_path / "ours", drafter.cfg, host)
    again = load_reference_eagle3(tmp_path / "ours")
    feats = reference_features(model, seqs[:1], AUX)
    for a, b in zip(reference_step_logits(reference, feats[:, :-1], seqs[:1, 1:], 3),
                    reference_step_logits(again, feats[:, :-1], seqs[:1, 1:], 3)):
        np.testing.assert_array_equal(a, b)
    # The original EAGLE-3 layout (midlayer.*, Llama config) loads to the same params, and
    # spec_jax writes it back loadable.
    save_original_eagle3_layout(reference, tmp_path / "original", model.config)
    drafter2, params2 = load_eagle3(tmp_path / "original", k=K, target_cfg=target.model.cfg)
    assert drafter2.cfg.layer == drafter.cfg.layer and drafter2.cfg.draft_vocab_size == DRAFT_VOCAB
    # That layout names no feature layers: EAGLE-3's default (2, L/2, L-3) for the 6-layer target.
    assert drafter2.cfg.aux_layer_ids == (2, 3, 3)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(host)):
        np.testing.assert_array_equal(a, b)
    save_eagle3(tmp_path / "ours_original", drafter.cfg, host, layout="eagle3")
    _, params3 = load_eagle3(tmp_path / "ours_original", target_cfg=target.model.cfg)
    for a, b in zip(jax.tree.leaves(params3), jax.tree.leaves(host)):
        np.testing.assert_array_equal(a, b)


def test_incompatible_checkpoints_are_clear_errors(targets, tmp_path_factory, tmp_path):
    import json
    import shutil

    _, target, _, _, _, drafter, _, path = loaded_case("llama-1layer", targets, tmp_path_factory)
    # A target of another width.
    with pytest.raises(ValueError, match="64-wide target hidden states, the target's are 32"):
        drafter.validate(target.model.cfg.replace(hidden_size=32), 128)
    with pytest.raises(ValueError, match="aux layer ids \\[5\\] are outside 1..4"):
        drafter.validate(target.model.cfg.replace(num_layers=4), 128)
    # A config.json whose draft vocabulary disagrees with the weights.
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["draft_vocab_size"] = 64
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="lm_head.weight: config implies \\(64, 64\\)"):
        load_eagle3(bad, target_cfg=target.model.cfg)
    # An EAGLE-3 head passed as DFlash (and the reverse) names the kind to use.
    from spec_jax.checkpoints.dflash import load_dflash

    with pytest.raises(CheckpointError, match="--drafter eagle3=PATH"):
        load_dflash(path)
    # Not an EAGLE-3 checkpoint at all.
    (bad / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="neither a speculators EAGLE-3 config"):
        load_eagle3(bad)


def _reference_greedy_steps(target_model, reference, prompt, max_new, k):
    """A torch speculative loop: the reference drafts K tokens as a chain (its multi-step
    forward, fed its own drafts), the torch target verifies greedily. -> (tokens, per-step
    emitted counts after the prefill token)."""
    ids = draft_to_target_ids(reference)
    with torch.no_grad():  # the first token comes from the prefill pass, as in spec_jax's loop
        seq = list(prompt) + [int(target_model(torch.tensor([prompt])).logits[0, -1].argmax())]
    steps = []
    while len(seq) - len(prompt) < max_new:
        drafts = []
        feats = reference_features(target_model, torch.tensor([seq]), AUX)  # the same for every draft step
        for step in range(k):  # step s sees drafts 0..s-1 as its teacher-forced inputs
            tokens = torch.tensor([seq + drafts])
            padded = torch.cat([feats, feats.new_zeros(1, len(drafts), feats.shape[-1])], 1)
            logits = reference_step_logits(reference, padded[:, :-1], tokens[:, 1:], step + 1)
            drafts.append(int(ids[np.argmax(logits[step][len(seq) - 2])]))
        with torch.no_grad():
            verify = target_model(torch.tensor([seq + drafts])).logits[0, len(seq) - 1 :].argmax(-1)
        n = 0
        while n < k and drafts[n] == int(verify[n]):
            n += 1
        seq += drafts[:n] + [int(verify[n])]
        steps.append(n + 1)
    return seq[len(prompt) :][:max_new], steps


@pytest.mark.parametrize("name", ["llama-1layer", "qwen3-2layer-norm-output"])
def test_greedy_eagle3_equals_ar_and_reference_loop(name, targets, tmp_path_factory):
    model, target, prompts, _, reference, drafter, params, _ = loaded_case(
        name, targets, tmp_path_factory, fitted=True
    )
    loaded = (target.model.cfg, target.params)
    max_new = 24
    # Batch 8 of mixed lengths through the jitted loop; batch 1 is the step-by-step comparison
    # with the reference below (the same prefill and step functions the loop runs). Plain
    # decoding's tokens: the torch target's greedy ones (greedy_choices: no plain loop to compile).
    spec = generate(loaded, prompts, drafter, params, max_new_tokens=max_new, ignore_eos=True)
    assert all(len(row) == max_new for row in spec.generated_ids)
    assert spec.generated_ids == greedy_choices(model, prompts, spec.generated_ids)
    assert spec.stats.accepted > 0, f"{name}: the fitted drafter never got a draft accepted"
    # Tokens and per-step acceptance lengths equal the torch reference loop's (steps cut by the
    # length cap in spec_jax are not compared).
    for prompt in prompts[2:4]:
        expected_tokens, expected_steps = _reference_greedy_steps(model, reference, prompt, max_new, K)
        tokens, steps = spec_jax_greedy_steps(target, drafter, params, prompt, max_new)
        assert tokens == expected_tokens
        start, compared = len(prompt), 0
        for ours, theirs in zip(steps, expected_steps):
            if start + K + 1 > len(prompt) + max_new:
                break
            assert ours == theirs, f"{name}: spec_jax {steps}, reference {expected_steps}"
            start += theirs
            compared += 1
        assert compared >= 3
        print(f"{name}: acceptance lengths {steps[:compared]}")
