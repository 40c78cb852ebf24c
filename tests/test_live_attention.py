"""Cache attention that reads only the live part of the cache (`attend_cache_and_pass`) against
the dense reference that scores every slot: random q/k/v, ragged lengths (0 and full included),
sliding windows, chain and tree pass masks, float32 and bfloat16; the slots past the live part are
never read; gradients equal the dense ones; the cache is still updated in place; generate's output
does not depend on the capacity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_DFLASH, make_prompts
from tiny_configs import TINY_GEMMA4, TINY_TARGET
from spec_jax.decoding import generate
from spec_jax.decoding.generate import compiled_loop, prepare_inputs
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params
from spec_jax.models.attention import attend_cache_and_pass, bucket_widths, live_span
from spec_jax.models.config import GLOBAL_WINDOW
from spec_jax.models.interface import ancestor_mask, chain_mask
from spec_jax.models.presets import PRESETS
from test_compiled_program import while_body_computations

BATCH, T, HEADS, KV_HEADS, DIM = 4, 5, 6, 2, 16
BLOCK = 16
# Token-tree parents (-1 = root): two branches under the root, one two deep.
TREE_PARENTS = np.array([-1, 0, 0, 1, 2])


def case(seed: int, capacity: int, lengths, dtype, tree: bool, window: int):
    rng = np.random.RandomState(seed)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    q = cast(rng.randn(BATCH, T, HEADS, DIM))
    k_cache, v_cache = (cast(rng.randn(BATCH, KV_HEADS, capacity, DIM)) for _ in range(2))
    k_pass, v_pass = (cast(rng.randn(BATCH, KV_HEADS, T, DIM)) for _ in range(2))
    lengths = jnp.asarray(lengths, jnp.int32)
    depth = jnp.asarray([0, 1, 1, 2, 2]) if tree else jnp.arange(T)
    positions = lengths[:, None] + depth  # [B, T]
    mask = ancestor_mask(jnp.broadcast_to(TREE_PARENTS, (BATCH, T))) if tree else chain_mask(T)
    mask = mask & (positions[:, :, None] - positions[:, None, :] < window)
    return q, k_cache, v_cache, lengths, positions, window, k_pass, v_pass, mask


LENGTHS = [  # capacity 100: not a multiple of the block, so the last block is read shifted
    [0, 37, 100, 5],  # ragged, with an empty row and a full one
    [0, 0, 0, 0],  # prefill: nothing committed
    [3, 16, 9, 1],  # within one block
]
CASES = [(False, GLOBAL_WINDOW), (True, GLOBAL_WINDOW), (False, 7), (True, 20), (False, 1)]  # (tree, window)


@pytest.mark.parametrize("impl", ["blocks", "buckets"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_live_paths_match_the_dense_reference(impl, dtype):
    # The window goes in traced (the decoder's is a Python int) so each path compiles once.
    live = jax.jit(functools.partial(attend_cache_and_pass, impl=impl, block=BLOCK))
    dense = jax.jit(functools.partial(attend_cache_and_pass, impl="dense"))
    tol = 3e-6 if dtype == "float32" else 3e-2
    for seed, ((tree, window), lengths) in enumerate(itertools.product(CASES, LENGTHS)):
        args = list(case(seed, 100, lengths, jnp.dtype(dtype), tree, window))
        args[5] = jnp.int32(window)
        got, want = live(*args), dense(*args)
        assert got.dtype == want.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                                   atol=tol, err_msg=f"tree={tree} window={window} lengths={lengths}")


def test_buckets_read_from_slot_zero_under_a_static_window_as_wide_as_the_cache():
    """A decoder's window is a Python int: when it spans the capacity (every global layer), each
    bucket starts at slot 0, a static slice (XLA:GPU copies a dynamic one out of the cache before
    the GEMM); same values as the dense reference. A narrower window keeps the dynamic start."""
    for window, tree, lengths in itertools.product((GLOBAL_WINDOW, 100), (False, True), LENGTHS):
        args = case(3, 100, lengths, jnp.float32, tree, window)
        live = jax.jit(functools.partial(attend_cache_and_pass, impl="buckets", block=BLOCK), static_argnums=5)
        want = jax.jit(functools.partial(attend_cache_and_pass, impl="dense"), static_argnums=5)(*args)
        np.testing.assert_allclose(np.asarray(live(*args)), np.asarray(want), rtol=3e-6, atol=3e-6,
                                   err_msg=f"window={window} tree={tree} lengths={lengths}")
    for window, dynamic in ((GLOBAL_WINDOW, False), (100, False), (99, True), (20, True)):
        text = jax.jit(functools.partial(attend_cache_and_pass, impl="buckets", block=BLOCK),
                       static_argnums=5).lower(*case(0, 100, LENGTHS[0], jnp.float32, False, window)).as_text()
        assert ("stablehlo.dynamic_slice" in text) == dynamic, window


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tree", [False, True])
def test_buckets_read_a_pass_from_the_cache_when_it_holds_it(tree, dtype):
    """pass_in_cache: the cache holds row b's pass key i at slot lengths[b] + i (the decoder writes
    them before attending); under a window that spans the capacity the buckets path reads the
    keys from there, as one part with the committed slots, a chain's (causal_pass) and a tree's
    (its mask packed into bits): equal to the dense reference for ragged and empty rows, one bucket
    or several (the pass crossing a bucket's end), with attention sinks too; narrower windows take
    the two-part path, equal as well."""
    capacity = 100

    def holding_the_pass(args):
        q, k_cache, v_cache, lengths, positions, window, k_pass, v_pass, mask = args
        slots = lengths[:, None] + jnp.arange(T)  # [B, T]
        rows = jnp.arange(BATCH)[:, None]
        k_cache = k_cache.at[rows, :, slots].set(jnp.swapaxes(k_pass, 1, 2))
        v_cache = v_cache.at[rows, :, slots].set(jnp.swapaxes(v_pass, 1, 2))
        return q, k_cache, v_cache, lengths, positions, window, k_pass, v_pass, mask

    live = jax.jit(functools.partial(attend_cache_and_pass, impl="buckets", block=BLOCK, pass_in_cache=True,
                                     causal_pass=not tree), static_argnums=5)
    dense = jax.jit(functools.partial(attend_cache_and_pass, impl="dense"), static_argnums=5)
    lengths_cases = [[0, 37, 95, 5], [0, 0, 0, 0], [3, 16, 9, 1], [12, 11, 60, 13]]  # 11 + 5 crosses 16
    tol = 3e-6 if dtype == "float32" else 3e-2  # bfloat16: what the accelerators run
    for seed, (window, lengths) in enumerate(itertools.product([GLOBAL_WINDOW, capacity, 7, 20], lengths_cases)):
        args = holding_the_pass(case(seed, capacity, lengths, jnp.dtype(dtype), tree, window))
        got, want = live(*args), dense(*args)
        assert got.dtype == want.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol,
                                   err_msg=f"window={window} lengths={lengths}")
    # One part: a single softmax over the window, no concatenation of two parts' scores, and no
    # lookup of the tree's mask per slot (a gather XLA:CPU left outside the fusion).
    args = holding_the_pass(case(0, capacity, lengths_cases[0], jnp.dtype(dtype), tree, GLOBAL_WINDOW))
    text = live.lower(*args).as_text()
    assert "stablehlo.concatenate" not in text and "stablehlo.gather" not in text
    # With attention sinks (gpt-oss): the sink's column joins the one softmax.
    sinks = jnp.asarray(np.random.RandomState(5).randn(HEADS), jnp.float32)
    np.testing.assert_allclose(np.asarray(live(*args, sinks=sinks), np.float32),
                               np.asarray(dense(*args, sinks=sinks), np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("width", [1, 5, 32, 33, 64])
def test_a_pass_mask_packed_into_bits_reads_back_at_every_slot(width):
    """`in_pass_words` then `in_pass_visible` give back the mask for keys 0..width-1 at slots
    lengths[b] + j, and nothing at the slots before or after the pass, for masks of one word and two."""
    from spec_jax.models.attention import in_pass_visible, in_pass_words

    rng = np.random.RandomState(width)
    mask = rng.rand(3, width, width) < 0.5
    lengths = np.asarray([0, 7, 40])
    slots = np.arange(120)
    got = np.asarray(in_pass_visible(in_pass_words(jnp.asarray(mask)),
                                     jnp.asarray(slots[None, None, :] - lengths[:, None, None]), width))
    want = np.zeros((3, width, len(slots)), bool)
    for b, length in enumerate(lengths):
        want[b, :, length:length + width] = mask[b]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["blocks", "buckets", "dense"])
def test_a_pass_into_an_empty_cache_reads_none_of_it(impl):
    """cache_empty (a prefill): the pass attends over its own keys only, equal to every path over
    a cache of zero lengths, and the program holds no cache path (no switch, no loop)."""
    for tree, window in CASES:
        args = case(1, 100, [0, 0, 0, 0], jnp.float32, tree, window)
        empty = jax.jit(functools.partial(attend_cache_and_pass, impl=impl, block=BLOCK, cache_empty=True),
                        static_argnums=5)
        want = jax.jit(functools.partial(attend_cache_and_pass, impl=impl, block=BLOCK), static_argnums=5)(*args)
        np.testing.assert_allclose(np.asarray(empty(*args)), np.asarray(want), rtol=3e-6, atol=3e-6,
                                   err_msg=f"tree={tree} window={window}")
        text = empty.lower(*args).as_text()
        assert "stablehlo.case" not in text and "stablehlo.while" not in text


def test_prefill_traces_its_layers_apart_from_the_passes_over_a_filled_cache():
    """The decoder hands its layers cache_empty under `into_empty_cache` as a static argument: a
    layer traced for a prefill is not reused (JAX caches a jitted layer by its arguments' shapes)
    for a later pass of the same shapes over a filled cache, which must read the cache: prompt in
    two halves == prompt in one pass."""
    from spec_jax.checkpoints import load_target
    from spec_jax.models.attention import into_empty_cache

    target = load_target("random:tiny", dtype="float32")
    model, params = target.model, target.params
    tokens = jnp.asarray([[5, 9, 2, 7, 11, 3, 8, 1]], jnp.int32)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    whole, _, _ = model.forward(params, tokens, positions, model.init_cache(1, 16))
    with into_empty_cache():
        first, _, written = model.forward(params, tokens[:, :4], positions[:, :4], model.init_cache(1, 16))
    second, _, _ = model.forward(params, tokens[:, 4:], positions[:, 4:], model.commit(written, jnp.asarray([4])))
    np.testing.assert_allclose(np.asarray(first), np.asarray(whole[:, :4]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(second), np.asarray(whole[:, 4:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["blocks", "buckets"])
def test_slots_outside_the_live_span_are_never_read(impl):
    """NaN in every slot the path should skip (past the longest row's block or bucket, and before
    the window's block) leaves the output finite and equal to the dense result on clean data."""
    capacity, window = 200, 20
    args = list(case(0, capacity, [60, 90, 75, 70], jnp.float32, False, window))
    lo, hi = (int(x) for x in live_span(args[3], args[4], window))
    if impl == "blocks":
        first, end = lo // BLOCK * BLOCK, -(-hi // BLOCK) * BLOCK
    else:
        width = next(w for w in bucket_widths(capacity, BLOCK) if w >= hi - lo)
        first = min(lo, capacity - width)
        end = first + width
    assert 0 < first and end < capacity  # the case really skips slots on both sides
    slots = jnp.arange(capacity)[None, None, :, None]
    outside = (slots < first) | (slots >= end)
    poisoned = list(args)
    for i in (1, 2):
        poisoned[i] = jnp.where(outside, jnp.nan, args[i])
    got = jax.jit(functools.partial(attend_cache_and_pass, impl=impl, block=BLOCK), static_argnums=5)(*poisoned)
    want = jax.jit(functools.partial(attend_cache_and_pass, impl="dense"), static_argnums=5)(*args)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=3e-6, atol=3e-6)


def test_gradients_equal_the_dense_reference():
    """Reverse mode goes through both live paths under jit (the blocks loop's dynamic trip count
    cannot be transposed, so it takes the dense reference's gradient) with the dense values."""
    args = case(0, 100, LENGTHS[0], jnp.float32, True, 7)
    diff = (0, 1, 2, 6, 7)  # q, the cache's k and v, the pass's k and v

    def grads(impl):
        def loss(*x):
            full = list(args)
            for i, value in zip(diff, x):
                full[i] = value
            return jnp.sum(jnp.sin(attend_cache_and_pass(*full, impl=impl, block=BLOCK)))

        return jax.jit(jax.grad(loss, argnums=tuple(range(len(diff)))))(*(args[i] for i in diff))

    want = grads("dense")
    for impl in ("blocks", "buckets"):
        for got, ref in zip(grads(impl), want):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=3e-6, atol=3e-6, err_msg=impl)


@pytest.mark.parametrize("kind", ["ar", "dflash"])
def test_generate_does_not_depend_on_the_capacity(models, kind):
    """Capacity 128 (one block on CPU: read densely) and 4096 (live blocks) give the same tokens;
    the 4096 loop copies no layer cache (the target's or DFlash's context cache) inside its while
    loop: each pass is written into the cache in place and only the live blocks are read."""
    drafter, params = None, None
    if kind == "dflash":
        drafter, params = DFlashDrafter(TINY_DFLASH, 4), init_dflash_params(TINY_DFLASH, jax.random.key(3), 3.0)
    prompts = make_prompts([3, 16, 9], seed=1)
    outs = [generate(models.target, prompts, drafter, params, max_new_tokens=40, capacity=capacity)
            for capacity in (128, 4096)]
    # The two reads sum attention in another order.
    assert_equal_but_ties(models.params, models.cfg, prompts, outs[0].generated_ids, outs[1].generated_ids)
    if outs[0].generated_ids == outs[1].generated_ids:
        assert outs[0].stats.tau == outs[1].stats.tau

    call = prepare_inputs(models.target, prompts, drafter, params, max_new_tokens=40, capacity=4096)
    compiled, compile_s = compiled_loop(call.target.model, call.drafter, call.capacity, call.inputs)
    assert compile_s == 0.0  # the program generate just ran
    shapes = {f"f32[{len(prompts)},{c.num_kv_heads},4096,{c.head_dim}]" for c in (models.cfg, TINY_DFLASH.layer)}
    copies = [line for lines in while_body_computations(compiled.as_text()) for line in lines
              if " copy(" in line and any(f"= {shape}" in line for shape in shapes)]
    assert copies == [], "\n".join(copies[:4])


@contextlib.contextmanager
def cache_attention(impl: str, block: int = 16):
    """The backend takes the cache attention `impl` with `block`-slot blocks or buckets, as if it
    were its measured choice (on a GPU too: the quick suite runs this file there); the table and
    the compiled programs are restored after."""
    from spec_jax.models import attention

    compiled = sys.modules["spec_jax.decoding.generate"]._COMPILED
    chosen = dict(attention.LIVE_ATTENTION)
    attention.LIVE_ATTENTION[jax.default_backend()] = (impl, block)
    jax.clear_caches()  # the jitted layers are cached by shapes, not by the table
    compiled.clear()
    try:
        yield
    finally:
        attention.LIVE_ATTENTION.clear()
        attention.LIVE_ATTENTION.update(chosen)
        jax.clear_caches()
        compiled.clear()


@pytest.mark.parametrize("tree", [0, 8])
def test_generate_on_the_accelerators_buckets_path_equals_the_dense_one(models, tree):
    """The accelerators' cache attention ("buckets", here with 16-slot buckets so that 96 slots
    hold several) run end to end on this CPU: plain decoding and a DFlash chain or tree of 8 give
    the tokens of the dense path. The decoder's layers read a pass's keys from the cache on
    this path (pass_in_cache), so every step checks that reading, a chain's and a tree's; prompts
    of 3, 16 and 9 tokens cross buckets' ends as they grow."""
    drafter = dataclasses.replace(DFlashDrafter(TINY_DFLASH, 4), tree=tree)
    params = init_dflash_params(TINY_DFLASH, jax.random.key(3), 3.0)
    prompts = make_prompts([3, 16, 9], seed=2)
    outs = {}
    for impl in ("buckets", "dense"):
        with cache_attention(impl):
            outs[impl] = [generate(models.target, prompts, d, p, max_new_tokens=30, capacity=96).generated_ids
                          for d, p in ((None, None), (drafter, params))]
    for got, want in zip(outs["buckets"], outs["dense"]):  # the paths sum attention in another order
        assert_equal_but_ties(models.params, models.cfg, prompts, got, want)


def tiny_family(preset: str, layer_types: tuple[str, ...]):
    """A preset's family switches on TINY_TARGET's sizes, with one layer per `layer_types`
    entry, a 5-token sliding window and 4 experts (top 2) where the family has them."""
    cfg = PRESETS[preset]
    fields = dict(vocab_size=TINY_TARGET.vocab_size, hidden_size=64, intermediate_size=128, num_heads=4,
                  num_kv_heads=2, head_dim=16, num_layers=len(layer_types), layer_types=layer_types,
                  bos_token_id=1, eos_token_ids=TINY_TARGET.eos_token_ids, dtype="float32")
    if cfg.sliding_window:
        fields["sliding_window"] = 5
    if cfg.moe:
        fields["moe"] = dataclasses.replace(cfg.moe, num_experts=4, top_k=2, expert_intermediate_size=32)
    if cfg.linear_num_key_heads:
        fields.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16)
    return cfg.replace(**fields)


