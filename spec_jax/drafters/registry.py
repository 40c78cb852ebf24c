"""Drafter kinds by name: one entry per kind, read by everything that names drafters.

`spec_jax.load_drafter`, `spec-jax generate|bench|info --drafter`, `spec-jax train KIND`, their help
texts and the "KIND+ngram" composition (prompt lookup in front of a model drafter) all read this
table (and "KIND+suffix", the suffix lookup across requests in front), so a new kind is one
module plus one `register` call:

    register(DrafterKind(
        name="bigram", help="a learned next-token table", load=load_bigram,   # (target, path, k)
        takes_path=True, default_k=3, drafts_trees=False, recipe=BigramRecipe, lookup_first=True,
    ))

`load` and `recipe` may be given as "module:attribute" strings, resolved on first use: the
built-in entries below name their loaders (`spec_jax.checkpoints.shipped`) and training recipes
(`spec_jax.training`) that way, so reading the table (for `--help`) imports no training code, and
this module imports nothing of spec_jax (the layers above it import it, never the reverse).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

# "KIND+ngram": prompt lookup in front of a model drafter (spec_jax/drafters/lookup.py).
LOOKUP = "+ngram"
# "KIND+suffix": the suffix lookup (the row's tokens and a store of earlier requests) in front
# (spec_jax/drafters/suffix.py). Both go with every kind that has `lookup_first`.
SUFFIX = "+suffix"
FRONTS = (LOOKUP, SUFFIX)


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """One drafter kind. `load(target, path, k) -> (drafter, params)` gets the checkpoint path
    (for a kind that takes one: the given one, else the one shipped for the default model) and K
    (the caller's, else `default_k`; None keeps the checkpoint's own)."""

    name: str
    help: str  # one line for the command line's help texts
    load: Callable[..., tuple[Any, Any]] | str
    takes_path: bool = False  # loads a checkpoint (`--drafter KIND=PATH`)
    shipped: str | None = None  # asset dir (spec_jax/assets) of the default model's drafter of this kind
    not_shipped: str | None = None  # for a kind that takes a path and ships none: why, and how to get one
    # "module:function" (target -> a path or None): the drafter inside the target's own checkpoint,
    # used when no path is given (Qwen3.5's mtp.* head lives in the target's directory)
    in_target: str | None = None
    default_k: int | None = None  # K when the caller names none; None: the checkpoint's
    drafts_trees: bool = False  # has `propose_tree` (`--tree N`)
    recipe: Any = None  # a `spec_jax.training.run.Recipe` class for `spec-jax train KIND`, or None
    lookup_first: bool = False  # "KIND+ngram" and "KIND+suffix" are accepted

    def loader(self) -> Callable[..., tuple[Any, Any]]:
        return resolve(self.load)

    def recipe_class(self) -> Any:
        if self.recipe is None:
            raise ValueError(f"drafter {self.name!r} has no training recipe.")
        return resolve(self.recipe)


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind, replace: bool = False) -> DrafterKind:
    """Add a kind (a name already taken is an error unless `replace`)."""
    if any(f in kind.name for f in FRONTS) or "=" in kind.name or ":" in kind.name or "," in kind.name:
        raise ValueError(f"drafter name {kind.name!r} may not contain {LOOKUP!r}, {SUFFIX!r}, '=', ':' or ','.")
    if kind.name in _KINDS and not replace:
        raise ValueError(f"drafter kind {kind.name!r} is already registered.")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def kinds() -> tuple[DrafterKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_KINDS.values())


def names() -> tuple[str, ...]:
    """Every name `--drafter` accepts: the kinds, then their "KIND+ngram" and "KIND+suffix" forms."""
    return (*_KINDS, *lookup_names(), *lookup_names(SUFFIX))


def lookup_names(front: str = LOOKUP) -> tuple[str, ...]:
    return tuple(k.name + front for k in _KINDS.values() if k.lookup_first)


def parse(name: str) -> tuple[DrafterKind, str]:
    """(kind, the lookup in front: "" for none, LOOKUP or SUFFIX) for a `--drafter` name;
    ValueError naming the choices."""
    front = next((f for f in FRONTS if name.endswith(f)), "")
    kind = _KINDS.get(name[: len(name) - len(front)])
    if kind is not None and (kind.lookup_first or not front):
        return kind, front
    raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(names())}.")


def get(name: str) -> DrafterKind:
    kind, _ = parse(name)
    return kind


def trainable() -> tuple[DrafterKind, ...]:
    """Kinds `spec-jax train` can train."""
    return tuple(k for k in _KINDS.values() if k.recipe is not None)


def tree_kinds() -> tuple[str, ...]:
    return tuple(k.name for k in _KINDS.values() if k.drafts_trees)


def synopsis() -> str:
    """ "none | ngram | self | draft-model[=PATH] | ... | eagle3=PATH | ..." for help texts."""

    def form(kind: DrafterKind) -> str:
        if not kind.takes_path:
            return kind.name
        return f"{kind.name}=PATH" if kind.shipped is None else f"{kind.name}[=PATH]"

    return " | ".join(form(k) for k in _KINDS.values())


def described() -> str:
    """ "ngram: prompt lookup ...; self: ..." (every kind's help line) for help texts."""
    return "; ".join(f"{k.name}: {k.help}" for k in _KINDS.values())


def resolve(ref: Any) -> Any:
    """A "module:attribute" reference, imported; anything else as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


_SHIPPED_LOADERS = "spec_jax.checkpoints.shipped"
for _kind in (
    DrafterKind("none", "plain decoding, the AR baseline", f"{_SHIPPED_LOADERS}:load_none"),
    DrafterKind("ngram", "prompt lookup: the tokens that followed the last n-gram's latest earlier "
                "occurrence", f"{_SHIPPED_LOADERS}:load_ngram", default_k=4, drafts_trees=True),
    DrafterKind("suffix", "suffix lookup across requests: the longest match of the last tokens in the "
                "row and in a store of earlier prompts and outputs", f"{_SHIPPED_LOADERS}:load_suffix",
                default_k=4, drafts_trees=True),
    DrafterKind("self", "the target drafting for itself (a diagnostic: every draft is accepted)",
                f"{_SHIPPED_LOADERS}:load_self", default_k=4, drafts_trees=True),
    DrafterKind("draft-model", "a small LM with the target's tokenizer (HF dir, hub id or GGUF)",
                f"{_SHIPPED_LOADERS}:load_draft_model", takes_path=True, shipped="smollm2_draft_model",
                default_k=4, drafts_trees=True, recipe="spec_jax.training.run:DraftModelRecipe",
                lookup_first=True),
    DrafterKind("dflash", "DFlash: a block of drafts in one pass over the target's hidden states",
                f"{_SHIPPED_LOADERS}:load_dflash_drafter", takes_path=True, shipped="smollm2_dflash",
                drafts_trees=True, recipe="spec_jax.training.run:DFlashRecipe", lookup_first=True),
    DrafterKind("eagle3", "an EAGLE-3 head (speculators format)", f"{_SHIPPED_LOADERS}:load_eagle3_drafter",
                takes_path=True, drafts_trees=True, recipe="spec_jax.training.run:Eagle3Recipe",
                lookup_first=True,
                not_shipped="no EAGLE-3 drafter ships with spec_jax (no default used it, and DFlash drafts "
                "better for the default model; it was retired to keep the package small). Train one with "
                "`spec-jax train eagle3 --data DATA --out runs/eagle3` (spec_jax/assets/README.md has "
                "the command that made the retired one) and pass --drafter eagle3=runs/eagle3/drafter, "
                "or use --drafter dflash."),
    DrafterKind("medusa", "Medusa heads on the target's last hidden state",
                f"{_SHIPPED_LOADERS}:load_medusa_drafter", takes_path=True, drafts_trees=True,
                recipe="spec_jax.training.medusa:MedusaRecipe", lookup_first=True,
                not_shipped="no Medusa heads ship with spec_jax (trained on this CPU they lost to plain "
                "decoding; benchmarks/RESULTS.md). Train them with `spec-jax train medusa --data DATA "
                "--out runs/medusa` and pass --drafter medusa=runs/medusa/drafter."),
    DrafterKind("mtp", "a model's own multi-token-prediction drafter (Gemma 4's assistant, reading the "
                "target's cache; the head inside a Qwen3.5 / Qwen3-Next checkpoint: PATH = the target's "
                "directory)", "spec_jax.checkpoints.mtp:load_mtp_drafter", takes_path=True,
                drafts_trees=True, recipe="spec_jax.training.mtp:MtpRecipe", lookup_first=True,
                in_target="spec_jax.checkpoints.qwen_mtp:head_dir_of_target",
                not_shipped="MTP drafters come with their model: pass the model's assistant checkpoint, "
                "e.g. --drafter mtp=PATH/gemma-4-e2b-it-assistant for a Gemma 4 E2B target, or a Qwen3.5 / "
                "Qwen3-Next target's own directory (its mtp.* head)."),
):
    register(_kind)
