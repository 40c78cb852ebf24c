"""Compiled programs saved whole on disk, so a later process skips tracing and lowering as well as
XLA's compile: the command line's second `spec-jax generate` loads its loop and calls it.

JAX's persistent compilation cache is keyed by the lowered program, so every start still traces
and lowers each program before the cache can answer (1.3-2.3 s of a warm 4-5 s `generate` with the
default model). Here a program is found by what produces it instead: a digest of spec_jax's own
source files, the jax / jaxlib / numpy versions, the backend and its devices, XLA_FLAGS, the
compiler options, JAX's config and the cache attention each backend takes, the program's name,
its static arguments and every argument's shape, dtype and placement. Editing any spec_jax
source, or changing any of those, misses, and the program compiles as before.

Only what can be described exactly is saved: static arguments made of spec_jax dataclasses,
numbers, strings, tuples, numpy arrays, spec_jax functions; a user's own model class (its code is
not in the digest), a mesh or several processes are compiled the usual way. A file that cannot be
read, unpacked or loaded, or that does not match the call, is a miss too (and is removed).

Off unless `enable(directory)` was called: the command line does, inside its compilation-cache
directory (`spec_jax.app.compilation_cache`). A file here runs as machine code when loaded, like an
entry of JAX's own cache: keep the directory private to its user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import os
import pickle
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

SUBDIR = "spec_jax-programs"
SUFFIX = ".program"
FORMAT = b"spec_jax saved program 1\n"
# Saved programs are 0.1-2 MB each (compressed); the oldest-used go beyond this many bytes.
MAX_BYTES = 512 * 1024 * 1024
# Modules whose functions and classes a static argument may name: their code is in the digest
# (spec_jax's source) or pinned by a version in it.
_KNOWN_MODULES = ("spec_jax", "jax", "jaxlib", "numpy", "ml_dtypes", "builtins")

_directory: Path | None = None


def enable(directory: str | os.PathLike | None) -> Path | None:
    """Save and load programs under `directory`/spec_jax-programs (None turns it off) -> that path."""
    global _directory
    _directory = Path(directory) / SUBDIR if directory is not None else None
    return _directory


def directory() -> Path | None:
    return _directory


class _Undescribable(Exception):
    """A static argument with no exact, process-independent description: the program is not saved."""


def describe(value: Any) -> str:
    """An exact description of a static argument that is the same in every process (a dataclass
    by its type and every field, an array by its bytes); raises _Undescribable otherwise."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, enum.Enum):
        return f"{_type_name(type(value))}.{value.name}"
    if isinstance(value, (tuple, list)):
        return f"{_type_name(type(value))}({','.join(describe(v) for v in value)})"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({','.join(sorted(describe(v) for v in value))})"
    if isinstance(value, dict):
        return "dict(" + ",".join(f"{describe(k)}:{describe(v)}" for k, v in value.items()) + ")"
    if isinstance(value, (np.ndarray, np.generic)):
        data = np.ascontiguousarray(value)
        return f"array({data.dtype.str},{data.shape},{hashlib.sha256(data.tobytes()).hexdigest()})"
    if isinstance(value, np.dtype):
        return f"dtype({value.str})"
    if isinstance(value, type):
        return f"type({_type_name(value)})"
    if dataclasses.is_dataclass(value):
        fields = ",".join(f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{_type_name(type(value))}({fields})"
    if isinstance(value, functools.partial):
        return f"partial({describe(value.func)},{describe(value.args)},{describe(value.keywords)})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, np.ufunc)) or (
        callable(value) and type(value).__module__.startswith("jax")  # e.g. jax.nn.gelu, a jitted function
    ):
        name = getattr(value, "__qualname__", getattr(value, "__name__", ""))
        module = getattr(value, "__module__", None) or type(value).__module__
        if "<" in name or not _known(module) or getattr(value, "__closure__", None):
            raise _Undescribable(f"function {module}.{name}")  # a lambda, closure or foreign code
        return f"function({module}.{name})"
    raise _Undescribable(type(value).__qualname__)


def _known(module: str) -> bool:
    return module.split(".")[0] in _KNOWN_MODULES


