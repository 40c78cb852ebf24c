"""Suffix speculation across requests (spec_jax/drafters/suffix.py): the store and its lookup, greedy
output equal to plain decoding alone and in front of a draft model, and the engine feeding finished
requests into the store so that a repeated request drafts from it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import make_prompts
from spec_jax.decoding import generate
from spec_jax.decoding.engine import Engine
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.drafters.suffix import SEPARATOR as S
from spec_jax.drafters.suffix import (SuffixDrafter, SuffixFirstDrafter, SuffixParams, SuffixStore,
                                     store_of_size, with_store)

STORE = 256  # one store shape for every test here: one compile per drafter and batch


def test_store_ring_and_lookup():
    # Bounded: the ring keeps the last `size` tokens written, documents separated; wrap-around.
    store = SuffixStore(8).extend([[1, 2, 3]])
    assert store.array().tolist() == [S, S, S, S, 1, 2, 3, S]
    store.add([4, 5, 6, 7])  # 9 tokens written in all: the oldest one falls off
    assert store.array().tolist() == [2, 3, S, 4, 5, 6, 7, S]
    store.add(range(20))  # longer than the store: its last 7 tokens
    assert store.array().tolist() == [13, 14, 15, 16, 17, 18, 19, S]
    assert store.array().shape == (8,) and store.ring.nbytes == 8 * 4

    drafter = SuffixDrafter(k=3, max_match=4, store_size=24)
    docs = [[9, 1, 2, 3, 4], [1, 2, 5, 6], [7, 8], [5, 6, 8, 8]]
    array = jnp.asarray(SuffixStore(24).extend(docs).array())
    rows = [
        [1, 2, 3],  # the longest match, "1 2 3" (in the oldest document), beats the latest "1 2"
        [5, 6],  # "5 6" then a separator has nothing to draft; the later "5 6 8 8": its 8 8, then cut
        [6, 7],  # "6 7" only across a separator, which matches nothing: "7" alone, in "7 8"
        [4, 1, 2, 4, 1, 2],  # the row's own earlier "4 1 2" beats the store's "1 2"
    ]
    tokens = jnp.asarray([r + [0] * (8 - len(r)) for r in rows], jnp.int32)
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    lookup = jax.jit(drafter.lookup)  # one program (eager, op by op, took 18 s)
    drafts, matched = lookup(array, tokens, lengths)
    # Past a continuation's end (a separator, or the row's last committed token): the last token.
    assert drafts.tolist() == [[4, 3, 3], [8, 8, 6], [8, 7, 7], [4, 1, 2]]
    assert matched.tolist() == [3, 2, 1, 3]
    # Wrap-around: a 10-token document overwrites the oldest one, "9 1 2 3 4": no "3" is left.
    wrapped = SuffixStore(24).extend(docs + [[8] * 9]).array()
    assert wrapped.tolist() == [S, 1, 2, 5, 6, S, 7, 8, S, 5, 6, 8, 8, S] + [8] * 9 + [S]
    drafts, matched = lookup(jnp.asarray(wrapped), tokens, lengths)
    assert drafts.tolist()[0] == [3, 3, 3] and matched.tolist()[0] == 0
    # An empty store: the row's own tokens only (as prompt lookup).
    empty = jnp.asarray(SuffixStore(24).array())
    assert lookup(empty, tokens, lengths)[0].tolist()[3] == [4, 1, 2]
    # A tree: the continuations of the two best "1 2" (latest first) as branches from the root.
    tree_drafter = SuffixDrafter(k=2, max_match=2, min_match=2, store_size=24, tree=4)
    tree, _ = jax.jit(tree_drafter.propose_tree)(SuffixParams(array), None, (), jnp.asarray([[1, 2, 0, 0]]),
                                        jnp.asarray([2]), None, None)
    assert tree.tokens.tolist() == [[5, 6, 3, 4]] and tree.parents.tolist() == [[0, 1, 0, 3]]
    # The store's size is the server's choice (`spec-jax serve --suffix-store-tokens`); other drafters refuse one.
    sized, params = store_of_size(SuffixFirstDrafter(NGramDrafter()), {"w": 1}, 100)
    assert sized.store_size == 100 and params.suffix_store.shape == (100,) and params.model == {"w": 1}
    with pytest.raises(ValueError, match="suffix-store-tokens"):
        store_of_size(NGramDrafter(), None, 100)
    with pytest.raises(ValueError, match="suffix_store is read by the suffix drafters"):
        with_store(NGramDrafter(), None, [[1, 2]])


NEW = 24


@pytest.fixture(scope="module")
def plain(models):
    """Prompts and their plain greedy continuations; `earlier` holds a random document and the
    first prompt with its continuation, as a store would after that request. Batch 3, as
    test_speculative_greedy's plain and n-gram runs: the suite compiles those programs once."""
    prompts = make_prompts([7, 12, 5], seed=5)
    out = generate(models.target, prompts, max_new_tokens=NEW)
    earlier = [make_prompts([30], seed=9)[0], prompts[0] + out.generated_ids[0]]
    return prompts, out.generated_ids, earlier


