"""A continuous-batching engine on the chunked loop.

The engine holds one `LoopState` of `slots` rows at a fixed cache capacity. Each `step()`:
  1. frees the slots of cancelled requests and prefills waiting requests into free slots: a 1-row
     `prefill` at the prompt's bucket, scattered into the slot's row of every state leaf (tokens,
     target cache, drafter state, stats) by one jitted, donated update;
     Each admitted row's first token (sampled by its prefill) goes out at once (`admit()`, the
     step's first half, returns it: a server hands it out before the chunk runs, so time to
     first token is the prefill's time, not prefill + a chunk). With `prefill_chunk_tokens`, prompts
     prefill in chunks instead (`prefill_plan`): one pass of at most that many tokens per step,
     several waiting prompts together, a long one over several steps, so running streams never
     wait for more than one such pass;
  2. runs one chunk of up to `chunk_steps` speculative steps over all rows (free rows are `done`
     and write nothing; `decode()`, the step's second half);
  3. reads each row's new tokens and hands them out as `EngineEvent`s; a finished row frees its slot.
Every request brings its own sampling values, max tokens, stop ids and seed (per-row traced
arrays), so requests come and go without recompiling: the programs are one chunk (whatever the
adaptive depth picks) and one admit per prompt bucket (`warmup()` compiles them all up front; `compiles` counts them).

Rows are independent in the loop, so a request's greedy output is the same whether it runs alone
or beside others. Sampled requests are exact in distribution, and reproducible: each row carries
its request's own PRNG key (from its seed, or a fresh one drawn by the engine's own generator when
it has none), folded with the row's committed length at every draw (`loop.draw_keys`); so a seeded
request gives the same tokens whatever runs beside it and whichever slot it gets.

Adaptive depth (`k="adaptive"`, or an `AdaptiveDepth`): the policy `generate` uses
(`spec_jax.decoding.depth`), inside the chunk program: each step of a chunk picks its depth (0 = a
plain step) for the live rows together from their acceptance EMAs and the step costs (measured
once by `depth_costs`, or supplied), with no host round trip and one compiled chunk whatever the
depth. Each row's EMA restarts from the policy's prior when its slot is admitted.

The parts, each testable on its own: `slots.SlotTable` (host-side slot bookkeeping and the
hand-out of new tokens), `scheduler.Scheduler` (waiting requests, cancellations, admissions),
`engine_programs.EnginePrograms` (the state layout and compiled programs).
This module wires them into `Engine`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from spec_jax.decoding import validation
from spec_jax.decoding.depth import AdaptiveDepth, as_adaptive_depth
from spec_jax.decoding.emitted import EmittedWindow, window_width
from spec_jax.decoding.engine_programs import EnginePrograms
from spec_jax.decoding.generate import default_stop_ids, prompt_bucket, round_capacity, stop_id_array, with_k
from spec_jax.decoding.loop import LoopState, check_adaptive, tree_budget
from spec_jax.decoding.pages import PagePool
from spec_jax.decoding.prefill_plan import DEFAULT_PREFILL_ROWS, PrefillPlan
from spec_jax.decoding.programs import CompileTally
from spec_jax.decoding.scheduler import Scheduler
from spec_jax.decoding.slots import Counters, EngineEvent, PositionTotals, RequestParams, RequestStats, SlotTable
from spec_jax.drafters.base import Drafter
from spec_jax.drafters.suffix import host_store, with_store
from spec_jax.models.paged import PAGE_SIZE
from spec_jax.models.resolve import resolve_target
from spec_jax.sharding.placement import gather_to_host

__all__ = ["Engine", "EngineEvent", "RequestParams", "RequestStats"]

DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_MAX_NEW_TOKENS = 128  # generate's default, lowered to what max_model_len leaves
CAPACITY_MULTIPLE = 128  # the engine's multiple for round_capacity (its cache is sized once per server)
# Programs `warmup` compiles at a time. One: on this 2-core CPU, with other work on the machine,
# two threads took as long as one (the default model's 8 programs, cold: 181 s alone, 192 s with 2;
# benchmarks/RESULTS.md, issue 46). A host with idle cores may pass more.
WARMUP_WORKERS = 1
MAX_LOGPROBS = 20  # the most top tokens per position a request may ask for (OpenAI's and vLLM's bound)


def depth_policy(drafter: Drafter | None, k: Any, k_choices: Sequence[int] | None) -> AdaptiveDepth | None:
    """The engine's adaptive depth policy (its depths filled in), or None when K is fixed: `k`
    "adaptive" or an AdaptiveDepth, or `k_choices` (the depths to choose from, 0 = a plain step)."""
    depth = as_adaptive_depth(k)
    if k_choices is not None:
        if k is not None:
            raise ValueError("give k or k_choices, not both (k_choices = the adaptive policy's depths).")
        depths = [validation.check_int("k_choices entry", d, minimum=0) for d in k_choices]
        if not depths:
            raise ValueError("k_choices is empty: give the depths to choose from, e.g. (0, 2, 4).")
        depth = AdaptiveDepth(depths=tuple(depths))
    if depth is not None and drafter is None:
        raise ValueError("an adaptive depth needs a drafter: plain decoding has no depth to choose.")
    # Throughput: a finished slot takes the next request, so every row's tokens count alike.
    return None if depth is None else depth.for_k(drafter.k).for_entry("throughput")


def model_length_and_capacity(max_model_len: Any, pass_max: int, max_positions: int) -> tuple[int, int]:
    """(max_model_len, cache capacity): the most prompt + new tokens one request may use (default
    min(1024, what the model's positions leave)), and the slots a row needs for it plus one verify
    pass of `pass_max` tokens, rounded up to CAPACITY_MULTIPLE."""
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, max_positions - pass_max - 1)
    max_model_len = validation.check_int("max_model_len", max_model_len, minimum=2)
    if max_model_len + pass_max + 1 > max_positions:
        raise ValueError(
            f"max_model_len {max_model_len} + K={pass_max} + 1 exceeds the model's "
            f"{max_positions} positions; lower max_model_len to {max_positions - pass_max - 1} or less."
        )
    capacity = round_capacity(max_model_len + pass_max + 1, CAPACITY_MULTIPLE)
    return max_model_len, min(capacity, max_positions)


def check_cache_options(model: Any, drafter: Drafter | None, mesh: Any, prefill_chunk_tokens: Any, kv_pages: Any,
                        page_size: Any, prefix_caching: bool) -> None:
    """Chunked prefill and the paged cache's settings (`kv_pages`, `prefix_caching`), checked
    before anything compiles."""
    if prefill_chunk_tokens is not None and mesh is not None:
        raise ValueError("chunked prefill (prefill_chunk_tokens) does not run on a mesh yet; "
                         "leave prefill_chunk_tokens unset with mesh=.")
    if prefix_caching and kv_pages is None:
        raise ValueError("prefix_caching shares KV pages: give kv_pages too (spec-jax serve --kv-pages N).")
    if kv_pages is None:
        return
    validation.check_int("kv_pages", kv_pages, minimum=1)
    page_size = validation.check_int("kv_page_size", page_size, minimum=1)
    if CAPACITY_MULTIPLE % page_size:
        raise ValueError(f"kv_page_size {page_size} must divide {CAPACITY_MULTIPLE} (the live attention's block "
                         "and the engine's capacity multiple); use 128, 64, 32, ...")
    if mesh is not None:
        raise ValueError("a paged KV cache (kv_pages) does not run on a mesh yet: its pool has no row axis to "
                         "split over `data`; leave kv_pages unset with mesh=.")
    if not callable(getattr(model, "init_paged_cache", None)):
        raise ValueError(f"kv_pages needs a target whose cache can be paged; {type(model).__name__} offers no "
                         "`init_paged_cache` (spec_jax's own decoder does): leave kv_pages unset for this target.")
    if prefix_caching:  # the shared pages hold keys/values only: nothing else of the prompt is cached
        if drafter is not None and drafter.capture_layers:
            raise ValueError(f"prefix caching keeps the prompt's keys/values only, and {type(drafter).__name__} "
                             "starts from the prompt's captured hidden states; leave prefix_caching off with it.")
        if jax.eval_shape(lambda: model.init_paged_cache(1, page_size, 1, page_size)).conv:
            raise ValueError("prefix caching keeps keys/values only, and this target's recurrent layers keep a "
                             "state per row; leave prefix_caching off with it.")


@dataclasses.dataclass
class WarmupReport(CompileTally):
    """`Engine.warmup`'s: what it compiled (`CompileTally`), and the programs it then ran once and
    the seconds that took."""

    programs_run: int = 0
    run_seconds: float = 0.0

    def summary(self) -> str:
        ran = f"; ran {self.programs_run} once in {self.run_seconds:.1f}s" if self.programs_run else ""
        return super().summary() + ran


def host_leaves(tree: Any) -> Any:
    """`tree`'s arrays copied to the host (whatever their sharding)."""
    return jax.tree_util.tree_map(np.asarray, gather_to_host(tree))


def put_like(host: np.ndarray, like: jax.Array) -> jax.Array:
    """`host` as an array placed as `like` is (over every process's devices, if it spans several)."""
    return jax.make_array_from_callback(host.shape, like.sharding, lambda index: host[index])


class Engine:
    """Continuous batching over `slots` rows; see the module docstring.

        engine = Engine(target, drafter, drafter_params, slots=8, max_model_len=1024)
        rid = engine.submit(prompt_ids, max_new_tokens=64)
        while engine.has_work():
            for event in engine.step():
                ...  # event.request_id, event.new_ids, event.finish_reason

    A server that streams calls `admit()` and `decode()` (a step's halves) and hands out
    `admit()`'s events first: new requests' first tokens then do not wait for the chunk.

    target: as `generate` takes it. drafter: None for plain decoding, else any Drafter. k: None
    (the drafter's K), an int (pins K), "adaptive" or an `AdaptiveDepth` (each step of a chunk picks
    its depth, as `generate(k="adaptive")` does; costs measured once per configuration unless the
    policy carries them); k_choices: shorthand for `AdaptiveDepth(depths=k_choices)`.
    max_model_len: the most prompt + new tokens one request may use (default min(1024, the
    model's positions)). max_admits_per_step: prefills between two chunks
    (default: fill every free slot; a bound caps the pause running streams see while new
    requests are admitted, at the cost of their time to first token). mesh / sharding_rules: as
    `generate`'s; the state's rows are split over `data`. seed: where the fresh seeds of requests
    that bring none come from. max_logprobs: None (requests cannot ask for logprobs), or the
    most top tokens per position a request may ask for (`decoding.logprobs`: the target's
    log-probabilities, kept by the loop only for rows that ask). prefill_chunk_tokens: None (each
    admitted prompt prefills in one pass while running streams wait), or the most prompt tokens
    (padding included, >= 16) one step prefills: waiting prompts, up to `prefill_rows` of them,
    prefill together in one pass per step, a long one in chunks between decode chunks, so running
    streams never wait longer than one such pass (`prefill_plan`; it keeps `prefill_rows` extra
    rows of target cache, or with kv_pages writes each prompt into its slot's pages, granted for
    the whole prompt when it starts). kv_pages: None (each slot holds a dense target cache of the whole
    capacity), or the target's cache is a shared pool of that many pages of `kv_page_size` slots
    (`spec_jax.models.paged`): a request takes pages as it grows and gives them back when it
    ends, so the same memory holds many more short requests; a request waits in the queue until
    the pool covers its worst case (`decoding.pages`; `pages` is the pool). Drafter caches stay
    dense per slot. prefix_caching (with kv_pages): whole pages of a prompt prefix already in the
    pool are shared, read-only and reference-counted, by later requests instead of being
    prefilled again (`decoding.pages`; `prefill_tokens_saved` counts the tokens). `submit` and
    `cancel` may be called from other threads.

    Its parts: `slot_table` (which request holds which row, host side: `live`, `slot_of`),
    `scheduler` (waiting requests, cancellations, admissions, `max_admits_per_step`), `programs`
    (the state layout, the placed weights and the compiled programs), `depth` (the adaptive
    policy, None when K is fixed), `depth_counts` (steps run at each depth) and `shadow_probes`.
    """

    def __init__(
        self,
        target: Any,
        drafter: Drafter | None = None,
        drafter_params: Any = None,
        *,
        slots: int = 8,
        max_model_len: int | None = None,
        chunk_steps: int = 4,
        k: int | str | AdaptiveDepth | None = None,
        k_choices: Sequence[int] | None = None,
        max_admits_per_step: int | None = None,
        mesh: Any = None,
        sharding_rules: Any = None,
        seed: int = 0,
        max_logprobs: int | None = None,
        prefill_chunk_tokens: int | None = None,
        prefill_rows: int = DEFAULT_PREFILL_ROWS,
        kv_pages: int | None = None,
        kv_page_size: int = PAGE_SIZE,
        prefix_caching: bool = False,
    ):
        resolved, _ = resolve_target(target)
        self.model = resolved.model
        self.default_stop_ids = default_stop_ids(target)
        self.slots = validation.check_int("slots", slots, minimum=1)
        self.chunk_steps = validation.check_int("chunk_steps", chunk_steps, minimum=1)
        if max_admits_per_step is not None:
            max_admits_per_step = validation.check_int("max_admits_per_step", max_admits_per_step, minimum=1)
        if max_logprobs is not None:
            max_logprobs = validation.check_int("max_logprobs", max_logprobs, minimum=0, maximum=MAX_LOGPROBS)
        self.max_logprobs = max_logprobs
        validation.check_mesh(mesh)
        self.prefill_plan = None if prefill_chunk_tokens is None else PrefillPlan(prefill_chunk_tokens, prefill_rows)
        check_cache_options(self.model, drafter, mesh, prefill_chunk_tokens, kv_pages, kv_page_size, prefix_caching)
        drafter_params = with_store(drafter, drafter_params)
        validation.check_drafter_params(drafter, drafter_params)
        # A suffix drafter's store of finished requests' text: one per engine, read by every chunk.
        self.suffix_store = host_store(drafter, drafter_params)
        self.mesh = mesh
        self.depth = depth_policy(drafter, k, k_choices)
        if self.depth is not None:
            if mesh is not None:
                raise ValueError("the adaptive depth does not run on a mesh yet; pin K (an int k) with mesh=.")
            drafter = with_k(drafter, self.depth.max_depth)
            check_adaptive(drafter, self.depth)
        else:
            drafter = with_k(drafter, validation.check_k(k))
        self.k = drafter.k if drafter is not None else 0  # the fixed K, or the adaptive policy's largest depth
        self.drafters: dict[int, Drafter | None] = {self.k: drafter}
        # Slots one verify pass writes past the last committed token: K, or N for a tree drafter.
        pass_max = max(self.k, tree_budget(drafter))
        self.max_model_len, self.capacity = model_length_and_capacity(
            max_model_len, pass_max, int(self.model.max_positions))
        self.window_width = window_width(self.chunk_steps, pass_max, self.capacity)  # what a chunk's read holds
        for d in self.drafters.values():
            if d is not None:
                d.validate(self.model, self.capacity)
        self.programs = EnginePrograms(self.model, self.drafters, resolved.params, drafter_params,
                                       capacity=self.capacity, slots=self.slots, mesh=mesh, kv_pages=kv_pages,
                                       sharding_rules=sharding_rules, top_logprobs=max_logprobs, page_size=kv_page_size,
                                       depth=None if self.depth is None else self.depth.static(),
                                       prefill_rows=None if self.prefill_plan is None else self.prefill_plan.rows,
                                       read_width=self.window_width)
        self._init_pages(kv_pages, kv_page_size, prefix_caching, pass_max)
        depth_costs = None
        if self.depth is not None:
            depth_costs = self.depth.costs or self._measure_depth_costs(target, drafter, drafter_params)
            self.depth = dataclasses.replace(self.depth, costs=tuple(depth_costs))
        self.state: LoopState = self.programs.initial_state(depth_costs)
        self.prefill_state = None if self.prefill_plan is None else self.programs.initial_prefill_rows()
        # Seeds for requests that bring none (each gets a fresh one; the engine's seed makes a batch run repeatable).
        self._fresh_seeds = np.random.default_rng(validation.check_int("seed", seed, minimum=0,
                                                                       maximum=validation.SEED_MAX))
        self._seed_lock = threading.Lock()
        self.slot_table = SlotTable(self.slots)
        self.scheduler = Scheduler(max_admits_per_step)
        self._init_counters()

    def _init_counters(self) -> None:
        """What the engine has run, for `/metrics` and benchmarks (plain ints and counters)."""
        self.k_chunks: collections.Counter[int] = collections.Counter()  # chunks run per K
        self.depth_counts: collections.Counter[int] = collections.Counter()  # steps run per depth (adaptive)
        self.chunks_run = self.shadow_probes = 0  # chunks run; shadow probes (adaptive, greedy chains)
        # Verify steps the chunks ran (the state's step counter), and the wall seconds from each
        # chunk's dispatch to its results on the host: chunk_seconds / decode_steps is the decode
        # step as the engine runs it, to set beside `generate`'s (the rest of a run's wall is
        # admitting requests and the host's bookkeeping).
        self.decode_steps, self.chunk_seconds = 0, 0.0
        self.positions = PositionTotals()  # drafts offered and accepted per position (/metrics)
        self.prefill_passes: collections.Counter[tuple[int, int]] = collections.Counter()  # passes run per [r, W]

    def _init_pages(self, kv_pages: int | None, page_size: int, prefix_caching: bool, pass_max: int) -> None:
        """The paged cache's host side: the pool (None: dense caches), the most slots one chunk can
        write past a row's committed tokens, each row's tokens at the last read."""
        self.pages = None if kv_pages is None else PagePool(kv_pages, page_size, self.slots,
                                                             self.capacity // page_size, prefix_caching)
        self.prefill_tokens_saved = 0  # prompt tokens prefix caching did not prefill again
        self.chunk_overshoot = self.chunk_steps * (pass_max + 1)
        self._row_lengths = np.zeros((self.slots,), np.int64)

    def _measure_depth_costs(self, target: Any, drafter: Drafter, drafter_params: Any) -> tuple[float, ...]:
        """Each depth's step time at this engine's batch and capacity, as `generate` measures it
        (`depth_costs.costs_for`: its adaptive loop at `slots` rows, timed once per device kind,
        model and batch bucket, then read from the cache file)."""
        from spec_jax.decoding.depth_costs import NEW_TOKENS, costs_for
        from spec_jax.decoding.generate import compiled_loop, prepare_inputs

        prompt = [0] * min(4, self.max_model_len - 1)
        call = prepare_inputs(target, [prompt] * self.slots, drafter, drafter_params, k=self.depth,
                              capacity=self.capacity, ignore_eos=True,
                              max_new_tokens=min(NEW_TOKENS, self.max_model_len - len(prompt)))
        compiled, _ = compiled_loop(call.target.model, call.drafter, call.capacity, call.inputs, None, call.depth)
        return costs_for(compiled, call)

    @property
    def compiles(self) -> int:
        """Programs this engine compiled (the chunk, admits per bucket; not shared ones)."""
        return self.programs.compiles

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt_ids: Sequence[int], **request_values: Any) -> RequestParams:
        """A request's values, checked (ArgumentError naming the field) before it is queued.

        request_values: max_new_tokens (default 128, or what max_model_len leaves after the
        prompt when that is less), temperature, top_k, top_p, seed (None or absent: a fresh
        one), stop_ids, ignore_eos, as `generate` takes them; logprobs (None, or N: each new
        token's log-probability and the N most likely there, N <= the engine's max_logprobs)."""
        (prompt,) = validation.check_prompts([prompt_ids], self.model.vocab_size)
        logprobs = request_values.pop("logprobs", None)
        if logprobs is not None and self.max_logprobs is None:
            raise validation.ArgumentError(
                "logprobs", "logprobs: this engine keeps no log-probabilities; build it with "
                "Engine(max_logprobs=N) (spec-jax serve --max-logprobs N).")
        if logprobs is not None:
            logprobs = validation.check_int("logprobs", logprobs, minimum=0, maximum=self.max_logprobs)
        seed = request_values.pop("seed", None)  # None: `submit` gives it a fresh one
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise validation.ArgumentError(
                "prompts", f"prompts: the prompt's {len(prompt)} tokens leave no room for a new token under the "
                f"engine's max_model_len {self.max_model_len}; shorten the prompt or raise max_model_len.")
        request_values.setdefault("max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, room))
        request_values["seed"] = 0 if seed is None else seed
        values = validation.check_request_values(self.default_stop_ids, **request_values)
        total = len(prompt) + values.max_new_tokens
        if total > self.max_model_len:
            raise validation.ArgumentError(
                "max_new_tokens",
                f"max_new_tokens: the prompt's {len(prompt)} tokens + max_new_tokens="
                f"{values.max_new_tokens} = {total} exceeds the engine's max_model_len "
                f"{self.max_model_len}; shorten the prompt or lower max_new_tokens.",
            )
        params = RequestParams.of(prompt, values, logprobs=logprobs)
        if self.pages is not None and self.pages.pages_for(self.worst_tokens(params)) > self.pages.num_pages:
            raise validation.ArgumentError(
                "max_new_tokens", f"max_new_tokens: the prompt's {len(prompt)} tokens + max_new_tokens="
                f"{values.max_new_tokens} need {self.pages.pages_for(self.worst_tokens(params))} KV pages and the "
                f"engine's pool has {self.pages.num_pages}; lower max_new_tokens or raise kv_pages.")
        return params if seed is not None else dataclasses.replace(params, seed=None)

    def worst_tokens(self, params: RequestParams) -> int:
        """The most cache slots a request can write: its prompt and new tokens, and one chunk's
        overshoot past them (paged: what `PagePool.reserve` sets aside)."""
        return len(params.prompt_ids) + params.max_new_tokens + self.chunk_overshoot

    def submit(self, prompt_ids: Sequence[int], **kwargs: Any) -> int:
        """Queue a request (see `check_request` for the keywords, or pass `params=` already
        checked) -> its id."""
        params = kwargs.pop("params", None) or self.check_request(prompt_ids, **kwargs)
        if params.seed is None:  # unseeded: a fresh seed, so that two such requests differ
            with self._seed_lock:
                params = dataclasses.replace(params, seed=int(self._fresh_seeds.integers(validation.SEED_MAX + 1)))
        return self.scheduler.submit(params, time.perf_counter())

    def cancel(self, request_id: int) -> None:
        """Stop a request: a waiting one is dropped, a running one's slot is freed before the next
        chunk. Its last event has finish_reason "cancelled". A request that has finished already
        is left as it is; an id `submit` never returned is an ArgumentError (a ValueError)."""
        self.scheduler.cancel(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work(bool(self.slot_table.running or self.prefill_plan and self.prefill_plan.active))

    @property
    def num_live(self) -> int:
        """Slots held by a request: running, or (chunked prefill) reserved while its prompt prefills."""
        return len(self.slot_table.running) + (0 if self.prefill_plan is None else len(self.prefill_plan.active))

    @property
    def open_slots(self) -> int:
        """Slots that waiting (and new) requests could take at the next step: the free ones; with a
        paged cache, only as many as the waiting requests (first come, first served) the pool
        covers now, or every free one when it covers them all with pages to spare (the serve
        queue's bound counts the rest as waiting)."""
        free = self.slots - self.num_live
        if self.pages is None:
            return free
        spare, waiting = self.pages.free - self.pages.owed(), self.scheduler.waiting_params()[:free]
        for admitted, params in enumerate(waiting):
            spare -= self.pages.pages_for(self.worst_tokens(params))
            if spare < 0:  # the pool stops the queue here: nothing behind it goes in either
                return admitted
        return free if spare > 0 else len(waiting)

    # ------------------------------------------------------------------ the loop
    def warmup(self, prompt_lengths: Sequence[int] | None = None, workers: int = WARMUP_WORKERS,
               run: bool = True) -> WarmupReport:
        """Compile every program requests can need: the chunk, and one admit per prompt bucket
        (with chunked prefill: one finish per bucket, and every prefill pass shape) (of
        `prompt_lengths`, default every bucket a request can reach: prompts of
        1 .. max_model_len - 1 tokens), `workers` programs at a time; then (`run`, on an idle
        engine) run each of them once (`_run_each_once`: a program's first run costs more than
        its later ones) -> what this call compiled (programs, wall seconds, persistent-cache hits;
        programs an engine of the same configuration compiled before are reused and not counted)
        and ran."""
        t0 = time.perf_counter()
        before = dataclasses.replace(self.programs.tally)
        if prompt_lengths is None:  # one length per bucket, up to the longest prompt's
            top, prompt_lengths = prompt_bucket(self.max_model_len - 1), [1]
            while prompt_bucket(prompt_lengths[-1]) < top:
                prompt_lengths.append(2 * prompt_bucket(prompt_lengths[-1]))
        buckets = sorted({min(prompt_bucket(n), self.capacity) for n in prompt_lengths})
        probe = RequestParams(prompt_ids=(0,), max_new_tokens=1)
        table = None if self.pages is None else self.pages.table
        jobs = [self.programs.chunk_job(self.k, self.programs.chunk_args(self.state, self.slot_table,
                                                                         self.chunk_steps, table))]
        jobs += [self.programs.window_job(self.window_width, args) for args in self._window_args_each()]
        plan = self.prefill_plan
        for bucket in buckets:
            if plan is None and self.pages is not None and self.pages.prefix_caching:
                jobs.append(self.programs.admit_after_prefix_job(bucket, self.programs.admit_after_prefix_args(
                    self.state, 0, probe, bucket, table[0], 0)))
            if plan is None:
                jobs.append(self.programs.admit_job(bucket, self.programs.admit_args(
                    self.state, 0, probe, bucket, None if table is None else table[0])))
            else:
                jobs.append(self.programs.finish_job(bucket, self.programs.finish_args(
                    self.state, self.prefill_state, 0, 0, probe, bucket, None if table is None else table[0])))
        for rows, width in [] if plan is None else plan.shapes():
            jobs.append(self.programs.prefill_pass_job(self.programs.prefill_pass_args(
                self.prefill_state, np.arange(rows), np.zeros((rows, width)), np.zeros((rows,)), np.zeros((rows,)),
                self.state, None if table is None else table[:rows])))
        self.programs.compile_all(jobs, workers)
        compiled = self.programs.tally.since(before, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ran = self._run_each_once(buckets) if run else 0
        return WarmupReport(**compiled.to_dict(), programs_run=ran, run_seconds=time.perf_counter() - t0 if ran else 0.0)

    def _run_each_once(self, buckets: Sequence[int]) -> int:
        """Run the chunk and each bucket's admit (chunked prefill: each pass shape and each
        bucket's finish) once, on slot 0, so that no request pays a program's first run: on
        XLA:CPU that run took ~0.3 s more than later ones per program of the default model
        (benchmarks/RESULTS.md, session 38). Only on an idle engine (busy: 0, nothing run).
        Afterwards the state is as it was, but for slot 0's row (and the prefill rows), which the
        next admit there writes anew; with pages, an idle slot's table row holds no page, so its
        writes drop. -> programs run."""
        if self.has_work() or self.slot_table.running:
            return 0
        shared = host_leaves((self.state.step, self.state.depth))  # what every row shares (the chunk counts)
        probe = RequestParams(prompt_ids=(0,), max_new_tokens=2)  # its chunk step runs the loop body
        table, programs, plan = None if self.pages is None else self.pages.table, self.programs, self.prefill_plan
        page_row = None if table is None else table[0]
        ran = 0
        for rows, width in [] if plan is None else plan.shapes():
            args = programs.prefill_pass_args(self.prefill_state, np.arange(rows), np.zeros((rows, width)),
                                              np.zeros((rows,)), np.ones((rows,)), self.state,
                                              None if table is None else table[:rows])
            if self.pages is None:
                self.prefill_state = programs.prefill_pass(args)(*args)
            else:
                self.state, self.prefill_state = programs.prefill_pass(args)(*args)
            ran += 1
        for bucket in buckets:
            if plan is not None:
                args = programs.finish_args(self.state, self.prefill_state, 0, 0, probe, bucket, page_row)
                self.state, ran = programs.finish_prefill(bucket, args)(*args), ran + 1
                continue
            if self.pages is not None and self.pages.prefix_caching:
                args = programs.admit_after_prefix_args(self.state, 0, probe, bucket, page_row, 0)
                self.state, ran = programs.admit_after_prefix(bucket, args)(*args), ran + 1
            args = programs.admit_args(self.state, 0, probe, bucket, page_row)
            self.state, ran = programs.admit(bucket, args)(*args), ran + 1
        rows = SlotTable(self.slots)  # slot 0 running the probe, in a table of its own
        rows.occupy(0, -1, probe, stop_id_array(()), 0.0)
        args = programs.chunk_args(self.state, rows, 1, table)
        self.state, _ = programs.chunk(self.k, args)(*args)
        step, depth = jax.tree_util.tree_map(put_like, shared, (self.state.step, self.state.depth))
        self.state = self.state.replace(step=step, depth=depth)
        reads = [programs.window(self.window_width, args)(*args) for args in self._window_args_each()]
        jax.block_until_ready((self.state, reads))
        return ran + 1 + len(reads)

    def _window_args_each(self) -> list[tuple]:
        """The window read's arguments without logprobs, and with them when requests may ask."""
        wanted = [False] if self.max_logprobs is None else [False, True]
        return [self.programs.window_args(self.state, with_logprobs) for with_logprobs in wanted]

    def step(self) -> list[EngineEvent]:
        """Admit, run one chunk, hand out new tokens (`admit()` then `decode()`); see the module
        docstring."""
        return self.admit() + self.decode()

    def admit(self) -> list[EngineEvent]:
        """A step's first half: cancellations, then waiting requests prefilled into free slots ->
        the cancelled requests' events and each admitted request's first token (its prefill's).
        A server hands these out before it calls `decode()`, so a request's first token waits for
        its prefill only, not for the chunk after it."""
        events = self._cancel_requests()
        self._release_pages()
        admitted = self._admit_waiting() if self.prefill_plan is None else self._prefill_waiting()
        if admitted:
            window = EmittedWindow.of(self._host(self._read_window(admitted)))
            now = time.perf_counter()
            events += [self.slot_table.hand_out_first(slot, window, now) for slot in admitted]
        return events

    def decode(self) -> list[EngineEvent]:
        """A step's second half: one chunk over the running rows -> their new tokens and
        finishes (nothing when no row runs)."""
        return self._run_chunk() if self.slot_table.running else []

    def _cancel_requests(self) -> list[EngineEvent]:
        cancelled, dropped = self.scheduler.take_cancelled()
        events = [EngineEvent(rid, [], "cancelled", RequestStats(len(params.prompt_ids))) for rid, params in dropped]
        for rid in cancelled:
            prefilling = None if self.prefill_plan is None else self.prefill_plan.drop(rid)
            if prefilling is not None:
                events.append(EngineEvent(rid, [], "cancelled", RequestStats(len(prefilling.params.prompt_ids))))
            slot = self.slot_table.slot_of.get(rid)
            if slot is not None:
                events.append(EngineEvent(rid, [], "cancelled", self.slot_table.release(slot).stats))
        return events

    def _admit_waiting(self) -> list[int]:
        """Prefill waiting requests into free slots -> the slots admitted."""
        claim, shared = self._page_claim()
        admissions = self.scheduler.admissions(self.slot_table.free_slots(), claim)
        for slot, rid, params, submitted_at in admissions:
            bucket = min(prompt_bucket(len(params.prompt_ids)), self.capacity)
            self._row_lengths[slot] = len(params.prompt_ids) + 1
            if self.pages is None:
                args = self.programs.admit_args(self.state, slot, params, bucket)
                self.state = self.programs.admit(bucket, args)(*args)
            else:
                self._admit_paged(slot, params, bucket, len(shared[slot]) * self.pages.page_size)
            self.slot_table.occupy(slot, rid, params, stop_id_array(params.stop_ids), submitted_at)
            self.positions.restart(slot)
        return [slot for slot, *_ in admissions]

    def _page_claim(self) -> tuple[Any, dict[int, list[int]]]:
        """(the scheduler's claim: whether the pool covers a request's worst case beside the running
        ones', its cached prefix pages shared; the shared pages it took, by slot), (None, {}) dense."""
        shared: dict[int, list[int]] = {}
        if self.pages is None:
            return None, shared

        def claim(slot: int, params: RequestParams) -> bool:
            shared[slot] = self.pages.prefix_pages(params.prompt_ids)
            return self.pages.reserve(slot, self.worst_tokens(params), shared[slot])

        return claim, shared

    def _admit_paged(self, slot: int, params: RequestParams, bucket: int, start: int) -> None:
        """Prefill a request into its pages: the whole prompt, or (prefix caching) the part after
        the `start` slots its shared pages hold."""
        self.pages.grow(slot, len(params.prompt_ids) + 1)  # the pages its prompt and first token fill
        page_row = self.pages.table[slot]
        if start:
            args = self.programs.admit_after_prefix_args(self.state, slot, params, bucket, page_row, start)
            self.state = self.programs.admit_after_prefix(bucket, args)(*args)
            self.prefill_tokens_saved += start
        else:
            args = self.programs.admit_args(self.state, slot, params, bucket, page_row)
            self.state = self.programs.admit(bucket, args)(*args)
        self.pages.register(slot, params.prompt_ids)

    def _prefill_waiting(self) -> list[int]:
        """Chunked prefill: waiting requests into free prefill rows (each reserving a free slot),
        one prefill pass over the rows in progress, and the rows it completed into their slots
        -> the slots admitted."""
        plan = self.prefill_plan
        reserved = plan.reserved_slots
        free = [slot for slot in self.slot_table.free_slots() if slot not in reserved]
        claim, shared = self._page_claim()
        for slot, rid, params, submitted_at in self.scheduler.admissions(free[: len(plan.free_rows())], claim):
            started = plan.start(rid, params, submitted_at, slot)
            if self.pages is not None:
                # The prompt's pages (and its first token's) up front: its reservation holds them
                # anyway, and the table stays fixed while its chunks run. Shared prefix pages are
                # committed already: its chunks start after them.
                self.pages.grow(slot, len(params.prompt_ids) + 1)
                started.done = len(shared[slot]) * self.pages.page_size
                self.prefill_tokens_saved += started.done
        chunk = plan.next_pass()
        if chunk is None:
            return []
        page_rows = None
        if self.pages is not None:  # each row's slot's pages (padding rows: none, their writes dropped)
            page_rows = np.full((len(chunk.rows), self.pages.pages_per_row), self.pages.num_pages, np.int32)
            for i, row in enumerate(chunk.rows.tolist()):
                if row in plan.active:
                    page_rows[i] = self.pages.table[plan.active[row].slot]
        args = self.programs.prefill_pass_args(self.prefill_state, chunk.rows, chunk.tokens, chunk.starts, chunk.valid,
                                               self.state, page_rows)
        if self.pages is None:
            self.prefill_state = self.programs.prefill_pass(args)(*args)
        else:
            self.state, self.prefill_state = self.programs.prefill_pass(args)(*args)
        self.prefill_passes[chunk.tokens.shape] += 1
        admitted = []
        for p in plan.advance(chunk):
            bucket = min(prompt_bucket(len(p.params.prompt_ids)), self.capacity)
            page_row = None
            if self.pages is not None:
                page_row = self.pages.table[p.slot]
                self.pages.register(p.slot, p.params.prompt_ids)
                self._row_lengths[p.slot] = len(p.params.prompt_ids) + 1
            args = self.programs.finish_args(self.state, self.prefill_state, p.row, p.slot, p.params, bucket,
                                             page_row)
            self.state = self.programs.finish_prefill(bucket, args)(*args)
            self.slot_table.occupy(p.slot, p.rid, p.params, stop_id_array(p.params.stop_ids), p.submitted_at)
            self.positions.restart(p.slot)
            admitted.append(p.slot)
        return admitted

    def _read_window(self, slots: Any) -> Any:
        """After admits: each row's last `window_width` buffer positions, read on device
        (`decoding.emitted`: the host fetches what it has not handed out, not the whole buffers),
        with the logprobs buffers' when a request in `slots` asked for them. (The chunk returns
        its own read.)"""
        args = self.programs.window_args(self.state, self.slot_table.wanting_logprobs(slots))
        return self.programs.window(self.window_width, args)(*args)

    def _host(self, tree: Any) -> Any:
        return gather_to_host(tree) if self.mesh is not None else jax.device_get(tree)

    def _run_chunk(self) -> list[EngineEvent]:
        """One chunk over every row -> each request's new tokens (and finish)."""
        table = None
        if self.pages is not None:  # each running row gets the pages this chunk can write
            for slot in self.slot_table.running:
                self.pages.grow(slot, int(self._row_lengths[slot]) + self.chunk_overshoot)
            table = self.pages.table
            if self.prefill_plan is not None and self.prefill_plan.active:
                # A row still prefilling holds its prompt's pages, but the chunk runs its (done) row
                # too, writing at its stale length: it sees no pages until it starts.
                table = table.copy()
                table[sorted(self.prefill_plan.reserved_slots)] = self.pages.num_pages
        started = time.perf_counter()
        args = self.programs.chunk_args(self.state, self.slot_table, self.chunk_steps, table)
        self.state, read = self.programs.chunk(self.k, args)(*args)
        state = self.state
        if not self.slot_table.wanting_logprobs(self.slot_table.running):
            read = (*read[:2], None)  # the logprobs' window stays on the device
        window, lengths, finish, done, stats, depth_counts, steps = self._host(
            (read, state.lengths, state.finish_reason, state.done, state.stats,
             None if state.depth is None else (state.depth.counts, state.depth.shadows), state.step))
        self.chunk_seconds += time.perf_counter() - started
        self.decode_steps = int(steps)  # admits keep the counter: it counts the chunks' steps only
        self.chunks_run += 1
        self.k_chunks[self.k] += 1
        if depth_counts is not None:  # the state's totals since the engine started
            depth_counts, self.shadow_probes = depth_counts[0], int(depth_counts[1])
            self.depth_counts = collections.Counter({d: int(n) for d, n in zip(self.depth.depths, depth_counts) if n})
        self.positions.add(stats.steps, stats.position_accepted)
        if self.suffix_store is not None:
            self._feed_suffix_store(lengths, done)
        self._row_lengths[:] = lengths
        events, _ = self.slot_table.collect(EmittedWindow.of(window), lengths, finish, done,
                                            Counters.of_rows(stats, self.k), time.perf_counter())
        self._release_pages()
        return events

    def _release_pages(self) -> None:
        """Free slots' pages back to the pool (finished and cancelled requests)."""
        if self.pages is None:
            return
        prefilling = set() if self.prefill_plan is None else self.prefill_plan.reserved_slots
        for slot in np.flatnonzero(self.pages.reserved).tolist():
            if slot not in self.slot_table.running and slot not in prefilling:
                self.pages.release(slot)

    def _feed_suffix_store(self, lengths: Any, done: Any) -> None:
        """Finished requests' prompt + output go into the suffix drafter's store (a new array of the
        same shape: the next chunk reads it without recompiling)."""
        finished = [slot for slot in self.slot_table.running if done[slot]]
        tokens = self._host(self.state.tokens) if finished else None  # whole rows, read only as requests end
        for slot in finished:
            self.suffix_store.add(tokens[slot, : lengths[slot]])
        if finished:
            store = self.programs.place(self.suffix_store.array())
            self.programs.drafter_params = self.programs.drafter_params.replace(suffix_store=store)

    def run_all(self) -> dict[int, EngineEvent]:
        """Step until every queued request has finished -> each request's tokens and stats as one
        event per request (a convenience for tests and batch use)."""
        out: dict[int, EngineEvent] = {}
        while self.has_work():
            for e in self.step():
                got = out.setdefault(e.request_id, EngineEvent(e.request_id, []))
                got.new_ids += e.new_ids
                got.finish_reason, got.stats = e.finish_reason, e.stats
        return out
