"""The engine's host time per chunk: its wall per chunk while serving, against the chunk program
alone, and the part that builds the chunk's arguments (`EnginePrograms.chunk_args`).

The engine is warmed (compiled, and one untimed round served), then serves 2 x --slots greedy requests
(--prompt-tokens each, --new-tokens new, EOS ignored) with `run_all`; then the same compiled chunk
runs --repeats more times on a running row, timed apart from its arguments. On a small model the
host's part is most of a chunk; on a large one it hides under the device's.

    python benchmarks/engine_host_time.py                          # random:tiny, 1 slot
    python benchmarks/engine_host_time.py --target random:llama-3.2-1b --slots 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="random:tiny", help="as load_target takes it (random:PRESET, a path, ...)")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()

    import jax
    import numpy as np

    from spec_jax.checkpoints import load_target
    from spec_jax.decoding.engine import Engine

    target = load_target(args.target, dtype="float32")
    engine = Engine(target, slots=args.slots, max_model_len=args.prompt_tokens + args.new_tokens + 1)
    engine.warmup([args.prompt_tokens])
    rng = np.random.default_rng(0)

    def submit(count: int) -> None:
        for _ in range(count):
            engine.submit(rng.integers(0, target.cfg.vocab_size, args.prompt_tokens).tolist(),
                          max_new_tokens=args.new_tokens, ignore_eos=True)

    submit(args.slots)
    engine.run_all()  # untimed: every program has run before the timing, whatever warmup() does
    submit(2 * args.slots)
    chunks, t0 = engine.chunks_run, time.perf_counter()
    engine.run_all()
    wall_ms = 1e3 * (time.perf_counter() - t0) / (engine.chunks_run - chunks)
    submit(args.slots)
    engine.step()  # admitted, running
    programs, build, run = engine.programs, [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        chunk_args = programs.chunk_args(engine.state, engine.slot_table, engine.chunk_steps)
        t1 = time.perf_counter()
        engine.state = programs.chunk(engine.k, chunk_args)(*chunk_args)
        jax.block_until_ready(engine.state)
        build.append(1e3 * (t1 - t0))
        run.append(1e3 * (time.perf_counter() - t1))
    engine.run_all()
    row = {"target": args.target, "slots": args.slots, "chunk_steps": engine.chunk_steps,
           "serving_ms_per_chunk": wall_ms, "program_ms": statistics.median(run),
           "chunk_args_ms": statistics.median(build)}
    print(f"{args.target}, {args.slots} slot(s), chunks of {engine.chunk_steps}: serving {wall_ms:.3f} ms a chunk; "
          f"the chunk program alone {row['program_ms']:.3f} ms, its arguments {row['chunk_args_ms']:.3f} ms "
          f"(medians of {args.repeats}); the rest of serving's chunk is the host's "
          f"({wall_ms - row['program_ms'] - row['chunk_args_ms']:.3f} ms: fetch, hand-out, scheduling)")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
