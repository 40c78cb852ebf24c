"""The engine's host-side slot table: which request runs in which row of the batch, each row's
request values (sent with every chunk as traced per-row arrays), and each request's counters.

Nothing here touches a device: the engine hands `SlotTable.collect` the host copy of what a chunk
wrote (`decoding.emitted`) and its counters, and gets back each request's new tokens and finish
reason.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import numpy as np

from spec_jax.decoding.emitted import EmittedWindow
from spec_jax.decoding.loop import FINISH_NAMES, FINISH_NONE, MAX_STOP_IDS
from spec_jax.decoding.validation import RequestValues


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's checked values. seed and choice make the row's PRNG key
    (`engine_programs.request_key`): choice i of a request of n samples independently of the others."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0  # None: `Engine.submit` gives it a fresh one
    stop_ids: tuple[int, ...] = ()
    choice: int = 0
    logprobs: int | None = None  # None: none; N: each token's log-probability and the N most likely

    @classmethod
    def of(cls, prompt_ids: Any, values: RequestValues, **extra: Any) -> RequestParams:
        return cls(tuple(prompt_ids), **dataclasses.asdict(values), **extra)


class Counters(NamedTuple):
    """Verify-step counters: steps, drafts proposed and accepted, tokens committed by verify
    steps, and steps that accepted all K drafts (what the acceptance estimate needs). Each field
    is an int for one request, or a [slots] array for a chunk's read of every row."""

    steps: Any
    drafted: Any
    accepted: Any
    emitted: Any
    full_steps: Any

    @classmethod
    def zero(cls) -> Counters:
        return cls(0, 0, 0, 0, 0)

    @classmethod
    def of_rows(cls, stats: Any, k: int) -> Counters:
        """Per-row counters from the loop's host-side `Stats` run at K drafts per step."""
        full = stats.histogram[:, -1] if k > 0 else np.zeros_like(stats.steps)
        return cls(*(np.asarray(x, np.int64) for x in (stats.steps, stats.drafted, stats.accepted, stats.emitted, full)))

    def row(self, slot: int) -> Counters:
        return Counters(*(int(x[slot]) for x in self))

    def minus(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self, other)))

    def plus(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(self, other)))


class PositionTotals:
    """The engine's totals per draft position i (0-based), for /metrics: `drafted[i]`, verify
    steps that drafted a token at position i; `accepted[i]`, those whose draft there was accepted.
    A row's device counters restart from zero at its admit and at a K switch (`restart`)."""

    def __init__(self) -> None:
        self.drafted: collections.Counter[int] = collections.Counter()
        self.accepted: collections.Counter[int] = collections.Counter()
        self._seen: tuple[np.ndarray, np.ndarray] | None = None  # (steps [slots], accepted [slots, K])

    def restart(self, slot: int | None = None) -> None:
        """Row `slot`'s device counters restarted (None: every row's, new Stats for another K)."""
        if slot is None or self._seen is None:
            self._seen = None
        else:
            self._seen[0][slot], self._seen[1][slot] = 0, 0

    def add(self, steps: np.ndarray, position_accepted: np.ndarray) -> None:
        """A chunk's host read of every row's Stats.steps [slots] and position_accepted [slots, K]."""
        steps, position_accepted = np.asarray(steps, np.int64), np.asarray(position_accepted, np.int64)
        seen_steps, seen_accepted = self._seen or (np.zeros_like(steps), np.zeros_like(position_accepted))
        new_steps = int((steps - seen_steps).sum())
        for i, count in enumerate((position_accepted - seen_accepted).sum(axis=0)):
            self.drafted[i] += new_steps
            self.accepted[i] += int(count)
        self._seen = (steps, position_accepted)


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

    def add(self, delta: Counters) -> None:
        self.steps += delta.steps
        self.drafted += delta.drafted
        self.accepted += delta.accepted
        self.emitted += delta.emitted

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), tau=self.tau)


