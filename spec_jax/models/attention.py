"""Attention over a KV cache plus a pass's own keys: the one function every pass goes through.

`attend` is grouped-query attention over any number of key/value parts with one joint softmax
(the dense reference). `attend_cache_and_pass` is what a decoder pass needs under the cache
contract of `spec_jax.models.interface`: each query sees the row's committed cache slots
(`slot < cache_lengths[b]`, within the layer's window) and the pass's own keys its in-pass mask
allows. It reads only the live part of the cache (up to the batch's longest committed length), so
a pass costs what the live lengths need whatever the capacity; its `impl="dense"`, which scores
every slot, is the reference the live paths are tested against (tests/test_live_attention.py).

Attention sinks (gpt-oss): every path takes an optional `sinks` [N], one learned logit per query
head that joins the softmax's denominator and adds no value (`probs = softmax([scores, sink])`
without the sink's column). None (every other family) leaves the computation as it was.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp

from spec_jax.models import paged

NEG_INF = -1e30  # finite so fully-masked rows (padding) stay NaN-free

AttentionParts = Sequence[tuple[jax.Array, jax.Array, jax.Array]]


def float32_precision() -> jax.lax.Precision | None:
    """The dot precision that computes float32 in float32 on the backend being traced for.

    HIGHEST on GPU and TPU, whose DEFAULT rounds float32 operands (TF32, bfloat16 passes). None
    (DEFAULT) on CPU: XLA:CPU's DEFAULT float32 dot is already exact float32 (bit-identical to
    HIGHEST, tested), and HIGHEST there selects a slower kernel (benchmarks/RESULTS.md)."""
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST


def einsum(
    subscripts: str, x: jax.Array, y: jax.Array, preferred_element_type=None
) -> jax.Array:
    """`jnp.einsum` at the precision the operands' dtype promises: float32 products in float32
    (`float32_precision`), the backend's fast default for bfloat16."""
    full = jnp.result_type(x, y) == jnp.float32
    precision = float32_precision() if full else None
    return jnp.einsum(
        subscripts, x, y, precision=precision, preferred_element_type=preferred_element_type
    )


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [B, T, N, D] -> [B, Kv, T*G, D] (row m = t * G + g, G = N // Kv).

    Both attention dots are then plain batched matmuls over (B, Kv) in the cache's own layout, so
    XLA transposes only the small q and output, never the [S]-long scores or the cache."""
    b, t, n, d = q.shape
    groups = n // kv_heads
    return jnp.swapaxes(q.reshape(b, t, kv_heads, groups, d), 1, 2).reshape(b, kv_heads, t * groups, d)


def ungroup_queries(out: jax.Array, num_queries: int) -> jax.Array:
    """[B, Kv, T*G, D] -> [B, T, N, D], the inverse of `group_queries`."""
    b, kv_heads, m, d = out.shape
    groups = m // num_queries
    return jnp.swapaxes(out.reshape(b, kv_heads, num_queries, groups, d), 1, 2).reshape(
        b, num_queries, kv_heads * groups, d
    )


def masked_scores(qh: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """Scaled float32 scores [B, Kv, T*G, S] of grouped queries qh [B, Kv, T*G, D] against keys
    k [B, Kv, S, D]; NEG_INF where mask [B or 1, T, S] hides the key from the query."""
    b, kv_heads, m, d = qh.shape
    t = mask.shape[1]
    s = einsum("bkmd,bksd->bkms", qh, k.astype(qh.dtype), preferred_element_type=jnp.float32)
    mask = jnp.broadcast_to(mask, (b, t, k.shape[2]))  # a [B, 1, S] mask holds for every query
    visible = jnp.repeat(mask, m // t, axis=1)[:, None]  # [B, 1, T*G, S]
    return jnp.where(visible, s / math.sqrt(d), NEG_INF)


def sink_scores(sinks: jax.Array, qh: jax.Array) -> jax.Array:
    """Per-head sink logits sinks [N] laid out as the grouped queries qh [B, Kv, T*G, D] are
    (row m = t * G + g of KV head k is query head k * G + g): float32 [1, Kv, T*G]."""
    kv_heads, m = qh.shape[1], qh.shape[2]
    groups = sinks.shape[0] // kv_heads
    per_head = sinks.astype(jnp.float32).reshape(kv_heads, 1, groups)
    return jnp.broadcast_to(per_head, (kv_heads, m // groups, groups)).reshape(1, kv_heads, m)


def attend(q: jax.Array, parts: AttentionParts, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention over one or more key/value parts with one joint softmax.

    q: [B, T, N, D]; each part (k, v, mask): k, v [B, Kv, S_i, D] (heads-major, as cached), mask
    [B, T, S_i] bool (True = visible) -> [B, T, N, D]. Parts let a pass attend to a cache and to
    its own new keys without concatenating (copying) the cache. sinks: [N] or None (module doc).
    """
    qh = group_queries(q, parts[0][0].shape[1])
    scores = [masked_scores(qh, k, mask) for k, _, mask in parts]
    if sinks is not None:  # one more column, after the parts': its probability is dropped below
        scores.append(jnp.broadcast_to(sink_scores(sinks, qh)[..., None], (*qh.shape[:3], 1)))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)  # [B, Kv, T*G, sum S_i]
    out = 0.0
    start = 0
    for k, v, _ in parts:
        p = probs[..., start : start + k.shape[2]].astype(q.dtype)
        out = out + einsum("bkms,bksd->bkmd", p, v.astype(q.dtype))
        start += k.shape[2]
    return ungroup_queries(out, q.shape[1])


