"""The one jitted loop: prefill, then draft -> verify -> accept in a `lax.while_loop`.

The autoregressive baseline is this same loop with no drafter (K = 0): every step verifies just
the last committed token and emits the one token sampled from it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.decoding.acceptance import accept, accept_tree
from spec_jax.decoding.logprobs import TokenLogprobs
from spec_jax.decoding.depth import AdaptiveDepth, draft_sources, drafter_at_depth
from spec_jax.decoding.depth import choose as choose_depth, record as record_depth, record_shadow, shadow_due
from spec_jax.drafters.base import Drafter
from spec_jax.drafters.tree import tree_budget as _tree_budget, with_root
from spec_jax.models.attention import into_empty_cache
from spec_jax.models.interface import (FINAL_HIDDEN, ForwardOutput, Target, TargetModel, ancestor_mask,
                                       tree_depths)
from spec_jax.models.resolve import as_target_model
from spec_jax.models.weights import abstract_from_specs
from spec_jax.sampling import SamplingParams, sample, split_key, warp

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_NONE: "none", FINISH_STOP: "stop", FINISH_LENGTH: "length"}
MAX_STOP_IDS = 8  # stop ids are a fixed-size traced array padded with -1, so they never recompile


@struct.dataclass
class Stats:
    """Per-row counters over verify steps (finished rows do not count).

    steps:             [B]        verify steps taken
    drafted:           [B]        draft tokens proposed (K per step)
    accepted:          [B]        draft tokens accepted
    emitted:           [B]        tokens committed by verify steps (accepted + correction/bonus,
                                  less any cut by a stop token or the length cap)
    histogram:         [B, K+1]   steps that accepted exactly n drafts, n = 0..K
    position_accepted: [B, K]     steps whose draft at position i (0-based) was accepted
    """

    steps: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    emitted: jax.Array
    histogram: jax.Array
    position_accepted: jax.Array

    @classmethod
    def zeros(cls, batch: int, k: int) -> "Stats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(
            steps=z,
            drafted=z,
            accepted=z,
            emitted=z,
            histogram=jnp.zeros((batch, k + 1), jnp.int32),
            position_accepted=jnp.zeros((batch, k), jnp.int32),
        )


@struct.dataclass
class LoopState:
    """Everything the while loop carries.

    tokens:         [B, S] int32  prompt + output, right-padded (S = cache capacity)
    lengths:        [B] int32     committed tokens; tokens[b, lengths[b]-1] is not yet in the cache
    prompt_lengths: [B] int32
    done:           [B] bool      row finished (stop token or length cap); it writes nothing more
    finish_reason:  [B] int32     FINISH_NONE / FINISH_STOP / FINISH_LENGTH
    cache:          the target model's cache, committed for lengths - 1 positions per row
    drafter_state:  the drafter's pytree (caches, context)
    key:            PRNG key, or [B] keys, one per row (the engine's; see `draw_keys`)
    step:           [] int32      verify steps taken
    stats:          Stats
    depth:          the adaptive depth policy's `DepthState` (None when K is fixed)
    logprobs:       `TokenLogprobs` of the committed tokens (None unless prefill was asked for them)
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    done: jax.Array
    finish_reason: jax.Array
    cache: Any
    drafter_state: Any
    key: jax.Array
    step: jax.Array
    stats: Stats
    depth: Any = None
    logprobs: Any = None


@struct.dataclass
class GenerateOutput:
    """What the jitted loop returns (device arrays; `spec_jax.generate` turns it into lists).

    tokens [B, S], prompt_lengths [B], lengths [B] (prompt + generated), finish_reason [B],
    steps [] (verify steps of the loop), stats (per row), depth (the adaptive policy's
    `DepthState`: steps per depth and the depth of each step; None when K is fixed).
    """

    tokens: jax.Array
    prompt_lengths: jax.Array
    lengths: jax.Array
    finish_reason: jax.Array
    steps: jax.Array
    stats: Stats
    depth: Any = None

    @classmethod
    def of(cls, state: LoopState) -> GenerateOutput:
        """What a finished (or paused) loop state hands back."""
        return cls(tokens=state.tokens, prompt_lengths=state.prompt_lengths, lengths=state.lengths,
                   finish_reason=state.finish_reason, steps=state.step, stats=state.stats,
                   depth=state.depth)


@struct.dataclass
class LoopInputs:
    """The loop's traced inputs; only the static model, drafter and capacity sit beside them.

    target_params:  the target's weight pytree
    drafter_params: the drafter's weight pytree (None when it has no weights)
    prompt_tokens:  [B, P] int32, right-padded to the prompt bucket
    prompt_lengths: [B] int32
    key:            PRNG key
    sampling:       SamplingParams (traced: new values never recompile)
    max_new_tokens: [] int32
    stop_ids:       [MAX_STOP_IDS] int32, padded with -1
    depth_costs:    [n] float32, the time of a step at each adaptive depth (None when K is fixed)
    """

    target_params: Any
    drafter_params: Any
    prompt_tokens: jax.Array
    prompt_lengths: jax.Array
    key: jax.Array
    sampling: SamplingParams
    max_new_tokens: jax.Array
    stop_ids: jax.Array
    depth_costs: Any = None


def abstract_inputs(
    model: TargetModel,
    drafter_specs: Any,
    *,
    batch: int,
    prompt_len: int,
    sampling: SamplingParams | None = None,
    dtype: Any = None,
) -> LoopInputs:
    """`LoopInputs` of ShapeDtypeStructs (weights in `dtype`, default the model's; allocates
    nothing), for `jax.eval_shape` and `generate_jit.lower` at any model size. The model (a
    TargetModel or a built-in ModelConfig) must have weight specs."""
    model = as_target_model(model)
    dtype = jnp.dtype(dtype or model.dtype)
    return LoopInputs(
        target_params=abstract_from_specs(model.weight_specs(), dtype),
        drafter_params=None if drafter_specs is None else abstract_from_specs(drafter_specs, dtype),
        prompt_tokens=jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
        prompt_lengths=jax.ShapeDtypeStruct((batch,), jnp.int32),
        key=jax.random.key(0),
        sampling=sampling if sampling is not None else SamplingParams.create(),
        max_new_tokens=jax.ShapeDtypeStruct((), jnp.int32),
        stop_ids=jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32),
    )


