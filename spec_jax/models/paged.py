"""Paged keys/values: one shared pool of fixed-size pages per layer, read and written through a
page table per row (the engine's paged mode, `Engine(kv_pages=N)`).

A paged layer cache is a pool [P, Kv, page_size, D] (P pages shared by every row) and the
cache's `page_table` [B, pages_per_row] int32: row b's slot s lives in page
`page_table[b, s // page_size]` at offset `s % page_size`. A row's capacity is pages_per_row *
page_size slots, as a dense row's is. The table entry P (one past the last page, `unallocated`)
marks a page the row does not hold: writes there are dropped and reads give zeros, so a row can
never touch another row's pages whatever its lengths say. The host hands pages out and takes them
back (`spec_jax.decoding.pages.PagePool`); the device only reads and writes through the table, so
tables and pool keep their shapes as requests come and go (no compile).

The page is the live-length attention's block (`attention.attend_cache_and_pass` visits one page
per iteration of its flash-decoding loop), so a paged pass reads what a dense one reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PAGE_SIZE = 128  # slots per page: the CPU live-attention block (`attention.LIVE_ATTENTION`)


def unallocated(pool: jax.Array) -> int:
    """The table entry of a page a row does not hold: the pool's page count (out of range)."""
    return pool.shape[0]


def locate(page_table: jax.Array, slots: jax.Array, page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """Slots [B, T] of each row -> (page [B, T], offset [B, T]); a slot past the row's capacity
    maps to the unallocated page (`num_pages`)."""
    index = slots // page_size
    inside = (index >= 0) & (index < page_table.shape[1])
    page = jnp.take_along_axis(page_table, jnp.clip(index, 0, page_table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, num_pages), slots % page_size


def read_pages(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """pool [P, Kv, page, D], pages [B] -> [B, Kv, page, D] (zeros for an unallocated page)."""
    return pool.at[pages].get(mode="fill", fill_value=0)


def write_slots(pool: jax.Array, new: jax.Array, page_table: jax.Array, slots: jax.Array) -> jax.Array:
    """Write new [B, Kv, T, D] into the pool at each row's slots [B, T] (one scatter, in place;
    slots in pages the row does not hold are dropped)."""
    page, offset = locate(page_table, slots, pool.shape[2], unallocated(pool))
    # Indexing dims 0 and 2 (split by a slice) puts the indexed [B, T] first: [B, T, Kv, D].
    return pool.at[page, :, offset].set(jnp.swapaxes(new, 1, 2).astype(pool.dtype), mode="drop")


def move_slots(pool: jax.Array, page_table: jax.Array, source: jax.Array, dest: jax.Array) -> jax.Array:
    """Each row's keys/values at slots source [B, P] copied to slots dest [B, P] (a tree's
    accepted path made contiguous), within the row's own pages."""
    num_pages, page_size = unallocated(pool), pool.shape[2]
    src_page, src_offset = locate(page_table, source, page_size, num_pages)
    picked = pool.at[src_page, :, src_offset].get(mode="fill", fill_value=0)  # [B, P, Kv, D]
    dst_page, dst_offset = locate(page_table, dest, page_size, num_pages)
    return pool.at[dst_page, :, dst_offset].set(picked, mode="drop")


def gather_rows(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """Every row's pages as a dense [B, Kv, pages_per_row * page, D] (the dense reference the
    paged attention is checked against; the serving path never builds it)."""
    b, n = page_table.shape
    pages = pool.at[page_table].get(mode="fill", fill_value=0)  # [B, n, Kv, page, D]
    kv, page, d = pool.shape[1:]
    return jnp.swapaxes(pages, 1, 2).reshape(b, kv, n * page, d)