def test_greedy_output_equals_plain_decoding(models, plain):
    """Row 0 repeats the earlier request in the store (its drafts come from there); row 1 matches
    nothing there. The suffix drafter alone at batch 1 (a tree of 8: two matches' continuations)
    and 2 (a chain), and in front of the draft model at batch 2 (batch 1: the engine test).
    Compiles are the suite's budget: one per drafter and batch."""
    prompts, expected, earlier = plain
    k = 4
    cases = [
        (SuffixDrafter(k=k, store_size=STORE, tree=8), None, 1),
        (SuffixDrafter(k=k, store_size=STORE), None, 2),
        (SuffixFirstDrafter(DraftModelDrafter(models.draft_cfg, k=k), store_size=STORE), models.draft_params, 2),
    ]
    for drafter, params, batch in cases:
        name = (type(drafter).__name__, batch)
        r = generate(models.target, prompts[:batch], drafter, params, max_new_tokens=NEW, suffix_store=earlier)
        assert r.generated_ids == expected[:batch], name  # rows are independent: batch 3's rows
        hit = r.row_stats[0]
        assert hit.emitted >= 4 * hit.steps - k, name  # drafted from the store throughout (tau ~5)
        if batch == 1:
            continue
        assert r.row_stats[1].accepted < hit.accepted / 2, name
        # The store as params, holding no earlier text: only the rows' own tokens to match.
        r = generate(models.target, prompts[:2], drafter, with_store(drafter, params, []), max_new_tokens=NEW)
        assert r.generated_ids == expected[:2], name
        assert r.row_stats[0].accepted < hit.accepted / 2, name


def test_engine_feeds_finished_requests_into_the_store(models, plain):
    """A request finishes, its prompt + output go into the engine's store, and the same request
    again drafts from the store: more drafts accepted than prompt lookup (n-gram) on it. The
    suffix lookup in front of the draft model (one slot: batch 1), output equal to plain decoding."""
    prompts, expected, _ = plain
    drafter = SuffixFirstDrafter(DraftModelDrafter(models.draft_cfg, k=4), store_size=STORE)
    engine = Engine(models.target, drafter, models.draft_params, slots=1, max_model_len=48, chunk_steps=2)
    first = engine.submit(prompts[0], max_new_tokens=NEW)
    out = engine.run_all()[first]
    stored = engine.suffix_store.array().tolist()
    assert stored[-(len(prompts[0]) + NEW + 1):] == prompts[0] + out.new_ids + [S]
    assert stored.count(S) == STORE - len(prompts[0]) - NEW
    runs = {rid: engine.submit(p, max_new_tokens=NEW) for rid, p in enumerate(prompts[:2])}
    outs = engine.run_all()
    assert [outs[runs[i]].new_ids for i in range(2)] == expected[:2]
    assert out.new_ids == expected[0]
    repeat = outs[runs[0]].stats
    ngram = generate(models.target, prompts, NGramDrafter(k=4), max_new_tokens=NEW).row_stats[0]
    assert repeat.accepted > ngram.accepted
    assert repeat.accepted > out.stats.accepted
    assert engine.compiles == 3  # one chunk, one admit, the host's read: the new store did not recompile
