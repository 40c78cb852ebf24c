"""The engine's per-request sampling state and logprobs (issue 45), with a greedy drafter kind
(an n-gram tree of 6 nodes) and a model drafter (a chain of sampled drafts with their probabilities):
  - each row carries its request's own PRNG key, so a seeded sampled request gives the same
    tokens alone and beside 7 others in other slots, and unseeded requests get fresh seeds (that
    per-row keys keep sampling exact is a chi-square test in test_sampling_stats);
  - logprobs under speculation are the target's: equal, to 1e-5, to the log-softmax of a plain
    full forward pass over the same tokens (top tokens too), greedy and sampled, along a tree's
    accepted path and a chain's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_prompts

from spec_jax.decoding.engine import Engine
from spec_jax.drafters.draft_model import self_drafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models import forward, init_cache

SLOTS = 8
MAX_MODEL_LEN = 48
TOP = 3
PROMPTS = make_prompts([5, 16, 3, 9, 12, 7, 14, 2], seed=4)
SEEDED = dict(max_new_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
# The 7 others: greedy, other temperatures and truncations, other seeds, other lengths.
OTHERS = [
    dict(max_new_tokens=12),
    dict(max_new_tokens=25, temperature=1.2, top_k=5, seed=1),
    dict(max_new_tokens=8, temperature=0.7, top_p=0.8, seed=2),
    dict(max_new_tokens=30, temperature=1.0),
    dict(max_new_tokens=16, temperature=0.5, top_k=3, seed=3),
    dict(max_new_tokens=20),
    dict(max_new_tokens=22, temperature=1.0, seed=7),
]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def engine(request, models):
    if request.param == "ngram":
        # A tree of 6 n-gram nodes: logprobs are read at the accepted path's nodes.
        e = Engine(models.target, NGramDrafter(k=3, tree=6), slots=SLOTS, max_model_len=MAX_MODEL_LEN,
                   chunk_steps=4, max_logprobs=TOP)
    else:  # sampled drafts with their probabilities (the target's weights plus noise)
        e = Engine(models.target, self_drafter(models.cfg, 3), models.near_params, slots=SLOTS,
                   max_model_len=MAX_MODEL_LEN, chunk_steps=4, max_logprobs=TOP)
    e.warmup([16])
    return e


def run(engine, requests):
    """Submit every (prompt, values) at once, run to the end -> each request's tokens, in order."""
    ids = [engine.submit(prompt, **values) for prompt, values in requests]
    out = engine.run_all()
    return [out[rid].new_ids for rid in ids]


def test_a_seeded_request_gives_the_same_tokens_alone_and_beside_seven_others(engine):
    (alone,) = run(engine, [(PROMPTS[0], SEEDED)])
    # Beside 7 others, in slot 4, and again in slot 0 with the others around it.
    others = [(p, v) for p, v in zip(PROMPTS[1:], OTHERS)]
    beside = run(engine, others[:4] + [(PROMPTS[0], SEEDED)] + others[4:])
    first = run(engine, [(PROMPTS[0], SEEDED)] + others)
    assert len(alone) == 20 and beside[4] == alone and first[0] == alone
    # The others are their own: the same prompt with another seed differs, and a sampled row
    # without a seed got a fresh one (its two runs differ).
    (other_seed,) = run(engine, [(PROMPTS[0], dict(SEEDED, seed=8))])
    assert other_seed != alone
    assert beside[3] != first[4]  # OTHERS[3] has no seed


@jax.jit
def full_forward_log_probs(params, tokens):
    """log_softmax of the target's logits over one padded sequence [1, MAX_MODEL_LEN]: plain
    decoding's distributions at every position, in one pass."""
    from tiny_configs import TINY_TARGET

    positions = jnp.arange(MAX_MODEL_LEN)[None]
    logits, _, _ = forward(params, TINY_TARGET, tokens, positions, init_cache(TINY_TARGET, 1, MAX_MODEL_LEN))
    return jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)


