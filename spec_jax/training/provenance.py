"""Where training files came from, and writing them so that nothing is half-written or mixed up.

Shard manifests, feature stores and training checkpoints record what they were made from (the
target's weights hash, the data's hash, each file's sha256) and are checked against it when read
back or resumed. Files are written under a unique temporary name in their own directory and
renamed into place, and a directory being written holds a lock file that refuses a second writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from spec_jax.checkpoints.atomic import write_atomic, write_json_atomic  # noqa: F401 (re-exported)


def weights_sha256(params: Any) -> str:
    """sha256 over every leaf of a params pytree (its path, then its bytes): the target's identity."""
    import jax

    weights = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
        weights.update(jax.tree_util.keystr(path).encode())
        weights.update(np.ascontiguousarray(leaf).tobytes())
    return weights.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def arrays_sha256(*arrays: np.ndarray) -> str:
    """sha256 of the arrays' bytes in order (read in row blocks, so memory maps stay cheap)."""
    digest = hashlib.sha256()
    for a in arrays:
        rows = max(1, (1 << 24) // max(a[:1].nbytes, 1))
        for start in range(0, len(a), rows):
            digest.update(np.ascontiguousarray(a[start : start + rows]).tobytes())
    return digest.hexdigest()


def read_json(path: Path, fix: str) -> Any:
    """A JSON file's value; an unreadable one is a ValueError naming the file and `fix`."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); {fix}") from e


def differing(saved: dict, expected: dict, keys: Any = None) -> list[str]:
    """Keys of `expected` (or `keys`) whose values differ, compared after a JSON round trip (a tuple
    saved as a JSON list is the same value)."""
    saved, expected = json.loads(json.dumps(saved)), json.loads(json.dumps(expected))
    return sorted(k for k in (expected if keys is None else keys) if saved.get(k) != expected.get(k))


def describe_differences(saved: dict, now: dict, keys: list[str]) -> str:
    """ "differs in a, b (a: 1 there, 2 now; b: ...)", hashes shortened."""

    def show(value: Any) -> str:
        text = repr(value)
        return text[:15] + "...'" if isinstance(value, str) and len(value) == 64 else text

    detail = "; ".join(f"{k}: {show(saved.get(k))} there, {show(now.get(k))} now" for k in keys)
    return f"differs in {', '.join(keys)} ({detail})"


def matching_manifest(path: Path, expected: dict, holds: str, fix: str) -> dict | None:
    """The manifest of resumable work at `path` (None when there is none yet); one whose
    `expected` fields differ is refused: the directory `holds` other work, `fix` says what to do."""
    if not path.is_file():
        return None
    existing = read_json(path, f"delete {path.parent} and re-run to rebuild it.")
    if not isinstance(existing, dict):
        raise ValueError(f"{path} is not a spec_jax manifest; delete {path.parent} and re-run to rebuild it.")
    differs = differing(existing, expected)
    if differs:
        raise ValueError(f"{path.parent} holds {holds} ({describe_differences(existing, expected, differs)}); {fix}")
    return existing


LOCK_NAME = ".writer.lock"
# A lock file that is still empty this long after it was made belongs to a writer that died.
_EMPTY_LOCK_STALE_S = 60.0


def _holder_gone(lock: Path) -> bool:
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        try:
            return time.time() - lock.stat().st_mtime > _EMPTY_LOCK_STALE_S
        except FileNotFoundError:
            return True
    if holder.get("host") != socket.gethostname():
        return False  # another machine's process: cannot be checked from here
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError):
        return False
    return False


@contextlib.contextmanager
def writer_lock(directory: Path, command: str) -> Iterator[None]:
    """Hold `directory`'s writer lock (an O_EXCL lock file) while writing into it. A second writer
    is refused with a clear message; a lock left by a process that died on this host is taken over."""
    lock = Path(directory) / LOCK_NAME
    me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _holder_gone(lock):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                continue
            try:
                holder = lock.read_text().strip() or "a process that has not written its id yet"
            except OSError:
                holder = "another process"
            raise ValueError(
                f"{directory} is being written by another `{command}` ({holder}); wait for it to finish, "
                f"or delete {lock} if that process no longer runs."
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(me)
        break
    else:
        raise ValueError(f"could not take the writer lock {lock}; delete it if no other process writes there.")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if lock.read_text() == me:
                os.unlink(lock)
