"""What one HTTP client can hold of `spec-jax serve`, and the options that bound it.

  - `HttpLimits`: request body and header sizes, read and keep-alive timeouts, the connection
    cap (`add_arguments` adds them to `serve`, `from_args` checks them before anything loads);
  - `bind`: the server's socket, bound before the model loads, so that a bad `--host` or a busy
    `--port` is said at once;
  - `uvicorn_config`: uvicorn on h11 with `protocol_class(limits)`, a protocol that closes a
    connection whose request does not arrive within `--read-timeout` (idle and slow-loris
    clients), answers past `--max-connections` with a 503, and gives its own 400s in OpenAI's
    error shape (`error_body`, which the API's errors use too).

Nothing here imports uvicorn, h11 or pydantic at import time: `spec-jax --help` stays light.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import socket
from typing import Any

from spec_jax.app.inputs import UsageError

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """max_body_bytes: a larger request body is refused with 413 (from Content-Length, or once
    that many bytes have arrived); max_header_bytes: larger request headers get a 431 (a 400
    while they arrive); read_timeout_s: a request's head and body must arrive within this many
    seconds of its first byte (of the connection's opening, for a new connection), else the
    connection is closed; keep_alive_s: an idle connection between requests is closed after this
    long; max_connections: a request on a connection past this many open ones gets a 503."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = 16 * 1024
    read_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = HttpLimits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"a larger request body gets 413 (default {d.max_body_bytes}, 8 MiB)")
    p.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help=f"larger request headers get 431 (default {d.max_header_bytes})")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout_s,
                   help="seconds a request's head and body may take to arrive; a slower or idle new "
                   f"connection is closed (default {d.read_timeout_s:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_s,
                   help=f"seconds an idle connection is kept between requests (default {d.keep_alive_s:g})")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open connections served at once; a request past them gets 503 (default {d.max_connections})")


def check_seconds(flag: str, value: float, allow_zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{flag} must be a number of seconds {'>= 0' if allow_zero else '> 0'}, got {value:g}.")
    return value


def check_count(flag: str, value: int, minimum: int) -> int:
    if value < minimum:
        raise UsageError(f"{flag} must be an integer >= {minimum}, got {value}.")
    return value


def from_args(args: argparse.Namespace) -> HttpLimits:
    """The limits from `serve`'s options, checked (UsageError naming the option)."""
    return HttpLimits(
        max_body_bytes=check_count("--max-body-bytes", args.max_body_bytes, 1024),
        max_header_bytes=check_count("--max-header-bytes", args.max_header_bytes, 1024),
        read_timeout_s=check_seconds("--read-timeout", args.read_timeout),
        keep_alive_s=check_seconds("--keep-alive-timeout", args.keep_alive_timeout),
        max_connections=check_count("--max-connections", args.max_connections, 1),
    )


# --------------------------------------------------------------------------- the socket
def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening: connections are refused until the
    server is ready); UsageError naming --host or --port."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host!r} is not an address this machine can listen on ({e}); pass "
                         "127.0.0.1, 0.0.0.0 (every address) or one of this machine's addresses.") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise bind_error(host, port, e) from None
    return sock


def bind_error(host: str, port: int, error: OSError) -> UsageError:
    """The user's fix for a failed bind or listen."""
    if error.errno == errno.EADDRINUSE:
        return UsageError(f"--port {port} is in use on {host} (another server listens there); pick another "
                          "--port, or 0 for a free one.")
    if error.errno == errno.EADDRNOTAVAIL:
        return UsageError(f"--host {host!r} is not an address of this machine; pass 127.0.0.1, 0.0.0.0 "
                          "(every address) or one of its addresses.")
    if error.errno == errno.EACCES:
        return UsageError(f"--port {port} needs privileges on this machine (ports below 1024 do); pick one >= 1024.")
    return UsageError(f"cannot listen on {host}:{port} ({error.strerror}); pick another --host or --port.")


# --------------------------------------------------------------------------- uvicorn
def uvicorn_config(app: Any, limits: HttpLimits, **kwargs: Any):
    """uvicorn's Config for `app` under `limits` (kwargs: uvicorn's other settings)."""
    import uvicorn

    return uvicorn.Config(app, http=protocol_class(limits), timeout_keep_alive=limits.keep_alive_s,
                          h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)


def _json_bytes(message: str, status: int) -> bytes:
    return json.dumps(error_body(message, status)).encode()


def _guarded(app: Any, connections: set, limits: HttpLimits) -> Any:
    """`app`, answering in OpenAI's shape a request on a connection past the cap (503; uvicorn's
    own cap answers in plain text) and a head over `max_header_bytes` (431; h11 bounds only a
    head still arriving)."""

    async def refuse(send, status: int, message: str) -> None:
        body = _json_bytes(message, status)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")] + ([(b"retry-after", b"1")] if status == 503 else [])})
        await send({"type": "http.response.body", "body": body})

    async def guarded_app(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        if len(connections) > limits.max_connections:
            return await refuse(send, 503, f"The server has its most open connections ({limits.max_connections}, "
                                "--max-connections); retry shortly, or reuse a connection.")
        head = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        if head > limits.max_header_bytes:
            return await refuse(send, 431, f"The request's headers are {head} bytes, more than this server takes "
                                f"({limits.max_header_bytes}, --max-header-bytes).")
        return await app(scope, receive, send)

    return guarded_app


def protocol_class(limits: HttpLimits) -> type:
    """uvicorn's h11 protocol with a read deadline per request and the connection cap."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.app = _guarded(self.app, self.connections, limits)
            self.read_deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()  # a new connection owes its first request within the read timeout

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Armed from a request's first byte until its last: neither an idle nor a trickling
            # client holds the connection past the deadline (h11 has none of its own).
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.read_deadline is None:
                self.read_deadline = self.loop.call_later(limits.read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self.read_deadline is not None:
                self.read_deadline.cancel()
                self.read_deadline = None

        def _read_timed_out(self) -> None:
            self.read_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = _json_bytes(f"{msg} (a malformed request, or a head over {limits.max_header_bytes} bytes, "
                               "--max-header-bytes)", 400)
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return LimitedH11Protocol
