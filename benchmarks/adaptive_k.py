"""Adaptive K against fixed K and the default drafter, at batch 1 and 8 (the engine, no HTTP).

For each batch size B the engine runs with B slots and B x --rounds requests (HumanEval prompts,
chat-formatted, greedy, --max-tokens new tokens each, EOS ignored so every run makes the same
number of tokens). Runs, in one process and after warm-up (compiles are not timed):
  - plain decoding (no drafter);
  - the default drafter for B (`spec_jax.default_drafter(target, batch_size=B)`);
  - the --drafter at each fixed K of --k-choices (an engine per K);
  - the same drafter with the per-step adaptive depth over --k-choices (`k=AdaptiveDepth(depths=
    ...)`: each step of a chunk picks its depth on device; costs measured once, cached on disk;
    its acceptance EMAs restart with each admitted request).
Every run is timed --repeats times, the order reversed on every other pass (the shared machine's
load drifts).

    python benchmarks/adaptive_k.py --batch-sizes 1 8 --out benchmarks/results/adaptive_k
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def timed_run(engine, prompts, max_tokens) -> dict:
    for ids in prompts:
        engine.submit(ids, max_new_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    depth_before = dict(engine.depth_counts)
    out = engine.run_all()
    seconds = time.perf_counter() - t0
    tokens = sum(len(e.new_ids) for e in out.values())
    steps = sum(e.stats.steps for e in out.values())
    depth_used = {d: n - depth_before.get(d, 0) for d, n in sorted(engine.depth_counts.items())}
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "tau": sum(e.stats.emitted for e in out.values()) / max(steps, 1),
            "depth_steps": {str(d): n for d, n in depth_used.items() if n}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--drafter", default="dflash+ngram")
    p.add_argument("--k-choices", type=int, nargs="+", default=[0, 2, 4, 7])
    p.add_argument("--rounds", type=int, default=2, help="requests per slot")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed passes over all runs, order alternating")
    p.add_argument("--chunk-steps", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from spec_jax.app.inputs import build_drafter, parse_drafter_spec
    from spec_jax.checkpoints import apply_chat_template, load_target
    from spec_jax.checkpoints.shipped import default_drafter
    from spec_jax.decoding.depth import AdaptiveDepth
    from spec_jax.decoding.engine import Engine
    from spec_jax.humaneval import humaneval_problems

    target = load_target(None, dtype="float32")
    prompts = [apply_chat_template(target.tokenizer, [{"role": "user", "content": "Complete this Python "
                                   "function:\n" + prob["prompt"]}], target.chat_template)
               for prob in humaneval_problems()[::5]]
    prompts = [ids for ids in prompts if len(ids) + args.max_tokens <= args.max_model_len]
    drafter, drafter_params = build_drafter(parse_drafter_spec(args.drafter), target)
    rows = []

    def record(batch, label, result):
        row = dict(batch=batch, run=label, **result)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for b in args.batch_sizes:
        run_prompts = [prompts[i % len(prompts)] for i in range(b * args.rounds)]
        common = dict(slots=b, max_model_len=args.max_model_len, chunk_steps=args.chunk_steps)
        lengths = [len(x) for x in run_prompts]
        runs = []  # (label, engine); every engine is warmed up before timing
        plain = Engine(target, None, None, **common)
        plain.warmup(lengths)
        runs.append(("plain", plain))
        d, dp, reason = default_drafter(target, batch_size=b)
        if d is not None:
            default = Engine(target, d, dp, **common)
            default.warmup(lengths)
            runs.append((f"default ({type(d).__name__} K={d.k})", default))
        for k in [k for k in args.k_choices if k > 0]:
            fixed = Engine(target, drafter, drafter_params, k=k, **common)
            fixed.warmup(lengths)
            runs.append((f"{args.drafter} K={k}", fixed))
        adaptive = Engine(target, drafter, drafter_params, k=AdaptiveDepth(depths=tuple(args.k_choices)), **common)
        adaptive.warmup(lengths)
        runs.append((f"{args.drafter} adaptive {args.k_choices}", adaptive))
        for repeat in range(args.repeats):  # alternate the order: the machine's load drifts
            for label, eng in (runs if repeat % 2 == 0 else runs[::-1]):
                record(b, label, dict(timed_run(eng, run_prompts, args.max_tokens), repeat=repeat))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "adaptive_k.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
        print(f"wrote {out / 'adaptive_k.json'}")


if __name__ == "__main__":
    main()
