"""The OpenAI-compatible HTTP API on the engine, in parts each testable without HTTP:

  - request models (pydantic, FastAPI's own): `CompletionRequest`, `ChatCompletionRequest`;
    a refusal is a `RequestError` naming the field (OpenAI's `error.param`);
  - `parse_request`: a JSON body -> `Parsed` (prompt ids, the engine's checked values);
  - `EngineRunner`: the engine on its own thread, handing each request's events to its queue;
  - `RequestEvents`: one request's events, None once its client has gone;
  - `Reply`: one response's JSON bodies and server-sent events;
  - `complete` / `stream_events`: a whole response, or its event stream;
  - `create_app`: the FastAPI routes over a `ServerState`.

Numbers follow the library's one rule (`validation.check_int` / `check_real`), stop ids its one
rule (`validation.resolve_stop_ids`), so the API, the CLI and `generate` refuse the same values.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' `Request` annotation at
# run time, and that class is imported inside `create_app`.
import asyncio
import bisect
import dataclasses
import json
import re
import threading
import time
import traceback
import uuid
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from spec_jax.app import prompt_text
from spec_jax.app.common import log
from spec_jax.app.http_limits import DEFAULT_MAX_BODY_BYTES, error_body
from spec_jax.decoding import validation
from spec_jax.decoding.slots import EngineEvent

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_JSON_DEPTH = 64
DISCONNECT_POLL_S = 0.25
RETRY_AFTER_S = 1  # a 429's Retry-After: a queued request waits about one request's time; clients back off from here
MAX_CHOICES = 16  # the most choices (n) one request may ask for
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs; the server's --max-logprobs may be lower


# --------------------------------------------------------------------------- request checks
class RequestError(Exception):
    """A client mistake: HTTP status, message, and the field it is about (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.headers = headers  # sent with the error (a 429's Retry-After)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)


def _number(name: str, default: Any, minimum: float | None = None, maximum: float | None = None,
            integer: bool = False) -> Any:
    """A field checked by the library's one number rule (`validation.check_int` / `check_real`);
    null means the default."""

    def check(value: Any) -> Any:
        if value is None:
            return default
        if integer:
            return validation.check_int(name, value, minimum, validation.INT32_MAX if maximum is None else maximum)
        return validation.check_real(name, value, minimum, maximum)

    return BeforeValidator(check)


def _flag(name: str) -> Any:
    def check(value: Any) -> bool:
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ValueError(f"'{name}' must be true or false, got {json.dumps(value)}.")
        return value

    return BeforeValidator(check)


def _required(name: str, what: str) -> Any:
    def check(value: Any) -> Any:
        if value is None:
            raise ValueError(f"'{name}' is required: {what}.")
        return value

    return BeforeValidator(check)


def _of_type(name: str, kind: type, what: str) -> Any:
    """A field that changes nothing in the output (an id for the caller's records), type-checked."""

    def check(value: Any) -> Any:
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"'{name}' must be {what}.")
        return value

    return BeforeValidator(check)


def _check_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("'prompt' is empty.")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ValueError("'prompt' must be a non-empty string or list of token ids (one prompt per request).")


def _check_stop(stop: Any) -> list[str]:
    stop_strings = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop_strings, list) or not all(isinstance(s, str) and s for s in stop_strings) \
            or len(stop_strings) > MAX_STOP_STRINGS:
        raise ValueError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them.")
    longest = max(len(s) for s in stop_strings) if stop_strings else 0
    if longest > MAX_STOP_CHARS:  # a stream holds back as much text as a stop's head could be
        raise ValueError(f"'stop' strings must be at most {MAX_STOP_CHARS} characters long, got one of {longest}.")
    return stop_strings


