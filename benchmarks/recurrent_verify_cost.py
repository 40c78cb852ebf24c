"""What a verify pass costs on a hybrid recurrent target (issue 44): one jitted pass of T tokens
(a chain after a committed context) plus the commit that keeps them all, for T = 1..32, on a
random-weight preset; with the rollback memory per row (the pass record of every Gated DeltaNet
layer, `spec_jax.models.gated_deltanet.rollback_bytes_per_row`) next to the state itself.

    python benchmarks/recurrent_verify_cost.py                                   # this CPU: qwen3.5-9b-scaled
    python benchmarks/recurrent_verify_cost.py --preset qwen3.5-9b --dtype bfloat16 --context 1024   # a GPU

Prints one JSON line per T and a Markdown table (benchmarks/RESULTS.md, "Issue 44").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from spec_jax.models import Decoder, init_params
from spec_jax.models.decoder import delta_net_dims
from spec_jax.models.gated_deltanet import rollback_bytes_per_row
from spec_jax.models.presets import preset_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-9b-scaled")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=512, help="committed tokens before the pass")
    parser.add_argument("--lengths", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    cfg = preset_config(args.preset, args.dtype)
    model = Decoder(cfg)
    params = init_params(cfg, jax.random.key(0))
    lengths = [int(t) for t in args.lengths.split(",")]
    capacity = args.context + max(lengths)
    tokens = jax.random.randint(jax.random.key(1), (1, args.context), 0, cfg.vocab_size)
    prefill = jax.jit(lambda p, t: model.commit(
        model.forward(p, t, jnp.arange(args.context)[None], model.init_cache(1, capacity)).cache,
        jnp.asarray([args.context])))
    cache = jax.block_until_ready(prefill(params, tokens))

    @jax.jit
    def verify(p, cache, t):  # a pass of T tokens and the commit of all of them
        positions = args.context + jnp.arange(t.shape[1])[None]
        out = model.forward(p, t, positions, cache)
        return model.logits(p, out.hidden[:, -1]), model.commit(out.cache, cache.lengths + t.shape[1])

    linear = sum(map(cfg.is_linear_attention, range(cfg.num_layers)))
    dims = delta_net_dims(cfg)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    state_bytes = linear * (4 * dims.value_heads * dims.key_dim * dims.value_dim
                            + itemsize * (dims.conv_kernel - 1) * dims.conv_channels)
    rows = []
    for t in lengths:
        pass_tokens = jnp.zeros((1, t), jnp.int32)
        jax.block_until_ready(verify(params, cache, pass_tokens))  # compile
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(verify(params, cache, pass_tokens))
            times.append(time.perf_counter() - start)
        rows.append({"T": t, "ms": 1e3 * statistics.median(times),
                     "rollback_MiB_per_row": linear * rollback_bytes_per_row(dims, t, itemsize) / 2**20})
        print(json.dumps({"preset": args.preset, "dtype": args.dtype, "context": args.context,
                          "backend": jax.default_backend(), **rows[-1]}), flush=True)
    base = rows[0]["ms"]
    print(f"\n{args.preset} ({cfg.dtype}, {linear} Gated DeltaNet layers, state {state_bytes / 2**20:.1f} MiB "
          f"per row), context {args.context}, {jax.default_backend()}")
    print("| T | verify + commit (ms) | vs T=1 | rollback memory per row (MiB) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['ms']:.1f} | {r['ms'] / base:.2f}x | {r['rollback_MiB_per_row']:.1f} |")


if __name__ == "__main__":
    main()
