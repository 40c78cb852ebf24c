"""Overload of `spec-jax serve` on loopback (issue 45): C clients at once against S slots and a
queue of Q (`--max-queued-requests`).

The server runs in this process as `spec-jax serve` builds it (the engine behind uvicorn on
127.0.0.1, an ephemeral port; --max-logprobs 20, the command's default). All C clients post one
non-streamed completion each at the same moment (a barrier). Reported: how many got 200 and how
many 429 (with Retry-After), whether every 200 carries all its tokens, the 429s' and the 200s'
latency p50/p99, /health while loaded and after, the queue back at 0, and what /metrics (read by
prometheus_client's parser) counted. Then the cost of logprobs: S concurrent requests asking for
top-5 logprobs and S asking for none, alternated, wall time of each round.

    python benchmarks/serve_overload.py --clients 64 --slots 8 --max-queued 16
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

import numpy as np


def post(port: int, body: dict) -> tuple[int, str | None, dict, float]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return resp.status, resp.getheader("retry-after"), out, time.perf_counter() - t0


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def at_once(port: int, bodies: list[dict]) -> tuple[list, float]:
    """Post every body from its own thread, all released together -> (results, wall seconds)."""
    barrier, results, lock = threading.Barrier(len(bodies) + 1), [], threading.Lock()

    def client(body):
        barrier.wait()
        r = post(port, body)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=client, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def ms(values, q):
    return round(1e3 * float(np.percentile(values, q)), 1) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--drafter", default="ngram", help="none or a --drafter KIND without weights")
    p.add_argument("--logprob-rounds", type=int, default=2)
    args = p.parse_args()

    from load_test import start_server  # benchmarks/ is on the path of a script run from it
    from prometheus_client.parser import text_string_to_metric_families

    from spec_jax.app.inputs import build_drafter, parse_drafter_spec
    from spec_jax.app.openai_api import ServerState
    from spec_jax.checkpoints import load_target
    from spec_jax.decoding.engine import Engine

    target = load_target(None, dtype="float32")
    drafter, params = (None, None) if args.drafter == "none" else build_drafter(parse_drafter_spec(args.drafter),
                                                                               target)
    engine = Engine(target, drafter, params, slots=args.slots, max_model_len=256, chunk_steps=4, max_logprobs=20)
    prompts = [f"Request {i}: write a haiku about the number {i}." for i in range(args.clients)]
    lengths = [len(target.tokenizer.encode(t)) for t in prompts]
    t0 = time.perf_counter()
    engine.warmup(lengths)
    print(f"warm-up {time.perf_counter() - t0:.1f}s", flush=True)
    state = ServerState(engine, target.tokenizer, target.chat_template, "default", args.drafter,
                        max_queued=args.max_queued)
    server, thread, port = start_server(state)

    health, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            t = time.perf_counter()
            status, _ = get(port, "/health")
            health.append((status, time.perf_counter() - t))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    bodies = [{"prompt": text, "max_tokens": args.max_tokens, "temperature": 0.8, "ignore_eos": True}
              for text in prompts]
    results, wall = at_once(port, bodies)
    stop.set()
    watcher.join()
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(get(port, "/metrics")[1].decode()) for s in f.samples}
    row = {
        "clients": args.clients, "slots": args.slots, "max_queued": args.max_queued, "drafter": args.drafter,
        "ok": len(ok), "429": len(rejected), "other": len(results) - len(ok) - len(rejected),
        "retry_after": sorted({r[1] for r in rejected}),
        "every_ok_complete": all(r[2]["usage"]["completion_tokens"] == args.max_tokens for r in ok),
        "ok_latency_p50_ms": ms([r[3] for r in ok], 50), "ok_latency_p99_ms": ms([r[3] for r in ok], 99),
        "429_latency_p50_ms": ms([r[3] for r in rejected], 50), "429_latency_p99_ms": ms([r[3] for r in rejected], 99),
        "wall_s": round(wall, 2),
        "health_during": f"{sum(s == 200 for s, _ in health)}/{len(health)} x 200, slowest "
                         f"{max((t for _, t in health), default=0) * 1e3:.0f} ms",
        "health_after": get(port, "/health")[0],
        "metrics": {
            "requests_rejected_total": metrics.get(("spec_jax_requests_rejected_total", ())),
            "requests_total_length": metrics.get(("spec_jax_requests_total", (("finish_reason", "length"),))),
            "generation_tokens_total": metrics.get(("spec_jax_generation_tokens_total", ())),
            "queue_depth": metrics.get(("spec_jax_queue_depth", ())),
            "slots_in_use": metrics.get(("spec_jax_slots_in_use", ())),
            "ttft_count": metrics.get(("spec_jax_time_to_first_token_seconds_count", ())),
        },
    }
    print(json.dumps(row), flush=True)

    # The cost of logprobs: `slots` requests at once, with top-5 logprobs and without, alternated.
    times = {"none": [], "top5": []}
    for _ in range(args.logprob_rounds):
        for label, extra in (("none", {}), ("top5", {"logprobs": 5})):
            round_bodies = [dict(b, **extra) for b in bodies[: args.slots]]
            results, wall = at_once(port, round_bodies)
            assert all(r[0] == 200 for r in results), [r[2] for r in results if r[0] != 200][:1]
            times[label].append(wall)
    print(json.dumps({"logprobs_cost": {k: [round(t, 2) for t in v] for k, v in times.items()},
                      "top5_over_none": round(statistics.fmean(times["top5"]) / statistics.fmean(times["none"]), 3)}),
          flush=True)
    server.should_exit = True
    thread.join(60)


if __name__ == "__main__":
    main()