def assert_logprobs_are_the_targets(params, prompt, new_ids, logprobs, top):
    """Each token's log-probability, and the `top` most likely there, equal a full forward pass's."""
    sequence = np.zeros((1, MAX_MODEL_LEN), np.int32)
    sequence[0, : len(prompt) + len(new_ids)] = prompt + new_ids
    reference = np.asarray(full_forward_log_probs(params, jnp.asarray(sequence)))
    at = np.arange(len(prompt) - 1, len(prompt) + len(new_ids) - 1)  # the position that produced each token
    # float32 rounding: the engine's one- and few-token passes and the full pass accumulate in
    # other orders (on one AMD VM a log-probability of -1.078 differed by 1.1e-5).
    close = dict(atol=1e-5, rtol=2e-5)
    np.testing.assert_allclose([chosen for chosen, _ in logprobs], reference[at, new_ids], **close)
    for (_, top_values), row in zip(logprobs, reference[at]):
        assert len(top_values) == top
        np.testing.assert_allclose(top_values, -np.sort(-row)[:top], **close)


def test_logprobs_under_speculation_are_the_targets(engine, models):
    requests = [(PROMPTS[1], dict(max_new_tokens=24, logprobs=TOP)),  # greedy: drafts get accepted
                (PROMPTS[2], dict(max_new_tokens=20, temperature=1.0, seed=5, logprobs=0)),
                (PROMPTS[3], dict(max_new_tokens=10))]  # asks for none
    ids = [engine.submit(p, **v) for p, v in requests]
    events = {rid: [] for rid in ids}
    while engine.has_work():
        for e in engine.step():
            events[e.request_id].append(e)
    assert all(e.logprobs is None for e in events[ids[2]])
    accepted = 0
    for (prompt, values), rid in zip(requests[:2], ids):
        got = [lp for e in events[rid] for lp in e.logprobs]
        new_ids = [t for e in events[rid] for t in e.new_ids]
        accepted += events[rid][-1].stats.accepted
        assert [lp.token_id for lp in got] == new_ids
        assert_logprobs_are_the_targets(models.params, prompt, new_ids,
                                        [(lp.logprob, [v for _, v in lp.top]) for lp in got], values["logprobs"])
    assert accepted > 0  # speculation ran: tokens came from verify passes that accepted drafts


def test_logprobs_keep_one_chunks_ring_and_stay_the_targets_when_every_draft_is_accepted(models):
    """The engine keeps the logprobs of one chunk's read window a row ([slots, W, top], a ring:
    position p at slot p % W), not [slots, capacity, top]. With the target as its own drafter every
    draft is accepted, so each chunk commits W tokens a row and its positions wrap the whole ring
    between two reads: every token's logprobs still equal a full forward pass's."""
    engine = Engine(models.target, self_drafter(models.cfg, 3), models.params, slots=2,
                    max_model_len=MAX_MODEL_LEN, chunk_steps=2, max_logprobs=TOP)
    width = engine.window_width
    assert width == 8 < engine.capacity
    assert engine.state.logprobs.chosen.shape == (2, width) and engine.state.logprobs.top_ids.shape == (2, width, TOP)
    requests = [(PROMPTS[1], dict(max_new_tokens=24, logprobs=TOP, ignore_eos=True)),
                (PROMPTS[4], dict(max_new_tokens=19, logprobs=2, ignore_eos=True))]
    ids = [engine.submit(p, **v) for p, v in requests]
    events = {rid: [] for rid in ids}
    while engine.has_work():
        for e in engine.step():
            events[e.request_id].append(e)
    for (prompt, values), rid in zip(requests, ids):
        got = [lp for e in events[rid] for lp in e.logprobs]
        new_ids = [t for e in events[rid] for t in e.new_ids]
        stats = events[rid][-1].stats
        assert len(new_ids) == values["max_new_tokens"] and stats.accepted == stats.drafted > 0
        assert_logprobs_are_the_targets(models.params, prompt, new_ids,
                                        [(lp.logprob, [v for _, v in lp.top]) for lp in got], values["logprobs"])
