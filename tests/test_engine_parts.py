"""The engine's host-side parts without a model: the scheduler (queue order, cancellations,
admissions bounded per step), the slot table (occupy / release, neutral values in free rows,
hand-out of new tokens from the read window, counters by name), the one stop-id rule and the
request-value check."""

from __future__ import annotations

import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.decoding.emitted import EmittedWindow, read_window
from spec_jax.decoding.engine import Engine, model_length_and_capacity
from spec_jax.decoding.generate import stop_id_array
from spec_jax.decoding.logprobs import TokenLogprobs
from spec_jax.decoding.loop import FINISH_NONE, FINISH_STOP as STOP
from spec_jax.decoding.scheduler import Scheduler
from spec_jax.decoding.slots import Counters, RequestParams, SlotTable
from spec_jax.decoding.validation import ArgumentError, check_request_values, resolve_stop_ids



def params(n_prompt=3, max_new=8, **kw):
    return RequestParams(prompt_ids=tuple(range(1, n_prompt + 1)), max_new_tokens=max_new, **kw)


def test_scheduler_admits_in_arrival_order_into_free_slots():
    scheduler = Scheduler()
    rids = [scheduler.submit(params(), submitted_at=float(i)) for i in range(4)]
    assert rids == [0, 1, 2, 3] and scheduler.has_work(running=False)
    admitted = scheduler.admissions([2, 5])
    assert [(slot, rid) for slot, rid, _, _ in admitted] == [(2, 0), (5, 1)]
    assert [rid for rid, _, _ in scheduler.waiting] == [2, 3]
    assert scheduler.admissions([]) == []


def test_scheduler_bounds_admissions_per_step():
    scheduler = Scheduler(max_admits_per_step=1)
    for i in range(3):
        scheduler.submit(params(), submitted_at=0.0)
    assert [rid for _, rid, _, _ in scheduler.admissions([0, 1, 2])] == [0]
    scheduler.max_admits_per_step = None
    assert [rid for _, rid, _, _ in scheduler.admissions([1, 2])] == [1, 2]
    assert not scheduler.has_work(running=False) and scheduler.has_work(running=True)


def test_scheduler_cancellations_drop_waiting_requests_once():
    scheduler = Scheduler()
    rids = [scheduler.submit(params(n_prompt=i + 1), submitted_at=0.0) for i in range(4)]
    scheduler.admissions([0])  # rids[0] now runs (the engine frees its slot)
    scheduler.cancel(rids[2])
    scheduler.cancel(rids[0])
    assert scheduler.has_work(running=False)
    cancelled, dropped = scheduler.take_cancelled()
    assert cancelled == {rids[2], rids[0]} and [(rid, len(p.prompt_ids)) for rid, p in dropped] == [(rids[2], 3)]
    assert [rid for rid, _, _ in scheduler.waiting] == [rids[1], rids[3]]
    assert scheduler.take_cancelled() == (set(), [])


@pytest.mark.parametrize("request_id, match", [
    ([1], r"request_id must be an integer, got \[1\] \(list\)"),
    ("1", r"request_id must be an integer, got '1'"),
    (-1, r"request_id must be an integer >= 0"),
    (2, r"request_id 2 was never submitted \(ids so far: 0 \.\. 1\); cancel takes the id one submit\(\) returned"),
])
def test_cancel_of_a_malformed_or_unknown_id_is_a_clear_error(request_id, match):
    """Issue 42: `cancel([1])` raised a raw TypeError (an unhashable id), and an id never given
    was taken silently."""
    scheduler = Scheduler()
    for _ in range(2):
        scheduler.submit(params(), submitted_at=0.0)
    with pytest.raises(ArgumentError, match=match) as e:
        scheduler.cancel(request_id)
    assert e.value.param == "request_id" and scheduler.take_cancelled() == (set(), [])
    scheduler.cancel(1.0)  # an integral number is an id, as everywhere else
    assert scheduler.take_cancelled()[0] == {1}


