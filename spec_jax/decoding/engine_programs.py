"""The engine's program set and the state layout they share.

One `LoopState` of `slots` rows at a fixed capacity, and two kinds of program on it, each jitted
with the state donated:
  - the chunk: up to `chunk_steps` speculative steps over every row (`run_chunk`; with an adaptive
    `depth`, each step picks its depth, and the state carries the policy's `DepthState`);
  - an admit per prompt bucket: a 1-row `prefill` scattered into one slot's row of every state
    leaf (tokens, target cache, drafter state, stats, the row's acceptance EMAs);
  - with chunked prefill (`prefill_rows`), instead of admits: a prefill pass per shape [r, W]
    (`chunked.prefill_chunk` on r of the `PrefillRows`' rows: their target caches and captured
    hidden states, kept apart from the running rows), and a finish per prompt bucket
    (`loop.start_state` on a prefilled row, scattered into its slot as an admit is). With a paged
    cache the prefill rows keep only their per-row parts: a pass writes each prompt's keys/values
    straight into the pages of the slot it will run in (the state and the rows donated together),
    and the finish reads them there.
Programs are shared between engines of the same configuration (a process that builds several
engines compiles each program once).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.decoding import saved_programs
from spec_jax.decoding.chunked import NO_STEP_CAP, prefill_chunk, run_chunk
from spec_jax.decoding.generate import stop_id_array
from spec_jax.decoding.depth import AdaptiveDepth, admitted_row
from spec_jax.decoding.emitted import read_window
from spec_jax.decoding.loop import LoopInputs, LoopState, forward_capturing, prefill, start_state, with_depth_state
from spec_jax.decoding.programs import CompileTally, ProgramCache, signature
from spec_jax.decoding.slots import RequestParams
from spec_jax.drafters.base import Drafter
from spec_jax.models.interface import Target
from spec_jax.models.paged import PAGE_SIZE
from spec_jax.sampling import SamplingParams

NO_BATCH_AXIS = -1
# Programs by full configuration, shared between engines (newest last, bounded).
_SHARED_PROGRAMS = ProgramCache(max_size=64)


def batch_axes(abstract_one: Any, abstract_two: Any) -> Any:
    """Per leaf, the axis whose size is the batch (found by comparing the state's shapes at batch
    1 and 2), or NO_BATCH_AXIS for leaves shared by all rows (the step counter)."""

    def axis(one: Any, two: Any) -> int:
        for i, (a, b) in enumerate(zip(one.shape, two.shape)):
            if a != b:
                return i
        return NO_BATCH_AXIS

    return jax.tree_util.tree_map(axis, abstract_one, abstract_two)


def request_key(seed: int, choice: int = 0) -> jax.Array:
    """A request's own PRNG key: from its seed, folded with its choice index (the n rows of one
    request sample independently). The loop folds it with the row's length at every draw
    (`loop.draw_keys`), so a seeded request gives the same tokens whatever runs beside it."""
    return jax.random.fold_in(jax.random.key(seed), choice)


def row_keys(batch: int) -> jax.Array:
    """[batch] per-row keys (placeholders until each row's request brings its own)."""
    return jax.random.split(jax.random.key(0), batch)


def zeros_like_abstract(abstract: Any) -> Any:
    def zeros(x: Any) -> Any:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a free row's key is never drawn from
            return row_keys(x.shape[0]) if x.shape else jax.random.key(0)
        return jnp.zeros(x.shape, x.dtype)

    return jax.tree_util.tree_map(zeros, abstract)


@struct.dataclass
class PrefillRows:
    """The rows prompts are prefilled in, chunk by chunk, before they join the running rows.

    cache:       the target's cache for R rows (committed up to each row's prompt so far)
    captured:    [R, capacity, n*H] the captured hidden states of each row's prompt so far (None
                 when the drafter captures none): what `Drafter.init` reads at the finish
    last_hidden: [R, H] the hidden state of each row's last prompt token so far"""

    cache: Any
    captured: Any
    last_hidden: jax.Array


def take_rows(tree: Any, axes: Any, rows: jax.Array) -> Any:
    """Rows `rows` [r] of each leaf along its batch axis (leaves without one are kept)."""
    return jax.tree_util.tree_map(lambda axis, x: x if axis == NO_BATCH_AXIS else jnp.take(x, rows, axis), axes, tree)


def put_rows(tree: Any, axes: Any, rows: jax.Array, part: Any) -> Any:
    """`tree` with rows `rows` [r] of each leaf replaced by `part`'s."""
    def put(axis, full, new):
        if axis == NO_BATCH_AXIS:
            return full
        moved = jnp.moveaxis(full, axis, 0).at[rows].set(jnp.moveaxis(new, axis, 0).astype(full.dtype))
        return jnp.moveaxis(moved, 0, axis)

    return jax.tree_util.tree_map(put, axes, tree, part)


class EnginePrograms:
    """The state layout, its placement on a mesh, and the compiled chunk and admit programs.

    drafters: {K: the drafter at K, or None for plain decoding} (one entry). top_logprobs: None,
    or the state keeps `TokenLogprobs` with this many top tokens per position (for requests that
    ask for logprobs). depth: the adaptive depth policy's static part (None: K is fixed); its
    costs travel in the state (`initial_state`). prefill_rows: None (prompts prefill in one
    pass, an admit), or R: prompts prefill in chunks in R `PrefillRows` (`initial_prefill_rows`).
    kv_pages: None (each row holds a dense cache of `capacity` slots), or the target's cache is a
    pool of that many pages of `page_size` slots (`spec_jax.models.paged`): the chunk and the
    admits then take the host's page table (`decoding.pages.PagePool`) as their last argument.
    read_width: the positions a row's read holds (`decoding.emitted`): the chunk returns, beside
    the state, each row's last `read_width` tokens (and logprobs), all a chunk can commit, so the
    host fetches those and not the whole buffers. `tally` (`compiles`, `compile_s`) counts the
    programs compiled by this object (not ones shared from another engine)."""

    def __init__(self, model: Any, drafters: dict[int, Drafter | None], target_params: Any, drafter_params: Any,
                 *, capacity: int, slots: int, mesh: Any = None, sharding_rules: Any = None,
                 top_logprobs: int | None = None, depth: AdaptiveDepth | None = None,
                 prefill_rows: int | None = None, kv_pages: int | None = None, page_size: int = PAGE_SIZE,
                 read_width: int):
        self.model, self.drafters, self.capacity, self.slots, self.mesh = model, drafters, capacity, slots, mesh
        self.read_width = read_width
        self.kv_pages, self.page_size = kv_pages, page_size
        self.top_logprobs, self.depth, self.prefill_rows = top_logprobs, depth, prefill_rows
        self.target_params, self.drafter_params = target_params, drafter_params
        self.widest = drafters[max(drafters)]  # the drafter at the largest K: admits use its layout
        abstract_one = self._abstract_prefill(1, self.widest)
        self.batch_axes = batch_axes(abstract_one, self._abstract_prefill(2, self.widest))
        self.abstract = self._abstract_prefill(slots, self.widest)
        self.state_shardings = None
        if mesh is not None:
            self._place_on(mesh, sharding_rules)
        self.exes: dict[Any, Any] = {}
        self._placed_rows: tuple | None = None  # (slot table, its version, step cap, the placed values)
        self.tally = CompileTally()  # what this object compiled (not programs shared from another engine)

    @property
    def compiles(self) -> int:
        return self.tally.programs

    @property
    def compile_s(self) -> float:
        return self.tally.seconds

    def _abstract_prefill(self, batch: int, drafter: Drafter | None) -> LoopState:
        dense = self._abstract_dense_prefill(batch, drafter)
        if self.kv_pages is None:
            return dense
        # The paged layout: the same state, its target cache a page pool with a table per row.
        return dense.replace(cache=jax.eval_shape(
            lambda: self.model.init_paged_cache(batch, self.capacity, self.kv_pages, self.page_size)))

    def _abstract_dense_prefill(self, batch: int, drafter: Drafter | None) -> LoopState:
        def fn(params, drafter_params):
            state = prefill(
                Target(params, self.model), drafter, drafter_params,
                jnp.zeros((batch, 16), jnp.int32), jnp.ones((batch,), jnp.int32), row_keys(batch),
                SamplingParams.create(), jnp.int32(1), jnp.asarray(stop_id_array(())), self.capacity,
                self.top_logprobs,
            )
            state = with_depth_state(state, self.depth, self._placeholder_costs(), drafter)
            return with_logprobs_ring(state, self.read_width)

        return jax.eval_shape(fn, self.target_params, self.drafter_params)

    def _placeholder_costs(self) -> Any:
        return None if self.depth is None else jnp.ones((len(self.depth.depths),), jnp.float32)

    def _place_on(self, mesh: Any, sharding_rules: Any) -> None:
        """State shardings from the rules, and the weights placed once, as `generate` places them."""
        from spec_jax.decoding.placement import place_generate_inputs
        from spec_jax.sharding.rules import DEFAULT_RULES, state_shardings

        self.state_shardings = state_shardings(self.abstract, mesh, sharding_rules or DEFAULT_RULES)
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        placed = place_generate_inputs(
            LoopInputs(self.target_params, self.drafter_params, np.zeros((self.slots, 1), np.int32),
                       np.ones((self.slots,), np.int32), jax.random.key(0), SamplingParams.create(),
                       np.int32(1), stop_id_array(())),
            self.model, self.widest, mesh, sharding_rules,
        )
        self.target_params, self.drafter_params = placed.target_params, placed.drafter_params

    def initial_state(self, depth_costs: Any = None) -> LoopState:
        """Every row free: done, one committed token whose cache holds nothing (lengths - 1 = 0);
        each admit puts its request's own key in its row. depth_costs: each adaptive depth's step
        time (traced: new costs never recompile)."""
        state = zeros_like_abstract(self.abstract).replace(
            done=jnp.ones((self.slots,), bool),
            lengths=jnp.ones((self.slots,), jnp.int32),
        )
        state = with_depth_state(state, self.depth, depth_costs, self.widest)
        if self.kv_pages is not None:  # no row holds a page yet
            state = state.replace(cache=state.cache.replace(
                page_table=jnp.full(state.cache.page_table.shape, self.kv_pages, jnp.int32)))
        if self.state_shardings is not None:
            from spec_jax.sharding.rules import place

            state = jax.tree_util.tree_map(place, state, self.state_shardings)
        return state

    def place(self, x: Any) -> Any:
        """A host value as a program argument (replicated over the mesh, if any)."""
        if self.mesh is None:
            return jnp.asarray(x)
        from spec_jax.sharding.rules import place

        return place(x, self._replicated)

    def _key(self, params: RequestParams) -> Any:
        """The request's own PRNG key [1] (see `request_key`)."""
        key = request_key(params.seed, params.choice)[None]
        return self.place(key) if self.mesh is not None else key

    def _compile(self, key: Any, fn: Any, args: tuple) -> Any:
        """The program for `key` (("chunk", K), ("admit", bucket), ("prefill_pass", rows, width),
        ("finish_prefill", bucket) or ("window", width, with logprobs)): this object's, else
        one an engine of the same configuration compiled, else compiled now."""
        exe = self.exes.get(key)
        if exe is None:
            drafter = self.drafters[key[1]] if key[0] == "chunk" else self.widest
            if key[0] == "prefill_pass":  # it reads only the layers the drafter captures
                drafter = self._capture_layers()
            config = (key, self.model, drafter, self.capacity, self.slots, self.mesh, str(self.state_shardings),
                      signature(args, self.mesh), self.depth)
            kw: dict[str, Any] = {}
            if key[0] != "window":  # the others take the state and return the next one in its place
                kw["donate_argnums"] = 0
            if self.mesh is not None:
                kw["out_shardings"] = self._out_shardings(key[0])
            # What `fn` closes over (chunk_job / admit_job), so a saved program is found only by its
            # own configuration.
            closed_over = (self.model, drafter, self.capacity, self.batch_axes if key[0] != "chunk" else None,
                           self.top_logprobs, self.read_width) + (() if self.depth is None else (self.depth,))
            exe, _ = _SHARED_PROGRAMS.get_or_compile(
                config, lambda: jax.jit(fn, **kw).lower(*args), self.mesh, tally=self.tally,
                saved_as=lambda: saved_programs.key_for(f"engine.{fn.__name__}", (key, *closed_over), args,
                                                        mesh=self.mesh))
            self.exes[key] = exe
        return exe

    def _out_shardings(self, kind: str) -> Any:
        """On a mesh: the state keeps its layout; a read (the window's, the chunk's) is gathered
        onto every device inside the program, so the host's fetch is one plain copy."""
        if kind == "window":
            return self._replicated
        return (self.state_shardings, self._replicated) if kind == "chunk" else self.state_shardings

    def compile_all(self, jobs: list[tuple[Any, Any, tuple]], workers: int) -> None:
        """Compile each (key, fn, args) of `jobs` (from `chunk_job` / `admit_job`), `workers` at a
        time (XLA compiles with the GIL released, so threads can overlap one program's tracing
        with another's compile where cores are free)."""
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                self._compile(*job)
            return
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(lambda job: self._compile(*job), jobs):
                pass  # re-raises a compile's error here

    def chunk_args(self, state: LoopState, slot_table: Any, chunk_steps: int, page_table: Any = None) -> tuple:
        """The chunk's arguments: the state and the slots' per-row request values (and, paged,
        the page table [slots, pages_per_row])."""
        live, wants_logprobs, sampling, max_new, stop, steps = self._rows_placed(slot_table, chunk_steps)
        return (state, live, wants_logprobs, self.target_params, self.drafter_params, sampling, max_new, stop,
                steps) + self._page_args(page_table)

    def _rows_placed(self, slot_table: Any, chunk_steps: int) -> tuple:
        """The slots' per-row values and the step cap as device arrays, placed again only when the
        table changed (`SlotTable.version`) or the cap did: most chunks run with the same requests,
        and each placement is a transfer (8 of them took ~0.12 ms a chunk on this CPU)."""
        cached = self._placed_rows
        if cached is None or cached[0] is not slot_table or cached[1:3] != (slot_table.version, chunk_steps):
            sampling = SamplingParams(slot_table.temperature, slot_table.top_k, slot_table.top_p)
            placed = (self.place(slot_table.live), self.place(slot_table.wants_logprobs),
                      jax.tree_util.tree_map(self.place, sampling), self.place(slot_table.max_new),
                      self.place(slot_table.stop), self.place(np.int32(chunk_steps)))
            self._placed_rows = (slot_table, slot_table.version, chunk_steps, placed)
        return self._placed_rows[3]

    def _page_args(self, page_table: Any) -> tuple:
        """() for a dense cache; (the page table,) for a paged one."""
        if self.kv_pages is None:
            return ()
        return (self.place(np.asarray(page_table, np.int32)),)

    def chunk(self, k: int, args: tuple) -> Any:
        """The chunk program at K (compiled on first use)."""
        return self._compile(*self.chunk_job(k, args))

    def chunk_job(self, k: int, args: tuple) -> tuple[Any, Any, tuple]:
        """(key, function, arguments) of the chunk program at K: (state, its args) -> (the next
        state, `read_window` of it: what the host reads)."""
        model, drafter, depth, width = self.model, self.drafters[k], self.depth, self.read_width

        def chunk(state, live, wants_logprobs, target_params, drafter_params, sampling, max_new, stop_ids, max_steps,
                  *page_table):
            state = with_page_table(state, page_table)
            state = state.replace(done=state.done | ~live)  # freed rows stop at once
            if state.logprobs is not None:  # only rows whose request asks record them
                state = state.replace(logprobs=state.logprobs.replace(wanted=wants_logprobs))
            state = run_chunk(state, target_params, drafter_params, sampling, max_new, stop_ids,
                              max_steps, jnp.int32(NO_STEP_CAP), model=model, drafter=drafter, depth=depth)
            return state, read_window(state.tokens, state.lengths, state.logprobs, width)

        return ("chunk", k), chunk, args

    def window_args(self, state: LoopState, with_logprobs: bool) -> tuple:
        """The window read's arguments: the state's tokens and lengths (and logprobs buffers)."""
        return state.tokens, state.lengths, state.logprobs if with_logprobs else None

    def window(self, width: int, args: tuple) -> Any:
        """The program that reads each row's last `width` buffer positions (`decoding.emitted`),
        after admits (the chunk returns its own read)."""
        return self._compile(*self.window_job(width, args))

    def window_job(self, width: int, args: tuple) -> tuple[Any, Any, tuple]:
        """(key, function, arguments) of the window read at `width`."""

        def read_emitted(tokens, lengths, logprobs):
            return read_window(tokens, lengths, logprobs, width)

        return ("window", width, args[2] is not None), read_emitted, args

    def admit_args(self, state: LoopState, slot: int, params: RequestParams, bucket: int,
                   page_row: Any = None) -> tuple:
        """The admit's arguments: the prompt right-padded to `bucket`, and the request's values
        (and, paged, the slot's row of the page table [pages_per_row])."""
        prompt = list(params.prompt_ids)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : len(prompt)] = prompt
        sampling = SamplingParams.create(params.temperature, params.top_k, params.top_p)
        return (
            state, self.place(np.int32(slot)), self.target_params, self.drafter_params,
            self.place(tokens), self.place(np.asarray([len(prompt)], np.int32)), self._key(params),
            jax.tree_util.tree_map(self.place, sampling), self.place(np.int32(params.max_new_tokens)),
            self.place(stop_id_array(params.stop_ids)),
        ) + self._page_args(None if page_row is None else np.asarray(page_row)[None])

    def admit(self, bucket: int, args: tuple) -> Any:
        """The admit program for this prompt bucket at the state's Stats K (compiled on first use)."""
        return self._compile(*self.admit_job(bucket, args))

    def admit_job(self, bucket: int, args: tuple) -> tuple[Any, Any, tuple]:
        """(key, function, arguments) of the admit program for this bucket at the state's Stats K."""
        model, drafter, capacity, axes, top = self.model, self.widest, self.capacity, self.batch_axes, self.top_logprobs
        depth = self.depth

        def admit(state, slot, target_params, drafter_params, prompt, prompt_length, key, sampling,
                  max_new, stop_ids, *page_row):
            # Paged: the prompt goes straight into the slot's pages (through its row of the table).
            empty = empty_paged_row(state.cache, page_row[0]) if page_row else None
            row = prefill(Target(target_params, model), drafter, drafter_params, prompt, prompt_length,
                          key, sampling, max_new, stop_ids, capacity, top, empty_cache=empty)
            row = with_admitted_depth(row, state, depth)
            merged = merge_row(state, row, slot, axes)
            if page_row:  # the pools have no row axis: the row's prefill wrote into them
                merged = merged.replace(cache=merged.cache.replace(k=row.cache.k, v=row.cache.v))
            return merged

        return ("admit", bucket), admit, args

    def admit_after_prefix_args(self, state: LoopState, slot: int, params: RequestParams, bucket: int,
                                page_row: Any, start: int) -> tuple:
        """A prefix-cached admit's arguments: the admit's, and the slots its shared pages hold."""
        return self.admit_args(state, slot, params, bucket, page_row) + (self.place(np.int32(start)),)

    def admit_after_prefix(self, bucket: int, args: tuple) -> Any:
        return self._compile(*self.admit_after_prefix_job(bucket, args))

    def admit_after_prefix_job(self, bucket: int, args: tuple) -> tuple[Any, Any, tuple]:
        """(key, function, arguments) of the prefix-cached admit for this prompt bucket: the
        row's table starts with shared pages holding the prompt's first `start` slots; only the
        rest of the prompt runs (one pass of the bucket's width from `start`), then the row starts
        as after a whole prefill (the drafter reads no captured states: `Engine` checks)."""
        model, drafter, capacity, axes, top = self.model, self.widest, self.capacity, self.batch_axes, self.top_logprobs
        depth = self.depth

        def admit_after_prefix(state, slot, target_params, drafter_params, prompt, prompt_length, key, sampling,
                               max_new, stop_ids, page_row, start):
            target = Target(target_params, model)
            cache = empty_paged_row(state.cache, page_row).replace(lengths=start[None])  # the prefix is committed
            width = prompt.shape[1]
            positions = start + jnp.arange(width, dtype=jnp.int32)[None]  # [1, W]; past the prompt: padding
            rest = jnp.take_along_axis(prompt, jnp.minimum(positions, width - 1), axis=1)
            hidden, _, cache = forward_capturing(target, rest, positions, cache, ())
            last_hidden = hidden[:, prompt_length[0] - 1 - start]  # [1, H]
            row = start_state(target, drafter, drafter_params, prompt, prompt_length, last_hidden, None, cache, key,
                              sampling, max_new, stop_ids, capacity, top)
            row = with_admitted_depth(row, state, depth)
            merged = merge_row(state, row, slot, axes)
            return merged.replace(cache=merged.cache.replace(k=row.cache.k, v=row.cache.v))

        return ("admit_after_prefix", bucket), admit_after_prefix, args

    # ------------------------------------------------------------------ chunked prefill
    def initial_prefill_rows(self) -> PrefillRows:
        """`prefill_rows` empty rows (each pass starts a new prompt's row from an empty cache)."""
        return zeros_like_abstract(self._abstract_prefill_rows())

    def _capture_layers(self) -> tuple[int, ...]:
        return self.widest.capture_layers if self.widest is not None else ()

    def _abstract_prefill_rows(self) -> PrefillRows:
        rows, capacity, model, capture = self.prefill_rows, self.capacity, self.model, self._capture_layers()

        def fn(params):
            cache = model.init_cache(rows, capacity)
            hidden, captured, _ = forward_capturing(Target(params, model), jnp.zeros((rows, 1), jnp.int32),
                                                    jnp.zeros((rows, 1), jnp.int32), cache, capture)
            return PrefillRows(
                cache=cache if self.kv_pages is None else self._prefill_rows_paged_cache(rows),
                captured=None if captured is None else jnp.zeros((rows, capacity, captured.shape[-1]), captured.dtype),
                last_hidden=hidden[:, 0])

        return jax.eval_shape(fn, self.target_params)

    def _prefill_rows_paged_cache(self, rows: int) -> Any:
        """Paged: the prefill rows' cache keeps only what is per row (lengths, recurrent states,
        the rows' page tables); their keys/values go straight into the state's pool, through the
        pages of the slot each prompt will run in (a 1-page placeholder pool stands in here)."""
        return self.model.init_paged_cache(rows, self.capacity, 1, self.page_size)

    def prefill_pass_args(self, prefill_rows: PrefillRows, rows: np.ndarray, tokens: np.ndarray,
                          starts: np.ndarray, valid: np.ndarray, state: LoopState | None = None,
                          page_rows: Any = None) -> tuple:
        """A prefill pass's arguments: which rows [r] (distinct), their next tokens [r, W], where
        each starts [r] (0: a new prompt) and how many of its W tokens are prompt [r]. Paged: the
        first argument is (state, prefill_rows), both donated (the pass writes the state's pool),
        and the last the page-table rows [r, pages_per_row] of the slots the prompts will run in."""
        head = prefill_rows if self.kv_pages is None else (state, prefill_rows)
        return (head, self.target_params, *(self.place(np.asarray(x, np.int32))
                                            for x in (rows, tokens, starts, valid))) + self._page_args(page_rows)

    def prefill_pass(self, args: tuple) -> Any:
        return self._compile(*self.prefill_pass_job(args))

    def prefill_pass_job(self, args: tuple) -> tuple[Any, Any, tuple]:
        """(key, function, arguments) of the prefill pass at the arguments' shape [r, W]."""
        model, capture, cache_axes = self.model, self._capture_layers(), self.batch_axes.cache

        def run_pass(prefill_rows, target_params, rows, tokens, starts, valid, pools=None):
            """The pass on the rows' caches; pools (paged) = (the state's cache, the rows' page
            tables [r, n]) -> (the new prefill rows, the cache the pass wrote)."""
            cache = take_rows(prefill_rows.cache, cache_axes, rows)
            fresh = (model.init_cache(rows.shape[0], self.capacity) if pools is None
                     else self._prefill_rows_paged_cache(rows.shape[0]))
            cache = jax.tree_util.tree_map(  # a row at 0 starts a new prompt: an empty cache
                lambda axis, old, new: old if axis == NO_BATCH_AXIS else jnp.where(
                    (starts == 0).reshape([-1 if d == axis else 1 for d in range(old.ndim)]), new, old),
                cache_axes, cache, fresh)
            if pools is not None:  # committed at starts (a prefix-cached prompt starts past its shared pages)
                cache = cache.replace(k=pools[0].k, v=pools[0].v, page_table=pools[1], lengths=starts)
            captured = None if prefill_rows.captured is None else prefill_rows.captured[rows]
            cache, captured, last_hidden = prefill_chunk(
                Target(target_params, model), cache, captured, prefill_rows.last_hidden[rows], tokens, starts,
                valid, capture)
            return PrefillRows(  # put_rows keeps the placeholder pools (they have no row axis)
                cache=put_rows(prefill_rows.cache, cache_axes, rows, cache),
                captured=None if captured is None else prefill_rows.captured.at[rows].set(captured),
                last_hidden=prefill_rows.last_hidden.at[rows].set(last_hidden)), cache

        def prefill_pass(prefill_rows, target_params, rows, tokens, starts, valid):
            return run_pass(prefill_rows, target_params, rows, tokens, starts, valid)[0]

        def paged_prefill_pass(state_and_rows, target_params, rows, tokens, starts, valid, page_rows):
            state, prefill_rows = state_and_rows
            prefill_rows, cache = run_pass(prefill_rows, target_params, rows, tokens, starts, valid,
                                           (state.cache, page_rows))
            return state.replace(cache=state.cache.replace(k=cache.k, v=cache.v)), prefill_rows

        fn = prefill_pass if self.kv_pages is None else paged_prefill_pass
        return ("prefill_pass", *args[3].shape), fn, args  # args[3]: tokens [r, W]

    def finish_args(self, state: LoopState, prefill_rows: PrefillRows, row: int, slot: int,
                    params: RequestParams, bucket: int, page_row: Any = None) -> tuple:
        """A finish's arguments: the admit's (`admit_args`), with the prefilled row."""
        admit = self.admit_args(state, slot, params, bucket, page_row)
        return (admit[0], prefill_rows, self.place(np.asarray([row], np.int32)), *admit[1:])

    def finish_prefill(self, bucket: int, args: tuple) -> Any:
        return self._compile(*self.finish_job(bucket, args))

    def finish_job(self, bucket: int, args: tuple) -> tuple[Any, Any, tuple]:
        """(key, function, arguments) of the finish for this prompt bucket: the row's first token,
        its drafter started from the whole prompt, the row put into its slot."""
        model, drafter, capacity, axes, top = self.model, self.widest, self.capacity, self.batch_axes, self.top_logprobs
        depth = self.depth

        def finish_prefill(state, prefill_rows, row, slot, target_params, drafter_params, prompt, prompt_length,
                           key, sampling, max_new, stop_ids, *page_row):
            captured = None if prefill_rows.captured is None else prefill_rows.captured[row][:, : prompt.shape[1]]
            cache = take_rows(prefill_rows.cache, axes.cache, row)
            if page_row:  # paged: the prompt is in the slot's pages already
                cache = cache.replace(k=state.cache.k, v=state.cache.v, page_table=page_row[0])
            started = start_state(Target(target_params, model), drafter, drafter_params, prompt, prompt_length,
                                  prefill_rows.last_hidden[row], captured, cache, key, sampling, max_new,
                                  stop_ids, capacity, top)
            started = with_admitted_depth(started, state, depth)
            merged = merge_row(state, started, slot, axes)
            if page_row:  # the pools have no row axis
                merged = merged.replace(cache=merged.cache.replace(k=started.cache.k, v=started.cache.v))
            return merged

        return ("finish_prefill", bucket), finish_prefill, args


