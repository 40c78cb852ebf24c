"""The loop in chunks: the same `speculative_step`, run up to S steps per call on donated state.

`generate_loop` runs prefill and every step in one program. Streaming and serving need the host
between steps (to hand tokens out, free finished rows, admit new requests), so here the loop is
split into a jitted prefill and a jitted chunk of at most S steps. A chunk is one
`lax.while_loop` with no host sync inside; its state is donated, so the caches are updated in
place from chunk to chunk. S is traced: any chunk size runs the same program.

A long prompt can be prefilled in chunks too (`prefill_chunk`, the engine's chunked prefill): each
chunk extends the target's cache as a verify pass does, keeps the chunk's captured hidden states
for the drafter, and `loop.start_state` then starts the row exactly as `prefill` does.

A chunk consumes the PRNG exactly as `generate_loop` does (prefill splits once, each step splits
`state.key`), and it stops at the same condition, so prefill + chunks give token for token what
`generate` gives, sampled or greedy, whatever the chunk sizes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.decoding.depth import AdaptiveDepth
from spec_jax.decoding.loop import (LoopInputs, LoopState, adaptive_steps, forward_capturing, prefill,
                                   speculative_step, with_depth_state)
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
    return with_depth_state(state, depth, inputs.depth_costs, drafter)


def prefill_chunk(
    target: Target,
    cache: Any,
    captured: jax.Array | None,
    last_hidden: jax.Array,
    tokens: jax.Array,
    starts: jax.Array,
    valid: jax.Array,
    capture: tuple[int, ...],
) -> tuple[Any, jax.Array | None, jax.Array]:
    """One chunk of R prompts: their next tokens [R, W] at positions starts .. starts + W - 1,
    of which the first valid [R] are prompt (the rest padding; valid 0: the row waits).

    cache: the target's cache of the R rows, committed at starts (empty for a row at 0); captured: [R, capacity, n*H]
    the prompt's captured hidden states so far (None when the drafter captures none);
    last_hidden: [R, H] the hidden state of each row's last prompt token so far.
    -> (cache committed at starts + valid, captured, last_hidden) with this chunk's written in."""
    rows, width = tokens.shape
    positions = starts[:, None] + jnp.arange(width, dtype=jnp.int32)
    hidden, chunk_captured, cache = forward_capturing(target, tokens, positions, cache, capture)
    cache = target.model.commit(cache, starts + valid)
    index = jnp.arange(rows)
    if captured is not None:  # positions past the capacity are dropped
        captured = captured.at[index[:, None], positions].set(chunk_captured.astype(captured.dtype), mode="drop")
    ended = hidden[index, jnp.maximum(valid - 1, 0)]
    last_hidden = jnp.where((valid > 0)[:, None], ended.astype(last_hidden.dtype), last_hidden)
    return cache, captured, last_hidden


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
