"""The continuous-batching engine: requests arriving while others are mid-generation give what
each gives alone (greedy), per-request sampling values, caps, stop ids; cancel frees the slot at
once; no compile after warm-up while requests come and go; the adaptive depth switches depth
per step inside the chunk without changing greedy output or recompiling. Every drafter kind, sharded on a mesh, runs in a
fresh process with 8 fake CPU devices (tests/engine_worker.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import make_prompts

from spec_jax.decoding.depth import AdaptiveDepth
from spec_jax.decoding.engine import Engine
from spec_jax.decoding.engine_programs import NO_BATCH_AXIS
from spec_jax.decoding.generate import generate, stop_id_array
from spec_jax.decoding.slots import RequestParams
from spec_jax.drafters.ngram import NGramDrafter

# <= 16 tokens (one prompt bucket); rows 1 and 2 meet EOS mid-way (conftest).
PROMPTS = make_prompts([3, 16, 1, 9, 12, 5], seed=0)
MAX_NEW = [14, 24, 24, 10, 17, 12]
WORKER = Path(__file__).with_name("engine_worker.py")


@pytest.fixture(scope="module")
def alone(models):
    """Each prompt's greedy tokens and finish reason, generated alone (plain decoding)."""
    out = []
    for p, n in zip(PROMPTS, MAX_NEW):
        r = generate(models.target, [p], max_new_tokens=n)
        out.append((r.generated_ids[0], r.finish_reasons[0]))
    return out


@pytest.fixture(scope="module")
def engine(models):
    e = Engine(models.target, NGramDrafter(k=3), slots=3, max_model_len=48, chunk_steps=2)
    e.warmup([16])
    return e


def run_staggered(engine, requests, cancel_after=None):
    """Submit requests[0:2], then one more after every step; cancel `cancel_after` (an index)
    after its first step. -> {index: (ids, finish_reason, stats)}."""
    ids, out, pending = {}, {}, list(enumerate(requests))

    def consume(events):
        for e in events:
            i = next(j for j, rid in ids.items() if rid == e.request_id)
            got = out.setdefault(i, [[], None, None])
            got[0] += e.new_ids
            got[1], got[2] = e.finish_reason, e.stats

    for _ in range(2):
        i, (prompt, kw) = pending.pop(0)
        ids[i] = engine.submit(prompt, **kw)
    while engine.has_work() or pending:
        consume(engine.step())
        if cancel_after is not None and cancel_after in out:
            engine.cancel(ids[cancel_after])
            cancel_after = None
        if pending:
            i, (prompt, kw) = pending.pop(0)
            ids[i] = engine.submit(prompt, **kw)
    return {i: tuple(v) for i, v in out.items()}


def test_staggered_requests_equal_each_alone(engine, alone):
    got = run_staggered(engine, [(p, dict(max_new_tokens=n)) for p, n in zip(PROMPTS, MAX_NEW)])
    for i, (ids, reason) in enumerate(alone):
        assert got[i][0] == ids and got[i][1] == reason, i
        stats = got[i][2]
        assert stats.completion_tokens == len(ids) and stats.prompt_tokens == len(PROMPTS[i])
        assert stats.steps >= 1 and stats.drafted == 3 * stats.steps and stats.tau >= 1.0
    assert {r for _, r in alone} == {"stop", "length"}
    assert engine.num_live == 0 and not engine.slot_table.live.any()


