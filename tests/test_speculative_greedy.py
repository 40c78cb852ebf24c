"""Greedy speculative decoding is token-identical to the AR baseline, for every drafter kind.

Drafter x K x batch is a Latin square (each drafter meets each K and each batch size once) so the
suite compiles 9 speculative loops, not 27. `self` (the target drafting for itself: every draft
accepted) and `near` (the target's weights plus noise: some accepted) share one static drafter and
so one compile per (K, batch). `draft` is a separate random 1-layer model (almost nothing
accepted). Rows mix prompt lengths; EOS (default stop id) ends some rows early.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_prompts
from spec_jax.decoding import generate

NEW = 40
# Prompts with repetition (so the n-gram drafter finds matches) among random ones, lengths mixed.
REPEAT = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
PROMPTS = {
    1: make_prompts([3], seed=0),  # runs all 40 tokens without meeting EOS
    3: make_prompts([3, 16, 1], seed=0)[:2] + [REPEAT],
    8: make_prompts([3, 16, 1, 12, 5, 9, 2, 14], seed=0)[:6] + [REPEAT, [72, 72, 72]],
}
CASES = [  # (drafter, K, batch)
    ("ngram", 1, 1), ("ngram", 4, 3), ("ngram", 8, 8),
    ("self", 1, 3), ("self", 4, 8), ("self", 8, 1),
    ("draft", 1, 8), ("draft", 4, 1), ("draft", 8, 3),
    ("lookup", 4, 8), ("lookup", 8, 3), ("dflash_lookup", 4, 1),
]


@pytest.fixture(scope="module")
def ar(models):
    return {b: generate(models.target, p, max_new_tokens=NEW) for b, p in PROMPTS.items()}


def check_row_stats(result, k):
    for row, (gen, s) in enumerate(zip(result.generated_ids, result.row_stats)):
        hist = np.asarray(s.acceptance_histogram)
        assert len(hist) == k + 1
        assert s.drafted == k * s.steps, row
        assert hist.sum() == s.steps, row
        assert s.emitted == len(gen) - 1, row  # the first token comes from prefill
        assert s.accepted == int((np.arange(k + 1) * hist).sum()), row
        # Each step emits 1..K+1 tokens.
        assert s.steps <= s.emitted <= (k + 1) * s.steps, row
        # position i accepted => positions < i accepted: rates never increase along the block.
        rates = np.asarray(s.position_acceptance)
        assert np.all(np.diff(rates) <= 1e-9), row
        # Rows that finished on the cap took no more steps than the loop did.
        assert s.steps <= result.loop_steps
    assert result.loop_steps == max(s.steps for s in result.row_stats)


@pytest.mark.parametrize("name,k,batch", CASES, ids=[f"{n}-k{k}-b{b}" for n, k, b in CASES])
def test_greedy_speculative_equals_ar(models, drafters, ar, name, k, batch):
    make, params = drafters[name]
    r = generate(models.target, PROMPTS[batch], make(k), params, max_new_tokens=NEW)
    assert r.generated_ids == ar[batch].generated_ids
    assert r.finish_reasons == ar[batch].finish_reasons
    check_row_stats(r, k)
    if name == "self":  # the target drafting for itself: every draft accepted
        for s in r.row_stats:
            assert s.accepted == s.drafted
            assert s.acceptance_histogram[:k] == [0] * k
            # K + 1 tokens per step; only the last block may be cut by the cap or a stop.
            assert s.emitted >= (k + 1) * (s.steps - 1) + 1
    if name == "draft":  # a random 101-token draft model: almost nothing accepted
        assert r.stats.accepted <= 0.2 * r.stats.drafted
    if name == "lookup":  # the same draft model behind prompt lookup: the repeating rows accept
        plain = generate(models.target, PROMPTS[batch], drafters["draft"][0](k), params, max_new_tokens=NEW)
        assert r.stats.accepted > plain.stats.accepted


@pytest.mark.parametrize("name", ["lookup", "dflash_lookup"])
def test_lookup_first_takes_the_lookup_where_the_suffix_recurs(models, drafters, name):
    """Rows whose last 2+ tokens occurred earlier get what followed them, as point masses; the
    other rows get the model drafter's drafts and probabilities unchanged. With DFlash behind the
    lookup, a batch where every row takes the lookup skips DFlash and returns its state as is."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from spec_jax.models import Decoder, Target
    from spec_jax.sampling import SamplingParams

    make, params = drafters[name]
    drafter = dataclasses.replace(make(3), min_match=2)
    target = Target(models.params, Decoder(models.cfg))
    tokens = jnp.asarray([[1, 2, 3, 9, 4, 1, 2, 0, 0], [1, 2, 3, 9, 4, 5, 2, 0, 0]], jnp.int32)
    lengths = jnp.asarray([7, 7], jnp.int32)  # row 0 ends in [1, 2], seen at 0; row 1 ends in [5, 2]
    features = len(drafter.capture_layers) * models.cfg.hidden_size
    captured = jax.random.normal(jax.random.key(4), (2, 9, features)) if features else None
    state = drafter.init(params, target, tokens, lengths - 1, captured, 16)
    sampling = SamplingParams.create(1.0, 0, 1.0)
    key = jax.random.key(0)
    propose = jax.jit(drafter.propose)  # traced as in the loop: the skip is a lax.cond
    drafts, probs, _ = propose(params, target, state, tokens, lengths, key, sampling)
    m_drafts, m_probs, _ = drafter.model.propose(params, target, state, tokens, lengths, key, sampling)
    assert drafts[0].tolist() == [3, 9, 4]
    np.testing.assert_array_equal(np.asarray(probs[0]), np.eye(probs.shape[-1])[[3, 9, 4]])
    assert drafts[1].tolist() == m_drafts[1].tolist()
    np.testing.assert_allclose(np.asarray(probs[1]), np.asarray(m_probs[1]), atol=1e-6)
    # Both rows matching: lookup drafts only, and the model drafter's state comes back unchanged.
    both = tokens.at[1].set(tokens[0])
    drafts, probs, new_state = propose(params, target, state, both, lengths, key, sampling)
    assert drafts.tolist() == [[3, 9, 4]] * 2
    np.testing.assert_array_equal(np.asarray(probs), np.eye(probs.shape[-1])[[[3, 9, 4]] * 2])
    if name == "dflash_lookup":
        for a, b in zip(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # generate's k= override reaches the model drafter too.
    assert dataclasses.replace(drafter, k=2).model.k == 2


def test_draft_model_cache_follows_committed_tokens_it_did_not_draft(models, drafters):
    """After a step whose accepted tokens were someone else's drafts (prompt lookup's), the draft
    model proposes exactly what it proposes from a fresh prefill of the committed tokens: its
    cache holds the committed tokens, not its own rejected drafts."""
    import jax
    import jax.numpy as jnp

    from spec_jax.models import Decoder, Target
    from spec_jax.sampling import SamplingParams

    k = 4
    make, params = drafters["draft"]
    drafter = make(k)
    target = Target(models.params, Decoder(models.cfg))
    sampling = SamplingParams.create(1.0, 0, 1.0)
    key = jax.random.key(0)
    # Prompt of 3 + first token = 4 committed; then K foreign drafts accepted + a bonus token.
    committed = [[5, 17, 33, 8, 61, 2, 90, 44, 12], [7, 3, 8, 19, 1, 66, 25, 70, 9]]
    tokens = jnp.asarray([row + [0] * 7 for row in committed], jnp.int32)  # [2, 16]
    state = drafter.init(params, target, tokens[:, :3], jnp.asarray([3, 3]), None, 32)
    lengths = jnp.asarray([4, 4], jnp.int32)
    own, _, state = drafter.propose(params, target, state, tokens, lengths, key, sampling)
    assert not np.array_equal(np.asarray(own), np.asarray(tokens[:, 4 : 4 + k]))
    state = drafter.commit(params, target, state, lengths - 1, jnp.asarray([k, k]), None)
    lengths = lengths + k + 1
    drafts, probs, _ = drafter.propose(params, target, state, tokens, lengths, key, sampling)

    fresh = drafter.init(params, target, tokens[:, :9], lengths, None, 32)
    f_drafts, f_probs, _ = drafter.propose(params, target, fresh, tokens, lengths, key, sampling)
    np.testing.assert_allclose(np.asarray(probs), np.asarray(f_probs), atol=1e-5)
    assert drafts.tolist() == f_drafts.tolist()


def test_near_draft_model_accepts_some_and_equals_ar(models, drafters, ar):
    """The target plus weight noise as draft model (same compile as `self`, K=4, batch 8)."""
    make, params = drafters["near"]
    r = generate(models.target, PROMPTS[8], make(4), params, max_new_tokens=NEW)
    assert r.generated_ids == ar[8].generated_ids
    check_row_stats(r, 4)
    assert 0 < r.stats.accepted < r.stats.drafted


def test_ngram_accepts_on_repetition(models, drafters, ar):
    make, _ = drafters["ngram"]
    r = generate(models.target, PROMPTS[8], make(8), None, max_new_tokens=NEW)
    assert r.generated_ids == ar[8].generated_ids
    # The [72, 72, 72] row's greedy output repeats 72: the n-gram drafter proposes it and wins.
    assert r.row_stats[7].accepted > 0
    assert r.stats.tau > 1.0


@pytest.mark.parametrize("name", ["ngram", "self", "draft"])
def test_greedy_with_stop_id_and_short_cap_equals_ar(models, drafters, ar, name):
    """A stop id met inside an accepted block and a cap that ends mid-block (K=4, batch 8/3)."""
    full = ar[8].generated_ids
    stop = full[0][6]
    batch, k = {"ngram": (3, 4), "self": (8, 4), "draft": (1, 4)}[name]
    prompts = PROMPTS[batch]
    make, params = drafters[name]
    for i, kw in enumerate([dict(stop_ids=[stop]), dict(max_new_tokens=7, ignore_eos=True), dict(max_new_tokens=2)]):
        kw = {"max_new_tokens": NEW, **kw}
        want = generate(models.target, prompts, **kw)
        got = generate(models.target, prompts, make(k), params, **kw)
        assert got.generated_ids == want.generated_ids, kw
        assert got.finish_reasons == want.finish_reasons, kw
        # Stop ids and caps are traced: the first call may compile (another test may have, unless
        # other files' programs pushed it out of the bounded program cache), the others never.
        assert i == 0 or got.compile_s == 0.0, kw
        check_row_stats(got, k)
