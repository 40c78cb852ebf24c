"""Suffix speculation across requests (`--drafter suffix`, `dflash+suffix`, `draft-model+suffix`, ...).

Agents and chat templates repeat whole passages from one request to the next: the same tool call,
the same boilerplate answer, the same JSON skeleton. Prompt lookup (`ngram.py`) only searches the
row's own tokens; the suffix drafter also searches a bounded store of earlier requests' prompts and
outputs, takes the longest match of the row's last tokens (up to `max_match`), and drafts what
followed it: a chain of K tokens, or a tree of the continuations of the best few matches.

Where the store lives. It is a fixed-size device token array, `SuffixParams.suffix_store` [N]
int32, passed to the jitted loop with the drafter's params: earlier documents oldest first, each
followed by SEPARATOR (-1, never a token, so no match and no draft crosses from one document into
the next). The search is the n-gram drafter's vectorised compare, over [store ++ row tokens]
([B, N + S]; `max_match` compares a step), so the loop never goes back to the host: a new store
is a new array of the same shape, which the next chunk reads without a recompile. The host keeps
the ring (`SuffixStore`: the last N tokens written, a document's head cut where the ring wrapped)
and uploads its chronological view (N * 4 bytes) when a request finishes. A host-side suffix
tree handing candidate continuations in per chunk would go stale within the chunk (the row's tail
changes every step), so the lookup stays in the loop.

Who feeds it. The engine (`spec_jax.decoding.engine.Engine`, so `spec-jax serve`) adds each
finished request's prompt + output: one store per server, `store_size` tokens (default
DEFAULT_STORE_TOKENS; `--suffix-store-tokens`). `generate(..., suffix_store=[earlier token lists])`
gives a library user the same without the engine.

Privacy and exactness. Drafts are only proposals: every drafted token is verified by the target,
and only tokens the target itself would emit are returned (token-identical under greedy, the same
distribution when sampling; the drafts are point masses chosen from committed tokens and the
store, never from the drafts themselves). So one request's text in the store can change how fast
another request runs, never what it outputs: a draft reveals nothing, since it is returned only
when the target produces it anyway. (Timing differences remain, as with any shared cache.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.drafters.lookup import LookupFirstDrafter
from spec_jax.drafters.ngram import continuations_trie
from spec_jax.drafters.tree import check_tree_setting, top_k, tree_budget
from spec_jax.models.interface import TargetModel
from spec_jax.models.weights import WeightSpec

SEPARATOR = -1  # between documents in the store; never a token
NO_TOKEN = -2  # the tail's slots before a row's first token: matches nothing, not even SEPARATOR
# 16k tokens: 64 KiB per server; a step compares max_match x [B, 16k + S] (measured cost:
# benchmarks/RESULTS.md, issue 45).
DEFAULT_STORE_TOKENS = 16384


@struct.dataclass
class SuffixParams:
    """The suffix drafters' params. suffix_store [N] int32: earlier documents oldest first, each
    followed by SEPARATOR (SEPARATOR where empty). model: the model drafter's params behind the
    lookup (`KIND+suffix`), None for the suffix drafter alone."""

    suffix_store: jax.Array
    model: Any = None


class SuffixStore:
    """The host side of a store: a ring of the last `size` tokens written, documents separated by
    SEPARATOR. `add` writes a document (its last size - 1 tokens if longer); `array()` is the
    chronological view the drafter reads (oldest first, ending in SEPARATOR)."""

    def __init__(self, size: int, initial: Any = None):
        if size < 2:
            raise ValueError(f"the suffix store needs at least 2 tokens (one and a separator), got {size}.")
        self.size = size
        self.ring = np.full((size,), SEPARATOR, np.int32)
        self.write = 0  # where the next token goes
        if initial is not None:  # a chronological view (`array()`): the next write overwrites the oldest
            initial = np.asarray(initial, np.int32)
            if initial.shape != (size,):
                raise ValueError(f"suffix store of {initial.shape} tokens, expected ({size},).")
            self.ring[:] = initial

    def add(self, tokens: Sequence[int]) -> None:
        document = np.asarray(tokens, np.int32).reshape(-1)[-(self.size - 1):]
        document = np.concatenate([document, [SEPARATOR]]).astype(np.int32)
        at = (self.write + np.arange(len(document))) % self.size
        self.ring[at] = document
        self.write = int((self.write + len(document)) % self.size)

    def extend(self, documents: Sequence[Sequence[int]]) -> SuffixStore:
        for document in documents:
            self.add(document)
        return self

    def array(self) -> np.ndarray:
        return np.concatenate([self.ring[self.write:], self.ring[: self.write]])


def store_spec(size: int) -> WeightSpec:
    return WeightSpec((size,), (None,), init="zeros")  # replicated on a mesh; ints, not weights


def haystack_matches(store: jax.Array, tokens: jax.Array, lengths: jax.Array, max_match: int):
    """Where the row's last tokens recur, in the store and in the row's own committed tokens.

    -> (haystack [B, H] = store ++ tokens (H = N + S), run [B, H]: for each end j, how many of the
    row's last tokens (up to max_match) end at j, 0 where no continuation may be drafted from j:
    the next token is a SEPARATOR, past the store's end, or not yet committed)."""
    batch, size = tokens.shape
    n = store.shape[0]
    hay = jnp.concatenate([jnp.broadcast_to(store.astype(jnp.int32), (batch, n)), tokens.astype(jnp.int32)], 1)
    h = n + size
    rows = jnp.arange(batch)[:, None]
    back = lengths[:, None] - 1 - jnp.arange(max_match)  # [B, M] the tail, newest first
    tail = jnp.where(back >= 0, tokens[rows, jnp.maximum(back, 0)], NO_TOKEN)
    run = jnp.zeros((batch, h), jnp.int32)
    alive = jnp.ones((batch, h), bool)
    for i in range(max_match):  # alive[:, j]: hay[j - i'] == tail[i'] for every i' <= i
        earlier = jnp.pad(hay, ((0, 0), (i, 0)), constant_values=SEPARATOR)[:, :h]  # hay[:, j - i]
        alive &= earlier == tail[:, i : i + 1]
        run += alive
    ends = jnp.arange(h)[None, :]
    following = jnp.pad(hay[:, 1:], ((0, 0), (0, 1)), constant_values=SEPARATOR)
    in_store = (ends + 1 < n) & (following >= 0)
    in_row = (ends >= n) & (ends - n <= lengths[:, None] - 2)  # the continuation is committed
    return hay, jnp.where((ends < n) & in_store | in_row, run, 0)


def continuations(hay: jax.Array, ends: jax.Array, found: jax.Array, n: int, lengths: jax.Array,
                  tokens: jax.Array, k: int) -> jax.Array:
    """The K tokens after each end (ends [B, M], found [B, M]) -> [B, M, K], cut at the first
    SEPARATOR or the end of the committed tokens; the rest (and every draft of a row without a
    match) is the row's last token, cheap to reject."""
    batch, h = hay.shape
    rows = jnp.arange(batch)[:, None, None]
    follow = ends[:, :, None] + 1 + jnp.arange(k)  # [B, M, K]
    limit = jnp.where(ends < n, n - 1, n + lengths[:, None] - 1)  # last index of the end's document
    conts = hay[rows, jnp.minimum(follow, h - 1)]
    valid = jnp.cumprod((follow <= limit[:, :, None]) & (conts >= 0), axis=-1).astype(bool)
    valid &= found[:, :, None]
    last = tokens[jnp.arange(batch), lengths - 1].astype(jnp.int32)
    return jnp.where(valid, conts, last[:, None, None])


@dataclasses.dataclass(frozen=True)
class SuffixDrafter:
    """Matches the row's last tokens (the longest run of up to max_match, at least min_match)
    against the store and the row's own tokens; the longest match wins, then the latest (the row's
    own tokens, then the newest document). Drafts the K tokens that followed it. No weights; its
    params are `SuffixParams` (the store). store_size: the store's tokens (static: the array's
    shape). tree: 0 for a chain; N for a tree of the continuations of ceil(N / K) best matches,
    merged into a trie."""

    k: int = 4
    max_match: int = 8
    min_match: int = 1
    store_size: int = DEFAULT_STORE_TOKENS
    tree: Any = 0

    def __post_init__(self):
        check_tree_setting(self.tree, self.k, static_ok=False, name="The suffix drafter")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def weight_specs(self) -> SuffixParams:
        return SuffixParams(suffix_store=store_spec(self.store_size))

    def validate(self, target: TargetModel, capacity: int) -> None:
        if self.k < 1:
            raise ValueError(f"K must be >= 1 for the suffix drafter, got {self.k}.")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"Need 1 <= min_match <= max_match, got min_match={self.min_match}, "
                             f"max_match={self.max_match}.")
        if self.store_size < 2:
            raise ValueError(f"store_size must be >= 2 tokens, got {self.store_size}.")

    def init(self, params, target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        return ()

    def scored_ends(self, store, tokens, lengths):
        """(haystack [B, H], run [B, H], score [B, H]: run * H + end where run >= min_match, else -1)."""
        hay, run = haystack_matches(store, tokens, lengths, self.max_match)
        h = hay.shape[1]
        return hay, run, jnp.where(run >= self.min_match, run * h + jnp.arange(h)[None, :], -1)

    def lookup(self, store, tokens, lengths):
        """(drafts [B, K] int32, the match length found [B], 0 for none)."""
        hay, run, score = self.scored_ends(store, tokens, lengths)
        best = jnp.argmax(score, axis=1)[:, None]  # [B, 1]
        found = jnp.take_along_axis(score, best, 1) >= 0
        drafts = continuations(hay, best, found, store.shape[0], lengths, tokens, self.k)[:, 0]
        return drafts.astype(jnp.int32), jnp.where(found[:, 0], jnp.take_along_axis(run, best, 1)[:, 0], 0)

    def propose(self, params, target, state, tokens, lengths, key, sampling):
        drafts, _ = self.lookup(params.suffix_store, tokens, lengths)
        return drafts, None, state

    def propose_tree(self, params, target, state, tokens, lengths, key, sampling):
        """The continuations of the ceil(N / K) best ends (longest, then latest), as a trie."""
        budget = tree_budget(self.tree)
        store = params.suffix_store
        hay, _, score = self.scored_ends(store, tokens, lengths)
        top_score, top_end = top_k(score, -(-budget // self.k))  # [B, M]
        conts = continuations(hay, top_end, top_score >= 0, store.shape[0], lengths, tokens, self.k)
        return continuations_trie(conts, budget), state

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return state


@dataclasses.dataclass(frozen=True)
class SuffixFirstDrafter(LookupFirstDrafter):
    """The suffix lookup in front of a model drafter (`KIND+suffix`): as `LookupFirstDrafter`
    (each row takes the lookup's drafts where its last min_match or more tokens recur, else the
    model's), with the store searched too. Params: `SuffixParams(store, model=the model's params)`.
    max_ngram: the longest match measured (it ranks matches; longer ones pick the right passage
    among many in a store)."""

    max_ngram: int = 8
    store_size: int = DEFAULT_STORE_TOKENS

    @property
    def lookup(self) -> SuffixDrafter:
        return SuffixDrafter(k=self.k, max_match=self.max_ngram, min_match=self.min_match,
                             store_size=self.store_size)

    def front(self, params, tokens, lengths):
        return self.lookup.lookup(params.suffix_store, tokens, lengths)

    def model_params(self, params):
        return params.model

    def weight_specs(self) -> SuffixParams:
        return SuffixParams(suffix_store=store_spec(self.store_size), model=self.model.weight_specs())


def reads_store(drafter: Any) -> bool:
    return isinstance(drafter, (SuffixDrafter, SuffixFirstDrafter))


def with_store(drafter: Any, params: Any, documents: Sequence[Sequence[int]] | None = None) -> Any:
    """`params` for a suffix drafter with a store holding `documents` (token lists, oldest first):
    the model drafter's params (or None) become `SuffixParams`; a `SuffixParams` keeps its store
    unless documents are given. Any other drafter's params come back as they are (documents must
    then be None)."""
    if not reads_store(drafter):
        if documents is not None:
            raise ValueError(f"suffix_store is read by the suffix drafters ('suffix', 'KIND+suffix'), not "
                             f"{type(drafter).__name__}; drop suffix_store or use a suffix drafter.")
        return params
    if isinstance(params, SuffixParams):
        if documents is None:
            return params
        params = params.model
    elif isinstance(drafter, SuffixDrafter) and params is not None:
        raise ValueError(f"the suffix drafter's params are SuffixParams (its store) or None, got "
                         f"{type(params).__name__}.")
    store = SuffixStore(drafter.store_size).extend(documents or ())
    return SuffixParams(suffix_store=jnp.asarray(store.array()), model=params)


def store_of_size(drafter: Any, params: Any, size: int) -> tuple[Any, Any]:
    """(the suffix drafter with a store of `size` tokens, its params with an empty store of that
    size): `spec-jax serve --suffix-store-tokens`. ValueError for a drafter that reads no store."""
    if not reads_store(drafter):
        raise ValueError(f"a suffix store size is for the suffix drafters ('suffix', 'KIND+suffix'), not "
                         f"{type(drafter).__name__}; drop --suffix-store-tokens or use a suffix drafter.")
    drafter = dataclasses.replace(drafter, store_size=size)
    return drafter, with_store(drafter, params, [])


def host_store(drafter: Any, params: Any) -> SuffixStore | None:
    """The host ring behind a suffix drafter's params (what the engine adds finished requests
    to), None for other drafters."""
    if not reads_store(drafter):
        return None
    return SuffixStore(drafter.store_size, np.asarray(jax.device_get(params.suffix_store)))
