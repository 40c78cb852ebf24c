"""The engine's host time per chunk: its wall per chunk while serving, against the chunk program
alone, and the part that builds the chunk's arguments (`EnginePrograms.chunk_args`).

The engine is warmed (compiled, and one untimed round served), then serves 2 x --slots greedy requests
(--prompt-tokens each, --new-tokens new, EOS ignored; with --logprobs N each asks for its tokens'
log-probabilities and the N most likely) with `run_all`, counting the bytes the engine brings to
the host; then the same compiled chunk runs --repeats more times on a running row, timed apart from
its arguments. On a small model the host's part is most of a chunk; on a large one it hides under
the device's; after each, its read (the window, `decoding.emitted`) and the whole token and logprobs
buffers it replaced are each copied to the host and timed. --max-model-len sizes the buffers
(default: what the requests need); --mesh runs the engine's rows over --devices fake CPU devices,
where each read of the state is a gather.

    python benchmarks/engine_host_time.py                          # random:tiny, 1 slot
    python benchmarks/engine_host_time.py --target random:llama-3.2-1b --slots 8 --json out.json
    python benchmarks/engine_host_time.py --slots 8 --max-model-len 16384 --logprobs 20 --mesh data=4 --devices 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="random:tiny", help="as load_target takes it (random:PRESET, a path, ...)")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None, help="default: prompt + new tokens + 1")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="requests ask for N top logprobs")
    p.add_argument("--mesh", default=None, help='e.g. "data=4": the engine on a mesh of --devices CPU devices')
    p.add_argument("--devices", type=int, default=None, help="fake CPU devices (set before JAX starts)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    if args.devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}")

    import jax
    import numpy as np

    from spec_jax.checkpoints import load_target
    from spec_jax.decoding.engine import Engine
    from spec_jax.sharding.mesh import make_mesh

    target = load_target(args.target, dtype="float32")
    max_model_len = args.max_model_len or args.prompt_tokens + args.new_tokens + 1
    engine = Engine(target, slots=args.slots, max_model_len=max_model_len,
                    max_logprobs=args.logprobs, mesh=None if args.mesh is None else make_mesh(args.mesh))
    engine.warmup([args.prompt_tokens])
    rng = np.random.default_rng(0)
    fetched = [0]
    host = engine._host

    def counted_host(tree):  # every read of the state the engine makes goes through _host
        out = host(tree)
        fetched[0] += sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(out))
        return out

    engine._host = counted_host

    def submit(count: int) -> None:
        for _ in range(count):
            engine.submit(rng.integers(0, target.cfg.vocab_size, args.prompt_tokens).tolist(),
                          max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=args.logprobs)

    submit(args.slots)
    engine.run_all()  # untimed: every program has run before the timing, whatever warmup() does
    submit(2 * args.slots)
    chunks, t0, fetched[0] = engine.chunks_run, time.perf_counter(), 0
    engine.run_all()
    wall_ms = 1e3 * (time.perf_counter() - t0) / (engine.chunks_run - chunks)
    fetched_kb = fetched[0] / 1024 / (engine.chunks_run - chunks)
    submit(args.slots)
    engine.step()  # admitted, running
    programs, build, run, reads = engine.programs, [], [], {"window": [], "whole": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        chunk_args = programs.chunk_args(engine.state, engine.slot_table, engine.chunk_steps)
        t1 = time.perf_counter()
        engine.state, read = programs.chunk(engine.k, chunk_args)(*chunk_args)
        jax.block_until_ready((engine.state, read))
        build.append(1e3 * (t1 - t0))
        run.append(1e3 * (time.perf_counter() - t1))
        # The chunk's own read against the whole buffers it replaced (ad7dd33's fetch), each copied
        # to the host alone: on an accelerator that is a device-to-host transfer.
        for name, tree in (("window", read), ("whole", (engine.state.tokens, engine.state.logprobs))):
            t0 = time.perf_counter()
            engine._host(tree)
            reads[name].append(1e3 * (time.perf_counter() - t0))
    row = {"target": args.target, "slots": args.slots, "chunk_steps": engine.chunk_steps,
           "capacity": engine.capacity, "logprobs": args.logprobs, "mesh": args.mesh,
           "serving_ms_per_chunk": wall_ms, "host_read_kb_per_chunk": fetched_kb, "program_ms": statistics.median(run),
           "chunk_args_ms": statistics.median(build), "read_window_ms": statistics.median(reads["window"]),
           "read_whole_buffers_ms": statistics.median(reads["whole"]), "device": str(jax.devices()[0].platform)}
    print(f"{args.target}, {args.slots} slot(s), capacity {engine.capacity}, logprobs {args.logprobs}, "
          f"mesh {args.mesh}: the host read {fetched_kb:.1f} KB a chunk; copying it "
          f"{row['read_window_ms']:.3f} ms, the whole buffers {row['read_whole_buffers_ms']:.3f} ms")
    print(f"{args.target}, {args.slots} slot(s), chunks of {engine.chunk_steps}: serving {wall_ms:.3f} ms a chunk; "
          f"the chunk program alone {row['program_ms']:.3f} ms, its arguments {row['chunk_args_ms']:.3f} ms "
          f"(medians of {args.repeats}); the rest of serving's chunk is the host's "
          f"({wall_ms - row['program_ms'] - row['chunk_args_ms']:.3f} ms: fetch, hand-out, scheduling)")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