# The families whose layers take other routes through the cache attention: Gemma 4 (sliding and
# full layers of two head sizes, a KV-shared layer reading another layer's written cache), gpt-oss
# (sinks, sliding and full layers, experts) and Qwen3.5 (Gated DeltaNet layers hold no cache).
FAMILIES = {
    "gemma4": lambda: TINY_GEMMA4,
    "gpt_oss": lambda: tiny_family("gpt-oss-20b", ("sliding_attention", "full_attention")),
    "qwen3_5": lambda: tiny_family("qwen3.5-9b-scaled", ("linear_attention", "full_attention")),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_layers_on_the_buckets_path_equal_the_dense_ones(family):
    """Greedy plain decoding, a DFlash chain and a tree of 8 on the accelerators' cache attention
    give the dense path's tokens for each family: the layers' static routes (a sliding window
    under the capacity keeps the dynamic window and two parts; a full one reads a chain pass from
    the cache) are only taken on a GPU or TPU otherwise. Weights at scale 1: at scale 3 the scores
    dwarf gpt-oss's sinks, and a path that dropped them gave the same tokens."""
    from spec_jax.drafters.dflash import DFlashConfig, dflash_layers
    from spec_jax.models import Decoder, init_params

    cfg = FAMILIES[family]()
    params = init_params(cfg, jax.random.key(0), scale=1.0)
    # Norms, biases, sinks and scalars start constant: drawn at random, so a path that drops or
    # misplaces one shows.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    target = (Decoder(cfg), jax.tree.unflatten(tree, [
        x + (2.0 * jax.random.normal(key, x.shape, x.dtype) if x.ndim <= 1 else 0) for x, key in zip(leaves, keys)]))
    dflash = DFlashConfig(layer=dflash_layers(1, 64, 4, 2, 16, 96, vocab_size=cfg.vocab_size), block_size=4,
                          target_layer_ids=(0, cfg.num_layers - 1), mask_token_id=cfg.vocab_size - 1,
                          num_target_layers=cfg.num_layers)
    params = init_dflash_params(dflash, jax.random.key(3), scale=3.0)
    prompts = make_prompts([3, 16, 9], seed=2, vocab=cfg.vocab_size)
    runs = {"plain": (None, None), "chain": (DFlashDrafter(dflash), params),
            "tree of 8": (DFlashDrafter(dflash, tree=8), params)}
    outs = {}
    for impl in ("buckets", "dense"):
        with cache_attention(impl):
            for run, (drafter, drafter_params) in runs.items():
                outs[impl, run] = generate(target, prompts, drafter, drafter_params, max_new_tokens=30,
                                           capacity=96, ignore_eos=True).generated_ids
    for run in runs:
        assert_equal_but_ties(target[1], cfg, prompts, outs["buckets", run], outs["dense", run], f"{family} {run}")
        assert_equal_but_ties(target[1], cfg, prompts, outs["dense", run], outs["dense", "plain"],
                              f"{family} {run}: speculation changed the tokens:")


TIE = 1e-4  # logit gap below which float summation order may pick either token


def assert_equal_but_ties(params, cfg, prompts, got, want, what: str = "") -> None:
    """Each row's tokens equal, or first differing where the target's top two next-token logits
    (a full forward over the row so far) are within TIE: there float summation order may pick
    either token."""
    from spec_jax.models import forward, init_cache

    for prompt, a, b in zip(prompts, got, want):
        if a == b:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        tokens = prompt + a[:first]
        logits, _, _ = forward(params, cfg, jnp.asarray([tokens]), jnp.arange(len(tokens))[None],
                               init_cache(cfg, 1, len(tokens)))
        top = np.sort(np.asarray(logits[0, -1]))[::-1]
        assert top[0] - top[1] < TIE, f"{what} token {first} differs where the top-2 gap is {top[0] - top[1]:.2e}"
