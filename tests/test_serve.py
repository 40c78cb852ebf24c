"""`spec-jax serve` over real HTTP on 127.0.0.1 (ephemeral ports, bounded requests and time):
completions and chat, streaming (SSE ending with [DONE]) equal to non-streamed, concurrent
streams, a client that disconnects mid-stream frees its slot, bad requests get a 4xx naming the
field while the server stays healthy, the official `openai` client, SIGTERM on the command,
stop strings cut exactly, an engine failure (503s at once, exit status 1) and the end of requests
past --drain-timeout (issue 42); n choices, logprobs and seeds, a full queue's 429s and
/metrics read by prometheus_client's parser (issue 45)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cheap_xla import CHEAP_XLA_FLAGS
from serving_testlib import save_tiny_target

from spec_jax.app.openai_api import ServerState, create_app
from spec_jax.checkpoints import load_target
from spec_jax.decoding.engine import Engine
from spec_jax.decoding.generate import generate
from spec_jax.drafters.ngram import NGramDrafter

MAX_MODEL_LEN = 96
TOP = 3  # the engine's max_logprobs
TIMEOUT = 60


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("serve") / "tiny")


def tiny_engine(target):
    """The module's engine configuration (engines of one configuration share compiled programs)."""
    return Engine(target, NGramDrafter(k=3), slots=3, max_model_len=MAX_MODEL_LEN, chunk_steps=2, max_logprobs=TOP)


@contextlib.contextmanager
def serving(state):
    """The app over `state` on an in-process uvicorn (a thread), on a free port -> the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + TIMEOUT
    while not uv.started and time.time() < deadline:
        time.sleep(0.05)
    assert uv.started
    try:
        yield sock.getsockname()[1]
    finally:
        uv.should_exit = True
        thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def server(tiny_dir):
    target = load_target(str(tiny_dir), dtype="float32")
    engine = tiny_engine(target)
    engine.warmup([16, 32])
    state = ServerState(engine, target.tokenizer, target.chat_template, "tiny", "ngram")
    with serving(state) as port:
        yield {"port": port, "target": target, "engine": engine, "state": state}


def start_serve(tiny_dir, *args, fault=None):
    """`spec-jax serve` of the tiny model in its own process (with `fault` put into its engine's
    step by tests/serve_fault_worker.py) -> (process, port, the log lines read so far)."""
    here = Path(__file__).parent
    env = dict(os.environ, XLA_FLAGS=CHEAP_XLA_FLAGS, PYTHONPATH=str(here.parent))  # the worker runs by path
    command = [sys.executable] + ([str(here / "serve_fault_worker.py"), fault] if fault else ["-m", "spec_jax.app.main"])
    proc = subprocess.Popen(
        command + ["serve", "--target", str(tiny_dir), "--port", "0", "--slots", "2", "--max-model-len", "256",
                   "--chunk-steps", "1", "--drafter", "ngram", "--dtype", "float32", *args],
        stderr=subprocess.PIPE, text=True, env=env, cwd=here.parent,
    )
    port, lines = None, []
    deadline = time.time() + 240
    while port is None and time.time() < deadline:
        line = proc.stderr.readline()
        assert line, "".join(lines)
        lines.append(line)
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        port = int(match.group(1)) if match else None
    assert port, "".join(lines)
    return proc, port, lines


def stop_process(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stderr.close()


def request(port, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, json.loads(payload)


def stream(port, path, body, stop_after=None, on_event=None):
    """SSE events of a streaming request, as parsed JSON ([DONE] as the string); with stop_after=n
    the connection is closed after n events; on_event(event) is called as each arrives."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = []
    for line in resp:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
        if on_event is not None:
            on_event(events[-1])
        if data == "[DONE]" or (stop_after is not None and len(events) >= stop_after):
            break
    conn.close()
    return events


def completion_text(events, chat):
    if chat:
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    return "".join(e["choices"][0]["text"] for e in events[:-1])