def window_mask(
    q_pos: jax.Array, k_pos: jax.Array, window: int | jax.Array, causal: bool = True
) -> jax.Array:
    """q_pos [B, T], k_pos [B or 1, S] -> [B, T, S] bool: the key is within the query's window,
    q - window < k, and not after it (k <= q) when causal; without causality |q - k| < window.
    The one sliding-window rule of every attention: the decoder's, DFlash's, EAGLE-3's."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    if causal:
        return (diff >= 0) & (diff < window)
    return (diff < window) & (-diff < window)


def cache_visibility(
    cache_lengths: jax.Array, q_positions: jax.Array, slots: jax.Array | int, window: int
) -> jax.Array:
    """[B, T, S] bool: committed slot s (holding position s) is visible to query t of row b when
    s < cache_lengths[b] and it is inside the window (`window_mask`; committed slots are never
    after a query). `slots`: the slot indices [S], or an int capacity meaning all of them."""
    if isinstance(slots, int):
        slots = jnp.arange(slots, dtype=jnp.int32)
    committed = slots[None, None, :] < cache_lengths[:, None, None]
    return committed & window_mask(q_positions, slots[None, :], window)


def live_span(
    cache_lengths: jax.Array, q_positions: jax.Array, window: int
) -> tuple[jax.Array, jax.Array]:
    """(lo, hi), int32 scalars with 0 <= lo <= hi: every cache slot some query of the batch can
    see lies in [lo, hi). hi = the longest committed length; lo = the earliest slot inside the
    window of the earliest query (0 for a global layer)."""
    hi = jnp.max(cache_lengths).astype(jnp.int32)
    earliest = jnp.min(q_positions).astype(jnp.int32) - window + 1  # window <= 2**30: no overflow
    return jnp.clip(earliest, 0, hi), hi


def _attend_dense(q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass, v_pass, pass_mask,
                  sinks=None):
    """Every slot of the capacity scored (the ones a query may not see masked): the reference the
    live-length paths are tested against. Cost grows with the capacity, whatever the live lengths."""
    visible = cache_visibility(cache_lengths, q_positions, k_cache.shape[2], window)
    return attend(q, [(k_cache, v_cache, visible), (k_pass, v_pass, pass_mask)], sinks)


def _merge_scores(carry, scores, v, dtype):
    """Fold scores [B, Kv, M, S] of values v [B, Kv, S, D] into the online softmax's running
    (max, sum, acc); the value product in `dtype` (the queries')."""
    top, total, acc = carry
    new_top = jnp.maximum(top, jnp.max(scores, axis=-1))  # [B, Kv, M]
    rescale = jnp.exp(top - new_top)
    p = jnp.exp(scores - new_top[..., None])
    pv = einsum("bkms,bksd->bkmd", p.astype(dtype), v.astype(dtype), preferred_element_type=jnp.float32)
    return new_top, total * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv


def _open_softmax(qh, k_pass, v_pass, pass_mask, sinks):
    """Step 1 of flash decoding: the pass's own keys open the running softmax (every query sees
    itself). A sink opens it before them: a score with weight exp(0) = 1 in the sum and no value."""
    if sinks is None:
        empty = (jnp.full(qh.shape[:3], NEG_INF, jnp.float32), jnp.zeros(qh.shape[:3], jnp.float32),
                 jnp.zeros(qh.shape, jnp.float32))
    else:
        empty = (jnp.broadcast_to(sink_scores(sinks, qh), qh.shape[:3]),
                 jnp.ones(qh.shape[:3], jnp.float32), jnp.zeros(qh.shape, jnp.float32))
    return _merge_scores(empty, masked_scores(qh, k_pass, pass_mask), v_pass, qh.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attend_live_blocks(
    q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass, v_pass, pass_mask, block,
    sinks=None,
):
    """Flash decoding: the pass's own keys, then the cache's live blocks [lo, hi) one `block` of
    slots at a time (a loop with a dynamic trip count), merged by an online softmax. Reverse mode
    cannot go through such a loop, so its gradient is the dense reference's (`_dense_vjp`)."""
    capacity = k_cache.shape[2]
    block = min(block, capacity)
    qh = group_queries(q, k_cache.shape[1])  # [B, Kv, M, D], M = T * G
    carry = _open_softmax(qh, k_pass, v_pass, pass_mask, sinks)

    # Step 2: the blocks holding [lo, hi). The last block is read at capacity - block when the
    # capacity is not a multiple of it; slots an earlier block covered are masked there.
    def visit(j, carry):
        first = j * block
        start = jnp.minimum(first, capacity - block)
        k = jax.lax.dynamic_slice_in_dim(k_cache, start, block, axis=2)  # [B, Kv, block, D]
        v = jax.lax.dynamic_slice_in_dim(v_cache, start, block, axis=2)
        slots = start + jnp.arange(block, dtype=jnp.int32)
        visible = cache_visibility(cache_lengths, q_positions, slots, window) & (slots >= first)
        return _merge_scores(carry, masked_scores(qh, k, visible), v, q.dtype)

    lo, hi = live_span(cache_lengths, q_positions, window)
    _, total, acc = jax.lax.fori_loop(lo // block, (hi + block - 1) // block, visit, carry)
    out = (acc / total[..., None]).astype(q.dtype)
    return ungroup_queries(out, q.shape[1])


def _attend_live_pages(q, k_pool, v_pool, page_table, cache_lengths, q_positions, window, k_pass, v_pass,
                       pass_mask, sinks=None):
    """`_attend_live_blocks` over a paged cache (`spec_jax.models.paged`): block j is the page
    `page_table[:, j]` of each row, read through the table; the same online softmax. Forward
    only (the engine's paged mode serves, it does not train)."""
    page_size = k_pool.shape[2]
    qh = group_queries(q, k_pool.shape[1])  # [B, Kv, M, D]
    carry = _open_softmax(qh, k_pass, v_pass, pass_mask, sinks)

    def visit(j, carry):
        pages = jax.lax.dynamic_index_in_dim(page_table, j, axis=1, keepdims=False)  # [B]
        k, v = paged.read_pages(k_pool, pages), paged.read_pages(v_pool, pages)  # [B, Kv, page, D]
        slots = j * page_size + jnp.arange(page_size, dtype=jnp.int32)
        visible = cache_visibility(cache_lengths, q_positions, slots, window)
        return _merge_scores(carry, masked_scores(qh, k, visible), v, q.dtype)

    lo, hi = live_span(cache_lengths, q_positions, window)
    _, total, acc = jax.lax.fori_loop(lo // page_size, (hi + page_size - 1) // page_size, visit, carry)
    return ungroup_queries((acc / total[..., None]).astype(q.dtype), q.shape[1])


def _live_blocks_forward(q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass, v_pass,
                         pass_mask, block, sinks=None):
    out = _attend_live_blocks(q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass,
                              v_pass, pass_mask, block, sinks)
    return out, (q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass, v_pass, pass_mask,
                 sinks)


def _dense_vjp(block, saved, grad):
    """Cotangents of the dense reference (the same function) for q, the cache, the pass's
    keys/values and the sinks; None for the integer and boolean inputs."""
    q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass, v_pass, pass_mask, sinks = saved

    def dense(q, k_cache, v_cache, k_pass, v_pass, sinks):
        return _attend_dense(q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass,
                             v_pass, pass_mask, sinks)

    dq, dk_cache, dv_cache, dk_pass, dv_pass, dsinks = jax.vjp(
        dense, q, k_cache, v_cache, k_pass, v_pass, sinks)[1](grad)
    return dq, dk_cache, dv_cache, None, None, None, dk_pass, dv_pass, None, dsinks


_attend_live_blocks.defvjp(_live_blocks_forward, _dense_vjp)


def bucket_widths(capacity: int, smallest: int) -> tuple[int, ...]:
    """0, then `smallest` doubling up to (and ending at) `capacity`."""
    widths, width = [0], min(smallest, capacity)
    while width < capacity:
        widths.append(width)
        width *= 2
    return (*widths, capacity)


def _attend_live_buckets(
    q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass, v_pass, pass_mask, smallest,
    sinks=None, pass_in_cache=False, causal_pass=False,
):
    """Dense attention over the smallest static window of the cache (0, smallest, 2 * smallest,
    ..., capacity slots) that covers [lo, hi), picked on device by `lax.switch`: the same
    arithmetic as the dense reference over fewer (all masked) slots."""
    capacity = k_cache.shape[2]
    widths = bucket_widths(capacity, smallest)
    lo, hi = live_span(cache_lengths, q_positions, window)
    own = (k_pass, v_pass, pass_mask)
    # A window at least the capacity reaches back to slot 0 from any query (slot s holds position
    # s < capacity), so every bucket starts there: a static slice. A dynamically placed one
    # XLA:GPU copied out of the cache before the attention's GEMM (the H100 profile of session
    # 34: 80 window copies a DFlash step at Qwen3-8B shapes, 0.19 ms).
    from_zero = isinstance(window, int) and window >= capacity
    if from_zero and pass_in_cache and (causal_pass or pass_mask.shape[-1] <= MAX_IN_PASS_BITS):
        return _attend_buckets_with_pass(q, k_cache, v_cache, cache_lengths, q_positions, window,
                                         None if causal_pass else pass_mask, widths[1:], hi, sinks)
    index = jnp.sum(hi - lo > jnp.asarray(widths[:-1], jnp.int32))  # the first width >= hi - lo

    def dense_over(width):
        def branch(k_cache, v_cache):
            if width == 0:
                return attend(q, [own], sinks)
            if from_zero:
                start, k, v = 0, k_cache[:, :, :width], v_cache[:, :, :width]  # [B, Kv, W, D]
            else:
                start = jnp.minimum(lo, capacity - width)
                k = jax.lax.dynamic_slice_in_dim(k_cache, start, width, axis=2)
                v = jax.lax.dynamic_slice_in_dim(v_cache, start, width, axis=2)
            slots = start + jnp.arange(width, dtype=jnp.int32)
            visible = cache_visibility(cache_lengths, q_positions, slots, window)
            return attend(q, [(k, v, visible), own], sinks)

        return branch

    return jax.lax.switch(index, [dense_over(w) for w in widths], k_cache, v_cache)


def _attend_buckets_with_pass(q, k_cache, v_cache, cache_lengths, q_positions, window, pass_mask, widths, hi,
                              sinks):
    """The buckets path for a pass whose keys/values the cache already holds (row b's pass key i at
    slot cache_lengths[b] + i, as the decoder writes them before attending) under a window that
    reaches slot 0: one part, the window [0, W) with W >= hi + T, where query i sees the committed
    slots and the pass's keys that `pass_mask` [B or 1, T, T] allows (None: a chain, keys 0..i).
    The same softmax as the two-part form over fewer kernels: no scores of the pass's own keys
    apart, no concatenation of the two parts' scores, no sum of two value products. The in-pass
    visibility is arithmetic on slot indices (a chain's comparison, or a tree's mask packed into
    bits and shifted), never a lookup, so it fuses into the scores' masking at any capacity."""
    t = q.shape[1]
    index = jnp.sum(hi + t > jnp.asarray(widths[:-1], jnp.int32))  # the first width >= hi + T
    words = None if pass_mask is None else in_pass_words(pass_mask)

    def over(width):
        def branch(k_cache, v_cache):
            slots = jnp.arange(width, dtype=jnp.int32)
            committed = cache_visibility(cache_lengths, q_positions, slots, window)  # [B, T, W]
            key = slots[None, None, :] - cache_lengths[:, None, None]  # [B, 1, W]: the pass key a slot holds
            if words is None:  # a chain: query i sees keys 0..i
                own = (key >= 0) & (key <= jnp.arange(t, dtype=jnp.int32)[None, :, None])
            else:
                own = in_pass_visible(words, key, t)
            return attend(q, [(k_cache[:, :, :width], v_cache[:, :, :width], committed | own)], sinks)

        return branch

    return jax.lax.switch(index, [over(w) for w in widths], k_cache, v_cache)


# The widest masked pass (a token tree's verify: nodes + 1) the buckets path reads from the cache
# as one part; its mask is packed into one 32-bit word per 32 keys, and a wider pass would pick
# among more words per slot. Wider passes keep the two parts.
MAX_IN_PASS_BITS = 64


def in_pass_words(pass_mask: jax.Array) -> jax.Array:
    """pass_mask [B or 1, T, T'] bool -> [B or 1, T, ceil(T' / 32)] uint32: bit j % 32 of word
    j // 32 set where the query sees the pass's key j."""
    lead, width = pass_mask.shape[:-1], pass_mask.shape[-1]
    words = -(-width // 32)
    padded = jnp.pad(pass_mask, [(0, 0)] * len(lead) + [(0, 32 * words - width)])
    bits = padded.reshape(*lead, words, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(bits, axis=-1, dtype=jnp.uint32)  # distinct bits: the sum is their or


def in_pass_visible(words: jax.Array, key: jax.Array, width: int) -> jax.Array:
    """Whether query i sees the pass key a slot holds: words [B or 1, T, n] (`in_pass_words`), key
    [B, 1, W] the pass key at each slot (negative or >= width: none) -> [B, T, W] bool. Shifts and
    selects only, elementwise over [B, T, W]."""
    held = jnp.clip(key, 0, width - 1)
    word = words[..., :1]  # [B or 1, T, 1]
    for w in range(1, words.shape[-1]):
        word = jnp.where(held >> 5 == w, words[..., w : w + 1], word)
    bit = (word >> (held & 31).astype(jnp.uint32)) & 1
    return (key >= 0) & (key < width) & (bit == 1)


# The cache attention each backend uses: (impl, block). On CPU "blocks" with 128-slot blocks:
# it beat "buckets" at batch 8 and tied or lost slightly at batch 1 with long live lengths, reads
# less than larger blocks at short lengths, and compiles about twice as fast (one loop body per
# layer, not a switch of branches). Elsewhere "buckets": it decides once per layer, where a
# dynamic-trip-count loop may cost a device-to-host round trip per block. The measurements are in
# benchmarks/RESULTS.md; `benchmarks/capacity_scaling.py --impls live,dense,blocks` repeats them.
LIVE_ATTENTION = {"cpu": ("blocks", 128)}
ACCELERATOR_LIVE_ATTENTION = ("buckets", 256)


_INTO_EMPTY_CACHE = contextvars.ContextVar("spec_jax_into_empty_cache", default=False)


@contextlib.contextmanager
def into_empty_cache() -> Iterator[None]:
    """Trace-time: the target passes traced inside write into a cache that holds nothing yet (a
    prefill into a fresh cache, or into a request's empty pages). The decoder reads it once per
    pass (`writing_into_empty_cache`) and hands its layers `cache_empty=True`, a static argument,
    so a layer traced here is never reused for a pass over a filled cache. A context variable, so
    threads tracing side by side (`Engine.warmup`) do not see each other's."""
    token = _INTO_EMPTY_CACHE.set(True)
    try:
        yield
    finally:
        _INTO_EMPTY_CACHE.reset(token)


def writing_into_empty_cache() -> bool:
    """Whether the pass being traced writes into an empty cache (`into_empty_cache`)."""
    return _INTO_EMPTY_CACHE.get()


def attend_cache_and_pass(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    q_positions: jax.Array,
    window: int,
    k_pass: jax.Array,
    v_pass: jax.Array,
    pass_mask: jax.Array,
    *,
    impl: str | None = None,
    block: int | None = None,
    sinks: jax.Array | None = None,
    page_table: jax.Array | None = None,
    cache_empty: bool = False,
    pass_in_cache: bool = False,
    causal_pass: bool = False,
) -> jax.Array:
    """Attention of a pass's queries over the committed cache and the pass's own keys.

    q [B, T, N, D] (rotated) at q_positions [B, T]; k_cache/v_cache [B, Kv, S, D]; cache_lengths
    [B] committed slots per row (slot s holds position s); window: the layer's attention window
    (GLOBAL_WINDOW for full attention), applied to the cache here; k_pass/v_pass [B, Kv, T', D]
    the pass's own keys; pass_mask [B or 1, T, T'] which of them each query sees (window and
    causality already folded in by the caller; every query should see at least one of them).
    -> [B, T, N, D].

    Only the live part of the cache is read: the slots up to the batch's longest `cache_lengths`
    and, for a sliding window, none before the earliest query's window (`live_span`), so the
    cost follows the live length, not the capacity. `impl`: "blocks" (flash decoding over KV
    blocks of `block` slots), "buckets" (dense over the smallest window of 0, `block`, 2 *
    `block`, ... slots that covers them), "dense" (every slot: the reference); None (and a None
    `block`) take the backend's measured choice, `LIVE_ATTENTION`. A capacity of at most one
    block is read densely.

    The cache may already hold the pass's own keys at slots >= cache_lengths (written first, so
    XLA updates it in place); they are not read from it. sinks: [N] per-head sink logits (gpt-oss)
    or None (the module doc).

    page_table: None (k_cache/v_cache are the rows' own arrays), or [B, pages_per_row] with
    k_cache/v_cache page pools [P, Kv, page, D] (`spec_jax.models.paged`): the live pages are
    read through the table one page per step (flash decoding over pages, whatever `impl` says
    but "dense", which gathers every page: the reference).

    cache_empty (static): every row's cache is known to be empty (`into_empty_cache`: a prefill),
    so only the pass's own keys are read, exactly as every path would over zero lengths, and no
    cache path is compiled: without it each prefill layer also holds the buckets' `lax.switch`, a
    pair of attention GEMMs per window width at the prompt's width, each autotuned on a GPU.

    pass_in_cache (static): the cache already holds the pass's keys/values, row b's key i at slot
    cache_lengths[b] + i (the decoder writes them first). The "buckets" path then reads them from
    there with the committed slots, as one part, where the layer's window spans the capacity: for a
    chain (causal_pass, static: pass_mask is the causal mask, and is not read) at any width, for a
    tree up to MAX_IN_PASS_BITS keys. Other passes keep the two parts.
    """
    if cache_empty:
        return attend(q, [(k_pass, v_pass, pass_mask)], sinks)
    if page_table is not None:
        if impl == "dense":
            dense = (paged.gather_rows(k_cache, page_table), paged.gather_rows(v_cache, page_table))
            return _attend_dense(q, *dense, cache_lengths, q_positions, window, k_pass, v_pass, pass_mask, sinks)
        return _attend_live_pages(q, k_cache, v_cache, page_table, cache_lengths, q_positions, window, k_pass,
                                  v_pass, pass_mask, sinks)
    default_impl, default_block = LIVE_ATTENTION.get(jax.default_backend(), ACCELERATOR_LIVE_ATTENTION)
    impl, block = impl or default_impl, block or default_block
    args = (q, k_cache, v_cache, cache_lengths, q_positions, window, k_pass, v_pass, pass_mask)
    if impl not in ("blocks", "buckets", "dense"):
        raise ValueError(f"unknown cache attention impl {impl!r}: use 'blocks', 'buckets' or 'dense'")
    if impl == "dense" or k_cache.shape[2] <= block:
        return _attend_dense(*args, sinks)
    if impl == "blocks":
        return _attend_live_blocks(*args, block, sinks)
    return _attend_live_buckets(*args, block, sinks, pass_in_cache, causal_pass)
