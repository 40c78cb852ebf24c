"""Load test of `spec-jax serve` on loopback: N concurrent streaming clients, mixed prompt and
answer lengths, with and without speculation.

For each concurrency N and each drafter, the server runs in this process (an engine with N slots
behind uvicorn on 127.0.0.1, an ephemeral port); N client threads stream chat completions
(HumanEval prompts, chat-formatted, greedy, max_tokens cycling over --max-tokens) until the
bounded request list is done. Reported per run: output tokens/s over the run, time to first token
(TTFT) p50/p99, inter-token latency (the gap between streamed events, ITL) p50/p99, and time per
output token after the first (TPOT) p50. A multi-token event (a step that accepted drafts) is one
gap, so ITL is per event and TPOT per token.

    python benchmarks/load_test.py --concurrency 1 4 16 --out benchmarks/results/load_test

--cache dense paged (the default) runs each drafter and concurrency twice: on the dense engine
(every slot holds a cache of --max-model-len tokens) and on the paged one (`kv_pages`: by default
the same cache bytes as the dense run, --kv-pages N to set a budget), and reports the pages in use
(the most at once, and after the run: 0 when every request gave its pages back). --workload agent
sends repeated coding-agent requests under one system prompt (benchmarks/suffix_speculation.py's),
the workload suffix speculation is for; humaneval (the default) mixes prompt lengths; chat sends the
general chat prompts (assets/chat_prompts.json).

    python benchmarks/load_test.py --concurrency 1 4 16 --drafters none adaptive --max-tokens 16 32

`--drafters default` is what `spec-jax serve` runs without --drafter: the measured drafter for
the engine's slots, each step picking its depth (issue 41's "never below 0.97x plain decoding"
bar); `--slots 8` keeps serve's default engine whatever the number of clients:

    python benchmarks/load_test.py --concurrency 1 8 16 --slots 8 --drafters none default --cache dense
    python benchmarks/load_test.py --concurrency 1 4 16 --drafters none suffix --workload agent

A named drafter as NAME@K runs with the adaptive depth, K its largest (`ngram@2`).

On a machine whose speed drifts, `--rounds R` runs the drafters side by side instead: per
concurrency, R rounds of each, the order reversed every other round, and prints the median of
each round's ratio to the first drafter's throughput:

    python benchmarks/load_test.py --concurrency 1 8 16 --slots 8 --drafters none default --cache dense --workload chat --rounds 4

--long-prompt-gap N measures instead what chunked prefill is for (issue 45): running streams'
longest gap between two hand-outs while one N-token prompt is admitted, in the engine itself (no
HTTP), for the one-pass admit and for each --prefill-chunk-tokens budget, on each --cache engine:

    python benchmarks/load_test.py --long-prompt-gap 2000 --prefill-chunk-tokens 128 256 --cache paged
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import socket
import statistics
import threading
import time
from pathlib import Path

import numpy as np


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def stream_request(port: int, body: dict) -> dict:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(body, stream=True)),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    arrivals, usage, spec = [], None, None
    for line in resp:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event["choices"] and event["choices"][0]["delta"].get("content"):
            arrivals.append(time.perf_counter())
        usage = event.get("usage") or usage
        spec = event.get("speculative") or spec
    conn.close()
    tokens = usage["completion_tokens"]
    return {
        "ttft": arrivals[0] - t0 if arrivals else float("nan"),
        "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "tpot": (arrivals[-1] - arrivals[0]) / (tokens - 1) if len(arrivals) > 1 and tokens > 1 else None,
        "tokens": tokens,
        "tau": spec["tau"] if spec else 0.0,
        "end": time.perf_counter(),
    }


def start_server(state):
    """The app over `state` on uvicorn in a thread, on an ephemeral 127.0.0.1 port -> (server, thread, port)."""
    import uvicorn

    from spec_jax.app.openai_api import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, sock.getsockname()[1]


def make_engine(target, drafter, drafter_params, slots, args, k_choices, cache, k=None):
    """The engine of one run: dense, or paged over --kv-pages pages (default: the dense engine's
    cache bytes, slots x capacity / page size)."""
    from spec_jax.decoding.engine import Engine

    options = dict(slots=slots, max_model_len=args.max_model_len, chunk_steps=args.chunk_steps,
                   k_choices=k_choices, k=k, max_admits_per_step=args.max_admits)
    if cache == "dense":
        return Engine(target, drafter, drafter_params, **options)
    kv_pages = args.kv_pages
    if kv_pages is None:  # a dense engine is built (not compiled) only to read its capacity
        dense = Engine(target, drafter, drafter_params, **options)
        kv_pages = slots * dense.capacity // args.kv_page_size
        del dense
    return Engine(target, drafter, drafter_params, kv_pages=kv_pages, kv_page_size=args.kv_page_size, **options)


def run_load(target, drafter, drafter_params, label, concurrency, bodies, args, k_choices=None, cache="dense",
             k=None) -> dict:
    from spec_jax.app.openai_api import ServerState

    slots = args.slots or concurrency
    engine = make_engine(target, drafter, drafter_params, slots, args, k_choices, cache, k)
    t0 = time.perf_counter()
    engine.warmup([len(b["prompt_ids"]) for b in bodies])
    compile_s = time.perf_counter() - t0
    state = ServerState(engine, target.tokenizer, target.chat_template, "default", label)
    server, thread, port = start_server(state)
    work: queue.Queue = queue.Queue()
    for b in bodies:
        work.put({"messages": b["messages"], "max_tokens": b["max_tokens"], "temperature": 0})
    results, lock = [], threading.Lock()

    def client():
        while True:
            try:
                body = work.get_nowait()
            except queue.Empty:
                return
            r = stream_request(port, body)
            with lock:
                results.append(r)

    peak_pages, done = [0], threading.Event()

    def watch_pages():  # the most pages in use at once, read every 5 ms
        while not done.wait(0.005):
            peak_pages[0] = max(peak_pages[0], engine.pages.used)

    watcher = threading.Thread(target=watch_pages, daemon=True)
    if engine.pages is not None:
        watcher.start()
    start = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(concurrency)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - start
    server.should_exit = True
    thread.join(60)
    done.set()
    if engine.pages is not None:
        watcher.join()
    tokens = sum(r["tokens"] for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    row = {
        "drafter": label, "cache": cache, "concurrency": concurrency, "slots": slots, "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile([r["ttft"] for r in results], 50),
        "ttft_p99_ms": 1e3 * percentile([r["ttft"] for r in results], 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "tpot_p50_ms": 1e3 * percentile([r["tpot"] for r in results if r["tpot"] is not None], 50),
        "tau_mean": statistics.fmean(r["tau"] for r in results),
        "compile_s": compile_s, "chunks": engine.chunks_run, "max_admits": args.max_admits,
        "capacity": engine.capacity,
    }
    if engine.pages is not None:  # after the server stopped: every finished request gave its pages back
        row.update(kv_pages=engine.pages.num_pages, page_size=engine.pages.page_size,
                   pages_peak=max(peak_pages[0], engine.pages.used), pages_end=engine.pages.used)
    if engine.depth is not None:  # steps per depth (the adaptive policy)
        row["depth_steps"] = {str(d): n for d, n in sorted(engine.depth_counts.items())}
    print(json.dumps(row), flush=True)
    return row


def print_interleaved(rows: list[dict], drafters: list[str]) -> None:
    """--rounds: per concurrency and cache, each drafter's median tokens/s over its rounds, and the
    median of its per-round ratios to the first drafter's."""
    import statistics

    print(f"\n{'clients':>7} {'cache':6} " + " ".join(f"{d:>22}" for d in drafters))
    for n, cache in dict.fromkeys((r["concurrency"], r["cache"]) for r in rows):
        mine = [r for r in rows if r["concurrency"] == n and r["cache"] == cache]
        base = {r["round"]: r["tokens_per_s"] for r in mine if r["name"] == drafters[0]}
        cells = []
        for d in drafters:
            runs = [r for r in mine if r["name"] == d]
            ratio = statistics.median(r["tokens_per_s"] / base[r["round"]] for r in runs)
            cells.append(f"{statistics.median(r['tokens_per_s'] for r in runs):8.1f} tok/s {ratio:5.2f}x")
        print(f"{n:>7} {cache:6} " + " ".join(f"{c:>22}" for c in cells))


