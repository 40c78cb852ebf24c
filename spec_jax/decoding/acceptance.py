"""The exact speculative acceptance rule, vectorised over [B, K]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.sampling import sample


def accept(
    key: jax.Array,
    target_probs: jax.Array,
    drafts: jax.Array,
    draft_probs: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """The speculative acceptance rule (exact in distribution; token-identical when greedy).

    target_probs: [B, K+1, V] warped p_1..p_{K+1}
    drafts:       [B, K] int32 d_1..d_K
    draft_probs:  [B, K, V] warped q_1..q_K, or None for one-hot drafts (q_i(d_i) = 1)
    Returns (num_accepted [B] in 0..K, next_token [B]): the correction token sampled from
    norm(max(p_{n+1} - q_{n+1}, 0)) when n < K, else the bonus token from p_{K+1}.
    """
    batch, k = drafts.shape
    vocab = target_probs.shape[-1]
    accept_key, token_key = jax.random.split(key)
    # Step 1: p_i(d_i) and q_i(d_i) for every draft.
    p_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    # Step 2: accept d_i when u_i * q_i(d_i) <= p_i(d_i); u in (0, 1] so p = 0 always rejects.
    u = 1.0 - jax.random.uniform(accept_key, (batch, k))
    accepted = u * q_draft <= p_draft
    # Step 3: n = number of leading accepts (cumulative product of the accept mask).
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)
    # Step 4: the distribution the next token comes from: residual at n < K, p_{K+1} at n = K.
    rows = jnp.arange(batch)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    if draft_probs is None:
        q_next = jax.nn.one_hot(drafts[rows, jnp.minimum(num_accepted, k - 1)], vocab) if k else 0.0
    else:
        q_next = draft_probs[rows, jnp.minimum(num_accepted, k - 1)] if k else 0.0
    q_next = jnp.where((num_accepted < k)[:, None], q_next, 0.0)
    residual = jnp.maximum(p_next - q_next, 0.0)
    residual_mass = jnp.sum(residual, axis=-1, keepdims=True)
    next_dist = jnp.where(residual_mass > 0, residual / jnp.maximum(residual_mass, 1e-30), p_next)
    # Step 5: sample it (one-hot under greedy -> the target's argmax).
    next_token = sample(token_key, next_dist)
    return num_accepted.astype(jnp.int32), next_token
