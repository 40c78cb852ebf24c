"""Host-side `generate`, in pieces a streaming or serving loop reuses: `prepare_inputs` (check
everything a user can get wrong, resolve stop ids, pad to buckets), `place_generate_inputs` (a
mesh), `compiled_loop` (compile once per static configuration and shape), `unpack` (device
output -> Python lists and stats). `make_generate_fn` gives the pure function behind it all for
a user's own `jax.jit`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding import saved_programs, validation
from spec_jax.decoding.depth import AdaptiveDepth, as_adaptive_depth, check_costs
from spec_jax.decoding.loop import (
    FINISH_NAMES,
    MAX_STOP_IDS,
    GenerateOutput,
    LoopInputs,
    generate_jit,
    generate_loop,
)
from spec_jax.decoding.loop import check_adaptive, pass_drafts
from spec_jax.decoding.programs import ProgramCache
from spec_jax.drafters.base import Drafter
from spec_jax.drafters.suffix import with_store
from spec_jax.drafters.tree import tree_budget as tree_budget_of
from spec_jax.models.interface import Target, TargetModel
from spec_jax.models.resolve import as_target_model, resolve_target
from spec_jax.sampling import SamplingParams
from spec_jax.sharding.placement import gather_to_host

MIN_PROMPT_BUCKET = 16
CAPACITY_BUCKET = 256


def prompt_bucket(length: int) -> int:
    """Prompts are right-padded to a power of two (>= 16) so a new length rarely recompiles."""
    bucket = MIN_PROMPT_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


def round_capacity(slots: int, multiple: int) -> int:
    """The one capacity rounding: `slots` rounded up to a multiple of `multiple`. `generate` uses
    CAPACITY_BUCKET (256: coarse, so a new max_new_tokens rarely recompiles); the engine sizes its
    cache once per server and uses a finer multiple (less memory per slot)."""
    return -(-slots // multiple) * multiple


def default_capacity(bucket: int, max_new_tokens: int, k: int, multiple: int = CAPACITY_BUCKET) -> int:
    return round_capacity(bucket + max_new_tokens + k + 1, multiple)


@dataclasses.dataclass(frozen=True)
class RowStats:
    steps: int
    drafted: int
    accepted: int
    emitted: int
    tau: float  # mean tokens committed per verify step, correction/bonus included
    acceptance_histogram: list[int]
    position_acceptance: list[float]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _row_stats(steps, drafted, accepted, emitted, histogram, position_accepted) -> RowStats:
    steps = int(steps)
    return RowStats(
        steps=steps,
        drafted=int(drafted),
        accepted=int(accepted),
        emitted=int(emitted),
        tau=float(emitted) / steps if steps else 0.0,
        acceptance_histogram=[int(x) for x in histogram],
        position_acceptance=[float(x) / steps if steps else 0.0 for x in position_accepted],
    )


@dataclasses.dataclass
class GenerationResult:
    """generated_ids[i]: the new tokens of prompt i (the stop token included when it finished on one)."""

    generated_ids: list[list[int]]
    finish_reasons: list[str]
    row_stats: list[RowStats]
    stats: RowStats  # totals over rows
    loop_steps: int
    compile_s: float
    generate_s: float
    # The adaptive depth only (k="adaptive"): steps taken at each depth, the depth of each step,
    # the step costs the choice used, and the shadow probes drafted at plain steps.
    depth_counts: dict[int, int] | None = None
    depth_trace: list[int] | None = None
    depth_costs: tuple[float, ...] | None = None
    shadow_probes: int | None = None

    @property
    def num_generated(self) -> int:
        return sum(len(g) for g in self.generated_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.generate_s if self.generate_s > 0 else 0.0


def unpack(out: GenerateOutput) -> tuple[list[list[int]], list[str], list[RowStats], RowStats, int]:
    """Device output (or its host copy) -> (generated ids per row, finish reasons, per-row stats,
    total stats, loop steps)."""
    out = jax.device_get(out)
    generated = [
        [int(t) for t in out.tokens[b, out.prompt_lengths[b] : out.lengths[b]]]
        for b in range(out.tokens.shape[0])
    ]
    reasons = [FINISH_NAMES[int(r)] for r in out.finish_reason]
    s = out.stats
    rows = [
        _row_stats(s.steps[b], s.drafted[b], s.accepted[b], s.emitted[b], s.histogram[b],
                   s.position_accepted[b])
        for b in range(len(generated))
    ]
    total = _row_stats(
        s.steps.sum(), s.drafted.sum(), s.accepted.sum(), s.emitted.sum(), s.histogram.sum(0),
        s.position_accepted.sum(0),
    )
    return generated, reasons, rows, total, int(out.steps)


def result_of(out: GenerateOutput, compile_s: float, generate_s: float) -> GenerationResult:
    """The loop's output (device or host copy) and its timings as the `GenerationResult` users get."""
    generated, reasons, rows, total, steps = unpack(out)
    depth = {}
    if out.depth is not None:
        record = jax.device_get(out.depth)
        trace = [int(d) for d in record.trace if d >= 0]
        depth = dict(depth_counts={d: trace.count(d) for d in sorted(set(trace))}, depth_trace=trace,
                     depth_costs=tuple(float(c) for c in record.costs), shadow_probes=int(record.shadows))
    return GenerationResult(
        generated_ids=generated, finish_reasons=reasons, row_stats=rows, stats=total, loop_steps=steps,
        compile_s=compile_s, generate_s=generate_s, **depth,
    )