def test_health_and_models(server):
    status, body = request(server["port"], "GET", "/health")
    assert status == 200 and body == {"status": "ok", "slots": 3, "running": 0, "waiting": 0, "max_queued": None,
                                      "model": "tiny", "drafter": "ngram"}
    status, body = request(server["port"], "GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion_is_generate_and_streams_the_same(server):
    tok = server["target"].tokenizer
    body = {"model": "tiny", "prompt": "def is_prime(n):", "max_tokens": 24, "temperature": 0}
    status, out = request(server["port"], "POST", "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    ids = tok.encode("def is_prime(n):")
    ref = generate(server["target"], [ids], max_new_tokens=24)
    assert choice["token_ids"] == ref.generated_ids[0] and choice["finish_reason"] == ref.finish_reasons[0]
    assert choice["text"] == tok.decode(ref.generated_ids[0], skip_special_tokens=True)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ref.generated_ids[0]),
                            "total_tokens": len(ids) + len(ref.generated_ids[0])}
    spec = out["speculative"]
    assert spec["drafted"] == 3 * spec["steps"] and spec["accepted"] <= spec["drafted"] and spec["tau"] >= 1
    events = stream(server["port"], "/v1/completions", body)
    assert events[-1] == "[DONE]" and completion_text(events[:-1], chat=False) == choice["text"]
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == choice["finish_reason"] and last["usage"] == out["usage"]


