"""The drafter protocol: the one interface the speculative loop talks to.

A drafter is a frozen, hashable object holding static hyperparameters (it is a static argument of
the jitted loop); its weights travel separately as a pytree (`params`), and its per-sequence state
(caches, context) is a pytree returned by `init` and threaded through `propose` and `commit`.

The drafter sees the target as `Target` (model + params): it reaches the target's embedding and
head through `target.embed(tokens)` and `target.logits(hidden)`, never by params keys.

Positions: after a step, `lengths[b]` tokens of row b are committed and the last one,
`tokens[b, lengths[b] - 1]`, has not been run through the target yet. The next verify pass scores
[last token, d_1..d_K] at positions lengths - 1 .. lengths - 1 + K.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from spec_jax.models.interface import Target, TargetModel
from spec_jax.sampling import SamplingParams

Params = Any
DrafterState = Any


@runtime_checkable
class Drafter(Protocol):
    """Optionally a drafter may set the class attribute `stateless_propose = True` when its
    propose returns the state unchanged (DFlash); `LookupFirstDrafter` then skips the call on
    steps where every row drafts from the lookup.

    Trees (`spec_jax.drafters.tree`): a drafter that drafts token trees has a static `tree`
    setting (0 = a chain; N = a budget of N nodes; or a tuple of paths) and
        propose_tree(params, target, state, tokens, lengths, key, sampling) -> (TreeDraft, state)
    which the loop calls instead of `propose` when `tree` is not 0. Its tree's depth is at most
    K, and `commit` then receives the captured hidden states of the accepted path [B, K+1, n*H]
    (root first), exactly as for a chain whose first `num_accepted` drafts were accepted.

    The adaptive depth (`spec_jax.decoding.depth`) reads further optional hooks: `at_depth(depth,
    max_depth)`, and either `keep_current(...)` (run at a plain step) or `catches_up` with
    `catch_up(params, target, state, tokens, lengths, rows=None)` (plain steps leave the state
    behind; the next propose feeds it what it missed), and for a
    drafter whose drafts come from several sources told apart before drafting (prompt lookup in
    front of a model drafter) `draft_sources` (how many), `draft_source(params, tokens, lengths)
    -> [B] int32` (each row's, from committed tokens only), `free_draft_sources` (those that
    cost no model pass) and `free_drafts(params, tokens, lengths) -> [B, K]` (those sources'
    drafts, without the model); the policy keeps an acceptance rate per source."""

    k: int  # drafts per verify step (static)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states `init`/`commit` need (HF hidden_states[id + 1])."""
        ...

    def weight_specs(self) -> Any:
        """The WeightSpec tree (`spec_jax.models.weights`) of this drafter's params, or None when
        it has no weights. Sharding, `spec-jax info` and checkpoint checks read it, so a new
        drafter is described once, here."""
        ...

    def validate(self, target: TargetModel, capacity: int) -> None:
        """Host-side compatibility checks against the target model (its vocab_size, hidden_size,
        num_layers); raise a clear ValueError before anything compiles."""
        ...

    def init(
        self,
        params: Params,
        target: Target,
        prompt_tokens: jax.Array,  # [B, P] right-padded
        prompt_lengths: jax.Array,  # [B]
        prefill_captured: jax.Array | None,  # [B, P, n*H] when capture_layers
        capacity: int,
    ) -> DrafterState: ...

    def propose(
        self,
        params: Params,
        target: Target,
        state: DrafterState,
        tokens: jax.Array,  # [B, S] committed tokens (prompt + output), right-padded
        lengths: jax.Array,  # [B] committed lengths
        key: jax.Array,
        sampling: SamplingParams,
    ) -> tuple[jax.Array, jax.Array | None, DrafterState]:
        """-> (drafts [B, K] int32, draft probs [B, K, V] warped like the target's or None when
        the drafts are deterministic (one-hot), new state)."""
        ...

    def commit(
        self,
        params: Params,
        target: Target,
        state: DrafterState,
        start: jax.Array,  # [B] position of the first verified token (old lengths - 1)
        num_accepted: jax.Array,  # [B] n: drafts accepted; inputs start..start+n are now final
        verify_captured: jax.Array | None,  # [B, K+1, n*H] hidden states of the verified inputs
    ) -> DrafterState: ...