@dataclasses.dataclass(frozen=True)
class PreparedCall:
    """One `generate` call, checked and padded, ready to compile and run.

    target: the target (model + params); drafter: with the call's K; capacity: cache slots;
    inputs: the loop's traced inputs (host arrays until placed); depth: the adaptive depth policy
    (its static part; None: K is fixed), whose costs are `inputs.depth_costs` unless
    `measure_costs` (then those are placeholders until `spec_jax.decoding.depth_costs` measures)."""

    target: Target
    drafter: Drafter | None
    capacity: int
    inputs: LoopInputs
    depth: AdaptiveDepth | None = None
    measure_costs: bool = False


def default_stop_ids(target: Any) -> tuple[int, ...]:
    """The ids generation stops at unless told otherwise: a loaded model's own `stop_ids` (EOS and
    its chat template's end-of-turn token), else the target model's `stop_ids`."""
    resolved, own = resolve_target(target)
    return own if own is not None else tuple(resolved.model.stop_ids)


def with_k(drafter: Drafter | None, k: int | None) -> Drafter | None:
    """The drafter with `k` drafts per step (None keeps its own); K must be >= 1 with a drafter."""
    if drafter is not None and k is not None:
        drafter = dataclasses.replace(drafter, k=k)
    k_eff = drafter.k if drafter is not None else 0
    if k_eff < 0 or (drafter is not None and k_eff == 0):
        raise ValueError(f"K (drafts per step) must be >= 1 with a drafter, got {k_eff}.")
    return drafter


def with_tree(drafter: Drafter | None, tree: Any) -> Drafter | None:
    """The drafter with the tree setting `tree` (None keeps its own; 0 = a chain of K; N = a
    budget of N nodes; a tuple of paths = a static tree), for drafters that draft trees."""
    if tree is None:
        return drafter
    if drafter is None:
        if tree_budget_of(tree):
            raise ValueError("tree needs a drafter: plain decoding (no drafter) verifies no drafts.")
        return None
    if not hasattr(drafter, "propose_tree"):
        if tree_budget_of(tree):
            from spec_jax.drafters.registry import tree_kinds

            raise ValueError(
                f"{type(drafter).__name__} drafts chains only; tree drafting is available for "
                f"{', '.join(tree_kinds())} and their lookup-first (+ngram) forms."
            )
        return drafter
    return dataclasses.replace(drafter, tree=tree)


