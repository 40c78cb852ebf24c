"""Compiled programs, cached once per process: `generate`'s loop, the stream's prefill and chunk,
and the engine's chunk and admit programs all go through a `ProgramCache`, and `clear_compiled`
releases every one of them.

Every compile is counted (`compile_tally()`: programs, seconds, and how many came from JAX's
persistent compilation cache or whole from `saved_programs`), so the command line can say whether a
start paid for its compiles.
spec_jax never turns that cache on from the library: the command line does, or the user's JAX
config (`jax.config.update("jax_compilation_cache_dir", ...)`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from spec_jax.decoding import saved_programs
from spec_jax.decoding.compiler_options import compiler_options, set_compiler_options  # noqa: F401  (public here)

# Every cache made, so clear_compiled reaches them all.
_ALL_CACHES: list[ProgramCache] = []

# JAX's own events (jax/_src/compiler.py): a compile that consulted the persistent cache, and one
# that was served from it. A miss is a lookup without a hit (JAX's "cache_misses" event fires only
# when an entry is written, which the size and compile-time thresholds can skip).
_CACHE_LOOKUP = "/jax/compilation_cache/compile_requests_use_cache"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
# Per thread: JAX records the events in the compiling thread, and warm-up compiles in several.
_thread_events = threading.local()


def _count_cache_event(event: str, **_: Any) -> None:
    if event in (_CACHE_LOOKUP, _CACHE_HIT):
        setattr(_thread_events, event, getattr(_thread_events, event, 0) + 1)


jax.monitoring.register_event_listener(_count_cache_event)


def _cache_events() -> tuple[int, int]:
    """(lookups, hits) of the persistent cache seen so far in this thread."""
    return getattr(_thread_events, _CACHE_LOOKUP, 0), getattr(_thread_events, _CACHE_HIT, 0)


@dataclasses.dataclass
class CompileTally:
    """Programs compiled, the seconds it took (`trace_seconds` of them tracing and lowering to
    StableHLO, paid on every start: the persistent cache's key is the lowered program), and what
    JAX's persistent compilation cache did for them: `cache_hits` were loaded from it,
    `cache_misses` were looked up there and compiled anew (both 0 when the cache is off);
    `saved_hits` of the hits were loaded whole from `saved_programs`, with no tracing."""

    programs: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    trace_seconds: float = 0.0
    saved_hits: int = 0

    def add(self, other: CompileTally) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def since(self, earlier: CompileTally, seconds: float) -> CompileTally:
        """What was added after `earlier` (a copy of this tally then), over `seconds` of wall time."""
        added = dataclasses.replace(self)
        for field in dataclasses.fields(self):
            setattr(added, field.name, getattr(self, field.name) - getattr(earlier, field.name))
        added.seconds = seconds
        return added

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """E.g. "compiled 5 programs in 12.3s, 4.1s of it tracing (3 from the persistent cache)"."""
        if not self.programs:
            return "compiled no programs"
        plural = "" if self.programs == 1 else "s"
        looked_up = self.cache_hits + self.cache_misses
        untraced = f", {self.saved_hits} of them untraced" if self.saved_hits else ""
        source = f" ({self.cache_hits} from the persistent cache{untraced})" if looked_up else " (persistent cache off)"
        return (f"compiled {self.programs} program{plural} in {self.seconds:.1f}s, {self.trace_seconds:.1f}s of "
                f"it tracing{source}")


_TOTAL = CompileTally()
_TOTAL_LOCK = threading.Lock()


def compile_tally() -> CompileTally:
    """Every program spec_jax compiled in this process so far (a copy)."""
    with _TOTAL_LOCK:
        return dataclasses.replace(_TOTAL)


def _compile_counted(lower: Callable[[], Any], mesh: Any,
                     saved_as: Callable[[], saved_programs.ProgramKey | None] | None) -> tuple[Any, CompileTally]:
    """The program saved under `saved_as()`, else `lower().compile()` (then saved there) ->
    (executable, its tally: time, and whether the persistent cache or the saved program served it)."""
    t0 = time.perf_counter()
    key = saved_as() if saved_as is not None else None
    if key is not None:
        exe = saved_programs.load(key)
        if exe is not None:
            return exe, CompileTally(1, time.perf_counter() - t0, cache_hits=1, saved_hits=1)
    lookups0, hits0 = _cache_events()
    lowering = time.perf_counter()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        lowered = lower()
        traced = time.perf_counter()
        exe = lowered.compile(compiler_options=compiler_options() or None)
    lookups, hits = _cache_events()
    hit = hits > hits0
    missed = lookups > lookups0 and not hit
    # Only a program compiled here: one JAX's cache loaded serializes without its machine code
    # (jaxlib 0.10.2 on CPU: it loads, then fails when run).
    if key is not None and not hit:
        saved_programs.save(key, exe)
    seconds = time.perf_counter() - t0
    return exe, CompileTally(1, seconds, int(hit), int(missed), traced - lowering)


def compile_counted(lower: Callable[[], Any], mesh: Any = None) -> Any:
    """`lower().compile()` with spec_jax's compiler options, added to `compile_tally()` (its
    seconds, and whether the persistent cache served it): for a one-off program no `ProgramCache`
    keeps, such as the roofline's verify pass, so a run's tally counts every program it compiled."""
    exe, this = _compile_counted(lower, mesh, None)
    with _TOTAL_LOCK:
        _TOTAL.add(this)
    return exe


class ProgramCache:
    """Compiled executables by key, most recently used last, at most `max_size` of them: each entry
    holds an executable (and, through its static drafter, configs), so a long-lived process that
    sweeps shapes keeps only the newest."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._programs: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # warm-up compiles from several threads
        _ALL_CACHES.append(self)

    def get_or_compile(self, key: Any, lower: Callable[[], Any], mesh: Any = None,
                       tally: CompileTally | None = None,
                       saved_as: Callable[[], saved_programs.ProgramKey | None] | None = None) -> tuple[Any, float]:
        """The executable for `key`, compiled from `lower()` (a `jax.stages.Lowered`) on first use
        -> (executable, seconds spent compiling now). A compile is added to `compile_tally()` and
        to `tally` when given. `saved_as()` is the program's `saved_programs` key (None: not saved):
        a program saved there by an earlier process is loaded instead of lowered and compiled."""
        with self._lock:
            exe = self._programs.get(key)
            if exe is not None:
                self._programs.move_to_end(key)
                return exe, 0.0
        exe, this = _compile_counted(lower, mesh, saved_as)  # outside the lock: other keys compile meanwhile
        with _TOTAL_LOCK:  # one lock for every tally: warm-up threads add to the engine's
            _TOTAL.add(this)
            if tally is not None:
                tally.add(this)
        with self._lock:
            self._programs[key] = exe
            while len(self._programs) > self.max_size:
                self._programs.popitem(last=False)
        return exe, this.seconds

    def __len__(self) -> int:
        return len(self._programs)

    def values(self) -> list[Any]:
        return list(self._programs.values())

    def clear(self) -> None:
        with self._lock:
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