def test_concurrent_streams_equal_their_non_streamed_answers(server):
    """Six chat streams at once on three slots (so some wait, then take freed slots)."""
    bodies = [{"messages": [{"role": "user", "content": f"Question {i}: café {'x' * i}"}],
               "max_tokens": 12 + 3 * i, "temperature": 0} for i in range(6)]
    expected = []
    for b in bodies:
        status, out = request(server["port"], "POST", "/v1/chat/completions", b)
        assert status == 200, out
        expected.append(out["choices"][0]["message"]["content"])
    results = [None] * len(bodies)

    def run(i):
        results[i] = stream(server["port"], "/v1/chat/completions", bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for events, text in zip(results, expected):
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1] == "[DONE]" and completion_text(events[1:-1], chat=True) == text
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def drop_a_stream_mid_way(port, engine):
    """A client that closes its stream after 2 events -> those events, once the server has
    cancelled its request and the engine freed it. Once the request is half done, the engine is
    held before each chunk until the server cancels it, so the request cannot run to its end
    first however fast the machine is (without the cancel, the test fails on the wait, not on a
    race)."""
    cancelled_ids, cancelled, freed = [], threading.Event(), threading.Event()
    engine_cancel, engine_admit, engine_decode = engine.cancel, engine.admit, engine.decode
    max_tokens = engine.max_model_len - 8

    def cancel(rid):  # the runner only cancels unfinished requests
        cancelled_ids.append(rid)
        engine_cancel(rid)
        cancelled.set()

    def admit():  # a step's first half frees cancelled requests' slots
        events = engine_admit()
        if any(e.finish_reason == "cancelled" for e in events):
            freed.set()
        return events

    def decode():
        if any(r.stats.completion_tokens >= max_tokens // 2 for r in engine.slot_table.running.values()):
            cancelled.wait(TIMEOUT)  # a chunk adds at most 8 tokens: the request stays unfinished
        return engine_decode()

    engine.cancel, engine.admit, engine.decode = cancel, admit, decode
    body = {"prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    try:
        events = stream(port, "/v1/completions", body, stop_after=2)
        assert cancelled.wait(TIMEOUT), "the server did not cancel the request of a client that went away"
        assert freed.wait(TIMEOUT), "the cancelled request's slot was not freed"
    finally:
        engine.cancel, engine.admit, engine.decode = engine_cancel, engine_admit, engine_decode
    assert len(cancelled_ids) == 1
    assert len(events) == 2 and events[-1] != "[DONE]"
    return events


def test_disconnect_mid_stream_frees_the_slot(server):
    """A client that closes its stream has its request cancelled and its slot freed."""
    engine = server["engine"]
    drop_a_stream_mid_way(server["port"], engine)
    assert engine.num_live == 0 and not engine.slot_table.live.any()
    assert request(server["port"], "GET", "/health")[1]["running"] == 0
    assert request(server["port"], "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4})[0] == 200


def test_disconnect_mid_stream_frees_the_pages(server):
    """Issue 45: with `--kv-pages`, a client that closes its stream gives its request's KV pages
    back: the pool is empty after the run (the engine's count and /metrics), and the server
    still answers. Plain decoding (the cheapest programs to compile), a pool of 8 pages of 32 (2
    rows' worth)."""
    target = server["target"]
    engine = Engine(target, slots=3, max_model_len=MAX_MODEL_LEN, chunk_steps=2, kv_pages=8, kv_page_size=32)
    engine.warmup([16])
    state = ServerState(engine, target.tokenizer, target.chat_template, "tiny", "none")
    with serving(state) as port:
        held = []
        engine_decode = engine.decode
        engine.decode = lambda: held.append(engine.pages.used) or engine_decode()
        try:
            drop_a_stream_mid_way(port, engine)
        finally:
            engine.decode = engine_decode
        assert max(held) >= 1  # the dropped request held pages while it ran
        assert engine.pages.used == 0 and engine.pages.owed() == 0 and engine.pages.free == 8
        metrics = scrape(port)
        assert (metrics[("spec_jax_kv_pages_used", ())], metrics[("spec_jax_kv_pages_free", ())]) == (0, 8)
        assert request(port, "GET", "/health")[0] == 200
        assert request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4})[0] == 200
        assert engine.pages.used == 0 and engine.num_live == 0


def fewest_tokens_holding(tok, ids, text):
    """The token_ids a stopped answer keeps: the fewest leading tokens whose text begins with it."""
    return next(ids[:n] for n in range(len(ids) + 1) if tok.decode(ids[:n], skip_special_tokens=True).startswith(text))


def stops_in(tok, ids, text):
    """Three stop lists for a greedy answer: a stop across a token boundary (with a later one and
    one that never occurs), and one that begins exactly where a token does."""
    ends = [len(tok.decode(ids[:n], skip_special_tokens=True)) for n in range(1, len(ids))]
    boundaries = [p for p in ends if len(text) // 3 <= p < len(text) - 2]
    spanning = next(text[p - 1 : p + 2] for p in boundaries
                    if text.find(text[p - 1 : p + 2]) == p - 1 and "\ufffd" not in text[p - 1 : p + 2])
    at_token = next(text[p : p + 2] for p in boundaries if text.find(text[p : p + 2]) == p and "\ufffd" not in text[p : p + 2])
    return [[spanning, text[-2:], "never§"], [at_token], [text[-2:]]]


def test_stop_strings_cut_exactly_where_the_answer_first_holds_them(server):
    """Issue 42: a greedy answer with stop strings is the answer without them cut before the
    first stop's first occurrence, streamed and not, with token_ids and usage matching, and the
    slot is free when the answer ends. Text generated after the stop was appended before."""
    tok, port = server["target"].tokenizer, server["port"]
    body = {"prompt": "The quick brown fox", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    status, full = request(port, "POST", "/v1/completions", body)
    assert status == 200, full
    ids, text = full["choices"][0]["token_ids"], full["choices"][0]["text"]
    for stops in stops_in(tok, ids, text):
        cut = text[: min(text.find(s) for s in stops if s in text)]
        kept = fewest_tokens_holding(tok, ids, cut)
        status, out = request(port, "POST", "/v1/completions", dict(body, stop=stops))
        assert status == 200, out
        choice = out["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (cut, "stop"), stops
        assert choice["token_ids"] == kept and out["usage"]["completion_tokens"] == len(kept)
        assert request(port, "GET", "/health")[1]["running"] == 0
        events = stream(port, "/v1/completions", dict(body, stop=stops))
        assert completion_text(events[:-1], chat=False) == cut and events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["usage"] == out["usage"]
    assert request(port, "GET", "/health")[1]["running"] == 0


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": TOP + 1}, 400, "logprobs"),  # past --max-logprobs
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", [1, 2], 400, None),
    ],
)
def test_bad_requests_get_4xx_naming_the_field(server, path, body, status, param):
    raw = body if isinstance(body, str) else None
    got, out = request(server["port"], "POST", path, None if raw else body, raw=raw)
    assert got == status, out
    assert out["error"]["param"] == param and out["error"]["message"]
    if param:
        assert param in out["error"]["message"]
    status, health = request(server["port"], "GET", "/health")  # the refusal left the server serving
    assert status == 200 and health["status"] == "ok" and health["running"] == health["waiting"] == 0


def test_openai_client_streaming_and_not(server):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused", timeout=TIMEOUT,
                           max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "Write a haiku about the sea 🌊"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length") and full.usage.completion_tokens >= 1
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == full.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="for i in", max_tokens=8, temperature=0.7, seed=1)
    assert text.usage.prompt_tokens >= 1 and text.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-2)