@contextlib.contextmanager
def backend_compiles():
    """The backend compiles (persistent-cache loads included) that happen inside the block."""
    compiles = []

    def listener(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_no_recompile_while_requests_come_and_go(engine, alone):
    """New sampling values, caps, stop ids, seeds, prompt lengths and a cancel: no compile."""
    with backend_compiles() as compiles:
        before = engine.compiles
        requests = [
            (PROMPTS[0], dict(max_new_tokens=14)),
            (PROMPTS[1], dict(max_new_tokens=20, temperature=0.9, top_k=5, seed=3)),
            (PROMPTS[2], dict(max_new_tokens=24, ignore_eos=True)),
            (PROMPTS[3], dict(max_new_tokens=10, temperature=0.5, top_p=0.8, seed=12)),
            (PROMPTS[4], dict(max_new_tokens=17, stop_ids=[alone[4][0][3]])),
            (PROMPTS[5], dict(max_new_tokens=12)),
        ]
        got = run_staggered(engine, requests, cancel_after=3)
    assert compiles == [] and engine.compiles == before
    # Greedy rows beside sampled and cancelled ones still give their alone output.
    assert got[0][:2] == alone[0] and got[5][:2] == alone[5]
    stop_at = alone[4][0].index(alone[4][0][3]) + 1
    assert got[4][0] == alone[4][0][:stop_at] and got[4][1] == "stop"  # its own stop id
    assert len(got[2][0]) == 24 and got[2][0][: len(alone[2][0])] == alone[2][0]  # EOS ignored
    assert got[3][1] == "cancelled" and len(got[3][0]) < 10
    assert got[1][1] in ("stop", "length") and all(0 <= t < 101 for t in got[1][0])


def test_default_warmup_covers_the_longest_prompt(models):
    """warmup() with no lengths compiles up to the bucket of a max_model_len - 1 token prompt (64
    here; it once stopped at 32), so that prompt compiles nothing when it arrives."""
    engine = Engine(models.target, NGramDrafter(k=3), slots=3, max_model_len=48, chunk_steps=2)
    report = engine.warmup(workers=2)  # the chunk and bucket 16 may be the module engine's (shared)
    assert report.programs == engine.compiles and report.seconds > 0
    assert sorted(engine.programs.exes) == [("admit", 16), ("admit", 32), ("admit", 64), ("chunk", 3),
                                            ("window", 8, False)]  # the host's read: 2 steps of 3 + 1
    with backend_compiles() as compiles:
        (prompt,) = make_prompts([engine.max_model_len - 1], seed=1)
        engine.submit(prompt, max_new_tokens=1)
        (done,) = engine.run_all().values()
    assert len(done.new_ids) == 1 and compiles == [] and engine.compiles == report.programs


def test_every_draft_accepted_fills_the_read_window_and_keeps_the_output(models, drafters, alone):
    """The target as its own drafter accepts all K drafts at every step, so a chunk commits
    chunk_steps * (K + 1) tokens a row: the full width of the window the host reads
    (`decoding.emitted`). Every token is handed out, as plain decoding's, logprobs' read alike."""
    make, params = drafters["self"]
    engine = Engine(models.target, make(3), params, slots=2, max_model_len=48, chunk_steps=2, max_logprobs=2)
    requests = [(p, dict(max_new_tokens=n, logprobs=1)) for p, n in zip(PROMPTS, MAX_NEW)]
    got = run_staggered(engine, requests)
    assert [got[i][:2] for i in range(len(PROMPTS))] == alone
    assert engine.window_width == 8 and engine.positions.accepted == engine.positions.drafted
    assert sum(got[i][2].emitted for i in got) > 4 * sum(got[i][2].steps for i in got) * 0.9  # ~K + 1 a step


def test_admit_hands_out_first_tokens_before_any_chunk(engine, alone):
    """step() is admit() then decode(): admit() alone prefills the waiting requests and returns
    each one's first token (its prefill's), running no chunk, so a server can send it before the
    chunk; the rest follows as if one step() had run. decode() on an idle engine does nothing."""
    assert engine.decode() == []
    chunks = engine.chunks_run
    rids = [engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW[i]) for i in (0, 1)]
    first = engine.admit()
    assert [(e.request_id, len(e.new_ids)) for e in first] == [(rids[0], 1), (rids[1], 1)]
    assert engine.chunks_run == chunks and engine.admit() == []
    rest = engine.run_all()
    assert [first[i].new_ids + rest[rid].new_ids for i, rid in enumerate(rids)] == [alone[0][0], alone[1][0]]


def test_cancel_frees_the_slot_at_once(engine, alone):
    """Three slots busy and a fourth request waiting: cancelling one hands its slot over before
    the next chunk."""
    rids = [engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW[i]) for i in (1, 2, 4, 0)]
    first = engine.step()
    assert {e.request_id for e in first} == set(rids[:3]) and rids[3] not in engine.slot_table.slot_of
    engine.cancel(rids[0])
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events if e.finish_reason == "cancelled"] == [(rids[0], "cancelled")]
    assert engine.slot_table.slot_of[rids[3]] == 0  # the cancelled request's slot
    done = engine.run_all()
    waited = sum((e.new_ids for e in events if e.request_id == rids[3]), []) + done[rids[3]].new_ids
    assert waited == alone[0][0]