def test_scheduler_submit_is_thread_safe():
    scheduler = Scheduler()
    threads = [threading.Thread(target=lambda: [scheduler.submit(params(), 0.0) for _ in range(200)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(rid for rid, _, _ in scheduler.waiting) == list(range(800))


def test_slot_table_occupy_and_release():
    table = SlotTable(3)
    request = params(temperature=0.7, top_k=5, top_p=0.9, stop_ids=(7, 9))
    table.occupy(1, rid=4, params=request, stop_row=stop_id_array(request.stop_ids), submitted_at=0.0)
    assert table.free_slots() == [0, 2] and table.slot_of == {4: 1} and table.live.tolist() == [False, True, False]
    assert table.temperature[1] == np.float32(0.7) and table.top_k[1] == 5 and table.max_new[1] == 8
    assert table.stop[1, 0, :3].tolist() == [7, 9, -1] and table.running[1].emitted_to == 3
    running = table.release(1)
    assert running.rid == 4 and table.free_slots() == [0, 1, 2] and table.slot_of == {}
    # A free row's values are neutral: they must not steer batch-wide sampling choices.
    assert (table.temperature[1], table.top_k[1], table.top_p[1], table.live[1]) == (0.0, 0, 1.0, False)


def window(tokens, lengths, width=3, logprobs=None):
    """The host's read of the buffers at these lengths, as the engine makes it (on device)."""
    return EmittedWindow.of(jax.device_get(read_window(jnp.asarray(tokens, jnp.int32),
                                                       jnp.asarray(lengths, jnp.int32), logprobs, width)))


def chunk_read(tokens, lengths, finish, done, steps, drafted, accepted, emitted, full):
    stats = types.SimpleNamespace(steps=np.asarray(steps), drafted=np.asarray(drafted),
                                  accepted=np.asarray(accepted), emitted=np.asarray(emitted),
                                  histogram=np.stack([np.zeros(len(steps), int), np.asarray(full)], 1))
    return (window(tokens, lengths), np.asarray(lengths), np.asarray(finish), np.asarray(done),
            Counters.of_rows(stats, k=1))


def test_slot_table_hands_out_new_tokens_and_counter_deltas():
    """Each read hands out the tokens since the last one (from a window 3 wide: at most 3 new a
    row), and the counters' deltas."""
    table = SlotTable(2)
    for slot, rid in ((0, 10), (1, 11)):
        table.occupy(slot, rid, params(n_prompt=2), stop_id_array(()), submitted_at=0.0)
    tokens = [[1, 2, 30, 31, 32, 0], [1, 2, 40, 0, 0, 0]]
    first = table.hand_out_first(0, window(tokens, [3, 3]), now=1.0)
    assert first.new_ids == [30] and table.running[0].first_token_at == 1.0
    read = chunk_read(tokens, [5, 3], [FINISH_NONE, STOP], [False, True],
                      steps=[2, 1], drafted=[2, 1], accepted=[1, 0], emitted=[3, 1], full=[1, 0])
    events, total = table.collect(*read, now=2.0)
    assert [(e.request_id, e.new_ids, e.finish_reason) for e in events] == [(10, [31, 32], None), (11, [40], "stop")]
    assert total == Counters(steps=3, drafted=3, accepted=1, emitted=4, full_steps=1)
    assert events[1].stats.completion_tokens == 1 and events[1].stats.steps == 1
    assert table.slot_of == {10: 0}  # the finished request freed its slot
    # The next read counts only what changed since this one.
    read = chunk_read([[1, 2, 30, 31, 32, 33]] * 2, [6, 3], [FINISH_NONE] * 2, [True, True],
                      steps=[3, 0], drafted=[3, 0], accepted=[1, 0], emitted=[4, 0], full=[1, 0])
    events, total = table.collect(*read, now=3.0)
    assert [(e.request_id, e.new_ids, e.finish_reason) for e in events] == [(10, [33], "length")]
    assert total == Counters(steps=1, drafted=1, accepted=0, emitted=1, full_steps=0)
    stats = events[0].stats
    assert (stats.steps, stats.emitted, stats.completion_tokens, stats.tau) == (3, 4, 4, 4 / 3)


@pytest.mark.parametrize("with_logprobs", [False, "whole", "ring"])
def test_the_read_window_holds_each_rows_last_positions(with_logprobs):
    """read_window's window of width W ends at each row's length (starts at 0 for a row shorter
    than W, at S - W where the length is past S - W): what numpy's slicing of the whole buffers
    gives, logprobs' buffers alike, whole or kept as a ring of W slots (`TokenLogprobs.as_ring`)."""
    rng = np.random.default_rng(0)
    batch, capacity, width, top = 6, 20, 7, 3
    tokens = rng.integers(0, 1000, (batch, capacity))
    lengths = np.array([1, 6, 7, 12, 16, 20])
    logprobs = None
    if with_logprobs:
        logprobs = TokenLogprobs(chosen=jnp.asarray(rng.normal(size=(batch, capacity)), jnp.float32),
                                 top_ids=jnp.asarray(rng.integers(0, 1000, (batch, capacity, top)), jnp.int32),
                                 top_values=jnp.asarray(rng.normal(size=(batch, capacity, top)), jnp.float32),
                                 wanted=jnp.ones((batch,), bool))
    kept = logprobs.as_ring(width, jnp.asarray(lengths)) if with_logprobs == "ring" else logprobs
    if with_logprobs == "ring":
        assert kept.chosen.shape == (batch, width) and kept.positions == capacity
    read = window(tokens, lengths, width, kept)
    assert read.starts.tolist() == [0, 0, 0, 5, 9, 13] and read.tokens.shape == (batch, width)
    for b, start in enumerate(read.starts):
        assert read.tokens[b].tolist() == tokens[b, start : start + width].tolist()
        assert read.token_ids(b, start + 1, start + 4) == tokens[b, start + 1 : start + 4].tolist()
        if with_logprobs:
            for name in ("chosen", "top_ids", "top_values"):
                full = np.asarray(getattr(logprobs, name))
                assert np.array_equal(getattr(read.logprobs, name)[b], full[b, start : start + width]), name
    assert read.token_ids(4, 16, 16) == []  # a row with nothing new
    with pytest.raises(RuntimeError, match="outside the read window"):
        read.token_ids(4, 8, 16)  # a token the read does not hold is never handed out as another


def test_one_stop_id_rule():
    defaults = (2, 3)
    assert resolve_stop_ids(defaults) == (2, 3)
    assert resolve_stop_ids(defaults, stop_ids=[7, 7]) == (7,)  # given ids replace the defaults
    assert resolve_stop_ids(defaults, ignore_eos=True) == ()
    assert resolve_stop_ids(defaults, stop_ids=[7], ignore_eos=True) == (7,)  # named ids still stop (issue 42)
    assert resolve_stop_ids(defaults, extra_stop_ids=[9]) == (9, 2, 3)  # the API's stop_token_ids add
    assert resolve_stop_ids(defaults, ignore_eos=True, extra_stop_ids=[9]) == (9,)
    with pytest.raises(ArgumentError, match="At most 8 stop ids") as e:
        resolve_stop_ids(defaults, stop_ids=list(range(9)))
    assert e.value.param == "stop_ids"


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_k=True), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(seed=2**32), "seed"),
    (dict(stop_ids=5), "stop_ids"),
])
def test_request_values_errors_carry_the_parameter(kwargs, param):
    with pytest.raises(ArgumentError) as e:
        check_request_values((2,), **kwargs)
    assert e.value.param == param and param in str(e.value)


