"""Drafters by name, the drafters shipped for the default model, and the measured default.

    drafter, params = load_drafter("dflash+ngram", target)          # the shipped DFlash + lookup
    drafter, params = load_drafter("draft-model", target, "path/to/small_lm", k=4)
    drafter, params, reason = default_drafter(target, batch_size=1, temperature=0.7)
    out = spec_jax.generate(target, prompts, drafter, params, temperature=0.7)

`spec-jax generate` without `--drafter` uses `default_drafter_choice`, so the API and the command
line pick the same drafter for the same call.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from spec_jax.checkpoints import LoadedModel, load_target

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # spec_jax/assets

MODEL_DRAFTERS = ("draft-model", "dflash", "eagle3", "medusa")
# "KIND+ngram": prompt lookup in front of a model drafter (spec_jax/drafters/lookup.py).
LOOKUP = "+ngram"
DRAFTER_KINDS = ("none", "ngram", "self", *MODEL_DRAFTERS, *(kind + LOOKUP for kind in MODEL_DRAFTERS))
DRAFTER_KINDS_WITH_PATH = (*MODEL_DRAFTERS, *(kind + LOOKUP for kind in MODEL_DRAFTERS))

# Drafters trained by spec_jax for the embedded default model, shipped inside the package with
# quantized weights (checkpoints/quantized.py; how they were made, and why no EAGLE-3 head ships:
# spec_jax/assets/README.md).
SHIPPED_DRAFTERS = {"dflash": "smollm2_dflash", "draft-model": "smollm2_draft_model"}
NOT_SHIPPED = {
    "eagle3": "no EAGLE-3 drafter ships with spec_jax (no default used it, and DFlash drafts better "
              "for the default model; it was retired to keep the package small). Train one with "
              "`spec-jax train eagle3 --data DATA --out runs/eagle3` (spec_jax/assets/README.md has "
              "the command that made the retired one) and pass --drafter eagle3=runs/eagle3/drafter, "
              "or use --drafter dflash.",
    "medusa": "no Medusa heads ship with spec_jax (trained on this CPU they lost to plain decoding; "
              "benchmarks/RESULTS.md). Train them with `spec-jax train medusa --data DATA --out runs/medusa` "
              "and pass --drafter medusa=runs/medusa/drafter.",
}


def is_default_target(target: LoadedModel) -> bool:
    return target.source.startswith("default:")


def shipped_drafter_path(kind: str, target: LoadedModel) -> Path:
    """The shipped `kind` drafter of the default model; a clear error for any other target and
    for a kind that does not ship."""
    if not is_default_target(target):
        raise ValueError(
            f"drafter {kind!r} needs a checkpoint for this target: --drafter {kind}=PATH "
            "(spec_jax ships one only for the default model)."
        )
    if kind in NOT_SHIPPED:
        raise ValueError(f"drafter {kind!r} needs a checkpoint: {NOT_SHIPPED[kind]}")
    path = ASSETS / SHIPPED_DRAFTERS[kind]
    if not (path / "config.json").is_file():
        raise ValueError(f"the shipped {kind} drafter is missing from this install ({path}).")
    return path


def load_drafter(kind: str, target: LoadedModel, path: str | None = None, k: int | None = None) -> tuple[Any, Any]:
    """(drafter, drafter_params) for `generate` by kind (see DRAFTER_KINDS); (None, None) for
    "none", the AR baseline. Without a path, a model drafter is the one shipped for the default
    model. k=None keeps the drafter's own K."""
    if kind == "none":
        return None, None
    if kind.endswith(LOOKUP) and kind[: -len(LOOKUP)] in MODEL_DRAFTERS:
        from spec_jax.drafters.lookup import LookupFirstDrafter

        model, params = load_drafter(kind[: -len(LOOKUP)], target, path, k)
        return LookupFirstDrafter(model), params
    if kind == "ngram":
        from spec_jax.drafters.ngram import NGramDrafter

        return (NGramDrafter() if k is None else NGramDrafter(k=k)), None
    if kind == "self":
        from spec_jax.drafters.draft_model import self_drafter

        return self_drafter(target.cfg, **({} if k is None else {"k": k})), target.params
    if kind not in MODEL_DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTER_KINDS)}.")
    if path is None:
        path = str(shipped_drafter_path(kind, target))
    if kind == "draft-model":
        from spec_jax.drafters.draft_model import DraftModelDrafter, check_same_tokenizer

        draft = load_target(path, dtype=target.cfg.dtype)
        check_same_tokenizer(target.tokenizer, draft.tokenizer)
        return (DraftModelDrafter(draft.cfg) if k is None else DraftModelDrafter(draft.cfg, k=k)), draft.params

    import jax
    import jax.numpy as jnp

    if kind == "dflash":
        from spec_jax.checkpoints.dflash import load_dflash

        drafter, params = load_dflash(path, dtype=target.cfg.dtype, k=k)
    elif kind == "medusa":
        from spec_jax.checkpoints.medusa import load_medusa

        drafter, params = load_medusa(path, dtype=target.cfg.dtype, k=k)
    else:
        from spec_jax.checkpoints.eagle3 import load_eagle3

        drafter, params = load_eagle3(path, dtype=target.cfg.dtype, k=k, target_cfg=target.cfg)
    return drafter, jax.tree.map(jnp.asarray, params)


