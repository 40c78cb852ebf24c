"""The loop's step with a DFlash drafter against plain decoding, on a random-weight target of real
shapes: what a GPU host can measure with this repository alone (no checkpoint travels there).

    python benchmarks/dflash_step.py                                   # random:qwen3-8b, block 16, 5 layers
    python benchmarks/dflash_step.py --target random:tiny --dtype float32 --new-tokens 8 --out DIR

Random weights accept (almost) no drafts, so a DFlash step commits one token and costs one draft
pass over the block plus one verify pass of block-size tokens; a trained drafter with acceptance
length tau then runs at about tau x (AR step / DFlash step) of plain decoding. Each step time is
per loop step of the real `generate` loop (prefill removed by difference: 1 vs --new-tokens new
tokens), best of --repeats runs. The drafter is shaped like the published ones for the target
(its width and heads, `--layers` Qwen3-style layers, context from as many target layers spread
over its depth, the DFlash default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np


def loop_step_seconds(target: Any, prompts: list[list[int]], drafter: Any, params: Any, *,
                      new_tokens: int, capacity: int, repeats: int) -> dict[str, float]:
    """Seconds per loop step (prefill excluded by difference) and the steps' mean committed tokens."""
    from spec_jax.decoding import generate

    def run(n: int):
        kwargs = dict(max_new_tokens=n, ignore_eos=True, capacity=capacity)
        generate(target, prompts, drafter, params, **kwargs)  # compile + warm
        return min((generate(target, prompts, drafter, params, **kwargs) for _ in range(repeats)),
                   key=lambda out: out.generate_s)

    short, long = run(1), run(new_tokens)
    steps = long.loop_steps - short.loop_steps
    return {"step_s": (long.generate_s - short.generate_s) / steps, "steps": steps,
            "tau": long.stats.tau, "prefill_s": short.generate_s}


def shaped_drafter(target_cfg: Any, block_size: int, layers: int, dtype: str, tree: Any = 0,
                   draft_vocab: int = 0):
    """(drafter, random params) of a DFlash drafter shaped like the published ones for the target
    (see the module docstring); `tree` as `DFlashDrafter` takes it (0 = a chain); `draft_vocab`
    > 0 gives it its own head over that many tokens (speculators' reduced draft vocabulary)
    instead of the target's LM head."""
    from spec_jax.drafters.dflash import DFlashDrafter, default_target_layer_ids, init_dflash_params
    from spec_jax.training.run import smollm2_dflash_config

    shaped = smollm2_dflash_config(target_cfg, block_size, layers)
    n = target_cfg.num_layers
    # Clamped into the target's layers: the default spread runs below 0 under 4 layers (random:tiny).
    ids = tuple(sorted({min(max(i, 0), n - 1) for i in default_target_layer_ids(n, layers)}))
    cfg = dataclasses.replace(shaped, layer=shaped.layer.replace(dtype=dtype), target_layer_ids=ids,
                              draft_vocab_size=draft_vocab or None)
    return DFlashDrafter(cfg, tree=tree), init_dflash_params(cfg, jax.random.key(0))


def main(argv: list[str] | None = None) -> int:
    from spec_jax.checkpoints import load_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="random:qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write dflash_step.json here")
    args = parser.parse_args(argv)

    target = load_target(args.target, dtype=args.dtype)
    drafter, params = shaped_drafter(target.cfg, args.block_size, args.layers, args.dtype)
    prompts = np.random.default_rng(0).integers(0, target.cfg.vocab_size, (args.batch_size, args.context)).tolist()
    capacity = args.context + args.new_tokens * args.block_size + args.block_size + 1  # every step may accept
    common = dict(new_tokens=args.new_tokens, capacity=capacity, repeats=args.repeats)
    ar = loop_step_seconds(target, prompts, None, None, **common)
    dflash = loop_step_seconds(target, prompts, drafter, params, **common)
    report = {
        "kind": "dflash_step", "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        "target": args.target, "dtype": args.dtype, "batch_size": args.batch_size, "context": args.context,
        "block_size": args.block_size, "draft_layers": args.layers, "ar": ar, "dflash": dflash,
        "dflash_step_vs_ar": dflash["step_s"] / ar["step_s"],
    }
    print(f"{args.target} {args.dtype} on {report['device']}, batch {args.batch_size}, context {args.context}: "
          f"AR step {ar['step_s'] * 1e3:.2f} ms, DFlash step (block {args.block_size}, {args.layers} layers) "
          f"{dflash['step_s'] * 1e3:.2f} ms = {report['dflash_step_vs_ar']:.2f}x AR (tau {dflash['tau']:.2f})")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dflash_step.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
