"""The engine's page pool, on the host: which KV pages each row holds (its page table) and which
are free. Nothing here touches a device: the engine sends the table with every program that
reads or writes the cache (`spec_jax.models.paged` for the device side).

A request is admitted when the pool can cover its worst case (prompt + max_new_tokens + one
chunk's overshoot, `Engine.worst_tokens`) beside what the running requests may still grow into, so a
running request can always grow and none is ever preempted; pages themselves are handed out as a
request grows (before each chunk, for the slots that chunk can write) and taken back when it
finishes or is cancelled. A request that does not fit waits in the queue (first come, first
served: it is not overtaken). A row's table entries for pages it does not hold are the
unallocated page, which the device never writes, so a row cannot touch another row's pages.

Prefix caching (`prefix_caching=True`): a page a prompt filled whole is registered under the
hash of every token up to its end (a chain of page hashes, as vLLM's), and a later request
whose prompt starts with the same pages shares them, read-only and reference-counted, instead of
prefilling them again. Only whole pages are shared, and always fewer than the prompt's tokens (its
last token is prefilled, for the first token's logits), so the first page where two prompts
differ (or where one ends) is the new request's own from the start: the copy-on-write of a
shared page never has to copy, because a row writes only at and after its own committed length,
which lies past every page it shares. A freed page keeps its hash while it waits in the free
list, so a later prompt can still take it back; handing it out for something else drops it.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


class PagePool:
    """num_pages pages of page_size slots, shared by `slots` rows of `pages_per_row` pages.

    `table` [slots, pages_per_row] int32 is what the device reads (num_pages = unallocated);
    `handed_out[p]` counts how often page p was handed out (a page freed and handed out again
    counts twice)."""

    def __init__(self, num_pages: int, page_size: int, slots: int, pages_per_row: int, prefix_caching: bool = False):
        self.num_pages, self.page_size, self.pages_per_row = num_pages, page_size, pages_per_row
        self.prefix_caching = prefix_caching
        self.refs = np.zeros((num_pages,), np.int64)  # rows holding each page
        self.page_hash: dict[int, bytes] = {}  # page -> the hash of the prompt up to its end
        self.by_hash: dict[bytes, int] = {}  # and back
        self.shared_hits = 0  # pages a request took from the cache instead of prefilling them
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

    def _digests(self, prompt: Sequence[int], pages: int) -> list[bytes]:
        """The hash of `prompt` up to the end of each of its first `pages` pages (each page's
        hash covers the one before it, so equal hashes mean equal prefixes)."""
        out, digest = [], b""
        for i in range(pages):
            tokens = np.asarray(prompt[i * self.page_size : (i + 1) * self.page_size], np.int64)
            digest = hashlib.blake2b(digest + tokens.tobytes(), digest_size=16).digest()
            out.append(digest)
        return out

    def prefix_pages(self, prompt: tuple[int, ...]) -> list[int]:
        """The cached pages holding the longest whole-page prefix of `prompt` (fewer pages than
        its tokens fill: its last token is always prefilled); [] without prefix caching."""
        if not self.prefix_caching:
            return []
        pages = []
        for digest in self._digests(prompt, (len(prompt) - 1) // self.page_size):
            page = self.by_hash.get(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def reserve(self, slot: int, worst_tokens: int, shared: Sequence[int] = ()) -> bool:
        """Admit a request into `slot` if the pool covers its worst case beside what the running
        rows are owed -> whether it did (then its pages are set aside, not handed out). shared:
        cached pages it starts with (`prefix_pages`): taken now, one free page each for those
        no row holds."""
        revived = sum(int(self.refs[p] == 0) for p in shared)
        need = self.pages_for(worst_tokens) - len(shared) + revived
        if need > self.free - self.owed():
            return False
        for i, page in enumerate(shared):
            if self.refs[page] == 0:
                self._free.remove(page)
            self.refs[page] += 1
            self.table[slot, i] = page
        self.held[slot] = len(shared)
        self.shared_hits += len(shared)
        self.reserved[slot] = self.pages_for(worst_tokens)
        return True

    def register(self, slot: int, prompt: tuple[int, ...]) -> None:
        """Row `slot`'s whole prompt pages (now prefilled) under their prefix hashes, for later
        prompts to share (a hash already registered keeps its page)."""
        if not self.prefix_caching:
            return
        for i, digest in enumerate(self._digests(prompt, len(prompt) // self.page_size)):
            page = int(self.table[slot, i])
            if digest not in self.by_hash and page not in self.page_hash:
                self.by_hash[digest], self.page_hash[page] = page, digest

    def grow(self, slot: int, tokens: int) -> None:
        """Hand row `slot` the pages that hold its first `tokens` slots (up to its reservation)."""
        want = min(self.pages_for(tokens), int(self.reserved[slot]))
        while self.held[slot] < want:
            page = self._free.popleft()  # never empty: reserve() kept the row's pages free
            if page in self.page_hash:  # its cached prefix is overwritten from now on
                del self.by_hash[self.page_hash.pop(page)]
            self.refs[page] = 1
            self.table[slot, self.held[slot]] = page
            self.held[slot] += 1
            self.handed_out[page] += 1

    def release(self, slot: int) -> None:
        """Row `slot`'s pages back to the pool; its table back to unallocated."""
        for page in self.table[slot, : self.held[slot]].tolist():
            self.refs[page] -= 1
            if self.refs[page] == 0:  # the last row holding it (a shared page may have others)
                self._free.append(page)
        self.table[slot] = self.num_pages
        self.held[slot] = self.reserved[slot] = 0
