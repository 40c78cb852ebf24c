"""Suffix speculation on a repeated-template (agent-like) workload, through the engine.

    python benchmarks/suffix_speculation.py [--requests 10] [--max-new-tokens 64] \
        [--rounds 2] [--drafters none,ngram,suffix,dflash+ngram,dflash+suffix] [--out benchmarks/results/suffix_speculation.json]

The default model (SmolLM2-135M-Instruct) answers a run of coding requests that share one system
prompt and answer format; each of five tasks recurs after the other four (an agent's repeated calls). Requests go
through one `Engine` per drafter, one slot, one after another: each finished request's prompt and
output enter the suffix drafter's store before the next is admitted. Per drafter: tau (tokens per
verify step, the bonus included), tokens per second after warm-up, and whether every request's
output is token-identical to plain decoding's (greedy). Compiles are done before timing, and the
timed rounds interleave the drafters (a fresh engine, so an empty store, each time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SYSTEM = (
    "You are a coding agent. Answer every task with one Python function in a ```python block: a "
    "docstring, type hints, and no explanation after the code."
)
TASKS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the factorial of a number.",
    "Write a Python function that reverses a string.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the vowels in a string.",
]


def requests(tokenizer, count: int) -> list[list[int]]:
    """`count` requests cycling through TASKS under one system prompt: each task recurs (as an
    agent's retried or repeated calls do) after the others, and all share the answer's template."""
    from spec_jax.checkpoints import apply_chat_template

    return [
        apply_chat_template(tokenizer, [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": TASKS[i % len(TASKS)]}])
        for i in range(count)
    ]


def engine_for(target, kind: str, prompts: list[list[int]], max_new: int, chunk_steps: int):
    """An engine for this drafter, its programs compiled (-> engine, compile seconds). Engines of
    the same configuration share programs, so a fresh one per round (an empty store) compiles nothing."""
    from spec_jax import load_drafter
    from spec_jax.decoding.engine import Engine

    drafter, params = load_drafter(kind, target) if kind != "none" else (None, None)
    engine = Engine(target, drafter, params, slots=1, max_model_len=max(map(len, prompts)) + max_new + 1,
                    chunk_steps=chunk_steps)
    return engine, engine.warmup([len(p) for p in prompts]).seconds


def run(engine, prompts: list[list[int]], max_new: int) -> dict:
    """Every request through the engine, one after another -> counters, seconds, outputs."""
    ids = [engine.submit(p, max_new_tokens=max_new) for p in prompts]
    t0 = time.perf_counter()
    done = engine.run_all()
    seconds = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    steps = sum(o.stats.steps for o in outs)
    emitted = sum(o.stats.emitted for o in outs)
    return {
        "seconds": round(seconds, 2),
        "tokens": sum(len(o.new_ids) for o in outs),
        "tau": round(emitted / steps, 3) if steps else 1.0,
        "accepted": sum(o.stats.accepted for o in outs),
        "tau_per_request": [round(o.stats.tau, 2) for o in outs],
        "outputs": [o.new_ids for o in outs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chunk-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds, the drafters interleaved in each")
    p.add_argument("--drafters", default="none,ngram,suffix,dflash+ngram,dflash+suffix")
    p.add_argument("--out", default="benchmarks/results/suffix_speculation.json")
    args = p.parse_args()

    from spec_jax import load_target

    target = load_target(None)
    prompts = requests(target.tokenizer, args.requests)
    kinds = args.drafters.split(",")
    compile_s = {kind: round(engine_for(target, kind, prompts, args.max_new_tokens, args.chunk_steps)[1], 1)
                 for kind in kinds}
    rounds: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):  # interleaved, so a change in the machine's load hits every drafter
        for kind in kinds:
            engine, _ = engine_for(target, kind, prompts, args.max_new_tokens, args.chunk_steps)
            rounds[kind].append(run(engine, prompts, args.max_new_tokens))
    plain = rounds["none"][0]["outputs"] if "none" in rounds else None
    results = []
    for kind in kinds:
        first = rounds[kind][0]
        rates = [r["tokens"] / r["seconds"] for r in rounds[kind]]
        r = {"drafter": kind, "compile_s": compile_s[kind], "tokens": first["tokens"],
             "tokens_per_s": [round(x, 2) for x in rates], "tau": first["tau"], "accepted": first["accepted"],
             "tau_per_request": first["tau_per_request"],
             "identical_to_plain": None if plain is None else all(x["outputs"] == plain for x in rounds[kind]),
             "outputs": first["outputs"]}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "outputs"}), flush=True)
    print("first answer:", target.tokenizer.decode(results[0]["outputs"][0]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "prompt_tokens": [len(p) for p in prompts],
                                          "results": results}, indent=1))


if __name__ == "__main__":
    main()
