"""Copy trained drafters into the package (spec_jax/assets/) in bfloat16, checked on the way.

    python benchmarks/ship_drafters.py --dflash runs/dflash/drafter --draft-model runs/draft/drafter \
        --eagle3 runs/eagle3/drafter

bfloat16 halves the files; loading casts them back to the dtype asked for (float32 on CPU). Each
shipped drafter is re-loaded and must give the AR baseline's greedy output on a short prompt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

ASSETS = Path(__file__).resolve().parent.parent / "spec_jax" / "assets"


def to_bf16(tree):
    """Float weights to bfloat16; integer arrays (EAGLE-3's vocabulary map) kept as they are."""
    def one(x):
        x = np.asarray(x)
        return x.astype(np.float32).astype(ml_dtypes.bfloat16) if np.issubdtype(x.dtype, np.floating) else x
    return jax.tree_util.tree_map(one, tree)


def main() -> None:
    from spec_jax.checkpoints import apply_chat_template, load_target, save_hf_dir
    from spec_jax.checkpoints.dflash import load_dflash, save_dflash
    from spec_jax.checkpoints.eagle3 import load_eagle3, save_eagle3
    from spec_jax.checkpoints.hf import load_hf_dir
    from spec_jax.decoding import generate
    from spec_jax.checkpoints.shipped import SHIPPED_DRAFTERS, load_drafter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dflash", type=Path)
    parser.add_argument("--draft-model", type=Path)
    parser.add_argument("--eagle3", type=Path)
    args = parser.parse_args()
    target = load_target(None)
    if args.dflash:
        drafter, params = load_dflash(args.dflash)
        # A reduced draft vocabulary only exists in the speculators format.
        save_dflash(ASSETS / SHIPPED_DRAFTERS["dflash"], drafter.cfg, to_bf16(params), overwrite=True,
                    layout="speculators" if drafter.cfg.draft_vocab_size else "z-lab")
    if args.draft_model:
        cfg, params = load_hf_dir(args.draft_model)
        save_hf_dir(ASSETS / SHIPPED_DRAFTERS["draft-model"], cfg, to_bf16(params),
                    tokenizer=target.tokenizer, overwrite=True)
    if args.eagle3:
        drafter, params = load_eagle3(args.eagle3, target_cfg=target.cfg)
        save_eagle3(ASSETS / SHIPPED_DRAFTERS["eagle3"], drafter.cfg, to_bf16(params), overwrite=True)
    prompt = apply_chat_template(target.tokenizer, "Write a Python function that reverses a string.",
                                 target.chat_template)
    ar = generate(target, [prompt], max_new_tokens=48)
    for kind in ("dflash", "draft-model", "eagle3"):
        if (ASSETS / SHIPPED_DRAFTERS[kind] / "config.json").is_file():
            drafter, params = load_drafter(kind, target)
            out = generate(target, [prompt], drafter, params, max_new_tokens=48)
            assert out.generated_ids == ar.generated_ids, f"shipped {kind} drafter changed the output"
            print(f"{kind}: shipped, AR-identical, tau {out.stats.tau:.2f}")


if __name__ == "__main__":
    main()
