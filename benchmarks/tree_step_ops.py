"""What a token tree adds to the loop's step, counted in the compiled program: the loop body's
launched operations (fusions, gathers, custom calls: on a GPU about one kernel each) per named
scope, plus what the switches' branches in it launch (the buckets path's cache attention, one switch a
layer), the compile seconds and the step time, for plain decoding, a DFlash chain and DFlash trees.

    python benchmarks/tree_step_ops.py [--target random:tiny] [--trees 0,16,32] [--json PATH]

On the H100 a tree of 32 ran 142 more kernels a step than the chain at Qwen3-8B shapes (~0.7 ms,
RESULTS.md, issue 46); most of what a tree adds does not depend on the model's size (the tree's
build, its ancestor mask, the node depths, the accepted path's walk), so a small target shows it.
The cache attention is the accelerators' ("buckets"), so the program is laid out as on a GPU;
XLA:CPU fuses differently, so the counts are a proxy for the GPU's kernels, not a measure of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hlo_text  # noqa: E402 - beside this script

def top_k_costs(rows: int, vocab: int, k: int = 8, calls: int = 200) -> dict[str, Any]:
    """Milliseconds per call of the best-first tree's top-k over [1, rows, vocab] float32 (a block
    drafter's per-position log-probabilities): XLA's top-k (`jax.lax.top_k`, what the accelerators
    run) against the two-stage one (`tree.chunked_top_k`, what the CPU runs), and whether they
    agree. On the H100 the tree's top-k took 0.14 ms a step (RESULTS.md, issue 46); the two-stage
    one reads the vocabulary once for the chunk maxima, then sorts only k chunks."""
    import jax
    import jax.numpy as jnp

    from spec_jax.drafters.tree import TOP_K_CHUNK, chunked_top_k

    x = jax.random.normal(jax.random.key(0), (1, rows, vocab), jnp.float32)
    variants = {"lax.top_k": jax.jit(lambda v: jax.lax.top_k(v, k))}
    if vocab % TOP_K_CHUNK == 0 and vocab >= k * TOP_K_CHUNK:  # what chunked_top_k takes
        variants["chunked_top_k"] = jax.jit(lambda v: chunked_top_k(v, k))
    out: dict[str, Any] = {"rows": rows, "vocab": vocab, "k": k}
    results = {}
    for name, fn in variants.items():
        results[name] = jax.block_until_ready(fn(x))  # compile and warm
        start = time.perf_counter()
        for _ in range(calls):
            last = fn(x)
        jax.block_until_ready(last)
        out[f"{name}_ms"] = 1e3 * (time.perf_counter() - start) / calls
    if len(results) == 2:
        out["equal"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(*results.values()))
    return out


def measure(target: Any, drafter: Any, params: Any, prompts: list[list[int]], capacity: int,
            new_tokens: int, repeats: int) -> dict[str, Any]:
    from dflash_step import loop_step_seconds

    import spec_jax.decoding.generate  # noqa: F401 - the module, which the package's `generate` hides

    programs = sys.modules["spec_jax.decoding.generate"]._COMPILED
    programs.clear()
    start = time.perf_counter()
    timing = loop_step_seconds(target, prompts, drafter, params, new_tokens=new_tokens, capacity=capacity,
                               repeats=repeats)
    wall = time.perf_counter() - start
    body = hlo_text.largest_loop_body(list(programs.values())[-1].as_text(), metadata=True)
    scopes = hlo_text.launched_by_scope(body)
    branches = hlo_text.switch_branches_launched(list(programs.values())[-1].as_text())
    return {"step_ms": 1e3 * timing["step_s"], "launched": sum(scopes.values()), "by_scope": scopes,
            "body_instructions": len(body), "first_run_s": wall, "switches": len(branches),
            "in_largest_branches": sum(max(b) for b in branches), "switch_branches": branches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="random:tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--trees", default="0,16,32", help="DFlash trees to count (0 = the chain)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="draft layers")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impl", default="buckets", help="cache attention (the accelerators' by default)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import jax
    import numpy as np
    from dflash_step import shaped_drafter

    from spec_jax.checkpoints import load_target
    from spec_jax.decoding.generate import default_capacity
    from spec_jax.models import attention

    trees = tuple(int(t) for t in args.trees.split(","))
    target = load_target(args.target, dtype=args.dtype)
    chain, params = shaped_drafter(target.cfg, args.block_size, args.layers, args.dtype)
    prompts = np.random.default_rng(0).integers(0, target.cfg.vocab_size, (1, args.context)).tolist()
    capacity = default_capacity(args.context, args.new_tokens * args.block_size, max(trees + (args.block_size,)))
    backend, chosen = jax.default_backend(), attention.LIVE_ATTENTION.copy()
    attention.LIVE_ATTENTION[backend] = (args.impl, attention.ACCELERATOR_LIVE_ATTENTION[1])
    try:  # the backend's own choice comes back after (a caller's process goes on)
        rows = {"plain": measure(target, None, None, prompts, capacity, args.new_tokens, args.repeats)}
        for tree in trees:
            label = f"tree {tree}" if tree else f"chain K={chain.k}"
            rows[label] = measure(target, dataclasses.replace(chain, tree=tree), params, prompts, capacity,
                                  args.new_tokens, args.repeats)
    finally:
        attention.LIVE_ATTENTION.clear()
        attention.LIVE_ATTENTION.update(chosen)
    scopes = sorted({s for r in rows.values() for s in r["by_scope"]})
    print(f"{args.target} {args.dtype} on {jax.devices()[0].device_kind}, {args.impl} attention, "
          f"batch 1, context {args.context}")
    print(f"{'program':>14} {'step ms':>8} {'launched':>9} " + " ".join(f"{s:>14}" for s in scopes)
          + f" {'switches':>9} {'in largest':>10} {'first run s':>12}")
    for label, r in rows.items():
        print(f"{label:>14} {r['step_ms']:8.2f} {r['launched']:9d} "
              + " ".join(f"{r['by_scope'].get(s, 0):14d}" for s in scopes)
              + f" {r['switches']:9d} {r['in_largest_branches']:10d} {r['first_run_s']:12.1f}")
    print("launched: the loop body's own work; in largest: what its switches' largest branches launch "
          "besides (the layers' cache attention: one switch a layer on the buckets path)")
    top = top_k_costs(args.block_size, target.cfg.vocab_size)
    print("the tree's top-k over [1, {rows}, {vocab}]: ".format(**top)
          + ", ".join(f"{name[:-3]} {ms:.3f} ms" for name, ms in top.items() if name.endswith("_ms")))
    if args.json is not None:
        report = {"top_k": top, "kind": "tree_step_ops", "target": args.target, "dtype": args.dtype, "impl": args.impl,
                  "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                  "context": args.context, "block_size": args.block_size, "draft_layers": args.layers,
                  "programs": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
