"""The autoregressive baseline (the loop with K = 0) and the host `generate` API.

AR greedy equals a plain Python loop of full forward passes; cached decode equals a full forward;
a row's output does not depend on the rows beside it; stop ids, max_new_tokens and ignore_eos do
what they say; sampling values, caps, stop ids and prompt lengths inside a bucket never recompile;
bad input fails with a clear error before anything compiles.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import EOS, make_prompts
from spec_jax.decoding import generate
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models import forward, init_cache
from spec_jax.models.decoder import commit

# `spec_jax.decoding.generate` the attribute is the function; the module holds the compiled cache.
gen_mod = importlib.import_module("spec_jax.decoding.generate")

# Shared shapes (see conftest): prompt bucket 16, default capacity 256, batch 1 / 3.
PROMPTS_3 = make_prompts([7, 16, 2], seed=1)
NEW = 24


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compilations inside the block (any function, not just the loop)."""
    events = []

    def listener(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@functools.lru_cache(maxsize=None)
def _full_forward_fn(cfg, batch, length):
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    @jax.jit
    def run(params, tokens):
        return forward(params, cfg, tokens, positions, init_cache(cfg, batch, length))[0]

    return run


def reference_greedy(models, prompts, max_new, stop_ids=()):
    """A plain Python loop: every step re-runs the whole sequence through `forward`, no cache
    reuse, and appends the argmax at each row's last position."""
    length = 48
    run = _full_forward_fn(models.cfg, len(prompts), length)
    seqs = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    live = [True] * len(prompts)
    for _ in range(max_new):
        tokens = np.zeros((len(prompts), length), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        logits = np.asarray(run(models.params, jnp.asarray(tokens)))
        for i, s in enumerate(seqs):
            if not live[i]:
                continue
            t = int(np.argmax(logits[i, len(s) - 1]))
            s.append(t)
            out[i].append(t)
            live[i] = t not in stop_ids
    return out


@pytest.fixture(scope="module")
def ar3(models):
    """AR greedy for PROMPTS_3 with stopping off: the reference stream the stop tests cut."""
    return generate(models.target, PROMPTS_3, max_new_tokens=NEW, ignore_eos=True).generated_ids


def test_ar_greedy_matches_full_forward_loop(models, ar3):
    assert ar3 == reference_greedy(models, PROMPTS_3, NEW)
    assert all(len(g) == NEW for g in ar3)


def test_prefill_then_decode_equals_full_forward(models):
    """Prefill part of each row (row 1 padded past its length), then decode one token at a time
    with rows at different positions: every logit equals one full forward pass."""
    cfg, params = models.target
    batch, total, cap = 3, 48, 64  # the full-forward shape of `reference_greedy`, compiled once
    tokens = jnp.asarray(make_prompts([total] * batch, seed=3))
    full = _full_forward_fn(cfg, batch, total)(params, tokens)  # [B, T, V]
    fwd = jax.jit(functools.partial(forward, cfg=cfg))
    prefill_len = np.array([8, 5, 1])
    logits, _, cache = fwd(
        params, tokens=tokens[:, :8], positions=jnp.broadcast_to(jnp.arange(8), (batch, 8)),
        cache=init_cache(cfg, batch, cap),
    )
    cache = commit(cache, jnp.asarray(prefill_len))  # rows keep different prefixes
    got = {(b, p): logits[b, p] for b in range(batch) for p in range(prefill_len[b])}
    pos = prefill_len.copy()
    for _ in range(12):
        positions = jnp.asarray(pos[:, None])
        step_logits, _, cache = fwd(
            params, tokens=jnp.take_along_axis(tokens, positions, axis=1), positions=positions,
            cache=cache,
        )
        cache = commit(cache, jnp.asarray(pos + 1))
        for b in range(batch):
            got[(b, int(pos[b]))] = step_logits[b, 0]
        pos += 1
    for (b, p), value in got.items():
        np.testing.assert_allclose(value, full[b, p], atol=1e-4, rtol=1e-4, err_msg=f"row {b} pos {p}")
    assert len(got) == sum(pos)


def test_batch_invariance(models, ar3):
    """A prompt's greedy output alone equals its output inside a batch with a longer and a
    shorter prompt (and the rows are padded to one bucket)."""
    for i, prompt in enumerate(PROMPTS_3):
        alone = generate(models.target, [prompt], max_new_tokens=NEW, ignore_eos=True)
        assert alone.generated_ids[0] == ar3[i], f"row {i}"


def _first(seq, tok):
    return seq.index(tok) if tok in seq else None


def test_stop_id_cuts_output_and_sets_reason(models, ar3):
    stop = ar3[0][5]
    i0 = _first(ar3[0], stop)
    r = generate(models.target, PROMPTS_3, max_new_tokens=NEW, stop_ids=[stop])
    for row, full in enumerate(ar3):
        i = _first(full, stop)
        if i is None:
            assert r.generated_ids[row] == full and r.finish_reasons[row] == "length"
        else:  # the stop token is emitted, nothing after it
            assert r.generated_ids[row] == full[: i + 1] and r.finish_reasons[row] == "stop"
    assert r.generated_ids[0][-1] == stop and i0 is not None


def test_stop_token_that_is_the_last_allowed_token_is_stop(models, ar3):
    stop = ar3[0][5]
    i0 = _first(ar3[0], stop)
    r = generate(models.target, PROMPTS_3, max_new_tokens=i0 + 1, stop_ids=[stop])
    assert r.generated_ids[0] == ar3[0][: i0 + 1]
    assert r.finish_reasons[0] == "stop"
    # One token fewer: the cap comes first.
    r = generate(models.target, PROMPTS_3, max_new_tokens=i0, stop_ids=[stop])
    assert r.generated_ids[0] == ar3[0][:i0]
    assert r.finish_reasons[0] == "length"


def test_several_stop_ids_first_one_wins(models, ar3):
    a, b = ar3[1][9], ar3[1][3]
    r = generate(models.target, PROMPTS_3, max_new_tokens=NEW, stop_ids=[a, b])
    for row, full in enumerate(ar3):
        hits = [i for i in (_first(full, a), _first(full, b)) if i is not None]
        want = full[: min(hits) + 1] if hits else full
        assert r.generated_ids[row] == want


def test_first_token_stop_and_cap_of_one(models, ar3):
    """The prefill-sampled first token alone: stop on it, or a cap of one."""
    r = generate(models.target, PROMPTS_3, max_new_tokens=NEW, stop_ids=[ar3[2][0]])
    assert r.generated_ids[2] == [ar3[2][0]] and r.finish_reasons[2] == "stop"
    assert r.row_stats[2].steps == 0
    r = generate(models.target, PROMPTS_3, max_new_tokens=1, ignore_eos=True)
    assert r.generated_ids == [g[:1] for g in ar3]
    assert r.finish_reasons == ["length"] * 3


@pytest.mark.parametrize("max_new", [2, 7, NEW])
def test_max_new_tokens_counts_tokens(models, ar3, max_new):
    r = generate(models.target, PROMPTS_3, max_new_tokens=max_new, ignore_eos=True)
    assert r.generated_ids == [g[:max_new] for g in ar3]
    assert r.finish_reasons == ["length"] * 3
    # AR: one verify step per token after the first.
    assert [s.steps for s in r.row_stats] == [max_new - 1] * 3


def test_eos_default_and_ignore_eos(models):
    """The config's EOS stops by default; ignore_eos=True runs to the cap through it."""
    prompts = make_prompts([3, 16, 1], seed=0)  # rows 1, 2 meet EOS at 12 and 21
    free = generate(models.target, prompts, max_new_tokens=NEW, ignore_eos=True)
    assert any(EOS in g[:-1] for g in free.generated_ids), "fixture: EOS should occur mid-output"
    dflt = generate(models.target, prompts, max_new_tokens=NEW)
    for row, full in enumerate(free.generated_ids):
        i = _first(full, EOS)
        want = full if i is None else full[: i + 1]
        assert dflt.generated_ids[row] == want
        assert dflt.finish_reasons[row] == ("length" if i is None else "stop")
    assert free.finish_reasons == ["length"] * 3


def test_traced_values_and_bucketed_lengths_do_not_recompile(models, ar3):
    base = generate(models.target, PROMPTS_3, max_new_tokens=NEW, ignore_eos=True)  # warm
    n_compiled = len(gen_mod._COMPILED)
    variants = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, top_k=3, top_p=0.5, seed=7),
        dict(max_new_tokens=5),
        dict(stop_ids=[ar3[0][3], 1, 2]),
    ]
    with count_compiles() as compiles:
        outs = []
        for kw in variants:
            kw = {"max_new_tokens": NEW, "ignore_eos": True, **kw}
            r = generate(models.target, PROMPTS_3, **kw)
            assert r.compile_s == 0.0, kw
            outs.append(r.generated_ids)
        # New prompt lengths inside the same bucket (16).
        r = generate(models.target, make_prompts([3, 9, 15], seed=5), max_new_tokens=NEW)
        assert r.compile_s == 0.0
    assert compiles == [], "a traced value or a new prompt length in the bucket recompiled"
    assert len(gen_mod._COMPILED) == n_compiled
    # The traced values are really used (not baked in at the first compile).
    assert outs[0] != base.generated_ids
    assert all(len(g) == 5 for g in outs[4])


