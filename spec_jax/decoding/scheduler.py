"""The engine's scheduling, on the host and without a model: the queue of waiting requests, the
cancellations asked for since the last chunk, and which waiting requests take which free slots
(the speculation depth is chosen on device, per step: `spec_jax.decoding.depth`).

`submit` and `cancel` may be called from any thread; the rest runs on the engine's thread.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Sequence

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

    def waiting_params(self) -> list[RequestParams]:
        """The waiting requests' values, in order (a snapshot: other threads may submit meanwhile)."""
        with self._lock:
            return [params for _, params, _ in self.waiting]

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

    def admissions(self, free_slots: Sequence[int], claim: Callable[[int, RequestParams], bool] | None = None,
                   ) -> list[tuple[int, int, RequestParams, float]]:
        """Waiting requests into free slots, first come first served, at most
        max_admits_per_step -> [(slot, request id, params, submitted_at)], taken off the queue.
        claim(slot, params): whether the request at the head of the queue may have that slot (the
        paged engine's page reservation); when it may not, it and everyone behind it wait."""
        admitted = []
        for slot in free_slots:
            if self.max_admits_per_step is not None and len(admitted) >= self.max_admits_per_step:
                break
            with self._lock:
                if not self.waiting or (claim is not None and not claim(slot, self.waiting[0][1])):
                    break
                admitted.append((slot, *self.waiting.popleft()))
        return admitted
