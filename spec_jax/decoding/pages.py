"""The engine's page pool, on the host: which KV pages each row holds (its page table) and which
are free. Nothing here touches a device: the engine sends the table with every program that
reads or writes the cache (`spec_jax.models.paged` for the device side).

A request is admitted when the pool can cover its worst case (prompt + max_new_tokens + one
chunk's overshoot, `worst_case_pages`) beside what the running requests may still grow into, so a
running request can always grow and none is ever preempted; pages themselves are handed out as a
request grows (before each chunk, for the slots that chunk can write) and taken back when it
finishes or is cancelled. A request that does not fit waits in the queue (first come, first
served: it is not overtaken). A row's table entries for pages it does not hold are the
unallocated page, which the device never writes, so a row cannot touch another row's pages.
"""

from __future__ import annotations

import collections

import numpy as np


class PagePool:
    """num_pages pages of page_size slots, shared by `slots` rows of `pages_per_row` pages.

    `table` [slots, pages_per_row] int32 is what the device reads (num_pages = unallocated);
    `handed_out[p]` counts how often page p was handed out (a page freed and handed out again
    counts twice)."""

    def __init__(self, num_pages: int, page_size: int, slots: int, pages_per_row: int):
        self.num_pages, self.page_size, self.pages_per_row = num_pages, page_size, pages_per_row
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self.table = np.full((slots, pages_per_row), num_pages, np.int32)
        self.held = np.zeros((slots,), np.int64)  # pages row s holds: table[s, :held[s]]
        self.reserved = np.zeros((slots,), np.int64)  # the most pages row s may grow to
        self.handed_out: collections.Counter[int] = collections.Counter()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` slots of a row (at most a whole row)."""
        return min(-(-int(tokens) // self.page_size), self.pages_per_row)

    def owed(self) -> int:
        """Pages the running rows may still take (reserved, not yet held)."""
        return int((self.reserved - self.held).sum())

    def reserve(self, slot: int, worst_tokens: int) -> bool:
        """Admit a request into `slot` if the pool covers its worst case beside what the running
        rows are owed -> whether it did (then the pages are set aside for it, not handed out)."""
        need = self.pages_for(worst_tokens)
        if need > self.free - self.owed():
            return False
        self.reserved[slot] = need
        return True

    def grow(self, slot: int, tokens: int) -> None:
        """Hand row `slot` the pages that hold its first `tokens` slots (up to its reservation)."""
        want = min(self.pages_for(tokens), int(self.reserved[slot]))
        while self.held[slot] < want:
            page = self._free.popleft()  # never empty: reserve() kept the row's pages free
            self.table[slot, self.held[slot]] = page
            self.held[slot] += 1
            self.handed_out[page] += 1

    def release(self, slot: int) -> None:
        """Row `slot`'s pages back to the pool; its table back to unallocated."""
        self._free.extend(int(p) for p in self.table[slot, : self.held[slot]])
        self.table[slot] = self.num_pages
        self.held[slot] = self.reserved[slot] = 0
