"""AR decode step against the memory floor for different layouts of the decoder-layer weights.

    python benchmarks/layer_layout.py                                   # llama-3.2-1b and qwen3-8b
    python benchmarks/layer_layout.py --presets smollm2-135m --dtype float32 --out DIR

Reproduces the table of the per-layer-weights issue on any backend with one command. For each
random-weight preset (real shapes, `spec_jax.models.presets`), batch 1, `--context` tokens cached:
- floor:         weight bytes / the copy bandwidth of a jitted elementwise pass (`spec_jax.app.roofline`);
- spec_jax loop: the AR step of the real `generate` loop (prefill removed by difference);
- minimal loops: `--steps` greedy decode steps in one jitted `fori_loop` built from the decoder's
  own `decoder_layer`, attending to a read-only cache of `--context` tokens, with the layer
  weights laid out as
    scan           stacked [L, ...] arrays, `lax.scan` over layers
    scan_unrolled  the same, `lax.scan(unroll=True)`
    static_slices  stacked arrays, a Python loop slicing layer i
    per_layer      one array per layer (what spec_jax stores), a Python loop.
Every time is the best of `--repeats` runs. The stacked copy is built from the per-layer weights
and freed after its rows, so peak memory is about twice the weights.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.checkpoints import random_target
from spec_jax.models.decoder import (
    decoder_layer,
    embed,
    lm_head,
    rms_norm,
    rope_inv_freq,
    window_mask,
)
from spec_jax.app.roofline import ar_loop_step, best_seconds, measure_copy_bandwidth

LAYOUTS = ("scan", "scan_unrolled", "static_slices", "per_layer")


def minimal_decode(layout: str, cfg: Any, steps: int):
    """A jitted function (params, layers, cache_k, cache_v, token) -> last token after `steps`
    greedy steps; `layers` / `cache_*` are stacked [L, ...] or per-layer lists per `layout`."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def layer(x, lp, k_cache, v_cache, position):
        # Attend to the cached context and this token's own key (no cache write: weights only).
        slots = jnp.arange(k_cache.shape[2], dtype=jnp.int32)[None]
        mask = window_mask(position, slots, cfg.layer_windows[0])
        self_mask = jnp.ones((1, 1, 1), bool)
        attend_to = lambda k, v: ([(k_cache, v_cache, mask), (k, v, self_mask)], None)  # noqa: E731
        x, _ = decoder_layer(lp, x, position, inv_freq, cfg.rms_norm_eps, attend_to)
        return x

    def step(i, carry, params, layers, cache_k, cache_v):
        token, position = carry
        x = embed(params, token)  # [1, 1, H]
        if layout in ("scan", "scan_unrolled"):
            def body(x, xs):
                return layer(x, *xs, position), None

            x, _ = jax.lax.scan(body, x, (layers, cache_k, cache_v), unroll=layout == "scan_unrolled")
        elif layout == "static_slices":
            for l in range(cfg.num_layers):
                lp = jax.tree.map(lambda w: w[l], layers)
                x = layer(x, lp, cache_k[l], cache_v[l], position)
        else:
            for lp, k_cache, v_cache in zip(layers, cache_k, cache_v):
                x = layer(x, lp, k_cache, v_cache, position)
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        token = jnp.argmax(lm_head(params, cfg, x), axis=-1).astype(jnp.int32)
        return token, position + 1

    @jax.jit
    def run(params, layers, cache_k, cache_v, token, position):
        body = functools.partial(step, params=params, layers=layers, cache_k=cache_k, cache_v=cache_v)
        return jax.lax.fori_loop(0, steps, body, (token, position))[0]

    return run


def measure_preset(preset: str, dtype: str, context: int, steps: int, repeats: int) -> dict:
    target = random_target(preset, dtype)
    cfg, params = target.cfg, target.params
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bandwidth = measure_copy_bandwidth()["bytes_per_s"]
    row: dict[str, Any] = {
        "preset": preset,
        "dtype": dtype,
        "device": str(jax.devices()[0].device_kind),
        "context": context,
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "floor_ms": 1e3 * weight_bytes / bandwidth,
    }
    capacity = -(-(context + steps + 1) // 256) * 256
    loop = ar_loop_step(
        target, batch=1, context=context, capacity=capacity, new_tokens=steps, repeats=repeats
    )
    row["spec_jax_loop_ms"] = 1e3 * loop["step_s"]

    kv_shape = (1, cfg.num_kv_heads, context, cfg.head_dim)
    key = jax.random.key(0)
    cache_k = [jax.random.normal(key, kv_shape, cfg.dtype) for _ in range(cfg.num_layers)]
    cache_v = [jax.random.normal(key, kv_shape, cfg.dtype) for _ in range(cfg.num_layers)]
    token = jnp.zeros((1, 1), jnp.int32)
    position = jnp.full((1, 1), context, jnp.int32)
    rest = {name: value for name, value in params.items() if name != "layers"}
    for layout in LAYOUTS:
        if layout == "per_layer":
            layers, ks, vs = params["layers"], cache_k, cache_v
        else:
            layers = jax.tree.map(lambda *w: jnp.stack(w), *params["layers"])
            ks, vs = jnp.stack(cache_k), jnp.stack(cache_v)
        run = minimal_decode(layout, cfg, steps)
        call = functools.partial(run, rest, layers, ks, vs, token, position)
        jax.block_until_ready(call())  # compile + warm
        seconds = best_seconds(call, repeats)
        row[f"{layout}_ms"] = 1e3 * seconds / steps
        del layers, ks, vs
    return row


def print_table(rows: list[dict]) -> None:
    head = ["preset", "dtype", "floor ms", "spec_jax loop"] + list(LAYOUTS)
    print(" | ".join(head))
    for r in rows:
        floor = r["floor_ms"]
        cells = [r["preset"], r["dtype"], f"{floor:.2f}"]
        for name in ["spec_jax_loop"] + list(LAYOUTS):
            ms = r[f"{name}_ms"]
            cells.append(f"{ms:.2f} ({ms / floor:.2f}x)")
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["llama-3.2-1b", "qwen3-8b"])
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 elsewhere")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write layer_layout.json here")
    args = parser.parse_args(argv)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    rows = []
    for preset in args.presets:
        print(f"measuring {preset} ({dtype}) ...", file=sys.stderr, flush=True)
        rows.append(measure_preset(preset, dtype, args.context, args.steps, args.repeats))
    print_table(rows)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "layer_layout.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
