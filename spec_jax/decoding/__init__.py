"""The jitted speculative loop, sampling and the host-side generate API."""

from spec_jax.decoding.acceptance import accept
from spec_jax.decoding.generate import (
    GenerationResult,
    PreparedCall,
    RowStats,
    compiled_loop,
    generate,
    make_generate_fn,
    pad_prompts,
    prepare_inputs,
    stop_id_array,
    unpack,
)
from spec_jax.decoding.loop import GenerateOutput, LoopState, Stats, generate_jit, generate_loop
from spec_jax.sampling import SamplingParams, warp

__all__ = [
    "GenerateOutput",
    "GenerationResult",
    "LoopState",
    "RowStats",
    "PreparedCall",
    "SamplingParams",
    "Stats",
    "accept",
    "compiled_loop",
    "generate",
    "generate_jit",
    "generate_loop",
    "make_generate_fn",
    "pad_prompts",
    "prepare_inputs",
    "stop_id_array",
    "unpack",
    "warp",
]