def forward_capturing(target: Target, tokens, positions, cache, capture, mask=None) -> ForwardOutput:
    """`target.forward` capturing the drafter's `capture` ids, where `FINAL_HIDDEN` stands for the
    final-normed hidden states the pass returns anyway (so the target never sees that id)."""
    layers = tuple(i for i in capture if i != FINAL_HIDDEN)
    hidden, captured, cache = target.forward(tokens, positions, cache, mask=mask, capture=layers)
    if FINAL_HIDDEN not in capture:
        return ForwardOutput(hidden, captured, cache)
    width = hidden.shape[-1]
    parts = [hidden if i == FINAL_HIDDEN else captured[..., layers.index(i) * width:(layers.index(i) + 1) * width]
             for i in capture]
    return ForwardOutput(hidden, jnp.concatenate(parts, axis=-1), cache)


def draw_keys(key: jax.Array, lengths: jax.Array, num: int) -> Any:
    """(the key to carry on, then num - 1 keys for this pass's draws).

    One key for the batch (`generate`): split it, and carry the first on. Per-row keys [B] (the
    engine's, one per request from its seed): row b's draws come from its own key folded with
    its own committed length, which grows every step, and its key is carried on unchanged; so a
    seeded request draws the same numbers whatever runs beside it and wherever it sits."""
    if jnp.ndim(key) == 0:
        return jax.random.split(key, num)
    drawn = split_key(jax.vmap(jax.random.fold_in)(key, lengths), num - 1)
    return [key, *drawn]


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def prefill(
    target: Target,
    drafter: Drafter | None,
    drafter_params: Any,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    sampling: SamplingParams,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
    capacity: int,
    top_logprobs: int | None = None,
    empty_cache: Any = None,
) -> LoopState:
    """Run the prompt through the target, sample the first token, start the drafter.
    top_logprobs (static): None, or keep `TokenLogprobs` with this many top tokens per position.
    empty_cache: None (a new dense cache of `capacity`), or the empty cache to prefill into (the
    engine's paged rows: the pool's pages, through the rows' tables)."""
    batch, prompt_len = prompt_tokens.shape
    capture = drafter.capture_layers if drafter is not None else ()
    rows = jnp.arange(batch)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    model = target.model
    with jax.named_scope("prefill"):
        # The empty cache behind a barrier: XLA would otherwise see its zero lengths as constants
        # and constant-fold the prefill's fully masked cache attention on the host, element by
        # element ([B, N, T, S]: 50 s of a 60 s compile at batch 2048, prompt 16, capacity 32).
        empty = jax.lax.optimization_barrier(model.init_cache(batch, capacity)) if empty_cache is None else empty_cache
        with into_empty_cache():  # the prompt's attention reads its own keys only
            hidden, captured, cache = forward_capturing(target, prompt_tokens, positions, empty, capture)
        # The LM head at each row's last prompt position only: [B, P, V] logits would cost P times
        # the head's FLOPs and, at batch 512 x 512 positions, tens of GB.
        last_hidden = hidden[rows, prompt_lengths - 1]  # [B, H]
    return start_state(target, drafter, drafter_params, prompt_tokens, prompt_lengths, last_hidden, captured,
                       cache, key, sampling, max_new_tokens, stop_ids, capacity, top_logprobs)