def test_max_admits_per_step_bounds_prefills_between_chunks(engine, alone):
    engine.scheduler.max_admits_per_step = 1
    try:
        # 30 tokens each, EOS ignored: nobody finishes within two chunks (<= 1 + 2 x 4 tokens).
        rids = [engine.submit(PROMPTS[i], max_new_tokens=30, ignore_eos=True) for i in (0, 3, 5)]
        events = engine.step()
        assert list(engine.slot_table.slot_of) == rids[:1]
        events += engine.step()
        assert list(engine.slot_table.slot_of) == rids[:2]
        events += list(engine.run_all().values())
    finally:
        engine.scheduler.max_admits_per_step = None
    assert [sum(len(e.new_ids) for e in events if e.request_id == r) for r in rids] == [30, 30, 30]


def test_the_engine_counts_its_decode_steps_and_their_seconds(engine):
    """`decode_steps` and `chunk_seconds` (the decode step as served, beside `generate`'s): a
    request alone runs as many verify steps as the chunks count, and admits add none; two requests
    together share the steps they run side by side."""
    steps, seconds = engine.decode_steps, engine.chunk_seconds
    rid = engine.submit(PROMPTS[1], max_new_tokens=20, ignore_eos=True)
    alone = engine.run_all()[rid].stats
    assert engine.decode_steps - steps == alone.steps > 0 and engine.chunk_seconds > seconds
    steps = engine.decode_steps
    rids = [engine.submit(PROMPTS[i], max_new_tokens=20, ignore_eos=True) for i in (1, 4)]
    together = engine.run_all()
    assert engine.decode_steps - steps == max(together[r].stats.steps for r in rids)


