"""What skipping DFlash on all-lookup steps saves: `dflash+ngram` with and without the skip.

    python benchmarks/lookup_skip.py [--num-prompts 20] [--batch-size 1] [--rounds 2] [--out DIR]

`LookupFirstDrafter` skips the DFlash forward (a `lax.cond`) on steps where every row drafts from
the prompt lookup, since DFlash's propose leaves its state unchanged (`stateless_propose`). This
runs the shipped DFlash drafter behind the lookup both ways on the same prompts, interleaved
prompt by prompt so that drift of this shared VM hits both alike, next to plain decoding; the
outputs must be identical (the skip changes only what is computed, never the drafts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from spec_jax.drafters.dflash import DFlashDrafter
from spec_jax.drafters.lookup import LookupFirstDrafter


class AlwaysRunDFlash(DFlashDrafter):
    """The same drafter, declared stateful: the lookup wrapper then runs it every step."""

    stateless_propose = False


def main() -> None:
    import dataclasses

    from spec_jax.app.inputs import DrafterSpec, build_drafter
    from spec_jax.checkpoints import apply_chat_template, load_target
    from spec_jax.decoding import generate
    from spec_jax.humaneval import humaneval_problems

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write lookup_skip.json here")
    args = parser.parse_args()

    target = load_target(None)
    dflash, params = build_drafter(DrafterSpec("dflash"), target)
    always = AlwaysRunDFlash(**{f.name: getattr(dflash, f.name) for f in dataclasses.fields(dflash)})
    methods = {"AR": None, "skip": LookupFirstDrafter(dflash), "no skip": LookupFirstDrafter(always)}
    problems = humaneval_problems()[: args.num_prompts]
    prompts = [apply_chat_template(target.tokenizer, p["prompt"], target.chat_template) for p in problems]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]

    def run(drafter, batch):
        return generate(target, batch, drafter, params if drafter else None, max_new_tokens=args.max_new_tokens)

    for drafter in methods.values():  # compile every batch shape outside the timing
        for shape in {len(b) for b in batches}:
            run(drafter, next(b for b in batches if len(b) == shape))
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for batch in tqdm(batches, desc="prompts", leave=False):
            outputs = {}
            for name, drafter in methods.items():
                start = time.perf_counter()
                result = run(drafter, batch)
                seconds[name] += time.perf_counter() - start
                tokens[name] += sum(len(ids) for ids in result.generated_ids)
                outputs[name] = result.generated_ids
            assert outputs["skip"] == outputs["no skip"] == outputs["AR"], "a drafter changed the output"
    rates = {name: tokens[name] / seconds[name] for name in methods}
    print(f"batch {args.batch_size}, HumanEval[:{args.num_prompts}], {args.max_new_tokens} tokens, "
          f"{args.rounds} rounds; outputs identical")
    for name, rate in rates.items():
        print(f"{name:8s} {rate:7.1f} tok/s  {rate / rates['AR']:.2f}x AR")
    print(f"skip / no skip: {rates['skip'] / rates['no skip']:.3f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lookup_skip.json").write_text(json.dumps(
            {"batch_size": args.batch_size, "num_prompts": args.num_prompts, "rounds": args.rounds,
             "tok_per_s": rates, "skip_over_no_skip": rates["skip"] / rates["no skip"]}, indent=1))


if __name__ == "__main__":
    main()
