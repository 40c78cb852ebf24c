"""A pytest plugin: the CPU seconds of each test item (this process, plus the subprocesses it waited
for), with its wall seconds, one tab-separated line per item. On a shared machine wall times
scatter with the other processes' load; CPU times mostly do not, so test-time cuts are judged by
these (benchmarks/RESULTS.md, issue 39).

    PYTHONPATH=benchmarks CPU_TIMES_OUT=/tmp/cpu.tsv SPEC_JAX_TEST_COMPILATION_CACHE=$(mktemp -d) \\
        python -m pytest -q -p pytest_cpu_times tests/test_x.py

Module- and session-scoped fixtures count toward the first item that uses them.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

OUT = os.environ.get("CPU_TIMES_OUT", "cpu_times.tsv")


def cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = cpu_seconds(), time.time()
    yield
    with open(OUT, "a") as f:
        f.write(f"{item.nodeid}\t{cpu_seconds() - cpu:.2f}\t{time.time() - wall:.2f}\n")
