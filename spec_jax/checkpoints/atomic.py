"""Writing files and directories so that a reader never sees half of one.

Everything is written under a unique temporary name in the target's own directory (so two writers
never share one, and the final rename stays on one filesystem), then renamed into place. Every
checkpoint save and every training file goes through `atomic_path`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary file (or, with directory=True, an empty directory) beside `path`;
    when the block finishes it replaces `path`, and when it raises it is removed."""
    path = Path(path)
    prefix, suffix = f".{path.name}.", ".tmp"
    if directory:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o755 if directory else 0o644)  # mkstemp / mkdtemp create it owner-only
        if directory:
            _replace_dir(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path`; an existing `path` is first renamed aside (a directory cannot be
    replaced in one rename), then deleted."""
    if not path.exists():
        os.rename(tmp, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    os.rmdir(old)
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: str | os.PathLike, write: Callable[[Any], None], binary: bool = True) -> None:
    """write(file) into a temporary file beside `path`, then rename it into place."""
    with atomic_path(path) as tmp, open(tmp, "wb" if binary else "w") as f:
        write(f)


def write_json_atomic(path: str | os.PathLike, value: Any, indent: int = 1) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(value, indent=indent)), binary=False)
