"""Greedy outputs and step counts of the default model on HumanEval[:N] for a fixed set of
drafters, written as JSON, so a refactor can show it changed no behaviour: run it before and
after and compare the two files (`--compare OLD.json`).

    python benchmarks/behaviour_snapshot.py --out /tmp/before.json
    python benchmarks/behaviour_snapshot.py --out /tmp/after.json --compare /tmp/before.json
"""

from __future__ import annotations

import argparse
import json
import sys

import spec_jax
from spec_jax.humaneval import humaneval_problems

# (name, drafter kind for load_drafter, K or None, tree budget or None); "default" is
# spec_jax.default_drafter at batch 1, greedy.
CASES = (
    ("default", None, None, None),
    ("ngram", "ngram", None, None),
    ("draft-model+ngram", "draft-model+ngram", None, None),
    ("dflash-tree16", "dflash", None, 16),
)


def snapshot(num_prompts: int, max_new_tokens: int) -> dict:
    target = spec_jax.load_target(None)
    prompts = [
        spec_jax.apply_chat_template(target.tokenizer, text, target.chat_template)
        for text in [p["prompt"] for p in humaneval_problems()[:num_prompts]]
    ]
    results = {}
    for name, kind, k, tree in CASES:
        if kind is None:
            drafter, params, _ = spec_jax.default_drafter(target, batch_size=1)
        else:
            drafter, params = spec_jax.load_drafter(kind, target, k=k)
        rows = []
        for prompt in prompts:
            out = spec_jax.generate(target, [prompt], drafter, params, max_new_tokens=max_new_tokens, tree=tree)
            rows.append({"ids": [int(t) for t in out.generated_ids[0]], "steps": int(out.row_stats[0].steps)})
        results[name] = rows
        print(name, "steps", [r["steps"] for r in rows], file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="an earlier snapshot; exit 1 on any difference")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    results = snapshot(args.num_prompts, args.max_new_tokens)
    with open(args.out, "w") as f:
        json.dump(results, f)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        same = before == results
        for name in results:
            print(f"{name}: {'identical' if before.get(name) == results[name] else 'DIFFERENT'}")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
