"""The step time of each adaptive depth, measured rather than guessed (`generate(..., k="adaptive")`).

The same policy has to choose well where a wider verify pass is expensive (CPU: 8 tokens cost
about twice one) and where it is nearly free (GPU/TPU), so the costs are timed on the machine: the
compiled loop itself runs with every depth but one disabled (an infinite cost), once for
`new_tokens` tokens and once for prefill alone, and a depth's cost is the difference over its
steps. Nothing recompiles (the costs are traced). The result is kept in
$XDG_CACHE_HOME/spec_jax/depth_costs.json (~/.cache/... when unset; `SPEC_JAX_DEPTH_COSTS` names
another file, or "off" to measure every time), one entry per device kind, model, drafter, depths,
batch bucket and capacity, so a process measures at most once per configuration.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding.compiler_options import compiler_options
from spec_jax.decoding.depth import AdaptiveDepth

OFF = "off"
NEW_TOKENS = 32  # tokens per timed run: a few dozen steps at K = 0, fewer at larger depths
METHOD = "round-robin"  # session 26: each round times every depth once (before: each depth's runs in a row)


def cache_file() -> Path | None:
    """Where measured costs are kept (None: not kept)."""
    override = os.environ.get("SPEC_JAX_DEPTH_COSTS")
    if override:
        return None if override.strip().lower() == OFF else Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spec_jax" / "depth_costs.json"


def batch_bucket(batch: int) -> int:
    return 1 << max(batch - 1, 0).bit_length()


def cost_key(model: Any, drafter: Any, depth: AdaptiveDepth, batch: int, capacity: int) -> str:
    """The device kind, then a digest of what a step's time depends on."""
    device = jax.devices()[0]
    # METHOD names how costs are timed: entries timed another way are measured again. So do the
    # XLA options the programs compile with (on this CPU they moved a 5-token verify from 1.4x a
    # one-token step to 3.4x: benchmarks/RESULTS.md, issue 41, session 27).
    xla = (sorted(compiler_options().items()), os.environ.get("XLA_FLAGS", ""))
    what = repr((METHOD, model, drafter, depth.depths, batch_bucket(batch), capacity, xla))
    return f"{device.platform}:{device.device_kind}:{hashlib.sha256(what.encode()).hexdigest()[:20]}"


def measure_costs(run: Callable[[Any], Any], inputs: Any, depths: tuple[int, ...],
                  new_tokens: int = NEW_TOKENS, repeats: int = 3) -> tuple[float, ...]:
    """Seconds per step at each depth: `run(inputs)` (the compiled adaptive loop) with one depth
    enabled at a time, stop ids off, `new_tokens` tokens, less a prefill-only run; the best of
    `repeats` rounds, each round timing every run once in turn (the machine may be shared, and its
    speed drifts: a depth timed after another's rounds would carry the drift into its ratio)."""
    no_stop = jnp.full_like(inputs.stop_ids, -1)
    n = len(depths)
    # (costs, tokens) of each timed run: prefill alone (max_new_tokens = 1: no step), then each depth.
    configs = [([1.0] * n, 1)] + [([1.0 if j == i else math.inf for j in range(n)], new_tokens) for i in range(n)]
    best, steps = [math.inf] * len(configs), [0] * len(configs)

    from tqdm.auto import tqdm

    # Seconds to tens of seconds on a CPU, once per configuration: say what the pause is.
    with tqdm(total=repeats * len(configs), unit="run", leave=False, disable=None,
              desc=f"timing a step at depths {', '.join(map(str, depths))} (once, kept)") as bar:
        for _ in range(repeats):
            for c, (costs, tokens) in enumerate(configs):
                x = inputs.replace(max_new_tokens=jnp.asarray(tokens, jnp.int32), stop_ids=no_stop,
                                   depth_costs=jnp.asarray(costs, jnp.float32))
                t0 = time.perf_counter()
                out = jax.block_until_ready(run(x))
                best[c], steps[c] = min(best[c], time.perf_counter() - t0), int(out.steps)
                bar.update()
    prefill_s = best[0]
    costs = [max(best[1 + i] - prefill_s, 1e-6) / max(steps[1 + i], 1) for i in range(n)]
    return shallower_never_dearer(costs)


def shallower_never_dearer(costs: Sequence[float]) -> tuple[float, ...]:
    """Costs per depth (ascending depths) with each capped by every deeper depth's: a shallower
    step drafts and verifies a prefix of a deeper step's tokens, so it cannot cost more, and a
    shared machine only ever inflates a timing (a DFlash + lookup run once measured depths 2 and
    4 at twice depth 7's cost; re-measured, they were below it)."""
    capped = list(costs)
    for i in range(len(capped) - 2, -1, -1):
        capped[i] = min(capped[i], capped[i + 1])
    return tuple(capped)


def costs_for(compiled: Callable[[Any], Any], call: Any) -> tuple[float, ...]:
    """The costs for this prepared call (`PreparedCall` with an adaptive `depth`): read from the
    cache file, else measured with its compiled loop and saved."""
    inputs, depth = call.inputs, call.depth
    batch = int(np.shape(inputs.prompt_tokens)[0])
    key = cost_key(call.target.model, call.drafter, depth, batch, call.capacity)
    path = cache_file()
    table = _read(path)
    if key in table and len(table[key]) == len(depth.depths):
        return tuple(float(c) for c in table[key])
    max_new = int(jax.device_get(inputs.max_new_tokens))
    costs = measure_costs(compiled, inputs, depth.depths, new_tokens=max(2, min(NEW_TOKENS, max_new)))
    if path is not None:
        from spec_jax.checkpoints.atomic import write_json_atomic

        table = _read(path)  # another process may have added entries meanwhile
        table[key] = list(costs)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, table)
    return costs


def _read(path: Path | None) -> dict[str, list[float]]:
    if path is None or not path.exists():
        return {}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache file is measured over, never an error
    return table if isinstance(table, dict) else {}
