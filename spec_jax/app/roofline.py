"""How far one decoding step is from the memory-bandwidth floor, and what verifying T tokens costs.

    spec-jax bench --roofline --target random:llama-3.2-1b --dtype bfloat16 --out results/

    from spec_jax.app import roofline
    from spec_jax.checkpoints import load_target
    report = roofline.run_roofline(load_target("random:llama-3.2-1b", dtype="bfloat16"))
    roofline.print_roofline(report); roofline.write_roofline(report, "results/")

Measured on the default device, all in one process:
- copy bandwidth: a jitted `x + 1` over a buffer far larger than any cache (bytes read + written
  per second), the best a memory-bound kernel can do here;
- the floor: parameter bytes / that bandwidth, since every decode step reads every weight once
  (the KV cache read is listed apart: it grows with the context). A mixture-of-experts target
  reads only the experts its tokens route to: its floor counts every other weight plus the
  expected union of the batch's experts (`spec_jax.models.moe.param_counts`), and each verify
  row its own T tokens' union, which grows from k experts per layer towards all of them;
- the AR step: per-step time of the real loop (`generate` with no drafter, K = 0), and of a bare
  jitted one-token forward against the same cache;
- verify cost: a jitted forward of T tokens (T = K + 1 of a speculative step) against a cache that
  holds `context` tokens, relative to T = 1. Speculation pays off while this stays near 1, i.e.
  while the step is memory-bound rather than compute-bound.
Every time is the best of several runs (the work is deterministic; the fastest run is the one the
rest of the machine disturbed least).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.app import inputs
from spec_jax.app.common import emit, log, parse_positive_ints
from spec_jax.decoding.generate import default_capacity, generate
from spec_jax.decoding.programs import compile_counted
from spec_jax.models.decoder import KVCache, forward, init_cache

DEFAULT_VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def best_seconds(call: Callable[[], Any], repeats: int) -> float:
    # Best of N: the work is deterministic, so the fastest run is the one least disturbed by
    # the rest of the machine.
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_copy_bandwidth(nbytes: int | None = None, repeats: int = 10) -> dict[str, float]:
    """Bytes moved (read + written) per second by a jitted elementwise pass over `nbytes`."""
    nbytes = nbytes or (256 << 20 if _on_cpu() else 2 << 30)
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    bump = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # donated: no allocation in the timing
    state = {"x": bump(x)}

    def step():
        state["x"] = bump(state["x"])
        return state["x"]

    step()
    seconds = best_seconds(step, repeats)
    moved = 2 * state["x"].nbytes
    return {"buffer_bytes": float(state["x"].nbytes), "seconds": seconds, "bytes_per_s": moved / seconds}


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def _verify_pass(params: Any, cfg: Any, tokens: jax.Array, positions: jax.Array, cache: KVCache):
    # What a verify step computes: logits of every token and the target's choice at each.
    logits, _, cache = forward(params, cfg, tokens, positions, cache)
    return jnp.argmax(logits, axis=-1), cache


def verify_costs(
    target: Any,
    *,
    batch: int,
    context: int,
    capacity: int,
    verify_tokens: Sequence[int],
    repeats: int,
    on_done: Callable[[], None] = lambda: None,
) -> dict[int, float]:
    """Best-of-`repeats` seconds of one forward of T tokens at positions context..context+T-1, per T."""
    cfg, params = target.cfg, target.params
    cache = init_cache(cfg, batch, capacity).with_lengths(jnp.full((batch,), context, jnp.int32))
    rng = np.random.default_rng(0)
    seconds = {}
    for t in verify_tokens:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, t)), jnp.int32)
        positions = jnp.broadcast_to(context + jnp.arange(t, dtype=jnp.int32), (batch, t))
        state = {"cache": cache}
        # With the options the loop's programs compile with (the command line's XLA:CPU mode), and
        # counted with them (the quick GPU suite's verify_cost step reports its cache hits).
        pass_t = compile_counted(lambda: _verify_pass.lower(params, cfg, tokens, positions, cache))

        def call():
            out, state["cache"] = pass_t(params, tokens, positions, state["cache"])
            return out

        call()  # warm
        seconds[t] = best_seconds(call, repeats)
        cache = state["cache"].with_lengths(jnp.full((batch,), context, jnp.int32))
        on_done()
    return seconds


def ar_loop_step(
    target: Any, *, batch: int, context: int, capacity: int, new_tokens: int, repeats: int
) -> dict[str, float]:
    """Per-step seconds of the real decoding loop with no drafter (prefill excluded by difference)."""
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, target.cfg.vocab_size, (batch, context)).tolist()

    def run(n: int) -> float:
        kwargs = dict(max_new_tokens=n, ignore_eos=True, capacity=capacity)
        generate(target, prompts, **kwargs)  # compile + warm
        return min(generate(target, prompts, **kwargs).generate_s for _ in range(repeats))

    # Prefill + 1 step vs prefill + new_tokens steps: the difference is new_tokens - 1 loop steps.
    short, long = run(1), run(new_tokens)
    return {"step_s": (long - short) / (new_tokens - 1), "prefill_s": short, "new_tokens": new_tokens}


def run_roofline(
    target: Any,
    *,
    batch: int = 1,
    context: int = 256,
    verify_tokens: Sequence[int] = DEFAULT_VERIFY_TOKENS,
    new_tokens: int = 64,
    repeats: int | None = None,
    copy_bytes: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure everything in the module docstring; return a JSON-ready report."""
    from tqdm import tqdm

    if batch < 1 or context < 1 or new_tokens < 2:
        raise ValueError("roofline needs batch >= 1, context >= 1 and new_tokens >= 2.")
    if not verify_tokens or min(verify_tokens) < 1:
        raise ValueError(f"verify token counts must be >= 1, got {list(verify_tokens)}.")
    verify_tokens = sorted(set(int(t) for t in verify_tokens) | {1})
    repeats = repeats or (5 if _on_cpu() else 20)
    cfg = target.cfg
    # The loop's own rounding: context + the longest pass (+ 1), up to a multiple of 256.
    capacity = default_capacity(context, max(max(verify_tokens), new_tokens), 0)
    if capacity > cfg.max_position_embeddings:
        raise ValueError(
            f"context {context} + {max(verify_tokens)} tokens exceeds the model's "
            f"{cfg.max_position_embeddings} positions; lower --context."
        )
    bar = tqdm(total=len(verify_tokens) + 2, desc="roofline", file=sys.stderr, disable=not progress)
    bar.set_postfix_str("copy bandwidth")
    copy = measure_copy_bandwidth(copy_bytes, repeats=max(repeats, 10))
    bar.update(1)
    bar.set_postfix_str("verify passes")
    verify = verify_costs(
        target, batch=batch, context=context, capacity=capacity, verify_tokens=verify_tokens,
        repeats=repeats, on_done=lambda: bar.update(1),
    )
    bar.set_postfix_str("AR loop")
    ar = ar_loop_step(
        target, batch=batch, context=context, capacity=capacity, new_tokens=new_tokens,
        repeats=max(3, repeats // 2),
    )
    bar.update(1)
    bar.close()

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
    read_bytes = weight_bytes - gathered_bytes(cfg, target.params)
    # The loop's attention reads the whole cache buffer (masked), keys and values of every layer.
    cache_bytes = cfg.kv_bytes_per_token * batch * capacity
    bandwidth, step_bytes = copy["bytes_per_s"], weight_bytes_read(cfg, read_bytes, batch)
    floor_s = step_bytes / bandwidth
    device = jax.devices()[0]
    base = verify[1]
    return {
        "kind": "roofline",
        "target": target.source,
        "dtype": cfg.dtype,
        "params": int(sum(x.size for x in jax.tree.leaves(target.params))),
        "weight_bytes": int(weight_bytes),
        "step_weight_bytes": int(step_bytes),  # what one decode step reads (MoE: routed experts)
        "cache_bytes": int(cache_bytes),
        "batch": batch,
        "context": context,
        "capacity": capacity,
        "copy": copy,
        "floor_ms": 1e3 * floor_s,
        "floor_with_cache_ms": 1e3 * (step_bytes + cache_bytes) / bandwidth,
        "ar_loop_step_ms": 1e3 * ar["step_s"],
        "ar_prefill_ms": 1e3 * ar["prefill_s"],
        "forward_1_token_ms": 1e3 * base,
        "ar_step_over_floor": ar["step_s"] / floor_s,
        "verify": [{"tokens": t, "ms": 1e3 * s, "relative": s / base, "ms_per_token": 1e3 * s / t,
                    "floor_ms": 1e3 * weight_bytes_read(cfg, read_bytes, batch * t) / bandwidth}
                   for t, s in verify.items()],
        "repeats": repeats,
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')} x{jax.device_count()}",
        "jax": jax.__version__,
        "host": platform.node(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def gathered_bytes(cfg: Any, params: Any) -> int:
    """Bytes of `params` a step gathers rows of rather than reads whole: an untied model's input
    embedding (on CPU every model is untied: `load_target` gives a tied head its own copy)."""
    return 0 if cfg.tie_embeddings else int(params["embed"].nbytes)


def weight_bytes_read(cfg: Any, weight_bytes: int, tokens: int) -> float:
    """Bytes of the `weight_bytes` a pass of `tokens` tokens reads: all of them, except a MoE
    target's unrouted experts (the expected union of the tokens' choices is read)."""
    from spec_jax.models.moe import param_counts

    counts = param_counts(cfg, tokens)
    return weight_bytes * counts["read"] / counts["total"]


def print_roofline(report: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    gb = report["copy"]["bytes_per_s"] / 1e9
    print(
        f"{report['target']} ({report['dtype']}, {report['params'] / 1e6:.1f}M params, "
        f"{report['weight_bytes'] / 2**20:.0f} MiB) on {report['device']}, batch {report['batch']}, "
        f"context {report['context']}",
        file=file,
    )
    print(f"copy bandwidth            {gb:9.1f} GB/s (read + write)", file=file)
    # A MoE target's floor grows with T (the union of the tokens' routed experts); a dense one's not.
    moe = len({row["floor_ms"] for row in report["verify"]}) > 1
    if report["step_weight_bytes"] != report["weight_bytes"]:
        print(f"a step reads              {report['step_weight_bytes'] / 2**20:9.0f} MiB of the weights "
              f"({'routed experts only' if moe else 'not the input embedding: a step gathers its rows'})", file=file)
    print(f"floor (weights / bw)      {report['floor_ms']:9.3f} ms", file=file)
    print(f"floor incl. KV cache      {report['floor_with_cache_ms']:9.3f} ms "
          f"({report['cache_bytes'] / 2**20:.0f} MiB cache)", file=file)
    print(f"AR step in the loop       {report['ar_loop_step_ms']:9.3f} ms "
          f"= {report['ar_step_over_floor']:.2f}x floor", file=file)
    print(f"bare 1-token forward      {report['forward_1_token_ms']:9.3f} ms", file=file)
    print("verify T tokens           ms       x T=1   ms/token" + ("   floor ms (experts read)" if moe else ""),
          file=file)
    for row in report["verify"]:
        print(f"  T={row['tokens']:<3d}                {row['ms']:9.3f} {row['relative']:7.2f} "
              f"{row['ms_per_token']:9.3f}" + (f" {row['floor_ms']:9.3f}" if moe else ""), file=file)


def write_roofline(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """roofline.json and roofline.png (step times vs the floor; verify cost vs T) in `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "roofline.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["floor\n(weights)", "floor\n(+KV cache)", "AR step\n(loop)", "1-token\nforward"]
    values = [report["floor_ms"], report["floor_with_cache_ms"], report["ar_loop_step_ms"],
              report["forward_1_token_ms"]]
    left.bar(names, values, color=["#999999", "#bbbbbb", "#1f77b4", "#ff7f0e"])
    left.set_ylabel("ms per step")
    left.set_title("decode step vs memory-bandwidth floor")
    ts = [r["tokens"] for r in report["verify"]]
    right.plot(ts, [r["relative"] for r in report["verify"]], "o-", label="measured")
    if report["step_weight_bytes"] != report["weight_bytes"]:  # MoE: the union of routed experts grows
        first = report["verify"][0]["floor_ms"]
        right.plot(ts, [r["floor_ms"] / first for r in report["verify"]], "s--", label="expert reads (floor x T=1)")
    right.plot(ts, ts, ":", color="gray", label="compute-bound (x T)")
    right.axhline(1.0, color="gray", linestyle="--", label="memory-bound (x 1)")
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xlabel("tokens verified in one pass (K + 1)")
    right.set_ylabel("time relative to 1 token")
    right.set_title("verify cost")
    right.legend()
    fig.suptitle(f"{report['target']} {report['dtype']} on {report['device']}")
    fig.tight_layout()
    png_path = out / "roofline.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return [json_path, png_path]


def run_command(args: argparse.Namespace) -> dict[str, Any] | None:
    verify_tokens = parse_positive_ints(args.verify_tokens, "--verify-tokens", "1,4,16")
    if args.batch_size < 1 or args.context < 1:
        raise inputs.UsageError("--batch-size and --context must be >= 1.")
    if args.mesh:
        raise inputs.UsageError("--roofline measures one device; drop --mesh.")
    target = inputs.load_target_or_fail(args.target, args.dtype)
    log(f"loaded {target.source} ({target.cfg.dtype})")
    report = run_roofline(
        target,
        batch=args.batch_size,
        context=args.context,
        verify_tokens=verify_tokens,
        new_tokens=max(2, args.max_new_tokens),
        progress=not args.no_progress,
    )
    return emit(args, report, write_roofline, print_roofline)