def plot(rows, path: Path, title: str = "spec-jax serve, default model on CPU, loopback load test") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for label in dict.fromkeys(f"{r['drafter']}, {r['cache']}" for r in rows):
        mine = [r for r in rows if f"{r['drafter']}, {r['cache']}" == label]
        n = [r["concurrency"] for r in mine]
        axes[0].plot(n, [r["tokens_per_s"] for r in mine], "o-", label=label)
        axes[1].plot(n, [r["ttft_p50_ms"] for r in mine], "o-", label=f"{label} p50")
        axes[1].plot(n, [r["ttft_p99_ms"] for r in mine], "x--", label=f"{label} p99")
        axes[2].plot(n, [r["tpot_p50_ms"] for r in mine], "o-", label=f"{label} TPOT p50")
        axes[2].plot(n, [r["itl_p99_ms"] for r in mine], "x--", label=f"{label} ITL p99")
    for ax, name in zip(axes, ("output tokens/s", "time to first token (ms)", "per-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients (= engine slots)")
        ax.set_title(name)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def long_prompt_gap(target, args) -> list[dict]:
    """Three streams decode (plain, greedy, --chunk-steps per step); then one --long-prompt-gap
    token prompt arrives. Per prefill mode (one pass, or chunks of each --prefill-chunk-tokens
    budget), on each --cache engine: the streams' gap between two hand-outs before it arrived (p50)
    and while it was admitted (until its first token: the longest, and p50), and its time to first
    token."""
    from spec_jax.decoding.engine import Engine, model_length_and_capacity

    rng = np.random.RandomState(0)
    vocab = int(target.model.vocab_size)
    streams = [rng.randint(3, vocab, 32).tolist() for _ in range(3)]
    long_prompt = rng.randint(3, vocab, args.long_prompt_gap).tolist()
    stream_tokens = 160
    rows = []
    for cache, budget in [(c, b) for c in args.cache for b in [None, *args.prefill_chunk_tokens]]:
        paged = {}
        if cache == "paged":  # the dense engine's cache bytes, as the load runs' default
            capacity = model_length_and_capacity(args.long_prompt_gap + 64, 0, int(target.model.max_positions))[1]
            paged = dict(kv_pages=args.kv_pages or 4 * capacity // args.kv_page_size, kv_page_size=args.kv_page_size)
        engine = Engine(target, slots=4, max_model_len=args.long_prompt_gap + 64, chunk_steps=args.chunk_steps,
                        prefill_chunk_tokens=budget, prefill_rows=2, **paged)
        t0 = time.perf_counter()
        engine.warmup([32, args.long_prompt_gap])
        compile_s = time.perf_counter() - t0
        rids = {engine.submit(p, max_new_tokens=stream_tokens, ignore_eos=True) for p in streams}
        handouts, long_rid, first_token_at, submitted_at = [], None, None, None
        while first_token_at is None:
            events = engine.step()
            now = time.perf_counter()
            if any(e.request_id in rids and e.new_ids for e in events):
                handouts.append(now)
            if long_rid is None and len(handouts) >= 6:  # the streams are under way: the long prompt arrives
                submitted_at = now
                long_rid = engine.submit(long_prompt, max_new_tokens=8)
                arrived = len(handouts)
            elif long_rid is not None and any(e.request_id == long_rid and e.new_ids for e in events):
                first_token_at = now
        for rid in [*rids, long_rid]:
            engine.cancel(rid)
        engine.run_all()
        before = np.diff(handouts[:arrived])
        during = np.diff(handouts[arrived - 1:])
        row = {
            "cache": cache, "prefill": "one pass" if budget is None else f"chunks of {budget} tokens",
            "long_prompt_tokens": args.long_prompt_gap, "streams": len(streams),
            "gap_before_p50_ms": 1e3 * float(np.median(before)),
            "longest_gap_while_admitting_ms": 1e3 * float(during.max()),
            "gap_while_admitting_p50_ms": 1e3 * float(np.median(during)),
            "long_prompt_ttft_ms": 1e3 * (first_token_at - submitted_at),
            "prefill_passes": {f"{r}x{w}": n for (r, w), n in sorted(engine.prefill_passes.items())},
            "compile_s": compile_s,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def workload(target, args) -> list[dict]:
    """The request bodies: HumanEval prompts (every 7th: short and long ones alternate), general
    chat prompts (assets/chat_prompts.json: stories, explanations, recipes, lists), or the agent
    workload (one system prompt, five tasks repeated)."""
    from spec_jax.checkpoints import apply_chat_template

    if args.workload == "agent":
        from suffix_speculation import SYSTEM, TASKS

        chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}] for task in TASKS]
    elif args.workload == "chat":
        from spec_jax.app.bench import chat_prompts

        chats = [[{"role": "user", "content": prompt.text}] for prompt in chat_prompts(10**6)]
    else:
        from spec_jax.humaneval import humaneval_problems

        chats = [[{"role": "user", "content": "Complete this Python function:\n" + prob["prompt"]}]
                 for prob in humaneval_problems()[::7]]
    bodies = []
    for i, messages in enumerate(chats):
        ids = apply_chat_template(target.tokenizer, messages, target.chat_template)
        max_tokens = args.max_tokens[i % len(args.max_tokens)]
        if len(ids) + max_tokens <= args.max_model_len:
            bodies.append({"messages": messages, "prompt_ids": ids, "max_tokens": max_tokens})
    return bodies


