"""benchmarks/load_test.py's dense-against-paged comparison (issue 45, part 7), on the tiny
served target: its options parse, and a small run reports the paged pool back to empty."""

from __future__ import annotations

import sys
from pathlib import Path

from serving_testlib import save_tiny_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_load_test_compares_dense_and_paged_and_the_pool_ends_empty(tmp_path):
    from load_test import main

    target = save_tiny_target(tmp_path / "tiny")
    report = main(["--target", str(target), "--workload", "agent", "--drafters", "none", "--concurrency", "2",
                   "--requests-per-client", "1", "--max-tokens", "4", "--max-model-len", "256",
                   "--cache", "dense", "paged", "--kv-page-size", "32"])
    dense, paged = report["rows"]
    assert (dense["cache"], paged["cache"]) == ("dense", "paged")
    assert dense["requests"] == paged["requests"] == 4 and "pages_end" not in dense
    assert paged["kv_pages"] == 2 * dense["capacity"] // 32  # the dense engine's cache bytes
    assert 0 < paged["pages_peak"] <= paged["kv_pages"] and paged["pages_end"] == 0
