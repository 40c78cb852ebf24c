"""What `Engine.warmup()`'s runs save the first requests: a program's first run costs more than its
later ones, so an engine warmed by compiling alone leaves that to the first request of each prompt
bucket. Each mode runs in a fresh process (an executable's first run happens once per process):

    compile-only   warmup(run=False)
    with runs      warmup() (each program compiled, then run once on slot 0)

Each process then sends --requests requests one at a time (prompts of --prompt-tokens, each of its
own bucket with --buckets) and times each one's first `Engine.step()` (its admit, first token and
first chunk: the first runs of both programs), and prints the warm-up's seconds and the steps'.

    python benchmarks/first_request.py                       # the default model, 8 slots
    python benchmarks/first_request.py --target random:tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODES = {"compile-only": False, "with runs": True}


def child(args: argparse.Namespace) -> dict:
    import numpy as np

    from spec_jax.checkpoints import load_target
    from spec_jax.decoding.engine import Engine

    target = load_target(args.target, dtype="float32")
    engine = Engine(target, None, None, slots=args.slots, max_model_len=args.max_model_len)
    report = engine.warmup(run=MODES[args.child])
    rng = np.random.default_rng(0)
    lengths = [args.prompt_tokens * 2**i if args.buckets else args.prompt_tokens for i in range(args.requests)]
    first_steps = []
    for length in lengths:
        engine.submit(rng.integers(0, target.cfg.vocab_size, length).tolist(), max_new_tokens=8, ignore_eos=True)
        t0 = time.perf_counter()
        engine.step()
        first_steps.append(time.perf_counter() - t0)
        engine.run_all()
    return {"mode": args.child, "warmup_s": report.seconds, "run_s": report.run_seconds,
            "programs": report.programs, "programs_run": report.programs_run, "prompt_tokens": lengths,
            "first_step_ms": [1e3 * t for t in first_steps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="as load_target takes it (default: the default model)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--buckets", action="store_true", help="each request twice the last's length (a new bucket)")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    passed = [*(["--target", args.target] if args.target else []), "--slots", str(args.slots), "--max-model-len",
              str(args.max_model_len), "--prompt-tokens", str(args.prompt_tokens), "--requests", str(args.requests),
              *(["--buckets"] if args.buckets else [])]
    rows = []
    for mode in MODES:
        proc = subprocess.run([sys.executable, __file__, *passed, "--child", mode], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent, timeout=1800)
        if proc.returncode:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = rows[0]["first_step_ms"][0]
    print("| warm-up | compile s | runs s | request 1 ms (vs compile-only) | later requests ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        steps = r["first_step_ms"]
        print(f"| {r['mode']} | {r['warmup_s']:.1f} | {r['run_s']:.1f} | {steps[0]:.0f} ({steps[0] / base:.2f}x) | "
              + ", ".join(f"{t:.0f}" for t in steps[1:]) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
