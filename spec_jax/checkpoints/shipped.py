"""Drafters by name, the drafters shipped for the default model, and the measured default.

    drafter, params = load_drafter("dflash+ngram", target)          # the shipped DFlash + lookup
    drafter, params = load_drafter("draft-model", target, "path/to/small_lm", k=4)
    drafter, params, reason = default_drafter(target, batch_size=1, temperature=0.7)
    out = spec_jax.generate(target, prompts, drafter, params, temperature=0.7)

Kinds are entries of `spec_jax.drafters.registry`; the loaders of the built-in ones are here.
The default drafter and tree come from the measured table `assets/measured_defaults.json`.
`spec-jax generate` without `--drafter` uses `default_drafter_choice`, so the API and the command
line pick the same drafter for the same call; `spec-jax serve` uses it with `engine=True` (the
table's entries measured on the serving engine, by slots, where a backend has them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from spec_jax.checkpoints import LoadedModel, load_target
from spec_jax.drafters import registry

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # spec_jax/assets
MEASURED_DEFAULTS = ASSETS / "measured_defaults.json"

# Drafters trained by spec_jax for the embedded default model, shipped inside the package with
# quantized weights (checkpoints/quantized.py; how they were made: spec_jax/assets/README.md).
SHIPPED_DRAFTERS = {kind.name: kind.shipped for kind in registry.kinds() if kind.shipped}


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
    entry = registry.get(kind)
    if entry.shipped is None:
        why = entry.not_shipped or f"no {kind} drafter ships with spec_jax; pass --drafter {kind}=PATH."
        raise ValueError(f"drafter {kind!r} needs a checkpoint: {why}")
    path = ASSETS / entry.shipped
    if not (path / "config.json").is_file():
        raise ValueError(f"the shipped {kind} drafter is missing from this install ({path}).")
    return path


def load_drafter(kind: str, target: LoadedModel, path: str | None = None, k: int | None = None) -> tuple[Any, Any]:
    """(drafter, drafter_params) for `generate` by kind (a `spec_jax.drafters.registry` name, or
    "KIND+ngram" for prompt lookup in front, "KIND+suffix" for the suffix lookup across requests,
    with an empty store); (None, None) for "none", the AR baseline. Without a
    path, a kind that loads a checkpoint uses the one inside the target's own checkpoint where it
    has one (Qwen3.5 / Qwen3-Next's MTP head), else the one shipped for the default model. k=None keeps
    the kind's default K (a checkpoint's own for DFlash, EAGLE-3, Medusa)."""
    entry, front = registry.parse(kind)
    if entry.takes_path and path is None:
        own = registry.resolve(entry.in_target)(target) if entry.in_target else None
        path = str(own if own is not None else shipped_drafter_path(entry.name, target))
    drafter, params = entry.loader()(target, path, entry.default_k if k is None else k)
    if k is None:
        drafter = moe_target_k(drafter, target)
    if front == registry.LOOKUP:
        from spec_jax.drafters.lookup import LookupFirstDrafter

        drafter = LookupFirstDrafter(drafter)
    elif front == registry.SUFFIX:
        from spec_jax.drafters.suffix import SuffixFirstDrafter, with_store

        drafter = SuffixFirstDrafter(drafter)
        params = with_store(drafter, params)
    return drafter, params


# Loaders of the built-in kinds, named by their registry entries: (target, path, k) -> (drafter, params).
def load_none(target: LoadedModel, path: str | None, k: int | None) -> tuple[None, None]:
    return None, None


def load_ngram(target: LoadedModel, path: str | None, k: int) -> tuple[Any, None]:
    from spec_jax.drafters.ngram import NGramDrafter

    return NGramDrafter(k=k), None


def load_suffix(target: LoadedModel, path: str | None, k: int) -> tuple[Any, Any]:
    from spec_jax.drafters.suffix import SuffixDrafter, with_store

    drafter = SuffixDrafter(k=k)
    return drafter, with_store(drafter, None)


def load_self(target: LoadedModel, path: str | None, k: int) -> tuple[Any, Any]:
    from spec_jax.drafters.draft_model import self_drafter

    return self_drafter(target.cfg, k=k), target.params


def load_draft_model(target: LoadedModel, path: str, k: int) -> tuple[Any, Any]:
    from spec_jax.drafters.draft_model import DraftModelDrafter, check_same_tokenizer

    draft = load_target(path, dtype=target.cfg.dtype)
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    return DraftModelDrafter(draft.cfg, k=k), draft.params


def load_dflash_drafter(target: LoadedModel, path: str, k: int | None) -> tuple[Any, Any]:
    from spec_jax.checkpoints.dflash import load_dflash

    return _on_device(*load_dflash(path, dtype=target.cfg.dtype, k=k))


def load_eagle3_drafter(target: LoadedModel, path: str, k: int | None) -> tuple[Any, Any]:
    from spec_jax.checkpoints.eagle3 import load_eagle3

    return _on_device(*load_eagle3(path, dtype=target.cfg.dtype, k=k, target_cfg=target.cfg))


def load_medusa_drafter(target: LoadedModel, path: str, k: int | None) -> tuple[Any, Any]:
    from spec_jax.checkpoints.medusa import load_medusa

    return _on_device(*load_medusa(path, dtype=target.cfg.dtype, k=k))


def _on_device(drafter: Any, host_params: Any) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    return drafter, jax.tree.map(jnp.asarray, host_params)


# --------------------------------------------------------------------------- the measured default
@functools.lru_cache(maxsize=None)
def measured_defaults() -> dict[str, Any]:
    """The measured table (assets/measured_defaults.json): per backend and decoding mode, the
    default drafter and tree, with the measurement behind each."""
    return json.loads(MEASURED_DEFAULTS.read_text())


def measured_entry(section: dict[str, Any], backend: str, temperature: float, batch_size: int,
                   engine: bool = False) -> dict[str, Any]:
    """The rule that reads a section ("drafter", "tree", "depth") of the table: the entries of
    this backend and decoding mode (greedy when temperature is 0, else sampled; `engine`: the
    backend's "engine" entries where it has them, measured on `spec-jax serve`'s engine, whose
    drafter serves every temperature), or the section's "unmeasured" ones; the first whose
    up_to_batch covers the batch (null: any) wins."""
    modes = section["backends"].get(backend, {})
    mode = "engine" if engine and "engine" in modes else "greedy" if temperature <= 0 else "sampled"
    entries = modes.get(mode, section["unmeasured"])
    return next(e for e in entries if e["up_to_batch"] is None or batch_size <= e["up_to_batch"])


def _backend(backend: str | None) -> str:
    if backend is not None:
        return backend
    import jax

    return jax.default_backend()


def default_tree_choice(
    batch_size: int = 1, temperature: float = 0.0, backend: str | None = None, table: dict | None = None
) -> tuple[int, str]:
    """(tree budget, reason) for the default drafter: 0 (a chain) or N nodes, per backend,
    decoding mode and batch size, from the measured table (`table`, default the shipped one)."""
    entry = measured_entry((table or measured_defaults())["tree"], _backend(backend), temperature, batch_size)
    return entry["tree"], entry["why"]


def default_depth_choice(
    batch_size: int = 1, temperature: float = 0.0, backend: str | None = None, table: dict | None = None
) -> tuple[str, str]:
    """("adaptive" or "fixed", reason) for the default drafter when no K is given: whether each
    step picks its depth (`spec_jax.decoding.depth`) or drafts the drafter's K, per backend,
    decoding mode and batch size, from the measured table."""
    entry = measured_entry((table or measured_defaults())["depth"], _backend(backend), temperature, batch_size)
    return entry["depth"], entry["why"]


def moe_target_choice(backend: str | None = None, table: dict | None = None) -> tuple[int | None, int, str]:
    """(largest K, tree budget, reason) for a drafter on a mixture-of-experts target when the
    caller names no K (None: the drafter's own) and no tree, per backend, from the measured table:
    a MoE verify pass reads the union of its tokens' experts, so it costs more per token than a
    dense model's (benchmarks/RESULTS.md, Issue 43). One entry per backend: the cost is the
    target's, whatever the decoding mode."""
    section = (table or measured_defaults())["moe_target"]
    entry = section["backends"].get(_backend(backend), section["unmeasured"])
    return entry["max_k"], entry["tree"], entry["why"]


def moe_target_k(drafter: Any, target: LoadedModel, backend: str | None = None) -> Any:
    """`drafter` with its K cut to `moe_target_choice`'s largest K when `target` is a
    mixture-of-experts model; any other drafter or target unchanged."""
    if drafter is None or getattr(target.cfg, "moe", None) is None:
        return drafter
    max_k, _, _ = moe_target_choice(backend=backend)
    if max_k is None or drafter.k <= max_k:
        return drafter
    from spec_jax.decoding.generate import with_k

    return with_k(drafter, max_k)


def default_drafter_choice(
    default_model: bool, k: int | None = None, batch_size: int = 1, temperature: float = 0.0,
    backend: str | None = None, table: dict | None = None, engine: bool = False,
) -> tuple[str, int | None, str]:
    """(kind, K, reason) of the drafter to use when none is named: for the default model, the one
    measured fastest on `backend` (default: JAX's) for this batch size and decoding mode (greedy
    when temperature is 0, else sampled; `engine`: for `spec-jax serve`'s engine of batch_size
    slots, where the backend's table has engine entries); plain decoding for other targets, for
    which spec_jax ships no drafter. A K the caller gives wins over the measured one."""
    if not default_model:
        return "none", k, "no drafter named and none shipped for this target"
    entry = measured_entry((table or measured_defaults())["drafter"], _backend(backend), temperature, batch_size,
                           engine)
    kind = entry["kind"]
    k = None if kind == "none" else (k if k is not None else entry["k"])
    return kind, k, f"default for the default model: {entry['why']}"


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
