"""`spec-jax serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine.

    spec-jax serve                                  # the default model on 127.0.0.1:8000
    spec-jax serve --target random:llama-3.2-1b --drafter ngram --slots 16 --port 9000
    curl -N localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (`"stream": true` sends server-sent
events ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus). Every
response carries usage counts and the request's speculative stats (`speculative`: steps, drafted,
accepted, tau). A request may ask for n choices, logprobs / top_logprobs (the target's, see
`spec_jax.decoding.logprobs`) and a seed (the same tokens whatever runs beside it); past
--max-queued-requests requests waiting for a slot to free up, a new one gets 429 with Retry-After.

One engine thread runs `Engine.step()`'s two halves while there is work (`admit()`, whose first
tokens it hands out before `decode()` runs the chunk) and hands each request's events to its
handler's queue. A bad request gets a 4xx JSON error in OpenAI's shape naming the field
(`error.param`). A client that disconnects has its request cancelled and its slot freed. SIGTERM:
uvicorn stops accepting connections, new requests get 503, running ones may finish for up to
--drain-timeout seconds; then each is ended in OpenAI's shape (a stream's last chunk, finish
reason "cancelled", and [DONE]; a JSON 503) and the process exits 0. An engine failure fails every
request in flight, answers 503 to the rest, and exits with status 1 (EXIT_ENGINE_FAILED).

This module is the command; the API itself (request models, handlers, the engine thread) is
`spec_jax.app.openai_api`, loaded only when the server starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from typing import TYPE_CHECKING

from spec_jax.app import http_limits, inputs
from spec_jax.app.common import add_drafter_arg, add_target_args, drafter_spec_from_args, log

MAX_LOGPROBS = 20  # as the engine's bound (spec_jax.decoding.engine.MAX_LOGPROBS; not imported: --help stays light)
DEFAULT_PREFILL_ROWS = 4  # as spec_jax.decoding.prefill_plan's (not imported: --help stays light)
PAGE_SIZE = 128  # as spec_jax.models.paged's (not imported: --help stays light)
MIN_PREFILL_CHUNK = 16  # the smallest prompt bucket (spec_jax.decoding.generate.MIN_PROMPT_BUCKET)
EXIT_ENGINE_FAILED = 1  # the process's status after an engine failure (a supervisor restarts it)
END_GRACE_S = 5.0  # past --drain-timeout: time for the ended requests to write their last bytes

if TYPE_CHECKING:  # the server's state, for annotations only (--help stays light)
    from spec_jax.app.openai_api import ServerState

HELP = "serve an OpenAI-compatible HTTP API (completions, chat, streaming) with continuous batching"


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
    p.add_argument("--prefill-chunk-tokens", type=int, default=None, metavar="N",
                   help="prefill waiting prompts in passes of at most N tokens between two chunks, several "
                   "prompts together and a long one over several steps, so running streams never wait longer "
                   "than one such pass (default: each prompt in one pass while running streams wait)")
    p.add_argument("--prefill-rows", type=int, default=DEFAULT_PREFILL_ROWS,
                   help=f"with --prefill-chunk-tokens: prompts prefilled together (default {DEFAULT_PREFILL_ROWS}; "
                   "each holds a row of the target's cache)")
    p.add_argument("--kv-pages", type=int, default=None, metavar="N",
                   help="keep the target's keys/values in a shared pool of N pages (of --kv-page-size slots) "
                   "that requests take as they grow and give back when they end, instead of a dense cache of "
                   "--max-model-len per slot: the same memory runs many more short requests; a request waits "
                   "until the pool covers it (default: dense). Size it as the KV memory you can spare / "
                   "(2 x layers x KV heads x head size x page size x dtype bytes)")
    p.add_argument("--kv-page-size", type=int, default=PAGE_SIZE, metavar="SLOTS",
                   help=f"with --kv-pages: slots per page, a divisor of 128 (default {PAGE_SIZE})")
    p.add_argument("--prefix-caching", action="store_true",
                   help="with --kv-pages: a prompt whose leading whole pages are already in the pool (the same "
                   "system prompt or chat history) shares them instead of prefilling them again (not for "
                   "drafters that read the target's hidden states, nor recurrent targets)")
    p.add_argument("--k-choices", default=None, metavar="0,2,4",
                   help="the depths --k adaptive chooses from each step (0 = a plain step; default 0, 2, "
                   "about K/2 and K)")
    p.add_argument("--suffix-store-tokens", type=int, default=None, metavar="N",
                   help="with a suffix drafter (suffix, KIND+suffix): tokens of earlier requests' prompts and "
                   "outputs it searches (default 16384; 4 bytes each, one store per server)")
    p.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests that may wait for a slot to free up (beyond the free slots); past them a new "
                   "one gets 429 with Retry-After (default: no bound)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most top tokens per position a request's logprobs / top_logprobs may ask for "
                   "(default 20; 0 = each token's own only; -1 = no logprobs, and no cost for them in the loop)")
    p.add_argument("--served-model-name", default=None, help="the model id in /v1/models (default: the target)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before cancelling them (default 30)")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M", help="shard over a device mesh")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every program requests can need before listening (default; the "
                   "persistent compilation cache makes a second start fast); --no-warmup compiles "
                   "each on the first request that needs it")
    http_limits.add_arguments(p)  # body and header sizes, read and keep-alive timeouts, connection cap


def create_app(state):
    """The FastAPI app (`spec_jax.app.openai_api.create_app`; fastapi loads only for `serve`)."""
    from spec_jax.app.openai_api import create_app as create

    return create(state)


# --------------------------------------------------------------------------- the command
def _cli_int(flag: str, value: int | None, minimum: int, maximum: int | None = None) -> None:
    """A flag's number by the library's one integer rule (`validation.check_int`); None = unset."""
    from spec_jax.decoding import validation

    if value is None:
        return
    try:
        validation.check_int(flag, value, minimum, validation.INT32_MAX if maximum is None else maximum)
    except ValueError as e:
        raise inputs.UsageError(str(e)) from None


def check_args(args: argparse.Namespace) -> list[int] | None:
    """The command's numbers, checked before anything loads -> the K choices (None: the drafter's K)."""
    _cli_int("--port", args.port, 0, 65535)
    _cli_int("--slots", args.slots, 1)
    _cli_int("--max-admits", args.max_admits, 1)
    _cli_int("--chunk-steps", args.chunk_steps, 1)
    _cli_int("--prefill-chunk-tokens", args.prefill_chunk_tokens, MIN_PREFILL_CHUNK)
    _cli_int("--prefill-rows", args.prefill_rows, 1)
    _cli_int("--kv-pages", args.kv_pages, 1)
    _cli_int("--kv-page-size", args.kv_page_size, 1, PAGE_SIZE)
    _cli_int("--max-model-len", args.max_model_len, 2)
    _cli_int("--max-queued-requests", args.max_queued_requests, 0)
    _cli_int("--max-logprobs", args.max_logprobs, -1, MAX_LOGPROBS)
    _cli_int("--suffix-store-tokens", args.suffix_store_tokens, 2)
    http_limits.check_seconds("--drain-timeout", args.drain_timeout, allow_zero=True)
    http_limits.from_args(args)
    if not args.k_choices:
        return None
    try:
        k_choices = [int(x) for x in args.k_choices.split(",") if x.strip()]
    except ValueError:
        k_choices = []
    if not k_choices or min(k_choices) < 0:
        raise inputs.UsageError(f"--k-choices {args.k_choices!r} must be a comma list of K >= 0, e.g. 0,2,4.")
    return k_choices


def build_state(args: argparse.Namespace) -> "ServerState":
    """Load the target and drafter, build the engine and compile its programs."""
    from spec_jax.app.openai_api import ServerState
    from spec_jax.decoding.depth import AdaptiveDepth
    from spec_jax.decoding.engine import Engine
    from spec_jax.drafters.suffix import store_of_size

    k_choices = check_args(args)
    # The engine does not run the adaptive depth on a mesh yet: there the default pins K.
    spec = drafter_spec_from_args(args, (), batch=args.slots, adaptive_ok=not args.mesh or args.k == "adaptive",
                                  engine=True)
    if k_choices is not None and spec.kind != "none":  # the adaptive policy's depths
        spec = dataclasses.replace(spec, adaptive=True)
    t0 = time.perf_counter()
    target = inputs.load_target_or_fail(args.target, args.dtype)
    if target.tokenizer is None:
        raise inputs.UsageError(f"{target.source} ships no tokenizer; serve needs one to read text prompts.")
    log(f"loaded {target.source} in {time.perf_counter() - t0:.1f}s")
    drafter, drafter_params = inputs.build_drafter(spec, target)
    if args.suffix_store_tokens is not None:
        try:
            drafter, drafter_params = store_of_size(drafter, drafter_params, args.suffix_store_tokens)
        except ValueError as e:
            raise inputs.UsageError(str(e)) from None
    mesh = inputs.mesh_kwargs(args.mesh, target).get("mesh")
    engine = Engine(target, drafter, drafter_params, slots=args.slots, max_model_len=args.max_model_len,
                    chunk_steps=args.chunk_steps, max_admits_per_step=args.max_admits,
                    k=None if not spec.adaptive else AdaptiveDepth(depths=tuple(k_choices) if k_choices else None),
                    mesh=mesh, max_logprobs=None if args.max_logprobs < 0 else args.max_logprobs,
                    prefill_chunk_tokens=args.prefill_chunk_tokens, prefill_rows=args.prefill_rows,
                    kv_pages=args.kv_pages, kv_page_size=args.kv_page_size, prefix_caching=args.prefix_caching)
    warm = engine.warmup() if args.warmup else None
    label = spec.label if spec.kind != "none" else "none"
    pages = "" if engine.pages is None else f", KV pool of {engine.pages.num_pages} pages of {engine.pages.page_size}"
    log(f"engine: {args.slots} slots{pages}, max model length {engine.max_model_len}, drafter {label} "
        f"K={'adaptive ' + str(list(engine.depth.depths)) if engine.depth else engine.k}"
        f"{' (' + (spec.brief or spec.reason) + '; the measurements: benchmarks/RESULTS.md)' if spec.reason else ''}; "
        + (f"warm-up {warm.summary()}" if warm is not None else "no warm-up: programs compile on first use"))
    name = args.served_model_name or (target.source if args.target is None else args.target)
    return ServerState(engine, target.tokenizer, target.chat_template, name, label, max_body_bytes=args.max_body_bytes,
                       max_queued=args.max_queued_requests)


def run(args: argparse.Namespace) -> None:
    check_args(args)
    # Bound before the model loads, so that a bad --host or a busy --port is said at once; it
    # listens once the model is ready (connections are refused until then).
    sock = http_limits.bind(args.host, args.port)
    try:
        state = build_state(args)
    except BaseException:
        sock.close()
        raise
    try:
        sock.listen(2048)  # connections made from now on wait in the backlog until uvicorn accepts them
    except OSError as e:  # another server took the port while the model loaded
        sock.close()
        raise http_limits.bind_error(args.host, args.port, e) from None
    host, port = sock.getsockname()[:2]
    # uvicorn's own timeout comes END_GRACE_S after ours, which ends each request in OpenAI's shape.
    config = http_limits.uvicorn_config(create_app(state), http_limits.from_args(args), log_level="warning",
                                        timeout_graceful_shutdown=args.drain_timeout + END_GRACE_S)
    log(f"serving {state.model_name} on http://{host}:{port} (OpenAI API at /v1)")
    _server_class()(config, state, args.drain_timeout).run(sockets=[sock])
    if state.runner.error:
        log(f"exiting with status {EXIT_ENGINE_FAILED} after an engine failure ({state.runner.error}), so that a "
            "supervisor restarts the server")
        raise SystemExit(EXIT_ENGINE_FAILED)
    log("stopped")
    return None


def _server_class():
    import asyncio
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGTERM/SIGINT end it with exit status 0 once it has
        drained (uvicorn re-raises the signal after shutdown, so the process would die by it);
        past `drain_timeout` the requests still running are ended in OpenAI's shape; an engine
        failure shuts it down."""

        def __init__(self, config, state, drain_timeout: float):
            super().__init__(config)
            self.state, self.drain_timeout = state, drain_timeout
            state.runner.on_failure = self.engine_failed

        def engine_failed(self) -> None:
            self.should_exit = True  # from the engine thread; uvicorn's loop polls it

        async def shutdown(self, sockets=None):
            self.state.runner.close()  # new requests get 503, /health says draining
            timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.end_running)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        def end_running(self) -> None:
            ended = self.state.runner.end_running()
            if ended:
                log(f"drain timeout ({self.drain_timeout:g}s) passed: ended {ended} running request(s)")

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
                engine = self.state.engine
                log(f"{signal.Signals(sig).name}: not accepting new requests; draining {engine.num_live} "
                    f"running and {len(engine.scheduler.waiting)} waiting (up to {self.drain_timeout:g}s)")
            super().handle_exit(sig, frame)

    return Server