# The drafter `generate` uses for the default model when none is named, per backend, decoding mode
# and batch: the fastest in the recorded measurements (benchmarks/RESULTS.md, first two sections:
# HumanEval, 128 tokens, greedy and temperature 0.7). Each entry: (largest batch it was measured
# at, or None for any larger batch; kind; its measured K, or None for the kind's default; why);
# the first that covers the batch wins. Only the CPU has been measured; another backend gets
# n-gram at batch 1, the one drafter that never lost to plain decoding at batch 1 where measured,
# and plain decoding above.
MEASURED_DEFAULT_DRAFTER: dict[tuple[str, str], tuple[tuple[int | None, str, int | None, str], ...]] = {
    ("cpu", "greedy"): (
        (1, "dflash+ngram", None,
         "measured fastest for the default model on CPU at batch 1, greedy (benchmarks/RESULTS.md, "
         "2026-11-25: DFlash with prompt lookup 1.90x and 2.00x plain decoding in two runs, tau "
         "3.40; the draft model with prompt lookup 1.58x and 1.68x at K=4, n-gram 1.58x, DFlash "
         "alone 1.34x)"),
        (8, "draft-model+ngram", 2,
         "measured fastest for the default model on CPU at batch 8, greedy (benchmarks/RESULTS.md, "
         "2026-11-25: the draft model with prompt lookup at K=2 1.15x plain decoding, K=4 1.07x "
         "and 1.08x; n-gram at K=2 1.10x, DFlash with prompt lookup 1.08x at K=2, 0.88x at K=7)"),
        (None, "none", None,
         "more prompts than the largest batch measured on CPU (8): plain decoding, which no "
         "drafter has been shown to beat there"),
    ),
    ("cpu", "sampled"): (
        (1, "dflash+ngram", 4,
         "measured fastest for the default model on CPU at batch 1, T=0.7 (benchmarks/RESULTS.md, "
         "2026-11-25: DFlash with prompt lookup at K=4 1.47x plain decoding, K=3 1.40x, K=7 1.39x "
         "and 1.19x in two runs; n-gram 1.32x and 1.20x at K=4)"),
        (8, "dflash+ngram", 2,
         "measured fastest for the default model on CPU at batch 8, T=0.7 (benchmarks/RESULTS.md, "
         "2026-11-25: DFlash with prompt lookup at K=2 1.06x and 1.02x plain decoding in two runs, "
         "the draft model with lookup 1.03x and 0.96x, n-gram 1.03x and 0.84x; K=3 lost, "
         "0.85-0.90x)"),
        (None, "none", None,
         "more prompts than the largest batch measured on CPU (8): plain decoding, which no "
         "drafter has been shown to beat there"),
    ),
}
UNMEASURED_DEFAULT_DRAFTER = (
    (1, "ngram", None, "no drafter measured for the default model on this backend; n-gram never "
                       "lost to plain decoding at batch 1 where measured"),
    (None, "none", None, "several prompts and no drafter measured on this backend: drafters lost "
                         "to plain decoding at batch 8 where measured"),
)


