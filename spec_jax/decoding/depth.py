"""Speculation depth chosen per step, on device (`generate(..., k="adaptive")`).

Each step of the loop picks its depth K from a small static set (by default 0, 2, about half the
drafter's K, and its K). Each depth has its own step function and its own inner `lax.while_loop`
that runs while the policy picks it (`loop.adaptive_steps`), so a K = 0 step really is a one-token
plain step and pays only that (a masked draft would still cost its whole verify width on CPU). The choice maximises the batch's expected tokens per unit of step time:

    expected_tokens(K, a) = 1 + a + ... + a^K  (= (1 - a^(K+1)) / (1 - a))
    choice = argmax over K of  sum over live rows of expected_tokens(K, a_row) / cost(K)
             (a plain step's value counted (1 + margin) times: drafting must promise more)

where a_row is an exponential moving average of the row's acceptance rate (accepted drafts over
drafts tried: a step accepting n of K tries n + 1 drafts, or K when all are accepted), carried in
the loop state, and cost(K) the measured time of a step at depth K (`spec_jax.decoding.depth_costs`
measures it once per device kind, model and batch bucket, or the caller supplies it). The batch
shares one depth per step: per-row depths would cost every row the widest row's verify anyway.
That sum is the engine's objective (`objective="throughput"`: a finished slot takes the next
request, so every token counts). A call of `generate` or `generate_stream` ends when its last
row does, so there (`objective="finish"`) the choice minimises the batch's projected finish
time instead, every remaining step at depth K:

    choice = argmin over K of  cost(K) x max over live rows of remaining_row / expected_tokens(K, a_row)

(remaining_row: the new tokens the row may still take; a plain step's time divided by
1 + margin). A row far ahead, or one whose drafts are accepted while the others' are not, no
longer buys drafting steps that the slowest rows pay for: at batch 8 on HumanEval the
throughput objective drafted while the two rows whose drafts were accepted ran ahead, and the
six others finished later than under plain decoding (0.94x; benchmarks/RESULTS.md, session 28).
With one row both objectives choose the same depth.
A drafter whose drafts come from one of several sources, told apart from the committed tokens
before drafting (`draft_sources`, `draft_source(params, tokens, lengths)`: prompt lookup in front
of a model drafter, where a row takes the lookup's drafts when its last tokens recur), has one
average per row and source, and a_row is the one of the source its drafts come from this step:
on chat prompts the lookup's drafts were worth 2.8 tokens a K = 7 step and DFlash's 1.2, so the
policy drafts where the lookup matches and steps plainly elsewhere.
A tree drafter (node budget N) at depth d < K drafts a tree of ceil(N d / K) nodes, a static
tree its paths no deeper than d (`tree_at_depth`): a shallower step verifies fewer tokens.

Exactness: the depth depends only on the acceptance history and the draft source (committed
tokens, and earlier steps' drafts checked against them), never on the current step's drafts, so
each step is an ordinary speculative step at a depth fixed before it drafts: greedy output is
token-identical to plain decoding, sampled output keeps its distribution.

Exploration: a K = 0 step observes nothing, so the policy probes.
- Greedy chains probe by a shadow probe: after `shadow_every` plain steps in a row (times the
  probe's price in plain steps, where a step at the largest depth costs more than two plain
  ones: DFlash over 8 rows on CPU), a plain step also runs the drafter at the largest depth
  (its drafts and state thrown away, the step's output untouched), and the plain steps after
  it compare those drafts with the tokens they commit; the first mismatch (or the K-th match)
  records what a step at depth K would have accepted there, exactly, for the cost of a draft
  pass (`record_shadow`). Where every live row would take a
  draft source that costs no model pass (`free_draft_sources`: the lookup's, in front of DFlash
  or a draft model), a plain step probes at once, without waiting, with those drafts alone
  (`free_drafts`: no model pass, whatever finished or empty rows would take). Replayed on
  recorded greedy walks of the default model (`benchmarks/depth_replay.py`), shadow probes and
  per-source rates took chat from 0.98x to 1.00x plain (median; mean 1.08x) and HumanEval from
  1.17x to 1.29x.
- Sampled decoding and trees probe by drafting: after a run of K = 0 steps as long as
  `probe_every` times the cheapest drafting depth's cost over a plain step's, one step drafts at
  that depth (the deepest of equally cheap ones), at a cost of about 1 / probe_every of the time
  (a sampled token matching a sampled draft would underrate the drafts' acceptance).
Each probe in a row after which drafting still promises the batch's live rows less than a plain
step (`promise`, with the acceptance the probe observed, by the throughput objective whatever
the entry point's) doubles the wait, up to 2^probe_backoff times (default 2x: a drafter that is
never right, or right too seldom to pay, is probed half as often; 8x starved code prompts of
probes), and one after which drafting pays resets it. A plain step's value gets a head start
(`margin`): near break-even, noisy costs and acceptance made drafting steps lose.

Drafter state across K = 0 steps. A drafter whose cache is fed from committed tokens alone (the
draft model) is left behind by plain steps and catches up when it drafts again (`catches_up`,
`catch_up`: the tokens it missed, fed its re-feed width at a time, so a run of plain steps costs
it nothing until a drafting step or a shadow probe, and then a fraction of one pass per missed
token; the catch-up before a shadow probe is kept, the probe's own state dropped). A drafter
whose state needs the target's hidden states is kept current, since those exist only at the
step that computed them: a K = 0 step calls its optional `keep_current(params, target, state,
tokens, lengths)` before the target's pass, then its ordinary `commit` of a step that verified
one token and accepted no drafts (DFlash writes that token's context entry; Medusa and the
Gemma 4 assistant take its hidden state; EAGLE-3 and the MTP heads,
`spec_jax.drafters.pair_cache`, run their pending pairs into their cache first and keep the
pending buffer at the largest K's width). Deferring DFlash's commits was built and measured: it
saved nothing (benchmarks/RESULTS.md, session 25). A drafter whose state's shape depends on K
cannot switch depth and is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from spec_jax.drafters.tree import tree_budget

ADAPTIVE = "adaptive"
OBJECTIVES = ("throughput", "finish")


@dataclasses.dataclass(frozen=True)
class AdaptiveDepth:
    """The per-step depth policy (static: a new value recompiles, except `costs`, which travel
    in the loop state).

    depths:       the depths to choose from, 0 (a plain step) included; None: `default_depths`
                  of the drafter's K. The largest is the drafter's K for the call.
    costs:        the time of one step at each depth (any unit; inf disables a depth); None:
                  measured at first use (`spec_jax.decoding.depth_costs`).
    decay:        weight of the acceptance history per observation (0.9: about the last 10).
    prior:        acceptance rate assumed before any step drafted, worth `prior_weight` drafts
                  (the engine starts an admitted request from what all rows accepted lately).
    probe_every:  after this many K = 0 steps in a row, times the cost ratio of the cheapest
                  drafting depth to a plain step, one step drafts at that depth (so probing
                  costs at most about 1 / probe_every of the time).
    probe_backoff: each probe in a row after which drafting still does not pay the batch
                  doubles the wait before the next probe, at most 2^probe_backoff times.
    margin:       a drafting depth must promise this much more than a plain step (0.1: 10% more
                  tokens per unit of time) to be chosen: costs and acceptance are noisy
                  estimates, and near break-even the engine's drafting steps lost throughput.
    shadow_every: greedy chain drafters probe by a draft pass alone (a shadow probe, see the
                  module docstring) after this many K = 0 steps in a row (times the backoff);
                  0: probe by drafting steps, as sampled decoding and trees always do.
    objective:    "throughput" (the batch's tokens per unit of time: the engine's, whose finished
                  slots take new requests) or "finish" (the time until the batch's last row is
                  done: `generate`'s and the stream's); None: the entry point's.
    """

    depths: tuple[int, ...] | None = None
    costs: tuple[float, ...] | None = None
    decay: float = 0.9
    prior: float = 0.6
    prior_weight: float = 2.0
    probe_every: int = 16
    probe_backoff: int = 1
    margin: float = 0.1
    shadow_every: int = 32
    objective: str | None = None

    def __post_init__(self):
        if self.depths is not None:
            depths = tuple(sorted(set(int(d) for d in self.depths)))
            if not depths or depths[0] < 0 or depths[-1] < 1:
                raise ValueError(
                    f"adaptive depths must be >= 0 with at least one >= 1 (0 is a plain step), got "
                    f"{self.depths!r}."
                )
            object.__setattr__(self, "depths", depths)
        if self.costs is not None:
            object.__setattr__(self, "costs", tuple(float(c) for c in self.costs))
            check_costs(self.costs, self.depths)
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}.")
        if not 0.0 <= self.prior < 1.0 or self.prior_weight <= 0:
            raise ValueError(f"need 0 <= prior < 1 and prior_weight > 0, got {self.prior}, {self.prior_weight}.")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}.")
        if not self.margin >= 0.0:
            raise ValueError(f"margin must be >= 0 (a plain step's head start), got {self.margin}.")
        if self.shadow_every < 0:
            raise ValueError(f"shadow_every must be >= 0 (0: no shadow probes), got {self.shadow_every}.")
        if self.objective not in OBJECTIVES + (None,):
            raise ValueError(f"objective must be one of {OBJECTIVES} (or None: the entry point's), "
                             f"got {self.objective!r}.")
        if not 0 <= self.probe_backoff <= 16:
            raise ValueError(f"probe_backoff must be in 0..16 (doublings of the probe wait), got {self.probe_backoff}.")

    def for_k(self, k: int) -> "AdaptiveDepth":
        """This policy with its depths filled in from the drafter's K when it names none."""
        return self if self.depths is not None else dataclasses.replace(self, depths=default_depths(k))

    def for_entry(self, objective: str) -> "AdaptiveDepth":
        """This policy with the entry point's objective when it names none ("finish" for a call
        that ends with its last row, "throughput" for the engine)."""
        return self if self.objective is not None else dataclasses.replace(self, objective=objective)

    def static(self) -> "AdaptiveDepth":
        """The part the loop compiles against (costs are traced)."""
        return dataclasses.replace(self, costs=None)

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    def initial_state(self, batch: int, capacity: int, costs: Any, sources: int = 1) -> "DepthState":
        """The loop state's depth record before the first step (`sources`: the drafter's
        `draft_sources`, each with its own acceptance averages)."""
        n = len(self.depths)
        return DepthState(
            accepted_ema=jnp.full((batch, sources), self.prior * self.prior_weight, jnp.float32),
            tried_ema=jnp.full((batch, sources), self.prior_weight, jnp.float32),
            idle_steps=jnp.zeros((), jnp.int32),
            missed=jnp.zeros((), jnp.int32),
            pool_accepted=jnp.full((sources,), self.prior * self.prior_weight, jnp.float32),
            pool_tried=jnp.full((sources,), self.prior_weight, jnp.float32),
            costs=jnp.asarray(costs, jnp.float32).reshape(n),
            counts=jnp.zeros((n,), jnp.int32),
            trace=jnp.full((capacity,), -1, jnp.int32),
            shadow=jnp.zeros((batch, self.max_depth), jnp.int32),
            shadow_at=jnp.full((batch,), -1, jnp.int32),
            shadow_source=jnp.zeros((batch,), jnp.int32),
            shadows=jnp.zeros((), jnp.int32),
            source=jnp.zeros((batch,), jnp.int32),
            choice=jnp.zeros((), jnp.int32),
        )


