"""From what a user types to what `generate` takes: prompts, drafters, mesh, dtype.

Shared by the `spec-jax` commands. Everything a user can
get wrong raises `UsageError` (a ValueError) with a one-line message naming the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from spec_jax.checkpoints import LoadedModel, apply_chat_template, load_target
from spec_jax.checkpoints.shipped import (
    default_depth_choice,
    default_drafter_choice,
    default_tree_choice,
    load_drafter,
)
from spec_jax.drafters import registry


class UsageError(ValueError):
    """A mistake in the user's arguments or inputs (the CLI prints it and exits 2)."""


# --------------------------------------------------------------------------- prompts
@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as given: exactly one of text (a user message), messages (a chat) or ids."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    ids: tuple[int, ...] | None = None
    source: str = ""  # for error messages: "argument 1", "prompts.jsonl:3"


def parse_prompt_ids(text: str, source: str = "--prompt-ids") -> Prompt:
    """ "1,2,3" -> Prompt(ids=(1, 2, 3))."""
    parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
    try:
        ids = tuple(int(p) for p in parts)
    except ValueError:
        raise UsageError(
            f"{source} {text!r} is not a comma-separated list of integer token ids (e.g. 1,2,3)."
        ) from None
    if not ids:
        raise UsageError(f"{source} is empty: give at least one token id, e.g. --prompt-ids 1,2,3.")
    return Prompt(ids=ids, source=source)


def check_text(text: str, where: str) -> str:
    """Text that encodes as UTF-8. Python hands undecodable bytes of a command-line argument over
    as lone surrogates (and JSON can spell them, "\\ud800"); tokenizers cannot encode those."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise UsageError(f"{where} is not valid UTF-8 text ({what} at character {e.start + 1}); pass UTF-8 text.") from None
    return text


def read_prompt_file(path: str | os.PathLike) -> list[Prompt]:
    """A JSONL file, one object per line with "prompt" (text), "messages" ([{role, content}])
    or "prompt_ids" ([int]). Blank lines are skipped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UsageError(f"prompt file {str(path)!r} does not exist.")
    prompts = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        where = f"{path.name}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(
                f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save "
                f"{path.name} as UTF-8."
            ) from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where} is not valid JSON ({e.msg}); write one JSON object per line.") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object with 'prompt', 'messages' or 'prompt_ids'.")
        if "prompt_ids" in obj:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise UsageError(f"{where}: 'prompt_ids' must be a list of integers.")
            if not ids:
                raise UsageError(f"{where}: 'prompt_ids' is empty; give at least one token id.")
            prompts.append(Prompt(ids=tuple(ids), source=where))
        elif "messages" in obj:
            messages = obj["messages"]
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
                or not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages)
            ):
                raise UsageError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects "
                                 "whose role and content are strings.")
            for m in messages:
                check_text(m["content"], where)
            prompts.append(Prompt(messages=tuple(messages), source=where))
        elif "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise UsageError(f"{where}: 'prompt' must be a string.")
            prompts.append(Prompt(text=check_text(obj["prompt"], where), source=where))
        else:
            raise UsageError(f"{where}: the object has none of 'prompt', 'messages', 'prompt_ids'.")
    if not prompts:
        raise UsageError(f"prompt file {str(path)!r} holds no prompts.")
    return prompts


def encode_prompts(target: LoadedModel, prompts: Sequence[Prompt], chat: bool | None = None) -> list[list[int]]:
    """Token ids per prompt. Text is wrapped in the chat template unless chat is False (default
    on); messages always are; ids are used as given."""
    if not prompts:
        raise UsageError("no prompt given: pass PROMPT text, --prompt-file or --prompt-ids.")
    encoded = []
    for i, p in enumerate(prompts):
        where = p.source or f"prompt {i}"
        if p.ids is not None:
            encoded.append(list(p.ids))
            continue
        if target.tokenizer is None:
            raise UsageError(
                f"{target.source} ships no tokenizer, so text prompts cannot be encoded; pass "
                "--prompt-ids or a checkpoint with tokenizer files."
            )
        if p.messages is not None:
            for m in p.messages:
                check_text(str(m.get("content", "")), where)
            ids = apply_chat_template(target.tokenizer, list(p.messages), target.chat_template)
        else:
            if not p.text or not p.text.strip():
                raise UsageError(f"{where} is empty: give some prompt text.")
            check_text(p.text, where)
            if chat is False:
                ids = list(target.tokenizer.encode(p.text))
            else:
                ids = apply_chat_template(target.tokenizer, p.text, target.chat_template)
        encoded.append(ids)
    return encoded


# --------------------------------------------------------------------------- drafters
@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """A drafter as named by the user: kind, optional checkpoint path, optional K."""

    kind: str
    path: str | None = None
    k: int | None = None
    reason: str = dataclasses.field(default="", compare=False)  # why it was chosen, when by default
    brief: str = dataclasses.field(default="", compare=False)  # the reason's gist, for a log line
    tree: int | None = None  # draft nodes per step for a tree (0 = a chain; None = the drafter's)
    adaptive: bool = False  # --k adaptive: each step picks its depth, K (the drafter's) the largest

    @property
    def generate_k(self) -> str | None:
        """`generate`'s k for this drafter beyond the K it was built with: "adaptive" or None."""
        return "adaptive" if self.adaptive else None

    @property
    def label(self) -> str:
        name = self.kind if self.path is None else f"{self.kind}:{Path(self.path).name or self.path}"
        name = name if self.k is None else f"{name} k={self.k}"
        name = f"{name} k=adaptive" if self.adaptive else name
        return name if not self.tree else f"{name} tree={self.tree}"


