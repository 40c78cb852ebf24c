"""The suite's own set-up: the compilation cache trim and the cheap codegen flags."""

from __future__ import annotations

import os

from cheap_xla import CHEAP_XLA_FLAGS, with_cheap_flags
from conftest import trim_test_cache


def test_trim_test_cache_deletes_the_least_recently_written_entries(tmp_path):
    for i in range(5):
        path = tmp_path / f"entry{i}-cache"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))  # entry0 the oldest
    trim_test_cache(str(tmp_path), max_bytes=250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry3-cache", "entry4-cache"]
    trim_test_cache(str(tmp_path / "missing"))  # no directory yet: nothing to do


def test_cheap_flags_are_added_once_and_keep_the_callers():
    flags = with_cheap_flags("--xla_force_host_platform_device_count=8")
    assert flags.startswith("--xla_force_host_platform_device_count=8 ")
    assert with_cheap_flags(flags) == flags
    assert set(CHEAP_XLA_FLAGS.split()) <= set(flags.split())
