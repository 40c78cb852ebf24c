"""What a plain step costs each drafter inside `generate`'s adaptive loop, against plain decoding.

Every drafting depth is priced out (costs 1 and inf: the policy never drafts) and shadow probes
are off, so every step is a plain one and only the drafter's bookkeeping differs from plain
decoding: DFlash writing the step's context entry, the prompt lookup telling each row's draft
source, the draft model doing nothing until it drafts. The same chat prompts for every method,
greedy, EOS ignored, the order reversed every other repeat; prints each method's median tokens/s
and its ratio to plain decoding's. `engine_plain_step.py` is the same question for the engine.

    python benchmarks/generate_plain_step.py --batch 1 --drafters dflash+ngram,draft-model+ngram
    python benchmarks/generate_plain_step.py --batch 8 --drafters dflash+ngram,draft-model+ngram,ngram
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="prompts per call (the first N chat prompts)")
    p.add_argument("--drafters", default="dflash+ngram,draft-model+ngram",
                   help="comma list as `spec-jax bench --drafters` takes them")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()

    from spec_jax.app import compilation_cache

    compilation_cache.configure(None)
    from spec_jax import generate, load_target
    from spec_jax.app.bench import chat_prompts
    from spec_jax.app.inputs import build_drafter, parse_drafter_spec
    from spec_jax.checkpoints import apply_chat_template
    from spec_jax.decoding.depth import AdaptiveDepth

    target = load_target(None, dtype="float32")
    ids = [apply_chat_template(target.tokenizer, [{"role": "user", "content": q.text}], target.chat_template)
           for q in chat_prompts(args.batch)]
    plain_only = AdaptiveDepth(depths=(0, 2), costs=(1.0, float("inf")), shadow_every=0)
    methods = {"plain": dict(drafter=None, drafter_params=None)}
    for name in args.drafters.split(","):
        drafter, params = build_drafter(dataclasses.replace(parse_drafter_spec(name.strip(), 2), tree=0), target)
        methods[name.strip()] = dict(drafter=drafter, drafter_params=params, k=plain_only)
    common = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for kw in methods.values():  # compile
        generate(target, ids, **kw, **common)
    speeds = {name: [] for name in methods}
    for rep in range(args.repeats):
        for name in (list(methods) if rep % 2 == 0 else list(reversed(methods))):
            r = generate(target, ids, **methods[name], **common)
            if r.depth_counts is not None and set(r.depth_counts) != {0}:
                raise SystemExit(f"{name} drafted ({r.depth_counts}): the plain-only policy did not hold")
            speeds[name].append(r.tokens_per_second)
    base = statistics.median(speeds["plain"])
    for name, values in speeds.items():
        print(f"batch {args.batch} {name}: {statistics.median(values):.1f} tok/s, "
              f"{statistics.median(values) / base:.3f}x plain decoding")


if __name__ == "__main__":
    main()