def test_serve_command_drains_on_sigterm(tiny_dir):
    """`spec-jax serve` in its own process: SIGTERM is sent once a long stream has begun (240
    sampled tokens, one verify step per chunk); the server's log says the request was running
    when the signal came, the stream still finishes (all its tokens, finish reason, [DONE]), and
    the process exits 0."""
    proc, port, lines = start_serve(tiny_dir, "--drain-timeout", "30")
    try:
        started, events = threading.Event(), []
        body = {"prompt": "The quick", "max_tokens": 240, "ignore_eos": True, "temperature": 1.0, "seed": 1}
        thread = threading.Thread(target=lambda: events.extend(
            stream(port, "/v1/completions", body, on_event=lambda _: started.set())))
        thread.start()
        assert started.wait(TIMEOUT), "the stream never began"
        proc.send_signal(signal.SIGTERM)
        thread.join(TIMEOUT)
        assert proc.wait(TIMEOUT) == 0
        log = "".join(lines) + proc.stderr.read()
        assert re.search(r"SIGTERM: not accepting new requests; draining 1 running", log), log
        assert events and events[-1] == "[DONE]", events[-3:]
        last = events[-2]
        assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 240
    finally:
        stop_process(proc)


def test_a_failed_engine_step_fails_the_server_whole(server):
    """Issue 42: a step that raises (a simulated device error) failed the requests in flight but
    left a zombie: /health said 503 while new requests were taken and hung. Now the requests in
    flight fail (a 500, a stream's error event and [DONE]), /health and every new request answer
    503 at once, and the exit hook `spec-jax serve` ends the process with is called. A fresh
    engine of the module's configuration: its step raises before running anything."""
    target = server["target"]
    engine, failed = tiny_engine(target), threading.Event()

    def failing_step():  # once both requests wait, so that both are in flight when it fails
        deadline = time.time() + TIMEOUT
        while len(engine.scheduler.waiting) < 2 and time.time() < deadline:
            time.sleep(0.01)
        raise RuntimeError("simulated device error")

    engine.admit = failing_step  # the step's first half
    state = ServerState(engine, target.tokenizer, target.chat_template, "tiny", "ngram")
    state.runner.on_failure = failed.set
    body = {"prompt": "The quick", "max_tokens": 8}
    with serving(state) as port:
        streamed = []
        thread = threading.Thread(target=lambda: streamed.extend(stream(port, "/v1/completions", body)))
        thread.start()
        status, out = request(port, "POST", "/v1/completions", body)
        thread.join(TIMEOUT)
        assert status == 500 and "simulated device error" in out["error"]["message"], out
        assert streamed[-1] == "[DONE]" and "simulated device error" in streamed[0]["error"]["message"]
        assert failed.wait(TIMEOUT), "the exit hook was not called"
        status, health = request(port, "GET", "/health")
        assert status == 503 and health["status"] == "error"
        for path, new in [("/v1/completions", body), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                             "content": "hi"}]})]:
            status, out = request(port, "POST", path, new)
            assert status == 503 and out["error"]["code"] == "engine_failed", out
            assert "simulated device error" in out["error"]["message"]


