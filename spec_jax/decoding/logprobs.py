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


@struct.dataclass
class TokenLogprobs:
    """Per committed token, its log-probability and the `top` most likely tokens there.

    chosen:     [B, S] f32        log p(tokens[b, s]) (0 where nothing was recorded)
    top_ids:    [B, S, top] int32 the most likely tokens at that position, most likely first
    top_values: [B, S, top] f32   their log-probabilities
    wanted:     [B] bool          rows whose request asked; when no live row asks, a step skips the work
    """

    chosen: jax.Array
    top_ids: jax.Array
    top_values: jax.Array
    wanted: jax.Array

    @classmethod
    def empty(cls, batch: int, capacity: int, top: int) -> TokenLogprobs:
        return cls(chosen=jnp.zeros((batch, capacity), jnp.float32),
                   top_ids=jnp.zeros((batch, capacity, top), jnp.int32),
                   top_values=jnp.zeros((batch, capacity, top), jnp.float32),
                   wanted=jnp.ones((batch,), bool))

    def record(self, logits: jax.Array, tokens: jax.Array, write_at: jax.Array) -> TokenLogprobs:
        """These buffers with tokens [B, T]'s log-probabilities under logits [B, T, V] written
        at slots write_at [B, T] (an index past the capacity writes nothing)."""
        batch, capacity = self.chosen.shape
        rows = jnp.arange(batch)[:, None]
        write_at = jnp.where(self.wanted[:, None], write_at, capacity)

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
