"""The loop in chunks: the same `speculative_step`, run up to S steps per call on donated state.

`generate_loop` runs prefill and every step in one program. Streaming and serving need the host
between steps (to hand tokens out, free finished rows, admit new requests), so here the loop is
split into a jitted prefill and a jitted chunk of at most S steps. A chunk is one
`lax.while_loop` with no host sync inside; its state is donated, so the caches are updated in
place from chunk to chunk. S is traced: any chunk size runs the same program.

A chunk consumes the PRNG exactly as `generate_loop` does (prefill splits once, each step splits
`state.key`), and it stops at the same condition, so prefill + chunks give token for token what
`generate` gives, sampled or greedy, whatever the chunk sizes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.decoding.depth import AdaptiveDepth
from spec_jax.decoding.loop import LoopInputs, LoopState, adaptive_steps, prefill, speculative_step, with_depth_state
from spec_jax.drafters.base import Drafter
from spec_jax.models.interface import Target, TargetModel
from spec_jax.models.resolve import as_target_model
from spec_jax.sampling import SamplingParams

NO_STEP_CAP = jnp.iinfo(jnp.int32).max  # a chunk's step cap when rows carry their own length caps


def prefill_state(
    inputs: LoopInputs, *, model: TargetModel, drafter: Drafter | None, capacity: int,
    depth: AdaptiveDepth | None = None,
) -> LoopState:
    """`prefill` from the loop's inputs (what `generate_loop` runs before its while loop)."""
    target = Target(inputs.target_params, as_target_model(model))
    state = prefill(
        target, drafter, inputs.drafter_params, inputs.prompt_tokens, inputs.prompt_lengths,
        inputs.key, inputs.sampling, inputs.max_new_tokens, inputs.stop_ids, capacity,
    )
    return with_depth_state(state, depth, inputs.depth_costs)


def run_chunk(
    state: LoopState,
    target_params: Any,
    drafter_params: Any,
    sampling: SamplingParams,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
    max_steps: jax.Array,
    step_cap: jax.Array,
    *,
    model: TargetModel,
    drafter: Drafter | None,
    depth: AdaptiveDepth | None = None,
) -> LoopState:
    """Up to `max_steps` speculative steps, stopping early when every row is done or
    `state.step` reaches `step_cap` (`generate_loop`'s bound: max_new_tokens for one call,
    NO_STEP_CAP for the engine, whose rows each stop at their own cap).

    max_new_tokens: [] or [B] (per row); stop_ids: [MAX_STOP_IDS] or [B, 1, MAX_STOP_IDS];
    sampling values: scalars or [B].
    """
    target = Target(target_params, as_target_model(model))
    first_step = state.step

    def not_finished(s: LoopState) -> jax.Array:
        return (s.step - first_step < max_steps) & (s.step < step_cap) & ~jnp.all(s.done)

    def step(s: LoopState) -> LoopState:
        if depth is not None:  # the adaptive depth (its costs travel in the state)
            return adaptive_steps(s, target, drafter, depth, drafter_params, sampling, max_new_tokens, stop_ids,
                                  not_finished)
        return speculative_step(s, target, drafter, drafter_params, sampling, max_new_tokens, stop_ids)

    return jax.lax.while_loop(not_finished, step, state)


prefill_jit = jax.jit(prefill_state, static_argnames=("model", "drafter", "capacity", "depth"))
chunk_jit = jax.jit(run_chunk, static_argnames=("model", "drafter", "depth"), donate_argnames=("state",))