def start_state(
    target: Target,
    drafter: Drafter | None,
    drafter_params: Any,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    last_hidden: jax.Array,
    captured: jax.Array | None,
    cache: Any,
    key: jax.Array,
    sampling: SamplingParams,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
    capacity: int,
    top_logprobs: int | None = None,
) -> LoopState:
    """The loop's state once the prompt has run through the target, in one pass (`prefill`) or
    in chunks (`chunked.prefill_chunk`, the engine's chunked prefill): sample the first token from
    the last prompt position's hidden state [B, H], start the drafter from the whole prompt's
    captured hidden states [B, P, n*H], commit the prompt in the target's cache."""
    batch, prompt_len = prompt_tokens.shape
    k = drafter.k if drafter is not None else 0
    rows = jnp.arange(batch)
    with jax.named_scope("prefill"):
        logits = target.logits(last_hidden)  # [B, V]
    key, first_key = draw_keys(key, prompt_lengths, 2)
    first = sample(first_key, warp(logits, sampling))  # [B]
    tokens = jnp.zeros((batch, capacity), jnp.int32).at[:, :prompt_len].set(prompt_tokens)
    tokens = tokens.at[rows, prompt_lengths].set(first)
    is_stop = _is_stop(first, stop_ids)
    hit_length = max_new_tokens <= 1
    finish = jnp.where(is_stop, FINISH_STOP, jnp.where(hit_length, FINISH_LENGTH, FINISH_NONE))
    drafter_state = ()
    if drafter is not None:
        drafter_state = drafter.init(
            drafter_params, target, prompt_tokens, prompt_lengths, captured, capacity
        )
    return LoopState(
        tokens=tokens,
        lengths=prompt_lengths + 1,
        prompt_lengths=prompt_lengths,
        done=is_stop | hit_length,
        finish_reason=finish.astype(jnp.int32),
        cache=target.model.commit(cache, prompt_lengths),
        drafter_state=drafter_state,
        key=key,
        step=jnp.zeros((), jnp.int32),
        stats=Stats.zeros(batch, k),
        logprobs=None if top_logprobs is None else TokenLogprobs.empty(batch, capacity, top_logprobs).record(
            logits[:, None], first[:, None], prompt_lengths[:, None]),
    )


