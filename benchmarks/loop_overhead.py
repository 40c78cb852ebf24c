"""What the speculative loop itself costs: time per verify step of the `self` drafter against the
sum of its parts measured separately (one 2-token draft step + K-1 one-token draft steps + one
(K+1)-token verify pass, each a jitted `forward` on the same cache shapes).

    python benchmarks/loop_overhead.py --k 4 --max-new-tokens 128 [--record]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def time_call(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from spec_jax.checkpoints import apply_chat_template, load_target
    from spec_jax.decoding.generate import default_capacity, generate, prompt_bucket
    from spec_jax.drafters.draft_model import self_drafter
    from spec_jax.models import forward, init_cache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()

    target = load_target(None)
    cfg, params = target.cfg, target.params
    prompt = apply_chat_template(
        target.tokenizer, "Write a Python function that merges two sorted lists.", target.chat_template
    )
    drafter = self_drafter(cfg, args.k)
    generate(target, [prompt], drafter, params, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    runs = [
        generate(target, [prompt], drafter, params, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        for _ in range(3)
    ]
    per_step = statistics.median(r.generate_s / r.loop_steps for r in runs)
    ar = [generate(target, [prompt], max_new_tokens=args.max_new_tokens, ignore_eos=True) for _ in range(3)]
    ar_step = statistics.median(r.generate_s / r.loop_steps for r in ar)

    capacity = default_capacity(prompt_bucket(len(prompt)), args.max_new_tokens, args.k)
    # 100 committed slots: the passes below sit at positions 100.. as in a real step.
    cache = init_cache(cfg, 1, capacity).with_lengths(jnp.full((1,), 100, jnp.int32))
    run = jax.jit(lambda p, t, pos, c: forward(p, cfg, t, pos, c)[0])

    def tokens(n: int):
        return jnp.zeros((1, n), jnp.int32), jnp.arange(100, 100 + n, dtype=jnp.int32)[None]

    draft_first = time_call(run, params, *tokens(2), cache)
    draft_one = time_call(run, params, *tokens(1), cache)
    verify = time_call(run, params, *tokens(args.k + 1), cache)
    parts = draft_first + (args.k - 1) * draft_one + verify
    overhead = per_step - parts
    lines = [
        f"self drafter, K={args.k}, batch 1: {per_step * 1e3:.1f} ms per verify step",
        f"  parts: 2-token draft step {draft_first * 1e3:.1f} ms + {args.k - 1} x 1-token draft step "
        f"{draft_one * 1e3:.1f} ms + {args.k + 1}-token verify {verify * 1e3:.1f} ms = {parts * 1e3:.1f} ms",
        f"  loop overhead: {overhead * 1e3:.1f} ms per step ({overhead / per_step:.1%})",
        f"AR (K=0) step: {ar_step * 1e3:.1f} ms vs a bare 1-token forward {draft_one * 1e3:.1f} ms "
        f"(overhead {(ar_step - draft_one) * 1e3:.1f} ms)",
    ]
    print("\n".join(lines))
    if args.record:
        path = Path(__file__).with_name("RESULTS.md")
        row = (
            f"| {datetime.date.today()} | {platform.machine()}, {jax.device_count()} {jax.devices()[0].platform} "
            f"| {args.k} | {per_step * 1e3:.1f} | {draft_first * 1e3:.1f} + {args.k - 1}x{draft_one * 1e3:.1f} "
            f"+ {verify * 1e3:.1f} = {parts * 1e3:.1f} | {overhead * 1e3:.1f} ({overhead / per_step:.1%}) "
            f"| {ar_step * 1e3:.1f} vs {draft_one * 1e3:.1f} |\n"
        )
        text = path.read_text() if path.exists() else ""
        header = "## Loop overhead (`benchmarks/loop_overhead.py`)"
        if header not in text:
            text += (
                f"\n{header}\n\nTime per verify step of the `self` drafter (default model, batch 1, "
                "median of 3 runs x 128 tokens) against its parts timed alone (median of 20).\n\n"
                "| date | machine | K | step ms | parts ms | overhead ms | AR step vs 1-token forward ms |\n"
                "|---|---|---|---|---|---|---|\n"
            )
        path.write_text(text + row)


if __name__ == "__main__":
    main()