def _type_name(cls: type) -> str:
    if not _known(cls.__module__) or "<" in cls.__qualname__:
        raise _Undescribable(f"{cls.__module__}.{cls.__qualname__}")  # its code is not in the digest
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every spec_jax source file (path and bytes): any edit makes every key new."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _environment() -> str:
    """Everything besides the program that changes what XLA would build for it."""
    import jaxlib

    from spec_jax.decoding.compiler_options import compiler_options
    from spec_jax.models import attention

    device = jax.devices()[0]
    config = {name: value for name, value in jax.config.values.items() if "cache" not in name and "log" not in name}
    return repr((
        source_digest(), jax.__version__, jaxlib.__version__, np.__version__, sys.version_info[:2],
        device.platform, device.client.platform_version, device.device_kind, jax.device_count(),
        jax.process_count(), os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
        sorted(compiler_options().items()),
        sorted((name, repr(value)) for name, value in config.items()),
        # The cache attention each backend traces (a table a benchmark or test may switch).
        sorted(attention.LIVE_ATTENTION.items()), attention.ACCELERATOR_LIVE_ATTENTION,
    ))


def _argument(leaf: Any, device: Any) -> str:
    """A leaf's shape, dtype and weak type; raises _Undescribable for one placed anywhere but `device`."""
    if isinstance(leaf, jax.Array):
        if leaf.sharding.device_set != {device}:
            raise _Undescribable("an argument placed on other devices")
        aval = leaf.aval
        return f"{aval.shape}{aval.dtype}{'w' if aval.weak_type else ''}"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return f"np{np.shape(leaf)}{leaf.dtype}"
    return describe(leaf)  # a Python scalar: jit traces it weakly typed, by type


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """Where a program is saved (`digest`) and what a loaded one must be called with (`in_tree`)."""

    digest: str
    in_tree: Any
    device: Any


def key_for(name: str, static: Any, args: tuple, kwargs: dict | None = None, mesh: Any = None) -> ProgramKey | None:
    """The key of program `name` (a jitted function called as fn(*args, **kwargs) with `static`
    fixed), or None when it is not to be saved: saving is off, a mesh or several processes, or a
    static argument without an exact description."""
    if _directory is None or mesh is not None or jax.process_count() > 1:
        return None
    device = jax.devices()[0]
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs or {}))
    try:
        described = (name, describe(static), str(in_tree), [_argument(leaf, device) for leaf in leaves])
    except _Undescribable:
        return None
    text = repr((_environment(), described))
    return ProgramKey(hashlib.sha256(text.encode()).hexdigest(), in_tree, device)


def _path(key: ProgramKey) -> Path:
    return _directory / f"{key.digest}{SUFFIX}"


def load(key: ProgramKey) -> Any | None:
    """The saved program for `key` (a `jax.stages.Compiled`), or None: none saved, or one that
    cannot be used (it is removed)."""
    from jax.experimental import serialize_executable

    path = _path(key)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(FORMAT):
            raise ValueError("not a saved program")
        digest, payload, in_tree, out_tree = pickle.loads(zlib.decompress(data[len(FORMAT):]))
        if digest != key.digest or in_tree != key.in_tree:
            raise ValueError("saved for another call")
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=[key.device])
    except Exception:  # noqa: BLE001 - any unusable file is a miss: compile as if it were absent
        path.unlink(missing_ok=True)
        return None
    with contextlib.suppress(OSError):  # another process may have pruned it meanwhile
        os.utime(path)  # recently used: pruned last
    return compiled


def save(key: ProgramKey, compiled: Any) -> None:
    """Save `compiled` for `key` (atomically: a reader sees the whole file or none); a program
    that cannot be serialized, or a directory that cannot be written, is skipped."""
    from jax.experimental import serialize_executable

    from spec_jax.checkpoints.atomic import atomic_path

    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        data = FORMAT + zlib.compress(pickle.dumps((key.digest, payload, in_tree, out_tree)), 1)
        _directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(_path(key)) as tmp:
            tmp.write_bytes(data)
        prune(_directory, MAX_BYTES)
    except Exception:  # noqa: BLE001 - saving is an optimisation: the program in hand still runs
        return


def prune(root: Path, max_bytes: int) -> None:
    """Remove the least recently used saved programs beyond `max_bytes` in all."""
    entries = []
    for path in root.glob(f"*{SUFFIX}"):
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size
