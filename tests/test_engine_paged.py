"""The engine's paged KV cache (issue 45, part 1): the target's keys/values in a shared pool of
pages read and written through a page table per row (`Engine(kv_pages=N)`). Greedy output of
every drafter kind, chains and trees, through the paged engine equals `generate`, with requests
arriving and finishing at staggered times, waiting for pages, pages handed out again after
frees, a prompt's first page shared (prefix caching), cancelled requests giving theirs back (the
pool empty after every run), and no compile after warm-up; chunked prefill writes a long prompt
into its pages while other requests stream; at the same cache bytes the paged
engine runs 4x the concurrent short requests of the dense one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_prompts
from test_engine import MAX_NEW, PROMPTS, backend_compiles, serve_engine_kwargs
from tiny_configs import TINY_DFLASH, TINY_DRAFT, TINY_GEMMA4, TINY_TARGET, VOCAB, tiny_dflash

from spec_jax.app import serve
from spec_jax.app.metrics import _EngineCollector
from spec_jax.decoding.engine import Engine
from spec_jax.decoding.generate import generate
from spec_jax.decoding.pages import PagePool
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.drafters.gemma4_assistant import Gemma4AssistantDrafter, assistant_config_for_target, init_assistant_params
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, init_medusa_params
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.drafters.suffix import SuffixFirstDrafter
from spec_jax.models import init_params, paged
from spec_jax.models.attention import attend_cache_and_pass
from spec_jax.models.config import GLOBAL_WINDOW
from spec_jax.models.interface import chain_mask
from spec_jax.sharding import make_mesh

K = 3
PAGE = 8  # a divisor of the 128-slot block: a row of capacity 128 spans 16 pages, a prompt of 16 two
POOL = 16  # pages: 2 or 3 requests at a time of the 8 slots, so later ones wait for pages while slots are free
# test_engine's prompts (<= 16 tokens, rows 1 and 2 meet EOS mid-way), one repetitive (the
# lookups draft from it) and one starting with PROMPTS[1]'s first page (prefix caching shares it).
PAGED_PROMPTS = [*PROMPTS[:3], [5, 6, 7, 8, 5, 6, 7, 8, 5], PROMPTS[1][:PAGE] + PROMPTS[4][PAGE:], PROMPTS[5]]


def paged_engine(target, drafter, drafter_params=None, prefix_caching=False):
    """8 slots over a pool of POOL pages of PAGE slots (the same programs with or without
    prefix caching, which adds one admit per bucket)."""
    return Engine(target, drafter, drafter_params, slots=8, max_model_len=48, chunk_steps=2, kv_pages=POOL,
                  kv_page_size=PAGE, prefix_caching=prefix_caching)


def run_staggered(engine, prompts, cancel=None):
    """prompts[0:3] at once, then one more after each step; `cancel` (an index) is cancelled
    after its first step -> (each request's ids, whether a request waited with a slot free)."""
    rids = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts[:3], MAX_NEW)]
    got: dict[int, list[int]] = {}
    waited_for_pages = False
    while engine.has_work() or len(rids) < len(prompts):
        for e in engine.step():
            got.setdefault(e.request_id, []).extend(e.new_ids)
        waited_for_pages |= bool(engine.scheduler.waiting) and engine.num_live < engine.slots
        if cancel is not None and cancel < len(rids) and rids[cancel] in got:
            engine.cancel(rids[cancel])
            cancel = None
        if len(rids) < len(prompts):
            rids.append(engine.submit(prompts[len(rids)], max_new_tokens=MAX_NEW[len(rids)]))
    return [got.get(r, []) for r in rids], waited_for_pages


