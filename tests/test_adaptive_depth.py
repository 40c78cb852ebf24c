"""The per-step speculation depth (`k="adaptive"`, spec_jax/decoding/depth.py).

Greedy output with the adaptive policy equals plain decoding for the n-gram, draft-model and
DFlash drafters at batch 1 and 3 (through `generate`, `make_generate_fn` and `generate_stream`)
and EAGLE-3's tree at batch 8 at three depths, with the depth changing mid-run (costs supplied
so that it must; sampled output: test_sampling_stats; a mesh: test_sharding); a drafter that is
never right settles on K = 0, an always-right one (the target drafting for itself) on the
largest depth; new costs, params and prompts never recompile; the draft model's cache catches
up after K = 0 steps (the target drafting for itself accepts every draft even after runs of
plain steps longer than its re-feed window, through drafting and shadow probes; the caught-up
cache is what a longer prompt gives), and DFlash's context and EAGLE-3's pair cache after a
plain step are what a longer prompt gives. Shadow probes (a plain step's unverified
drafts, checked against the tokens the next plain steps commit) find an always-right drafter
without a drafting step and never draft for a never-right one; prompt lookup's drafts have
their own acceptance rate and free probes; sampled decoding probes by drafting.
Costs are always supplied, so nothing here measures time or touches the cost cache on disk,
except the cache test, which times a stand-in function.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_prompts
from test_ar_generate import count_compiles
from tiny_configs import TINY_DFLASH, VOCAB
from spec_jax.app.bench import parse_ks
from spec_jax.app.common import drafter_spec_from_args, k_value
from spec_jax.app.inputs import UsageError
from spec_jax.decoding import generate, make_generate_fn, prepare_inputs
from spec_jax.decoding.loop import forward_capturing, generate_jit
from spec_jax.decoding.stream import generate_stream
from spec_jax.decoding.depth import AdaptiveDepth, PlainStep, drafter_at_depth
from spec_jax.decoding.engine import depth_policy
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params
from spec_jax.drafters.draft_model import DraftModelDrafter, self_drafter
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.drafters.lookup import LookupFirstDrafter
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.models.decoder import Decoder
from spec_jax.models.interface import Target

K = 2
DEPTHS = (0, K)  # two branches: each depth is a whole step to compile
# A wider verify costs more (as on CPU) and the prior is optimistic: the first steps draft K, and
# drafters that miss fall to K = 0, probing K after 4 x 1.3 plain steps.
SWITCHING = AdaptiveDepth(depths=DEPTHS, costs=(1.0, 1.3), prior=0.9, probe_every=4)
NEW = 24


def _plain(models, prompts):
    return generate(models.target, prompts, max_new_tokens=NEW, ignore_eos=True).generated_ids


def test_adaptive_depth_exact_switching_and_settling(models):
    """Each drafter kind once and each entry point once, over batch 1 and 3 (a compile each: the
    full drafter x batch matrix ran once and is recorded in benchmarks/RESULTS.md, issue 41)."""
    dflash_params = init_dflash_params(TINY_DFLASH, jax.random.key(3), scale=3.0)
    prompts = {1: make_prompts([9], seed=5), 3: make_prompts([7, 16, 2], seed=1)}
    plain = {b: _plain(models, p) for b, p in prompts.items()}
    cases = [  # (name, drafter, params, batch, entry point)
        ("ngram", NGramDrafter(k=K), None, 1, "make_generate_fn"),
        ("draft-model", self_drafter(models.cfg, K), models.near_params, 1, "generate"),
        # Behind prompt lookup (serve's default): steps where every row looks up skip the draft
        # model, which catches up later (a one-token match makes those steps common here).
        ("draft-model+lookup", LookupFirstDrafter(self_drafter(models.cfg, K), min_match=1), models.near_params,
         3, "make_generate_fn"),
        ("dflash", DFlashDrafter(TINY_DFLASH, K), dflash_params, 3, "stream"),
    ]
    for name, drafter, params, batch, how in cases:
        ids, trace = _run(models, prompts[batch], drafter, params, SWITCHING, how)
        assert ids == plain[batch], (name, batch, how)
        assert len(set(trace)) == 2, (name, batch, trace)  # the depth changed mid-run

    # Never right (a random DFlash drafter): K = 0 except the probes (one step in 7).
    _, trace = _run(models, prompts[3], DFlashDrafter(TINY_DFLASH, K), dflash_params, SWITCHING, "stream", 64)
    assert trace.count(0) >= 0.7 * len(trace), trace

    # Always right (the target drafting for itself): the largest depth on every step but the first;
    # new costs, params and prompts compile nothing.
    cheaper = dataclasses.replace(SWITCHING, costs=(1.0, 1.2))
    with count_compiles() as compiles:
        r = generate(models.target, prompts[1], self_drafter(models.cfg, K), models.params, k=cheaper,
                     max_new_tokens=NEW, ignore_eos=True)
    assert compiles == [], "new depth costs or prompts recompiled the adaptive loop"
    assert r.generated_ids == plain[1] and r.stats.accepted == r.stats.drafted
    assert r.depth_trace.count(K) >= len(r.depth_trace) - 1, r.depth_trace


_FNS = {}


def _run(models, prompts, drafter, params, depth, how, new=NEW):
    """-> (generated ids per row, the depth of each step)."""
    if how == "generate":
        r = generate(models.target, prompts, drafter, params, k=depth, max_new_tokens=new, ignore_eos=True)
        return r.generated_ids, r.depth_trace
    if how == "stream":
        *_, last = generate_stream(models.target, prompts, drafter, params, k=depth, max_new_tokens=new,
                                   ignore_eos=True)
        return last.result.generated_ids, last.result.depth_trace
    call = prepare_inputs(models.target, prompts, drafter, params, k=depth, max_new_tokens=new, ignore_eos=True)
    key = (drafter, call.capacity, depth.static())
    if key not in _FNS:
        _FNS[key] = jax.jit(make_generate_fn(models.cfg, drafter, capacity=call.capacity, depth=depth.static()))
    x = call.inputs
    out = jax.device_get(_FNS[key](models.params, params, x.prompt_tokens, x.prompt_lengths, x.key,
                                   max_new_tokens=x.max_new_tokens, stop_ids=x.stop_ids,
                                   depth_costs=jnp.asarray(depth.costs)))
    ids = [out.tokens[b, out.prompt_lengths[b]:out.lengths[b]].tolist() for b in range(len(prompts))]
    return ids, [int(d) for d in out.depth.trace if d >= 0]


def test_draft_model_cache_stays_current_across_plain_steps(models):
    """The target drafting for itself, made to take 14 plain steps between probes at K = 2:
    plain steps leave its cache behind and the probe catches it up (a re-feed of K + 1 = 3
    tokens alone would miss those of 14 plain steps, after a step that committed 3), or drafts
    would start missing."""
    # K = 2 is worth 3 tokens for 3.5 plain steps' time: K = 0 but for a probe after 4 x 3.5 steps.
    forced = dataclasses.replace(SWITCHING, costs=(1.0, 3.5), shadow_every=0)  # probes that draft
    prompts = make_prompts([9], seed=5)
    r = generate(models.target, prompts, self_drafter(models.cfg, K), models.params, k=forced,
                 max_new_tokens=40, ignore_eos=True)
    assert r.depth_trace[:16] == [0] * 14 + [K, 0], r.depth_trace
    assert r.stats.drafted > 0 and r.stats.accepted == r.stats.drafted, r.stats


def test_draft_model_catch_up_equals_a_longer_prompt(models):
    """`catch_up` feeds a draft model's cache the committed tokens plain steps left out, R at a
    time (R = the re-feed width), as if they had been part of its prompt: row 0 is 11 tokens
    behind (four passes), row 1 is current, row 2 is behind but not asked to catch up."""
    drafter = drafter_at_depth(self_drafter(models.cfg, K), K, K)  # re-feeds R = K + 1 = 3
    assert drafter.catches_up and drafter.refeed_width == 3
    model, params = drafter.model, models.params
    tokens = jnp.asarray(make_prompts([24], seed=3) * 3, jnp.int32)  # [3, 24]
    fed, lengths = jnp.asarray([6, 20, 6]), jnp.asarray([20, 20, 20])

    @jax.jit
    def caches(tokens):
        whole = drafter.init(params, None, tokens, lengths, None, 32)
        behind = drafter.init(params, None, tokens, fed, None, 32)
        caught = drafter.catch_up(params, None, behind, tokens, lengths, rows=jnp.asarray([True, True, False]))
        return whole, behind, caught

    whole, behind, caught = caches(tokens)
    assert model.cache_lengths(caught).tolist() == [18, 20, 6]  # 6 + 4 x 3 >= 20 - 3
    current = 17  # positions below L - R = 17 are what the next re-feed reads
    for want, was, got in zip(whole.k + whole.v, behind.k + behind.v, caught.k + caught.v):
        np.testing.assert_allclose(got[0, ..., :current, :], want[0, ..., :current, :], atol=1e-5)
        np.testing.assert_allclose(got[1, ..., :current, :], want[1, ..., :current, :], atol=1e-5)
        np.testing.assert_array_equal(got[2, ..., :6, :], was[2, ..., :6, :])  # what it holds, kept


def test_shadow_probes(models):
    """Greedy chains probe with a draft pass alone at a plain step (a shadow probe), checked
    against the tokens the following plain steps commit: an always-right drafter is found by one
    probe and no drafting step, a never-right one never drafts, prompt lookup's drafts are
    probed whenever they match (free: no model pass), and sampled decoding probes by drafting."""
    prompts = make_prompts([9], seed=5)
    plain = _plain(models, prompts)
    # A prior of 0: plain steps first, a shadow probe after 4 of them.
    shy = AdaptiveDepth(depths=DEPTHS, costs=(1.0, 1.3), prior=0.0, shadow_every=4, probe_every=4)
    r = generate(models.target, prompts, self_drafter(models.cfg, K), models.params, k=shy,
                 max_new_tokens=NEW, ignore_eos=True)
    assert r.generated_ids == plain
    first = r.depth_trace.index(K)  # the probe opens at step 4 and closes when its K drafts held
    assert first == 4 + K and r.shadow_probes == 1 and set(r.depth_trace[first:]) == {K}, r.depth_trace

    dflash_params = init_dflash_params(TINY_DFLASH, jax.random.key(3), scale=3.0)
    r = generate(models.target, prompts, DFlashDrafter(TINY_DFLASH, K), dflash_params, k=shy,
                 max_new_tokens=NEW, ignore_eos=True)
    assert r.generated_ids == plain and set(r.depth_trace) == {0} and r.shadow_probes >= 3, r.depth_trace

    # Prompt lookup in front: its drafts have their own acceptance rate, and a plain step where
    # every row would take them drafts a shadow probe at once (no wait: it costs no model pass).
    looped = [[5, 6, 7, 8] * 4 + p for p in make_prompts([3], seed=2)]  # batch 1: all rows look up
    lookup = LookupFirstDrafter(DFlashDrafter(TINY_DFLASH, K), min_match=1)
    patient = dataclasses.replace(shy, shadow_every=1000)
    r = generate(models.target, looped, lookup, dflash_params, k=patient, max_new_tokens=NEW, ignore_eos=True)
    assert r.generated_ids == _plain(models, looped) and r.shadow_probes >= 1

    # Sampled: no shadow probes (a match of sampled tokens would underrate the drafts); drafting
    # steps probe instead.
    r = generate(models.target, prompts, self_drafter(models.cfg, K), models.params, k=shy,
                 max_new_tokens=NEW, ignore_eos=True, temperature=0.8, seed=1)
    assert r.shadow_probes == 0 and K in r.depth_trace, r.depth_trace


_MODEL_PROPOSES: list[int] = []


@dataclasses.dataclass(frozen=True)
class CountedDraftModel(DraftModelDrafter):
    """The draft model, counting the proposes that run (a host callback inside the program)."""

    def propose(self, params, target, state, tokens, lengths, key, sampling):
        jax.debug.callback(lambda: _MODEL_PROPOSES.append(1))
        return super().propose(params, target, state, tokens, lengths, key, sampling)


def test_free_shadow_probes_never_run_the_model_drafter(models):
    """Prompt lookup in front of a draft model, in an engine whose other slots are empty: a
    shadow probe where every live row takes the lookup's drafts drafts those alone, without the
    draft model (it once ran the model for every such probe: the empty slots matched nothing, so
    the lookup's skip, which looks at every row, never held; 0.93x plain at 1 client). Drafting
    never pays here (its cost is 1e6 plain steps), so every probe is a free one."""
    from spec_jax.decoding.engine import Engine

    drafter = LookupFirstDrafter(CountedDraftModel(models.draft_cfg, K), min_match=1)
    idle = AdaptiveDepth(depths=DEPTHS, costs=(1.0, 1e6), shadow_every=1000)
    engine = Engine(models.target, drafter, models.draft_params, slots=3, max_model_len=48, k=idle)
    prompt = [5, 6, 7, 8] * 4  # every token recurs: the lookup always matches
    _MODEL_PROPOSES.clear()
    rid = engine.submit(prompt, max_new_tokens=16, ignore_eos=True)
    got = engine.run_all()[rid]
    jax.effects_barrier()
    assert got.new_ids == generate(models.target, [prompt], max_new_tokens=16, ignore_eos=True).generated_ids[0]
    assert engine.depth_counts[0] > 0 and engine.depth_counts.get(K, 0) == 0, engine.depth_counts
    assert engine.shadow_probes >= 3 and _MODEL_PROPOSES == [], (engine.shadow_probes, len(_MODEL_PROPOSES))


def test_policy_choices_and_cost_cache(models, tmp_path, monkeypatch):
    """The choice from given acceptance rates, the checks, and measured costs kept on disk (a
    stand-in loop: nothing compiles)."""
    from types import SimpleNamespace

    from spec_jax.decoding.depth import choose, default_depths
    from spec_jax.decoding.depth_costs import costs_for, shallower_never_dearer

    assert default_depths(7) == (0, 2, 4, 7) and default_depths(4) == (0, 2, 4) and default_depths(1) == (0, 1)
    policy = AdaptiveDepth(depths=(0, 2, 4, 7))
    costs = jnp.asarray([1.0, 1.3, 1.5, 1.9])

    @jax.jit
    def picked(rates):  # one row per rate -> the depth index chosen for each (one compile)
        def one(rate):
            state = policy.initial_state(1, 8, costs).replace(accepted_ema=rate[None, None], tried_ema=jnp.ones((1, 1)))
            return choose(policy, state, jnp.ones((1,), bool))
        return jax.vmap(one)(rates)

    chosen = picked(jnp.asarray([0.0, 0.2, 0.6, 0.95]))
    assert [policy.depths[int(i)] for i in chosen] == [0, 0, 4, 7]
    # Near break-even a plain step wins by the margin: depth 2 promises 1.3 / 1.3 = 1.0x at rate
    # 0.3 (0.3 + 0.09 = 0.39 more tokens for 0.3 more time), under the 10% head start.
    assert policy.depths[int(picked(jnp.asarray([0.3]))[0])] == 0
    no_margin = dataclasses.replace(policy, margin=0.0)
    state = no_margin.initial_state(1, 8, costs).replace(accepted_ema=jnp.asarray([[0.35]]), tried_ema=jnp.ones((1, 1)))
    assert no_margin.depths[int(choose(no_margin, state, jnp.ones((1,), bool)))] == 2
    assert AdaptiveDepth().probe_every == 16
    # Two draft sources (prompt lookup in front of a model drafter): each row's own source's rate.
    two = policy.initial_state(2, 8, costs, sources=2).replace(
        accepted_ema=jnp.asarray([[0.0, 0.6], [0.0, 0.6]]), tried_ema=jnp.ones((2, 2)))
    for sources, depth in (([0, 0], 0), ([1, 1], 4), ([0, 1], 2)):
        assert policy.depths[int(choose(policy, two, jnp.ones((2,), bool), True, jnp.asarray(sources)))] == depth
    # The "finish" objective (generate's, the stream's): the batch's slowest row sets its time.
    # One row accepting 0.95 and one 0.0, both with 100 tokens left: the sum of tokens drafts
    # (6.7 + 1 tokens for 1.9 beats 2 x 1.1 for 1.0), but the second row needs 100 steps either way.
    finish = dataclasses.replace(policy, objective="finish")
    mixed = policy.initial_state(2, 8, costs).replace(accepted_ema=jnp.asarray([[0.95], [0.0]]),
                                                      tried_ema=jnp.ones((2, 1)))
    live, left = jnp.ones((2,), bool), jnp.asarray([100, 100])
    assert policy.depths[int(choose(policy, mixed, live, remaining=left))] == 7  # throughput ignores it
    assert finish.depths[int(choose(finish, mixed, live, remaining=left))] == 0
    # ... unless the slow row is nearly done: then the fast one's 100 tokens set the time.
    assert finish.depths[int(choose(finish, mixed, live, remaining=jnp.asarray([100, 3])))] == 7
    # One row: both objectives pick the same depth at every rate.
    for rate in (0.0, 0.3, 0.6, 0.95):
        one = policy.initial_state(1, 8, costs).replace(accepted_ema=jnp.asarray([[rate]]), tried_ema=jnp.ones((1, 1)))
        assert int(choose(finish, one, jnp.ones((1,), bool), remaining=jnp.asarray([40]))) == int(
            choose(policy, one, jnp.ones((1,), bool)))
    with pytest.raises(ValueError, match="objective"):
        AdaptiveDepth(objective="latency")
    assert depth_policy(NGramDrafter(k=K), "adaptive", None).objective == "throughput"  # the engine's
    assert prepare_inputs(models.target, [[1]], NGramDrafter(k=K), k="adaptive").depth.objective == "finish"
    # The pool: every observing row's drafts together, weighed as one row's; an admitted row (the
    # engine's) starts from its rate instead of the prior.
    from spec_jax.decoding.depth import admitted_row, record

    missed = record(policy, policy.initial_state(2, 8, costs), jnp.int32(3), jnp.int32(0), jnp.ones((2,), bool),
                    jnp.asarray([0, 1]))  # depth 7: the rows accepted 0 and 1 drafts
    rate = float(missed.pool_accepted[0] / missed.pool_tried[0])
    d = policy.decay
    assert np.isclose(rate, (d * 1.2 + 0.5) / (d * 2.0 + 1.5)) and rate < policy.prior
    row = admitted_row(policy, policy.initial_state(1, 8, costs), missed)
    assert np.isclose(float(row.accepted_ema[0, 0] / row.tried_ema[0, 0]), rate)
    # The probe backoff counts observations after which drafting still does not pay, not ones
    # where no row accepted a draft: at 8 rows some row nearly always accepts one.
    low = policy.initial_state(8, 8, costs).replace(accepted_ema=jnp.full((8, 1), 0.2), tried_ema=jnp.ones((8, 1)))
    one_accepts = jnp.asarray([1, 0, 0, 0, 0, 0, 0, 0])
    after = record(policy, low, jnp.int32(3), jnp.int32(0), jnp.ones((8,), bool), one_accepts)
    assert int(after.missed) == 1 and policy.depths[int(choose(policy, after, jnp.ones((8,), bool)))] == 0
    again = record(policy, after, jnp.int32(3), jnp.int32(1), jnp.ones((8,), bool), one_accepts)
    assert int(again.missed) == 2
    high = low.replace(accepted_ema=jnp.full((8, 1), 0.9), missed=jnp.int32(2))
    pays = record(policy, high, jnp.int32(3), jnp.int32(0), jnp.ones((8,), bool), jnp.full((8,), 7))
    assert int(pays.missed) == 0
    # ... judged over the batch's live rows, which step at one depth: one row's shadow probe closing
    # with both drafts matched does not reset the wait while the batch still steps plainly.
    from spec_jax.decoding.depth import record_shadow

    shallow = dataclasses.replace(policy, depths=(0, 2))
    probing = shallow.initial_state(8, 8, (1.0, 1.3)).replace(
        accepted_ema=jnp.full((8, 1), 0.2), tried_ema=jnp.ones((8, 1)), missed=jnp.int32(1),
        shadow=jnp.full((8, 2), 5), shadow_at=jnp.asarray([1, -1, -1, -1, -1, -1, -1, -1]))
    closed = record_shadow(shallow, probing, jnp.ones((8,), bool), jnp.full((8,), 5), jnp.asarray(False),
                           jnp.zeros((8, 2), jnp.int32))
    assert int(closed.shadow_at[0]) == -1 and float(closed.accepted_ema[0, 0]) > 1.0  # row 0 saw 2 of 2
    assert int(closed.missed) == 2 and shallow.depths[int(choose(shallow, closed, jnp.ones((8,), bool)))] == 0
    alone = record_shadow(shallow, probing, jnp.asarray([True] + [False] * 7), jnp.full((8,), 5),
                          jnp.asarray(False), jnp.zeros((8, 2), jnp.int32))
    assert int(alone.missed) == 0  # the batch is that one row: drafting pays for it
    # After enough plain steps a probe drafts at the cheapest depth, the deepest of equal ones.
    idle = dict(accepted_ema=jnp.zeros((1, 1)), tried_ema=jnp.ones((1, 1)), idle_steps=jnp.int32(1000))
    for probe_costs, probed in (((1.0, 2.0, 2.0, 2.0), 7), ((1.0, 1.5, 2.0, 2.0), 2), ((1.0, 3.0, 2.0, 2.5), 4)):
        state = policy.initial_state(1, 8, jnp.asarray(probe_costs)).replace(**idle)
        assert policy.depths[int(choose(policy, state, jnp.ones((1,), bool)))] == probed
    # A shadow probe waits shadow_every plain steps, times its price in plain steps when a step
    # at the largest depth costs more than two plain ones (DFlash over 8 rows on CPU).
    from spec_jax.decoding.depth import shadow_due

    shadowy = AdaptiveDepth(depths=(0, 2), shadow_every=32)
    for probe_costs, idle_steps, due in (((1.0, 1.5), 40, True), ((1.0, 4.0), 40, False), ((1.0, 4.0), 96, True),
                                         ((1.0, float("inf")), 40, False)):
        state = shadowy.initial_state(1, 8, jnp.asarray(probe_costs)).replace(idle_steps=jnp.int32(idle_steps))
        assert bool(shadow_due(shadowy, state, jnp.ones((1,), bool))) == due, (probe_costs, idle_steps)
    with pytest.raises(ValueError, match="one cost per depth"):
        AdaptiveDepth(depths=(0, 2), costs=(1.0,))
    with pytest.raises(ValueError, match="needs a drafter"):
        prepare_inputs(models.target, [[1]], k="adaptive")

    # The adaptive loop has no host round trip (lowered only: no compile).
    call = prepare_inputs(models.target, make_prompts([9], seed=5), NGramDrafter(k=K), k=SWITCHING)
    text = generate_jit.lower(call.inputs, model=call.target.model, drafter=call.drafter,
                              capacity=call.capacity, depth=call.depth).as_text()
    assert text.count("stablehlo.while") >= 3 and not re.search(r"callback|infeed|outfeed|\bsend\b|\brecv\b", text)

    # The command line: --k adaptive for generate, bench and serve; other commands refuse it.
    assert parse_ks("4,adaptive") == [4, "adaptive"] and k_value("Adaptive") == "adaptive"
    args = argparse.Namespace(k="adaptive", drafter="ngram", tree=None, target=None)
    assert drafter_spec_from_args(args, adaptive_ok=True).adaptive
    assert drafter_spec_from_args(argparse.Namespace(**{**vars(args), "tree": 8}), adaptive_ok=True).tree == 8
    with pytest.raises(UsageError, match="generate, bench and serve"):
        drafter_spec_from_args(args)

    monkeypatch.setenv("SPEC_JAX_DEPTH_COSTS", str(tmp_path / "costs.json"))

    class Inputs(SimpleNamespace):
        def replace(self, **values):
            return Inputs(**{**vars(self), **values})

    runs = []

    def loop(inputs):
        runs.append(inputs)
        return SimpleNamespace(steps=np.int32(4))

    call = SimpleNamespace(
        inputs=Inputs(prompt_tokens=np.zeros((1, 16), np.int32), max_new_tokens=jnp.int32(24),
                      stop_ids=jnp.zeros((8,), jnp.int32)),
        depth=AdaptiveDepth(depths=(0, 2)), target=SimpleNamespace(model="model"), drafter="drafter", capacity=256)
    measured = costs_for(loop, call)
    assert len(measured) == 2 and all(c > 0 for c in measured) and len(runs) == 9  # 3 runs, best of 3
    assert costs_for(loop, call) == measured and len(runs) == 9  # read back from the file
    # A timing inflated by a shared machine never makes a shallower depth dearer than a deeper one.
    assert shallower_never_dearer((0.04, 0.226, 0.222, 0.113)) == (0.04, 0.113, 0.113, 0.113)
    assert shallower_never_dearer((0.04, 0.11, 0.12, 0.14)) == (0.04, 0.11, 0.12, 0.14)


def _prompt_captured(models, drafter, length: int):
    """-> (the target, a [1, length] prompt, the hidden states the drafter captures over it)."""
    target = Target(models.params, Decoder(models.cfg))
    tokens = jnp.asarray(make_prompts([length], seed=2), jnp.int32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    _, captured, _ = jax.jit(lambda t: forward_capturing(target, t, positions, target.model.init_cache(1, 16),
                                                         drafter.capture_layers))(tokens)
    return target, tokens, captured


def test_dflash_context_stays_current_across_a_plain_step(models):
    """A K = 0 step gives DFlash the verified token's context entry (its commit of a step that
    accepted nothing), as if the token had been part of its context all along."""
    drafter = DFlashDrafter(TINY_DFLASH, K)
    dflash_params = init_dflash_params(TINY_DFLASH, jax.random.key(3), scale=3.0)
    target, tokens, captured = _prompt_captured(models, drafter, 10)

    @jax.jit
    def contexts(captured):
        whole = drafter.init(dflash_params, target, tokens, jnp.asarray([10]), captured, 16)
        # Context of 9 tokens, position 9's entry blank; then the plain step that verifies token 9.
        part = drafter.init(dflash_params, target, tokens, jnp.asarray([9]), captured.at[:, 9].set(0), 16)
        stepped = PlainStep(drafter).commit(dflash_params, target, part, jnp.asarray([9]),
                                            jnp.zeros((1,), jnp.int32), captured[:, 9:10])
        return whole, part, stepped

    whole, part, stepped = contexts(captured)
    assert int(stepped.lengths[0]) == 10 and int(part.lengths[0]) == 9
    for want, blank, got in zip(whole.k + whole.v, part.k + part.v, stepped.k + stepped.v):
        assert not np.allclose(blank[..., 9, :], want[..., 9, :])
        np.testing.assert_allclose(got[..., :10, :], want[..., :10, :], atol=1e-5)


# Trees: three depths, so a middle one drafts a smaller tree (a budget scaled by depth / K, a
# static tree's paths no deeper than the depth): the first steps draft K = 4, then 2, then 0.
TREE_K = 4
TREES = AdaptiveDepth(depths=(0, 2, TREE_K), costs=(1.0, 1.2, 1.5), prior=0.9, probe_every=4)


def test_adaptive_depth_exact_with_trees(models):
    """EAGLE-3's budget tree (a pair-cache drafter, as the MTP heads) at batch 8, each step at
    depth 4, 2 (a tree of half the nodes) or 0: greedy output equals plain decoding (one compile;
    the chains of n-gram, the draft model and DFlash are the test above's; Medusa's static tree,
    the other tree drafters, Medusa and EAGLE-3 chains, the suffix drafter, the Gemma 4 assistant
    and Qwen's MTP head ran once: benchmarks/RESULTS.md, issue 41)."""
    cfg = Eagle3Config(layer=models.draft_cfg, draft_vocab_size=VOCAB, aux_layer_ids=(1, 2),
                       speculative_tokens=TREE_K)
    drafter = Eagle3Drafter(cfg, k=TREE_K, tree=8)
    prompts = make_prompts([3, 16, 1, 9, 12, 5, 8, 14], seed=3)
    ids, trace = _run(models, prompts, drafter, init_eagle3_params(cfg, jax.random.key(5), scale=3.0), TREES,
                      "generate")
    assert ids == _plain(models, prompts)
    assert sorted(set(trace)) == [0, 2, TREE_K], trace
    # A shallower step's tree: a budget scaled by depth / K; a static tree cut at the depth.
    assert drafter_at_depth(drafter, 2, TREE_K).tree == 4
    medusa = MedusaDrafter(MedusaConfig.for_target(models.cfg, num_heads=TREE_K), k=TREE_K,
                           tree=((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)))
    assert drafter_at_depth(medusa, 2, TREE_K).tree == ((0,), (1,), (0, 0), (0, 1))


def test_pair_cache_stays_current_across_a_plain_step(models):
    """EAGLE-3 (and the MTP head: the same `PairCacheDrafter`) before a K = 0 step runs its
    pending pairs into its cache, and the step leaves the verified token's features pending: as
    if the prompt had been one token longer all along."""
    cfg = Eagle3Config(layer=models.draft_cfg, draft_vocab_size=VOCAB, aux_layer_ids=(1, 2), speculative_tokens=K)
    drafter, params = Eagle3Drafter(cfg, k=K), init_eagle3_params(cfg, jax.random.key(5), scale=3.0)
    target, tokens, captured = _prompt_captured(models, drafter, 11)

    @jax.jit
    def states(captured):
        whole = drafter.init(params, target, tokens, jnp.asarray([11]), captured, 16)
        # A 10-token prompt and its first token (position 10), then the plain step verifying it.
        part = drafter.init(params, target, tokens, jnp.asarray([10]), captured, 16)
        plain = PlainStep(drafter)
        _, _, kept = plain.propose(params, target, part, tokens, jnp.asarray([11]), None, None)
        return whole, plain.commit(params, target, kept, jnp.asarray([10]), jnp.zeros((1,), jnp.int32),
                                   captured[:, 10:11])

    whole, stepped = states(captured)
    assert int(stepped.cache.lengths[0]) == int(whole.cache.lengths[0]) == 10
    assert stepped.pending.shape == whole.pending.shape == (1, K + 1, whole.pending.shape[-1])
    np.testing.assert_allclose(stepped.pending[:, 0], whole.pending[:, 0], atol=1e-6)
    for got, want in zip(stepped.cache.k + stepped.cache.v, whole.cache.k + whole.cache.v):
        np.testing.assert_allclose(got[..., :10, :], want[..., :10, :], atol=1e-5)