def speculative_step(
    state: LoopState,
    target: Target,
    drafter: Drafter | None,
    drafter_params: Any,
    sampling: SamplingParams,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
) -> LoopState:
    """One draft -> verify -> accept step for every row (finished rows write nothing)."""
    batch = state.tokens.shape[0]
    k = drafter.k if drafter is not None else 0
    rows = jnp.arange(batch)
    key, draft_key, accept_key = draw_keys(state.key, state.lengths, 3)

    start = state.lengths - 1  # [B] position of the last committed token (the root)
    last = state.tokens[rows, start]
    # Steps 1-3: draft, verify in one target pass, accept a prefix (a chain) or a path (a tree).
    step_fn = _tree_step if tree_budget(drafter) > 0 else _chain_step
    drafts, num_accepted, next_token, path, cache, captured, drafter_state, logits = step_fn(
        state, target, drafter, drafter_params, sampling, draft_key, accept_key, last
    )
    offsets = jnp.arange(k + 1, dtype=jnp.int32)
    out = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    out = out.at[rows, num_accepted].set(next_token)  # [B, K+1]: d_1..d_n, next, (unused)

    # Step 4: cut the emitted run at the length cap, then just after the first stop token.
    active = ~state.done
    num_new, has_stop = _emitted_count(state, out, num_accepted, active, max_new_tokens, stop_ids)

    # Step 5: commit. Unwritten slots go to an out-of-range index and are dropped.
    capacity = state.tokens.shape[1]
    write_at = jnp.where(offsets < num_new[:, None], state.lengths[:, None] + offsets, capacity)
    tokens = state.tokens.at[rows[:, None], write_at].set(out, mode="drop")
    lengths = state.lengths + num_new
    hit_length = active & ~has_stop & (lengths - state.prompt_lengths >= max_new_tokens)
    newly_stopped = active & has_stop
    finish = jnp.where(
        newly_stopped, FINISH_STOP, jnp.where(hit_length, FINISH_LENGTH, state.finish_reason)
    )
    if drafter is not None:
        drafter_state = drafter.commit(
            drafter_params, target, drafter_state, start, num_accepted, captured
        )
    drafted = tree_budget(drafter) or k
    return LoopState(
        tokens=tokens,
        lengths=lengths,
        prompt_lengths=state.prompt_lengths,
        done=state.done | newly_stopped | hit_length,
        finish_reason=finish.astype(jnp.int32),
        # A chain: rejected drafts drop by length; a tree: the accepted path moves to contiguous
        # slots first.
        cache=target.model.commit(cache, lengths - 1, path),
        drafter_state=drafter_state,
        key=key,
        step=state.step + 1,
        stats=_count_step(state.stats, active, drafted, num_accepted, num_new, k),
        logprobs=None if state.logprobs is None else state.logprobs.record(
            logits if path is None else jnp.take_along_axis(logits, path[:, :, None], axis=1), out, write_at),
    )


def _emitted_count(state, out, num_accepted, active, max_new_tokens, stop_ids):
    """(tokens each row commits this step [B], whether its run holds a stop token [B]): the run
    of n + 1 tokens cut at the length cap, then just after the first stop token; 0 for a
    finished row."""
    offsets = jnp.arange(out.shape[1], dtype=jnp.int32)
    generated = state.lengths - state.prompt_lengths
    num_new = jnp.minimum(num_accepted + 1, max_new_tokens - generated)
    stop_mask = _is_stop(out, stop_ids) & (offsets[None, :] < num_new[:, None])
    has_stop = jnp.any(stop_mask, axis=-1)
    num_new = jnp.where(has_stop, jnp.argmax(stop_mask, axis=-1) + 1, num_new)
    return jnp.where(active, num_new, 0), has_stop


def _count_step(stats: Stats, active, drafted: int, num_accepted, num_new, k: int) -> Stats:
    """`stats` plus one verify step of the live rows (`drafted` draft tokens each)."""
    live = active.astype(jnp.int32)
    offsets = jnp.arange(k, dtype=jnp.int32)
    return Stats(
        steps=stats.steps + live,
        drafted=stats.drafted + live * drafted,
        accepted=stats.accepted + live * num_accepted,
        emitted=stats.emitted + num_new,
        histogram=stats.histogram
        + live[:, None] * jax.nn.one_hot(num_accepted, k + 1, dtype=jnp.int32),
        position_accepted=stats.position_accepted
        + live[:, None] * (offsets[None, :] < num_accepted[:, None]).astype(jnp.int32),
    )


def _chain_step(state, target, drafter, drafter_params, sampling, draft_key, accept_key, last):
    """Steps 1-3 for a chain (or, with no drafter, a plain step): draft K tokens, verify [last,
    d_1..d_K] in one pass, accept a prefix. -> (drafts [B, K], num_accepted [B], next_token [B],
    path None, the target cache, captured hidden states [B, K+1, n*H] (or None), drafter state,
    the verify pass's logits [B, K+1, V])."""
    batch = last.shape[0]
    k = drafter.k if drafter is not None else 0
    start = state.lengths - 1
    # Step 1: draft K tokens per row.
    if drafter is not None:
        with jax.named_scope("draft"):
            drafts, draft_probs, drafter_state = drafter.propose(
                drafter_params, target.replace(cache=state.cache), state.drafter_state,
                state.tokens, state.lengths, draft_key, sampling,
            )
    else:
        drafts, draft_probs, drafter_state = jnp.zeros((batch, 0), jnp.int32), None, ()

    # Step 2: verify [last committed token, d_1..d_K] in one target pass.
    verify_tokens = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, K+1]
    verify_positions = start[:, None] + jnp.arange(k + 1, dtype=jnp.int32)  # [B, K+1]
    capture = drafter.capture_layers if drafter is not None else ()
    with jax.named_scope("verify"):
        hidden, captured, cache = forward_capturing(
            target, verify_tokens, verify_positions, state.cache, capture
        )
        logits = target.logits(hidden)  # [B, K+1, V] float32

    # Step 3: accept a prefix of the drafts; sample the correction or bonus token.
    with jax.named_scope("accept"):
        num_accepted, next_token = accept(accept_key, warp(logits, sampling), drafts, draft_probs)
    return drafts, num_accepted, next_token, None, cache, captured, drafter_state, logits


