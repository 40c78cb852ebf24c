"""The engine's paged KV cache (issue 45, part 1): the target's keys/values in a shared pool of
pages read and written through a page table per row (`Engine(kv_pages=N)`). Greedy output of
chain and tree drafters through the paged engine equals `generate`, with requests arriving and
finishing at staggered times, waiting for pages, pages handed out again after frees, cancelled
requests giving theirs back (the pool empty after every run), and no compile after warm-up; at
the same cache bytes the paged engine runs 4x the concurrent short requests of the dense one."""

from __future__ import annotations

import jax
import pytest
from conftest import make_prompts
from test_engine import backend_compiles
from tiny_configs import TINY_DRAFT, VOCAB

from spec_jax.decoding.engine import Engine
from spec_jax.decoding.generate import generate
from spec_jax.decoding.pages import PagePool
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.drafters.suffix import SuffixDrafter

K = 3
PAGE = 32  # a divisor of the 128-slot block: a row of capacity 128 spans 4 pages
PROMPTS = make_prompts([3, 16, 1, 9, 12, 5], seed=0)
MAX_NEW = 24
POOL = 6  # 3 requests of 2 pages at a time: later ones wait for pages while a slot is free


def run_staggered(engine, cancel=None):
    """PROMPTS[0:2] at once, then one more after each step; `cancel` (an index) is cancelled
    after its first step -> (each request's ids, whether a request waited with a slot free)."""
    rids = [engine.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS[:2]]
    got: dict[int, list[int]] = {}
    waited_for_pages = False
    while engine.has_work() or len(rids) < len(PROMPTS):
        for e in engine.step():
            got.setdefault(e.request_id, []).extend(e.new_ids)
        waited_for_pages |= bool(engine.scheduler.waiting) and engine.num_live < engine.slots
        if cancel is not None and cancel < len(rids) and rids[cancel] in got:
            engine.cancel(rids[cancel])
            cancel = None
        if len(rids) < len(PROMPTS):
            rids.append(engine.submit(PROMPTS[len(rids)], max_new_tokens=MAX_NEW))
    return [got.get(r, []) for r in rids], waited_for_pages


def test_paged_engine_equals_generate_for_chain_and_tree_drafters(models, drafters):
    eagle3 = Eagle3Config(layer=TINY_DRAFT, draft_vocab_size=VOCAB - 20, aux_layer_ids=(1, 2))
    lookup, lookup_params = drafters["lookup"]
    cases = {  # (drafter, params): chains and trees; a drafter cache of its own (dense per slot)
        "plain": (None, None),
        "ngram tree": (NGramDrafter(k=K, tree=6), None),
        "draft model behind lookup": (lookup(K), lookup_params),
        "eagle3 tree": (Eagle3Drafter(eagle3, K, tree=6), init_eagle3_params(eagle3, jax.random.key(4), scale=3.0)),
        "suffix": (SuffixDrafter(k=K, store_size=64), None),
    }
    for name, (drafter, params) in cases.items():
        want = generate(models.target, PROMPTS, drafter, params, max_new_tokens=MAX_NEW).generated_ids
        engine = Engine(models.target, drafter, params, slots=4, max_model_len=48, chunk_steps=2,
                        kv_pages=POOL, kv_page_size=PAGE)
        engine.warmup([16])
        with backend_compiles() as compiles:
            got, waited = run_staggered(engine)
        assert got == want, name
        assert compiles == [], name
        assert waited, name  # the pool, not the slots, held a request back
        assert max(engine.pages.handed_out.values()) >= 2, name  # pages freed and handed out again
        assert engine.pages.used == 0 and engine.pages.owed() == 0, name
    # Cancelled mid-stream (and while waiting): their pages go back; the others are unchanged.
    got, _ = run_staggered(engine, cancel=1)
    assert [g for i, g in enumerate(got) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    assert len(got[1]) < MAX_NEW and engine.pages.used == 0 and engine.pages.free == POOL
    assert not engine.pages.table.any() or (engine.pages.table == POOL).all()


def test_paged_engine_admits_4x_the_short_requests_at_the_same_cache_bytes(models):
    """Two dense slots of 128 slots each hold the same bytes as 8 pages of 32: short requests
    (1 page each) run 8 at a time in the paged engine, 2 in the dense one."""
    drafter = NGramDrafter(k=K)
    dense = Engine(models.target, drafter, slots=2, max_model_len=48, chunk_steps=2)
    paged = Engine(models.target, drafter, slots=8, max_model_len=48, chunk_steps=2, kv_pages=8, kv_page_size=PAGE)
    cache_bytes = [sum(x.nbytes for x in (*e.state.cache.k, *e.state.cache.v)) for e in (dense, paged)]
    assert cache_bytes[0] == cache_bytes[1]
    short = make_prompts([5] * 12, seed=1)
    most = []
    for engine in (dense, paged):
        for p in short:
            engine.submit(p, max_new_tokens=4, ignore_eos=True)
        live = 0
        while engine.has_work():
            engine.step()
            live = max(live, engine.num_live)
        most.append(live)
    assert most == [2, 8] and most[1] >= 4 * most[0]
    assert paged.pages.used == 0


def test_page_pool_hands_out_grows_and_takes_back():
    pool = PagePool(num_pages=4, page_size=32, slots=3, pages_per_row=4)
    assert pool.reserve(0, 70) and pool.reserved[0] == 3  # 70 slots: 3 pages set aside
    pool.grow(0, 33)
    assert pool.held[0] == 2 and pool.used == 2 and pool.table[0].tolist() == [0, 1, 4, 4]
    assert not pool.reserve(1, 64)  # 2 free, but row 0 is owed 1 more: only 1 may go
    assert pool.reserve(1, 10)
    pool.grow(1, 10)
    pool.grow(0, 1000)  # up to its reservation, never past it
    assert pool.held[0] == 3 and pool.free == 0
    pool.release(0)
    assert pool.free == 3 and (pool.table[0] == 4).all() and pool.reserved[0] == 0
    assert pool.reserve(2, 96)
    pool.grow(2, 96)
    assert sorted(p for p, n in pool.handed_out.items() if n == 2) == [0, 1, 3]  # the freed ones, again


def test_paged_engine_settings_are_checked(models):
    with pytest.raises(ValueError, match="divide 128"):
        Engine(models.target, slots=2, max_model_len=48, kv_pages=4, kv_page_size=48)
    with pytest.raises(ValueError, match="chunked prefill"):
        Engine(models.target, slots=2, max_model_len=48, kv_pages=4, prefill_chunk_tokens=32)
    engine = Engine(models.target, slots=2, max_model_len=100, kv_pages=1, kv_page_size=PAGE)
    with pytest.raises(ValueError, match="raise kv_pages"):
        engine.submit([1, 2, 3], max_new_tokens=90)
