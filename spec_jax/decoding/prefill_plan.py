"""Chunked and batched prefill, planned on the host: which requests prefill together, and the
shape of each step's prefill pass under the engine's token budget.

A request taken off the queue gets a prefill row (of the engine's `prefill_rows`) and reserves the
slot it will run in. Every engine step then runs one prefill pass [r, W] over the rows in
progress, before its decode chunk: each row's next W tokens of prompt (fewer at its end; the rest
padding), where r is the rows in progress rounded up to a power of two (at most `prefill_rows`)
and W the widest prompt bucket with r * W <= the budget that the longest remainder needs. So
several short prompts prefill in one pass, a long one over several steps, and running streams
never wait for more than one pass of at most `budget` tokens between two chunks. A row whose
prompt is complete is finished (its first token, its drafter's start) and joins the running rows.

Nothing here touches a device.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spec_jax.decoding import validation
from spec_jax.decoding.generate import MIN_PROMPT_BUCKET
from spec_jax.decoding.slots import RequestParams

DEFAULT_PREFILL_ROWS = 4  # prompts that prefill together in one pass (at most; the budget may allow fewer)


@dataclasses.dataclass
class Prefilling:
    """A request whose prompt is being prefilled in row `row`, for slot `slot`; `done` tokens of
    its prompt are in the row's cache."""

    rid: int
    params: RequestParams
    submitted_at: float
    slot: int
    row: int
    done: int = 0

    @property
    def remaining(self) -> int:
        return len(self.params.prompt_ids) - self.done


@dataclasses.dataclass(frozen=True)
class PrefillPass:
    """One pass: rows [r] (distinct; padding rows have valid 0), tokens [r, W], starts [r],
    valid [r] (prompt tokens among each row's W)."""

    rows: np.ndarray
    tokens: np.ndarray
    starts: np.ndarray
    valid: np.ndarray


def row_counts(rows: int) -> list[int]:
    """The pass heights r: powers of two below `rows`, and `rows`."""
    counts = [1]
    while counts[-1] * 2 < rows:
        counts.append(counts[-1] * 2)
    return sorted(set(counts) | {rows})


def widths(budget: int, rows: int) -> list[int]:
    """The pass widths at r rows: the prompt buckets with r * W <= budget."""
    out = [MIN_PROMPT_BUCKET]
    while rows * out[-1] * 2 <= budget:
        out.append(out[-1] * 2)
    return out


class PrefillPlan:
    """The prefill rows in progress, and each step's pass.

    budget: the most tokens (prompt and padding) one pass runs, >= 16 (a prompt bucket); rows:
    prompts that prefill together (at most budget // 16)."""

    def __init__(self, budget: int, rows: int = DEFAULT_PREFILL_ROWS):
        self.budget = validation.check_int("prefill_chunk_tokens", budget, minimum=MIN_PROMPT_BUCKET)
        rows = validation.check_int("prefill_rows", rows, minimum=1)
        self.rows = min(rows, self.budget // MIN_PROMPT_BUCKET)
        self.active: dict[int, Prefilling] = {}  # by row

    def shapes(self) -> list[tuple[int, int]]:
        """Every pass shape (r, W) a step can run (what `Engine.warmup` compiles)."""
        return [(r, w) for r in row_counts(self.rows) for w in widths(self.budget, r)]

    def free_rows(self) -> list[int]:
        return [row for row in range(self.rows) if row not in self.active]

    @property
    def reserved_slots(self) -> set[int]:
        return {p.slot for p in self.active.values()}

    def start(self, rid: int, params: RequestParams, submitted_at: float, slot: int) -> Prefilling:
        row = self.free_rows()[0]
        self.active[row] = Prefilling(rid, params, submitted_at, slot, row)
        return self.active[row]

    def drop(self, rid: int) -> Prefilling | None:
        """Stop prefilling request `rid` (cancelled) -> it, or None when it is not prefilling."""
        for row, p in list(self.active.items()):
            if p.rid == rid:
                return self.active.pop(row)
        return None

    def next_pass(self) -> PrefillPass | None:
        """This step's pass over the rows in progress (None: none is)."""
        if not self.active:
            return None
        height = next(r for r in row_counts(self.rows) if r >= len(self.active))
        longest = max(p.remaining for p in self.active.values())
        choices = widths(self.budget, height)
        width = next((w for w in choices if w >= longest), choices[-1])
        padding = self.free_rows()[: height - len(self.active)]
        rows = sorted(self.active) + padding
        tokens = np.zeros((height, width), np.int32)
        starts = np.zeros((height,), np.int32)
        valid = np.zeros((height,), np.int32)
        for i, row in enumerate(rows):
            p = self.active.get(row)
            if p is None:
                continue  # a padding row: starts at 0 with nothing valid (an empty cache, unused)
            take = min(width, p.remaining)
            tokens[i, :take] = p.params.prompt_ids[p.done : p.done + take]
            starts[i], valid[i] = p.done, take
        return PrefillPass(np.asarray(rows, np.int32), tokens, starts, valid)

    def advance(self, done_pass: PrefillPass) -> list[Prefilling]:
        """Record a pass run -> the requests whose prompt it completed (taken off the rows)."""
        complete = []
        for row, valid in zip(done_pass.rows.tolist(), done_pass.valid.tolist()):
            p = self.active.get(row)
            if p is None:
                continue
            p.done += valid
            if p.remaining == 0:
                complete.append(self.active.pop(row))
        return complete
