"""The paged KV cache (issue 45, part 1) on every drafter kind, and what it admits at a fixed
cache budget. Tiny random models (tests/tiny_configs.py shapes), float32, CPU; counts, not timings.

1. Every drafter kind, chain and tree, through `Engine(kv_pages=N)`: requests arriving one per
   step, a pool too small for all of them at once (later ones wait for pages), greedy output
   compared with `generate` (the dense loop) per request; the most pages in use at once, how many
   pages were handed out more than once, the pool after the run (must be empty), and the
   compiles after warm-up (must be 0). The Gemma 4 assistant (`mtp`) runs on a tiny Gemma 4
   target (sliding and KV-shared layers): it reads the target's pages through the table.
2. At the cache bytes of D dense slots of `max_model_len` 1024 (capacity 1152 = 9 pages of 128),
   the short requests (16-token prompt, 16 new) each engine runs at once: the dense engine its D
   slots, the paged one as many as the pool covers (one page each).

    python benchmarks/paged_kv.py            # both parts
    python benchmarks/paged_kv.py --kinds ngram eagle3_tree
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_configs import TINY_DRAFT, TINY_GEMMA4, TINY_TARGET, VOCAB, tiny_dflash  # noqa: E402

from spec_jax.decoding.engine import Engine  # noqa: E402
from spec_jax.decoding.generate import generate  # noqa: E402
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params  # noqa: E402
from spec_jax.drafters.draft_model import DraftModelDrafter  # noqa: E402
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params  # noqa: E402
from spec_jax.drafters.gemma4_assistant import (Gemma4AssistantDrafter, assistant_config_for_target,  # noqa: E402
                                                init_assistant_params)
from spec_jax.drafters.lookup import LookupFirstDrafter  # noqa: E402
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, init_medusa_params  # noqa: E402
from spec_jax.drafters.ngram import NGramDrafter  # noqa: E402
from spec_jax.drafters.suffix import SuffixDrafter  # noqa: E402
from spec_jax.models import init_params  # noqa: E402

K = 3
PAGE = 32  # rows of capacity 128: 4 pages each
POOL = 5
MAX_NEW = 24


def prompts(vocab: int) -> list[list[int]]:
    rng = jax.random.split(jax.random.key(11), 6)
    out = [jax.random.randint(r, (n,), 3, vocab).tolist() for r, n in zip(rng, (3, 16, 1, 9, 12, 5))]
    out[3] = [5, 6, 7, 8, 5, 6, 7, 8, 5]  # repetitive: the lookups draft from it
    return out


def cases() -> dict[str, tuple]:
    """kind -> (target, drafter, drafter params)."""
    llama = (TINY_TARGET, init_params(TINY_TARGET, jax.random.key(0), scale=3.0))
    draft = init_params(TINY_DRAFT, jax.random.key(1), scale=3.0)
    dflash_cfg = tiny_dflash(K + 1)
    dflash = init_dflash_params(dflash_cfg, jax.random.key(3), scale=3.0)
    eagle3_cfg = Eagle3Config(layer=TINY_DRAFT, draft_vocab_size=VOCAB - 20, aux_layer_ids=(1, 2))
    eagle3 = init_eagle3_params(eagle3_cfg, jax.random.key(4), scale=3.0)
    medusa_cfg = MedusaConfig.for_target(TINY_TARGET, num_heads=K)
    medusa = init_medusa_params(medusa_cfg, jax.random.key(5), scale=3.0)
    gemma4 = (TINY_GEMMA4, init_params(TINY_GEMMA4, jax.random.key(6), scale=3.0))
    assistant_cfg = assistant_config_for_target(TINY_GEMMA4, hidden_size=32, num_layers=2, k=K)
    assistant = init_assistant_params(assistant_cfg, jax.random.key(7), scale=3.0)
    return {
        "none": (llama, None, None),
        "ngram": (llama, NGramDrafter(k=K), None),
        "ngram_tree": (llama, NGramDrafter(k=K, tree=6), None),
        "suffix": (llama, SuffixDrafter(k=K, store_size=64), None),
        "self": (llama, DraftModelDrafter(TINY_TARGET, K), llama[1]),
        "draft_model+ngram": (llama, LookupFirstDrafter(DraftModelDrafter(TINY_DRAFT, K), min_match=1), draft),
        "draft_model_tree": (llama, DraftModelDrafter(TINY_DRAFT, K, tree=6), draft),
        "dflash": (llama, DFlashDrafter(dflash_cfg, K), dflash),
        "dflash_tree": (llama, DFlashDrafter(dflash_cfg, K, tree=((0,), (1,), (0, 0))), dflash),
        "eagle3": (llama, Eagle3Drafter(eagle3_cfg, K), eagle3),
        "eagle3_tree": (llama, Eagle3Drafter(eagle3_cfg, K, tree=6), eagle3),
        "medusa_tree": (llama, MedusaDrafter(medusa_cfg, K, tree=6), medusa),
        "mtp (gemma4 assistant)": (gemma4, Gemma4AssistantDrafter(assistant_cfg, K), assistant),
        "mtp_tree (gemma4 assistant)": (gemma4, Gemma4AssistantDrafter(assistant_cfg, K, tree=6), assistant),
    }


def paged_equals_generate(kind: str, target, drafter, params) -> dict:
    vocab = target[0].vocab_size
    reqs = prompts(vocab)
    want = [generate(target, [p], drafter, params, max_new_tokens=MAX_NEW).generated_ids[0] for p in reqs]
    engine = Engine(target, drafter, params, slots=6, max_model_len=48, chunk_steps=2, kv_pages=POOL,
                    kv_page_size=PAGE)
    engine.warmup([16])
    compiles = []
    listener = lambda name, *a, **k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    rids, got, most_pages, waited = [], {}, 0, False
    try:
        while engine.has_work() or len(rids) < len(reqs):
            if len(rids) < len(reqs):
                rids.append(engine.submit(reqs[len(rids)], max_new_tokens=MAX_NEW))
            for e in engine.step():
                got.setdefault(e.request_id, []).extend(e.new_ids)
            most_pages = max(most_pages, engine.pages.used)
            waited |= bool(engine.scheduler.waiting) and engine.num_live < engine.slots
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return {"kind": kind, "equal": [got[r] == w for r, w in zip(rids, want)], "most_pages_in_use": most_pages,
            "pool": POOL, "waited_for_pages": waited,
            "pages_handed_out_again": sum(n > 1 for n in engine.pages.handed_out.values()),
            "pages_used_after": engine.pages.used, "compiles_after_warmup": len(compiles)}


def admitted_at_budget(dense_slots: int) -> dict:
    """Short requests running at once at the cache bytes of `dense_slots` dense slots."""
    target = (TINY_TARGET, init_params(TINY_TARGET, jax.random.key(0), scale=3.0))
    dense = Engine(target, None, slots=dense_slots, max_model_len=1024, chunk_steps=2)
    pages = dense.capacity // 128 * dense_slots
    paged = Engine(target, None, slots=64, max_model_len=1024, chunk_steps=2, kv_pages=pages)
    nbytes = [sum(x.nbytes for x in (*e.state.cache.k, *e.state.cache.v)) for e in (dense, paged)]
    out = {"dense_slots": dense_slots, "capacity": dense.capacity, "pages": pages, "cache_bytes": nbytes}
    for name, engine in (("dense", dense), ("paged", paged)):
        for i in range(64):
            engine.submit([3 + i % 90] * 16, max_new_tokens=16, ignore_eos=True)
        most = 0
        while engine.has_work():
            engine.step()
            most = max(most, engine.num_live)
        out[f"{name}_most_running"] = most
    out["paged_pages_used_after"] = paged.pages.used
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="*", default=None, help="drafter kinds to run (default all)")
    parser.add_argument("--dense-slots", type=int, default=2)
    parser.add_argument("--skip-budget", action="store_true")
    args = parser.parse_args()
    for kind, case in cases().items():
        if args.kinds is None or kind in args.kinds:
            print(json.dumps(paged_equals_generate(kind, *case)), flush=True)
    if not args.skip_budget:
        print(json.dumps(admitted_at_budget(args.dense_slots)), flush=True)


if __name__ == "__main__":
    main()
