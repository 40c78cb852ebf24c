"""Hostile load on `spec-jax serve` (issue 42): many concurrent clients, some of them rude.

The server runs as its own process (`python -m spec_jax.app.main serve ... --port 0`, its log kept).
Each good request (greedy; completions and chat; streamed, non-streamed, read slowly, or with a
stop string taken from its answer) is first run alone on the idle server; then --clients threads
pick actions at random (seeded) for --duration seconds:

  stream / full / slow_reader / stop   good greedy requests: the text must equal the solo run's
                                       (cut before the stop for `stop`)
  sampled                              temperature 0.8: a 200 and an ending is all that is checked
  disconnect                           a stream closed after 1-4 events, or a request closed
                                       before its answer
  bad                                  a malformed or refused request: must get a 4xx
  idle                                 a connection that sends half a request line and waits

Checked and reported: every good answer equals its solo run, no 5xx, no traceback in the server's
log, the server's RSS (sampled each second) flat, /health's answer time under load, and the
process exits 0 on SIGTERM.

    python benchmarks/hostile_load.py                       # a tiny random model with a real tokenizer
    python benchmarks/hostile_load.py --target default      # the default model (SmolLM2-135M)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def is_prime(n):", "The quick brown fox", "for i in range(10):", "Café crème and", "Write a haiku about",
    "Once upon a time", "import numpy as np\n", "Explain recursion:", "The capital of France", "1, 2, 3, 4,",
    "Dear team,", "SELECT * FROM",
]
BAD = [  # (path, raw body): each must be refused with a 4xx
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": -1}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10**6}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 3}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "gpt-9"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["x"] * 9}).encode()),
    ("/v1/completions", json.dumps({"prompt": [1, 10**9]}).encode()),
    ("/v1/completions", json.dumps({"prompt": "word " * 20000}).encode()),  # far past --max-model-len
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}).encode()),
]


def connection(port: int, timeout: float = 120) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


def post(port: int, path: str, body: dict | bytes) -> tuple[int, dict]:
    conn = connection(port)
    conn.request("POST", path, body=body if isinstance(body, bytes) else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, {"raw": raw[:200].decode(errors="replace")}


def stream(port: int, path: str, body: dict, read_delay: float = 0.0, close_after: int | None = None):
    """-> (status, text, finish_reason, saw [DONE]); closes early after `close_after` events."""
    conn = connection(port)
    conn.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
        conn.close()
        return resp.status, "", None, False
    text, reason, done, events = [], None, False, 0
    for line in resp:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        event = json.loads(line[6:])
        if "error" in event:
            reason = "error: " + event["error"]["message"]
            continue
        choice = event["choices"][0]
        text.append(choice["delta"].get("content", "") if "delta" in choice else choice["text"])
        reason = choice["finish_reason"] or reason
        events += 1
        if close_after is not None and events >= close_after:
            conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
            break
        if read_delay:
            time.sleep(read_delay)
    conn.close()
    return 200, "".join(text), reason, done


def good_requests(max_tokens: list[int]) -> list[tuple[str, dict]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        n = max_tokens[i % len(max_tokens)]
        common = {"max_tokens": n, "temperature": 0}
        out.append(("/v1/completions", {"prompt": prompt, **common}))
        out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}))
    return out


def answer_text(path: str, body: dict) -> str:
    return body["choices"][0]["message"]["content"] if "chat" in path else body["choices"][0]["text"]


class Load:
    """The clients' shared record: counts per action and status, mismatches, 5xx answers."""

    def __init__(self, port: int, goods: list[tuple[str, dict]], solo: list[str], seed: int):
        self.port, self.goods, self.solo = port, goods, solo
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.counts: Counter = Counter()
        self.mismatches: list[dict] = []
        self.server_errors: list[dict] = []

    def note(self, action: str, status: int, detail: dict | None = None) -> None:
        with self.lock:
            self.counts[f"{action} {status}"] += 1
            if status >= 500:
                self.server_errors.append({"action": action, "status": status, **(detail or {})})

    def check(self, action: str, i: int, got: str, want: str, reason: str | None) -> None:
        if got != want or reason not in ("stop", "length"):
            with self.lock:
                self.mismatches.append({"action": action, "request": i, "got": got[:80], "want": want[:80],
                                        "finish_reason": reason})

    def pick(self) -> tuple[str, int]:
        with self.lock:
            action = self.rng.choices(["stream", "full", "slow_reader", "stop", "sampled", "disconnect", "bad", "idle"],
                                      weights=[22, 18, 8, 8, 5, 20, 16, 3])[0]
            return action, self.rng.randrange(len(self.goods))

    def run_one(self, action: str, i: int) -> None:
        path, body = self.goods[i]
        if action in ("stream", "slow_reader"):
            status, text, reason, done = stream(self.port, path, body, read_delay=0.05 if action == "slow_reader" else 0)
            self.note(action, status, {"reason": reason})
            if status == 200:
                self.check(action, i, text, self.solo[i], reason if done else "no [DONE]")
        elif action == "full":
            status, out = post(self.port, path, body)
            self.note(action, status, out)
            if status == 200:
                self.check(action, i, answer_text(path, out), self.solo[i], out["choices"][0]["finish_reason"])
        elif action == "stop":
            self.run_stop(i)
        elif action == "sampled":
            status, out = post(self.port, path, dict(body, temperature=0.8, seed=i))
            self.note(action, status, out)
        elif action == "disconnect":
            self.run_disconnect(path, body)
        elif action == "bad":
            bad_path, raw = BAD[i % len(BAD)]
            status, out = post(self.port, bad_path, raw)
            self.note("bad", status, out)
            if not 400 <= status < 500:
                with self.lock:
                    self.mismatches.append({"action": "bad", "request": bad_path, "status": status})
        else:
            self.run_idle()

    def run_stop(self, i: int) -> None:
        """A stop string from the middle of the solo answer: the answer must end right before it."""
        path, body = self.goods[i]
        want = self.solo[i]
        at = len(want) // 2
        stop = want[at : at + 3]
        if len(stop) < 3:
            return
        cut = want[: want.find(stop)]
        status, text, reason, done = stream(self.port, path, dict(body, stop=[stop]))
        self.note("stop", status, {"reason": reason})
        if status == 200:
            self.check("stop", i, text, cut, reason if done else "no [DONE]")

    def run_disconnect(self, path: str, body: dict) -> None:
        if self.rng.random() < 0.7:
            status, *_ = stream(self.port, path, dict(body, max_tokens=body["max_tokens"] * 2),
                                close_after=self.rng.randint(1, 4))
            self.note("disconnect", status)
            return
        sock = socket.create_connection(("127.0.0.1", self.port))  # a request closed before its answer
        data = json.dumps(body).encode()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(self.rng.uniform(0.0, 0.3))
        sock.close()
        self.note("disconnect", 0)

    def run_idle(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more for a while
        time.sleep(3.0)
        sock.close()
        self.note("idle", 0)


def sample_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) * 1024


