"""The plain decode step of a random-weight Gemma 4 (issue 40), optionally scaled down to fit a
small host: ms per step of the real loop (`generate`, no drafter), prefill excluded by difference
(`spec_jax.app.roofline.ar_loop_step`).

    python benchmarks/gemma4_step.py --preset gemma-4-e4b --layers 12 --vocab 32768   # this CPU
    python benchmarks/gemma4_step.py --preset gemma-4-e4b --dtype bfloat16            # a GPU

`--layers N` keeps the preset's first N layer types (the last forced to full attention, as
transformers does) and the same share of KV-shared layers; `--vocab V` shrinks the vocabulary
and the per-layer-embedding table. Every layer keeps its real shapes, so the per-layer cost is
the real model's. The full-size GPU number also comes from
`spec-jax bench --roofline --target random:gemma-4-e4b --dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax


def scaled_config(preset: str, dtype: str, layers: int | None, vocab: int | None):
    from spec_jax.models.config import FULL_ATTENTION
    from spec_jax.models.presets import preset_config

    cfg = preset_config(preset, dtype)
    if layers is not None and layers != cfg.num_layers:
        types = list(cfg.layer_types[:layers])
        types[-1] = FULL_ATTENTION
        shared = round(cfg.num_kv_shared_layers * layers / cfg.num_layers)
        cfg = cfg.replace(num_layers=layers, layer_types=tuple(types), num_kv_shared_layers=shared)
    if vocab is not None:
        cfg = cfg.replace(vocab_size=vocab, per_layer_vocab_size=vocab if cfg.per_layer_input_size else 0)
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gemma-4-e4b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (and per-layer table) size")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from spec_jax.app.roofline import ar_loop_step
    from spec_jax.checkpoints import LoadedModel
    from spec_jax.decoding.generate import default_capacity
    from spec_jax.models.decoder import init_params

    cfg = scaled_config(args.preset, args.dtype, args.layers, args.vocab)
    params = jax.jit(functools.partial(init_params, cfg, scale=0.5))(jax.random.key(0))
    target = LoadedModel(cfg, params, None, None, f"random:{args.preset}")
    capacity = default_capacity(args.context, args.new_tokens, 0)
    step = ar_loop_step(target, batch=args.batch, context=args.context, capacity=capacity,
                        new_tokens=args.new_tokens, repeats=args.repeats)
    table = params.get("per_layer_embed")
    print(json.dumps({
        "preset": args.preset, "layers": cfg.num_layers, "kv_shared_layers": cfg.num_kv_shared_layers,
        "vocab": cfg.vocab_size, "dtype": cfg.dtype, "batch": args.batch, "context": args.context,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        # A step gathers L x P values of the per-layer table, not the table: the bytes it reads.
        "weight_bytes_per_step": int(sum(x.nbytes for x in jax.tree.leaves(params))
                                     - (0 if table is None else table.nbytes)),
        "cache_arrays": len(cfg.kv_cache_shapes), "ar_step_ms": 1e3 * step["step_s"],
        "device": str(jax.devices()[0].device_kind),
    }))


if __name__ == "__main__":
    main()