def with_page_table(state: LoopState, page_table: tuple) -> LoopState:
    """The state with its paged cache reading the host's page table (`page_table` = (table,));
    unchanged for `()` (a dense cache)."""
    if not page_table:
        return state
    return state.replace(cache=state.cache.replace(page_table=page_table[0]))


def empty_paged_row(cache: Any, page_row: jax.Array) -> Any:
    """A 1-row empty view of a paged cache: the shared pools, the row's pages page_row [1, n],
    nothing committed (its per-row recurrent states zero)."""
    zero_rows = lambda states: tuple(jnp.zeros_like(x[:1]) for x in states)  # noqa: E731
    # The zero lengths behind a barrier, as `prefill`'s empty cache is (no constant folding).
    lengths = jax.lax.optimization_barrier(jnp.zeros((1,), jnp.int32))
    return cache.replace(page_table=page_row, lengths=lengths, conv=zero_rows(cache.conv),
                         recurrent=zero_rows(cache.recurrent), record=None)


def with_admitted_depth(row: LoopState, state: LoopState, depth: AdaptiveDepth | None) -> LoopState:
    """An admitted request's row with the adaptive policy's record: its acceptance starts from
    what the engine's rows accepted lately (`depth.admitted_row`); the policy's shared leaves
    stay the engine's (`merge_row`). Unchanged when K is fixed."""
    if depth is None:
        return row
    batch, capacity = row.tokens.shape
    fresh = depth.initial_state(batch, capacity, state.depth.costs, sources=state.depth.accepted_ema.shape[1])
    return row.replace(depth=admitted_row(depth, fresh, state.depth))