def _check_stop_token_ids(ids: Any) -> list[int]:
    if ids is not None and (not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError("'stop_token_ids' must be a list of token ids.")
    return ids or []


def _unsupported(name: str, allowed: tuple = (None,), why: str = "") -> Any:
    """An OpenAI field this server does not implement: accepted only at a value that changes
    nothing (compared with its type, so that 1 is not true), refused by name otherwise."""

    def check(value: Any) -> Any:
        if not any(value == a and type(value) is type(a) for a in allowed):
            neutral = [json.dumps(a) for a in allowed if a is not None]
            raise ValueError(f"'{name}' is not supported by this server{why}; leave it out"
                             + (f" or send {' or '.join(neutral)}." if neutral else "."))
        return value

    return BeforeValidator(check)


def _no_penalty(name: str) -> Any:
    def check(value: float) -> float:
        if value != 0:
            raise ValueError(f"'{name}' {value:g} is not supported by this server (it samples from the model's "
                             "probabilities as they are); send 0 or leave it out.")
        return value

    return AfterValidator(check)


_NO_TOOLS = " (it generates text only, no tool or function calls)"


class _Request(BaseModel):
    """The fields both endpoints take: OpenAI's, plus top_k, ignore_eos and stop_token_ids as
    vLLM has them. An unknown field is refused by name, as OpenAI's server does."""

    model_config = ConfigDict(extra="forbid")

    model: Any = None
    max_tokens: Annotated[int, _number("max_tokens", 16, minimum=1, integer=True)] = 16
    temperature: Annotated[float, _number("temperature", 1.0, 0.0, 2.0)] = 1.0
    top_p: Annotated[float, _number("top_p", 1.0, 0.0, 1.0)] = 1.0
    top_k: Annotated[int, _number("top_k", 0, minimum=-1, integer=True)] = 0  # vLLM's -1 = off
    # No seed: a fresh one per request (and per choice); a seed gives the same tokens whatever runs beside it.
    seed: Annotated[int | None, _number("seed", None, 0, validation.SEED_MAX, integer=True)] = None
    n: Annotated[int, _number("n", 1, 1, MAX_CHOICES, integer=True)] = 1
    stream: Annotated[bool, _flag("stream")] = False
    stream_options: Any = Field(None, validate_default=True)
    stop: Annotated[Any, BeforeValidator(_check_stop)] = Field(None, validate_default=True)
    stop_token_ids: Annotated[Any, BeforeValidator(_check_stop_token_ids)] = Field(None, validate_default=True)
    ignore_eos: Annotated[bool, _flag("ignore_eos")] = False
    frequency_penalty: Annotated[float, _number("frequency_penalty", 0.0, -2.0, 2.0),
                                 _no_penalty("frequency_penalty")] = 0.0
    presence_penalty: Annotated[float, _number("presence_penalty", 0.0, -2.0, 2.0),
                                _no_penalty("presence_penalty")] = 0.0
    logit_bias: Annotated[Any, _unsupported("logit_bias", (None, {}), " (no biased sampling)")] = None
    user: Annotated[Any, _of_type("user", str, "a string (an id of your end user)")] = None

    @field_validator("top_p")
    @classmethod
    def _top_p_not_zero(cls, top_p: float) -> float:
        if top_p == 0:
            raise ValueError("'top_p' must be in (0, 1], got 0.")
        return top_p

    @field_validator("stream_options", mode="before")
    @classmethod
    def _options(cls, options: Any) -> dict:
        if not isinstance(options or {}, dict):
            raise ValueError("'stream_options' must be an object.")
        return options or {}

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; N: each token's log-probability and the N most likely there."""
        return self.logprobs


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: Annotated[Any, _required("prompt", "a string or a list of token ids"), AfterValidator(_check_prompt)] \
        = Field(None, validate_default=True)
    # The legacy API's logprobs: how many most likely tokens to list per position (0: the chosen one's only).
    logprobs: Annotated[int | None, _number("logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)] = None
    echo: Annotated[Any, _unsupported("echo", (None, False))] = None
    suffix: Annotated[Any, _unsupported("suffix", (None, ""), " (no fill-in-the-middle)")] = None
    best_of: Annotated[Any, _unsupported("best_of", (None, 1), " (one candidate per request)")] = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages instead of a prompt; max_tokens defaults to what the
    model length leaves, and max_completion_tokens (OpenAI's newer name) wins over it."""

    messages: Annotated[Any, _required("messages", "a list of {role, content} objects"),
                        AfterValidator(prompt_text.check_messages)] = Field(None, validate_default=True)
    max_tokens: Annotated[int | None, _number("max_tokens", None, minimum=1, integer=True)] = None
    max_completion_tokens: Annotated[int | None, _number("max_completion_tokens", None, minimum=1,
                                                         integer=True)] = None
    logprobs: Annotated[bool, _flag("logprobs")] = False
    top_logprobs: Annotated[int | None, _number("top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)] = None
    response_format: Annotated[Any, _unsupported("response_format", (None, {"type": "text"}),
                                                 " (it does not constrain the output to JSON)")] = None
    tools: Annotated[Any, _unsupported("tools", (None, []), _NO_TOOLS)] = None
    tool_choice: Annotated[Any, _unsupported("tool_choice", (None, "none"), _NO_TOOLS)] = None
    parallel_tool_calls: Annotated[Any, _of_type("parallel_tool_calls", bool, "true or false")] = None
    functions: Annotated[Any, _unsupported("functions", (None, []), _NO_TOOLS)] = None
    function_call: Annotated[Any, _unsupported("function_call", (None, "none"), _NO_TOOLS)] = None
    modalities: Annotated[Any, _unsupported("modalities", (None, ["text"]), " (text output only)")] = None
    audio: Annotated[Any, _unsupported("audio", (None,), " (text output only)")] = None
    prediction: Annotated[Any, _unsupported("prediction", (None,), " (no predicted outputs)")] = None
    reasoning_effort: Annotated[Any, _unsupported("reasoning_effort")] = None
    verbosity: Annotated[Any, _unsupported("verbosity")] = None
    web_search_options: Annotated[Any, _unsupported("web_search_options", (None,), " (no web search)")] = None
    # Fields for the caller's records or OpenAI's billing: they change nothing in the output.
    metadata: Annotated[Any, _of_type("metadata", dict, "an object of strings")] = None
    store: Annotated[Any, _of_type("store", bool, "true or false")] = None
    service_tier: Annotated[Any, _of_type("service_tier", str, "a string")] = None
    prompt_cache_key: Annotated[Any, _of_type("prompt_cache_key", str, "a string")] = None
    safety_identifier: Annotated[Any, _of_type("safety_identifier", str, "a string")] = None

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


_OTHER_ENDPOINT = {"prompt": "/v1/chat/completions takes 'messages'",
                   "messages": "chat messages go to /v1/chat/completions",
                   "max_completion_tokens": "/v1/completions takes 'max_tokens'"}


def field_error(error: ValidationError) -> RequestError:
    """A pydantic error as the API's 400: the field from the error's location, the message from
    the check that refused it."""
    first = error.errors()[0]
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "extra_forbidden":
        hint = _OTHER_ENDPOINT.get(param, "this server takes OpenAI's fields plus top_k, ignore_eos and "
                                          "stop_token_ids")
        return RequestError(f"Unrecognized request argument supplied: '{param}' ({hint}).", param)
    cause = (first.get("ctx") or {}).get("error")
    return RequestError(str(cause) if cause is not None else f"'{param}': {first['msg']}.", param)


@dataclasses.dataclass
class Parsed:
    """A checked request: prompt ids, the engine's values, and what the response needs."""

    prompt_ids: list[int]
    engine_kwargs: Any  # the engine's RequestParams (of choice 0)
    stream: bool
    stop_strings: list[str]
    chat: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; N: each token's and the N most likely there

    def choices(self) -> list:
        """The engine's RequestParams of each choice: the same values, each its own PRNG key."""
        return [dataclasses.replace(self.engine_kwargs, choice=i) for i in range(self.n)]


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_values(body: dict) -> None:
    """Every string in the body is text (JSON can carry a lone UTF-16 surrogate, which no
    tokenizer takes) and the body nests at most MAX_JSON_DEPTH deep; RequestError naming the
    top-level field."""
    for field, value in body.items():
        stack = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            if depth > MAX_JSON_DEPTH:
                raise RequestError(f"'{field}' nests deeper than {MAX_JSON_DEPTH} levels.", field)
            if isinstance(item, str):
                hit = _SURROGATE.search(item)
                if hit:
                    raise RequestError(f"'{field}' holds a lone UTF-16 surrogate (U+{ord(hit.group()):04X}), which is "
                                       "not text; send valid Unicode.", field)
            elif isinstance(item, dict):
                stack.extend((part, depth + 1) for pair in item.items() for part in pair)
            elif isinstance(item, list):
                stack.extend((part, depth + 1) for part in item)


def validate_body(body: Any, server: "ServerState", chat: bool) -> _Request:
    """The JSON body as a request model; RequestError naming the field (404 for a model this
    server does not serve)."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.", None)
    check_json_values(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, the served model's id '{server.model_name}'.", "model")
    if model is not None and model not in server.model_names:
        raise RequestError(f"The model '{model}' does not exist; this server serves '{server.model_name}'.",
                           "model", status=404, code="model_not_found")
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        raise field_error(e) from None


def _check_text_length(chars: int, server: "ServerState", field: str) -> None:
    """Refuse, before tokenizing it, a text too long to be a prompt under the model length."""
    limit = server.engine.max_model_len
    fewest = server.prompt_text.fewest_tokens(chars)
    if fewest >= limit:
        raise RequestError(f"The prompt's {chars} characters are at least {fewest} tokens, past the model length "
                           f"{limit} (--max-model-len); shorten the prompt.", field)


def prompt_ids_of(request: _Request, server: "ServerState", chat: bool) -> list[int]:
    """The request's prompt as token ids (chat messages through the chat template), inside the vocabulary."""
    if chat:
        _check_text_length(sum(len(m["content"]) for m in request.messages), server, "messages")
        try:
            if server.prompt_text.chat_template:
                server.prompt_text.check_roles(request.messages)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        try:
            prompt_ids = server.prompt_text.chat_ids(request.messages)
        except Exception as e:  # a template that refuses these messages, or no template at all
            raise RequestError(f"'messages' could not be formatted with the chat template: {e}", "messages") from None
    else:
        prompt = request.prompt
        if isinstance(prompt, str):
            _check_text_length(len(prompt), server, "prompt")
        prompt_ids = list(server.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    vocab = server.engine.model.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise RequestError(f"'prompt' holds token ids outside the vocabulary [0, {vocab}).", "prompt")
    if not prompt_ids:
        raise RequestError("The prompt encodes to no tokens.", "messages" if chat else "prompt")
    return prompt_ids


def max_tokens_of(request: _Request, prompt_length: int, limit: int) -> tuple[int, str]:
    """(new tokens asked for, the field that asked), within the model length `limit`."""
    name = request.max_tokens_field()
    room = limit - prompt_length
    max_tokens = getattr(request, name)
    max_tokens = room if max_tokens is None else max_tokens  # chat: what the model length leaves
    if prompt_length + max_tokens > limit:
        raise RequestError(
            f"The prompt's {prompt_length} tokens + '{name}' {max_tokens} = {prompt_length + max_tokens} "
            f"exceeds the model length {limit} (--max-model-len); shorten the prompt or lower '{name}'"
            + (f" to {room} or less." if room >= 1 else "."),
            name,
        )
    return max_tokens, name


def stop_ids_of(request: _Request, engine) -> tuple[int, ...]:
    """The request's stop ids by the one stop-id rule; RequestError naming `stop_token_ids`."""
    vocab = engine.model.vocab_size
    outside = [t for t in request.stop_token_ids if not 0 <= t < vocab]
    if outside:
        raise RequestError(f"'stop_token_ids' holds ids outside the vocabulary [0, {vocab}): {outside[:5]}.",
                           "stop_token_ids")
    try:
        return validation.resolve_stop_ids(engine.default_stop_ids, ignore_eos=request.ignore_eos,
                                           extra_stop_ids=request.stop_token_ids)
    except validation.ArgumentError as e:
        extra = "" if request.ignore_eos else "; the model's own stop ids count too (ignore_eos drops them)"
        raise RequestError(f"'stop_token_ids': {e}{extra}", "stop_token_ids") from None


def parse_request(body: Any, server: "ServerState", chat: bool) -> Parsed:
    """Check a /v1/completions or /v1/chat/completions body -> Parsed; RequestError naming the field."""
    request = validate_body(body, server, chat)
    engine = server.engine
    prompt_ids = prompt_ids_of(request, server, chat)
    max_tokens, max_name = max_tokens_of(request, len(prompt_ids), engine.max_model_len)
    stop_ids = stop_ids_of(request, engine)
    # The API's field for each engine parameter an engine check can name.
    fields = {"max_new_tokens": max_name, "stop_ids": "stop_token_ids", "prompts": "messages" if chat else "prompt",
              "logprobs": "logprobs"}
    top_logprobs = request.top_logprobs_asked()
    asked = {} if top_logprobs is None else {"logprobs": top_logprobs}  # an engine without them is not asked
    try:
        params = engine.check_request(
            prompt_ids, max_new_tokens=max_tokens, temperature=request.temperature, top_k=max(request.top_k, 0),
            top_p=request.top_p, seed=request.seed, stop_ids=stop_ids, **asked)
    except validation.ArgumentError as e:
        field = fields.get(e.param, e.param)
        raise RequestError(str(e) if field == e.param else f"'{field}': {e}", field) from None
    return Parsed(prompt_ids, params, request.stream, request.stop, chat,
                  bool(request.stream_options.get("include_usage", True)), request.n, top_logprobs)


# --------------------------------------------------------------------------- the engine thread
class ServerEnding(Exception):
    """Handed to a request still running when the server stops waiting for it (past
    --drain-timeout): it ends in OpenAI's shape now, before uvicorn would cut it."""


class EngineRunner:
    """Runs the engine on its own thread and routes each request's events to the asyncio queue
    of the handler waiting for them.

    A step that raises fails the server whole: every request in flight gets the error, every new
    one a 503, and `on_failure` (set by `spec-jax serve`: end the process, non-zero) is called."""

    def __init__(self, engine, metrics: Any = None, max_queued: int | None = None):
        self.engine, self.metrics = engine, metrics
        self.max_queued = max_queued  # requests waiting for a slot past which a new one gets 429 (None: no bound)
        self.lock = threading.Lock()
        self.queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.error: str | None = None
        self.on_failure: Callable[[], None] | None = None
        self.thread = threading.Thread(target=self._run, name="spec-jax-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, params) -> tuple[int, asyncio.Queue]:
        return self.submit_all([params])[0]

    def submit_all(self, choices: list) -> list[tuple[int, asyncio.Queue]]:
        """Queue a request's choices (its n rows) together -> (request id, event queue) of each.
        RequestError 503 when the engine failed or the server is stopping, 429 (with Retry-After)
        when the queue has no room for them all."""
        loop = asyncio.get_running_loop()
        submitted = []
        with self.lock:  # registered before the engine thread can hand out its first event
            if self.error:  # checked under the lock: a failing step fails every registered queue
                raise RequestError(f"The engine failed ({self.error}); the server is exiting so that its "
                                   "supervisor can restart it.", None, status=503, code="engine_failed")
            if self.stopping:
                raise RequestError("The server is shutting down.", None, status=503, code="server_shutting_down")
            self._check_room(len(choices))
            for params in choices:
                rid = self.engine.submit(params.prompt_ids, params=params)
                if self.metrics is not None:
                    self.metrics.submitted(rid)
                self.queues[rid] = (loop, asyncio.Queue())
                submitted.append((rid, self.queues[rid][1]))
        self.wake.set()
        return submitted

    def _check_room(self, rows: int) -> None:
        """429 when `rows` more requests would leave more than --max-queued-requests waiting for
        a slot to free up (the free slots take waiting requests first)."""
        if self.max_queued is None:
            return
        open_slots = getattr(self.engine, "open_slots", None)  # a paged engine's free slots need pages too
        free = self.engine.slots - self.engine.num_live if open_slots is None else open_slots
        waiting = len(self.engine.scheduler.waiting)
        if waiting + rows - free <= self.max_queued:
            return
        if self.metrics is not None:
            self.metrics.rejected.inc()
        raise RequestError(
            f"The server is overloaded: {max(waiting - free, 0)} requests wait for a slot to free up (at most "
            f"{self.max_queued}, --max-queued-requests) and this one needs {rows} more; retry after "
            f"{RETRY_AFTER_S} s.", None, status=429, code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)})

    def cancel(self, rid: int) -> None:
        with self.lock:
            if rid in self.queues:
                self.engine.cancel(rid)
        self.wake.set()

    def _dispatch(self, events) -> None:
        if self.metrics is not None:
            now = time.perf_counter()
            for event in events:
                self.metrics.observe(event, now)
        with self.lock:
            for event in events:
                target = self.queues.get(event.request_id)
                if event.finish_reason is not None:
                    self.queues.pop(event.request_id, None)
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, event)

    def _end_all(self, error: Exception) -> int:
        """Hand `error` to every request in flight and forget them -> how many there were."""
        with self.lock:
            for loop, queue in self.queues.values():
                loop.call_soon_threadsafe(queue.put_nowait, error)
            ended = len(self.queues)
            self.queues.clear()
        return ended

    def _run(self) -> None:
        while not self.stopping or self.engine.has_work():
            if not self.engine.has_work():
                self.wake.wait(0.1)
                self.wake.clear()
                continue
            try:  # a new request's first token goes out before the chunk after its prefill runs
                self._dispatch(self.engine.admit())
                events = self.engine.decode()
            except Exception as e:  # a failing step must not hang every client: fail them all
                log(f"engine step failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                with self.lock:
                    self.error = f"{type(e).__name__}: {e}"
                self._end_all(RuntimeError(self.error))
                if self.on_failure is not None:
                    self.on_failure()
                return
            self._dispatch(events)

    def close(self) -> None:
        """Refuse new requests (503); the running ones go on."""
        with self.lock:
            self.stopping = True
        self.wake.set()

    def end_running(self) -> int:
        """Past the drain timeout: end every request in flight now (`ServerEnding`) and cancel it
        in the engine -> how many there were."""
        with self.lock:
            self.stopping = True
            for rid in self.queues:
                self.engine.cancel(rid)
        self.wake.set()
        return self._end_all(ServerEnding("The server shut down before the request finished "
                                          "(--drain-timeout passed); retry it."))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel whatever is left, hand out the cancellations, end the thread."""
        self.close()
        with self.lock:
            for rid in list(self.queues):
                self.engine.cancel(rid)
        self.wake.set()
        self.thread.join(timeout)


# --------------------------------------------------------------------------- the app
class ServerState:
    """What the handlers share: the engine, its runner, the tokenizer and the served names."""

    def __init__(self, engine, tokenizer, chat_template, model_name, drafter_label,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queued: int | None = None):
        from spec_jax.app.metrics import ServerMetrics

        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.model_name, self.drafter_label = model_name, drafter_label
        self.model_names = {model_name}
        self.prompt_text = prompt_text.PromptText(tokenizer, chat_template)
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(engine, drafter_label)
        self.runner = EngineRunner(engine, self.metrics, max_queued)
        self.created = int(time.time())


class TextOutput:
    """A request's text so far: incremental detokenization, stop strings held back until they
    can no longer begin one.

    Once a stop string is found the output is final: `text` ends before the stop's first
    occurrence (the stop excluded, as OpenAI does), `token_ids` are the fewest tokens whose text
    holds `text` (a token that ends inside the stop is kept when its text begins before it), and
    tokens the engine hands out later (it runs on until the cancel lands) are dropped."""

    def __init__(self, tokenizer, stop_strings):
        from spec_jax.decoding.stream import IncrementalDetokenizer

        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop_strings = stop_strings
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""  # produced so far (unsent part included)
        self.sent = 0
        self.token_ids: list[int] = []
        self.stopped = False  # a stop string was found

    def push(self, ids: list[int], final: bool) -> str:
        """Text to send now for these new ids ("" once stopped)."""
        if self.stopped:
            return ""
        self.token_ids += ids
        self.text += self.detok.push(ids) + (self.detok.flush() if final else "")
        # No stop can begin in text already sent: the held-back tail is longer than any stop's head.
        found = [at for at in (self.text.find(s, self.sent) for s in self.stop_strings) if at >= 0]
        if found:
            self.text, self.stopped, final = self.text[: min(found)], True, True
            self.token_ids = self.token_ids[: self._tokens_holding(self.text)]
        upto = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent : upto], upto
        return piece

    def _tokens_holding(self, text: str) -> int:
        """The fewest leading tokens whose decoded text begins with `text` (a binary search:
        a longer prefix of tokens only adds text)."""
        tokenizer, skip = self.detok.tokenizer, self.detok.skip_special_tokens
        return bisect.bisect_left(range(len(self.token_ids)), True, key=lambda n: tokenizer.decode(
            self.token_ids[:n], skip_special_tokens=skip).startswith(text))


# --------------------------------------------------------------------------- responses
@dataclasses.dataclass
class Reply:
    """One choice of a response (a request of n choices has n, sharing the response's id): its
    bodies and events in OpenAI's shape. `output` holds the text so far, `logprobs` the
    `TokenLogprob` of each token received (when the request asked for them)."""

    parsed: Parsed
    model_name: str
    output: TextOutput
    response_id: str
    created: int
    index: int = 0
    tokenizer: Any = None
    logprobs: list = dataclasses.field(default_factory=list)
    logprobs_sent: int = 0  # a stream's logprobs sent so far
    client_gone: bool = False  # the stream ended because its client went away (no [DONE] then)

    @classmethod
    def new(cls, parsed: Parsed, state: ServerState) -> "Reply":
        return cls(parsed, state.model_name, TextOutput(state.tokenizer, parsed.stop_strings),
                   ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                   tokenizer=state.tokenizer)

    def choices(self) -> list["Reply"]:
        """This reply and one more per further choice the request asked for (same id)."""
        return [self] + [dataclasses.replace(self, output=TextOutput(self.tokenizer, self.parsed.stop_strings),
                                             index=i, logprobs=[]) for i in range(1, self.parsed.n)]

    def usage(self, replies: list["Reply"] | None = None) -> dict[str, Any]:
        prompt = len(self.parsed.prompt_ids)
        completion = sum(len(r.output.token_ids) for r in replies or [self])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def speculative(stats: Any) -> dict[str, Any]:
        if stats is None:
            return {"steps": 0, "drafted": 0, "accepted": 0, "tau": 0.0}
        return {"steps": stats.steps, "drafted": stats.drafted, "accepted": stats.accepted,
                "tau": round(stats.tau, 4)}

    def finish_reason(self, event: Any) -> str | None:
        """A stop string found by the server ends the request as "stop" whatever the engine says."""
        return "stop" if self.output.stopped else event.finish_reason

    def push(self, event: Any) -> str:
        """An engine event's tokens (and their logprobs) -> the text to send now."""
        self.logprobs += event.logprobs or []
        return self.output.push(event.new_ids, event.finish_reason is not None)

    def choice(self, reason: str | None) -> dict[str, Any]:
        """This choice in the whole (non-streamed) response."""
        choice = {"index": self.index, "finish_reason": reason, "logprobs": self.logprobs_body(len(self.logprobs)),
                  "token_ids": self.output.token_ids}
        if self.parsed.chat:
            choice["message"] = {"role": "assistant", "content": self.output.text}
        else:
            choice["text"] = self.output.text
        return choice

    def completion(self, reason: str | None, stats: Any, others: list | None = None) -> dict[str, Any]:
        """The whole (non-streamed) response body; `others`: the further choices' (reply,
        finish reason, stats)."""
        replies = [(self, reason, stats)] + (others or [])
        return {"id": self.response_id, "object": "chat.completion" if self.parsed.chat else "text_completion",
                "created": self.created, "model": self.model_name,
                "choices": [r.choice(why) for r, why, _ in replies], "usage": self.usage([r for r, _, _ in replies]),
                "speculative": self.speculative(sum_stats([s for _, _, s in replies]))}

    def logprobs_body(self, upto: int, start: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs of tokens start .. upto - 1 (those a stop string cut are left out):
        chat's {"content": [{token, logprob, bytes, top_logprobs}]}, the legacy completions'
        {tokens, token_logprobs, top_logprobs, text_offset}; None when the request asked for none."""
        if self.parsed.logprobs is None:
            return None
        entries = self.logprobs[start: min(upto, len(self.output.token_ids))]
        text = self.tokenizer.decode
        if self.parsed.chat:
            def item(token_id: int, logprob: float) -> dict[str, Any]:
                token = text([token_id])
                return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

            return {"content": [dict(item(e.token_id, e.logprob), top_logprobs=[item(i, v) for i, v in e.top])
                                for e in entries]}
        offsets, at = [], sum(len(text([e.token_id])) for e in self.logprobs[:start])
        for e in entries:
            offsets.append(at)
            at += len(text([e.token_id]))
        return {"tokens": [text([e.token_id]) for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text([i]): v for i, v in e.top} for e in entries], "text_offset": offsets}

    def stream_logprobs(self, final: bool) -> dict[str, Any] | None:
        """The logprobs not sent yet, for a stream's next event (all that are left when final)."""
        upto = len(self.logprobs) if final else min(len(self.logprobs), len(self.output.token_ids))
        body = self.logprobs_body(upto, self.logprobs_sent)
        self.logprobs_sent = max(self.logprobs_sent, min(upto, len(self.output.token_ids)))
        return body

    def event(self, choice: dict[str, Any], extra: dict | None = None) -> str:
        """One server-sent event carrying `choice`."""
        body = {"id": self.response_id, "object": "chat.completion.chunk" if self.parsed.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": [choice], **(extra or {})}
        return f"data: {json.dumps(body)}\n\n"

    def role_event(self) -> str:
        """A chat stream's first event: the assistant's role."""
        return self.event({"index": self.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                           "logprobs": None})

    def piece_event(self, piece: str | None, reason: str | None, extra: dict | None = None) -> str:
        logprobs = self.stream_logprobs(final=reason is not None)
        if self.parsed.chat:
            delta = {} if piece is None else {"content": piece}
            return self.event({"index": self.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs},
                              extra)
        return self.event({"index": self.index, "text": piece or "", "finish_reason": reason, "logprobs": logprobs},
                          extra)

    def last_event(self, event: Any) -> str:
        """The event that ends a stream: finish reason, speculative stats and (unless the
        request's stream_options said not to) usage."""
        extra = {"speculative": self.speculative(event.stats)} if event.stats is not None else {}
        if self.parsed.include_usage:
            extra["usage"] = self.usage()
        return self.piece_event(None if self.parsed.chat else "", self.finish_reason(event), extra)


def sum_stats(stats: list) -> Any:
    """The speculative stats of a response's choices together (None when none has any)."""
    from spec_jax.decoding.slots import RequestStats

    stats = [s for s in stats if s is not None]
    if len(stats) <= 1:
        return stats[0] if stats else None
    total = RequestStats(stats[0].prompt_tokens)
    for s in stats:
        total.completion_tokens += s.completion_tokens
        total.steps, total.drafted = total.steps + s.steps, total.drafted + s.drafted
        total.accepted, total.emitted = total.accepted + s.accepted, total.emitted + s.emitted
    return total


class RequestEvents:
    """One request's events from the engine thread. `next()` is None once the client has gone
    (the request is then cancelled); an engine failure is raised as RuntimeError."""

    def __init__(self, runner: EngineRunner, rid: int, queue: asyncio.Queue,
                 is_disconnected: Callable[[], Awaitable[bool]], poll_s: float = DISCONNECT_POLL_S):
        self.runner, self.rid, self.queue = runner, rid, queue
        self.is_disconnected, self.poll_s = is_disconnected, poll_s

    async def next(self) -> Any:
        while True:
            try:
                event = await asyncio.wait_for(self.queue.get(), self.poll_s)
            except asyncio.TimeoutError:
                if await self.is_disconnected():
                    self.cancel()
                    return None
                continue
            if isinstance(event, Exception):
                raise event
            return event

    def cancel(self) -> None:
        self.runner.cancel(self.rid)


async def complete(reply: Reply, events: RequestEvents) -> tuple[int, dict[str, Any]]:
    """The non-streamed response -> (HTTP status, body)."""
    return await complete_choices([reply], [events])


async def complete_choices(replies: list[Reply], events: list[RequestEvents]) -> tuple[int, dict[str, Any]]:
    """The non-streamed response of every choice (run together, each to its end) -> (HTTP
    status, body); a choice's error is the response's."""
    ended = await asyncio.gather(*(_run_choice(r, e) for r, e in zip(replies, events)))
    for status, body, _, _ in ended:
        if status != 200:
            return status, body
    (_, _, reason, stats), *others = ended
    return 200, replies[0].completion(reason, stats, [(r, why, s) for r, (_, _, why, s) in zip(replies[1:], others)])


async def _run_choice(reply: Reply, events: RequestEvents) -> tuple[int, dict[str, Any], str | None, Any]:
    """One choice to its end -> (HTTP status, error body or {}, finish reason, stats)."""
    stats, reason = None, None
    try:
        while reason is None:
            event = await events.next()
            if event is None:
                return 499, {}, None, None  # the client is gone
            # Detokenizing (and a stop's token search) off the event loop, as tokenizing is.
            await asyncio.to_thread(reply.push, event)
            if reply.output.stopped and event.finish_reason is None:
                events.cancel()  # a stop string: no need for more tokens
            stats, reason = event.stats, reply.finish_reason(event) if event.finish_reason else None
    except ServerEnding as e:
        if not reply.output.stopped:  # an answer a stop string ended is whole: it goes out
            error = RequestError(str(e), None, status=503, code="server_shutting_down")
            return error.status, error.body(), None, None
        reason = "stop"
    except RuntimeError as e:
        error = RequestError(f"generation failed: {e}", None, status=500)
        return error.status, error.body(), None, None
    return 200, {}, reason, stats


async def stream_events(reply: Reply, events: RequestEvents) -> AsyncIterator[str]:
    """The streamed response: server-sent events ending with `data: [DONE]`. A stream left
    before its end (the client went away, or the server is stopping) cancels the request."""
    async for line in _choice_events(reply, events):
        yield line
    if not reply.client_gone:
        yield "data: [DONE]\n\n"


async def stream_choices(replies: list[Reply], events: list[RequestEvents]) -> AsyncIterator[str]:
    """The streamed response of several choices: their events as they come (each names its
    choice's `index`), then `data: [DONE]` once every choice has ended."""
    if len(replies) == 1:
        async for line in stream_events(replies[0], events[0]):
            yield line
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(reply: Reply, choice_events: RequestEvents) -> None:
        try:
            async for line in _choice_events(reply, choice_events):
                await merged.put(line)
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(r, e)) for r, e in zip(replies, events)]
    try:
        running = len(tasks)
        while running:
            line = await merged.get()
            if line is None:
                running -= 1
            else:
                yield line
        if not any(r.client_gone for r in replies):
            yield "data: [DONE]\n\n"
    finally:
        for task in tasks:  # the client left: each choice's own cleanup cancels its request
            task.cancel()


async def _choice_events(reply: Reply, events: RequestEvents) -> AsyncIterator[str]:
    """One choice's server-sent events, without the closing [DONE]."""
    finished = False
    try:
        if reply.parsed.chat:
            yield reply.role_event()
        while True:
            try:
                event = await events.next()
            except ServerEnding:  # past the drain timeout: what is held back, then a last chunk
                event = EngineEvent(events.rid, [], "cancelled")
            except RuntimeError as e:
                yield f"data: {json.dumps(RequestError(f'generation failed: {e}', None, 500).body())}\n\n"
                break
            if event is None:
                reply.client_gone = True
                return
            done = event.finish_reason is not None
            piece = await asyncio.to_thread(reply.push, event)  # off the event loop
            if reply.output.stopped and not done:
                events.cancel()
            if piece:
                yield reply.piece_event(piece, None)
            if done:
                finished = True
                yield reply.last_event(event)
                break
    finally:
        if not finished:
            events.cancel()


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"The request body is not valid JSON ({e}).", None) from None
    except RecursionError:
        raise RequestError(f"The request body nests deeper than JSON can be read here; at most {MAX_JSON_DEPTH} "
                           "levels are taken.", None) from None


def parse_body(raw: bytes, state: "ServerState", chat: bool) -> Parsed:
    """The body as a checked request: JSON, then `parse_request` (run off the event loop, since
    it tokenizes)."""
    return parse_request(parse_json(raw), state, chat)


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body; 413 past `limit` bytes, from its Content-Length before any of it is
    read, or as soon as that many bytes have come (a chunked body)."""
    declared = request.headers.get("content-length", "")
    too_large = RequestError(f"The request body is larger than this server takes ({limit} bytes, "
                             "--max-body-bytes); send a shorter prompt.", None, status=413, code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(error: RequestError, headers: dict | None = None):
    """`error` in OpenAI's shape, as ASCII JSON: a message may quote the client's text, a lone
    surrogate included, which UTF-8 cannot carry."""
    from starlette.responses import Response

    return Response(json.dumps(error.body()), status_code=error.status, media_type="application/json",
                    headers=headers or error.headers)


def route_error(method: str, path: str, status: int, detail: Any) -> RequestError:
    """Starlette's 404 / 405 (and any other HTTP error it raises) as a RequestError."""
    if status == 404:
        return RequestError(f"Invalid URL ({method} {path}): this server has POST /v1/completions, POST "
                            "/v1/chat/completions, GET /v1/models, GET /v1/models/{model}, GET /health and GET /metrics.",
                            None, 404)
    if status == 405:
        return RequestError(f"Method {method} is not allowed on {path}.", None, 405)
    return RequestError(str(detail), None, status)


def health(state: ServerState) -> tuple[int, dict[str, Any]]:
    """GET /health -> (status, body): 200 while serving, 503 once draining or failed."""
    engine = state.engine
    status = "error" if state.runner.error else ("draining" if state.runner.stopping else "ok")
    body = {"status": status, "slots": engine.slots, "running": engine.num_live,
            "waiting": len(engine.scheduler.waiting), "max_queued": state.runner.max_queued,
            "model": state.model_name, "drafter": state.drafter_label}
    return (200 if status == "ok" else 503), body


def model_card(state: ServerState) -> dict[str, Any]:
    """GET /v1/models/{model}: the served model."""
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "spec-jax",
            "max_model_len": state.engine.max_model_len}


def models(state: ServerState) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [model_card(state)]}


def add_error_handlers(app) -> None:
    """Every error the app itself answers in OpenAI's shape: unknown routes (404), wrong methods
    (405), and a bug (500; Starlette still logs its traceback)."""
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return error_response(route_error(request.method, request.url.path, exc.status_code, exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, exc):
        return error_response(RequestError(f"Internal server error ({type(exc).__name__}).", None, 500))


def create_app(state: ServerState):
    """The FastAPI app over a `ServerState` (its runner is started and stopped by the app's
    lifespan)."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.requests import ClientDisconnect

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.runner.start()
        yield
        # uvicorn has drained the connections it could (--drain-timeout); cancel the rest.
        await asyncio.get_running_loop().run_in_executor(None, state.runner.stop)

    app = FastAPI(title="spec-jax", lifespan=lifespan)
    add_error_handlers(app)

    async def handle(request: Request, chat: bool):
        try:
            raw = await read_body(request, state.max_body_bytes)
            parsed = await asyncio.to_thread(parse_body, raw, state, chat)  # tokenizing: off the event loop
            submitted = state.runner.submit_all(parsed.choices())
        except RequestError as e:
            return error_response(e)
        except ClientDisconnect:  # the client left (or --read-timeout closed it) before its body came
            return Response(status_code=499)
        replies = Reply.new(parsed, state).choices()
        events = [RequestEvents(state.runner, rid, queue, request.is_disconnected) for rid, queue in submitted]
        if parsed.stream:
            return StreamingResponse(stream_choices(replies, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        status, body = await complete_choices(replies, events)
        return JSONResponse(body, status_code=status)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def get_health():
        status, body = health(state)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def get_metrics():
        text, content_type = state.metrics.exposition()
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def get_models():
        return models(state)

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model not in state.model_names:
            return error_response(RequestError(f"The model '{model}' does not exist; this server serves "
                                               f"'{state.model_name}'.", "model", 404, "model_not_found"))
        return model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app
