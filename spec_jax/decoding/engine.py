"""A continuous-batching engine on the chunked loop.

The engine holds one `LoopState` of `slots` rows at a fixed cache capacity. Each `step()`:
  1. frees the slots of cancelled requests and prefills waiting requests into free slots: a 1-row
     `prefill` at the prompt's bucket, scattered into the slot's row of every state leaf (tokens,
     target cache, drafter state, stats) by one jitted, donated update;
  2. runs one chunk of up to `chunk_steps` speculative steps over all rows (free rows are `done`
     and write nothing);
  3. reads each row's new tokens and hands them out as `EngineEvent`s; a finished row frees its slot.
Every request brings its own sampling values, max tokens, stop ids and seed (per-row traced
arrays), so requests come and go without recompiling: the programs are one chunk per K variant
and one admit per prompt bucket (`warmup()` compiles them all up front; `compiles` counts them).

Rows are independent in the loop, so a request's greedy output is the same whether it runs alone
or beside others. Sampled requests are exact in distribution; the request's seed draws its first
token, and the later draws come from the engine's own key (one key for the batch, as in the loop).

Adaptive K (`k_choices`): the same drafter compiled at several K (0 = plain decoding when the
drafter keeps no state of its own); before each chunk `AdaptiveK` picks the K with the most
expected tokens per second from an EMA of the acceptance rate and the measured step time at the
current number of live rows.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding import validation
from spec_jax.decoding.chunked import NO_STEP_CAP, run_chunk
from spec_jax.decoding.generate import prompt_bucket, stop_id_array, with_k
from spec_jax.decoding.loop import FINISH_NAMES, FINISH_NONE, MAX_STOP_IDS, LoopState, Stats, prefill, tree_budget
from spec_jax.decoding.programs import ProgramCache, signature
from spec_jax.drafters.base import Drafter
from spec_jax.models.interface import Target
from spec_jax.models.resolve import resolve_target
from spec_jax.sampling import SamplingParams
from spec_jax.sharding.placement import gather_to_host

NO_BATCH_AXIS = -1
# Programs by full configuration, shared between engines (newest last, bounded).
_SHARED_PROGRAMS = ProgramCache(max_size=64)
DEFAULT_MAX_MODEL_LEN = 1024
CAPACITY_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's checked values."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class RequestStats:
    """A request's counters: verify steps, drafts proposed and accepted, tokens committed by
    verify steps; tau = committed tokens per step (the correction/bonus token included)."""

    prompt_tokens: int
    completion_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def tau(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), tau=self.tau)


@dataclasses.dataclass
class EngineEvent:
    """What `Engine.step` hands out for one request: its new tokens since the last event, and on
    the last event its finish reason ("stop", "length" or "cancelled") and stats."""

    request_id: int
    new_ids: list[int]
    finish_reason: str | None = None
    stats: RequestStats | None = None


@dataclasses.dataclass
class _Running:
    rid: int
    params: RequestParams
    stats: RequestStats
    emitted_to: int  # tokens[slot, :emitted_to] are handed out (prompt included)
    submitted_at: float
    # The slot's device counters when last read: steps, drafted, accepted, emitted, and steps
    # that accepted all K drafts (for the acceptance estimate).
    seen: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(5, np.int64))
    first_token_at: float | None = None


def _batch_axes(abstract_one: Any, abstract_two: Any) -> Any:
    """Per leaf, the axis whose size is the batch (found by comparing the state's shapes at batch
    1 and 2), or NO_BATCH_AXIS for leaves shared by all rows (the PRNG key, the step counter)."""

    def axis(one: Any, two: Any) -> int:
        for i, (a, b) in enumerate(zip(one.shape, two.shape)):
            if a != b:
                return i
        return NO_BATCH_AXIS

    return jax.tree_util.tree_map(axis, abstract_one, abstract_two)


def _zeros_like_abstract(abstract: Any) -> Any:
    def zeros(x: Any) -> Any:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(0)
        return jnp.zeros(x.shape, x.dtype)

    return jax.tree_util.tree_map(zeros, abstract)


class AdaptiveK:
    """Chooses K between chunks: the K with the most expected tokens per second.

    Expected tokens per verify step with K drafts at per-draft acceptance a (geometric):
    (1 - a^(K+1)) / (1 - a). a is an EMA of the acceptance rate measured under speculation (its
    maximum-likelihood value accepted / (accepted + steps that rejected)). The step time of each K
    is an EMA measured per number of live rows (rounded up to a power of two); a K not yet timed
    at that many rows is tried once. Plain decoding (K = 0) teaches nothing about acceptance, so
    every `probe_every` chunks the best speculative K is tried again.
    """

    def __init__(self, choices: Sequence[int], ema: float = 0.3, probe_every: int = 16,
                 prior_acceptance: float = 0.5):
        self.choices = tuple(sorted(set(int(k) for k in choices)))
        self.ema = ema
        self.probe_every = probe_every
        self.acceptance = prior_acceptance
        self.step_s: dict[tuple[int, int], float] = {}
        self.chunks_since_speculation = 0

    @staticmethod
    def rows_bucket(live: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(live, 1))))

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def choose(self, live: int) -> int:
        bucket = self.rows_bucket(live)
        for k in self.choices:
            if (k, bucket) not in self.step_s:
                return k
        speculative = [k for k in self.choices if k > 0]

        def rate(k: int) -> float:
            return self.expected_tokens(k) / self.step_s[(k, bucket)]

        best = max(self.choices, key=rate)
        if best == 0 and speculative and self.chunks_since_speculation >= self.probe_every:
            best = max(speculative, key=rate)
        return best

    def update(self, k: int, live: int, steps: int, seconds: float, accepted: int, rejecting_steps: int) -> None:
        if steps <= 0:
            return
        key = (k, self.rows_bucket(live))
        per_step = seconds / steps
        old = self.step_s.get(key)
        self.step_s[key] = per_step if old is None else (1 - self.ema) * old + self.ema * per_step
        if k > 0:
            self.chunks_since_speculation = 0
            if accepted + rejecting_steps > 0:
                measured = accepted / (accepted + rejecting_steps)
                self.acceptance = (1 - self.ema) * self.acceptance + self.ema * measured
        else:
            self.chunks_since_speculation += 1


class Engine:
    """Continuous batching over `slots` rows; see the module docstring.

        engine = Engine(target, drafter, drafter_params, slots=8, max_model_len=1024)
        rid = engine.submit(prompt_ids, max_new_tokens=64)
        while engine.has_work():
            for event in engine.step():
                ...  # event.request_id, event.new_ids, event.finish_reason

    target: as `generate` takes it. drafter: None for plain decoding, else any Drafter (its K, or
    `k_choices` for adaptive K). max_model_len: the most prompt + new tokens one request may use
    (default min(1024, the model's positions)). max_admits_per_step: prefills between two chunks
    (default: fill every free slot; a bound caps the pause running streams see while new
    requests are admitted, at the cost of their time to first token). mesh / sharding_rules: as
    `generate`'s; the state's rows are split over `data`. `submit` and `cancel` may be called from other threads.
    """

    def __init__(
        self,
        target: Any,
        drafter: Drafter | None = None,
        drafter_params: Any = None,
        *,
        slots: int = 8,
        max_model_len: int | None = None,
        chunk_steps: int = 4,
        k_choices: Sequence[int] | None = None,
        max_admits_per_step: int | None = None,
        mesh: Any = None,
        sharding_rules: Any = None,
        seed: int = 0,
    ):
        resolved, own_stop = resolve_target(target)
        self.model = resolved.model
        self.default_stop_ids = tuple(own_stop if own_stop is not None else self.model.stop_ids)
        self.slots = validation.check_int("slots", slots, minimum=1)
        self.chunk_steps = validation.check_int("chunk_steps", chunk_steps, minimum=1)
        self.max_admits_per_step = None if max_admits_per_step is None else validation.check_int(
            "max_admits_per_step", max_admits_per_step, minimum=1)
        validation.check_mesh(mesh)
        validation.check_drafter_params(drafter, drafter_params)
        self.mesh = mesh
        # K variants: the drafter at each K of k_choices (0 = no drafter), else its own K.
        if k_choices is None:
            ks = [drafter.k if drafter is not None else 0]
        else:
            ks = sorted(set(validation.check_int("k_choices entry", k, minimum=0) for k in k_choices))
            if not ks:
                raise ValueError("k_choices is empty: give the K values to choose from, e.g. (0, 2, 4).")
            if drafter is None and ks != [0]:
                raise ValueError(f"k_choices {ks} need a drafter; without one the engine decodes plainly.")
        self.drafters: dict[int, Drafter | None] = {k: with_k(drafter, k) if k else None for k in ks}
        k_max = max(ks)
        # Slots one verify pass writes past the last committed token: K, or N for a tree drafter.
        pass_max = max(k_max, tree_budget(drafter))
        max_positions = int(self.model.max_positions)
        if max_model_len is None:
            max_model_len = min(DEFAULT_MAX_MODEL_LEN, max_positions - pass_max - 1)
        self.max_model_len = validation.check_int("max_model_len", max_model_len, minimum=2)
        if self.max_model_len + pass_max + 1 > max_positions:
            raise ValueError(
                f"max_model_len {self.max_model_len} + K={pass_max} + 1 exceeds the model's "
                f"{max_positions} positions; lower max_model_len to {max_positions - pass_max - 1} or less."
            )
        self.capacity = min(-(-(self.max_model_len + pass_max + 1) // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE,
                            max_positions)
        for d in self.drafters.values():
            if d is not None:
                d.validate(self.model, self.capacity)
        self.target_params, self.drafter_params = resolved.params, drafter_params
        self.adaptive = AdaptiveK(ks) if len(ks) > 1 else None
        self.k = ks[-1] if self.adaptive is None else None  # the fixed K, or None when adaptive

        # The state's layout at batch 1 and 2 gives each leaf's batch axis; K changes only Stats.
        any_drafter = self.drafters[k_max]
        abstract_one = self._abstract_prefill(1, any_drafter)
        self.batch_axes = _batch_axes(abstract_one, self._abstract_prefill(2, any_drafter))
        abstract = self._abstract_prefill(self.slots, any_drafter)
        self.stateless_drafter = not jax.tree_util.tree_leaves(abstract.drafter_state)
        if 0 in ks and drafter is not None and not self.stateless_drafter:
            raise ValueError(
                "k_choices includes 0 (plain decoding), but this drafter keeps state that plain "
                "steps would not update (a draft model's cache, DFlash's context); use K >= 1 "
                "choices with it, or 0 only with ngram."
            )
        for k, d in self.drafters.items():  # K variants share the one state (only Stats differ)
            if d is not None and k != k_max and str(self._abstract_prefill(1, d).drafter_state) != str(
                abstract_one.drafter_state
            ):
                raise ValueError(
                    f"k_choices: this drafter's state has a different layout at K={k} than at "
                    f"K={k_max}, so the engine cannot switch between them; give one K."
                )
        state = _zeros_like_abstract(abstract)
        # Free rows: done, one committed token whose cache holds nothing (lengths - 1 = 0).
        state = state.replace(
            done=jnp.ones((self.slots,), bool),
            lengths=jnp.ones((self.slots,), jnp.int32),
            key=jax.random.key(validation.check_int("seed", seed, minimum=0, maximum=validation.SEED_MAX)),
        )
        self.state_shardings = None
        if mesh is not None:
            from spec_jax.decoding.placement import place_generate_inputs
            from spec_jax.sharding.rules import DEFAULT_RULES, place, state_shardings

            self.state_shardings = state_shardings(abstract, mesh, sharding_rules or DEFAULT_RULES)
            state = jax.tree_util.tree_map(place, state, self.state_shardings)
            self._rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            # Weights placed once, as `generate` places them.
            from spec_jax.decoding.loop import LoopInputs

            placed = place_generate_inputs(
                LoopInputs(self.target_params, self.drafter_params, np.zeros((self.slots, 1), np.int32),
                           np.ones((self.slots,), np.int32), jax.random.key(0), SamplingParams.create(),
                           np.int32(1), stop_id_array(())),
                self.model, any_drafter, mesh, sharding_rules,
            )
            self.target_params, self.drafter_params = placed.target_params, placed.drafter_params
        self.state: LoopState = state
        self.current_k = ks[-1]  # adaptive K starts at the largest and learns from there
        self._stats_k = any_drafter.k if any_drafter is not None else 0

        # Per-slot request values (host copies; sent with each chunk).
        self.temperature = np.zeros((self.slots,), np.float32)
        self.top_k = np.zeros((self.slots,), np.int32)
        self.top_p = np.ones((self.slots,), np.float32)
        self.max_new = np.ones((self.slots,), np.int32)
        self.stop = np.full((self.slots, 1, MAX_STOP_IDS), -1, np.int32)
        self.live = np.zeros((self.slots,), bool)

        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.waiting: collections.deque[tuple[int, RequestParams, float]] = collections.deque()
        self._cancel: set[int] = set()
        self.running: dict[int, _Running] = {}  # by slot
        self.slot_of: dict[int, int] = {}  # request id -> slot
        self._exes: dict[Any, Any] = {}
        self.compiles = 0  # programs this engine compiled (chunks per K, admits per bucket; not shared ones)
        self.compile_s = 0.0
        self.chunks_run = 0
        self.first_token_early = True  # hand out prefill's token before the chunk (one more sync)
        self._host_step = 0
        self.k_history: list[int] = []

    # ------------------------------------------------------------------ programs
    def _abstract_prefill(self, batch: int, drafter: Drafter | None) -> LoopState:
        def fn(params, drafter_params):
            return prefill(
                Target(params, self.model), drafter, drafter_params,
                jnp.zeros((batch, 16), jnp.int32), jnp.ones((batch,), jnp.int32), jax.random.key(0),
                SamplingParams.create(), jnp.int32(1), jnp.asarray(stop_id_array(())), self.capacity,
            )

        return jax.eval_shape(fn, self.target_params, self.drafter_params)

    def _place(self, x: Any) -> Any:
        if self.mesh is None:
            return jnp.asarray(x)
        from spec_jax.sharding.rules import place

        return place(x, self._rep)

    def _compile(self, key: Any, fn: Any, args: tuple) -> Any:
        """The program for `key` (("chunk", K) or ("admit", bucket, stats K)): this engine's, else
        one an engine of the same configuration compiled (shared: a process that builds several
        engines compiles each program once), else compiled now."""
        exe = self._exes.get(key)
        if exe is None:
            config = (key, self.model, self.drafters[key[1]] if key[0] == "chunk" else self.drafters[max(self.drafters)],
                      self.capacity, self.slots, self.mesh, str(self.state_shardings),
                      signature(args, self.mesh))
            kw = {} if self.state_shardings is None else {"out_shardings": self.state_shardings}
            exe, seconds = _SHARED_PROGRAMS.get_or_compile(
                config, lambda: jax.jit(fn, donate_argnums=0, **kw).lower(*args), self.mesh)
            if seconds:  # compiled now, not shared from another engine
                self.compiles += 1
                self.compile_s += seconds
            self._exes[key] = exe
        return exe

    def _stats_for(self, state: LoopState, k: int) -> LoopState:
        """The state with Stats of K's shape (fresh zeros when K changed; the host keeps totals)."""
        if k == self._stats_k:
            return state
        # A copy per leaf: Stats.zeros shares one zeros array between counters, and a donated
        # state may not hold one buffer twice.
        stats = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), Stats.zeros(self.slots, k))
        if self.state_shardings is not None:
            from spec_jax.sharding.rules import state_shardings

            stats = jax.tree_util.tree_map(
                lambda x, s: jax.device_put(x, s), stats, state_shardings(stats, self.mesh)
            )
        for running in self.running.values():
            running.seen[:] = 0
        self._stats_k = k
        return state.replace(stats=stats)

    def _chunk_exe(self, k: int, args: tuple) -> Any:
        model, drafter = self.model, self.drafters[k]

        def chunk(state, live, target_params, drafter_params, sampling, max_new, stop_ids, max_steps):
            state = state.replace(done=state.done | ~live)  # freed rows stop at once
            return run_chunk(state, target_params, drafter_params, sampling, max_new, stop_ids,
                             max_steps, jnp.int32(NO_STEP_CAP), model=model, drafter=drafter)

        return self._compile(("chunk", k), chunk, args)

    def _admit_exe(self, bucket: int, args: tuple) -> Any:
        model, drafter, capacity, axes = self.model, self.drafters[max(self.drafters)], self.capacity, self.batch_axes

        def admit(state, slot, target_params, drafter_params, prompt, prompt_length, key, sampling,
                  max_new, stop_ids):
            row = prefill(Target(target_params, model), drafter, drafter_params, prompt, prompt_length,
                          key, sampling, max_new, stop_ids, capacity)
            row = row.replace(stats=jax.tree_util.tree_map(
                lambda x: jnp.zeros((1,) + x.shape[1:], x.dtype), state.stats))

            def put(axis, full, part):
                if axis == NO_BATCH_AXIS:
                    return full
                return jax.lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), slot, axis)

            stats_axes = jax.tree_util.tree_map(lambda _: 0, state.stats)
            merged = jax.tree_util.tree_map(put, axes.replace(stats=stats_axes), state, row)
            return merged.replace(key=state.key, step=state.step)

        return self._compile(("admit", bucket, self._stats_k), admit, args)

    # ------------------------------------------------------------------ requests
    def check_request(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: Any = 128,
        temperature: Any = 0.0,
        top_k: Any = 0,
        top_p: Any = 1.0,
        seed: Any = 0,
        stop_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> RequestParams:
        """A request's values, checked (ValueError naming the field) before it is queued."""
        checked = validation.check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        (prompt,) = validation.check_prompts([prompt_ids], self.model.vocab_size)
        total = len(prompt) + checked["max_new_tokens"]
        if total > self.max_model_len:
            raise ValueError(
                f"max_new_tokens: the prompt's {len(prompt)} tokens + max_new_tokens="
                f"{checked['max_new_tokens']} = {total} exceeds the engine's max_model_len "
                f"{self.max_model_len}; shorten the prompt or lower max_new_tokens."
            )
        if stop_ids is None:
            stop_ids = () if ignore_eos else self.default_stop_ids
        elif ignore_eos:
            stop_ids = ()
        stop = tuple(validation.check_stop_ids(stop_ids))
        stop_id_array(stop)  # at most MAX_STOP_IDS
        return RequestParams(tuple(prompt), checked["max_new_tokens"], checked["temperature"],
                             checked["top_k"], checked["top_p"], checked["seed"], stop)

    def submit(self, prompt_ids: Sequence[int], **kwargs: Any) -> int:
        """Queue a request (see `check_request` for the keywords) -> its id."""
        params = kwargs.pop("params", None) or self.check_request(prompt_ids, **kwargs)
        with self._lock:
            rid = next(self._ids)
            self.waiting.append((rid, params, time.perf_counter()))
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop a request: a waiting one is dropped, a running one's slot is freed before the next
        chunk. Its last event has finish_reason "cancelled"."""
        with self._lock:
            self._cancel.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.running or self._cancel)

    @property
    def num_live(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ the loop
    def _admit(self, slot: int, rid: int, params: RequestParams, submitted_at: float) -> None:
        prompt = list(params.prompt_ids)
        bucket = min(prompt_bucket(len(prompt)), self.capacity)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : len(prompt)] = prompt
        args = (
            self.state, self._place(np.int32(slot)), self.target_params, self.drafter_params,
            self._place(tokens), self._place(np.asarray([len(prompt)], np.int32)),
            self._place(jax.random.key(params.seed)) if self.mesh is not None else jax.random.key(params.seed),
            jax.tree_util.tree_map(self._place, SamplingParams.create(params.temperature, params.top_k, params.top_p)),
            self._place(np.int32(params.max_new_tokens)), self._place(stop_id_array(params.stop_ids)),
        )
        self.state = self._admit_exe(bucket, args)(*args)
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = params.temperature, params.top_k, params.top_p
        self.max_new[slot] = params.max_new_tokens
        self.stop[slot, 0] = stop_id_array(params.stop_ids)
        self.live[slot] = True
        self.running[slot] = _Running(rid, params, RequestStats(prompt_tokens=len(prompt)), len(prompt),
                                      submitted_at)
        self.slot_of[rid] = slot

    def _free(self, slot: int) -> None:
        running = self.running.pop(slot)
        self.slot_of.pop(running.rid, None)
        self.live[slot] = False
        # A free row's values must not steer batch-wide choices (greedy or sampled warp).
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = 0.0, 0, 1.0

    def _chunk_args(self, k: int) -> tuple:
        sampling = SamplingParams(self.temperature, self.top_k, self.top_p)
        return (
            self.state, self._place(self.live), self.target_params, self.drafter_params,
            jax.tree_util.tree_map(self._place, sampling), self._place(self.max_new),
            self._place(self.stop), self._place(np.int32(self.chunk_steps)),
        )

    def warmup(self, prompt_lengths: Sequence[int] | None = None) -> None:
        """Compile every program requests can need: one chunk per K variant, and one admit per
        prompt bucket (of `prompt_lengths`, default every bucket up to max_model_len)."""
        if prompt_lengths is None:
            prompt_lengths, n = [], 1
            while n < self.max_model_len:
                prompt_lengths.append(n)
                n = max(16, n * 2)
        buckets = sorted({min(prompt_bucket(n), self.capacity) for n in prompt_lengths})
        for k in self.drafters:
            self.state = self._stats_for(self.state, k)
            self._chunk_exe(k, self._chunk_args(k))
            for bucket in buckets:
                row = (np.zeros((1, bucket), np.int32), np.ones((1,), np.int32))
                args = (self.state, self._place(np.int32(0)), self.target_params, self.drafter_params,
                        self._place(row[0]), self._place(row[1]),
                        self._place(jax.random.key(0)) if self.mesh is not None else jax.random.key(0),
                        jax.tree_util.tree_map(self._place, SamplingParams.create()),
                        self._place(np.int32(1)), self._place(stop_id_array(())))
                self._admit_exe(bucket, args)
        self.state = self._stats_for(self.state, self.current_k)

    def step(self) -> list[EngineEvent]:
        """Admit, run one chunk, hand out new tokens; see the module docstring."""
        events: list[EngineEvent] = []
        with self._lock:
            cancelled, self._cancel = self._cancel, set()
            kept = collections.deque()
            for rid, params, t in self.waiting:
                if rid in cancelled:
                    events.append(EngineEvent(rid, [], "cancelled", RequestStats(len(params.prompt_ids))))
                else:
                    kept.append((rid, params, t))
            self.waiting = kept
        for rid in cancelled:
            slot = self.slot_of.get(rid)
            if slot is not None:
                running = self.running[slot]
                events.append(EngineEvent(rid, [], "cancelled", running.stats))
                self._free(slot)
        k = self.current_k
        if self.adaptive is not None:
            live_after_admit = min(self.slots, len(self.running) + len(self.waiting))
            k = self.adaptive.choose(live_after_admit) if live_after_admit else k
        self.state = self._stats_for(self.state, k)
        self.current_k = k
        admitted = []
        for slot in range(self.slots):
            if slot in self.running:
                continue
            if self.max_admits_per_step is not None and len(admitted) >= self.max_admits_per_step:
                break  # bound how long running rows wait on prefills between two chunks
            with self._lock:
                if not self.waiting:
                    break
                rid, params, t = self.waiting.popleft()
            self._admit(slot, rid, params, t)
            admitted.append(slot)
        if not self.running:
            return events
        if admitted and self.first_token_early:
            # Each admitted row's first token (sampled by its prefill) goes out now, not after
            # the chunk: time to first token is the prefill's time, not prefill + a chunk.
            tokens = gather_to_host(self.state.tokens) if self.mesh is not None else np.asarray(self.state.tokens)
            for slot in admitted:
                running = self.running[slot]
                first = int(tokens[slot, running.emitted_to])
                running.emitted_to += 1
                running.stats.completion_tokens += 1
                running.first_token_at = time.perf_counter()
                events.append(EngineEvent(running.rid, [first]))
        # One chunk.
        live = len(self.running)
        args = self._chunk_args(k)
        exe = self._chunk_exe(k, args)
        t0 = time.perf_counter()
        self.state = exe(*args)
        view = (self.state.tokens, self.state.lengths, self.state.finish_reason, self.state.done,
                self.state.step, self.state.stats)
        tokens, lengths, finish, done, step, stats = (
            gather_to_host(view) if self.mesh is not None else jax.device_get(view)
        )
        seconds = time.perf_counter() - t0
        steps_run, self._host_step = int(step) - self._host_step, int(step)
        self.chunks_run += 1
        self.k_history.append(k)
        full = stats.histogram[:, -1] if k > 0 else np.zeros((self.slots,), np.int64)
        counters = np.stack([stats.steps, stats.drafted, stats.accepted, stats.emitted, full], axis=1)
        total = np.zeros(5, np.int64)
        for slot in list(self.running):
            running = self.running[slot]
            new = tokens[slot, running.emitted_to : lengths[slot]].tolist()
            running.emitted_to = int(lengths[slot])
            delta = counters[slot] - running.seen
            running.seen = counters[slot].astype(np.int64)
            total += delta
            st = running.stats
            st.steps += int(delta[0])
            st.drafted += int(delta[1])
            st.accepted += int(delta[2])
            st.emitted += int(delta[3])
            st.completion_tokens += len(new)
            if new and running.first_token_at is None:
                running.first_token_at = time.perf_counter()
            reason = None
            if done[slot]:
                reason = FINISH_NAMES[int(finish[slot])] if int(finish[slot]) != FINISH_NONE else "length"
            if new or reason:
                events.append(EngineEvent(running.rid, new, reason, st if reason else None))
            if reason:
                self._free(slot)
        if self.adaptive is not None:
            rejecting = int(total[0] - total[4])  # steps that rejected a draft
            self.adaptive.update(k, live, steps_run, seconds, int(total[2]), rejecting)
        return events

    def run_all(self) -> dict[int, EngineEvent]:
        """Step until every queued request has finished -> each request's tokens and stats as one
        event per request (a convenience for tests and batch use)."""
        out: dict[int, EngineEvent] = {}
        while self.has_work():
            for e in self.step():
                got = out.setdefault(e.request_id, EngineEvent(e.request_id, []))
                got.new_ids += e.new_ids
                got.finish_reason, got.stats = e.finish_reason, e.stats
        return out