def test_serve_command_exits_nonzero_when_the_engine_fails(tiny_dir):
    """The command after an engine failure: the request in flight gets a 500, and the process
    exits with status 1 (so that a supervisor restarts it), saying why."""
    proc, port, lines = start_serve(tiny_dir, "--no-warmup", fault="fail")
    try:
        status, out = request(port, "POST", "/v1/completions", {"prompt": "The quick", "max_tokens": 8})
        assert status == 500 and "simulated device error" in out["error"]["message"], out
        assert proc.wait(TIMEOUT) == 1
        log = "".join(lines) + proc.stderr.read()
        assert "engine step failed: RuntimeError: simulated device error" in log, log
        assert re.search(r"exiting with status 1 after an engine failure .* so that a supervisor restarts", log), log
    finally:
        stop_process(proc)


def test_serve_command_ends_requests_past_the_drain_timeout(tiny_dir):
    """Issue 42: past --drain-timeout, streams were cut with no final chunk and no [DONE],
    non-streamed requests got a plain-text 500, and the log held a traceback per request. A
    stream and a non-streamed request run (each step slowed to 0.1 s: 240 tokens take longer
    than the 1 s drain) when SIGTERM comes: the stream ends with a final chunk (finish reason
    "cancelled", its usage) and [DONE], the other request gets a 503 in OpenAI's error shape,
    the log has no traceback and the process exits 0."""
    proc, port, lines = start_serve(tiny_dir, "--no-warmup", "--drain-timeout", "1", fault="slow")
    try:
        body = {"prompt": "The quick", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
        started, streamed, answered = threading.Event(), [], []
        threads = [threading.Thread(target=lambda: streamed.extend(
                       stream(port, "/v1/completions", body, on_event=lambda _: started.set()))),
                   threading.Thread(target=lambda: answered.append(request(port, "POST", "/v1/completions", body)))]
        for t in threads:
            t.start()
        assert started.wait(TIMEOUT), "the stream never began"
        deadline = time.time() + TIMEOUT
        while request(port, "GET", "/health")[1]["running"] < 2 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(TIMEOUT)
        assert proc.wait(TIMEOUT) == 0
        log = "".join(lines) + proc.stderr.read()
        assert "Traceback" not in log and "drain timeout (1s) passed: ended 2 running request(s)" in log, log
        assert streamed[-1] == "[DONE]", streamed[-3:]
        last = streamed[-2]["choices"][0]
        assert last["finish_reason"] == "cancelled" and 0 < streamed[-2]["usage"]["completion_tokens"] < 240
        ((status, out),) = answered
        assert status == 503 and out["error"]["code"] == "server_shutting_down" and out["error"]["type"] == "server_error"
    finally:
        stop_process(proc)


def test_choices_logprobs_and_seeds(server):
    """n choices (each its own key), logprobs in OpenAI's shapes, and a seed that gives the same
    answer again; streamed n choices carry their index and equal the non-streamed ones."""
    body = {"prompt": "The quick", "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3, "logprobs": 2,
            "ignore_eos": True}
    status, out = request(server["port"], "POST", "/v1/completions", body)
    assert status == 200, out
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and len({tuple(c["token_ids"]) for c in choices}) > 1
    assert out["usage"]["completion_tokens"] == 24
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
        assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-6
                   for top, chosen in zip(lp["top_logprobs"], lp["token_logprobs"]))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert request(server["port"], "POST", "/v1/completions", body)[1]["choices"] == choices  # the seed
    events = stream(server["port"], "/v1/completions", dict(body, logprobs=None))
    texts = ["", "", ""]
    for e in events[:-1]:
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert events[-1] == "[DONE]" and texts == [c["text"] for c in choices]
    # Chat, greedy: each token is the most likely one, so its logprob tops its top_logprobs.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": TOP}
    status, out = request(server["port"], "POST", "/v1/chat/completions", chat)
    content = out["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == len(out["choices"][0]["token_ids"])
    for item in content:
        top = item["top_logprobs"]
        assert len(top) == TOP and top[0]["token"] == item["token"] and abs(top[0]["logprob"] - item["logprob"]) < 1e-6
        assert item["bytes"] == list(item["token"].encode()) and item["logprob"] <= 0
    streamed = [e for e in stream(server["port"], "/v1/chat/completions", chat)[1:-1] if e["choices"][0]["logprobs"]]
    assert [i for e in streamed for i in e["choices"][0]["logprobs"]["content"]] == content


def scrape(port):
    """GET /metrics parsed by prometheus_client's own parser -> {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_requests_first_token_goes_out_before_the_chunk_after_its_prefill(server):
    """The engine thread hands out an admitted request's first token (its prefill's) before it
    runs the next chunk (`Engine.admit`, then `Engine.decode`): with every chunk held, the first
    token is already counted in /metrics' time to first token. Released, the request completes."""
    engine, port = server["engine"], server["port"]
    key = ("spec_jax_time_to_first_token_seconds_count", ())
    before, chunks = scrape(port)[key], engine.chunks_run
    gate, real_decode = threading.Event(), engine.decode
    engine.decode = lambda: gate.wait(TIMEOUT) and real_decode()
    results = []
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    client = threading.Thread(target=lambda: results.append(request(port, "POST", "/v1/completions", body)))
    try:
        client.start()
        deadline = time.time() + TIMEOUT
        while scrape(port)[key] == before and time.time() < deadline:
            time.sleep(0.02)
        assert scrape(port)[key] == before + 1 and engine.chunks_run == chunks
    finally:
        del engine.decode
        gate.set()
        client.join(TIMEOUT)
    assert results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 6