def every_drafter_kind(models) -> dict[str, tuple]:
    """name -> (target, drafter, drafter params, prefix caching): every registered kind, chains
    and trees (the two ways a step commits to the cache), the model drafters with test_engine's
    mesh worker's shapes (K = 3). An engine compiles its own programs (seconds each), so kinds
    share engines where the registry combines them: `self` (the draft model with the target's
    config) is the draft-model kind, behind the suffix lookup. Prefix caching is on for n-gram
    (its programs are the two tests' below), off for the others (one more program each; the
    drafters that start from captured hidden states refuse it)."""
    llama = models.target
    # The random model drafters' drafts are all but never accepted, so their depth adds compile
    # time (seconds per engine) and no coverage: one draft each, a chain or two siblings.
    dflash_cfg = tiny_dflash(2)
    eagle3_cfg = Eagle3Config(layer=TINY_DRAFT, draft_vocab_size=VOCAB - 20, aux_layer_ids=(1, 2))
    medusa_cfg = MedusaConfig.for_target(TINY_TARGET, num_heads=1)
    assistant_cfg = assistant_config_for_target(TINY_GEMMA4, hidden_size=32, num_layers=2, k=1)
    return {
        "none": (llama, None, None, False),
        "ngram": (llama, NGramDrafter(k=K), None, True),
        # Every draft accepted (the target drafts for itself): every step moves tree nodes.
        "self / draft-model tree + suffix": (llama, SuffixFirstDrafter(DraftModelDrafter(TINY_TARGET, K, tree=6),
                                                                        min_match=1, store_size=64),
                                            models.params, False),
        "dflash": (llama, DFlashDrafter(dflash_cfg, 1), init_dflash_params(dflash_cfg, jax.random.key(3), scale=3.0),
                   False),
        "eagle3 tree": (llama, Eagle3Drafter(eagle3_cfg, 1, tree=2),
                        init_eagle3_params(eagle3_cfg, jax.random.key(4), scale=3.0), False),
        "medusa": (llama, MedusaDrafter(medusa_cfg, 1), init_medusa_params(medusa_cfg, jax.random.key(5), scale=3.0),
                   False),
        # The Gemma 4 assistant keeps no cache: it reads the target's pages (sliding and KV-shared layers).
        "mtp tree (Gemma 4 assistant)": ((TINY_GEMMA4, init_params(TINY_GEMMA4, jax.random.key(6), scale=3.0)),
                                         Gemma4AssistantDrafter(assistant_cfg, 1, tree=2),
                                         init_assistant_params(assistant_cfg, jax.random.key(7), scale=3.0), False),
    }


@pytest.mark.slow  # seven engines' programs (about 45 s): the full suite; the fast lane keeps the chunked-prefill case
def test_paged_engine_equals_generate_for_every_drafter_kind(models):
    """Every drafter kind, chain and tree, through the paged engine: requests arriving one per
    step and finishing at staggered times (EOS or their cap), the pool (not the slots) holding
    later ones back, pages freed and handed out again, a prompt sharing an earlier one's first
    page where prefix caching is on; greedy output equals `generate`, no compile after warm-up,
    the pool empty after."""
    want = {}  # target config -> each prompt's greedy continuation by plain `generate`
    for kind, (target, drafter, params, prefix_caching) in every_drafter_kind(models).items():
        if target[0] not in want:
            want[target[0]] = [generate(target, [p], max_new_tokens=n).generated_ids[0]
                               for p, n in zip(PAGED_PROMPTS, MAX_NEW)]
        engine = paged_engine(target, drafter, params, prefix_caching)
        engine.warmup([16])
        with backend_compiles() as compiles:
            got, waited = run_staggered(engine, PAGED_PROMPTS)
        assert got == want[target[0]], kind
        assert compiles == [], kind
        assert waited, kind  # the pool, not the slots, held a request back
        assert max(engine.pages.handed_out.values()) >= 2, kind  # pages freed and handed out again
        assert engine.pages.shared_hits == (1 if prefix_caching else 0), kind
        assert engine.pages.used == 0 and engine.pages.owed() == 0, kind
    # Cancelled mid-stream (the last kind's engine): its pages go back; the others are unchanged.
    got, _ = run_staggered(engine, PAGED_PROMPTS, cancel=1)
    assert [g for i, g in enumerate(got) if i != 1] == [w for i, w in enumerate(want[target[0]]) if i != 1]
    assert len(got[1]) < MAX_NEW[1] and engine.pages.used == 0 and engine.pages.free == POOL
    assert (engine.pages.table == POOL).all()