def test_same_seed_same_output_different_seed_differs(models):
    kw = dict(max_new_tokens=NEW, temperature=1.0, ignore_eos=True)
    a = generate(models.target, PROMPTS_3, seed=3, **kw).generated_ids
    b = generate(models.target, PROMPTS_3, seed=3, **kw).generated_ids
    c = generate(models.target, PROMPTS_3, seed=4, **kw).generated_ids
    assert a == b
    assert a != c


BAD_INPUTS = [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[]), "No prompts"),
    (dict(prompts=[[1, 2, 3]], capacity=8, max_new_tokens=NEW), "does not fit the cache"),
    (dict(prompts=[list(range(40))], capacity=32), "does not fit the cache"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(prompts=[[1, 2, 101]]), "outside the vocabulary"),
    (dict(prompts=[[3], [-1, 4]]), "outside the vocabulary"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(stop_ids=list(range(9))), "stop ids"),
    (dict(drafter=NGramDrafter(k=4), k=0), "K"),
    (dict(drafter=NGramDrafter(k=-2)), "K"),
    (dict(drafter=NGramDrafter(k=4), k=50, capacity=64, max_new_tokens=20), "K=50"),
    (dict(drafter=NGramDrafter(k=4, min_ngram=3, max_ngram=2)), "min_ngram"),
]


@pytest.mark.parametrize("kwargs,match", BAD_INPUTS, ids=[m + str(i) for i, (_, m) in enumerate(BAD_INPUTS)])
def test_bad_input_raises_before_compiling(models, kwargs, match):
    kwargs = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    prompts = kwargs.pop("prompts")
    with count_compiles() as compiles, pytest.raises(ValueError, match=match):
        generate(models.target, prompts, **kwargs)
    assert compiles == []


def test_integral_float_max_new_tokens_is_accepted(models, ar3):
    r = generate(models.target, PROMPTS_3, max_new_tokens=float(NEW), ignore_eos=True)
    assert r.generated_ids == ar3
