"""Why ITL p99 at 16 clients moved between the dense and the paged engine (issue 45, part 7):
how many of N simultaneous streaming requests each step admits (the "waves"), over HTTP as in
load_test.py, on the dense and the paged engine, with and without load_test.py's 5 ms page
watcher thread (it runs beside paged engines only).

The tiny served target (tests/serving_testlib.py); each admitted prompt's one-pass prefill (about
1 s for the default model on this CPU) is stood in for by a sleep of --prefill-s per admitted
request, so the waves' pauses have the shape they have with the real model. Prints one JSON line
per run: the requests admitted per step, ITL p99 and the largest gaps.

    python benchmarks/admission_waves.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests"), str(Path(__file__).resolve().parent)]

import load_test  # noqa: E402


def run(target, cache: str, watcher: bool, clients: int, prefill_s: float) -> dict:
    from spec_jax.app.openai_api import ServerState
    from spec_jax.decoding.engine import Engine

    pages = {} if cache == "dense" else {"kv_pages": 2 * clients, "kv_page_size": 64}
    engine = Engine(target, slots=clients, max_model_len=96, chunk_steps=4, **pages)
    engine.warmup([16, 32])
    waves, real_step = [], engine.step

    def step():  # the requests this step admitted, and the prefill time they stand for
        before = set(engine.slot_table.slot_of)
        events = real_step()
        admitted = {e.request_id for e in events if e.request_id not in before}
        if admitted:
            waves.append(len(admitted))
            time.sleep(prefill_s * len(admitted))
        return events

    engine.step = step
    server, thread, port = load_test.start_server(ServerState(engine, target.tokenizer, target.chat_template,
                                                              "tiny", "none"))
    done = threading.Event()

    def watch():  # what load_test.py's watcher does beside a paged engine
        while not done.wait(0.005):
            _ = engine.pages.used if engine.pages is not None else engine.num_live

    if watcher:
        threading.Thread(target=watch, daemon=True).start()
    bodies = [{"messages": [{"role": "user", "content": f"Question {i}: the quick brown fox {'x' * (i % 5)}"}],
               "max_tokens": 32, "ignore_eos": True, "temperature": 0} for i in range(clients)]
    results = []
    threads = [threading.Thread(target=lambda b=b: results.append(load_test.stream_request(port, b))) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.should_exit = True
    thread.join(60)
    done.set()
    gaps = [g for r in results for g in r["gaps"]]
    return {"cache": cache, "watcher": watcher, "waves": waves, "gaps": len(gaps),
            "itl_p99_ms": round(1e3 * load_test.percentile(gaps, 99)),
            "largest_gaps_s": [round(g, 2) for g in sorted(gaps, reverse=True)[:4]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-s", type=float, default=0.3, help="the stand-in prefill time per admitted request")
    args = parser.parse_args()
    from serving_testlib import save_tiny_target

    from spec_jax.checkpoints import load_target

    with tempfile.TemporaryDirectory() as tmp:
        target = load_target(str(save_tiny_target(Path(tmp) / "tiny")), dtype="float32")
    for _ in range(args.repeats):
        for cache in ("dense", "paged"):
            for watcher in (False, True):
                print(json.dumps(run(target, cache, watcher, args.clients, args.prefill_s)), flush=True)


if __name__ == "__main__":
    main()
