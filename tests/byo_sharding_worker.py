"""The bring-your-own-model target (docs/bring_your_own_model.md) sharded on 8 fake CPU devices,
run in a fresh process by test_bring_your_own_model.py (JAX fixes its device count at start).

Prints one JSON object (the last stdout line): the device count and, per case, whether the
sharded run's tokens equal the unsharded run's.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import spec_jax  # noqa: E402
from spec_jax.sharding import make_mesh  # noqa: E402
from test_bring_your_own_model import definitions  # noqa: E402  (tests/ is on sys.path)


def main() -> None:
    ns = definitions()
    vocab, dim, heads = 64, 32, 2
    model, params = ns["TinyLMTarget"].wrap(ns["TinyLM"](vocab, dim, 2, heads, rngs=ns["nnx"].Rngs(0)), heads)
    dflash_cfg = spec_jax.DFlashConfig(
        num_layers=1, hidden_size=dim, num_heads=heads, num_kv_heads=heads, head_dim=dim // heads,
        intermediate_size=64, block_size=4, target_layer_ids=(0, 1), mask_token_id=vocab - 1,
        num_target_layers=2, vocab_size=vocab,
    )
    cases = {
        "ar": (None, None),
        "ngram": (spec_jax.NGramDrafter(k=3), None),
        "dflash": (spec_jax.DFlashDrafter(dflash_cfg), spec_jax.init_dflash_params(dflash_cfg, jax.random.key(1))),
    }
    prompts = [[5, 9, 13, 5, 9, 13], [7, 3, 1], [2, 4, 6, 8], [11, 11, 11]] * 2  # 8 rows: data=2
    mesh = make_mesh("data=2,model=4")
    # weight_specs() is None: the user places the params (replicated here).
    placed = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    equal = {}
    for name, (drafter, drafter_params) in cases.items():
        plain = spec_jax.generate((model, params), prompts, drafter, drafter_params, max_new_tokens=12)
        sharded = spec_jax.generate((model, placed), prompts, drafter, drafter_params, max_new_tokens=12,
                                    mesh=mesh)
        equal[name] = sharded.generated_ids == plain.generated_ids
    print(json.dumps({"devices": len(jax.devices()), "equal": equal}))


if __name__ == "__main__":
    main()