class TokenLogprob(NamedTuple):
    """A token the target committed, its log-probability (see `decoding.logprobs`), and the
    request's `logprobs` most likely tokens there as (id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class EngineEvent:
    """What `Engine.step` hands out for one request: its new tokens since the last event (with
    their log-probabilities when the request asked for them), and on the last event its finish
    reason ("stop", "length" or "cancelled") and stats."""

    request_id: int
    new_ids: list[int]
    finish_reason: str | None = None
    stats: RequestStats | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Running:
    """A request in a slot."""

    rid: int
    params: RequestParams
    stats: RequestStats
    emitted_to: int  # tokens[slot, :emitted_to] are handed out (prompt included)
    submitted_at: float
    seen: Counters = Counters.zero()  # the slot's device counters when last read
    first_token_at: float | None = None


class SlotTable:
    """Which request holds which slot, and the per-slot request values the chunk reads.

    A free slot is not `live` and holds neutral sampling values: a free row must not steer
    batch-wide choices (greedy or sampled warp)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.temperature = np.zeros((slots,), np.float32)
        self.top_k = np.zeros((slots,), np.int32)
        self.top_p = np.ones((slots,), np.float32)
        self.max_new = np.ones((slots,), np.int32)
        self.stop = np.full((slots, 1, MAX_STOP_IDS), -1, np.int32)  # [slots, 1, MAX_STOP_IDS]
        self.live = np.zeros((slots,), bool)
        self.wants_logprobs = np.zeros((slots,), bool)
        self.running: dict[int, Running] = {}  # by slot
        self.slot_of: dict[int, int] = {}  # request id -> slot
        self.version = 0  # bumped by every change to the per-row values above (the chunk's placed copy follows it)

    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.slots) if slot not in self.running]

    def occupy(self, slot: int, rid: int, params: RequestParams, stop_row: np.ndarray, submitted_at: float) -> None:
        """`stop_row`: the request's stop ids as the loop's padded [MAX_STOP_IDS] array."""
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = params.temperature, params.top_k, params.top_p
        self.max_new[slot] = params.max_new_tokens
        self.stop[slot, 0] = stop_row
        self.live[slot] = True
        self.wants_logprobs[slot] = params.logprobs is not None
        prompt_tokens = len(params.prompt_ids)
        self.running[slot] = Running(rid, params, RequestStats(prompt_tokens), prompt_tokens, submitted_at)
        self.slot_of[rid] = slot
        self.version += 1

    def release(self, slot: int) -> Running:
        running = self.running.pop(slot)
        self.slot_of.pop(running.rid, None)
        self.live[slot] = False
        self.wants_logprobs[slot] = False
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = 0.0, 0, 1.0
        self.version += 1
        return running

    def hand_out_first(self, slot: int, window: EmittedWindow, now: float) -> EngineEvent:
        """The token an admitted slot's prefill sampled, handed out before the chunk runs (time
        to first token is the prefill's time, not prefill + a chunk). window: the host read of
        the state's buffers (its logprobs read when some request wants them)."""
        running = self.running[slot]
        event = EngineEvent(running.rid, window.token_ids(slot, running.emitted_to, running.emitted_to + 1),
                            logprobs=self._logprobs(slot, running, window, running.emitted_to + 1))
        running.emitted_to += 1
        running.stats.completion_tokens += 1
        running.first_token_at = now
        return event

    def wanting_logprobs(self, slots: Any) -> bool:
        return any(self.wants_logprobs[slot] for slot in slots)

    @staticmethod
    def _logprobs(slot: int, running: Running, window: EmittedWindow, end: int) -> list[TokenLogprob] | None:
        """Slot's tokens emitted_to .. end - 1 with their log-probabilities (None: not asked)."""
        top, logprobs = running.params.logprobs, window.logprobs
        if top is None or logprobs is None:
            return None
        columns = window.columns(slot, running.emitted_to, end)
        return [TokenLogprob(int(window.tokens[slot, c]), float(logprobs.chosen[slot, c]),
                             [(int(i), float(v)) for i, v in zip(logprobs.top_ids[slot, c, :top],
                                                                 logprobs.top_values[slot, c, :top])])
                for c in range(columns.start, columns.stop)]

    def collect(self, window: EmittedWindow, lengths: np.ndarray, finish: np.ndarray, done: np.ndarray,
                counters: Counters, now: float) -> tuple[list[EngineEvent], Counters]:
        """A chunk's host read (the window of the buffers it wrote, its logprobs read when a
        request wants them; lengths / finish / done [slots]; per-row counters) -> each running
        request's event, and the counters all rows added. A finished request frees its slot."""
        events, total = [], Counters.zero()
        for slot in list(self.running):
            running = self.running[slot]
            new = window.token_ids(slot, running.emitted_to, int(lengths[slot]))
            new_logprobs = self._logprobs(slot, running, window, int(lengths[slot]))
            running.emitted_to = int(lengths[slot])
            current = counters.row(slot)
            delta, running.seen = current.minus(running.seen), current
            total = total.plus(delta)
            running.stats.add(delta)
            running.stats.completion_tokens += len(new)
            if new and running.first_token_at is None:
                running.first_token_at = now
            reason = None
            if done[slot]:
                reason = FINISH_NAMES[int(finish[slot])] if int(finish[slot]) != FINISH_NONE else "length"
            if new or reason:
                events.append(EngineEvent(running.rid, new, reason, running.stats if reason else None, new_logprobs))
            if reason:
                self.release(slot)
        return events, total
