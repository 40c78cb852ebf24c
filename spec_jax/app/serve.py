"""`spec-jax serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine.

    spec-jax serve                                  # the default model on 127.0.0.1:8000
    spec-jax serve --target random:llama-3.2-1b --drafter ngram --slots 16 --port 9000
    curl -N localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (`"stream": true` sends server-sent
events ending with `data: [DONE]`), GET /v1/models, GET /health. Every response carries usage
counts and the request's speculative stats (`speculative`: steps, drafted, accepted, tau).

One engine thread runs `Engine.step()` while there is work and hands each request's events to its
handler's queue. A bad request gets a 4xx JSON error in OpenAI's shape naming the field
(`error.param`). A client that disconnects has its request cancelled and its slot freed. SIGTERM:
uvicorn stops accepting connections and lets running requests finish for up to --drain-timeout
seconds; what is left is cancelled and the process exits.
"""


# No `from __future__ import annotations`: FastAPI reads the handlers' `Request` annotation at
# run time, and that class is imported inside `create_app` (fastapi loads only for `serve`).
import argparse
import asyncio
import json
import threading
import time
import uuid
from typing import Any

from spec_jax.app import inputs
from spec_jax.app.common import add_drafter_arg, add_target_args, drafter_spec_from_args, log

HELP = "serve an OpenAI-compatible HTTP API (completions, chat, streaming) with continuous batching"
MAX_STOP_STRINGS = 4
DISCONNECT_POLL_S = 0.25


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    add_drafter_arg(
        p,
        "Default: the drafter measured fastest for the default model at a batch of --slots, none "
        "for other targets.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--slots", type=int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most prompt + generated tokens per request (default min(1024, the model's positions))")
    p.add_argument("--chunk-steps", type=int, default=4,
                   help="verify steps between hand-outs (default 4; lower = smoother streams)")
    p.add_argument("--max-admits", type=int, default=None,
                   help="prefills between two chunks (default: every free slot; fewer = smoother running streams)")
    p.add_argument("--k-choices", default=None, metavar="0,2,4",
                   help="adaptive K: the drafter's K variants to choose from live (0 = plain decoding, ngram only)")
    p.add_argument("--served-model-name", default=None, help="the model id in /v1/models (default: the target)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before cancelling them (default 30)")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard over a device mesh")


# --------------------------------------------------------------------------- request checks
class RequestError(Exception):
    """A client mistake: HTTP status, message, and the field it is about (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, default: Any, minimum: float | None = None, maximum: float | None = None,
            integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        what = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {what}, got {json.dumps(value)}.", name)
    if value != value or value in (float("inf"), float("-inf")):
        raise RequestError(f"'{name}' must be a finite number, got {value}.", name)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise RequestError(f"'{name}' must be {bounds}, got {value}.", name)
    return value


class Parsed:
    """A checked request: prompt ids, the engine's values, and what the response needs."""

    def __init__(self, prompt_ids, engine_kwargs, stream, stop_strings, chat, include_usage):
        self.prompt_ids, self.engine_kwargs, self.stream = prompt_ids, engine_kwargs, stream
        self.stop_strings, self.chat, self.include_usage = stop_strings, chat, include_usage


def parse_request(body: Any, server: "ServerState", chat: bool) -> Parsed:
    """Check a /v1/completions or /v1/chat/completions body (OpenAI fields, plus top_k,
    ignore_eos and stop_token_ids as vLLM has them) -> Parsed; RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.", None)
    model = body.get("model")
    if model is not None and model not in server.model_names:
        raise RequestError(f"The model '{model}' does not exist; this server serves '{server.model_name}'.",
                           "model", status=404, code="model_not_found")
    tok = server.tokenizer
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise RequestError("'messages' is required: a list of {role, content} objects.", "messages")
        if (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise RequestError("'messages' must be a non-empty list of objects whose 'role' and 'content' "
                               "are strings.", "messages")
        try:
            from spec_jax.checkpoints import apply_chat_template

            prompt_ids = apply_chat_template(tok, [{"role": m["role"], "content": m["content"]} for m in messages],
                                             server.chat_template)
        except Exception as e:  # a template that refuses these roles, or no template at all
            raise RequestError(f"'messages' could not be formatted with the chat template: {e}", "messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if prompt is None:
            raise RequestError("'prompt' is required: a string or a list of token ids.", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' is empty.", "prompt")
            prompt_ids = list(tok.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt per "
                               "request).", "prompt")
        if body.get("echo"):
            raise RequestError("'echo' is not supported.", "echo")
    vocab = server.engine.model.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise RequestError(f"'prompt' holds token ids outside the vocabulary [0, {vocab}).", "prompt")
    if not prompt_ids:
        raise RequestError("The prompt encodes to no tokens.", "messages" if chat else "prompt")
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}.", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise RequestError("'logprobs' is not supported.", "logprobs")
    limit = server.engine.max_model_len
    room = limit - len(prompt_ids)
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default_max = room if chat else 16
    max_tokens = _number(body, max_name, default_max, minimum=1, integer=True)
    if len(prompt_ids) + max_tokens > limit:
        raise RequestError(
            f"The prompt's {len(prompt_ids)} tokens + '{max_name}' {max_tokens} = {len(prompt_ids) + max_tokens} "
            f"exceeds the model length {limit} (--max-model-len); shorten the prompt or lower '{max_name}'"
            + (f" to {room} or less." if room >= 1 else "."),
            max_name,
        )
    temperature = _number(body, "temperature", 1.0, minimum=0.0, maximum=2.0)
    top_p = _number(body, "top_p", 1.0, minimum=0.0, maximum=1.0)
    if top_p == 0:
        raise RequestError("'top_p' must be in (0, 1], got 0.", "top_p")
    top_k = _number(body, "top_k", 0, integer=True)
    if top_k < 0:
        top_k = 0 if top_k == -1 else _number(body, "top_k", 0, minimum=0, integer=True)  # vLLM's -1 = off
    seed = _number(body, "seed", 0, minimum=0, maximum=2**32 - 1, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {json.dumps(stream)}.", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object.", "stream_options")
    stop = body.get("stop")
    stop_strings = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop_strings, list) or not all(isinstance(s, str) and s for s in stop_strings) \
            or len(stop_strings) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them.", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids)):
        raise RequestError("'stop_token_ids' must be a list of token ids.", "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("'ignore_eos' must be true or false.", "ignore_eos")
    stop_ids = None
    if stop_token_ids:
        stop_ids = list(stop_token_ids) + ([] if ignore_eos else list(server.engine.default_stop_ids))
    kwargs = dict(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  stop_ids=stop_ids, ignore_eos=ignore_eos and not stop_token_ids)
    try:
        params = server.engine.check_request(prompt_ids, **kwargs)
    except ValueError as e:  # what the engine checks beyond the above (too many stop ids, ...)
        message = str(e)
        param = next((p for p in ("stop", "temperature", "top_k", "top_p", "seed") if p in message), None)
        raise RequestError(message, param or ("stop_token_ids" if "stop ids" in message else None)) from None
    return Parsed(prompt_ids, params, stream, stop_strings, chat, bool(stream_options.get("include_usage", True)))


# --------------------------------------------------------------------------- the engine thread
class EngineRunner:
    """Runs the engine on its own thread and routes each request's events to the asyncio queue
    of the handler waiting for them."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="spec-jax-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, params) -> tuple[int, asyncio.Queue]:
        if self.stopping:
            raise RequestError("The server is shutting down.", None, status=503)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        with self.lock:  # registered before the engine thread can hand out its first event
            rid = self.engine.submit(params.prompt_ids, params=params)
            self.queues[rid] = (loop, queue)
        self.wake.set()
        return rid, queue

    def cancel(self, rid: int) -> None:
        with self.lock:
            if rid in self.queues:
                self.engine.cancel(rid)
        self.wake.set()

    def _dispatch(self, events) -> None:
        with self.lock:
            for event in events:
                target = self.queues.get(event.request_id)
                if event.finish_reason is not None:
                    self.queues.pop(event.request_id, None)
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, event)

    def _run(self) -> None:
        while not self.stopping or self.engine.has_work():
            if not self.engine.has_work():
                self.wake.wait(0.1)
                self.wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # a failing step must not hang every client: fail them all
                log(f"engine step failed: {type(e).__name__}: {e}")
                self.error = f"{type(e).__name__}: {e}"
                with self.lock:
                    for loop, queue in self.queues.values():
                        loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(self.error))
                    self.queues.clear()
                return
            self._dispatch(events)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel whatever is left, hand out the cancellations, end the thread."""
        self.stopping = True
        with self.lock:
            for rid in list(self.queues):
                self.engine.cancel(rid)
        self.wake.set()
        self.thread.join(timeout)


# --------------------------------------------------------------------------- the app
class ServerState:
    def __init__(self, engine, tokenizer, chat_template, model_name, drafter_label):
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.model_name, self.drafter_label = model_name, drafter_label
        self.model_names = {model_name}
        self.runner = EngineRunner(engine)
        self.created = int(time.time())


class _Output:
    """A request's text so far: incremental detokenization, stop strings held back until they
    can no longer begin one."""

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
        """Text to send now for these new ids."""
        self.token_ids += ids
        self.text += self.detok.push(ids) + (self.detok.flush() if final else "")
        for s in self.stop_strings:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.stopped, final = self.text[:at], True, True
        upto = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent : upto], upto
        return piece


def create_app(state: ServerState):
    """The FastAPI app over a `ServerState` (its runner is started and stopped by the app's
    lifespan)."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.runner.start()
        yield
        # uvicorn has drained the connections it could (--drain-timeout); cancel the rest.
        await asyncio.get_running_loop().run_in_executor(None, state.runner.stop)

    app = FastAPI(title="spec-jax", lifespan=lifespan)

    def error(e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health():
        engine = state.engine
        status = "error" if state.runner.error else ("draining" if state.runner.stopping else "ok")
        body = {"status": status, "slots": engine.slots, "running": engine.num_live,
                "waiting": len(engine.waiting), "model": state.model_name, "drafter": state.drafter_label}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "spec-jax",
            "max_model_len": state.engine.max_model_len,
        }]}

    async def handle(request: Request, chat: bool):
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"The request body is not valid JSON ({e}).", None) from None
            parsed = parse_request(body, state, chat)
            rid, queue = state.runner.submit(parsed.engine_kwargs)
        except RequestError as e:
            return error(e)
        kind = "chat.completion" if chat else "text_completion"
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        output = _Output(state.tokenizer, parsed.stop_strings)

        def usage(stats) -> dict[str, Any]:
            completion = len(output.token_ids)
            return {"prompt_tokens": len(parsed.prompt_ids), "completion_tokens": completion,
                    "total_tokens": len(parsed.prompt_ids) + completion}

        def speculative(stats) -> dict[str, Any]:
            if stats is None:
                return {"steps": 0, "drafted": 0, "accepted": 0, "tau": 0.0}
            return {"steps": stats.steps, "drafted": stats.drafted, "accepted": stats.accepted,
                    "tau": round(stats.tau, 4)}

        async def next_event():
            """The request's next event; None when the client went away (the request is cancelled)."""
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        state.runner.cancel(rid)
                        return None
                    continue
                if isinstance(event, Exception):
                    raise event
                return event

        def finish_of(event) -> str | None:
            if output.stopped:
                return "stop"
            return event.finish_reason

        if not parsed.stream:
            stats, reason = None, None
            try:
                while reason is None:
                    event = await next_event()
                    if event is None:
                        return JSONResponse({}, status_code=499)
                    output.push(event.new_ids, event.finish_reason is not None)
                    if output.stopped and event.finish_reason is None:
                        state.runner.cancel(rid)  # a stop string: no need for more tokens
                    stats, reason = event.stats, finish_of(event) if event.finish_reason else None
            except RuntimeError as e:
                return error(RequestError(f"generation failed: {e}", None, status=500))
            text = output.text
            choice = {"index": 0, "finish_reason": reason, "logprobs": None,
                      "token_ids": output.token_ids}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {"id": response_id, "object": kind, "created": created, "model": state.model_name,
                    "choices": [choice], "usage": usage(stats), "speculative": speculative(stats)}

        def chunk(piece: str | None, reason: str | None, extra: dict | None = None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
            body = {"id": response_id, "object": "chat.completion.chunk" if chat else kind,
                    "created": created, "model": state.model_name, "choices": [choice], **(extra or {})}
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            finished = False
            try:
                if chat:
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                            "logprobs": None}
                    yield f"data: {json.dumps({'id': response_id, 'object': 'chat.completion.chunk', 'created': created, 'model': state.model_name, 'choices': [role]})}\n\n"
                while True:
                    try:
                        event = await next_event()
                    except RuntimeError as e:
                        yield f"data: {json.dumps(RequestError(f'generation failed: {e}', None, 500).body())}\n\n"
                        break
                    if event is None:
                        return  # the client is gone
                    done = event.finish_reason is not None
                    piece = output.push(event.new_ids, done)
                    if output.stopped and not done:
                        state.runner.cancel(rid)
                    if piece:
                        yield chunk(piece, None)
                    if done:
                        finished = True
                        extra = {"speculative": speculative(event.stats)}
                        if parsed.include_usage:
                            extra["usage"] = usage(event.stats)
                        yield chunk(None if chat else "", finish_of(event), extra)
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client disconnected mid-stream (or the server is stopping)
                    state.runner.cancel(rid)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


