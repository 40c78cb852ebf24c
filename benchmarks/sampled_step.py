"""What sampling costs a step of `generate`'s loop against greedy decoding, per drafter and batch.

The loop warps the target's logits (and a drafter's) at every verify step: temperature, then
top-k, then top-p. Greedy rows take the argmax; temperature alone only scales; top-k and top-p
cut the distribution, which needs the k-th value and the nucleus's edge for every position
verified (K + 1 of them per row). The same chat prompts, EOS ignored, each setting compiled and
run once before the timed runs; prints each setting's ms per loop step (median of --repeats) and
its ratio to greedy's in the same process. Run it at two commits for before / after.

    python benchmarks/sampled_step.py                                    # plain and the default drafter, batch 1 and 8
    python benchmarks/sampled_step.py --drafters none --batches 8 --json out.json
    python benchmarks/sampled_step.py --warp      # the cut alone: spec_jax's against a full sort's

`--warp` times `sampling._truncate` (top-k and top-p by bisection) beside the cut by a full sort
of the vocabulary that the loop used until session 38 (`sort_truncate` below), on rows of 8 and
64 logits (a batch of 8 verifying 1 or 8 positions) over 49152 and 128256 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SETTINGS = {  # name -> (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "T=0.8": (0.8, 0, 1.0),
    "T=0.8 top_p=0.9": (0.8, 0, 0.9),
    "T=0.8 top_k=20": (0.8, 20, 1.0),
    "T=1 top_k=50 top_p=0.95": (1.0, 50, 0.95),
}


def sort_truncate(scaled, top_k, top_p):
    """The sort-based top-k / top-p cut the loop used until session 38 (the baseline of --warp)."""
    import jax
    import jax.numpy as jnp

    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    in_top_k = jnp.arange(vocab) < jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    sorted_probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    keep = in_top_k & (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p)
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def time_warp(repeats: int) -> list[dict]:
    """ms of each cut (top-k 20 on one row, top-p 0.9 on all) per shape, best of `repeats`."""
    import time

    import jax
    import jax.numpy as jnp

    from spec_jax.sampling import _truncate

    rows = []
    for vocab in (49152, 128256):
        for height in (8, 64):
            logits = 3.0 * jax.random.normal(jax.random.key(0), (height, vocab))
            top_k, top_p = jnp.zeros((height, 1), jnp.int32).at[0].set(20), jnp.full((height, 1), 0.9)
            ms = {}
            for name, cut in (("sort", sort_truncate), ("bisection", _truncate)):
                fn = jax.jit(cut)
                jax.block_until_ready(fn(logits, top_k, top_p))
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(logits, top_k, top_p))
                    times.append(1e3 * (time.perf_counter() - t0))
                ms[name] = min(times)
            rows.append(dict(vocab=vocab, rows=height, sort_ms=ms["sort"], bisection_ms=ms["bisection"]))
            print(f"[{height}, {vocab}]: sort {ms['sort']:.1f} ms, bisection {ms['bisection']:.1f} ms "
                  f"({ms['sort'] / ms['bisection']:.1f}x faster)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", default="none,default", help="comma list: none, default (the measured "
                   "default for the batch), or a spec as `spec-jax bench --drafters` takes it")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes (the first N chat prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--warp", action="store_true", help="time the cut alone (see above)")
    args = p.parse_args()
    if args.warp:
        rows = time_warp(max(args.repeats, 3))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return

    from tqdm import tqdm

    from spec_jax import default_drafter, generate, load_target
    from spec_jax.app.bench import chat_prompts
    from spec_jax.app.inputs import build_drafter, parse_drafter_spec
    from spec_jax.checkpoints import apply_chat_template

    target = load_target(None, dtype="float32")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ids = [apply_chat_template(target.tokenizer, [{"role": "user", "content": q.text}], target.chat_template)
               for q in chat_prompts(batch)]
        for name in (d.strip() for d in args.drafters.split(",")):
            if name == "none":
                drafter, params = None, None
            elif name == "default":
                drafter, params, _ = default_drafter(target, batch_size=batch)  # greedy's, for every setting
            else:
                drafter, params = build_drafter(parse_drafter_spec(name, None), target)
            ms = {}
            for setting, (t, k, top_p) in tqdm(SETTINGS.items(), desc=f"batch {batch} {name}", leave=False):
                kw = dict(drafter=drafter, drafter_params=params, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                          temperature=t, top_k=k, top_p=top_p, seed=1)
                generate(target, ids, **kw)  # compile and first run
                runs = [generate(target, ids, **kw) for _ in range(args.repeats)]
                ms[setting] = statistics.median(1e3 * r.generate_s / max(r.loop_steps, 1) for r in runs)
                rows.append(dict(batch=batch, drafter=name, setting=setting, ms_per_step=ms[setting],
                                 vs_greedy=ms[setting] / ms["greedy"], k=getattr(drafter, "k", 0)))
            print(f"batch {batch}, {name} (K={getattr(drafter, 'k', 0)}): "
                  + ", ".join(f"{s} {v:.1f} ms ({v / ms['greedy']:.2f}x)" for s, v in ms.items()), flush=True)
    print("\n| batch | drafter | " + " | ".join(SETTINGS) + " |")
    print("|---|---|" + "---|" * len(SETTINGS))
    for batch in sorted({r["batch"] for r in rows}):
        for name in dict.fromkeys(r["drafter"] for r in rows):
            cells = [r for r in rows if r["batch"] == batch and r["drafter"] == name]
            print(f"| {batch} | {name} | " + " | ".join(f"{r['ms_per_step']:.1f} ({r['vs_greedy']:.2f}x)" for r in cells)
                  + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