def test_paged_engine_runs_4x_the_short_requests_at_the_same_cache_bytes(models):
    """The dense engine's one slot of 128 cache slots holds the bytes of the paged engine's 16
    pages of 8; a dense engine runs at most its slots at once (1), the paged one runs 5 short
    requests (3 pages each at worst: prompt 5 + 4 new + one chunk's 8) at once."""
    dense = Engine(models.target, NGramDrafter(k=K), slots=1, max_model_len=48, chunk_steps=2)
    paged = paged_engine(models.target, NGramDrafter(k=K))
    cache_bytes = [sum(x.nbytes for x in (*e.state.cache.k, *e.state.cache.v)) for e in (dense, paged)]
    assert cache_bytes[0] == cache_bytes[1]
    assert paged.open_slots == 8  # an empty pool: every free slot
    for p in make_prompts([5] * 12, seed=1):
        paged.submit(p, max_new_tokens=4, ignore_eos=True)
    most, gauges, pool_full_with_free_slots = 0, [], False
    while paged.has_work():
        paged.step()
        most = max(most, paged.num_live)
        # The serve queue's bound sees no open slot while the pool cannot take the next request.
        pool_full_with_free_slots |= paged.open_slots == 0 and paged.num_live < paged.slots
        gauges.append({f.name: f.samples[0].value for f in _EngineCollector(paged, "ngram").collect()
                       if f.name.startswith("spec_jax_kv_pages")})
    assert most == 5 and most >= 4 * dense.slots and pool_full_with_free_slots
    # /metrics shows the pool: pages in use while requests run, all free after the run.
    assert max(g["spec_jax_kv_pages_used"] for g in gauges) >= 5
    assert all(g["spec_jax_kv_pages_used"] + g["spec_jax_kv_pages_free"] == POOL for g in gauges)
    assert gauges[-1] == {"spec_jax_kv_pages_used": 0, "spec_jax_kv_pages_free": POOL}


def test_prefix_caching_shares_whole_prompt_pages_and_output_equals_generate(models):
    """Prompts that begin with PROMPTS[1]'s first page share it (read-only, counted) instead of
    prefilling it again, while it is held and after it is freed; the page where a prompt differs
    is its own. Output equals `generate` (batch 1, the shapes of test_engine's `alone`)."""
    base = PROMPTS[1]
    prompts = [base, base[:10] + [7, 8, 9], base[:PAGE] + [1, 2, 3, 4, 5, 6, 7, 8], base[:15] + [42],
               [base[0] + 1] + base[1:]]  # the last differs in its first page: nothing to share
    want = [generate(models.target, [p], max_new_tokens=24, ignore_eos=True).generated_ids[0] for p in prompts]
    engine = paged_engine(models.target, NGramDrafter(k=K), prefix_caching=True)
    engine.warmup([16])
    got: dict[int, list[int]] = {}

    def step():
        for e in engine.step():
            got.setdefault(e.request_id, []).extend(e.new_ids)

    with backend_compiles() as compiles:
        rids = [engine.submit(prompts[0], max_new_tokens=24, ignore_eos=True)]
        step()  # the first prompt prefilled, its whole page registered
        rids += [engine.submit(p, max_new_tokens=24, ignore_eos=True) for p in prompts[1:3]]
        step()
        shared_refs = int(engine.pages.refs.max())
        while engine.has_work():
            step()  # every page free again, the shared one still cached
        rids += [engine.submit(p, max_new_tokens=24, ignore_eos=True) for p in prompts[3:]]
        while engine.has_work():
            step()
    assert [got[r] for r in rids] == want
    assert compiles == []
    assert shared_refs == 3  # one page held by three rows at once
    assert engine.pages.shared_hits == 3 and engine.prefill_tokens_saved == 3 * PAGE
    saved = [f for f in _EngineCollector(engine, "ngram").collect() if f.name == "spec_jax_prefix_cached_tokens"]
    assert saved[0].samples[0].value == 3 * PAGE  # in /metrics
    assert engine.pages.used == 0 and engine.pages.free == POOL