def test_request_errors_name_the_field(engine):
    with pytest.raises(ValueError, match="max_new_tokens.*max_model_len 48"):
        engine.check_request(PROMPTS[1], max_new_tokens=40)
    with pytest.raises(ValueError, match="temperature"):
        engine.check_request(PROMPTS[0], temperature=-1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        engine.check_request(PROMPTS[0], top_p=1.5, max_new_tokens=4)
    with pytest.raises(ValueError, match="vocab"):
        engine.check_request([5, 500], max_new_tokens=4)
    with pytest.raises(ValueError, match="stop ids"):
        engine.check_request(PROMPTS[0], stop_ids=list(range(20)), max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine((engine.model.cfg, engine.programs.target_params), k="adaptive")


def test_adaptive_depth_per_step_keeps_greedy_output(models, alone):
    """The engine's chunk runs `generate`'s per-step depth policy: with costs that make depth 3
    pay only while drafts are accepted (the prior's 0.6) and a plain step otherwise, the depth
    switches inside chunks as acceptance changes; output equals plain decoding's, no compile after
    warm-up."""
    engine = Engine(models.target, NGramDrafter(k=3), slots=3, max_model_len=48, chunk_steps=2,
                    k=AdaptiveDepth(depths=(0, 3), costs=(1.0, 1.8)))
    engine.warmup([16])
    assert sorted(engine.programs.exes) == [("admit", 16), ("chunk", 3), ("window", 8, False)]
    with backend_compiles() as compiles:
        before = engine.compiles
        got = run_staggered(engine, [(p, dict(max_new_tokens=n)) for p, n in zip(PROMPTS, MAX_NEW)])
    assert [got[i][:2] for i in range(len(PROMPTS))] == alone
    assert engine.depth_counts[0] > 0 and engine.depth_counts[3] > 0, engine.depth_counts
    assert compiles == [] and engine.compiles == before


def test_chunk_values_are_placed_again_only_when_the_slots_change(engine):
    """The rows' request values go to the device once per change of the slot table (an admit, a
    finish, a cancel) or of the step cap, not at every chunk."""
    programs, table = engine.programs, engine.slot_table
    assert not table.running
    first = programs.chunk_args(engine.state, table, 2)
    again = programs.chunk_args(engine.state, table, 2)
    assert all(a is b for a, b in zip(first[1:], again[1:]))
    table.occupy(1, 99, RequestParams(prompt_ids=(1, 2), max_new_tokens=5, temperature=0.5),
                stop_id_array(()), 0.0)
    occupied = programs.chunk_args(engine.state, table, 2)
    live, sampling, max_new = occupied[1], occupied[5], occupied[6]
    assert live is not first[1] and np.asarray(live).tolist() == [False, True, False]
    assert float(sampling.temperature[1]) == 0.5 and int(max_new[1]) == 5
    table.release(1)
    released = programs.chunk_args(engine.state, table, 2)
    assert not np.asarray(released[1]).any() and float(released[5].temperature[1]) == 0.0
    assert int(programs.chunk_args(engine.state, table, 3)[8]) == 3  # another step cap


WARM_CASES = {  # name -> (Engine keywords, prompt lengths to warm up)
    "adaptive depth": (dict(k=AdaptiveDepth(depths=(0, 3), costs=(1.0, 1.8))), [16]),
    "pages, prefix caching": (dict(kv_pages=16, kv_page_size=8, prefix_caching=True, slots=8), [16, 32]),
    "pages, chunked prefill": (dict(kv_pages=16, kv_page_size=8, prefill_chunk_tokens=16, slots=8), [16, 64]),
}


def state_changes(engine, fresh):
    """The state's leaves where `engine` differs from `fresh` (same configuration, never run),
    slot 0's row of the per-row leaves left out, and the rows' own keys/values: a free row has
    none committed (its cache length, compared, is 0), and a chunk may write past it."""
    changed = []
    for (path, axis), got, want in zip(jax.tree_util.tree_flatten_with_path(engine.programs.batch_axes)[0],
                                       jax.tree_util.tree_leaves(engine.state), jax.tree_util.tree_leaves(fresh.state)):
        if axis != NO_BATCH_AXIS and jax.tree_util.keystr(path).startswith((".cache.k", ".cache.v")):
            continue
        got, want = (np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
                     for x in (got, want))
        if axis != NO_BATCH_AXIS:
            got, want = np.delete(got, 0, axis), np.delete(want, 0, axis)
        if not np.array_equal(got, want):
            changed.append(jax.tree_util.keystr(path))
    return changed


@pytest.mark.parametrize("case", WARM_CASES)
def test_warmup_runs_each_program_once_and_leaves_the_state_as_it_was(models, alone, case):
    """warmup() runs every program it compiled once (so no request pays a program's first run),
    on slot 0 of the idle engine: afterwards every leaf equals a never-run engine's but slot 0's
    row (the shared counters restored; with pages, the pool untouched: slot 0 held no page).
    Then greedy requests give their alone output, and a seeded sampled one the tokens an engine
    warmed without the runs gives."""
    kwargs, lengths = WARM_CASES[case]
    kwargs = dict(dict(slots=3, max_model_len=48, chunk_steps=2), **kwargs)
    engine, fresh = (Engine(models.target, NGramDrafter(k=3), **kwargs) for _ in range(2))
    report = engine.warmup(lengths)
    assert report.programs_run == len(engine.programs.exes) >= 2 and report.run_seconds > 0
    assert "ran" in report.summary()
    assert state_changes(engine, fresh) == []
    assert int(engine.state.step) == 0 and engine.decode_steps == 0 and engine.chunks_run == 0
    sampled = dict(max_new_tokens=12, temperature=0.9, seed=7)
    assert fresh.warmup(lengths, run=False).programs_run == 0
    rid = fresh.submit(PROMPTS[1], **sampled)
    want_sampled = fresh.run_all()[rid].new_ids
    with backend_compiles() as compiles:
        got = run_staggered(engine, [(p, dict(max_new_tokens=n)) for p, n in zip(PROMPTS, MAX_NEW)])
        rid = engine.submit(PROMPTS[1], **sampled)
        assert engine.run_all()[rid].new_ids == want_sampled
    assert [got[i][:2] for i in range(len(PROMPTS))] == alone
    assert compiles == []


def test_warmup_on_a_busy_engine_runs_nothing(engine, alone):
    """A request running: warm-up compiles what is missing and runs no program (that would write
    into the state under it); the request's output is unchanged."""
    rid = engine.submit(PROMPTS[0], max_new_tokens=MAX_NEW[0])
    first = engine.step()
    report = engine.warmup([16])
    assert report.programs_run == 0 and report.run_seconds == 0 and "ran" not in report.summary()
    done = engine.run_all()
    assert sum((e.new_ids for e in first), []) + done[rid].new_ids == alone[0][0]


def test_every_drafter_kind_on_a_mesh():
    """Staggered == alone for ngram, the draft model and DFlash (each behind prompt lookup),
    EAGLE-3 and Medusa, with the state's rows split over data=4 and heads over model=2; no compile
    after warm-up."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=env,
                          timeout=900, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"ngram", "draft_model_lookup", "dflash_lookup", "eagle3", "medusa"}
    for kind, r in report.items():
        assert r["equal"] == [True] * len(r["equal"]), (kind, r)
        assert r["compiles_after_warmup"] == 0, (kind, r)
        assert r["tau"] >= 1.0


def serve_engine_kwargs(monkeypatch, argv: list[str], drafter: list[str] | None = None) -> dict:
    """The keywords `spec-jax serve ARGV` builds its Engine with; nothing loads or compiles (the
    target, the drafter (n-gram) and the engine are stood in for)."""
    import argparse
    from types import SimpleNamespace

    from spec_jax.app import inputs, serve
    from spec_jax.decoding import engine as engine_module

    built = []

    class Built(Exception):
        pass

    def fake_engine(*args, **kwargs):
        built.append(kwargs)
        raise Built

    monkeypatch.setattr(inputs, "load_target_or_fail", lambda *a, **k: SimpleNamespace(tokenizer=object(), source="tiny"))
    monkeypatch.setattr(inputs, "build_drafter", lambda spec, target: (NGramDrafter(k=spec.k or 4), None))
    monkeypatch.setattr(engine_module, "Engine", fake_engine)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(Built):
        serve.build_state(parser.parse_args([*(["--drafter", "ngram"] if drafter is None else drafter), "--no-warmup",
                                             *argv]))
    return built[-1]


def test_serve_k_adaptive_builds_an_adaptive_engine(monkeypatch):
    """`spec-jax serve --k adaptive` (and --k-choices, its depths) reach the engine as its policy."""
    for argv, depths in ((["--k", "adaptive"], None), (["--k-choices", "0,2,4"], (0, 2, 4)), (["--k", "3"], "fixed")):
        k = serve_engine_kwargs(monkeypatch, argv)["k"]
        assert k is None if depths == "fixed" else isinstance(k, AdaptiveDepth) and k.depths == depths, (argv, k)
    # The default model's default drafter picks its depth per step unless --k pins K; on a mesh
    # (where the engine has no adaptive depth yet) it keeps the drafter's K.
    monkeypatch.setattr("spec_jax.app.inputs.mesh_kwargs", lambda *a: {})
    for argv, adaptive in (([], True), (["--k", "3"], False), (["--mesh", "data=1,model=1"], False)):
        k = serve_engine_kwargs(monkeypatch, argv, drafter=[])["k"]
        assert isinstance(k, AdaptiveDepth) if adaptive else k is None, (argv, k)


def test_adaptive_engine_measures_costs_at_its_batch_and_capacity(models, monkeypatch):
    """Without costs, the engine asks `depth_costs` once for its own batch (slots) and capacity
    (the timing itself is depth_costs' and stood in for here: nothing compiles)."""
    import importlib

    from spec_jax.decoding import depth_costs

    generate_module = importlib.import_module("spec_jax.decoding.generate")  # the package names the function
    calls = []
    monkeypatch.setattr(generate_module, "compiled_loop", lambda *a, **k: ("compiled", 0.0))
    monkeypatch.setattr(depth_costs, "costs_for", lambda compiled, call: calls.append(call) or (1.0, 1.5, 2.0))
    engine = Engine(models.target, NGramDrafter(k=3), slots=3, max_model_len=48, k="adaptive")
    (call,) = calls
    assert call.inputs.prompt_tokens.shape[0] == 3 and call.capacity == engine.capacity
    assert call.depth.depths == engine.depth.depths == (0, 2, 3) and engine.depth.costs == (1.0, 1.5, 2.0)
    assert engine.state.depth.costs.tolist() == [1.0, 1.5, 2.0]