def tree_budget(drafter: Drafter | None) -> int:
    """Draft nodes per verify step when the drafter proposes trees (its static `tree` setting),
    else 0 (a chain of K)."""
    return 0 if drafter is None else _tree_budget(getattr(drafter, "tree", 0))


def pass_drafts(drafter: Drafter | None) -> int:
    """Slots a verify pass writes past the last committed token: K, or N for a tree (0 without a
    drafter); a step commits at most this + 1 tokens."""
    return max(drafter.k, tree_budget(drafter)) if drafter is not None else 0


def _tree_step(state, target, drafter, drafter_params, sampling, draft_key, accept_key, last):
    """Steps 1-3 for a tree: draft N nodes, verify root + N in one pass under the ancestor mask
    (node position = start + depth), accept the longest accepted path. -> (the path's drafts
    [B, K] (0 past it), num_accepted [B], next_token [B], path [B, K+1], the target cache,
    the captured hidden states along the path [B, K+1, n*H] (or None), drafter state, the verify
    pass's logits [B, N+1, V])."""
    k = drafter.k
    rows = jnp.arange(last.shape[0])
    start = state.lengths - 1
    with jax.named_scope("draft"):
        tree, drafter_state = drafter.propose_tree(
            drafter_params, target.replace(cache=state.cache), state.drafter_state, state.tokens,
            state.lengths, draft_key, sampling,
        )
    verify_tokens, parents = with_root(tree, last)  # [B, N+1]
    mask = ancestor_mask(parents)  # [B, N+1, N+1]
    positions = start[:, None] + tree_depths(mask)
    with jax.named_scope("verify"):
        hidden, captured, cache = forward_capturing(
            target, verify_tokens, positions, state.cache, drafter.capture_layers, mask=mask,
        )
        logits = target.logits(hidden)  # [B, N+1, V] float32
    draft_probs = None
    if tree.probs is not None:
        draft_probs = jnp.concatenate([jnp.zeros_like(tree.probs[:, :1]), tree.probs], axis=1)
    with jax.named_scope("accept"):
        num_accepted, next_token, path = accept_tree(
            accept_key, warp(logits, sampling), verify_tokens, parents, k, draft_probs, tree.mode
        )
    drafts = jnp.where(jnp.arange(k)[None, :] < num_accepted[:, None], verify_tokens[rows[:, None], path[:, 1:]], 0)
    if captured is not None:  # drafters read the path's hidden states as if it were a chain
        captured = jnp.take_along_axis(captured, path[:, :, None], axis=1)
    return drafts, num_accepted, next_token, path, cache, captured, drafter_state, logits


def check_adaptive(drafter: Drafter | None, depth: AdaptiveDepth) -> None:
    """Host-side checks of an adaptive-depth loop: a drafter whose K is the largest depth."""
    if drafter is None:
        raise ValueError("the adaptive depth needs a drafter: plain decoding has no depth to choose.")
    if depth.depths is None or drafter.k != depth.max_depth:
        raise ValueError(f"the drafter's K ({drafter.k}) must be the adaptive policy's largest depth "
                         f"({None if depth.depths is None else depth.max_depth}).")


def with_depth_state(state: LoopState, depth: AdaptiveDepth | None, costs: Any, drafter: Any) -> LoopState:
    """The prefilled state with the adaptive policy's record (unchanged when K is fixed)."""
    if depth is None:
        return state
    batch, capacity = state.tokens.shape
    return state.replace(depth=depth.initial_state(batch, capacity, costs, draft_sources(drafter)))


