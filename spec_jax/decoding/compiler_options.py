"""XLA options for the programs spec_jax compiles, per platform: the command line sets them, the
library leaves XLA's defaults. Their own module because both the compiling (`programs`) and the
saved programs' keys (`saved_programs`) read them."""

from __future__ import annotations

from typing import Any

import jax

_COMPILER_OPTIONS: dict[str, dict[str, Any]] = {}


def set_compiler_options(platform: str, options: dict[str, Any]) -> None:
    """XLA compiler options for the programs compiled from now on when JAX's default backend is
    `platform` ("cpu", "gpu", "tpu"): `lowered.compile(compiler_options=options)`."""
    _COMPILER_OPTIONS[platform] = dict(options)


def compiler_options() -> dict[str, Any]:
    """The options for JAX's default backend (initialises it)."""
    return dict(_COMPILER_OPTIONS.get(jax.default_backend(), {}))
