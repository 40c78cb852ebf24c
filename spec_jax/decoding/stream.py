"""Streaming: `generate_stream` yields each row's new tokens after every chunk of the loop, and
`IncrementalDetokenizer` turns a growing list of token ids into text pieces that never split a
multi-byte character or a merge across tokens.

    for update in spec_jax.generate_stream(target, [prompt], drafter, max_new_tokens=64):
        print(detok.push(update.new_ids[0]), end="", flush=True)
    result = update.result  # on the last update: what `generate` returns, stats included

The stream runs the same prefill and the same speculative step as `generate`, in chunks of
`chunk_steps` steps on donated state (`spec_jax.decoding.chunked`), so its tokens are `generate`'s,
greedy or sampled with the same seed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding import saved_programs, validation
from spec_jax.decoding.chunked import chunk_jit, prefill_jit
from spec_jax.decoding.emitted import EmittedWindow, read_window_jit, window_width
from spec_jax.decoding.generate import GenerationResult, prepare_inputs, result_of
from spec_jax.decoding.loop import FINISH_NAMES, FINISH_NONE, GenerateOutput, LoopState, pass_drafts
from spec_jax.decoding.programs import ProgramCache, signature
from spec_jax.drafters.base import Drafter
from spec_jax.sharding.placement import gather_to_host

DEFAULT_CHUNK_STEPS = 4

# AOT executables by (function, static arguments, argument shapes and shardings).
_COMPILED = ProgramCache(max_size=32)


def compiled(jitted: Any, args: tuple, static: dict[str, Any], mesh: Any = None,
             sig: str | None = None) -> tuple[Any, float]:
    """`jitted` lowered and compiled for these arguments (cached) -> (executable, seconds spent
    compiling now). `sig` skips recomputing `signature(args, mesh)` when the caller holds it."""
    key = (jitted, tuple(sorted(static.items(), key=lambda kv: kv[0])),
           sig if sig is not None else signature(args, mesh), mesh)
    return _COMPILED.get_or_compile(
        key, lambda: jitted.lower(*args, **static), mesh,
        saved_as=lambda: saved_programs.key_for(jitted.__name__, key[1], args, mesh=mesh))


@dataclasses.dataclass
class StreamUpdate:
    """One update of `generate_stream`, per prompt row.

    new_ids:        the tokens committed since the previous update (often several per row:
                    a step commits accepted drafts + one)
    finish_reasons: "stop" / "length" once a row has finished, else None
    result:         on the last update only, the `GenerationResult` that `generate` returns
    """

    new_ids: list[list[int]]
    finish_reasons: list[str | None]
    result: GenerationResult | None = None


def _host_view(state: LoopState, read: Any, mesh: Any) -> tuple[Any, ...]:
    """(the window of tokens the last chunk could have written, lengths, finish reasons, the step
    counter), in one transfer; `read` is the compiled `read_window`."""
    view = (read(state.tokens, state.lengths, None), state.lengths, state.finish_reason, state.step)
    return gather_to_host(view) if mesh is not None else jax.device_get(view)


def generate_stream(
    target: Any,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None = None,
    drafter_params: Any = None,
    *,
    chunk_steps: int = DEFAULT_CHUNK_STEPS,
    mesh: Any = None,
    sharding_rules: Any = None,
    **kwargs: Any,
) -> Iterator[StreamUpdate]:
    """`generate`, yielding each row's new tokens after prefill and after every chunk of at most
    `chunk_steps` verify steps. Takes `generate`'s arguments (k, max_new_tokens, temperature,
    top_k, top_p, seed, stop_ids, ignore_eos, capacity, mesh, sharding_rules); the tokens are
    `generate`'s. The last update carries the full `GenerationResult`.

    Everything a user can get wrong is checked when the generator is created, before compiling.
    """
    validation.check_mesh(mesh)
    chunk_steps = validation.check_int("chunk_steps", chunk_steps, minimum=1)  # verify steps per chunk
    call = prepare_inputs(target, prompts, drafter, drafter_params, **kwargs)
    inputs = call.inputs
    if call.depth is not None and mesh is not None:
        raise ValueError("k='adaptive' does not run on a mesh yet; pin K (an int k) with mesh=.")
    if call.measure_costs:  # measured on the whole loop once, then read from disk
        from spec_jax.decoding.depth_costs import costs_for
        from spec_jax.decoding.generate import compiled_loop

        loop, _ = compiled_loop(call.target.model, call.drafter, call.capacity, inputs, None, call.depth)
        inputs = inputs.replace(depth_costs=jnp.asarray(costs_for(loop, call), jnp.float32))
    if mesh is not None:
        from spec_jax.decoding.placement import place_generate_inputs  # only for mesh runs

        inputs = place_generate_inputs(inputs, call.target.model, call.drafter, mesh, sharding_rules)
    return _stream(call.target.model, call.drafter, call.capacity, inputs, chunk_steps, mesh, call.depth)


def _stream(model, drafter, capacity, inputs, chunk_steps, mesh, depth=None) -> Iterator[StreamUpdate]:
    static = dict(model=model, drafter=drafter)
    if depth is not None:  # the adaptive depth's static part (absent for a fixed K: same keys)
        static["depth"] = depth
    prefill_exe, compile_s = compiled(prefill_jit, (inputs,), dict(static, capacity=capacity), mesh)
    t0 = time.perf_counter()
    state = prefill_exe(inputs)
    chunk_args = (inputs.target_params, inputs.drafter_params, inputs.sampling,
                  inputs.max_new_tokens, inputs.stop_ids)
    rep = (lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
           ) if mesh is not None else jnp.asarray
    max_steps, step_cap = rep(np.int32(chunk_steps)), inputs.max_new_tokens
    chunk_exe, chunk_compile_s = compiled(chunk_jit, (state, *chunk_args, max_steps, step_cap), static, mesh)
    # Each update reads the tokens one chunk can write a row (`decoding.emitted`), not the buffers.
    width = window_width(chunk_steps, pass_drafts(drafter), capacity)
    read_exe, read_compile_s = compiled(read_window_jit, (state.tokens, state.lengths, None), dict(width=width), mesh)
    # They compile once the prefill has run (its state is their argument): generation's seconds
    # leave their compile out, as `generate`'s do.
    loop_compile_s = chunk_compile_s + read_compile_s
    compile_s += loop_compile_s
    max_new = int(jax.device_get(inputs.max_new_tokens))
    emitted = np.asarray(jax.device_get(inputs.prompt_lengths)).copy()  # tokens handed out per row
    while True:
        window, lengths, finish, step = _host_view(state, read_exe, mesh)
        window = EmittedWindow.of(window)
        new_ids = [window.token_ids(b, emitted[b], lengths[b]) for b in range(len(emitted))]
        emitted = np.maximum(emitted, lengths)
        reasons = [None if r == FINISH_NONE else FINISH_NAMES[int(r)] for r in finish]
        if all(r is not None for r in reasons) or int(step) >= max_new:
            break
        yield StreamUpdate(new_ids, reasons)
        state = chunk_exe(state, *chunk_args, max_steps, step_cap)
    generate_s = time.perf_counter() - t0 - loop_compile_s
    out = GenerateOutput.of(state)
    result = result_of(gather_to_host(out) if mesh is not None else out, compile_s, generate_s)
    yield StreamUpdate(new_ids, reasons, result)


class IncrementalDetokenizer:
    """Text for a growing list of token ids, piece by piece: `push(new_ids)` returns the text the
    new tokens complete. A token that ends inside a multi-byte UTF-8 character (byte-level BPE
    decodes it to U+FFFD) is held back until the character is whole, and each piece is the
    difference of two decodes over a window of earlier tokens, so merges and leading-space rules
    across token boundaries come out as the full decode would. `flush()` returns what is left.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window (a few tokens of context)
        self.read_offset = 0  # tokens whose text has been returned

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or an unfinished multi-byte character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
