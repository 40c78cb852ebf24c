"""The engine's scheduling, on the host and without a model: the queue of waiting requests, the
cancellations asked for since the last chunk, which waiting requests take which free slots, and
(`AdaptiveK`) which K the next chunk runs at.

`submit` and `cancel` may be called from any thread; the rest runs on the engine's thread.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Sequence

from spec_jax.decoding import validation
from spec_jax.decoding.slots import RequestParams


class Scheduler:
    """Waiting requests in arrival order, and cancellations.

    max_admits_per_step: prefills between two chunks (None: fill every free slot; a bound caps
    the pause running streams see while new requests are admitted, at the cost of their time to
    first token)."""

    def __init__(self, max_admits_per_step: int | None = None):
        self.max_admits_per_step = max_admits_per_step
        self.waiting: collections.deque[tuple[int, RequestParams, float]] = collections.deque()
        self._cancelled: set[int] = set()
        self._issued = 0  # request ids are 0 .. _issued - 1
        self._lock = threading.Lock()

    def submit(self, params: RequestParams, submitted_at: float) -> int:
        """Queue a request -> its id."""
        with self._lock:
            rid, self._issued = self._issued, self._issued + 1
            self.waiting.append((rid, params, submitted_at))
        return rid

    def cancel(self, request_id: int) -> None:
        """Cancel a request by the id `submit` gave; a finished request's id is a no-op (it may
        finish while the caller decides), an id never given is an ArgumentError."""
        rid = validation.check_int("request_id", request_id, minimum=0)
        with self._lock:
            if rid >= self._issued:
                raise validation.ArgumentError(
                    "request_id", f"request_id {rid} was never submitted (ids so far: 0 .. {self._issued - 1}); "
                    "cancel takes the id one submit() returned.")
            self._cancelled.add(rid)

    def has_work(self, running: bool) -> bool:
        with self._lock:
            return bool(self.waiting or running or self._cancelled)

    def take_cancelled(self) -> tuple[set[int], list[tuple[int, RequestParams]]]:
        """The cancellations asked for since the last call -> (their ids, the waiting requests
        among them, now dropped from the queue)."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [(rid, params) for rid, params, _ in self.waiting if rid in cancelled]
            self.waiting = collections.deque(w for w in self.waiting if w[0] not in cancelled)
        return cancelled, dropped

    def admissions(self, free_slots: Sequence[int]) -> list[tuple[int, int, RequestParams, float]]:
        """Waiting requests into free slots, first come first served, at most
        max_admits_per_step -> [(slot, request id, params, submitted_at)], taken off the queue."""
        admitted = []
        for slot in free_slots:
            if self.max_admits_per_step is not None and len(admitted) >= self.max_admits_per_step:
                break
            with self._lock:
                if not self.waiting:
                    break
                admitted.append((slot, *self.waiting.popleft()))
        return admitted


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
