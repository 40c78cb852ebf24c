"""A target spec_jax has never seen: the Flax NNX decoder written from scratch in
docs/bring_your_own_model.md (not `spec_jax.models`), run from the doc's own code blocks.

- the doc's example runs as written: check_target passes, and n-gram, draft model, DFlash and
  EAGLE-3 are greedy-identical to the model's own plain decoding at batch 4 (asserted inside);
  again at batch 1; AR, n-gram and DFlash sharded on 8 fake devices match (all three in a fresh
  process, tests/byo_sharding_worker.py, where the loop compiles cheaply);
- sampling with a draft model reproduces the model's exact 3-token joint (chi-square);
- the pure function of `make_generate_fn` inside the user's own jit equals `generate`;
- check_target rejects six broken variants, each naming its property, and passes the built-in
  decoder.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax
from spec_jax.testing import TargetCheckError, check_target

DOC = Path(__file__).resolve().parents[1] / "docs" / "bring_your_own_model.md"


def doc_block(marker: str) -> str:
    """The doc's python block that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} python blocks of {DOC.name} contain {marker!r}"
    return found[0]


def definitions() -> dict:
    """The doc's model and adapter (TinyLM, TinyLMTarget), executed in a fresh namespace."""
    namespace: dict = {}
    exec(compile(doc_block("class TinyLMTarget"), str(DOC), "exec"), namespace)
    return namespace


def test_make_generate_fn_composes_inside_a_user_jit():
    """The doc's rollout: the pure loop inside the user's jit, next to the user's own reward
    computation, equals `generate` with the same sampling values and seed."""
    ns = definitions()
    ns["model"], ns["params"] = ns["TinyLMTarget"].wrap(ns["TinyLM"](128, 64, 2, 4, rngs=ns["nnx"].Rngs(0)), 4)
    ns["prompts"] = prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [7, 3, 1], [2, 4, 6, 8, 10, 12], [11, 11, 11, 11]]
    exec(compile(doc_block("rollout_and_score"), str(DOC), "exec"), ns)
    out, score = ns["out"], ns["score"]
    expected = spec_jax.generate(
        (ns["model"], ns["params"]), prompts, spec_jax.NGramDrafter(k=4),
        max_new_tokens=16, temperature=0.8, seed=0, ignore_eos=True, capacity=64,
    )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    got = [tokens[b, len(p): lengths[b]].tolist() for b, p in enumerate(prompts)]
    assert got == expected.generated_ids
    assert np.asarray(score).tolist() == [sum(g) for g in got]


