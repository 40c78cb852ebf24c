"""How the layout of decoder-layer weights changes XLA:CPU decode speed (an experiment, not the library).

    python benchmarks/cpu_layer_layout.py [--tokens 1 5] [--steps 20]

The matmuls of SmolLM2-135M's 30 layers (attention softmax left out; projections and MLP only),
run as 20 decode steps inside one jitted `fori_loop`, the way the generate loop runs them:
- scan:         weights stacked [L, ...] and a `lax.scan` over layers (what spec_jax does; one
                program per layer, the form TPU/GPU compilers want);
- unrolled:     the same stacked weights, a Python loop slicing layer i;
- list:         one array per layer per weight (no stacking), a Python loop;
- *_fused:      q/k/v and gate/up concatenated into one matrix each (fewer, wider matmuls).
Prints ms per step, the weight bytes streamed per second, and the ratio to `scan`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

H, N, KV, D, F, L = 576, 9, 3, 64, 1536, 30  # SmolLM2-135M


def make_layer(fused: bool):
    def layer(x, lp):
        if fused:
            qkv = x @ lp["wqkv"]
            q, k, v = qkv[..., : N * D], qkv[..., N * D : (N + KV) * D], qkv[..., (N + KV) * D :]
            gate_up = None
        else:
            q, k, v = x @ lp["wq"], x @ lp["wk"], x @ lp["wv"]
        attn = q + jnp.tile(k + v, (1, 1, N // KV))  # stands in for attention: same shapes
        x = x + attn @ lp["wo"]
        if fused:
            gate_up = x @ lp["wgu"]
            gate, up = gate_up[..., :F], gate_up[..., F:]
        else:
            gate, up = x @ lp["wg"], x @ lp["wu"]
        return x + (jax.nn.silu(gate) * up) @ lp["wd"]

    return layer


def stacked_weights(fused: bool) -> dict[str, jax.Array]:
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def w(*shape):
        return 0.02 * jax.random.normal(next(keys), (L, *shape), jnp.float32)

    p = dict(wq=w(H, N * D), wk=w(H, KV * D), wv=w(H, KV * D), wo=w(N * D, H), wg=w(H, F),
             wu=w(H, F), wd=w(F, H))
    if fused:
        p = dict(wqkv=jnp.concatenate([p["wq"], p["wk"], p["wv"]], -1), wo=p["wo"],
                 wgu=jnp.concatenate([p["wg"], p["wu"]], -1), wd=p["wd"])
    return p


def variants(steps: int):
    for fused in (False, True):
        layer = make_layer(fused)
        stacked = stacked_weights(fused)
        per_layer = [{k: v[i] for k, v in stacked.items()} for i in range(L)]
        suffix = "_fused" if fused else ""

        def scan_step(p, x, layer=layer):
            return jax.lax.scan(lambda x, lp: (layer(x, lp), None), x, p)[0]

        def unrolled_step(p, x, layer=layer):
            for i in range(L):
                x = layer(x, {k: v[i] for k, v in p.items()})
            return x

        def list_step(p, x, layer=layer):
            for lp in p:
                x = layer(x, lp)
            return x

        for name, step, params in (("scan", scan_step, stacked), ("unrolled", unrolled_step, stacked),
                                   ("list", list_step, per_layer)):
            run = jax.jit(lambda p, x, step=step: jax.lax.fori_loop(0, steps, lambda i, x: step(p, x), x))
            yield name + suffix, run, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5], help="tokens per pass (K + 1)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    for tokens in args.tokens:
        x = jnp.full((1, tokens, H), 0.01, jnp.float32)
        base = None
        for name, run, params in variants(args.steps):
            jax.block_until_ready(run(params, x))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(run(params, x))
                times.append((time.perf_counter() - t0) / args.steps)
            step_s = statistics.median(times)
            base = base or step_s
            nbytes = sum(v.nbytes for v in jax.tree.leaves(params))
            print(f"T={tokens} {name:15s} {1e3 * step_s:7.2f} ms/step {nbytes / step_s / 1e9:6.1f} GB/s "
                  f"{base / step_s:5.2f}x vs scan", flush=True)


if __name__ == "__main__":
    main()