# --------------------------------------------------------------------------- the command
def build_state(args: argparse.Namespace) -> ServerState:
    from spec_jax.decoding.engine import Engine

    if not 0 <= args.port <= 65535:
        raise inputs.UsageError(f"--port must be in 0..65535, got {args.port}.")
    if args.slots < 1:
        raise inputs.UsageError(f"--slots must be >= 1, got {args.slots}.")
    if args.max_admits is not None and args.max_admits < 1:
        raise inputs.UsageError(f"--max-admits must be >= 1, got {args.max_admits}.")
    if args.chunk_steps < 1:
        raise inputs.UsageError(f"--chunk-steps must be >= 1, got {args.chunk_steps}.")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise inputs.UsageError(f"--max-model-len must be >= 2, got {args.max_model_len}.")
    k_choices = None
    if args.k_choices:
        try:
            k_choices = [int(x) for x in args.k_choices.split(",") if x.strip()]
        except ValueError:
            k_choices = []
        if not k_choices or min(k_choices) < 0:
            raise inputs.UsageError(f"--k-choices {args.k_choices!r} must be a comma list of K >= 0, e.g. 0,2,4.")
    spec = drafter_spec_from_args(args, (), batch=args.slots)
    t0 = time.perf_counter()
    target = inputs.load_target_or_fail(args.target, args.dtype)
    if target.tokenizer is None:
        raise inputs.UsageError(f"{target.source} ships no tokenizer; serve needs one to read text prompts.")
    log(f"loaded {target.source} in {time.perf_counter() - t0:.1f}s")
    drafter, drafter_params = inputs.build_drafter(spec, target)
    mesh = inputs.mesh_kwargs(args.mesh, target).get("mesh")
    engine = Engine(target, drafter, drafter_params, slots=args.slots, max_model_len=args.max_model_len,
                    chunk_steps=args.chunk_steps, k_choices=k_choices, max_admits_per_step=args.max_admits,
                    mesh=mesh)
    t0 = time.perf_counter()
    engine.warmup()
    label = spec.label if spec.kind != "none" else "none"
    log(f"engine: {args.slots} slots, max model length {engine.max_model_len}, drafter {label} "
        f"K={'adaptive ' + str(sorted(engine.drafters)) if engine.adaptive else engine.k}"
        f"{' (' + spec.reason + ')' if spec.reason else ''}; {engine.compiles} programs compiled in "
        f"{time.perf_counter() - t0:.1f}s")
    name = args.served_model_name or (target.source if args.target is None else args.target)
    return ServerState(engine, target.tokenizer, target.chat_template, name, label)


def run(args: argparse.Namespace) -> None:
    import socket

    import uvicorn

    state = build_state(args)
    # Bind first, so that --port 0 can report the port it got (tests and scripts read this line).
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise inputs.UsageError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); pick another --port.") from None
    sock.listen(2048)  # connections made from now on wait in the backlog until uvicorn accepts them
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(state), log_level="warning",
                            timeout_graceful_shutdown=args.drain_timeout)
    log(f"serving {state.model_name} on http://{host}:{port} (OpenAI API at /v1)")
    _server_class()(config).run(sockets=[sock])
    log("stopped")
    return None


def _server_class():
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGTERM/SIGINT end it with exit status 0 once it has
        drained (uvicorn re-raises the signal after shutdown, so the process would die by it)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            signals = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in signals}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log(f"{signal.Signals(sig).name}: not accepting new requests; draining running ones "
                    f"(up to {self.config.timeout_graceful_shutdown:g}s)")
            super().handle_exit(sig, frame)

    return Server
