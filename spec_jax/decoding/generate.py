"""Host-side `generate`: validate, pad to buckets, compile once per shape, run, unpack."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding import validation
from spec_jax.decoding.loop import (
    FINISH_NAMES,
    MAX_STOP_IDS,
    GenerateOutput,
    LoopInputs,
    generate_jit,
)
from spec_jax.drafters.base import Drafter
from spec_jax.models.config import ModelConfig
from spec_jax.sampling import SamplingParams

MIN_PROMPT_BUCKET = 16
CAPACITY_BUCKET = 256


def prompt_bucket(length: int) -> int:
    """Prompts are right-padded to a power of two (>= 16) so a new length rarely recompiles."""
    bucket = MIN_PROMPT_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


def default_capacity(bucket: int, max_new_tokens: int, k: int, multiple: int = CAPACITY_BUCKET) -> int:
    need = bucket + max_new_tokens + k + 1
    return -(-need // multiple) * multiple


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

    @property
    def num_generated(self) -> int:
        return sum(len(g) for g in self.generated_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.generate_s if self.generate_s > 0 else 0.0


def _unpack(out: GenerateOutput) -> tuple[list[list[int]], list[str], list[RowStats], RowStats, int]:
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


# Compiled loops by static configuration and input shapes, most recently used last. Bounded: each
# entry holds an executable (and, through its static drafter, configs), so a long-lived process
# that sweeps shapes keeps only the newest ones.
_COMPILED: collections.OrderedDict[Any, Any] = collections.OrderedDict()
MAX_COMPILED = 16


def _target_parts(target: Any) -> tuple[ModelConfig, Any]:
    if isinstance(target, tuple):
        return target
    return target.cfg, target.params


def default_stop_ids(target: Any) -> tuple[int, ...]:
    """The ids generation stops at unless told otherwise: the target's own `stop_ids` (a loaded
    model: EOS and its chat template's end-of-turn token), else its config's EOS ids."""
    own = getattr(target, "stop_ids", None)
    if own is not None:
        return tuple(own)
    return _target_parts(target)[0].eos_token_ids


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
) -> GenerationResult:
    """Generate continuations of token-id prompts (one batch) with an optional drafter.

    target: a loaded model (anything with `.cfg` and `.params`) or a `(cfg, params)` tuple.
    drafter: None for the autoregressive baseline, else a Drafter; `k` overrides its K.
    stop_ids: default `default_stop_ids(target)`: EOS and, for a loaded model with a chat template,
      its end-of-turn token (so a chat prompt stops at the end of the assistant's turn);
      `ignore_eos=True` disables stopping.
    capacity: KV cache/buffer length; default bucket(prompt) + max_new_tokens + K + 1 rounded up.
    mesh: a `jax.sharding.Mesh` from `spec_jax.sharding.make_mesh` ("data=D,model=M") to run the
      whole loop sharded: params are placed per `sharding_rules` (default
      `spec_jax.sharding.ShardingRules()`), prompts split over `data`; None runs unsharded.
    Everything a user can get wrong is checked here, before compiling.
    """
    cfg, params = _target_parts(target)
    k, capacity = validation.check_k(k), validation.check_capacity(capacity)
    validation.check_mesh(mesh)
    if drafter is not None and k is not None:
        drafter = dataclasses.replace(drafter, k=k)
    k_eff = drafter.k if drafter is not None else 0
    if k_eff < 0 or (drafter is not None and k_eff == 0):
        raise ValueError(f"K (drafts per step) must be >= 1 with a drafter, got {k_eff}.")
    checked = validation.check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    max_new_tokens, seed = checked["max_new_tokens"], checked["seed"]
    prompts = validation.check_prompts(prompts, cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    bucket = prompt_bucket(longest)
    if capacity is None:
        capacity = default_capacity(bucket, max_new_tokens, k_eff)
    if longest + max_new_tokens + k_eff > capacity:
        raise ValueError(
            f"Prompt of {longest} tokens + max_new_tokens={max_new_tokens} + K={k_eff} does not fit "
            f"the cache capacity {capacity}; shorten the prompt, lower max_new_tokens or K, or raise "
            "capacity."
        )
    positions = cfg.max_position_embeddings
    if longest + max_new_tokens + k_eff > positions:
        raise ValueError(
            f"Prompt too long: {longest} prompt tokens + max_new_tokens={max_new_tokens} + K={k_eff} "
            f"exceeds the model's {positions} positions (max_position_embeddings); shorten the "
            "prompt or lower max_new_tokens."
        )
    bucket = min(bucket, capacity)
    if drafter is not None:
        drafter.validate(cfg, capacity)
    validation.check_drafter_params(drafter, drafter_params)
    if stop_ids is None:
        stop_ids = () if ignore_eos else default_stop_ids(target)
    elif ignore_eos:
        stop_ids = ()
    stop_ids = validation.check_stop_ids(stop_ids)
    if len(stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"At most {MAX_STOP_IDS} stop ids are supported, got {len(stop_ids)}.")

    batch = len(prompts)
    prompt_tokens = np.zeros((batch, bucket), np.int32)
    for i, p in enumerate(prompts):
        prompt_tokens[i, : len(p)] = p
    inputs = LoopInputs(
        target_params=params,
        drafter_params=drafter_params,
        prompt_tokens=jnp.asarray(prompt_tokens),
        prompt_lengths=jnp.asarray([len(p) for p in prompts], jnp.int32),
        key=jax.random.key(seed),
        sampling=SamplingParams.create(checked["temperature"], checked["top_k"], checked["top_p"]),
        max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
        stop_ids=jnp.asarray(stop_ids + [-1] * (MAX_STOP_IDS - len(stop_ids)), jnp.int32),
    )
    if mesh is not None:
        from spec_jax.sharding.placement import place_generate_inputs

        inputs = place_generate_inputs(inputs, cfg, drafter, mesh, sharding_rules)
    static = dict(cfg=cfg, drafter=drafter, capacity=capacity)
    shaped = (inputs.target_params, inputs.drafter_params, inputs.prompt_tokens, inputs.prompt_lengths)
    shapes = jax.tree_util.tree_map(lambda x: (jnp.shape(x), jnp.result_type(x)), shaped)
    cache_key = (cfg, drafter, capacity, str(shapes))
    if mesh is not None:
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, inputs)
        cache_key += (mesh, str(shardings))
    compile_s = 0.0
    compiled = _COMPILED.get(cache_key)
    if compiled is None:
        t0 = time.perf_counter()
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            compiled = generate_jit.lower(inputs, **static).compile()
        compile_s = time.perf_counter() - t0
        _COMPILED[cache_key] = compiled
        while len(_COMPILED) > MAX_COMPILED:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(cache_key)
    t0 = time.perf_counter()
    out = compiled(inputs)
    jax.block_until_ready(out)
    generate_s = time.perf_counter() - t0
    if mesh is not None:
        from spec_jax.sharding.placement import gather_to_host

        out = gather_to_host(out)
    generated, reasons, rows, total, steps = _unpack(out)
    return GenerationResult(
        generated_ids=generated,
        finish_reasons=reasons,
        row_stats=rows,
        stats=total,
        loop_steps=steps,
        compile_s=compile_s,
        generate_s=generate_s,
    )
