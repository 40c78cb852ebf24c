"""Batched generation throughput of the default model (what `spec-jax train data` runs).

Answers the first N training prompts (chat-formatted) at each batch size, greedy, AR, and prints
tokens/s including prefill, best of --repeats after a compile run.
    python benchmarks/batched_generate.py --batch-sizes 1 8 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

from spec_jax.checkpoints import apply_chat_template, load_target
from spec_jax.decoding.generate import generate
from spec_jax.training.data import training_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    target = load_target(None, dtype="float32")  # the default model (installed)
    prompts = [apply_chat_template(target.tokenizer, q.text, target.chat_template)
               for q in training_prompts(max(args.batch_sizes), seed=0)]
    rows = []
    for b in args.batch_sizes:
        batch = prompts[:b]
        generate(target, batch, max_new_tokens=args.max_new_tokens, ignore_eos=True)  # compile
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = generate(target, batch, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            best = min(best, time.perf_counter() - t0)
        row = {"batch": b, "prompt_tokens": sum(map(len, batch)), "seconds": best,
               "tokens_per_s": out.num_generated / best}
        rows.append(row)
        print(f"batch {b:3d}: {row['tokens_per_s']:7.1f} tok/s ({best:.2f} s, {row['prompt_tokens']} prompt tokens)",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
