"""The bring-your-own-model example (docs/bring_your_own_model.md) in a fresh process, run by
test_bring_your_own_model.py: 8 fake CPU devices (JAX fixes its device count at start) and cheap
CPU codegen (these checks compare tokens, not speed), so each loop compiles in seconds.

1. the doc's example block as written (check_target; every drafter equal to plain decoding at
   batch 4, asserted inside the block);
2. the same drafters at batch 1;
3. AR, n-gram and DFlash sharded over data=2, model=4 against unsharded plain decoding.
Prints one JSON object (the last stdout line).
"""

from __future__ import annotations

import fake_devices  # noqa: F401  (first: 8 fake CPU devices, cheap codegen; tests/ is sys.path[0])

import json  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import spec_jax  # noqa: E402
from spec_jax.drafters.dflash import dflash_layers  # noqa: E402
from spec_jax.sharding import make_mesh  # noqa: E402
from test_bring_your_own_model import DOC, definitions, doc_block  # noqa: E402  (tests/ is on sys.path)


def example_and_batch_1() -> dict:
    ns = definitions()
    exec(compile(doc_block("check_target(model, params)\n\nprompts"), str(DOC), "exec"), ns)
    model, params, prompt = ns["model"], ns["params"], ns["prompts"][:1]
    plain = spec_jax.generate((model, params), prompt, max_new_tokens=24)
    batch_1 = {}
    for name, (drafter, drafter_params) in ns["drafters"].items():
        out = spec_jax.generate((model, params), prompt, drafter, drafter_params, max_new_tokens=24)
        batch_1[name] = out.generated_ids == plain.generated_ids and out.stats.steps > 0
    return {"example_drafters": list(ns["drafters"]), "batch_1": batch_1}


def sharded() -> dict[str, bool]:
    ns = definitions()
    vocab, dim, heads = 64, 32, 2
    model, params = ns["TinyLMTarget"].wrap(ns["TinyLM"](vocab, dim, 2, heads, rngs=ns["nnx"].Rngs(0)), heads)
    dflash_cfg = spec_jax.DFlashConfig(
        layer=dflash_layers(1, dim, heads, heads, dim // heads, 64, vocab_size=vocab),
        block_size=4, target_layer_ids=(0, 1), mask_token_id=vocab - 1, num_target_layers=2,
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
    # Each sharded run against unsharded plain decoding (greedy speculative output equals it, so
    # one unsharded loop is the reference for all three).
    plain = spec_jax.generate((model, params), prompts, max_new_tokens=12)
    equal = {}
    for name, (drafter, drafter_params) in cases.items():
        on_mesh = spec_jax.generate((model, placed), prompts, drafter, drafter_params, max_new_tokens=12,
                                    mesh=mesh)
        equal[name] = on_mesh.generated_ids == plain.generated_ids
    return equal


def main() -> None:
    report = {"devices": len(jax.devices()), **example_and_batch_1(), "sharded": sharded()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
