"""The target's log-probabilities of the tokens the loop commits (the engine's `logprobs` requests).

What is reported: log_softmax of the target's raw logits at the position that produced each token
(vLLM's default, `logprobs_mode="raw_logprobs"`: before temperature, top-k and top-p; OpenAI's API
reports the model's log-probabilities too). They come from the pass that committed the token --
the prefill for the first, the verify pass for the rest, at the accepted path's positions -- so
under speculation they are the target's, never the drafter's, and equal plain decoding's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def last_positions(lengths: jax.Array, width: int, capacity: int) -> jax.Array:
    """Each row's last `width` buffer positions before its length [B] -> [B, width] int32: the
    window ends at the row's length, or starts at 0 for a row shorter than `width` (width <=
    capacity: the window stays inside the buffer)."""
    starts = jnp.clip(lengths - width, 0, capacity - width).astype(jnp.int32)
    return starts[:, None] + jnp.arange(width, dtype=jnp.int32)


def take_positions(buffer: jax.Array, slots: jax.Array) -> jax.Array:
    """buffer [B, S, ...] at each row's own slots [B, W] -> [B, W, ...]."""
    return jnp.take_along_axis(buffer, slots.reshape(slots.shape + (1,) * (buffer.ndim - 2)), axis=1)


@struct.dataclass
class TokenLogprobs:
    """Per committed token, its log-probability and the `top` most likely tokens there.

    chosen:     [B, R] f32        log p(tokens[b, s]) (0 where nothing was recorded)
    top_ids:    [B, R, top] int32 the most likely tokens at that position, most likely first
    top_values: [B, R, top] f32   their log-probabilities
    wanted:     [B] bool          rows whose request asked; when no live row asks, a step skips the work
    capacity:   (static) the positions S the buffers index. R = S keeps every position; R < S
                is a ring (`as_ring`): position s at slot s % R, each slot its latest position's
                (the engine's: its host reads each chunk's positions before they can be overwritten).
    """

    chosen: jax.Array
    top_ids: jax.Array
    top_values: jax.Array
    wanted: jax.Array
    capacity: int = struct.field(pytree_node=False, default=0)  # 0: the buffers' own length

    @property
    def positions(self) -> int:
        """S: the positions (the token buffer's capacity) these buffers index."""
        return self.capacity or self.chosen.shape[1]

    def slots(self, positions: jax.Array) -> jax.Array:
        """The buffer slots of token positions (< S): themselves, or their ring slots."""
        return positions % self.chosen.shape[1]

    def as_ring(self, width: int, lengths: jax.Array) -> TokenLogprobs:
        """These full buffers as a ring of `width` slots a row, holding each row's last `width`
        positions before its length [B] (all that a row not yet read can have recorded)."""
        capacity = self.positions
        width = min(width, capacity)
        window = last_positions(lengths, width, capacity)  # [B, W]
        rows = jnp.arange(window.shape[0])[:, None]

        def ring(buffer: jax.Array) -> jax.Array:
            taken = take_positions(buffer, window)
            return jnp.zeros_like(taken).at[rows, window % width].set(taken)

        return TokenLogprobs(ring(self.chosen), ring(self.top_ids), ring(self.top_values), self.wanted, capacity)

    @classmethod
    def empty(cls, batch: int, capacity: int, top: int) -> TokenLogprobs:
        return cls(chosen=jnp.zeros((batch, capacity), jnp.float32),
                   top_ids=jnp.zeros((batch, capacity, top), jnp.int32),
                   top_values=jnp.zeros((batch, capacity, top), jnp.float32),
                   wanted=jnp.ones((batch,), bool))

    def record(self, logits: jax.Array, tokens: jax.Array, write_at: jax.Array) -> TokenLogprobs:
        """These buffers with tokens [B, T]'s log-probabilities under logits [B, T, V] written
        at positions write_at [B, T] (a position past the capacity writes nothing)."""
        batch, capacity = self.chosen.shape  # its slots: the positions, or a ring's
        rows = jnp.arange(batch)[:, None]
        write_at = jnp.where(self.wanted[:, None] & (write_at < self.positions), self.slots(write_at), capacity)

        def write(buffers: TokenLogprobs) -> TokenLogprobs:
            log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
            chosen = jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
            buffers = buffers.replace(chosen=buffers.chosen.at[rows, write_at].set(chosen, mode="drop"))
            top = buffers.top_ids.shape[-1]
            if not top:
                return buffers
            top_values, top_ids = jax.lax.top_k(log_probs, top)  # [B, T, top]
            return buffers.replace(
                top_ids=buffers.top_ids.at[rows, write_at].set(top_ids.astype(jnp.int32), mode="drop"),
                top_values=buffers.top_values.at[rows, write_at].set(top_values, mode="drop"),
            )

        return jax.lax.cond(jnp.any(write_at < capacity), write, lambda buffers: buffers, self)
