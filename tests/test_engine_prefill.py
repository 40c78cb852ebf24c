"""Chunked and batched prefill in the engine (issue 45, part 3): prompts prefill in passes of at
most `prefill_chunk_tokens` tokens between decode chunks, several together, a long one over
several steps; greedy output still equals `generate` for every request (staggered arrivals), for
drafters with a state built from the prompt (a draft model's cache; EAGLE-3's pair cache, built
from the target's captured hidden states, as DFlash's context is) and a recurrent target (Qwen3.5's Gated DeltaNet layers), with no compile after warm-up. The host-side
planner is checked on its own."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import make_prompts
from test_engine import backend_compiles, serve_engine_kwargs
from tiny_configs import TINY_DRAFT, VOCAB

from spec_jax.decoding.engine import Engine
from spec_jax.decoding.generate import generate
from spec_jax.decoding.prefill_plan import PrefillPlan
from spec_jax.decoding.slots import RequestParams
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.models import ModelConfig, init_params

K = 3
BUDGET, ROWS = 32, 2  # passes [1, 16], [1, 32] or [2, 16]
# One prompt bucket (32): 30 and 25 tokens are longer than a two-row pass's 16.
PROMPTS = make_prompts([20, 30, 18, 25], seed=3)
MAX_NEW = 10
QWEN3_5 = ModelConfig.from_hf_config(dict(
    architectures=["Qwen3_5ForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}))


def run_staggered(engine):
    """PROMPTS[0:2] at once, then one more after each step -> (each request's ids, the prefill
    passes' shapes)."""
    rids = [engine.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS[:2]]
    got: dict[int, list[int]] = {}
    while engine.has_work() or len(rids) < len(PROMPTS):
        for e in engine.step():
            got.setdefault(e.request_id, []).extend(e.new_ids)
        if len(rids) < len(PROMPTS):
            rids.append(engine.submit(PROMPTS[len(rids)], max_new_tokens=MAX_NEW))
    return [got[r] for r in rids]


@pytest.mark.slow  # an engine per drafter and a recurrent target (about 28 s): the full suite
def test_chunked_batched_prefill_equals_generate_for_drafters_and_a_recurrent_target(models):
    eagle3 = Eagle3Config(layer=TINY_DRAFT, draft_vocab_size=VOCAB - 20, aux_layer_ids=(1, 2))
    qwen = (QWEN3_5, init_params(QWEN3_5, jax.random.key(7), scale=3.0))
    cases = {  # a drafter with its own cache; a recurrent target under a drafter built from captured states
        "draft model": (models.target, DraftModelDrafter(TINY_DRAFT, K), models.draft_params),
        "qwen3.5 eagle3": (qwen, Eagle3Drafter(eagle3, K), init_eagle3_params(eagle3, jax.random.key(4), scale=3.0)),
    }
    for name, (target, drafter, drafter_params) in cases.items():
        want = generate(target, PROMPTS, drafter, drafter_params, max_new_tokens=MAX_NEW).generated_ids
        engine = Engine(target, drafter, drafter_params, slots=3, max_model_len=48, chunk_steps=2,
                        prefill_chunk_tokens=BUDGET, prefill_rows=ROWS)
        engine.warmup([32])
        with backend_compiles() as compiles:
            got = run_staggered(engine)
        assert got == want, name
        assert compiles == [], name
        # Two prompts prefilled together in 16-token chunks, later ones alone in one pass.
        assert engine.prefill_passes[(2, 16)] >= 2 and engine.prefill_passes[(1, 32)] >= 1, (name, engine.prefill_passes)
    # A seeded sampled request draws the same tokens prefilled in chunks as in one pass (the
    # first token's key is folded with the prompt length either way).
    target, drafter, drafter_params = cases["draft model"]
    one_pass = Engine(target, drafter, drafter_params, slots=3, max_model_len=48, chunk_steps=2)
    chunked = Engine(target, drafter, drafter_params, slots=3, max_model_len=48, chunk_steps=2,
                     prefill_chunk_tokens=BUDGET, prefill_rows=ROWS)
    sampled = []
    for e in (one_pass, chunked):
        rid = e.submit(PROMPTS[1], max_new_tokens=MAX_NEW, temperature=0.8, seed=5)
        sampled.append(e.run_all()[rid].new_ids)
    assert sampled[0] == sampled[1]
    engine = chunked
    # A request cancelled mid-prefill frees its prefill row and its reserved slot.
    rids = [engine.submit(p, max_new_tokens=2) for p in PROMPTS[:2]]
    assert engine.step() == [] and engine.num_live == 2  # both hold a slot while they prefill
    engine.cancel(rids[1])
    events = engine.step()
    assert [e.finish_reason for e in events if e.request_id == rids[1]] == ["cancelled"]
    engine.run_all()
    assert not engine.has_work() and not engine.prefill_plan.active and not engine.slot_table.running


def test_serve_flags_reach_the_engine(monkeypatch):
    """`spec-jax serve --prefill-chunk-tokens N --prefill-rows R` reach the engine (stood in for);
    a budget under one prompt bucket is a usage error."""
    import argparse

    from spec_jax.app import inputs, serve
    from spec_jax.decoding import prefill_plan
    from spec_jax.decoding.generate import MIN_PROMPT_BUCKET

    assert (serve.DEFAULT_PREFILL_ROWS, serve.MIN_PREFILL_CHUNK) == (prefill_plan.DEFAULT_PREFILL_ROWS, MIN_PROMPT_BUCKET)
    kwargs = serve_engine_kwargs(monkeypatch, ["--prefill-chunk-tokens", "256", "--prefill-rows", "2"])
    assert (kwargs["prefill_chunk_tokens"], kwargs["prefill_rows"]) == (256, 2)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(inputs.UsageError, match="prefill-chunk-tokens"):
        serve.check_args(parser.parse_args(["--prefill-chunk-tokens", "8"]))


def test_prefill_plan_keeps_each_pass_within_the_budget():
    plan = PrefillPlan(budget=64, rows=4)
    assert plan.shapes() == [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (4, 16)]
    long = RequestParams(prompt_ids=tuple(range(150)), max_new_tokens=1)
    plan.start(0, long, 0.0, slot=5)
    first = plan.next_pass()  # alone: the whole budget
    assert first.tokens.shape == (1, 64) and first.starts.tolist() == [0] and first.valid.tolist() == [64]
    assert plan.advance(first) == [] and plan.reserved_slots == {5}
    plan.start(1, RequestParams(prompt_ids=(7, 8, 9), max_new_tokens=1), 0.0, slot=2)
    both = plan.next_pass()  # two rows share the budget; the short prompt completes
    assert both.tokens.shape == (2, 32) and both.starts.tolist() == [64, 0] and both.valid.tolist() == [32, 3]
    assert both.tokens[0].tolist() == list(range(64, 96)) and both.tokens[1, :3].tolist() == [7, 8, 9]
    assert [p.rid for p in plan.advance(both)] == [1]
    plan.start(2, RequestParams(prompt_ids=(1,), max_new_tokens=1), 0.0, slot=3)
    plan.start(3, RequestParams(prompt_ids=(1, 2), max_new_tokens=1), 0.0, slot=4)
    three = plan.next_pass()  # three in progress: four rows (one padding, nothing valid), 16 wide
    assert three.tokens.shape == (4, 16) and sorted(three.valid.tolist()) == [0, 1, 2, 16]
    assert len(set(three.rows.tolist())) == 4
    assert plan.drop(0).slot == 5 and plan.drop(0) is None
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        PrefillPlan(budget=8)
    assert np.all(np.asarray([r * w for r, w in plan.shapes()]) <= 64)