def check_capacity(
    longest: int, max_new_tokens: int, k: int, capacity: int | None, max_positions: int
) -> int:
    """The cache capacity for prompts of up to `longest` tokens (default: bucket + max_new_tokens
    + K + 1, rounded up), checked against the model's positions."""
    if capacity is None:
        capacity = default_capacity(prompt_bucket(longest), max_new_tokens, k)
    if longest + max_new_tokens + k > capacity:
        raise ValueError(
            f"Prompt of {longest} tokens + max_new_tokens={max_new_tokens} + K={k} does not fit "
            f"the cache capacity {capacity}; shorten the prompt, lower max_new_tokens or K, or raise "
            "capacity."
        )
    if longest + max_new_tokens + k > max_positions:
        raise ValueError(
            f"Prompt too long: {longest} prompt tokens + max_new_tokens={max_new_tokens} + K={k} "
            f"exceeds the model's {max_positions} positions (max_position_embeddings); shorten the "
            "prompt or lower max_new_tokens."
        )
    return capacity


def stop_id_array(stop_ids: Sequence[int]) -> np.ndarray:
    """Stop ids as the loop's fixed-size [MAX_STOP_IDS] int32 array, padded with -1."""
    stop_ids = list(dict.fromkeys(int(s) for s in stop_ids))
    if len(stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"At most {MAX_STOP_IDS} stop ids are supported, got {len(stop_ids)}.")
    return np.asarray(stop_ids + [-1] * (MAX_STOP_IDS - len(stop_ids)), np.int32)


def pad_prompts(prompts: Sequence[Sequence[int]], bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> (tokens [B, bucket] int32 right-padded with 0, lengths [B] int32)."""
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.asarray([len(p) for p in prompts], np.int32)


def prepare_inputs(
    target: Any,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None = None,
    drafter_params: Any = None,
    *,
    k: int | None = None,
    capacity: int | None = None,
    tree: Any = None,
    suffix_store: Sequence[Sequence[int]] | None = None,
    **request_values: Any,
) -> PreparedCall:
    """Check everything a user can get wrong (before any compile), resolve the stop ids, pad the
    prompts to their bucket: the host half of `generate` (same arguments; `request_values` are
    max_new_tokens, temperature, top_k, top_p, seed, stop_ids and ignore_eos)."""
    resolved, _ = resolve_target(target)
    model = resolved.model
    depth = as_adaptive_depth(k)
    if depth is not None:
        if drafter is None:
            raise ValueError("k='adaptive' needs a drafter: plain decoding has no depth to choose.")
        depth = depth.for_k(drafter.k).for_entry("finish")  # the call ends with its last row
        k = depth.max_depth
    k, capacity = validation.check_k(k), validation.check_capacity(capacity)
    drafter = with_tree(with_k(drafter, k), tree)
    if depth is not None:
        check_adaptive(drafter, depth)
    k_eff = pass_drafts(drafter)
    values = validation.check_request_values(default_stop_ids(target), **request_values)
    prompts = validation.check_prompts(prompts, model.vocab_size)
    longest = max(len(p) for p in prompts)
    capacity = check_capacity(longest, values.max_new_tokens, k_eff, capacity, model.max_positions)
    if drafter is not None:
        drafter.validate(model, capacity)
    drafter_params = with_store(drafter, drafter_params, suffix_store)  # the suffix drafters' store
    validation.check_drafter_params(drafter, drafter_params)
    prompt_tokens, prompt_lengths = pad_prompts(prompts, min(prompt_bucket(longest), capacity))
    inputs = LoopInputs(
        target_params=resolved.params,
        drafter_params=drafter_params,
        prompt_tokens=jnp.asarray(prompt_tokens),
        prompt_lengths=jnp.asarray(prompt_lengths),
        key=jax.random.key(values.seed),
        sampling=SamplingParams.create(*values.sampling),
        max_new_tokens=jnp.asarray(values.max_new_tokens, jnp.int32),
        stop_ids=jnp.asarray(stop_id_array(values.stop_ids)),
    )
    if depth is None:
        return PreparedCall(resolved, drafter, capacity, inputs)
    costs = depth.costs if depth.costs is not None else (1.0,) * len(depth.depths)
    inputs = inputs.replace(depth_costs=jnp.asarray(costs, jnp.float32))
    return PreparedCall(resolved, drafter, capacity, inputs, depth.static(), measure_costs=depth.costs is None)


# Compiled loops by static configuration and input shapes.
_COMPILED = ProgramCache(max_size=16)


def compiled_loop(
    model: TargetModel, drafter: Drafter | None, capacity: int, inputs: LoopInputs, mesh: Any = None,
    depth: AdaptiveDepth | None = None,
) -> tuple[Any, float]:
    """The compiled loop for this static configuration and these input shapes (and shardings),
    compiled on first use -> (executable, seconds spent compiling now). `depth`: the adaptive
    depth policy's static part (None: K is fixed)."""
    shaped = (inputs.target_params, inputs.drafter_params, inputs.prompt_tokens, inputs.prompt_lengths)
    shapes = jax.tree_util.tree_map(lambda x: (jnp.shape(x), jnp.result_type(x)), shaped)
    cache_key = (model, drafter, capacity, str(shapes))
    if depth is not None:
        cache_key += (depth,)
    if mesh is not None:
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, inputs)
        cache_key += (mesh, str(shardings))
    static = dict(model=model, drafter=drafter, capacity=capacity)
    if depth is not None:
        static["depth"] = depth
    return _COMPILED.get_or_compile(
        cache_key, lambda: generate_jit.lower(inputs, **static), mesh,
        saved_as=lambda: saved_loop_key(model, drafter, capacity, inputs, mesh, depth))