def parse_drafter_spec(text: str, k: int | None = None) -> DrafterSpec:
    """ "ngram", "self", "draft-model=PATH" / "draft-model:PATH", "dflash=PATH", "eagle3=PATH", and
    any model drafter with prompt lookup in front: "dflash+ngram", "draft-model+ngram=PATH", ..."""
    kind, path = text, None
    for sep in ("=", ":"):
        if sep in text:
            kind, path = text.split(sep, 1)
            break
    return make_drafter_spec(kind.strip(), path, k)


def make_drafter_spec(kind: str, path: str | None, k: int | None) -> DrafterSpec:
    for front, alone in ((registry.LOOKUP, "ngram"), (registry.SUFFIX, "suffix")):
        if kind.endswith(front) and kind not in registry.names():
            raise UsageError(
                f"drafter {kind!r}: a lookup ({front}) goes in front of a model drafter: "
                f"{', '.join(registry.lookup_names(front))}; the lookup alone is {alone!r}."
            )
    if kind not in registry.names():
        raise UsageError(f"unknown drafter {kind!r}; choose one of {', '.join(registry.names())}.")
    if not registry.get(kind).takes_path and path:
        raise UsageError(f"drafter {kind!r} takes no checkpoint path (got {path!r}).")
    if k is not None and k < 1:
        raise UsageError(f"--k must be >= 1 (drafts per step), got {k}.")
    return DrafterSpec(kind, path, k)


def build_drafter(spec: DrafterSpec | None, target: LoadedModel) -> tuple[Any, Any]:
    """(drafter, drafter_params) for `generate`; (None, None) for the AR baseline."""
    if spec is None:
        return None, None
    drafter, params = load_drafter(spec.kind, target, spec.path, spec.k)
    if spec.tree is not None:
        from spec_jax.decoding.generate import with_tree

        try:
            drafter = with_tree(drafter, spec.tree)
        except ValueError as e:
            raise UsageError(f"--tree {spec.tree}: {e}") from None
    return drafter, params


def default_drafter_spec(
    target_arg: str | None, k: int | None, batch: int = 1, temperature: float = 0.0, engine: bool = False
) -> DrafterSpec:
    """`generate` without --drafter: `default_drafter_choice` for the default model (no --target)
    at this batch size and temperature (`engine`: `serve`'s engine of `batch` slots), with the
    reason in `DrafterSpec.reason`; each step picks its depth (`adaptive`) where
    `default_depth_choice` says so and no K is given."""
    pinned = k is not None
    kind, k, reason = default_drafter_choice(target_arg is None, k, batch, temperature, engine=engine)
    if kind == "none":
        return DrafterSpec(kind, None, k, reason=reason, brief=in_brief(reason))
    tree, why = default_tree_choice(batch, temperature)
    depth, depth_why = default_depth_choice(batch, temperature)
    adaptive = depth == "adaptive" and not pinned  # --k N pins K
    parts = [reason, why, *([depth_why] if adaptive else [])]
    return DrafterSpec(kind, None, k, reason="; ".join(parts), brief="; ".join(map(in_brief, parts)),
                       tree=tree or None, adaptive=adaptive)


def in_brief(why: str) -> str:
    """A measured default's reason cut to its gist for a log line: its first clause, without the
    parenthesised figures and citations. Whole, the three reasons of the default model's default
    ran to 1,800 characters on every `generate`; `--json` keeps them whole (`drafter_reason`)."""
    kept, depth = [], 0
    for ch in why:
        if ch == "(":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    text = re.sub(r" ([,:;.])", r"\1", " ".join("".join(kept).split()))  # no gap where a figure was
    for end in ("; ", ". "):
        text = text.split(end, 1)[0]
    return text.rstrip(" .")


def drafter_k(drafter: Any) -> int:
    return 0 if drafter is None else int(drafter.k)


# --------------------------------------------------------------------------- mesh
def mesh_kwargs(mesh_spec: str | None, target: LoadedModel) -> dict[str, Any]:
    """{"mesh": Mesh} for `generate` when a mesh was asked for, else {}."""
    if not mesh_spec:
        return {}
    from spec_jax.sharding.mesh import make_mesh

    return {"mesh": make_mesh(mesh_spec, cfg=target.cfg)}


def resolve_dtype(dtype: str | None) -> str:
    """"auto" (or None) -> float32 on CPU, where bfloat16 matmuls are several times slower, and
    bfloat16 on GPU/TPU."""
    if dtype in (None, "auto"):
        import jax

        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return dtype


def load_target_or_fail(spec: str | None, dtype: str | None = "auto", untie_head: bool | None = None) -> LoadedModel:
    """`load_target` in `dtype` ("auto": see `resolve_dtype`)."""
    if spec is not None and not spec.strip():
        raise UsageError("--target is empty; pass an HF dir, a hub id, a .gguf file or random:PRESET.")
    if spec is None:
        from spec_jax.checkpoints.default_model import install_default_model

        install_default_model()  # the command line's first run on a fresh machine
    return load_target(spec, dtype=resolve_dtype(dtype), untie_head=untie_head)