def adaptive_steps(
    state: LoopState,
    target: Target,
    drafter: Drafter,
    depth: AdaptiveDepth,
    drafter_params: Any,
    sampling: SamplingParams,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
    keep_going: Any,
) -> LoopState:
    """Steps at the depths the adaptive policy picks (`spec_jax.decoding.depth`), one pass over
    the depths: each depth has its own `lax.while_loop` of `speculative_step` at that depth
    (depth 0: a plain step; `spec_jax.decoding.depth` says what it does with the drafter's
    state), running while `keep_going` (the enclosing loop's condition) holds and the policy
    picks that depth. A pass runs at least one step (the depth picked now has its loop now or
    later in the pass). Loops rather than a `lax.switch` per step: XLA copies the caches into
    and out of a conditional's branches every step (34 cache-sized copies against the fixed
    loop's 6 in a tiny DFlash program), while a loop updates them in place, so a step costs what
    the same step costs at a fixed depth. A plain step's shadow probe is a `lax.switch` that only
    reads the state (no copies)."""
    check_adaptive(drafter, depth)
    batch = state.tokens.shape[0]
    rows = jnp.arange(batch)
    top = drafter_at_depth(drafter, depth.max_depth, depth.max_depth)
    # Shadow probes (greedy chains): a plain step also drafts, unverified, and the plain steps
    # after it check the drafts (`depth.record_shadow`); sampled rows probe by drafting steps.
    shadowing = depth.shadow_every > 0 and not tree_budget(top)
    greedy = jnp.all(sampling.temperature == 0.0)
    verify_probes = ~greedy if shadowing else True

    sources = draft_sources(top)

    def with_next_choice(s: LoopState) -> LoopState:
        """`s` with the next step's draft sources and depth in its record (committed tokens and
        acceptance only: exact). Once per step, at its end, and once as a pass over the depths
        begins; the loops' conditions only read it."""
        source = None if sources == 1 else top.draft_source(drafter_params, s.tokens, s.lengths)
        left = max_new_tokens - (s.lengths - s.prompt_lengths)  # the "finish" objective's
        choice = choose_depth(depth, s.depth, ~s.done, verify_probes, source, remaining=left)
        stored = jnp.zeros((batch,), jnp.int32) if source is None else source
        return s.replace(depth=s.depth.replace(source=stored, choice=choice))

    def at(index: int, d: int):
        step_drafter = drafter_at_depth(drafter, d, depth.max_depth)

        def picked(s: LoopState) -> jax.Array:
            return keep_going(s) & (s.depth.choice == index)

        def step(s: LoopState) -> LoopState:
            record = s.depth
            source = None if sources == 1 else record.source
            if d == 0 and shadowing:
                due, drafts, s = shadow_probe(s, target, top, depth, drafter_params, sampling, source, greedy)
            inner = s.replace(stats=Stats.zeros(batch, d), depth=None)
            out = speculative_step(inner, target, step_drafter, drafter_params, sampling, max_new_tokens, stop_ids)
            if d == 0 and shadowing:  # the token this plain step committed, at the old length
                committed = out.tokens[rows, jnp.minimum(s.lengths, s.tokens.shape[1] - 1)]
                record = record_shadow(depth, record, ~s.done, committed, due, drafts, source)
            record = record_depth(depth, record, jnp.int32(index), s.step, ~s.done, out.stats.accepted, source)
            return with_next_choice(out.replace(stats=_add_stats(s.stats, out.stats), depth=record))

        return picked, step

    state = with_next_choice(state)  # the caller (the engine between chunks) may have changed rows
    try:
        for index, d in enumerate(depth.depths):
            state = jax.lax.while_loop(*at(index, d), state)
    except TypeError as e:  # the step's state differs from the loop's
        raise ValueError(
            f"{type(drafter).__name__} cannot switch depth per step: its state's shape depends on K "
            "(keep it at the largest K's shape, as the pair-cache drafters pad their pending pairs). "
            "Pin K (an int k) for this drafter.") from e
    return state


