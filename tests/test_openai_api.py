"""The HTTP API's parts without HTTP or a compiled model: request models and `parse_request`
(each refusal names its field, numbers follow the library's one rule, stop ids its one rule),
the response bodies and server-sent events of `Reply`, and `complete` / `stream_events` fed by
a queue of engine events, including a client that goes away and an engine that fails."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from serving_testlib import make_tokenizer

from spec_jax.app.openai_api import (
    EngineRunner,
    Parsed,
    Reply,
    RequestError,
    RequestEvents,
    ServerEnding,
    ServerState,
    complete,
    health,
    models,
    parse_request,
    stream_events,
)
from spec_jax.decoding.engine import Engine
from spec_jax.decoding.slots import EngineEvent, RequestStats
from spec_jax.decoding.validation import resolve_stop_ids

MAX_MODEL_LEN = 64
DEFAULT_STOP = (0,)


class FakeEngine:
    """What the API reads of an engine; `check_request` is the real one."""

    check_request = Engine.check_request
    max_logprobs = None  # it keeps no log-probabilities
    pages = None  # a dense cache (no page pool)

    def __init__(self, vocab_size: int):
        self.model = types.SimpleNamespace(vocab_size=vocab_size)
        self.max_model_len = MAX_MODEL_LEN
        self.default_stop_ids = DEFAULT_STOP
        self.slots, self.num_live, self.scheduler = 2, 0, types.SimpleNamespace(waiting=[])
        self.cancelled: list[int] = []

    def cancel(self, rid: int) -> None:
        self.cancelled.append(rid)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def server(tokenizer):
    state = ServerState(FakeEngine(len(tokenizer)), tokenizer, tokenizer.chat_template, "tiny", "ngram")
    return state


def refused(server, body, chat=False):
    with pytest.raises(RequestError) as e:
        parse_request(body, server, chat)
    return e.value


@pytest.mark.parametrize("body, chat, param, status", [
    ({"max_tokens": 4}, True, "messages", 400),
    ({"messages": [{"role": "user"}]}, True, "messages", 400),
    ({"messages": []}, True, "messages", 400),
    ({"max_tokens": 4}, False, "prompt", 400),
    ({"prompt": ""}, False, "prompt", 400),
    ({"prompt": [1, 10**6]}, False, "prompt", 400),
    ({"prompt": [1, True]}, False, "prompt", 400),
    ({"prompt": "hi", "temperature": -1}, False, "temperature", 400),
    ({"prompt": "hi", "temperature": "0.5"}, False, "temperature", 400),
    ({"prompt": "hi", "top_p": 1.5}, False, "top_p", 400),
    ({"prompt": "hi", "top_p": 0}, False, "top_p", 400),
    ({"prompt": "hi", "top_k": -2}, False, "top_k", 400),
    ({"prompt": "hi", "seed": 2**32}, False, "seed", 400),
    ({"prompt": "hi", "max_tokens": 0}, False, "max_tokens", 400),
    ({"prompt": "hi", "max_tokens": 2.5}, False, "max_tokens", 400),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, False, "max_tokens", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": MAX_MODEL_LEN}, True,
     "max_completion_tokens", 400),
    ({"prompt": "hi", "n": 17}, False, "n", 400),
    ({"prompt": "hi", "stream": "yes"}, False, "stream", 400),
    ({"prompt": "hi", "stream_options": [1]}, False, "stream_options", 400),
    ({"prompt": "hi", "stop": ["a", ""]}, False, "stop", 400),
    ({"prompt": "hi", "stop_token_ids": [1, "2"]}, False, "stop_token_ids", 400),
    ({"prompt": "hi", "stop_token_ids": list(range(1, 10))}, False, "stop_token_ids", 400),
    ({"prompt": "hi", "ignore_eos": 1}, False, "ignore_eos", 400),
    ({"prompt": "hi", "logprobs": 21}, False, "logprobs", 400),
    ({"prompt": "hi", "logprobs": 3}, False, "logprobs", 400),  # this engine keeps none
    ({"prompt": "hi", "echo": True}, False, "echo", 400),
    ({"prompt": "hi", "model": "gpt-9"}, False, "model", 404),
    ([1, 2], False, None, 400),
])
def test_refusals_name_the_field(server, body, chat, param, status):
    error = refused(server, body, chat)
    assert (error.param, error.status) == (param, status), error.message
    assert error.body()["error"]["param"] == param and error.message
    if param:
        assert param in error.message


def test_a_request_becomes_the_engine_values(server, tokenizer):
    parsed = parse_request({"prompt": "def is_prime(n):", "max_tokens": 8.0, "temperature": 0, "top_k": -1,
                            "seed": 3, "stop": "\n", "stream": True, "stream_options": {"include_usage": False},
                            "presence_penalty": 0, "user": "u-1"}, server, chat=False)
    assert parsed.prompt_ids == tokenizer.encode("def is_prime(n):")
    params = parsed.engine_kwargs
    assert (params.max_new_tokens, params.temperature, params.top_k, params.seed) == (8, 0.0, 0, 3)
    assert params.stop_ids == DEFAULT_STOP and parsed.stop_strings == ["\n"]
    assert parsed.stream and not parsed.include_usage and not parsed.chat


def test_chat_defaults_to_what_the_model_length_leaves(server):
    parsed = parse_request({"messages": [{"role": "user", "content": "hi"}]}, server, chat=True)
    assert parsed.engine_kwargs.max_new_tokens == MAX_MODEL_LEN - len(parsed.prompt_ids)
    assert parsed.engine_kwargs.temperature == 1.0 and parsed.include_usage


@pytest.mark.parametrize("ignore_eos, stop_token_ids", [(False, None), (True, None), (False, [5, 6]), (True, [5])])
def test_stop_token_ids_follow_the_one_rule(server, ignore_eos, stop_token_ids):
    body = {"prompt": [1, 2], "ignore_eos": ignore_eos, "stop_token_ids": stop_token_ids}
    got = parse_request(body, server, chat=False).engine_kwargs.stop_ids
    assert got == resolve_stop_ids(DEFAULT_STOP, ignore_eos=ignore_eos, extra_stop_ids=stop_token_ids or ())
    assert got == tuple(stop_token_ids or ()) + (() if ignore_eos else DEFAULT_STOP)


def test_health_and_models(server):
    assert health(server) == (200, {"status": "ok", "slots": 2, "running": 0, "waiting": 0, "max_queued": None,
                                    "model": "tiny", "drafter": "ngram"})
    server.runner.stopping = True
    assert health(server)[0] == 503 and health(server)[1]["status"] == "draining"
    assert models(server)["data"][0]["id"] == "tiny" and models(server)["data"][0]["max_model_len"] == MAX_MODEL_LEN


# --------------------------------------------------------------------------- responses from events
def events_of(server, items, disconnected=False):
    """A RequestEvents whose queue already holds `items`; the client is gone once they are read
    when `disconnected`."""
    queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)

    async def is_disconnected():
        return disconnected

    runner = EngineRunner(server.engine)
    runner.queues[7] = (None, queue)  # what submit registers
    return RequestEvents(runner, rid=7, queue=queue, is_disconnected=is_disconnected, poll_s=0.01)


def reply_for(server, chat=False, stop_strings=(), include_usage=True):
    parsed = Parsed([1, 2, 3], None, stream=False, stop_strings=list(stop_strings), chat=chat,
                    include_usage=include_usage)
    return Reply.new(parsed, server)


def finished(ids, reason="length"):
    return EngineEvent(7, ids, reason, RequestStats(3, len(ids), steps=2, drafted=6, accepted=3, emitted=len(ids)))


def test_complete_joins_the_events(server, tokenizer):
    ids = tokenizer.encode("Café crème")
    status, body = asyncio.run(complete(reply_for(server), events_of(server, [EngineEvent(7, ids[:2]),
                                                                             finished(ids[2:])])))
    assert status == 200 and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == "Café crème" and choice["token_ids"] == ids and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}
    assert body["speculative"] == {"steps": 2, "drafted": 6, "accepted": 3, "tau": len(ids[2:]) / 2}


def test_a_stop_string_ends_the_request_early(server, tokenizer):
    ids = tokenizer.encode("for i in range(10):")
    events = events_of(server, [EngineEvent(7, ids), finished([], "cancelled")])
    status, body = asyncio.run(complete(reply_for(server, chat=True, stop_strings=["range"]), events))
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": "for i in "}
    assert body["choices"][0]["finish_reason"] == "stop" and server.engine.cancelled == [7]


@pytest.mark.parametrize("stream", [False, True])
def test_nothing_after_a_stop_string_is_appended(server, tokenizer, stream):
    """Issue 42: the engine runs on until the cancel lands, and the tokens it hands out after the
    stop were appended after the cut (text, token_ids and usage). Here the stop "e(1" spans
    tokens (" range", "(", "10") and more tokens follow in two later events."""
    ids = tokenizer.encode("for i in range(10):\n    print(i * i)\n")
    items = [EngineEvent(7, ids[:5]), EngineEvent(7, ids[5:9]), EngineEvent(7, ids[9:]), finished(ids[:2], "cancelled")]
    reply = reply_for(server, stop_strings=["print", "e(1", "zzz"])
    if stream:
        events = parsed_events(asyncio.run(collect(stream_events(reply, events_of(server, items)))))
        text, last = "".join(e["choices"][0]["text"] for e in events[:-1]), events[-2]
        usage, token_ids = last["usage"], reply.output.token_ids
    else:
        status, body = asyncio.run(complete(reply, events_of(server, items)))
        assert status == 200
        text, last, usage, token_ids = body["choices"][0]["text"], body, body["usage"], body["choices"][0]["token_ids"]
    assert text == "for i in rang" and last["choices"][0]["finish_reason"] == "stop"
    assert token_ids == ids[:5]  # the fewest tokens holding the text: " range" ends inside the stop
    assert usage["completion_tokens"] == 5 and server.engine.cancelled[0] == 7


def test_a_client_that_went_away_cancels_its_request(server):
    status, body = asyncio.run(complete(reply_for(server), events_of(server, [], disconnected=True)))
    assert (status, body) == (499, {}) and server.engine.cancelled == [7]


def test_an_engine_failure_is_a_500(server):
    status, body = asyncio.run(complete(reply_for(server), events_of(server, [RuntimeError("boom")])))
    assert status == 500 and "boom" in body["error"]["message"] and body["error"]["type"] == "server_error"


def test_past_the_drain_timeout_a_request_gets_a_json_503(server, tokenizer):
    ids = tokenizer.encode("The quick brown fox")
    ending = ServerEnding("The server shut down before the request finished (--drain-timeout passed); retry it.")
    status, body = asyncio.run(complete(reply_for(server), events_of(server, [EngineEvent(7, ids), ending])))
    assert status == 503 and body["error"]["type"] == "server_error" and body["error"]["code"] == "server_shutting_down"
    assert "--drain-timeout" in body["error"]["message"]
    # An answer a stop string already ended (its cancel not yet handed out) is whole: it goes out.
    reply = reply_for(server, stop_strings=["brown"])
    status, body = asyncio.run(complete(reply, events_of(server, [EngineEvent(7, ids), ending])))
    assert status == 200 and body["choices"][0]["text"] == "The quick " and body["choices"][0]["finish_reason"] == "stop"


async def collect(stream):
    return [event async for event in stream]


def parsed_events(lines):
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    return [line[6:-2] if line[6:-2] == "[DONE]" else json.loads(line[6:-2]) for line in lines]


def test_a_chat_stream(server, tokenizer):
    ids = tokenizer.encode("The quick brown fox")
    lines = asyncio.run(collect(stream_events(reply_for(server, chat=True),
                                              events_of(server, [EngineEvent(7, ids[:3]), finished(ids[3:])]))))
    events = parsed_events(lines)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == "The quick brown fox"
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == len(ids) and events[-2]["speculative"]["steps"] == 2
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1]) and server.engine.cancelled == []


def test_a_stream_without_usage_and_one_cut_short(server, tokenizer):
    ids = tokenizer.encode("hello")
    lines = asyncio.run(collect(stream_events(reply_for(server, include_usage=False),
                                              events_of(server, [finished(ids, "stop")]))))
    last = parsed_events(lines)[-2]
    assert "usage" not in last and last["choices"][0]["finish_reason"] == "stop"
    lines = asyncio.run(collect(stream_events(reply_for(server), events_of(server, [EngineEvent(7, ids)],
                                                                           disconnected=True))))
    assert parsed_events(lines)[-1] != "[DONE]" and server.engine.cancelled == [7, 7]


def test_past_the_drain_timeout_a_stream_ends_with_a_last_chunk_and_done(server, tokenizer):
    """The text held back for a possible stop string goes out, then a last chunk (finish reason
    "cancelled", usage) and [DONE]."""
    ids = tokenizer.encode("The quick brown fox")
    ending = ServerEnding("shut down")
    reply = reply_for(server, chat=True, stop_strings=["zzzzzz"])
    events = parsed_events(asyncio.run(collect(stream_events(reply, events_of(server, [EngineEvent(7, ids), ending])))))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == "The quick brown fox"
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "cancelled"
    assert events[-2]["usage"]["completion_tokens"] == len(ids) and "speculative" not in events[-2]


@pytest.mark.parametrize("argv, match", [
    (["--port", "70000"], r"--port must be an integer >= 0 and <= 65535, got 70000"),
    (["--slots", "0"], r"--slots must be an integer >= 1"),
    (["--max-admits", "0"], r"--max-admits must be an integer >= 1"),
    (["--chunk-steps", "0"], r"--chunk-steps must be an integer >= 1"),
    (["--max-model-len", "1"], r"--max-model-len must be an integer >= 2"),
    (["--k-choices", "2,x"], r"--k-choices '2,x' must be a comma list of K >= 0"),
])
def test_serve_flags_follow_the_one_integer_rule(argv, match):
    import argparse

    from spec_jax.app import inputs, serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(inputs.UsageError, match=match):
        serve.check_args(parser.parse_args(argv))
    assert serve.check_args(parser.parse_args(["--k-choices", "0,2,4"])) == [0, 2, 4]
