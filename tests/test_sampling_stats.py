"""Speculative sampling reproduces the target's distribution (statistical tests), and `warp`
matches a numpy reference of temperature -> top-k -> top-p (HF order).

False-failure rate: every chi-square test fails only at p < 1e-4; the file runs <= 32 (vmapped
`accept`) + 18 (end to end) such tests, so a correct implementation fails one with probability
< 5e-3 -- and the seeds are fixed, so a given run is deterministic. Cells the target gives
probability 0 must get no samples at all (checked exactly, not statistically).
"""

from __future__ import annotations

import dataclasses

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from spec_jax.decoding import generate
from spec_jax.decoding.engine_programs import request_key
from spec_jax.decoding.generate import prepare_inputs, unpack
from spec_jax.decoding.loop import generate_jit
from spec_jax.sampling import SamplingParams, sample, warp
from spec_jax.decoding.acceptance import accept
from spec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_layers, init_dflash_params
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.drafters.lookup import LookupFirstDrafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.drafters.qwen_mtp import QwenMtpConfig, QwenMtpDrafter, init_mtp_params
from spec_jax.models import ModelConfig, forward, init_cache, init_params
from spec_jax.models.config import MoeConfig

P_FAIL = 1e-4
SAMPLING = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 3, 1.0),
    (1.3, 0, 0.8),
    (0.9, 5, 0.7),
]


