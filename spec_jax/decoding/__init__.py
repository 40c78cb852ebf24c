"""The jitted speculative loop, sampling and the host-side generate API."""

from spec_jax.decoding.acceptance import accept
from spec_jax.decoding.generate import GenerationResult, RowStats, generate
from spec_jax.decoding.loop import GenerateOutput, LoopState, Stats, generate_jit, generate_loop
from spec_jax.sampling import SamplingParams, warp

__all__ = [
    "GenerateOutput",
    "GenerationResult",
    "LoopState",
    "RowStats",
    "SamplingParams",
    "Stats",
    "accept",
    "generate",
    "generate_jit",
    "generate_loop",
    "warp",
]