def saved_loop_key(model: TargetModel, drafter: Drafter | None, capacity: int, inputs: LoopInputs,
                   mesh: Any = None, depth: AdaptiveDepth | None = None) -> saved_programs.ProgramKey | None:
    """The loop's key among `saved_programs` (None: not saved)."""
    static = (model, drafter, capacity) if depth is None else (model, drafter, capacity, depth)
    return saved_programs.key_for("generate_loop", static, (inputs,), mesh=mesh)


def generate(
    target: Any,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None = None,
    drafter_params: Any = None,
    *,
    k: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    capacity: int | None = None,
    mesh: Any = None,
    sharding_rules: Any = None,
    tree: Any = None,
    suffix_store: Sequence[Sequence[int]] | None = None,
) -> GenerationResult:
    """Generate continuations of token-id prompts (one batch) with an optional drafter.

    target: a loaded model (`spec_jax.load_target`), a `Target(params, model)`, or a `(model,
      params)` tuple whose model implements `spec_jax.models.TargetModel` (or is a built-in
      `ModelConfig`).
    drafter: None for the autoregressive baseline, else a Drafter; `k` overrides its K: an int
      pins it, "adaptive" lets each step choose its depth among 0 (a plain step), 2, about K / 2
      and K from the recent acceptance and each depth's measured step time (measured once per
      device kind, model and batch bucket, cached on disk: `spec_jax.decoding.depth_costs`), an
      `AdaptiveDepth(depths=..., costs=...)` sets the depths and/or the costs.
    tree: overrides a tree-capable drafter's tree setting: 0 = a chain of K drafts, N = a tree
      of N draft nodes verified in one pass (K bounds its depth), a tuple of paths = a static
      tree (`spec_jax.drafters.tree`).
    suffix_store: for a suffix drafter ("suffix", "KIND+suffix"), earlier texts (token lists,
      oldest first) its lookup searches besides each row's own tokens (`spec_jax.drafters.suffix`);
      default an empty store, or the one in `drafter_params` when it holds one.
    stop_ids: default `default_stop_ids(target)`: EOS and, for a loaded model with a chat template,
      its end-of-turn token (so a chat prompt stops at the end of the assistant's turn);
      `ignore_eos=True` drops those defaults (ids given in `stop_ids` still stop).
    capacity: KV cache/buffer length; default bucket(prompt) + max_new_tokens + K + 1 rounded up.
    mesh: a `jax.sharding.Mesh` from `spec_jax.sharding.make_mesh` ("data=D,model=M") to run the
      whole loop sharded: params are placed per `sharding_rules` (default
      `spec_jax.sharding.ShardingRules()`), prompts split over `data`; None runs unsharded.
    Everything a user can get wrong is checked here, before compiling.
    """
    validation.check_mesh(mesh)
    call = prepare_inputs(
        target, prompts, drafter, drafter_params, k=k, capacity=capacity, tree=tree, suffix_store=suffix_store,
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop_ids=stop_ids, ignore_eos=ignore_eos,
    )
    model, inputs = call.target.model, call.inputs

    def placed(x: LoopInputs) -> LoopInputs:  # committed to the mesh (unsharded: as they are)
        if mesh is None:
            return x
        from spec_jax.decoding.placement import place_generate_inputs  # only for mesh runs

        return place_generate_inputs(x, model, call.drafter, mesh, sharding_rules)

    inputs = placed(inputs)
    compiled, compile_s = compiled_loop(model, call.drafter, call.capacity, inputs, mesh, call.depth)
    if call.measure_costs:
        from spec_jax.decoding.depth_costs import costs_for  # measured once, then read from disk

        costs = costs_for(lambda x: compiled(placed(x)), call)
        inputs = placed(inputs.replace(depth_costs=jnp.asarray(costs, jnp.float32)))
    t0 = time.perf_counter()
    out = compiled(inputs)
    jax.block_until_ready(out)
    generate_s = time.perf_counter() - t0
    return result_of(gather_to_host(out) if mesh is not None else out, compile_s, generate_s)