def ref_warp(logits, temperature, top_k, top_p):
    """numpy reference, written after transformers' Temperature/TopK/TopP logits warpers."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return np.eye(logits.shape[-1])[np.argmax(logits, -1)]
    out = []
    for row in logits.reshape(-1, logits.shape[-1]):
        s = row / temperature
        if top_k > 0:
            kth = np.sort(s)[::-1][min(top_k, len(s)) - 1]
            s = np.where(s < kth, -np.inf, s)
        if top_p < 1.0:
            order = np.argsort(s)  # ascending
            probs = np.exp(s[order] - s[order][-1])
            probs /= probs.sum()
            remove = np.cumsum(probs) <= 1 - top_p
            remove[-1] = False  # min_tokens_to_keep = 1
            s = s.copy()
            s[order[remove]] = -np.inf
        e = np.exp(s - s.max())
        out.append(e / e.sum())
    return np.asarray(out).reshape(logits.shape)


def chi_square_ok(counts, probs, what):
    """counts ~ Multinomial(sum, probs)? Zero-probability cells must be empty; cells with an
    expected count < 5 are pooled into one."""
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    zero = probs <= 1e-12
    assert counts[zero].sum() == 0, f"{what}: samples where the target has probability 0"
    counts, probs = counts[~zero], probs[~zero] / probs[~zero].sum()
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(counts) < 2:
        return
    p_value = scipy_stats.chisquare(counts, expected).pvalue
    assert p_value > P_FAIL, f"{what}: chi-square p = {p_value:.2e}"


# --------------------------------------------------------------------------- warp
warp_jit = jax.jit(warp)


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING + [(0.0, 0, 1.0), (0.5, 1, 1.0), (1.0, 0, 0.05), (2.0, 100, 0.999)])
def test_warp_matches_numpy_reference(temperature, top_k, top_p):
    logits = 2.0 * jax.random.normal(jax.random.key(0), (6, 12))
    got = warp_jit(logits, SamplingParams.create(temperature, top_k, top_p))
    np.testing.assert_allclose(got, ref_warp(logits, temperature, top_k, top_p), atol=1e-5)


def test_warp_per_row_values_at_full_vocabulary_match_the_reference():
    """Each row its own values (the engine's), over a real vocabulary (49152): top-k alone, top-p
    alone, both, neither, greedy; and a row with top_p = 1 beside a truncating one keeps its whole
    distribution (the old sort's cumulative sum dropped its tail once it rounded to 1)."""
    rows = [(1.0, 0, 0.9), (0.7, 40, 1.0), (1.3, 200, 0.95), (1.0, 0, 1.0), (0.0, 0, 1.0), (0.8, 5000, 0.5),
            (2.0, 0, 0.999), (1.0, 1, 0.3)]
    logits = 3.0 * jax.random.normal(jax.random.key(1), (len(rows), 49152))
    temperature, top_k, top_p = (np.asarray(v) for v in zip(*rows))
    got = np.asarray(warp_jit(logits, SamplingParams.per_row(temperature, top_k, top_p)))
    for i, (t, k, p) in enumerate(rows):
        want = ref_warp(logits[i], t, k, p)
        assert np.array_equal(got[i] > 0, want > 0), (rows[i], int((got[i] > 0).sum()), int((want > 0).sum()))
        np.testing.assert_allclose(got[i], want, atol=1e-6, err_msg=str(rows[i]))
    assert (got[3] > 0).all()  # top_p = 1 beside truncating rows: nothing cut


def test_warp_keeps_ties_with_the_kth_value_and_both_zeros():
    """Logits with many equal values (and -0.0 beside 0.0): top-k keeps every tie of the k-th
    value, as transformers' TopKLogitsWarper does; -inf entries never come back."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        vocab = int(rng.integers(2, 400))
        logits = np.round(rng.normal(size=(3, vocab)) * rng.uniform(0.5, 4)).astype(np.float32)
        logits[logits == 0] = rng.choice([0.0, -0.0], size=int((logits == 0).sum()))
        logits[:, rng.integers(0, vocab)] = -np.inf
        top_k = rng.integers(1, vocab + 2, size=3)
        got = np.asarray(warp_jit(jnp.asarray(logits), SamplingParams.per_row(np.ones(3), top_k, np.ones(3))))
        for i in range(3):
            want = ref_warp(logits[i], 1.0, int(top_k[i]), 1.0)
            assert np.array_equal(got[i] > 0, want > 0), (trial, i, int(top_k[i]))


# --------------------------------------------------------------------------- sample
@pytest.mark.parametrize("vocab", [300, 49152])
def test_sample_draws_from_probs_and_never_a_zero_probability_token(vocab):
    """`sample` (inverse CDF over blocks of CDF_BLOCK entries) against its probabilities: mass at
    block edges, a whole block without mass, zeros between tokens, a vocabulary that does not
    fill its last block (300), and rows given unnormalised."""
    rng = np.random.default_rng(0)
    probs = np.zeros((2, vocab))
    support = [0, 1, 127, 128, 130, 255, vocab - 1] if vocab == 300 else [5, 127, 128, 4096, 49151]
    probs[0, support] = rng.uniform(0.2, 1.0, len(support))  # block 1 of 300 (256..383) sparse
    probs[1, rng.choice(vocab, 40, replace=False)] = rng.uniform(0.0, 1.0, 40)
    probs[1, 200:256] = 0.0  # a block with no mass at all, for vocab 300
    probs[1] = 3.0 * probs[1] / probs[1].sum()  # unnormalised: the draw scales by the total
    draws = jax.jit(jax.vmap(lambda key: sample(key, jnp.asarray(probs, jnp.float32))))(
        jax.random.split(jax.random.key(3), 60_000)
    )
    for row in range(2):
        counts = np.bincount(np.asarray(draws[:, row]), minlength=vocab)
        chi_square_ok(counts, probs[row], f"sample, vocab {vocab}, row {row}")


# ------------------------------------------------------------ accept, vmapped over keys
V_ACC, K_ACC, N_ACC = 8, 3, 100_000


def _emit(key, p, q_logits, sampling, fixed_drafts):
    """One speculative step on context-free p_1..p_{K+1}: drafts sampled from q (or fixed,
    one-hot), then `accept`. Returns the K+1 emitted slots and n."""
    draft_key, accept_key = jax.random.split(key)
    if fixed_drafts is None:
        q = warp(q_logits, sampling)  # [K, V]
        drafts = sample(draft_key, q)  # [K]
        n, nxt = accept(accept_key, p[None], drafts[None], q[None])
    else:
        drafts = fixed_drafts
        n, nxt = accept(accept_key, p[None], drafts[None], None)
    slots = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]).at[n[0]].set(nxt[0])
    return slots, n[0]


@jax.jit
def _run_accept(keys, p, q_logits, sampling):
    return jax.vmap(lambda key: _emit(key, p, q_logits, sampling, None))(keys)


@jax.jit
def _run_accept_one_hot(keys, p, drafts):
    return jax.vmap(lambda key: _emit(key, p, None, None, drafts))(keys)


@pytest.mark.parametrize("draft_kind", ["full", "one_hot"])
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
def test_accept_reproduces_target_distribution(draft_kind, temperature, top_k, top_p):
    """Context-free target p_1..p_{K+1}: the token in emitted slot j, over the runs that reach
    slot j (n >= j), is distributed as p_{j+1} -- whatever q is."""
    sampling = SamplingParams.create(temperature, top_k, top_p)
    key_t, key_q, key_run = jax.random.split(jax.random.key(hash((draft_kind == "full", temperature, top_k, top_p)) % 2**31), 3)
    target_logits = 1.5 * jax.random.normal(key_t, (K_ACC + 1, V_ACC))
    p = warp(target_logits, sampling)
    keys = jax.random.split(key_run, N_ACC)
    if draft_kind == "full":
        draft_logits = target_logits[:K_ACC] + 1.5 * jax.random.normal(key_q, (K_ACC, V_ACC))
        slots, n = _run_accept(keys, p, draft_logits, sampling)
    else:
        # Drafts: a likely token, an unlikely one, the least likely one (0 under top-k/top-p).
        order = jnp.argsort(-p, axis=-1)
        drafts = jnp.asarray([order[0, 0], order[1, 2], order[2, V_ACC - 1]], jnp.int32)
        slots, n = _run_accept_one_hot(keys, p, drafts)
    slots, n, p = np.asarray(slots), np.asarray(n), np.asarray(p)
    for j in range(K_ACC + 1):
        reached = slots[n >= j, j]
        assert not np.any(p[j][reached] == 0), f"slot {j}: token outside the target's support"
        if len(reached) < 1000:  # a late slot reached too rarely (disjoint supports, rare drafts)
            continue
        chi_square_ok(np.bincount(reached, minlength=V_ACC), p[j], f"slot {j}")
    # Acceptance really happened and was not universal.
    assert 0 < (n > 0).mean() < 1


# ------------------------------------------------------------------ end to end
V_E2E, HORIZON, K_E2E, ROWS, SEEDS = 8, 3, 2, 2048, 5
E2E_CFG = ModelConfig(
    vocab_size=V_E2E, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=16,
)
E2E_DRAFT_CFG = E2E_CFG.replace(num_layers=1)
E2E_DFLASH_CFG = DFlashConfig(
    layer=dflash_layers(1, 32, 2, 1, 16, 64, vocab_size=V_E2E),
    block_size=K_E2E + 1, target_layer_ids=(0, 1), mask_token_id=7, num_target_layers=2,
)
# EAGLE-3 with a reduced draft vocabulary (6 of 8 tokens): drafts never propose 3 or 6, and
# their distributions are mapped back onto the target vocabulary.
E2E_EAGLE3_CFG = Eagle3Config(layer=E2E_DRAFT_CFG, draft_vocab_size=6, aux_layer_ids=(1, 2),
                              speculative_tokens=K_E2E)
E2E_EAGLE3_TARGET_IDS = np.array([0, 1, 2, 4, 5, 7])
PROMPT = [1, 2, 3]


def prefix_logits(params, cfg: ModelConfig) -> np.ndarray:
    """Logits for every 3-token continuation prefix: [V^2, P+2] sequences, one full forward."""
    prefixes = np.asarray(list(itertools.product(range(V_E2E), repeat=2)))  # [V^2, 2]
    seqs = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    b, t = seqs.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _, _ = jax.jit(forward, static_argnums=1)(
        params, cfg, jnp.asarray(seqs), positions, init_cache(cfg, b, t)
    )
    return np.asarray(logits)


@pytest.fixture(scope="module")
def e2e():
    params = init_params(E2E_CFG, jax.random.key(10), scale=1.5)
    draft_params = init_params(E2E_DRAFT_CFG, jax.random.key(11), scale=1.5)
    return params, draft_params, prefix_logits(params, E2E_CFG)


def exact_joint(logits, temperature, top_k, top_p):
    """P(t1, t2, t3 | prompt) under the warped target: [V, V, V]."""
    p = len(PROMPT)
    v = V_E2E
    p1 = ref_warp(logits[0, p - 1], temperature, top_k, top_p)  # same for every row
    p2 = ref_warp(logits[::v, p], temperature, top_k, top_p)  # row t1 * V + 0 -> [V(t1), V]
    p3 = ref_warp(logits[:, p + 1], temperature, top_k, top_p).reshape(v, v, v)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


E2E_DRAFTERS = ["ngram", "draft_model", "dflash", "dflash_draft_vocab", "eagle3", "dflash_lookup"]
# Each drafter under two of the first three sampling settings, each setting for four drafters.
E2E_CASES = [(kind, *setting) for d, kind in enumerate(E2E_DRAFTERS)
             for s, setting in enumerate(SAMPLING[:3]) if s != d % 3]


@pytest.mark.parametrize("drafter_kind,temperature,top_k,top_p", E2E_CASES)
def test_generate_reproduces_target_joint_distribution(e2e, drafter_kind, temperature, top_k, top_p):
    """The first 3 generated tokens (prefill token + one or two verify steps with K = 2), over
    5 seeds x 2048 identical rows, against the exact warped joint from full forward passes."""
    params, draft_params, logits = e2e
    if drafter_kind == "ngram":
        drafter, dparams = NGramDrafter(k=K_E2E, max_ngram=2), None
    elif drafter_kind == "dflash":  # sampled block drafts with their full distributions
        drafter = DFlashDrafter(E2E_DFLASH_CFG)
        dparams = init_dflash_params(E2E_DFLASH_CFG, jax.random.key(12), scale=1.5)
    elif drafter_kind == "dflash_lookup":  # point-mass lookup drafts where the first token recurs
        # in the prompt (t1 in 1, 2, 3), sampled DFlash drafts in the other rows
        drafter = LookupFirstDrafter(DFlashDrafter(E2E_DFLASH_CFG), min_match=1, max_ngram=2)
        dparams = init_dflash_params(E2E_DFLASH_CFG, jax.random.key(12), scale=1.5)
    elif drafter_kind == "dflash_draft_vocab":  # its own head over 6 of the 8 tokens
        cfg = dataclasses.replace(E2E_DFLASH_CFG, draft_vocab_size=6)
        drafter = DFlashDrafter(cfg)
        dparams = init_dflash_params(cfg, jax.random.key(14), scale=1.5)
        dparams["d2t"] = jnp.asarray(E2E_EAGLE3_TARGET_IDS - np.arange(6), jnp.int32)
    elif drafter_kind == "eagle3":  # sampled chain drafts over a reduced vocabulary
        drafter = Eagle3Drafter(E2E_EAGLE3_CFG)
        dparams = init_eagle3_params(E2E_EAGLE3_CFG, jax.random.key(13), scale=1.5)
        dparams["d2t"] = jnp.asarray(E2E_EAGLE3_TARGET_IDS - np.arange(6), jnp.int32)
    else:
        drafter, dparams = DraftModelDrafter(E2E_DRAFT_CFG, K_E2E), draft_params
    counts, accepted = sampled_joint_counts((E2E_CFG, params), drafter, dparams, temperature, top_k, top_p)
    assert accepted > 0  # the acceptance path was exercised, not only corrections
    chi_square_ok(counts, exact_joint(logits, temperature, top_k, top_p), "joint of 3 tokens")


def sampled_joint_counts(target, drafter, drafter_params, temperature, top_k, top_p, seeds=SEEDS):
    """[V, V, V] counts of the first 3 generated tokens over seeds x ROWS rows, and the drafts accepted."""
    counts = np.zeros((V_E2E,) * HORIZON)
    accepted = 0
    for seed in range(seeds):
        r = generate(
            target, [PROMPT] * ROWS, drafter, drafter_params, max_new_tokens=HORIZON,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, capacity=32,
        )
        ids = np.asarray(r.generated_ids)
        assert ids.shape == (ROWS, HORIZON)
        np.add.at(counts, tuple(ids.T), 1)
        accepted += r.stats.accepted
    return counts, accepted


def test_adaptive_depth_keeps_the_target_distribution(e2e):
    """The adaptive depth (issue 41), its choice made from acceptance the rows' own samples
    produced: the first step drafts K = 2 (an optimistic prior); rows that accepted nothing take
    their third token from a plain step (their acceptance rate fell below what a drafting step's
    cost pays for); the joint of 3 tokens stays the target's."""
    from spec_jax.decoding.depth import AdaptiveDepth

    params, draft_params, logits = e2e
    temperature, top_k, top_p = SAMPLING[1]
    depth = AdaptiveDepth(depths=(0, K_E2E), costs=(1.0, 2.0), prior=0.9)
    counts, accepted = np.zeros((V_E2E,) * HORIZON), 0
    for seed in range(3):
        r = generate((E2E_CFG, params), [PROMPT] * ROWS, DraftModelDrafter(E2E_DRAFT_CFG, K_E2E), draft_params,
                     k=depth, max_new_tokens=HORIZON, temperature=temperature, top_k=top_k, top_p=top_p,
                     seed=seed, capacity=32)
        assert r.depth_trace == [K_E2E, 0], r.depth_trace
        np.add.at(counts, tuple(np.asarray(r.generated_ids).T), 1)
        accepted += r.stats.accepted
    assert accepted > 0
    chi_square_ok(counts, exact_joint(logits, temperature, top_k, top_p), "joint of 3 tokens, adaptive depth")


# A mixture-of-experts target: each token through 2 of 4 experts, its own routing in every pass.
E2E_MOE_CFG = E2E_CFG.replace(moe=MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=32,
                                            normalize_top_k=True))


def test_sampled_speculation_on_a_mixture_of_experts_target(e2e):
    """The MoE target's warped joint of 3 tokens, reproduced with a (dense) draft model in front."""
    params = init_params(E2E_MOE_CFG, jax.random.key(15), scale=1.5)
    temperature, top_k, top_p = SAMPLING[0]
    counts, accepted = sampled_joint_counts((E2E_MOE_CFG, params), DraftModelDrafter(E2E_DRAFT_CFG, K_E2E),
                                            e2e[1], temperature, top_k, top_p)
    assert accepted > 0
    chi_square_ok(counts, exact_joint(prefix_logits(params, E2E_MOE_CFG), temperature, top_k, top_p),
                  "joint of 3 tokens, MoE target")


# A recurrent (Qwen3.5-style) target: a Gated DeltaNet layer, then attention.
E2E_RECURRENT_CFG = E2E_CFG.replace(
    layer_types=("linear_attention", "full_attention"), linear_num_key_heads=1, linear_num_value_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16,
)


def test_sampled_speculation_on_a_recurrent_target_with_its_mtp_head():
    """The recurrent target's warped joint of 3 tokens, reproduced with an MTP head (issue 44) in
    front drafting sampled chains: the target's state rollback and the head's own cache are both
    under the exact acceptance (4,096 rows: each 2,048 costs seconds on a recurrent target)."""
    params = init_params(E2E_RECURRENT_CFG, jax.random.key(16), scale=1.5)
    mtp = QwenMtpConfig.from_target(E2E_RECURRENT_CFG)
    temperature, top_k, top_p = SAMPLING[2]
    counts, accepted = sampled_joint_counts((E2E_RECURRENT_CFG, params), QwenMtpDrafter(mtp, k=K_E2E),
                                            init_mtp_params(mtp, jax.random.key(17), scale=1.5),
                                            temperature, top_k, top_p, seeds=2)
    assert accepted > 0
    chi_square_ok(counts, exact_joint(prefix_logits(params, E2E_RECURRENT_CFG), temperature, top_k, top_p),
                  "joint of 3 tokens, recurrent target")


PER_ROW_RUNS = 2  # x ROWS rows, each with its own seed


def test_per_request_keys_keep_sampling_exact(e2e):
    """The engine's per-row keys (each row its own request's key, folded with its own length at
    every draw: `loop.draw_keys`): the loop run with one request key per row (distinct seeds)
    reproduces the warped joint, with a draft model's sampled drafts in front."""
    params, draft_params, logits = e2e
    temperature, top_k, top_p = SAMPLING[1]
    drafter = DraftModelDrafter(E2E_DRAFT_CFG, K_E2E)
    call = prepare_inputs((E2E_CFG, params), [PROMPT] * ROWS, drafter, draft_params, max_new_tokens=HORIZON,
                          temperature=temperature, top_k=top_k, top_p=top_p, capacity=32)
    counts, accepted = np.zeros((V_E2E,) * HORIZON), 0
    for run in range(PER_ROW_RUNS):
        keys = jax.vmap(request_key)(jnp.arange(run * ROWS, (run + 1) * ROWS))
        out = generate_jit(call.inputs.replace(key=keys), model=call.target.model, drafter=call.drafter,
                           capacity=call.capacity)
        ids, *_ = unpack(jax.device_get(out))
        np.add.at(counts, tuple(np.asarray(ids).T), 1)
        accepted += int(out.stats.accepted.sum())
    assert accepted > 0
    chi_square_ok(counts, exact_joint(logits, temperature, top_k, top_p), "joint of 3 tokens, per-row keys")


def test_generate_same_seed_same_samples_different_seed_differs(e2e):
    params, draft_params, _ = e2e
    drafter = DraftModelDrafter(E2E_DRAFT_CFG, K_E2E)
    kw = dict(max_new_tokens=HORIZON, temperature=1.0, capacity=32)
    run = lambda seed: generate((E2E_CFG, params), [PROMPT] * ROWS, drafter, draft_params, seed=seed, **kw).generated_ids
    a, b, c = run(0), run(0), run(1)
    assert a == b
    assert a != c
