"""What unrolling the layer loop costs at trace and compile time, at Qwen3-8B depth (36 layers).

    python benchmarks/compile_time.py [--out DIR]

1. Qwen3-8B shapes (36 layers, real widths) with the DFlash b16 drafter (5 layers), abstract
   weights: the seconds `jax.eval_shape` and `jax.jit(...).lower` take for the whole generate loop
   (AR and DFlash). Nothing is allocated, so this runs anywhere.
2. A real compile of the same depth at tiny width (hidden 64): `generate`'s compile_s for AR and
   DFlash, batch 1, so the compiler's cost of 36 unrolled layers is measured without 16 GB of weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from spec_jax.decoding import generate
from spec_jax.decoding.loop import abstract_inputs, generate_jit, generate_loop
from spec_jax.models.decoder import Decoder
from spec_jax.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    dflash_layers,
    dflash_weight_specs,
    init_dflash_params,
)
from spec_jax.models.decoder import init_params
from spec_jax.models.presets import preset_config

QWEN3_8B = preset_config("qwen3-8b", "bfloat16")
QWEN3_8B_DFLASH = DFlashConfig(
    layer=dflash_layers(5, 4096, 32, 8, 128, 12288, vocab_size=151936, dtype="bfloat16"),
    block_size=16, target_layer_ids=(1, 9, 17, 25, 33), mask_token_id=151669, num_target_layers=36,
)
TINY_36 = dataclasses.replace(
    QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
    head_dim=16, eos_token_ids=(1,), dtype="float32",
)
TINY_36_DFLASH = dataclasses.replace(
    QWEN3_8B_DFLASH, mask_token_id=511,
    layer=QWEN3_8B_DFLASH.layer.replace(hidden_size=64, intermediate_size=128, num_heads=4,
                                        num_kv_heads=2, head_dim=16, vocab_size=512, dtype="float32"),
)


def abstract_trace(drafter: DFlashDrafter | None) -> dict[str, float]:
    capacity = 512
    specs = None if drafter is None else dflash_weight_specs(drafter.cfg)
    inputs = abstract_inputs(Decoder(QWEN3_8B), specs, batch=1, prompt_len=256)
    static = dict(model=Decoder(QWEN3_8B), drafter=drafter, capacity=capacity)
    t0 = time.perf_counter()
    jax.eval_shape(functools.partial(generate_loop, **static), inputs)
    eval_shape_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate_jit.lower(inputs, **static)
    return {"eval_shape_s": eval_shape_s, "lower_s": time.perf_counter() - t0}


def tiny_compile(with_dflash: bool) -> float:
    params = init_params(TINY_36, jax.random.key(0))
    drafter, drafter_params = None, None
    if with_dflash:
        drafter = DFlashDrafter(TINY_36_DFLASH)
        drafter_params = init_dflash_params(TINY_36_DFLASH, jax.random.key(1))
    prompt = np.arange(2, 40).tolist()
    result = generate((TINY_36, params), [prompt], drafter, drafter_params, max_new_tokens=16, ignore_eos=True)
    return result.compile_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write compile_time.json here")
    args = parser.parse_args(argv)
    rows = {"backend": jax.default_backend()}
    for name, drafter in (("ar", None), ("dflash_b16", DFlashDrafter(QWEN3_8B_DFLASH))):
        rows[f"qwen3_8b_{name}"] = abstract_trace(drafter)
        rows[f"tiny36_{name}_compile_s"] = tiny_compile(drafter is not None)
        print(name, rows[f"qwen3_8b_{name}"], rows[f"tiny36_{name}_compile_s"], file=sys.stderr)
    print(json.dumps(rows, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile_time.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