def draft_sources(drafter: Any) -> int:
    """How many kinds of drafts the drafter tells apart before drafting (`draft_source`): prompt
    lookup in front of a model drafter, 2 (the model's drafts, the lookup's); else 1."""
    return int(getattr(drafter, "draft_sources", 1)) if drafter is not None else 1


def default_depths(k: int) -> tuple[int, ...]:
    """0, 2, about K / 2 and K (K = 7: 0, 2, 4, 7; K = 4: 0, 2, 4; K = 1: 0, 1)."""
    return tuple(sorted({0, min(2, k), (k + 1) // 2, k}))


def check_costs(costs: Any, depths: tuple[int, ...] | None) -> None:
    import math

    costs = [float(c) for c in costs]
    if depths is not None and len(costs) != len(depths):
        raise ValueError(f"give one cost per depth: {len(depths)} depths {depths}, {len(costs)} costs.")
    if any(not c > 0 for c in costs) or not any(math.isfinite(c) for c in costs):
        raise ValueError(f"depth costs must be > 0 (inf disables a depth), at least one finite; got {costs}.")


def as_adaptive_depth(k: Any) -> AdaptiveDepth | None:
    """`generate`'s `k` when it asks for the adaptive policy ("adaptive" or an AdaptiveDepth),
    else None (an int or None pins K)."""
    if isinstance(k, AdaptiveDepth):
        return k
    if isinstance(k, str):
        if k.strip().lower() == ADAPTIVE:
            return AdaptiveDepth()
        raise ValueError(f"k must be an int, 'adaptive' or an AdaptiveDepth, got {k!r}.")
    return None


@struct.dataclass
class DepthState:
    """The adaptive policy's part of the loop state.

    accepted_ema: [B, S] float32  discounted drafts accepted per row and draft source (prior
                               included; S = the drafter's `draft_sources`, 1 for most)
    tried_ema:    [B, S] float32  discounted drafts tried; acceptance rate = accepted / tried
    idle_steps:   []  int32    K = 0 steps in a row just before this one
    missed:       []  int32    observations in a row (drafting steps, closed shadow probes) after
                               which drafting still did not pay: the probe backoff
    pool_accepted, pool_tried: [S] float32  the same averages over all rows together (the
                               engine starts an admitted row's from this rate, not the prior)
    costs:        [n] float32  time of one step at each depth
    counts:       [n] int32    steps taken at each depth
    trace:        [S] int32    the depth of step i (-1: no step i)
    shadow:       [B, K] int32 the open shadow probe's drafts (K the largest depth)
    shadow_at:    [B] int32    how many of them the plain steps since have confirmed; -1: none open
    shadow_source: [B] int32   the draft source the open probe's drafts came from
    shadows:      []  int32    shadow probes taken
    source:       [B] int32    where each row's drafts come from at the next step (0 with one source)
    choice:       []  int32    the next step's depth (an index into the depths), chosen after the
                               last step: each step looks its rows' draft sources up once (the
                               prompt lookup's n-gram match), not again in the loop's condition
    """

    accepted_ema: jax.Array
    tried_ema: jax.Array
    idle_steps: jax.Array
    missed: jax.Array
    pool_accepted: jax.Array
    pool_tried: jax.Array
    costs: jax.Array
    counts: jax.Array
    trace: jax.Array
    shadow: jax.Array
    shadow_at: jax.Array
    shadow_source: jax.Array
    shadows: jax.Array
    source: jax.Array
    choice: jax.Array

    def rate(self, source: Any = None) -> jax.Array:
        """[B] each row's acceptance rate for the drafts it gets now (`source` [B]; None: the
        first source)."""
        rates = jnp.clip(self.accepted_ema / self.tried_ema, 0.0, 1.0)  # [B, S]
        if source is None:
            return rates[:, 0]
        return jnp.take_along_axis(rates, source[:, None], axis=1)[:, 0]


def promise(policy: AdaptiveDepth, state: DepthState, live: jax.Array, source: Any = None,
            remaining: Any = None) -> jax.Array:
    """What a step at each depth promises the rows `live` [B] at their acceptance now, per unit of
    time; [n] float32 (-1: a disabled depth), a plain step's with its head start (`margin`).
    Throughput: expected tokens over the step's cost; "finish" (with `remaining`): one over the
    batch's projected finish time."""
    depths = jnp.asarray(policy.depths, jnp.int32)
    rate = state.rate(source)  # [B]
    powers = rate[:, None] ** jnp.arange(policy.max_depth + 1, dtype=jnp.float32)  # [B, Kmax+1]
    expected = jnp.cumsum(powers, axis=1)[:, depths]  # [B, n]: 1 + a + ... + a^K
    usable = jnp.isfinite(state.costs)
    if policy.objective == "finish" and remaining is not None:
        # The batch's projected finish time at depth K: its slowest row's remaining steps.
        left = jnp.maximum(remaining, 1).astype(jnp.float32)[:, None] / expected  # [B, n]
        finish = jnp.max(jnp.where(live[:, None], left, 0.0), axis=0)  # [n]
        value = jnp.where(usable, 1.0 / (state.costs * jnp.maximum(finish, 1e-6)), -1.0)
    else:
        tokens = jnp.sum(jnp.where(live[:, None], expected, 0.0), axis=0)  # [n]
        value = jnp.where(usable, tokens / state.costs, -1.0)
    return jnp.where(depths == 0, value * (1.0 + policy.margin), value)  # a plain step's head start


def choose(policy: AdaptiveDepth, state: DepthState, live: jax.Array, verify_probes: Any = True,
           source: Any = None, remaining: Any = None) -> jax.Array:
    """The index (into `policy.depths`) of this step's depth; [] int32. verify_probes (traced
    bool): probe with a drafting step (False where shadow probes do it). source: [B] where each
    row's drafts come from this step (the drafter's `draft_source`), None: one source.
    remaining: [B] new tokens each row may still take (the "finish" objective; None: throughput)."""
    depths = jnp.asarray(policy.depths, jnp.int32)
    usable = jnp.isfinite(state.costs)
    best = jnp.argmax(promise(policy, state, live, source, remaining)).astype(jnp.int32)
    # Probe: the cheapest usable depth > 0 (the deepest of equally cheap ones, which observes
    # more drafts for the same time: on CPU depths 2-7 often measure alike) drafts once after
    # probe_every x (its cost / a plain step's) idle steps, so probing costs at most about
    # 1 / probe_every of the time.
    probe_ok = usable & (depths > 0)
    cheapest = jnp.min(jnp.where(probe_ok, state.costs, jnp.inf))
    candidates = probe_ok & (state.costs <= cheapest)
    probe = (len(policy.depths) - 1 - jnp.argmax(candidates[::-1])).astype(jnp.int32)
    backoff = jnp.exp2(jnp.minimum(state.missed, policy.probe_backoff).astype(jnp.float32))
    wait = backoff * policy.probe_every * state.costs[probe] / state.costs[0]  # depths[0] is 0 when best is
    should_probe = (depths[best] == 0) & (state.idle_steps >= wait) & jnp.any(probe_ok) & verify_probes
    return jnp.where(should_probe, probe, best)


def shadow_due(policy: AdaptiveDepth, state: DepthState, live: jax.Array, free: Any = False) -> jax.Array:
    """Whether this K = 0 step drafts a shadow probe: none is open and `shadow_every` plain
    steps (times the backoff, times the probe's price in plain steps where that is above one)
    have passed since the last, or drafting costs nothing now (`free`: every live row would take
    the prompt lookup's drafts); [] bool.

    The probe's price: what a step at the largest depth costs beyond a plain step, a bound on
    its draft pass. So probing takes at most about 1 / shadow_every of the time at any batch:
    DFlash's draft pass over 8 rows cost ~3 plain steps on CPU, and waits of 32 steps made an
    all-plain batch of 8 run at 0.93x plain decoding (benchmarks/RESULTS.md, session 28)."""
    backoff = jnp.left_shift(1, jnp.minimum(state.missed, policy.probe_backoff))
    top, plain = state.costs[-1], state.costs[0]
    price = jnp.where(jnp.isfinite(top), (top - plain) / plain, 1.0)
    waited = (state.idle_steps >= backoff * policy.shadow_every * jnp.maximum(price, 1.0)) | free
    can_draft = jnp.any(jnp.isfinite(state.costs) & (jnp.asarray(policy.depths) > 0))
    return waited & can_draft & ~jnp.any(live & (state.shadow_at >= 0)) & jnp.any(live)


def record_shadow(policy: AdaptiveDepth, state: DepthState, live: jax.Array, committed: jax.Array,
                  opened: jax.Array, drafts: jax.Array, source: Any = None) -> DepthState:
    """`state` after a K = 0 step that committed `committed` [B] (one token per live row) and,
    where `opened`, drafted the shadow probe `drafts` [B, K]. Each open probe's next draft is
    compared with the committed token: a match moves it on, a miss or the K-th match closes it
    and records what a step at depth K would have accepted there (greedy: exactly that)."""
    k = policy.max_depth
    at = jnp.where(opened, jnp.where(live, 0, -1), state.shadow_at)
    drafts = jnp.where(opened, drafts, state.shadow)
    open_ = live & (at >= 0)
    expected = jnp.take_along_axis(drafts, jnp.clip(at, 0, k - 1)[:, None], axis=1)[:, 0]
    hit = open_ & (expected == committed)
    moved = at + hit.astype(jnp.int32)
    closed = open_ & (~hit | (moved >= k))
    source = jnp.where(opened, _source(state, source), state.shadow_source)
    tried = jnp.where(moved < k, moved + 1, k).astype(jnp.float32)  # as a step at depth K counts them
    state = _observe(policy, state, closed, moved, tried, live, source)
    return state.replace(
        shadow=drafts,
        shadow_source=source,
        shadow_at=jnp.where(closed | ~live, -1, moved).astype(jnp.int32),
        shadows=state.shadows + opened.astype(jnp.int32),
        idle_steps=jnp.where(opened, 0, state.idle_steps).astype(jnp.int32),
    )


def _source(state: DepthState, source: Any) -> jax.Array:
    return jnp.zeros(state.accepted_ema.shape[:1], jnp.int32) if source is None else source


def _observe(policy: AdaptiveDepth, state: DepthState, observe: jax.Array, accepted: jax.Array,
             tried: jax.Array, live: jax.Array, source: Any = None) -> DepthState:
    """The acceptance averages after the rows in `observe` [B] saw `accepted` of `tried`
    drafts [B] from draft source `source` [B] (a drafting step or a closed shadow probe);
    `missed` counts such observations in a row after which drafting at no depth promises the
    batch's `live` rows more than a plain step (`promise` by throughput: the rows' remaining
    tokens, which the "finish" objective also weighs, do not reach the record)."""
    decay = policy.decay
    observed = jnp.any(observe)
    sources = state.accepted_ema.shape[1]
    at = observe[:, None] & (_source(state, source)[:, None] == jnp.arange(sources))  # [B, S]
    accepted = accepted.astype(jnp.float32)

    def pooled(average: jax.Array, per_row: jax.Array) -> jax.Array:
        """The pool's averages [S] after this step: per source, the observing rows' mean,
        weighed as one row's."""
        seen = jnp.sum(at, axis=0)
        mean = jnp.sum(jnp.where(at, per_row[:, None], 0.0), axis=0) / jnp.maximum(seen, 1)
        return jnp.where(seen > 0, decay * average + mean, average)

    state = state.replace(
        accepted_ema=jnp.where(at, decay * state.accepted_ema + accepted[:, None], state.accepted_ema),
        tried_ema=jnp.where(at, decay * state.tried_ema + tried[:, None], state.tried_ema),
        pool_accepted=pooled(state.pool_accepted, accepted),
        pool_tried=pooled(state.pool_tried, tried),
    )
    # A miss: after this observation drafting still promises the batch less than a plain step,
    # judged over every live row, since the batch steps at one depth. (Not "no draft accepted":
    # over 8 rows some row nearly always accepts one; and not over the observing rows alone: a
    # shadow probe closes row by row, and one row whose two drafts matched reset the wait while
    # the batch still stepped plainly, so the engine's probes on chat never backed off.)
    pays = jnp.asarray(policy.depths)[jnp.argmax(promise(policy, state, live, source))] > 0
    return state.replace(missed=jnp.where(observed, jnp.where(pays, 0, state.missed + 1),
                                          state.missed).astype(jnp.int32))


def record(policy: AdaptiveDepth, state: DepthState, choice: jax.Array, step: jax.Array, live: jax.Array,
           accepted: jax.Array, source: Any = None) -> DepthState:
    """`state` after a step at depth `policy.depths[choice]` in which live rows accepted
    `accepted` [B] drafts. A K = 0 step observes nothing (its shadow probe, `record_shadow`,
    may); a drafting step closes any open shadow probe unread (the tokens moved on)."""
    depth = jnp.asarray(policy.depths, jnp.int32)[choice]
    tried = jnp.where(accepted < depth, accepted + 1, depth).astype(jnp.float32)
    state = _observe(policy, state, live & (depth > 0), accepted, tried, live, source)
    return state.replace(
        idle_steps=jnp.where(depth == 0, state.idle_steps + 1, 0).astype(jnp.int32),
        shadow_at=jnp.where(depth == 0, state.shadow_at, -1).astype(jnp.int32),
        counts=state.counts.at[choice].add(1),
        trace=state.trace.at[step].set(depth, mode="drop"),
    )


def admitted_row(policy: AdaptiveDepth, row: DepthState, pool: DepthState) -> DepthState:
    """A newly admitted row's record (the engine's): its acceptance starts from the rate the pool
    of rows has seen lately, worth `prior_weight` drafts, instead of the fixed prior, so requests
    arriving while drafts are rarely accepted do not each make the batch draft on a guess."""
    rate = jnp.clip(pool.pool_accepted / pool.pool_tried, 0.0, 1.0)  # [S]
    return row.replace(accepted_ema=jnp.broadcast_to(rate * policy.prior_weight, row.accepted_ema.shape),
                       tried_ema=jnp.full_like(row.tried_ema, policy.prior_weight))


def drafter_at_depth(drafter: Any, depth: int, max_depth: int) -> Any:
    """The drafter drafting `depth` tokens per step inside a loop whose steps draft up to
    `max_depth`: its own `at_depth` when it has one (the draft model re-feeds max_depth + 1
    tokens whatever its depth), else the drafter with K = depth. Depth 0: `PlainStep`."""
    top = drafter.at_depth(max_depth, max_depth) if hasattr(drafter, "at_depth") else dataclasses.replace(
        drafter, k=max_depth)
    if depth == 0:
        return PlainStep(top)
    tree = getattr(top, "tree", 0)
    if depth < max_depth and tree_budget(tree):  # the shallower tree first: K = depth must fit it
        top = dataclasses.replace(top, tree=tree_at_depth(tree, depth, max_depth))
    return top.at_depth(depth, max_depth) if hasattr(top, "at_depth") else dataclasses.replace(top, k=depth)


def tree_at_depth(tree: Any, depth: int, max_depth: int) -> Any:
    """A tree drafter's setting for a step at `depth` of a loop whose deepest steps draft `tree`:
    a node budget scaled by depth / max_depth (rounded up), a static tree's paths no longer than
    `depth`, so a shallower step's verify is narrower too."""
    if isinstance(tree, (tuple, list)):
        return tuple(tuple(path) for path in tree if len(path) <= depth)
    return -(-int(tree) * depth // max_depth)


@dataclasses.dataclass(frozen=True)
class PlainStep:
    """The K = 0 choice: no drafts, so the loop's step verifies the last token alone (a plain
    step); the drafter's state is kept current or left to catch up (the module docstring)."""

    drafter: Any
    k: int = 0
    tree: int = 0

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.drafter.capture_layers

    def propose(self, params, target, state, tokens, lengths, key, sampling):
        keep_current = getattr(self.drafter, "keep_current", None)
        if keep_current is not None:
            state = keep_current(params, target, state, tokens, lengths)
        return jnp.zeros((tokens.shape[0], 0), jnp.int32), None, state

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return self.drafter.commit(params, target, state, start, num_accepted, verify_captured)
