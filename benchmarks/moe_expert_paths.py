"""Which expert computation of the MoE block is fastest on this backend, per pass size?

Times one MoE layer (`spec_jax.models.moe.moe_block`) of a preset with each path forced: the
per-pair loop, gathered pairs, every expert (dense) and `jax.lax.ragged_dot`, for passes of
1..256 tokens (random router and weights, so routing spreads as a trained one roughly does), and
prints a table (best of `--repeats` runs, ms) plus what `expert_path` picks.

    python benchmarks/moe_expert_paths.py --preset qwen3-30b-a3b-scaled --tokens 1,2,4,8,16,64,256
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from spec_jax.models import moe
from spec_jax.models.presets import preset_config
from spec_jax.models.weights import init_from_specs, model_weight_specs

PATHS = (moe.LOOP, moe.GATHER, moe.DENSE, moe.RAGGED)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b-scaled")
    p.add_argument("--tokens", default="1,2,4,8,16,64,256")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip", default="gather>64",
                   help="path>T pairs not timed (the gathered copies grow as T * k experts)")
    args = p.parse_args()
    cfg = preset_config(args.preset, args.dtype).replace(num_layers=1)
    lp = init_from_specs(model_weight_specs(cfg)["layers"], jax.random.key(0), jnp.dtype(args.dtype))[0]
    skip = dict(item.split(">") for item in args.skip.split(",") if item)
    print(f"{args.preset}: E={cfg.moe.num_experts} k={cfg.moe.top_k} H={cfg.hidden_size} "
          f"F={cfg.moe.expert_intermediate_size} {args.dtype} on {jax.devices()[0].platform}; ms per MoE layer")
    print("tokens  " + "".join(f"{path:>10s}" for path in PATHS) + "   expert_path picks")
    for t in (int(x) for x in args.tokens.split(",")):
        x = jax.random.normal(jax.random.key(t), (1, t, cfg.hidden_size), jnp.dtype(args.dtype))
        row = []
        for path in PATHS:
            if path in skip and t > int(skip[path]):
                row.append(float("nan"))
                continue
            block = jax.jit(lambda lp, x, path=path: moe.moe_block(lp, x, cfg.moe, path))
            jax.block_until_ready(block(lp, x))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(block(lp, x))
                times.append(time.perf_counter() - t0)
            row.append(1e3 * min(times))
        picked = moe.expert_path(t * cfg.moe.top_k, cfg.moe.num_experts)
        print(f"{t:6d}  " + "".join(f"{ms:10.2f}" for ms in row) + f"   {picked}", flush=True)


if __name__ == "__main__":
    main()
