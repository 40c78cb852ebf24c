"""Engine checks for every drafter kind on a data=4 x model=2 mesh of fake CPU devices, run in a
fresh process by test_engine.py (JAX fixes the device count at start-up). Prints one JSON
object (the last stdout line): per kind, whether each staggered request equals its greedy output
alone, and the compiles seen after warm-up."""

from __future__ import annotations

import fake_devices  # noqa: F401  (first: 8 fake CPU devices, cheap codegen; tests/ is sys.path[0])

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from spec_jax.decoding.engine import Engine  # noqa: E402
from spec_jax.decoding.generate import generate  # noqa: E402
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params  # noqa: E402
from spec_jax.drafters.draft_model import DraftModelDrafter  # noqa: E402
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params  # noqa: E402
from spec_jax.drafters.lookup import LookupFirstDrafter  # noqa: E402
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, init_medusa_params  # noqa: E402
from spec_jax.drafters.ngram import NGramDrafter  # noqa: E402
from spec_jax.models import init_params  # noqa: E402
from spec_jax.sharding import make_mesh  # noqa: E402
from tiny_configs import TINY_DRAFT, TINY_TARGET, VOCAB, tiny_dflash  # noqa: E402

K = 3
CFG = TINY_TARGET
DFLASH = tiny_dflash(block_size=K + 1)
EAGLE3 = Eagle3Config(layer=TINY_DRAFT, draft_vocab_size=VOCAB - 20,
                      aux_layer_ids=(1, 2))
MEDUSA = MedusaConfig.for_target(CFG, num_heads=K)
rng = np.random.RandomState(0)
PROMPTS = [rng.randint(0, VOCAB, n).tolist() for n in (3, 16, 1, 9, 12)]
PROMPTS[3] = [5, 6, 7, 8, 5, 6, 7, 8, 5]  # repetitive: the lookup drafts from it
MAX_NEW = [14, 24, 20, 10, 17]


def drafters(params):
    draft_cfg = TINY_DRAFT
    draft_params = init_params(draft_cfg, jax.random.key(1), scale=3.0)
    dflash_params = init_dflash_params(DFLASH, jax.random.key(3), scale=3.0)
    # The draft model and DFlash run behind prompt lookup: one engine each covers the model
    # drafter (its propose runs on every step where some row has no lookup match) and the
    # lookup-first drafter; a compile per kind is most of this worker's time.
    return {
        "ngram": (NGramDrafter(k=K), None),
        "draft_model_lookup": (LookupFirstDrafter(DraftModelDrafter(draft_cfg, K), min_match=1), draft_params),
        "dflash_lookup": (LookupFirstDrafter(DFlashDrafter(DFLASH, K), min_match=1), dflash_params),
        "eagle3": (Eagle3Drafter(EAGLE3, K), init_eagle3_params(EAGLE3, jax.random.key(4), scale=3.0)),
        "medusa": (MedusaDrafter(MEDUSA, K), init_medusa_params(MEDUSA, jax.random.key(5), scale=3.0)),
    }


def main() -> None:
    params = init_params(CFG, jax.random.key(0), scale=3.0)
    target = (CFG, params)
    alone = [generate(target, [p], max_new_tokens=n).generated_ids[0] for p, n in zip(PROMPTS, MAX_NEW)]
    mesh = make_mesh("data=4,model=2")
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    report = {}
    for kind, (drafter, drafter_params) in drafters(params).items():
        engine = Engine(target, drafter, drafter_params, slots=4, max_model_len=48, chunk_steps=2, mesh=mesh)
        engine.warmup([16])
        compiles.clear()
        rids = [engine.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[:2], MAX_NEW[:2])]
        got: dict[int, list[int]] = {}
        steps = 0
        while engine.has_work() or len(rids) < len(PROMPTS):
            for e in engine.step():
                got.setdefault(e.request_id, []).extend(e.new_ids)
                if e.finish_reason:
                    steps += e.stats.steps
            if len(rids) < len(PROMPTS):  # one more arrives after every chunk
                i = len(rids)
                rids.append(engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW[i]))
        emitted = sum(len(got[r]) for r in rids)
        report[kind] = {
            "equal": [got[r] == a for r, a in zip(rids, alone)],
            "compiles_after_warmup": len(compiles),
            "tau": (emitted - len(rids)) / max(steps, 1),  # prefill's first tokens are not steps'
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