def test_paged_engine_with_chunked_prefill_equals_generate(models):
    """Chunked prefill into pages (plain decoding, and DFlash, whose state starts from the
    prompt's captured hidden states): two requests stream, then a 40-token prompt arrives and
    prefills in 3 passes of 16 tokens (the smallest budget: one pass shape) between their
    chunks, beside a prompt sharing its first 4 pages (prefix caching, plain decoding); greedy
    output equals `generate`, no compile after warm-up, the pool empty after."""
    long = make_prompts([40], seed=9)[0]
    prompts, max_new = [PAGED_PROMPTS[1], PAGED_PROMPTS[0], long, long[:32] + [7]], [*MAX_NEW[1::-1], 8, 8]
    want = [generate(models.target, [p], max_new_tokens=n).generated_ids[0] for p, n in zip(prompts[:2], max_new)]
    want += generate(models.target, prompts[2:], max_new_tokens=8).generated_ids
    dflash_cfg = tiny_dflash(2)  # every_drafter_kind's: its chunk program is shared
    cases = {"none": (None, None, True),
             "dflash": (DFlashDrafter(dflash_cfg, 1), init_dflash_params(dflash_cfg, jax.random.key(3), scale=3.0),
                        False)}
    for name, (drafter, params, prefix_caching) in cases.items():
        engine = Engine(models.target, drafter, params, slots=8, max_model_len=48, chunk_steps=2, kv_pages=POOL,
                        kv_page_size=PAGE, prefix_caching=prefix_caching, prefill_chunk_tokens=16)
        engine.warmup([16, 64])
        got: dict[int, list[int]] = {}
        long_passes = streamed_meanwhile = 0
        with backend_compiles() as compiles:
            rids = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts[:2], max_new)]
            for _ in range(2):  # the two short ones stream
                for e in engine.step():
                    got.setdefault(e.request_id, []).extend(e.new_ids)
            rids += [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts[2:], max_new[2:])]
            while engine.has_work():
                events = engine.step()
                prefilling_long = rids[2] not in got  # each step until its first token runs one of its passes
                long_passes += prefilling_long
                streamed_meanwhile += prefilling_long and any(e.new_ids for e in events if e.request_id in rids[:2])
                for e in events:
                    got.setdefault(e.request_id, []).extend(e.new_ids)
        assert [got[r] for r in rids] == want, name
        assert compiles == [], name
        assert long_passes == 3 and streamed_meanwhile >= 2, (name, long_passes, streamed_meanwhile)
        assert engine.pages.shared_hits == (4 if prefix_caching else 0), name
        assert engine.prefill_tokens_saved == (32 if prefix_caching else 0), name
        assert engine.pages.used == 0 and engine.pages.owed() == 0 and not engine.prefill_plan.active, name
    # Cancelled mid-prefill (the last engine): its pages go back.
    rid = engine.submit(long, max_new_tokens=8)
    assert engine.step() == [] and engine.pages.used == 6  # its prompt's pages, granted up front
    engine.cancel(rid)
    assert [e.finish_reason for e in engine.step()] == ["cancelled"]
    assert engine.pages.used == 0 and engine.pages.owed() == 0 and not engine.has_work()


def test_serve_kv_pages_reach_the_engine(monkeypatch):
    kwargs = serve_engine_kwargs(monkeypatch, ["--kv-pages", "64", "--kv-page-size", "32", "--prefix-caching",
                                               "--prefill-chunk-tokens", "64"])
    assert (kwargs["kv_pages"], kwargs["kv_page_size"], kwargs["prefix_caching"]) == (64, 32, True)
    assert kwargs["prefill_chunk_tokens"] == 64  # chunked prefill into pages
    assert serve.PAGE_SIZE == paged.PAGE_SIZE


