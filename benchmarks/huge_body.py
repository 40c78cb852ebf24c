"""Huge request bodies against a `spec-jax serve` process (issue 42, finding 2).

The server runs as its own process (a tiny random model with a real BPE tokenizer, as in
benchmarks/hostile_load.py). For each body below, a greedy stream is started, the body is sent,
and the script records the body's answer and time, the stream's longest gap between two events
while the body was being sent and answered, /health's slowest answer (polled every 50 ms) and the
server's RSS (before, highest, one second after):

  20 MB, Content-Length     {"prompt": "word word ..."}
  20 MB, chunked            the same without a Content-Length (the server sees its size as it comes)
  100 MB, unknown field     {"prompt": "hi", "junk": "word word ..."}

    python benchmarks/huge_body.py                         # this checkout's server
    python benchmarks/huge_body.py --root /tmp/old --bodies 20mb   # another checkout's server
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_load  # noqa: E402  (the server's start-up and RSS sampling)

MIB = 2**20
BODIES = {  # name: (size in MiB, chunked, the JSON field that holds the bulk)
    "20mb": (20, False, "prompt"), "20mb-chunked": (20, True, "prompt"), "100mb-unknown-field": (100, False, "junk"),
}


def send_body(port: int, size_mb: int, chunked: bool, field: str, timeout: float) -> tuple[int | str, float]:
    """POST a body of `size_mb` MiB in 1 MiB pieces -> (status or the error, seconds to the answer)."""
    head = (b'{"prompt": "hi", "junk": "' if field == "junk" else b'{"prompt": "')
    piece, tail = b"word " * (MIB // 5), b'"}'
    parts = [head] + [piece] * ((size_mb * MIB - len(head) - len(tail)) // len(piece)) + [tail]
    t0 = time.perf_counter()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % sum(map(len, parts))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + framing + b"\r\n\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for part in parts:
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.read()
        sock.close()
        return response.status, time.perf_counter() - t0
    except OSError as e:
        return type(e).__name__, time.perf_counter() - t0


def watch(port: int, pid: int, stop: threading.Event, arrivals: list, health_s: list, rss: list, max_tokens: int):
    """A greedy stream (event arrival times), /health every 50 ms, the server's RSS."""

    def stream():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
             "stream": True}))
        for line in conn.getresponse():
            if line.startswith(b"data: "):
                arrivals.append(time.perf_counter())
            if stop.is_set():
                break
        conn.close()

    def health():
        while not stop.is_set():
            health_s.append(hostile_load.health_time(port, timeout=600))
            rss.append(hostile_load.sample_rss(pid))
            stop.wait(0.05)

    threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=health, daemon=True)]
    for t in threads:
        t.start()
    return threads


def measure(port: int, pid: int, name: str, args) -> dict:
    size_mb, chunked, field = BODIES[name]
    stop, arrivals, health_s, rss = threading.Event(), [], [], []
    threads = watch(port, pid, stop, arrivals, health_s, rss, args.max_model_len - 8)
    while len(arrivals) < 3:
        time.sleep(0.01)
    rss_before = hostile_load.sample_rss(pid)
    t0 = time.perf_counter()
    status, seconds = send_body(port, size_mb, chunked, field, args.timeout)
    t1 = time.perf_counter()
    time.sleep(1.0)
    rss_after = hostile_load.sample_rss(pid)
    stop.set()
    for t in threads:
        t.join(args.timeout)
    during = [t for t in arrivals if t0 <= t <= t1] or [t0, t1]
    gaps = [b - a for a, b in zip([t0] + during, during + [t1])]
    return {"body": name, "status": status, "answer_s": round(seconds, 2), "stream_longest_gap_s": round(max(gaps), 3),
            "health_slowest_s": round(max(health_s), 3), "rss_before_mb": round(rss_before / MIB),
            "rss_peak_mb": round(max(rss + [rss_after]) / MIB), "rss_after_mb": round(rss_after / MIB)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(hostile_load.ROOT), help="the checkout whose server runs")
    p.add_argument("--bodies", nargs="+", default=list(BODIES), choices=list(BODIES))
    p.add_argument("--max-model-len", type=int, default=480)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for an answer")
    p.add_argument("--out", default=None, help="a JSON file for the report")
    args = p.parse_args()
    hostile_load.ROOT = Path(args.root)  # start_server runs the server from this checkout
    server_args = argparse.Namespace(target="tiny", slots=4, max_model_len=args.max_model_len, chunk_steps=2,
                                     start_timeout=600.0)
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, log_path = hostile_load.start_server(server_args, Path(tmp))
        try:
            results = [measure(port, proc.pid, name, args) for name in args.bodies]
        finally:
            proc.send_signal(signal.SIGTERM)
            exit_status = proc.wait(120)
        report = {"root": args.root, "results": results, "exit_status": exit_status,
                  "tracebacks_in_log": log_path.read_text().count("Traceback")}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
