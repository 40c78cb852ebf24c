"""What the host reads after a chunk: the part of each row's buffers the chunk could have written,
not the whole [B, capacity] buffers.

A chunk of N verify steps commits at most N * (P + 1) tokens a row (P: the widest verify pass's
drafts), all at or after the row's length before the chunk. So a window of that width ending at
each row's new length holds every token the host has not handed out yet, and the transfer is
B * N * (P + 1) tokens whatever the capacity (the whole token buffer, at 64 slots of 32k, is 8 MB).
For the same reason the engine keeps logprobs for this window only, as a ring
(`TokenLogprobs.as_ring`: at 64 slots of 32k with top 20 the whole buffers were 340 MB).

`read_window` is the device side (one small gather): the engine's chunk program returns it beside
the state, so the steady state adds no program; after admits, and in `generate_stream`, it runs as
a small program of its own. `EmittedWindow` is its host copy, indexed by buffer position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from spec_jax.decoding.logprobs import TokenLogprobs, last_positions, take_positions


def window_width(chunk_steps: int, pass_max: int, capacity: int) -> int:
    """The most tokens one chunk of `chunk_steps` verify steps commits a row (each step commits
    at most `pass_max` drafts and one token of the target's), at most the capacity."""
    return min(chunk_steps * (pass_max + 1), capacity)


def read_window(tokens: jax.Array, lengths: jax.Array, logprobs: TokenLogprobs | None,
                width: int) -> tuple[jax.Array, jax.Array, TokenLogprobs | None]:
    """(starts [B], tokens[b, starts[b] : starts[b] + width] [B, width], the same window of the
    logprobs buffers or None). starts[b] = lengths[b] - width, clipped into the buffer, so each
    window ends at its row's length or covers the row's start. Traceable; `width` is static."""
    positions = last_positions(lengths, width, tokens.shape[1])  # [B, width]
    if logprobs is not None:  # its buffers may be a ring (`TokenLogprobs.as_ring`): by slot
        slots = logprobs.slots(positions)
        logprobs = logprobs.replace(chosen=take_positions(logprobs.chosen, slots),
                                    top_ids=take_positions(logprobs.top_ids, slots),
                                    top_values=take_positions(logprobs.top_values, slots))
    return positions[:, 0], take_positions(tokens, positions), logprobs


read_window_jit = jax.jit(read_window, static_argnames="width")


@dataclasses.dataclass(frozen=True)
class EmittedWindow:
    """The host copy of `read_window`'s result: position p of row b is column p - starts[b].

    starts: [B]; tokens: [B, W]; logprobs: `TokenLogprobs` of [B, W(, top)] numpy arrays, or None
    (no request asked)."""

    starts: np.ndarray
    tokens: np.ndarray
    logprobs: Any = None

    @classmethod
    def of(cls, host: tuple) -> EmittedWindow:
        starts, tokens, logprobs = host
        return cls(np.asarray(starts), np.asarray(tokens), logprobs)

    def columns(self, slot: int, begin: int, end: int) -> slice:
        """Row `slot`'s buffer positions begin .. end - 1 as window columns. Raises if they are not
        all inside the window: tokens the host never read would be lost, not returned."""
        start = int(self.starts[slot])
        if begin < start or end > start + self.tokens.shape[1]:
            raise RuntimeError(
                f"row {slot}: positions {begin}..{end - 1} are outside the read window "
                f"{start}..{start + self.tokens.shape[1] - 1}; a chunk committed more tokens than "
                "its window holds (its width must be chunk_steps * (pass_max + 1)).")
        return slice(begin - start, end - start)

    def token_ids(self, slot: int, begin: int, end: int) -> list[int]:
        """Row `slot`'s tokens at buffer positions begin .. end - 1."""
        return self.tokens[slot, self.columns(slot, begin, end)].tolist()
