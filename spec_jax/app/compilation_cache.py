"""JAX's persistent compilation cache for the command line: on by default, so a second `spec-jax
generate` or `serve` loads its programs instead of compiling them again.

Where it goes, first that is set:
  1. `--compile-cache DIR|off` (every command takes it);
  2. the environment variable SPEC_JAX_COMPILATION_CACHE=DIR|off;
  3. JAX's own JAX_COMPILATION_CACHE_DIR (the user's JAX setting is kept as it is);
  4. $XDG_CACHE_HOME/spec_jax/jax-compilation-cache (~/.cache/... when XDG_CACHE_HOME is unset).

In that directory's spec_jax-programs/ the command line also saves each program whole
(`spec_jax.decoding.saved_programs`): a later start loads it without tracing or lowering it again.

The library (`import spec_jax`) never turns the cache on: that is the user's JAX config (and
`saved_programs.enable(directory)` for the saved programs).
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Mapping

ENV = "SPEC_JAX_COMPILATION_CACHE"
OFF = "off"
# JAX's defaults skip programs that compiled in under a second; the CLI caches every program (the
# small admit and prefill programs add up at a server's start). The user's own JAX_* values win.
_CACHE_EVERYTHING = {
    "jax_persistent_cache_min_compile_time_secs": ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.0),
    "jax_persistent_cache_min_entry_size_bytes": ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", -1),
}
# No YNNPACK fusions on XLA:CPU. Loading a compiled program rebuilds each one with a search over all
# of the program's instructions (issue 46: 5.7 of the 8.5 CPU seconds of loading the default
# model's loop), and each runs a setup at its first execution (~0.4 s of the first `generate`).
# Session 27 had turned single-dot fusions on because a pass of 2-7 tokens fell to a slow dot
# path without them (3.5x a one-token pass); that path was the tied LM head's product with the
# embedding as stored ([V, H]), which `load_target` now unties on CPU, and without fusions the
# passes are the cheaper ones: 2 tokens 1.17x, 8 tokens 1.42x a one-token pass, against 1.21x
# and 1.56x with them (benchmarks/RESULTS.md, issue 41, session 29).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help=f"JAX's persistent compilation cache: a second run loads its compiled programs from DIR "
        f"(default: ${ENV}, else $JAX_COMPILATION_CACHE_DIR, else {default_dir()}); off = compile afresh",
    )


def default_dir(environ: Mapping[str, str] = os.environ) -> str:
    """The per-user cache directory (XDG base directories)."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spec_jax", "jax-compilation-cache")


def choose(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The cache directory for this run, or None for off (see the module docstring's order)."""
    for value in (flag, environ.get(ENV)):
        if value:
            return None if value.strip().lower() == OFF else os.path.abspath(os.path.expanduser(value))
    return environ.get("JAX_COMPILATION_CACHE_DIR") or default_dir(environ)


def jax_settings(directory: str | None, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The `jax.config` values that put the cache in `directory` (None: turn it off)."""
    if directory is None:
        return {"jax_enable_compilation_cache": False}
    settings: dict[str, Any] = {"jax_enable_compilation_cache": True, "jax_compilation_cache_dir": directory}
    for name, (env, value) in _CACHE_EVERYTHING.items():
        if env not in environ:
            settings[name] = value
    return settings


def configure(flag: str | None) -> str | None:
    """Set JAX's config for this process (before anything compiles), and spec_jax's XLA:CPU
    options -> the cache directory, or None."""
    import jax

    from spec_jax.decoding import programs, saved_programs

    directory = choose(flag)
    for name, value in jax_settings(directory).items():
        jax.config.update(name, value)
    saved_programs.enable(directory)
    programs.set_compiler_options("cpu", accepted_options(cpu_compiler_options()))
    return directory


def accepted_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` when this jaxlib's XLA:CPU takes them (checked on a one-op program, on CPU
    only), else none of them, with a warning: an older or newer jaxlib may lack the option or
    its value, and XLA's defaults decode about as fast (benchmarks/RESULTS.md, issue 41)."""
    import jax

    if not options or jax.default_backend() != "cpu":
        return options
    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=options)
    except Exception as e:  # jaxlib raises its own runtime error type for an unknown option or value
        warnings.warn(f"XLA:CPU refused spec_jax's options {options} ({str(e).splitlines()[0]}); "
                      "compiling with XLA's defaults.", stacklevel=2)
        return {}
    return options


def cpu_compiler_options(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """CPU_COMPILER_OPTIONS less those the user's XLA_FLAGS set (theirs win)."""
    flags = environ.get("XLA_FLAGS", "")
    return {name: value for name, value in CPU_COMPILER_OPTIONS.items() if name not in flags}


def unconfigure() -> None:
    """Give spec_jax's own settings back to the library's defaults (saved programs off, XLA's
    options) once a command returns, for a caller that goes on in the same process (tests)."""
    from spec_jax.decoding import programs, saved_programs

    saved_programs.enable(None)
    programs.set_compiler_options("cpu", {})