def run_drafter(name: str, slots: int, target, args) -> tuple:
    """(drafter, params, label, k_choices, k) of a --drafters entry for an engine of `slots`."""
    from spec_jax.app.inputs import build_drafter, default_drafter_spec, parse_drafter_spec
    from spec_jax.checkpoints.shipped import default_drafter, default_drafter_choice

    if name == "none":
        return None, None, "none", None, None
    if name == "default":  # serve's default: the measured drafter for the slots, its depth policy
        spec = default_drafter_spec(args.target, None, batch=slots, engine=True)
        return (*build_drafter(spec, target), f"default ({spec.label}, {slots} slots)", None, spec.generate_k)
    if name in ("batch1", "adaptive"):
        drafter, params, _ = default_drafter(target, batch_size=1)
        kind = default_drafter_choice(True, None, 1)[0]
        if name == "adaptive":
            return drafter, params, f"{kind} adaptive K {args.k_choices}", args.k_choices, None
        return drafter, params, f"{kind} K={drafter.k} (default at batch 1)", None, None
    if "@" in name:  # NAME@K: the drafter adaptive, K its largest depth (as adaptive_depth.py's)
        kind, _, k = name.partition("@")
        return (*build_drafter(parse_drafter_spec(kind, int(k)), target), f"{kind} K={k} adaptive", None, "adaptive")
    return (*build_drafter(parse_drafter_spec(name), target), name, None, None)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=float, default=2.0,
                   help="requests per run = max(4, this x concurrency)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[32, 64, 96])
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--chunk-steps", type=int, default=4)
    p.add_argument("--slots", type=int, default=None,
                   help="engine slots (default: the run's concurrency; `spec-jax serve` defaults to 8)")
    p.add_argument("--drafters", nargs="+", default=["none", "default"],
                   help="none, default (`spec-jax serve`'s: the measured drafter for the engine's slots, "
                        "with its default depth policy), batch1 (the default drafter at batch 1, fixed K), "
                        "adaptive (that drafter with adaptive K over --k-choices), or a --drafter KIND")
    p.add_argument("--k-choices", type=int, nargs="+", default=[1, 2, 4, 7])
    p.add_argument("--max-admits", type=int, default=None, help="the engine's max_admits_per_step")
    p.add_argument("--cache", nargs="+", choices=["dense", "paged"], default=["dense", "paged"],
                   help="the engines each run is made on: dense (a --max-model-len cache per slot) and/or paged")
    p.add_argument("--kv-pages", type=int, default=None, metavar="N",
                   help="the paged engine's pool (default: the dense engine's cache bytes, slots x capacity / page size)")
    p.add_argument("--kv-page-size", type=int, default=128, help="slots per page (a divisor of 128)")
    p.add_argument("--workload", choices=["humaneval", "chat", "agent"], default="humaneval",
                   help="humaneval: mixed prompt lengths; agent: repeated requests under one system prompt")
    p.add_argument("--target", default=None, help="the target (default: the default model)")
    p.add_argument("--out", default=None, help="directory for load_test.json and load_test.png")
    p.add_argument("--rounds", type=int, default=None, metavar="R",
                   help="interleaved: per concurrency, R rounds of every drafter, the order reversed every "
                        "other round; prints each drafter's median throughput over the first's (the machine "
                        "drifts: a ratio needs its runs side by side)")
    p.add_argument("--long-prompt-gap", type=int, default=None, metavar="N",
                   help="measure the streams' longest gap while one N-token prompt is admitted (see above)")
    p.add_argument("--prefill-chunk-tokens", type=int, nargs="+", default=[256],
                   help="with --long-prompt-gap: the chunked-prefill budgets to measure beside the one-pass admit")
    args = p.parse_args(argv)

    from spec_jax.checkpoints import load_target

    target = load_target(args.target, dtype="float32")
    if args.long_prompt_gap is not None:
        rows = long_prompt_gap(target, args)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "long_prompt_gap.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
        return {"rows": rows, "args": vars(args)}
    bodies = workload(target, args)
    rows = []

    def run(name, n, round_=None):
        drafter, params, label, k_choices, k = run_drafter(name, args.slots or n, target, args)
        count = max(4, int(round(args.requests_per_client * n)))
        run_bodies = [bodies[i % len(bodies)] for i in range(count)]
        for cache in args.cache:
            row = run_load(target, drafter, params, label, n, run_bodies, args, k_choices, cache, k)
            rows.append(row if round_ is None else dict(row, round=round_, name=name))

    if args.rounds:
        for n in args.concurrency:
            for r in range(args.rounds):
                for name in (args.drafters if r % 2 == 0 else args.drafters[::-1]):
                    run(name, n, r)
        print_interleaved(rows, args.drafters)
    else:
        for name in args.drafters:
            for n in args.concurrency:
                run(name, n)
    report = {"rows": rows, "args": vars(args), "prompt_lengths": sorted(len(b["prompt_ids"]) for b in bodies)}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "load_test.json").write_text(json.dumps(report, indent=1))
        plot(rows, out / "load_test.png")
        print(f"wrote {out / 'load_test.json'} and {out / 'load_test.png'}")
    return report


if __name__ == "__main__":
    main()