def test_sampling_with_a_draft_model_reproduces_the_exact_joint():
    """First 3 tokens of a vocab-8 TinyLM, sampled (T = 1) with a draft model of its own kind,
    over 4 seeds x 1024 rows, against the exact joint from one full forward of all prefixes."""
    from scipy import stats as scipy_stats

    ns = definitions()
    vocab, prompt, horizon = 8, [1, 2, 3], 3
    model, params = ns["TinyLMTarget"].wrap(ns["TinyLM"](vocab, 32, 2, 2, rngs=ns["nnx"].Rngs(5)), 2)
    draft, draft_params = ns["TinyLMTarget"].wrap(ns["TinyLM"](vocab, 32, 1, 2, rngs=ns["nnx"].Rngs(6)), 2)
    prefixes = np.asarray(list(itertools.product(range(vocab), repeat=2)))
    seqs = jnp.asarray(np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1))
    positions = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    out = model.forward(params, seqs, positions, model.init_cache(*seqs.shape))
    probs = np.asarray(jax.nn.softmax(model.logits(params, out.hidden), axis=-1), np.float64)
    p = len(prompt)
    joint = (probs[0, p - 1][:, None, None] * probs[::vocab, p][:, :, None]
             * probs[:, p + 1].reshape(vocab, vocab, vocab))
    counts = np.zeros((vocab,) * horizon)
    accepted = 0
    for seed in range(4):
        r = spec_jax.generate((model, params), [prompt] * 1024, spec_jax.DraftModelDrafter(draft, k=2),
                              draft_params, max_new_tokens=horizon, temperature=1.0, seed=seed, capacity=32)
        np.add.at(counts, tuple(np.asarray(r.generated_ids).T), 1)
        accepted += r.stats.accepted
    assert accepted > 0
    expected = joint.ravel() / joint.sum() * counts.sum()  # float32 softmax: renormalise in float64
    small = expected < 5
    observed = np.append(counts.ravel()[~small], counts.ravel()[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    assert scipy_stats.chisquare(observed, expected).pvalue > 1e-4


# ----------------------------------------------------------------------------- broken models
def broken_variants(ns: dict) -> dict:
    """name -> (a TinyLMTarget subclass with one bug, the check that must name it)."""
    base = ns["TinyLMTarget"]

    @dataclasses.dataclass(frozen=True)
    class SharedWriteIndex(base):  # every row writes (and reads) at row 0's length
        def forward(self, params, tokens, positions, cache, *, mask=None, capture=()):
            own = cache["lengths"]
            shared = dict(cache, lengths=jnp.broadcast_to(own[0], own.shape))
            out = super().forward(params, tokens, positions, shared, mask=mask, capture=capture)
            return out._replace(cache=dict(out.cache, lengths=own))

    @dataclasses.dataclass(frozen=True)
    class PositionsIgnored(base):  # rotates by slot index, not by the given positions
        def forward(self, params, tokens, positions, cache, *, mask=None, capture=()):
            slots = cache["lengths"][:, None] + jnp.arange(tokens.shape[1])
            return super().forward(params, tokens, slots, cache, mask=mask, capture=capture)

    @dataclasses.dataclass(frozen=True)
    class MaskIgnored(base):  # always causal: a tree's siblings see each other
        def forward(self, params, tokens, positions, cache, *, mask=None, capture=()):
            return super().forward(params, tokens, positions, cache, capture=capture)

    @dataclasses.dataclass(frozen=True)
    class Float16Logits(base):
        def logits(self, params, hidden):
            return super().logits(params, hidden).astype(jnp.float16)

    @dataclasses.dataclass(frozen=True)
    class HostCallback(base):  # a debugging print left in the forward pass
        def forward(self, params, tokens, positions, cache, *, mask=None, capture=()):
            jax.debug.callback(lambda t: None, tokens)
            return super().forward(params, tokens, positions, cache, mask=mask, capture=capture)

    @dataclasses.dataclass(frozen=True)
    class CommitsInForward(base):  # advances the lengths itself: rejected drafts would stay
        def forward(self, params, tokens, positions, cache, *, mask=None, capture=()):
            out = super().forward(params, tokens, positions, cache, mask=mask, capture=capture)
            return out._replace(cache=dict(out.cache, lengths=cache["lengths"] + tokens.shape[1]))

    return {
        "shared write index": (SharedWriteIndex, "per-row writes"),
        "positions ignored": (PositionsIgnored, "positions honoured"),
        "in-pass mask ignored": (MaskIgnored, "tree mask equals chains"),
        "float16 logits": (Float16Logits, "float32 logits"),
        "host callback": (HostCallback, "no host callbacks"),
        "forward commits": (CommitsInForward, "forward leaves lengths"),
    }


def test_check_target_rejects_broken_models_naming_the_property():
    ns = definitions()
    good, params = ns["TinyLMTarget"].wrap(ns["TinyLM"](64, 32, 2, 2, rngs=ns["nnx"].Rngs(0)), 2)
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good)}
    for name, (variant, check) in broken_variants(ns).items():
        with pytest.raises(TargetCheckError) as info:
            check_target(variant(**fields), params, seq_len=8, capacity=16)
        assert info.value.check == check, f"{name}: {info.value}"
        assert check in str(info.value)


@pytest.mark.parametrize("family", ["llama", "qwen3-sliding"])
def test_builtin_decoder_passes_check_target(models, family):
    """The built-in decoder as Llama (the shared tiny target) and as Qwen3 (q/k norms) with a
    sliding-window layer of 4 tokens, shorter than the checked sequence."""
    from spec_jax.models import Decoder, init_params

    cfg, params = models.cfg, models.params
    if family == "qwen3-sliding":
        cfg = cfg.replace(qk_norm=True, layer_types=("sliding_attention", "full_attention"),
                          sliding_window=4, architecture="qwen3")
        params = init_params(cfg, jax.random.key(4), scale=3.0)
    passed = check_target(Decoder(cfg), params, seq_len=8, capacity=16)
    assert "tree commit" in passed and "positions honoured" in passed


# ----------------------------------------------------------------------------- the example
def test_example_batch_1_and_sharded_on_8_fake_devices():
    """In a fresh process with 8 fake devices and cheap CPU codegen (each loop compiles in
    seconds; tests/byo_sharding_worker.py): the doc's example as written (check_target, then
    every drafter greedy-identical to plain decoding at batch 4), the same drafters at batch 1,
    and AR / n-gram / DFlash sharded over data=2, model=4 equal to unsharded."""
    worker = Path(__file__).parent / "byo_sharding_worker.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    assert report["example_drafters"] == ["ngram", "draft model", "dflash", "eagle3"]
    assert set(report["batch_1"]) == {"ngram", "draft model", "dflash", "eagle3"}
    for name, equal in report["batch_1"].items():
        assert equal, f"batch 1: {name}"
    for name, equal in report["sharded"].items():
        assert equal, f"sharded: {name}"