def test_a_full_queue_answers_429_and_metrics_count_what_happened(server):
    """--max-queued-requests 2 on 3 slots with the engine held: of 8 concurrent requests, 5 wait
    (3 for the free slots, 2 queued) and 3 get 429 with Retry-After at once; /health stays 200;
    released, the 5 complete. /metrics, read by prometheus_client's parser, counts exactly that."""
    engine, runner, port = server["engine"], server["state"].runner, server["port"]
    before = scrape(port)
    gate, real_admit = threading.Event(), engine.admit
    engine.admit = lambda: gate.wait(TIMEOUT) and real_admit()  # held before it admits anything
    runner.max_queued = 2
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    results = []

    def post():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        results.append((resp.status, resp.getheader("retry-after"), json.loads(resp.read())))
        conn.close()

    threads = [threading.Thread(target=post) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        deadline = time.time() + TIMEOUT
        while len(results) < 3 and time.time() < deadline:
            time.sleep(0.02)
        assert [(status, retry, out["error"]["code"]) for status, retry, out in results] == [(429, "1", "queue_full")] * 3
        assert len(engine.scheduler.waiting) == 5 and request(port, "GET", "/health")[0] == 200
        assert scrape(port)[("spec_jax_queue_depth", ())] == 5
    finally:
        runner.max_queued = None
        del engine.admit
        gate.set()
        for t in threads:
            t.join(TIMEOUT)
    done = [out for status, _, out in results if status == 200]
    assert len(done) == 5 and all(out["usage"]["completion_tokens"] == 6 for out in done)
    after = scrape(port)

    def added(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert added("spec_jax_requests_rejected_total") == 3
    assert added("spec_jax_requests_total", finish_reason="length") == 5
    assert added("spec_jax_prompt_tokens_total") == 15 and added("spec_jax_generation_tokens_total") == 30
    assert added("spec_jax_time_to_first_token_seconds_count") == 5
    assert added("spec_jax_inter_token_latency_seconds_count") == 25  # 5 gaps after each first token
    drafted = sum(out["speculative"]["drafted"] for out in done)
    accepted = sum(out["speculative"]["accepted"] for out in done)
    assert added("spec_jax_draft_tokens_total", drafter="ngram") == drafted
    assert added("spec_jax_accepted_draft_tokens_total", drafter="ngram") == accepted
    assert added("spec_jax_position_drafted_total", drafter="ngram", position="1") == drafted // 3
    assert sum(added("spec_jax_position_accepted_total", drafter="ngram", position=str(i)) for i in (1, 2, 3)) \
        == accepted
    assert added("spec_jax_chunks_total", k="3") >= 1
    # Each step gives every live row a token at least, after the first from its prefill.
    assert 0 < added("spec_jax_decode_steps_total") <= 30 - 5 and added("spec_jax_chunk_seconds_total") > 0
    assert after[("spec_jax_queue_depth", ())] == 0 and after[("spec_jax_slots_in_use", ())] == 0
    assert after[("spec_jax_slots", ())] == 3