def make_generate_fn(model: Any, drafter: Drafter | None = None, *, capacity: int,
                     depth: AdaptiveDepth | None = None):
    """The pure function behind `generate`, for use inside a user's own `jax.jit`, `shard_map`
    or training step (RL rollouts inside a jitted update, for example):

        fn = spec_jax.make_generate_fn(model, drafter, capacity=256)
        out = fn(params, drafter_params, prompt_tokens, prompt_lengths, key,
                 sampling=SamplingParams.create(0.7, 0, 0.9), max_new_tokens=64,
                 stop_ids=stop_id_array([eos]))
        # out.tokens [B, capacity], out.lengths [B], out.finish_reason [B], out.stats

    model: a TargetModel (or a built-in ModelConfig); drafter: None for plain decoding.
    depth: an `AdaptiveDepth` to choose each step's depth (the drafter's K the largest); then
    `fn(..., depth_costs=[...])` gives the step time of each depth, traced (no recompile), unless
    the policy carries `costs` (`spec_jax.decoding.depth_costs.measure_costs` measures them).
    prompt_tokens [B, P] int32 right-padded, prompt_lengths [B]; everything except the shapes is
    traced, so new values never recompile. No host callbacks: the whole loop is one XLA program,
    and its caches live and die inside it. Checks are the caller's: `prepare_inputs` makes
    checked inputs from Python lists (`PreparedCall.inputs`), or see `validation.check_prompts`,
    `check_capacity`, `pad_prompts` and `stop_id_array`.
    """
    model = as_target_model(model)
    if depth is not None:
        if drafter is None:
            raise ValueError("an adaptive depth needs a drafter: plain decoding has no depth to choose.")
        depth = depth.for_k(drafter.k if drafter is not None else 0).for_entry("finish")
        drafter = with_k(drafter, depth.max_depth)
        check_adaptive(drafter, depth)
    static_depth = None if depth is None else depth.static()

    def generate_fn(
        params: Any,
        drafter_params: Any,
        prompt_tokens: jax.Array,
        prompt_lengths: jax.Array,
        key: jax.Array,
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int | jax.Array,
        stop_ids: jax.Array | None = None,
        depth_costs: Any = None,
    ) -> GenerateOutput:
        inputs = LoopInputs(
            target_params=params,
            drafter_params=drafter_params,
            prompt_tokens=jnp.asarray(prompt_tokens, jnp.int32),
            prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32),
            key=key,
            sampling=sampling if sampling is not None else SamplingParams.create(),
            max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
            stop_ids=jnp.asarray(stop_ids if stop_ids is not None else stop_id_array(()), jnp.int32),
        )
        if depth is not None:
            costs = depth_costs if depth_costs is not None else depth.costs
            if costs is None:
                raise ValueError("pass depth_costs (one step time per depth in depth.depths) or an "
                                 "AdaptiveDepth with costs; spec_jax.decoding.depth_costs measures them.")
            if not isinstance(costs, jax.Array):
                check_costs(costs, depth.depths)
            inputs = inputs.replace(depth_costs=jnp.asarray(costs, jnp.float32))
        return generate_loop(inputs, model=model, drafter=drafter, capacity=capacity, depth=static_depth)

    return generate_fn
