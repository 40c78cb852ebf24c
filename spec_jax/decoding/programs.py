"""Compiled programs, cached once per process: `generate`'s loop, the stream's prefill and chunk,
and the engine's chunk and admit programs all go through a `ProgramCache`, and `clear_compiled`
releases every one of them."""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

# Every cache made, so clear_compiled reaches them all.
_ALL_CACHES: list[ProgramCache] = []


class ProgramCache:
    """Compiled executables by key, most recently used last, at most `max_size` of them: each entry
    holds an executable (and, through its static drafter, configs), so a long-lived process that
    sweeps shapes keeps only the newest."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._programs: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        _ALL_CACHES.append(self)

    def get_or_compile(self, key: Any, lower: Callable[[], Any], mesh: Any = None) -> tuple[Any, float]:
        """The executable for `key`, compiled from `lower()` (a `jax.stages.Lowered`) on first use
        -> (executable, seconds spent compiling now)."""
        exe = self._programs.get(key)
        if exe is not None:
            self._programs.move_to_end(key)
            return exe, 0.0
        t0 = time.perf_counter()
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            exe = lower().compile()
        self._programs[key] = exe
        while len(self._programs) > self.max_size:
            self._programs.popitem(last=False)
        return exe, time.perf_counter() - t0

    def __len__(self) -> int:
        return len(self._programs)

    def values(self) -> list[Any]:
        return list(self._programs.values())

    def clear(self) -> None:
        self._programs.clear()


def signature(args: Any, mesh: Any = None) -> str:
    """What a compiled program depends on besides its static arguments: every argument's shape and
    dtype (and sharding on a mesh)."""
    if mesh is None:
        return str(jax.tree_util.tree_map(lambda x: (jnp.shape(x), jnp.result_type(x)), args))
    return str(jax.tree_util.tree_map(lambda x: (jnp.shape(x), jnp.result_type(x), x.sharding), args))


def clear_compiled() -> None:
    """Release every compiled program spec_jax and JAX hold in this process.

    Each CPU executable keeps its machine code in its own memory mappings, and Linux caps a process
    at `vm.max_map_count` (65530 by default): a process that compiles thousands of distinct
    programs (a sweep over shapes, a test suite) aborts inside XLA once it reaches the cap. Calling
    this between phases keeps the count bounded; the next call of each program recompiles it.
    """
    for cache in _ALL_CACHES:
        cache.clear()
    jax.clear_caches()
