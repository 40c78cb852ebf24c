"""What JAX's persistent compilation cache saves the command line: `spec-jax generate` and `spec-jax
serve`, each started twice in fresh processes on one fresh cache directory (cold, then warm).

- generate: the compile seconds spec_jax counts (its programs, tracing included), the part that
  is XLA compiling (cold) or loading from the cache (warm), how many came from the cache (and how
  many of those were saved programs, loaded untraced), and the process's wall time;
- serve: from starting the process to the first token of one streamed chat request (loopback,
  one bounded request, then SIGTERM), and the warm-up's own line.

    python benchmarks/compile_cache.py                        # the default model, both commands
    python benchmarks/compile_cache.py --target random:tiny --only generate --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Write a Python function that checks whether a number is prime."
CLI = [sys.executable, "-m", "spec_jax.app.main"]


def run_generate(cache: str, target: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([*CLI, "generate", PROMPT, *target, "--json", "--compile-cache", cache],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"generate failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout)
    c = out["compilation"]
    return {"wall_s": wall, "compile_s": c["seconds"], "trace_s": c["trace_seconds"], "programs": c["programs"],
            "cache_hits": c["cache_hits"], "saved_hits": c.get("saved_hits", 0),
            "drafter": out["drafter"], "tokens": sum(len(r["generated_ids"]) for r in out["results"]),
            "tok_s": out["timing"]["tokens_per_second"], "ids": [r["generated_ids"] for r in out["results"]]}


def first_token_s(port: int) -> tuple[float, str]:
    """Send one streamed chat request -> (seconds until its first content event arrived, the text)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, text = None, ""
    for line in resp:  # read to the end: the request finishes before the server is stopped
        line = line.decode().strip()
        if line.startswith("data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content"):
                first = first if first is not None else time.perf_counter() - t0
                text += choices[0]["delta"]["content"]
    conn.close()
    return first, text


def run_serve(cache: str, target: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen([*CLI, "serve", *target, "--port", "0", "--host", "127.0.0.1", "--compile-cache", cache],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines: list[str] = []
    ready = threading.Event()

    def read_log():  # drains stderr for the life of the process
        for line in proc.stderr:
            lines.append(line)
            if "serving " in line:
                ready.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        deadline = time.perf_counter() + timeout
        while not ready.wait(1.0):
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise SystemExit("serve did not start (exited or timed out):\n" + "".join(lines[-20:]))
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        ready_s = time.perf_counter() - t0
        request_s, text = first_token_s(port)
        total = ready_s + request_s
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    warm = next((line.split("warm-up ", 1)[1].strip() for line in lines if "warm-up " in line), "?")
    return {"first_token_s": total, "listening_s": ready_s, "request_s": request_s, "warmup": warm, "text": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="as the CLI takes it (default: the default model)")
    ap.add_argument("--only", choices=["generate", "serve"], default=None)
    ap.add_argument("--runs", type=int, default=2, help="starts per command on the same cache (default 2)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per start")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    args = ap.parse_args()
    target = ["--target", args.target] if args.target else []
    rows: dict[str, list[dict]] = {}
    for command, run in (("generate", run_generate), ("serve", run_serve)):
        if args.only not in (None, command):
            continue
        with tempfile.TemporaryDirectory(prefix=f"spec_jax_cc_{command}_") as cache:
            rows[command] = [run(cache, target, args.timeout) for _ in range(args.runs)]
            print(f"{command}: {rows[command]}", file=sys.stderr, flush=True)
    show(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def show(rows: dict[str, list[dict]]) -> None:
    if "generate" in rows:
        first = rows["generate"][0]
        first_xla = first["compile_s"] - first["trace_s"]
        print("| generate | compile s | vs first | of it tracing s | XLA compile or load s | vs first | "
              "programs (from cache, of them untraced) | process wall s | tok/s | same tokens as first |"
              "\n|---|---|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(rows["generate"]):
            xla = r["compile_s"] - r["trace_s"]
            print(f"| start {i + 1} ({'cold' if i == 0 else 'warm'}) | {r['compile_s']:.1f} | "
                  f"{r['compile_s'] / first['compile_s']:.0%} | {r['trace_s']:.1f} | {xla:.1f} | {xla / first_xla:.0%} | "
                  f"{r['programs']} ({r['cache_hits']}, {r['saved_hits']}) | {r['wall_s']:.1f} | {r['tok_s']:.1f} | "
                  f"{r['ids'] == first['ids']} |")
    if "serve" in rows:
        first = rows["serve"][0]["first_token_s"]
        print("\n| serve | start to first token s | vs first | listening after s | warm-up | same text as first |"
              "\n|---|---|---|---|---|---|")
        for i, r in enumerate(rows["serve"]):
            print(f"| start {i + 1} ({'cold' if i == 0 else 'warm'}) | {r['first_token_s']:.1f} | "
                  f"{r['first_token_s'] / first:.0%} | {r['listening_s']:.1f} | {r['warmup']} | "
                  f"{r['text'] == rows['serve'][0]['text']} |")


if __name__ == "__main__":
    main()