def test_request_values_take_integral_numbers_the_one_way():
    values = check_request_values((2,), max_new_tokens=4.0, top_k=np.int64(3), temperature=1, seed=0)
    assert (values.max_new_tokens, values.top_k, values.temperature, values.stop_ids) == (4, 3, 1.0, (2,))


def fake_engine(max_model_len=48, default_stop_ids=(2,)):
    """What `Engine.check_request` reads of an engine (no model, nothing compiled)."""
    return types.SimpleNamespace(model=types.SimpleNamespace(vocab_size=101), max_model_len=max_model_len,
                                 default_stop_ids=default_stop_ids, pages=None)


def test_engine_requests_honour_stop_ids_with_ignore_eos():
    """Issue 42: `submit(..., stop_ids=[9], ignore_eos=True)` dropped the explicit stop ids."""
    engine = fake_engine()
    assert Engine.check_request(engine, [1, 2], stop_ids=[9], ignore_eos=True).stop_ids == (9,)
    assert Engine.check_request(engine, [1, 2], ignore_eos=True).stop_ids == ()
    assert Engine.check_request(engine, [1, 2]).stop_ids == (2,)


def test_engine_default_max_new_tokens_fits_max_model_len():
    """Issue 42: the default max_new_tokens (128) was refused by an engine with a shorter
    max_model_len; it is now what the model length leaves, up to 128."""
    assert Engine.check_request(fake_engine(48), [1] * 10).max_new_tokens == 38
    assert Engine.check_request(fake_engine(1024), [1] * 10).max_new_tokens == 128
    with pytest.raises(ArgumentError, match="max_model_len 48") as e:
        Engine.check_request(fake_engine(48), [1] * 10, max_new_tokens=39)
    assert e.value.param == "max_new_tokens"
    with pytest.raises(ArgumentError, match="the prompt's 48 tokens leave no room for a new token") as e:
        Engine.check_request(fake_engine(48), [1] * 48)
    assert e.value.param == "prompts"


def test_model_length_and_capacity():
    assert model_length_and_capacity(None, 3, 512) == (508, 512)
    assert model_length_and_capacity(48, 3, 512) == (48, 128)
    with pytest.raises(ValueError, match="lower max_model_len to 508"):
        model_length_and_capacity(600, 3, 512)
