"""Table-driven acceptance and emission cases, each also run padded inside a larger batch.

The target is a hand-built bigram model: attention and MLP outputs are zeroed, the embedding is
the identity and the LM head a permutation, so the greedy next token after `t` is SUCC[t] whatever
the context. A fixed drafter proposes the drafts each case gives. One `speculative_step` after
`prefill` then has a known answer: accepted count, emitted tokens, finish reason, stats.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.decoding.loop import FINISH_NAMES, MAX_STOP_IDS, prefill, speculative_step
from spec_jax.sampling import SamplingParams
from spec_jax.decoding.acceptance import accept
from spec_jax.models import Decoder, Target
from spec_jax.models import ModelConfig, init_params

V, K = 16, 4
SUCC = (3 * np.arange(V) + 1) % V  # a permutation: the bigram target's argmax after t
CFG = ModelConfig(
    vocab_size=V, hidden_size=V, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
    head_dim=8,
)


def bigram_params():
    params = init_params(CFG, jax.random.key(0))
    layers = [
        {**lp, "wo": jnp.zeros_like(lp["wo"]), "w_down": jnp.zeros_like(lp["w_down"])}
        for lp in params["layers"]
    ]
    return {
        **params,
        "layers": layers,
        "embed": jnp.eye(V, dtype=jnp.float32),
        "final_norm": jnp.ones((V,), jnp.float32),
        "lm_head": 10.0 * jax.nn.one_hot(SUCC, V, dtype=jnp.float32),  # [H=V, V]
    }


@dataclasses.dataclass(frozen=True)
class FixedDrafter:
    """Proposes the drafts it is given as params ([B, K]), one-hot."""

    k: int = K

    @property
    def capture_layers(self):
        return ()

    def validate(self, target_cfg, capacity):
        pass

    def init(self, params, target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        return ()

    def propose(self, params, target, state, tokens, lengths, key, sampling):
        return params, None, state

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return state


@functools.partial(jax.jit, static_argnames=("capacity",))
def one_step(params, prompts, prompt_lengths, drafts, max_new, stop_ids, done, capacity=32):
    target = Target(params, Decoder(CFG))
    sampling = SamplingParams.create()
    state = prefill(
        target, FixedDrafter(), drafts, prompts, prompt_lengths, jax.random.key(0), sampling,
        max_new, stop_ids, capacity,
    )
    state = state.replace(done=state.done | done)
    return speculative_step(state, target, FixedDrafter(), drafts, sampling, max_new, stop_ids)


def chain(t, n):
    out = []
    for _ in range(n):
        t = int(SUCC[t])
        out.append(t)
    return out


# Every case: prompt [2, 5]; prefill emits F = SUCC[5]; the step verifies [F, d1..dK] and the
# target's argmaxes are C = chain(F). X is a token that is never the right draft.
F = int(SUCC[5])
C = chain(F, K + 1)
X = [t for t in range(V) if t not in C and t != F][0]


@dataclasses.dataclass
class Case:
    name: str
    drafts: list
    accepted: int  # drafts accepted by the rule (before any cut)
    emitted: list  # tokens the step commits
    reason: str
    max_new: int = 20
    stop: tuple = ()
    done: bool = False


CASES = [
    Case("all_accepted_plus_bonus", C[:K], K, C[: K + 1], "none"),
    Case("first_rejected", [X] + C[1:K], 0, C[:1], "none"),
    Case("rejected_mid_block", [C[0], C[1], X, C[3]], 2, C[:3], "none"),
    Case("last_rejected", C[: K - 1] + [X], K - 1, C[:K], "none"),
    Case("stop_inside_accepted_run", C[:K], K, C[:2], "stop", stop=(C[1],)),
    Case("stop_is_the_correction", [C[0], X, X, X], 1, C[:2], "stop", stop=(C[1],)),
    Case("stop_is_the_bonus", C[:K], K, C[: K + 1], "stop", stop=(C[K],)),
    Case("stop_in_rejected_draft_ignored", [C[0], X, X, X], 1, C[:2], "none", stop=(X,)),
    Case("cap_mid_block", C[:K], K, C[:2], "length", max_new=3),
    Case("cap_and_stop_at_same_token_is_stop", C[:K], K, C[:2], "stop", max_new=3, stop=(C[1],)),
    Case("stop_after_cap_not_reached", C[:K], K, C[:2], "length", max_new=3, stop=(C[2],)),
    Case("cap_exactly_at_block_end", C[:K], K, C[: K + 1], "length", max_new=K + 2),
    Case("row_already_done", C[:K], K, [], "none", done=True),
]
assert len(set(C)) == K + 1 and F not in C[:2]


def run(cases_rows, max_new, stop):
    """Run rows [(prompt, drafts, done)] in one batch; returns per-row observations."""
    batch = len(cases_rows)
    prompts = np.zeros((batch, 16), np.int32)
    lengths = np.zeros((batch,), np.int32)
    for i, (prompt, _, _) in enumerate(cases_rows):
        prompts[i, : len(prompt)] = prompt
        lengths[i] = len(prompt)
    stop_ids = list(stop) + [-1] * (MAX_STOP_IDS - len(stop))
    s = one_step(
        bigram_params(), jnp.asarray(prompts), jnp.asarray(lengths),
        jnp.asarray([d for _, d, _ in cases_rows], jnp.int32), jnp.int32(max_new),
        jnp.asarray(stop_ids, jnp.int32), jnp.asarray([dn for _, _, dn in cases_rows]),
    )
    s = jax.device_get(s)
    rows = []
    for i, (prompt, _, _) in enumerate(cases_rows):
        p = len(prompt)
        rows.append(dict(
            generated=s.tokens[i, p : s.lengths[i]].tolist(),
            reason=FINISH_NAMES[int(s.finish_reason[i])],
            done=bool(s.done[i]),
            cache_length=int(s.cache.lengths[i]),
            stats={f: np.asarray(getattr(s.stats, f)[i]).tolist() for f in
                   ("steps", "drafted", "accepted", "emitted", "histogram", "position_accepted")},
        ))
    return rows


def check(case, row, prompt_len=2):
    assert row["generated"] == [F] + case.emitted, case.name
    assert row["reason"] == case.reason, case.name
    assert row["done"] == (case.reason != "none" or case.done), case.name
    assert row["cache_length"] == prompt_len + len(case.emitted)  # lengths - 1: last not cached
    live = 0 if case.done else 1
    hist = [0] * (K + 1)
    hist[case.accepted] = live
    assert row["stats"] == dict(
        steps=live, drafted=live * K, accepted=live * case.accepted,
        emitted=live * len(case.emitted), histogram=hist,
        position_accepted=[live * int(i < case.accepted) for i in range(K)],
    ), case.name


# Neighbours for the padded runs: other prompts (longer and shorter), their own drafts.
NEIGHBOURS = [([7], [1, 2, 3, 4]), (list(range(3, 14)), chain(SUCC[13], K)), ([9, 9, 9, 9, 9], [0] * K)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_alone_and_padded(case):
    alone = run([([2, 5], case.drafts, case.done)], case.max_new, case.stop)[0]
    check(case, alone)
    rows = [(p, d, False) for p, d in NEIGHBOURS]
    rows.insert(2, ([2, 5], case.drafts, case.done))
    padded = run(rows, case.max_new, case.stop)
    assert padded[2] == alone, case.name
    # The neighbours follow the same rule (checked against a direct reading of it).
    for (prompt, drafts), got in zip(NEIGHBOURS, padded[:2] + padded[3:]):
        first = int(SUCC[prompt[-1]])
        target = chain(first, K + 1)
        n = next((i for i in range(K) if drafts[i] != target[i]), K)
        out = ([first] + target[: n + 1])[: case.max_new]
        stops = [i for i, t in enumerate(out) if t in case.stop]
        out = out[: stops[0] + 1] if stops else out
        assert got["generated"] == out, prompt


def test_mixed_acceptance_across_rows():
    """Rows accepting K, 0, 2 drafts and a finished row, side by side in one step."""
    by_name = {c.name: c for c in CASES}
    picked = [by_name[n] for n in
              ("all_accepted_plus_bonus", "first_rejected", "rejected_mid_block", "row_already_done")]
    rows = run([([2, 5], c.drafts, c.done) for c in picked], 20, ())
    for c, row in zip(picked, rows):
        check(c, row)


# ------------------------------------------------------------------- `accept` alone
accept_jit = jax.jit(accept)


def one_hot_probs(tokens):
    return jax.nn.one_hot(jnp.asarray(tokens), V, dtype=jnp.float32)


ACCEPT_CASES = [
    # (target argmaxes p_1..p_{K+1}, drafts, expected n, expected next token)
    ([1, 2, 3, 4, 5], [1, 2, 3, 4], 4, 5),
    ([1, 2, 3, 4, 5], [0, 2, 3, 4], 0, 1),
    ([1, 2, 3, 4, 5], [1, 2, 0, 4], 2, 3),
    ([1, 2, 3, 4, 5], [1, 2, 3, 0], 3, 4),
    ([7, 7, 7, 7, 7], [7, 7, 7, 7], 4, 7),
]


@pytest.mark.parametrize("draft_probs", ["none", "one_hot"])
def test_accept_table_alone_and_padded(draft_probs):
    """Greedy-shaped p (one-hot): the result is deterministic for any key. All cases batched
    together equal each case alone."""
    targets = one_hot_probs([c[0] for c in ACCEPT_CASES])  # [B, K+1, V]
    drafts = jnp.asarray([c[1] for c in ACCEPT_CASES], jnp.int32)
    q = None if draft_probs == "none" else one_hot_probs(drafts)
    n, nxt = accept_jit(jax.random.key(1), targets, drafts, q)
    assert n.tolist() == [c[2] for c in ACCEPT_CASES]
    assert nxt.tolist() == [c[3] for c in ACCEPT_CASES]
    for i, case in enumerate(ACCEPT_CASES):
        n1, nxt1 = accept_jit(jax.random.key(i), targets[i : i + 1], drafts[i : i + 1],
                          None if q is None else q[i : i + 1])
        assert (int(n1[0]), int(nxt1[0])) == (case[2], case[3])


def test_accept_zero_target_probability_always_rejects():
    """A draft the target gives probability 0 (e.g. cut by top-k) is never accepted, for any u;
    one the draft and target agree on with probability 1 is always accepted."""
    p = jnp.full((1, 2, V), 1.0 / (V - 1)).at[0, :, 3].set(0.0)
    drafts = jnp.asarray([[3]], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 2000)
    n, nxt = jax.jit(jax.vmap(lambda key: accept(key, p, drafts, None)))(keys)
    assert int(n.max()) == 0 and not bool(jnp.any(nxt == 3))
    q = one_hot_probs([[3]])
    p_sure = one_hot_probs([[3, 5]])
    n, nxt = jax.jit(jax.vmap(lambda key: accept(key, p_sure, drafts, q)))(keys)
    assert bool(jnp.all(n == 1)) and bool(jnp.all(nxt == 5))