def test_paged_attention_writes_and_moves_equal_the_dense_cache():
    """Through a shuffled page table, with a page a row does not hold: attention (global, a
    sliding window, sinks) equals the dense reference, and a tree commit's move equals the dense one."""
    rng = np.random.default_rng(0)
    batch, kv_heads, heads, dim, page, per_row, pool_pages, t = 2, 2, 4, 8, 8, 4, 9, 3
    capacity = page * per_row
    table = rng.permutation(pool_pages)[: batch * per_row].reshape(batch, per_row).astype(np.int32)
    table[1, 3] = pool_pages  # row 1 holds 3 pages
    lengths = jnp.asarray([27, 17], jnp.int32)
    dense = [jnp.asarray(rng.normal(size=(batch, kv_heads, capacity, dim)), jnp.float32) for _ in "kv"]
    slots = jnp.broadcast_to(jnp.arange(capacity), (batch, capacity))
    pools = [jax.jit(paged.write_slots)(jnp.zeros((pool_pages, kv_heads, page, dim)), x, table, slots) for x in dense]
    held = (np.arange(capacity)[None, :] < np.asarray([capacity, 3 * page])[:, None])[:, None, :, None]  # [B, 1, S, 1]
    q = jnp.asarray(rng.normal(size=(batch, t, heads, dim)), jnp.float32)
    k_pass, v_pass = (jnp.asarray(rng.normal(size=(batch, kv_heads, t, dim)), jnp.float32) for _ in "kv")
    positions = lengths[:, None] + jnp.arange(t)
    source = lengths[:, None] + jnp.asarray([[0, 2, 3], [0, 1, 4]])
    dest = lengths[:, None] + jnp.arange(3)

    @jax.jit  # one program (each op run eagerly would compile on its own)
    def both_ways(dense, pools, table):
        out = []
        for window, sinks in [(GLOBAL_WINDOW, None), (5, None), (GLOBAL_WINDOW, jnp.asarray([0.5, -1.0, 2.0, 0.0]))]:
            args = (lengths, positions, window, k_pass, v_pass, chain_mask(t))
            out.append((attend_cache_and_pass(q, *pools, *args, sinks=sinks, page_table=table),
                        attend_cache_and_pass(q, *dense, *args, impl="dense", sinks=sinks)))
        rows = jnp.arange(batch)[:, None]
        moved = (paged.gather_rows(paged.move_slots(pools[0], table, source, dest), table),
                 dense[0].at[rows, :, dest].set(dense[0][rows, :, source]))
        return out, moved, paged.gather_rows(pools[0], table)

    attended, (moved, dense_moved), gathered = both_ways(dense, pools, jnp.asarray(table))
    np.testing.assert_array_equal(gathered, np.where(held, dense[0], 0))
    for got, want in attended:
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(moved, np.where(held, dense_moved, 0))


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
    with pytest.raises(ValueError, match="give kv_pages too"):
        Engine(models.target, slots=2, max_model_len=48, prefix_caching=True)
    with pytest.raises(ValueError, match="does not run on a mesh"):
        Engine(models.target, slots=2, max_model_len=48, kv_pages=4, mesh=make_mesh("data=1"))
    with pytest.raises(ValueError, match="captured hidden states"):  # DFlash starts from them: not cached
        Engine(models.target, DFlashDrafter(TINY_DFLASH, 4), None, slots=2, kv_pages=4, prefix_caching=True)
    engine = Engine(models.target, slots=2, max_model_len=100, kv_pages=1, kv_page_size=PAGE)
    with pytest.raises(ValueError, match="raise kv_pages"):
        engine.submit([1, 2, 3], max_new_tokens=90)
