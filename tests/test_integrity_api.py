"""`generate` refuses what it would otherwise convert silently or fail on deep inside tracing:
prompts that are not lists of integer token-id lists, sampling and size arguments that are NaN,
inf, too large or strings, a string mesh, and drafter params that do not fit the drafter's
weight specs. Every refusal names the parameter and comes before any compilation."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import TINY_DFLASH
from test_ar_generate import count_compiles

from spec_jax.decoding import generate
from spec_jax.decoding.validation import check_drafter_params, check_prompts, check_sampling
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models import init_params

NAN, INF = float("nan"), float("inf")


def refused(models, match, *args, **kwargs):
    with count_compiles() as compiles, pytest.raises(ValueError, match=match):
        generate(models.target, *args, **kwargs)
    assert compiles == []


@pytest.mark.parametrize("prompts, match", [
    ([[5.7, 6.2]], r"Prompt 0 holds 5.7 \(float\) at position 0, which is not an integer token id"),
    ([[5, True]], r"Prompt 0 holds True \(bool\) at position 1"),
    ([["5", "6"]], r"Prompt 0 holds '5' \(str\)"),
    ([[3, 4], "hello"], r"Prompt 1 is a string \('hello'\).*apply_chat_template"),
    ("hello", r"prompts must be a list of token-id lists.*got a string.*apply_chat_template"),
    ([5, 6, 7], r"prompts is one flat list of ids.*pass \[ids\]"),
    (5, r"prompts must be a list of token-id lists, got int"),
    (np.zeros(4, np.int32), r"2-D \[batch, length\]"),
    ([np.asarray([1.5, 2.0])], r"Prompt 0 holds 1.5"),
    ([[]], r"Prompt 0 is empty"),
])
def test_prompts_that_are_not_token_id_lists_are_refused(models, prompts, match):
    """Issue 33: [[5.7, 6.2]] ran as [[5, 6]]; "hello" and [5, 6, 7] failed inside int()."""
    refused(models, match, prompts, max_new_tokens=4)


def test_integer_arrays_are_prompts_and_scalar_arrays_are_numbers():
    assert check_prompts(np.asarray([[1, 2], [3, 4]]), 10) == [[1, 2], [3, 4]]
    assert check_prompts([jax.numpy.asarray([5, 6]), (np.int64(7),)], 10) == [[5, 6], [7]]
    checked = check_sampling(np.int64(4), jax.numpy.float32(0.5), jax.numpy.int32(3), np.float32(0.9), 7)
    assert checked == dict(max_new_tokens=4, temperature=0.5, top_k=3, top_p=pytest.approx(0.9), seed=7)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=NAN), r"max_new_tokens must be an integer, got nan"),
    (dict(max_new_tokens=INF), r"max_new_tokens must be an integer, got inf"),
    (dict(max_new_tokens="8"), r"max_new_tokens must be an integer, got '8' \(str\)"),
    (dict(max_new_tokens=2**40), r"max_new_tokens must be an integer >= 1 and <= 2147483647"),
    (dict(top_k=NAN), r"top_k must be an integer, got nan"),
    (dict(top_k=99999999999), r"top_k must be an integer >= 0 and <= 2147483647"),
    (dict(top_k="5"), r"top_k must be an integer, got '5'"),
    (dict(seed=NAN), r"seed must be an integer, got nan"),
    (dict(seed=99999999999999999999999), r"seed must be an integer >= 0 and <= 4294967295"),
    (dict(seed=2**32), r"seed must be an integer >= 0 and <= 4294967295"),  # would equal seed 0
    (dict(seed="1"), r"seed must be an integer, got '1'"),
    (dict(capacity=NAN), r"capacity must be an integer, got nan"),
    (dict(capacity="64"), r"capacity must be an integer, got '64'"),
    (dict(capacity=2**40), r"capacity must be an integer >= 1 and <= 2147483647"),
    (dict(stop_ids=[NAN]), r"stop_ids holds nan \(float\) at position 0"),
    (dict(stop_ids=["2"]), r"stop_ids holds '2' \(str\)"),
    (dict(stop_ids=2), r"stop_ids must be a list of token ids, got the single id 2; pass \[2\]"),
    (dict(stop_ids=[2**40]), r"stop_ids \[1099511627776\] are not token ids"),
    (dict(temperature="0.5"), r"temperature must be a number, got '0.5'"),
    (dict(temperature=INF), r"temperature must be a finite number"),
    (dict(top_p="1"), r"top_p must be a number"),
    (dict(k=NAN, drafter=NGramDrafter(k=2)), r"k must be an integer, got nan"),
    (dict(mesh="data=1,model=1"), r"mesh must be a jax.sharding.Mesh or None, got 'data=1,model=1'.*make_mesh"),
])
def test_bad_arguments_name_the_parameter(models, kwargs, match):
    refused(models, match, [[1, 2, 3]], **{"max_new_tokens": 4, **kwargs})


def abstract_dflash(cfg):
    return jax.eval_shape(lambda: init_dflash_params(cfg, jax.random.key(0)))


def abstract_model(cfg):
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def test_drafter_params_are_checked_against_its_weight_specs(models):
    """Issue 33, case 6: params of another width or depth ran unnoticed; params that do not fit
    at all failed with KeyError 'fc', NoneType or einsum shape errors from inside tracing."""
    dflash = DFlashDrafter(TINY_DFLASH)
    wide = abstract_dflash(dataclasses.replace(TINY_DFLASH, layer=TINY_DFLASH.layer.replace(intermediate_size=96)))
    refused(models, r"DFlashDrafter params do not fit the drafter: weight \['layers'\]\[0\]\['w_down'\] "
                    r"expected shape \(128, 64\), found \(96, 64\); pass the params made for this drafter",
            [[1, 2, 3]], dflash, wide, max_new_tokens=4)
    two_layers = DraftModelDrafter(models.draft_cfg.replace(num_layers=2), k=2)
    refused(models, r"DraftModelDrafter params lack the weight \['layers'\]\[1\]\['attn_norm'\]",
            [[1, 2, 3]], two_layers, abstract_model(models.draft_cfg), max_new_tokens=4)
    for params, match in [(None, r"DFlashDrafter needs its params, got drafter_params=None"),
                          ({}, r"DFlashDrafter params lack the weight \['fc'\]"),
                          (models.params, r"DFlashDrafter params lack the weight \['fc'\]"),
                          (abstract_model(models.draft_cfg), r"DFlashDrafter params lack the weight \['fc'\]")]:
        refused(models, match, [[1, 2, 3]], dflash, params, max_new_tokens=4)
    extra = {**abstract_dflash(TINY_DFLASH), "lm_head": jax.ShapeDtypeStruct((64, 101), np.float32)}
    refused(models, r"params hold \['lm_head'\], which the drafter has no weight for", [[1, 2, 3]], dflash, extra,
            max_new_tokens=4)
    ints = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, np.int32), abstract_dflash(TINY_DFLASH))
    refused(models, r"weight \['fc'\] must be floating-point, found int32", [[1, 2, 3]], dflash, ints,
            max_new_tokens=4)


def test_fitting_params_pass_the_check(models, drafters):
    for name, (make, params) in drafters.items():
        check_drafter_params(make(2), params)
    check_drafter_params(DFlashDrafter(TINY_DFLASH), abstract_dflash(TINY_DFLASH))
    vocab = dataclasses.replace(TINY_DFLASH, draft_vocab_size=40)
    check_drafter_params(DFlashDrafter(vocab), abstract_dflash(vocab))  # with its integer d2t map
