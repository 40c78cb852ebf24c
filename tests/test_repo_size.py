"""The tracked files fit what an accelerator host receives (a 64 MiB working tree, issue 34).

The budget is 48 MiB for `git ls-files`, leaving room for the shared/ folder and carried build
outputs. The shipped drafters are the bulk: they ship as int8 (spec_jax/assets/README.md).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUDGET_MIB = 48


def tracked_sizes() -> dict[str, int]:
    """{path: bytes} of the files `git ls-files` lists that exist in the working tree."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, timeout=60
    )
    if out.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout")
    paths = [p for p in out.stdout.decode().split("\0") if p]
    # A file deleted in the working tree but not yet from the index does not travel.
    return {p: (REPO / p).stat().st_size for p in paths if (REPO / p).is_file()}


def test_tracked_files_fit_the_accelerator_host_budget():
    sizes = tracked_sizes()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:8]
    listing = "\n".join(f"  {size / 2**20:7.2f} MiB  {path}" for path, size in largest)
    assert total <= BUDGET_MIB * 2**20, (
        f"`git ls-files` totals {total / 2**20:.1f} MiB, over the {BUDGET_MIB} MiB an accelerator "
        f"host can receive with room to spare. Largest files:\n{listing}\nKeep large files out of "
        "the repository (store drafters as int8: benchmarks/ship_drafters.py)."
    )
