"""Copy trained drafters into the package (spec_jax/assets/) as quantized weights, checked on the way.

    python benchmarks/ship_drafters.py --dflash runs/dflash/drafter --draft-model runs/draft/drafter

Every weight matrix is stored as int8 with one float32 scale per output channel, and the draft
model's embedding table (also its tied LM head, 89% of its weights) as int4 with a scale per 32
weights (`spec_jax.checkpoints.quantized`): that keeps the repository small enough for the
accelerator hosts (`tests/test_repo_size.py`). Norms and vocabulary maps are stored as they are.
Loading dequantizes to the dtype asked for (float32 on CPU). The measured cost in tau:
spec_jax/assets/README.md. The draft model is written without tokenizer files: it uses the target's tokenizer, which
the target already carries. Each shipped drafter is re-loaded and must give the AR baseline's
greedy output on a short prompt; its tau there is printed next to the source drafter's.
(EAGLE-3 is no longer shipped; spec_jax/assets/README.md says why.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "spec_jax" / "assets"
INT4 = {"dflash": (), "draft-model": ("model.embed_tokens.weight",)}  # the rest: int8


def main() -> None:
    from spec_jax.checkpoints import apply_chat_template, load_target, save_hf_dir
    from spec_jax.checkpoints.dflash import load_dflash, save_dflash
    from spec_jax.checkpoints.hf import load_hf_dir
    from spec_jax.checkpoints.quantized import quantize_checkpoint_file
    from spec_jax.checkpoints.shipped import SHIPPED_DRAFTERS, load_drafter
    from spec_jax.decoding import generate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dflash", type=Path)
    parser.add_argument("--draft-model", type=Path)
    args = parser.parse_args()
    target = load_target(None)
    prompt = apply_chat_template(target.tokenizer, "Write a Python function that reverses a string.",
                                 target.chat_template)
    ar = generate(target, [prompt], max_new_tokens=48)
    sources = {"dflash": args.dflash, "draft-model": args.draft_model}
    source_tau = {}
    for kind, source in sources.items():
        if source is not None:  # measured before writing: the source may be the shipped dir itself
            drafter, params = load_drafter(kind, target, str(source))
            source_tau[kind] = generate(target, [prompt], drafter, params, max_new_tokens=48).stats.tau
    if args.dflash:
        drafter, params = load_dflash(args.dflash)
        # A reduced draft vocabulary only exists in the speculators format.
        save_dflash(ASSETS / SHIPPED_DRAFTERS["dflash"], drafter.cfg, params, overwrite=True,
                    layout="speculators" if drafter.cfg.draft_vocab_size else "z-lab")
    if args.draft_model:
        cfg, params = load_hf_dir(args.draft_model)
        save_hf_dir(ASSETS / SHIPPED_DRAFTERS["draft-model"], cfg, params, overwrite=True)
    for kind, source in sources.items():
        if source is not None:
            quantize_checkpoint_file(ASSETS / SHIPPED_DRAFTERS[kind] / "model.safetensors", INT4[kind])
    for kind in SHIPPED_DRAFTERS:
        if (ASSETS / SHIPPED_DRAFTERS[kind] / "config.json").is_file():
            drafter, params = load_drafter(kind, target)
            out = generate(target, [prompt], drafter, params, max_new_tokens=48)
            assert out.generated_ids == ar.generated_ids, f"shipped {kind} drafter changed the output"
            was = f" (source {source_tau[kind]:.2f})" if kind in source_tau else ""
            print(f"{kind}: shipped, AR-identical, tau {out.stats.tau:.2f}{was}")


if __name__ == "__main__":
    main()