def health_time(port: int, timeout: float) -> float:
    """Seconds `GET /health` takes to answer on 127.0.0.1:port (inf when the connection fails)."""
    t0 = time.perf_counter()
    try:
        conn = connection(port, timeout=timeout)
        conn.request("GET", "/health")
        conn.getresponse().read()
        conn.close()
    except OSError:
        return float("inf")
    return time.perf_counter() - t0


def monitor(port: int, pid: int, stop: threading.Event, rss: list, health_s: list) -> None:
    """Each second: the server's RSS and how long /health takes to answer."""
    while not stop.is_set():
        rss.append((time.time(), sample_rss(pid)))
        health_s.append(health_time(port, timeout=30))
        stop.wait(1.0)


def start_server(args, workdir: Path) -> tuple[subprocess.Popen, int, Path]:
    if args.target == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from serving_testlib import save_tiny_target

        target = ["--target", str(save_tiny_target(workdir / "tiny")), "--dtype", "float32", "--drafter", "ngram"]
    else:
        target = [] if args.target == "default" else ["--target", args.target]
    log_path = workdir / "server.log"
    command = [sys.executable, "-m", "spec_jax.app.main", "serve", *target, "--port", "0", "--slots", str(args.slots), "--max-model-len", str(args.max_model_len),
               "--chunk-steps", str(args.chunk_steps), "--drain-timeout", "10"]
    log = open(log_path, "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen(command, stderr=log, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        match = re.search(r"http://127\.0\.0\.1:(\d+)", log_path.read_text())
        if match:
            return proc, int(match.group(1)), log_path
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log_path.read_text()[-3000:]}")


def run(args, port: int, pid: int) -> dict:
    goods = good_requests(args.max_tokens)
    t0 = time.perf_counter()
    solo = []
    for path, body in goods:  # each good request alone on the idle server
        status, out = post(port, path, body)
        assert status == 200, out
        solo.append(answer_text(path, out))
    solo_s = time.perf_counter() - t0
    load = Load(port, goods, solo, args.seed)
    stop, rss, health_s = threading.Event(), [], []
    watcher = threading.Thread(target=monitor, args=(port, pid, stop, rss, health_s), daemon=True)
    watcher.start()
    deadline = time.time() + args.duration

    def client():
        while time.time() < deadline:
            load.run_one(*load.pick())

    t0 = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(args.clients)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    return summarize(load, rss, health_s, wall, solo_s)


def summarize(load: Load, rss: list, health_s: list, wall: float, solo_s: float) -> dict:
    mb = [r / 2**20 for _, r in rss]
    third = max(1, len(mb) // 3)
    actions = Counter()
    for key, n in load.counts.items():
        actions[key.split()[0]] += n
    finite = sorted(h for h in health_s if h != float("inf"))
    return {
        "requests": sum(load.counts.values()), "by_action": dict(sorted(actions.items())),
        "by_action_status": dict(sorted(load.counts.items())), "wall_s": round(wall, 1), "solo_runs_s": round(solo_s, 1),
        "mismatches": load.mismatches, "server_errors_5xx": load.server_errors,
        "rss_mb": {"first": round(mb[0], 1), "max": round(max(mb), 1), "last": round(mb[-1], 1),
                   "mean_first_third": round(sum(mb[:third]) / third, 1),
                   "mean_last_third": round(sum(mb[-third:]) / third, 1), "samples": len(mb)},
        "health_s": {"samples": len(health_s), "p50": round(finite[len(finite) // 2], 4) if finite else None,
                     "max": round(max(health_s), 4) if health_s else None},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="tiny", help="tiny (random, a real BPE tokenizer), default, or a path")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--chunk-steps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[16, 32, 48])
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a JSON file for the report")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, log_path = start_server(args, Path(tmp))
        try:
            report = run(args, port, proc.pid)
            proc.send_signal(signal.SIGTERM)
            report["exit_status"] = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
        log = log_path.read_text()
    report["tracebacks_in_log"] = log.count("Traceback")
    report["log_errors"] = [line for line in log.splitlines() if "ERROR" in line or "Error" in line][:20]
    report["args"] = vars(args)
    report["ok"] = (not report["mismatches"] and not report["server_errors_5xx"] and not report["tracebacks_in_log"]
                    and report["exit_status"] == 0)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