# Chain or token tree for that default drafter, per backend and decoding mode: (largest batch, tree
# budget (0 = a chain), why), read like the table above. Trees raise tau by 1.1-1.3x on the default
# model, but a CPU verify pass of N + 1 tokens is compute-bound, so on CPU trees lost to the chain
# in most runs. On GPU/TPU a verify pass of up to ~64 tokens costs about one token, so trees should
# pay there (a projection in benchmarks/RESULTS.md, "Token trees"); no GPU/TPU run has measured
# one yet, so those backends keep the chain until one does.
MEASURED_DEFAULT_TREE: dict[tuple[str, str], tuple[tuple[int | None, int, str], ...]] = {
    ("cpu", "greedy"): (
        (None, 0,
         "a chain: on CPU trees lose to it (benchmarks/RESULTS.md, 2026-11-25, batch 1, DFlash "
         "with prompt lookup, K=7, HumanEval[:20], quiet machine: chain 1.77x plain decoding at "
         "tau 3.40, trees of 16 / 32 nodes 1.47x / 1.16x at tau 4.14 / 4.31; the wider verify "
         "pass is compute-bound on CPU)"),
    ),
    ("cpu", "sampled"): (
        (None, 0,
         "a chain: trees lost to it on CPU in most greedy runs, where they gain the most tau "
         "(benchmarks/RESULTS.md, Token trees), and the verify pass costs the same when sampling"),
    ),
}
UNMEASURED_DEFAULT_TREE = (
    (None, 0, "a chain: no tree has been measured on this backend yet (on GPU/TPU trees of 16-32 "
              "nodes are projected to pay: pass --tree 16)"),
)


def default_tree_choice(batch_size: int = 1, temperature: float = 0.0, backend: str | None = None) -> tuple[int, str]:
    """(tree budget, reason) for the default drafter: 0 (a chain) or N nodes, per backend,
    decoding mode and batch size, from the measurements in MEASURED_DEFAULT_TREE."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    mode = "greedy" if temperature <= 0 else "sampled"
    entries = MEASURED_DEFAULT_TREE.get((backend, mode), UNMEASURED_DEFAULT_TREE)
    return next((tree, why) for largest, tree, why in entries if largest is None or batch_size <= largest)


def default_drafter_choice(
    default_model: bool, k: int | None = None, batch_size: int = 1, temperature: float = 0.0,
    backend: str | None = None,
) -> tuple[str, int | None, str]:
    """(kind, K, reason) of the drafter to use when none is named: for the default model, the one
    measured fastest on `backend` (default: JAX's) for this batch size and decoding mode (greedy
    when temperature is 0, else sampled); plain decoding for other targets, for which spec_jax
    ships no drafter. A K the caller gives wins over the measured one."""
    if not default_model:
        return "none", k, "no drafter named and none shipped for this target"
    if backend is None:
        import jax

        backend = jax.default_backend()
    mode = "greedy" if temperature <= 0 else "sampled"
    entries = MEASURED_DEFAULT_DRAFTER.get((backend, mode), UNMEASURED_DEFAULT_DRAFTER)
    kind, measured_k, why = next(
        (kind, kk, why) for largest, kind, kk, why in entries if largest is None or batch_size <= largest
    )
    k = None if kind == "none" else (k if k is not None else measured_k)
    return kind, k, f"default for the default model: {why}"


def default_drafter(
    target: LoadedModel, batch_size: int = 1, temperature: float = 0.0, k: int | None = None
) -> tuple[Any, Any, str]:
    """(drafter, drafter_params, reason): what `spec-jax generate` uses without --drafter for a
    batch of `batch_size` prompts at `temperature` (see `default_drafter_choice`); (None, None,
    reason) where plain decoding is the fastest measured."""
    kind, k, reason = default_drafter_choice(is_default_target(target), k, batch_size, temperature)
    drafter, params = load_drafter(kind, target, None, k)
    tree, why = default_tree_choice(batch_size, temperature)
    if drafter is not None and hasattr(drafter, "propose_tree"):
        reason += f"; {why}"
        if tree:
            drafter = dataclasses.replace(drafter, tree=tree)
    return drafter, params, reason