def shadow_probe(s: LoopState, target: Target, top: Drafter, depth: AdaptiveDepth, drafter_params: Any,
                 sampling: SamplingParams, source: jax.Array | None, greedy: jax.Array,
                 ) -> tuple[jax.Array, jax.Array, LoopState]:
    """A plain step's shadow probe (`adaptive_steps`; `top`: the drafter at the largest depth).
    -> (whether this step drafts one [], the drafts a step at the largest depth would verify now
    [B, K], zeros when not, the state: the probe's own drafter state is dropped, but what a
    drafter that plain steps leave behind catches up is kept)."""
    batch = s.tokens.shape[0]

    def draft(s):
        draft_key = draw_keys(s.key, s.lengths, 3)[1]  # the plain step's own, unused draft key
        return top.propose(drafter_params, target.replace(cache=s.cache), s.drafter_state, s.tokens,
                           s.lengths, draft_key, sampling)[0]

    def free_drafts(s):  # every live row takes a source with no model pass: no propose at all
        return top.free_drafts(drafter_params, s.tokens, s.lengths)  # (finished rows' would not match)

    def none(s):
        return jnp.zeros((batch, depth.max_depth), jnp.int32)

    free, branches = jnp.asarray(False), [none, draft]
    if source is not None and getattr(top, "free_draft_sources", ()):
        free = jnp.all(s.done | jnp.isin(source, jnp.asarray(top.free_draft_sources)))
        branches.append(free_drafts)
    due = shadow_due(depth, s.depth, ~s.done, free) & greedy
    # In place, outside the switch, whose state is dropped: every row (finished ones too, which
    # the probe's own propose would catch up again at each probe).
    if getattr(top, "catches_up", False):
        s = s.replace(drafter_state=top.catch_up(drafter_params, target.replace(cache=s.cache), s.drafter_state,
                                                 s.tokens, s.lengths, rows=jnp.broadcast_to(due & ~free, (batch,))))
    branch = jnp.where(due, jnp.where(free, len(branches) - 1, 1), 0)
    return due, jax.lax.switch(branch, branches, s), s


def _add_stats(total: Stats, part: Stats) -> Stats:
    """`total` (at K) plus `part` (counted at a depth <= K; its per-position counts padded)."""
    def pad(x, width):
        return jnp.pad(x, ((0, 0), (0, width - x.shape[1])))

    return Stats(
        steps=total.steps + part.steps,
        drafted=total.drafted + part.drafted,
        accepted=total.accepted + part.accepted,
        emitted=total.emitted + part.emitted,
        histogram=total.histogram + pad(part.histogram, total.histogram.shape[1]),
        position_accepted=total.position_accepted + pad(part.position_accepted, total.position_accepted.shape[1]),
    )


def generate_loop(
    inputs: LoopInputs,
    *,
    model: TargetModel,
    drafter: Drafter | None,
    capacity: int,
    depth: AdaptiveDepth | None = None,
) -> GenerateOutput:
    """Prefill + the whole speculative loop; meant to run under one `jax.jit`.

    Static: model (a TargetModel, or a built-in ModelConfig), drafter (hashable, holds K),
    capacity, depth (None: every step drafts K; an `AdaptiveDepth` without costs: each step
    picks its depth, the drafter's K the largest), and the shapes of the inputs.
    Traced: everything in `inputs`, so new sampling values, caps, stop ids or depth costs never
    recompile.
    """
    target = Target(inputs.target_params, as_target_model(model))
    drafter_params, sampling = inputs.drafter_params, inputs.sampling
    max_new_tokens, stop_ids = inputs.max_new_tokens, inputs.stop_ids
    state = prefill(
        target, drafter, drafter_params, inputs.prompt_tokens, inputs.prompt_lengths, inputs.key,
        sampling, max_new_tokens, stop_ids, capacity,
    )
    state = with_depth_state(state, depth, inputs.depth_costs, drafter)

    def not_finished(s: LoopState) -> jax.Array:
        # Every live row emits >= 1 token per step, so max_new_tokens steps always suffice.
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def step(s: LoopState) -> LoopState:
        if depth is not None:
            return adaptive_steps(s, target, drafter, depth, drafter_params, sampling, max_new_tokens, stop_ids,
                                  not_finished)
        return speculative_step(s, target, drafter, drafter_params, sampling, max_new_tokens, stop_ids)

    state = jax.lax.while_loop(not_finished, step, state)
    return GenerateOutput.of(state)


generate_jit = jax.jit(generate_loop, static_argnames=("model", "drafter", "capacity", "depth"))