def with_logprobs_ring(state: LoopState, width: int) -> LoopState:
    """The state with its logprobs buffers (if any) as a ring of `width` slots a row, one chunk's
    read window (`TokenLogprobs.as_ring`): the engine reads every position out before a later one
    lands on its slot, so its memory is [slots, width, top], not [slots, capacity, top]."""
    if state.logprobs is None:
        return state
    return state.replace(logprobs=state.logprobs.as_ring(width, state.lengths))


def merge_row(state: LoopState, row: LoopState, slot: Any, axes: Any) -> LoopState:
    """`state` with slot `slot`'s row of every leaf replaced by the 1-row `row`'s (its logprobs
    laid out as the state's ring), its stats zeroed (the policy's shared leaves and the step
    counter stay)."""
    row = row.replace(stats=jax.tree_util.tree_map(lambda x: jnp.zeros((1,) + x.shape[1:], x.dtype), state.stats))
    if state.logprobs is not None:
        row = with_logprobs_ring(row, state.logprobs.chosen.shape[1])

    def put(axis, full, part):
        if axis == NO_BATCH_AXIS:
            return full
        return jax.lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), slot, axis)

    stats_axes = jax.tree_util.tree_map(lambda _: 0, state.stats)
    merged = jax.tree_util.tree_map(put, axes.replace(stats=stats_axes), state, row)
    return merged.replace(step=state.step)  # the row's key went in with its other leaves
