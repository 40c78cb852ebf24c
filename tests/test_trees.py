"""Token trees: the builders, the tree acceptance rule (exact in distribution for every candidate
mode), and greedy tree decoding token-identical to AR for every tree drafter.

Statistical tests fail only at p < 1e-4 (see test_sampling_stats.py); seeds are fixed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # hlo_text, tree_step_ops

from conftest import TINY_DFLASH, VOCAB, make_prompts
from spec_jax.decoding import generate
from spec_jax.decoding.acceptance import accept_tree
from spec_jax.drafters.dflash import DFlashDrafter, init_dflash_params
from spec_jax.drafters.draft_model import DraftModelDrafter
from spec_jax.drafters.lookup import LookupFirstDrafter
from spec_jax.drafters.ngram import NGramDrafter
from spec_jax.drafters.tree import (
    TreeDraft,
    best_first_tree,
    branch_first,
    check_tree_setting,
    select_best_nodes,
    static_tree,
    tree_from_logprobs,
)
from spec_jax.models.interface import ancestor_mask, tree_depths
from spec_jax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_eagle3_params
from spec_jax.drafters.medusa import MedusaConfig, MedusaDrafter, init_medusa_params
from test_sampling_stats import (  # noqa: F401  (e2e is a fixture)
    E2E_CFG,
    E2E_DFLASH_CFG,
    E2E_DRAFT_CFG,
    E2E_EAGLE3_CFG,
    E2E_EAGLE3_TARGET_IDS,
    PROMPT,
    V_E2E,
    chi_square_ok,
    e2e,
    exact_joint,
)


def tree_paths(tokens, parents):
    """One row's tree -> {node index: tuple of tokens from the root's child down to it}."""
    paths = {0: ()}
    for i, (t, p) in enumerate(zip(tokens, parents), start=1):
        assert 0 <= p < i, "a parent must precede its child"
        paths[i] = paths[int(p)] + (int(t),)
    return paths


# ------------------------------------------------------------------ builders
def test_best_first_tree_takes_the_highest_scoring_prefixes():
    """Against brute force: every prefix of ranks (<= width per depth) scored by its log-prob sum;
    the tree is the budget best, it is prefix-closed and siblings come in rank order. Then ties
    (rounded logits) and a vocabulary with fewer finite entries than the width (-inf scores):
    still the best scores, distinct nodes (the node-at-a-time loop took a -inf node twice)."""
    depth, vocab, width, budget = 3, 6, 3, 9
    logprobs = jax.nn.log_softmax(2.0 * jax.random.normal(jax.random.key(0), (2, depth, vocab)), -1)
    tree = best_first_tree(logprobs, budget, width)
    lp = np.asarray(logprobs)
    for row in range(2):
        order = np.argsort(-lp[row], axis=-1)[:, :width]
        scored = []
        for d in range(1, depth + 1):
            for ranks in itertools.product(range(width), repeat=d):
                toks = tuple(int(order[i, r]) for i, r in enumerate(ranks))
                scored.append((sum(lp[row, i, t] for i, t in enumerate(toks)), toks))
        best = sorted(scored, reverse=True)[:budget]
        paths = tree_paths(np.asarray(tree.tokens[row]), np.asarray(tree.parents[row]))
        assert sorted(paths.values())[1:] == sorted(t for _, t in best)
        scores = [sum(lp[row, i, t] for i, t in enumerate(paths[n])) for n in range(1, budget + 1)]
        assert np.all(np.diff(scores) <= 1e-6), "taken best first"

    ties = jax.nn.log_softmax(jnp.round(3.0 * jax.random.normal(jax.random.key(1), (1, 4, 8))), -1)
    masked = logprobs.at[:, :, 2:].set(-jnp.inf)  # 2 finite tokens per depth, width 3
    for lp, budget, width in ((ties, 20, 4), (masked, 12, 3)):
        tree = best_first_tree(lp, budget, width)
        lp = np.asarray(lp[0])
        paths = tree_paths(np.asarray(tree.tokens[0]), np.asarray(tree.parents[0]))
        assert len(set(paths.values())) == budget + 1, "distinct nodes"
        order = np.argsort(-lp, axis=-1, kind="stable")[:, :width]
        every = sorted((sum(lp[i, order[i, r]] for i, r in enumerate(ranks))
                        for d in range(1, lp.shape[0] + 1) for ranks in itertools.product(range(width), repeat=d)),
                       reverse=True)
        scores = [sum(lp[i, t] for i, t in enumerate(paths[n])) for n in range(1, budget + 1)]
        np.testing.assert_allclose(np.maximum(scores, -1e30), np.maximum(every[:budget], -1e30), atol=1e-5)
    with pytest.raises(ValueError, match="lower the tree budget or raise K"):
        check_tree_setting(20, 1, static_ok=True, name="DFlash")


def test_static_tree_follows_the_given_ranks():
    logprobs = jnp.log(jnp.asarray([[[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.2, 0.1]]]) + 1e-9)
    tree = static_tree(logprobs, [(0,), (1,), (0, 0), (0, 1), (1, 0)])
    paths = tree_paths(np.asarray(tree.tokens[0]), np.asarray(tree.parents[0]))
    assert sorted(paths.values()) == [(), (0,), (0, 1), (0, 2), (1,), (1, 1)]


def test_select_best_nodes_reindexes_parents_first():
    # Generated in level order: a(-1), b(-1), then a's child c, b's child d, c's child e.
    tokens = jnp.asarray([[10, 11, 12, 13, 14]])
    parents = jnp.asarray([[-1, -1, 0, 1, 2]])
    scores = jnp.asarray([[-0.1, -2.0, -0.5, -2.5, -0.9]])
    depths = jnp.asarray([[1, 1, 2, 2, 3]])
    tree = select_best_nodes(tokens, parents, scores, depths, 4)
    assert tree_paths(np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])) == {
        0: (), 1: (10,), 2: (10, 12), 3: (10, 12, 14), 4: (11,),
    }


def test_ngram_tree_branches_are_earlier_matches_merged_into_a_trie():
    # Suffix "1 2" occurs at 0 (-> 3 4), 4 (-> 3 5) and 8 (-> 7 7); the longest matches come
    # first, the latest first among equals.
    seq = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 7, 7, 1, 2]
    tokens = jnp.asarray([seq + [0] * 6])
    lengths = jnp.asarray([len(seq)])
    tree, _ = NGramDrafter(k=2, max_ngram=2, min_ngram=2, tree=6).propose_tree(
        None, None, (), tokens, lengths, None, None
    )
    paths = tree_paths(np.asarray(tree.tokens[0]), np.asarray(tree.parents[0]))
    assert set(paths.values()) == {(), (7,), (7, 7), (3,), (3, 5), (3, 4)}


def test_branch_first_puts_the_lookup_chain_first():
    tree = TreeDraft(tokens=jnp.asarray([[5, 6, 7, 8]] * 2), parents=jnp.asarray([[0, 1, 0, 2]] * 2))
    out = branch_first(tree, jnp.asarray([[1, 2]] * 2), jnp.asarray([True, False]))
    assert tree_paths(np.asarray(out.tokens[0]), np.asarray(out.parents[0])) == {
        0: (), 1: (1,), 2: (1, 2), 3: (5,), 4: (5, 6),
    }
    np.testing.assert_array_equal(out.tokens[1], tree.tokens[1])


def test_tree_settings_are_checked_before_compiling():
    with pytest.raises(ValueError, match="parent path"):
        DFlashDrafter(TINY_DFLASH, 4, tree=((0,), (1, 0)))
    with pytest.raises(ValueError, match="deeper than K"):
        DFlashDrafter(TINY_DFLASH, 1, tree=((0,), (0, 0)))
    with pytest.raises(ValueError, match="budget of N nodes|tuple of paths|not a list of paths"):
        NGramDrafter(k=2, tree=((0,),))
    with pytest.raises(ValueError, match=">= 0"):
        NGramDrafter(k=2, tree=-1)


# ------------------------------------------------------------------ acceptance, context-free
V_ACC, N_RUNS = 6, 40000
# Root -> 3 children; children 1 and 2 have 2 children each (max depth 2).
PARENTS = np.asarray([-1, 0, 0, 0, 1, 1, 2, 2])


def synthetic_target(key):
    """A tree over a context-free synthetic "target": P1[t] after token t, P2[t1, t2] after two,
    so nodes with the same path share p. Deterministic: distinct top tokens of a draft q; drawn
    modes: candidates sampled from q per parent (with or without replacement)."""
    k_p, k_q = jax.random.split(key)
    kp = jax.random.split(k_p, 3)
    p_root = jax.nn.softmax(1.5 * jax.random.normal(kp[0], (V_ACC,)))
    p1 = jax.nn.softmax(1.5 * jax.random.normal(kp[1], (V_ACC, V_ACC)), -1)
    p2 = jax.nn.softmax(1.5 * jax.random.normal(kp[2], (V_ACC, V_ACC, V_ACC)), -1)
    kq = jax.random.split(k_q, 2)
    q_root = jax.nn.softmax(jnp.log(p_root) + jax.random.normal(kq[0], (V_ACC,)))  # near p
    q1 = jax.nn.softmax(jax.random.normal(kq[1], (V_ACC, V_ACC)), -1)  # unrelated to p1
    return p_root, p1, p2, q_root, q1


def draw_tree(mode, p_root, p1, p2, q_root, q1, key):
    """Tokens [8], target probs per node [8, V], draft q per node [8, V] for one run."""
    keys = jax.random.split(key, 3)

    def children(q, n, k):
        if mode == "deterministic":
            return jnp.argsort(-q)[:n]
        if mode == "with_replacement":
            return jax.random.categorical(k, jnp.log(q), shape=(n,))
        return jax.random.choice(k, V_ACC, (n,), replace=False, p=q)

    c = children(q_root, 3, keys[0])  # nodes 1, 2, 3
    g1 = children(q1[c[0]], 2, keys[1])  # nodes 4, 5
    g2 = children(q1[c[1]], 2, keys[2])  # nodes 6, 7
    root_token = jnp.zeros((1,), jnp.int32)
    tokens = jnp.concatenate([root_token, c, g1, g2]).astype(jnp.int32)
    probs = jnp.stack([p_root, p1[c[0]], p1[c[1]], p1[c[2]],
                       p2[c[0], g1[0]], p2[c[0], g1[1]], p2[c[1], g2[0]], p2[c[1], g2[1]]])
    q = jnp.stack([q_root, q_root, q_root, q_root, q1[c[0]], q1[c[0]], q1[c[1]], q1[c[1]]])
    return tokens, probs, q


@pytest.mark.parametrize("mode", ["deterministic", "with_replacement", "without_replacement"])
def test_accept_tree_reproduces_target_distribution(mode):
    """Whatever the candidates, the first emitted token is ~ p_root, the next one after an
    accepted node c is ~ p(.|c), and the one after two accepted nodes ~ p(.|c, g)."""
    p_root, p1, p2, q_root, q1 = synthetic_target(jax.random.key(7))
    parents = jnp.asarray(PARENTS)

    def run(key):
        k_tree, k_acc = jax.random.split(key)
        tokens, probs, q = draw_tree(mode, p_root, p1, p2, q_root, q1, k_tree)
        n, nxt, path = accept_tree(
            k_acc, probs[None], tokens[None], parents[None], 2,
            None if mode == "deterministic" else q[None], mode,
        )
        emitted = jnp.concatenate([tokens[path[0, 1:]], jnp.zeros((1,), jnp.int32)])
        emitted = emitted.at[n[0]].set(nxt[0])
        return emitted, n[0]

    emitted, n = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(8), N_RUNS))
    emitted, n = np.asarray(emitted), np.asarray(n)
    p_root, p1, p2 = np.asarray(p_root), np.asarray(p1), np.asarray(p2)
    chi_square_ok(np.bincount(emitted[:, 0], minlength=V_ACC), p_root, f"{mode}: first token")
    for c in range(V_ACC):
        after_c = emitted[(n >= 1) & (emitted[:, 0] == c), 1]
        if len(after_c) >= 500:
            chi_square_ok(np.bincount(after_c, minlength=V_ACC), p1[c], f"{mode}: after {c}")
    deep = n >= 2
    for c, g in {(int(a), int(b)) for a, b in emitted[deep, :2]}:
        sel = deep & (emitted[:, 0] == c) & (emitted[:, 1] == g)
        if sel.sum() >= 500:
            chi_square_ok(np.bincount(emitted[sel, 2], minlength=V_ACC), p2[c, g], f"{mode}: after {c},{g}")
    assert 0.05 < (n >= 1).mean() < 1 and (n == 2).mean() > 0.01, "the tree was exercised"


def test_accept_tree_greedy_takes_a_later_sibling_and_the_longest_path():
    # Greedy target: argmax 3 at the root, then 4 after 3, then 5 after 3, 4.
    tokens = jnp.asarray([[9, 1, 3, 4, 5, 4]])
    parents = jnp.asarray([[-1, 0, 0, 1, 3, 2]])  # 3 (node 2) has child 4 (node 5)
    argmax = jnp.asarray([3, 0, 4, 0, 0, 5])
    probs = jax.nn.one_hot(argmax, 8)[None]
    n, nxt, path = accept_tree(jax.random.key(0), probs, tokens, parents, 3)
    assert int(n[0]) == 2 and int(nxt[0]) == 5
    np.testing.assert_array_equal(path[0], [0, 2, 5, 0])


# ------------------------------------------------------------------ greedy end to end
NEW = 40
REPEAT = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
PROMPTS = {
    1: make_prompts([3], seed=0),
    3: make_prompts([3, 16], seed=0) + [REPEAT],
    8: make_prompts([3, 16, 1, 12, 5, 9], seed=0) + [REPEAT, [72, 72, 72]],
}


@dataclasses.dataclass(frozen=True)
class OracleTreeDrafter:
    """A test drafter with per-position distributions that know the answer: its params are the
    AR outputs, and at every other depth a decoy outranks the true token, so best-first
    trees accept deep paths through later siblings (stressing the tree commit)."""

    k: int = 4
    tree: object = 8
    vocab: int = VOCAB

    @property
    def capture_layers(self):
        return ()

    def weight_specs(self):
        return None

    def validate(self, target, capacity):
        pass

    def init(self, params, target, prompt_tokens, prompt_lengths, prefill_captured, capacity):
        return ()

    def propose_tree(self, params, target, state, tokens, lengths, key, sampling):
        batch = tokens.shape[0]
        pos = jnp.minimum(lengths[:, None] + jnp.arange(self.k), params.shape[1] - 1)
        truth = params[jnp.arange(batch)[:, None], pos]  # [B, K]
        decoys = jax.random.randint(key, (batch, self.k, 2), 0, self.vocab)
        b, d = jnp.arange(batch)[:, None], jnp.arange(self.k)
        # Odd depths: a decoy ranks first and the truth second; even depths: the truth first.
        scores = jnp.full((batch, self.k, self.vocab), -6.0)
        scores = scores.at[b, d, decoys[:, :, 1]].set(-3.0)
        scores = scores.at[b, d, decoys[:, :, 0]].set(jnp.where(d % 2 == 1, -0.1, -3.0))
        scores = scores.at[b, d, truth].set(jnp.where(d % 2 == 1, -0.2, -0.1))
        return tree_from_logprobs(scores, self.tree, width=4), state

    def commit(self, params, target, state, start, num_accepted, verify_captured):
        return state


@pytest.fixture(scope="module")
def ar(models):
    return {b: generate(models.target, p, max_new_tokens=NEW) for b, p in PROMPTS.items()}


def oracle_params(ar_result, prompts, width=128):
    rows = [p + g for p, g in zip(prompts, ar_result.generated_ids)]
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return jnp.asarray(out)


# Every tree drafter at two of the batch sizes 1, 3 and 8 and two of the budgets 8, 16 and 32 (the
# budget turns with the batch; each batch size and budget meets four drafters: every case is a
# compile of its own, so not all nine pairs per drafter), plus an oracle that forces deep paths
# through later siblings.
TREE_DRAFTERS = ["dflash", "dflash_lookup", "ngram", "draft", "eagle3", "medusa"]
TREE_CASES = [("oracle", 8, 3), ("oracle", 32, 1), ("oracle", 16, 8)] + [
    (name, (8, 16, 32)[(i + j) % 3], batch)
    for i, name in enumerate(TREE_DRAFTERS) for j, batch in enumerate((1, 3, 8)) if j != i % 3
]


@pytest.mark.parametrize("name,budget,batch", TREE_CASES, ids=[f"{n}-n{t}-b{b}" for n, t, b in TREE_CASES])
def test_greedy_tree_equals_ar(models, drafters, ar, name, budget, batch):
    prompts = PROMPTS[batch]
    if name == "oracle":
        drafter, params = OracleTreeDrafter(k=4, tree=budget), oracle_params(ar[batch], prompts)
    elif name == "dflash":
        drafter = DFlashDrafter(TINY_DFLASH, 4, tree=budget)
        params = drafters["dflash_lookup"][1]
    elif name == "dflash_lookup":
        drafter = LookupFirstDrafter(DFlashDrafter(TINY_DFLASH, 4, tree=budget), min_match=1)
        params = drafters["dflash_lookup"][1]
    elif name == "ngram":
        drafter, params = NGramDrafter(k=4, tree=budget), None
    elif name == "draft":
        drafter, params = DraftModelDrafter(models.draft_cfg, 4, tree=budget), models.draft_params
    elif name == "eagle3":
        cfg = Eagle3Config(layer=models.draft_cfg, draft_vocab_size=VOCAB, aux_layer_ids=(1, 2),
                           speculative_tokens=4)
        drafter = Eagle3Drafter(cfg, tree=budget)
        params = init_eagle3_params(cfg, jax.random.key(5), scale=3.0)
    else:  # medusa
        cfg = MedusaConfig.for_target(models.cfg, num_heads=4)
        drafter, params = MedusaDrafter(cfg, k=4, tree=budget), init_medusa_params(cfg, jax.random.key(6), scale=3.0)
    r = generate(models.target, prompts, drafter, params, max_new_tokens=NEW)
    assert r.generated_ids == ar[batch].generated_ids
    s = r.stats
    assert s.drafted == budget * s.steps and sum(s.acceptance_histogram) == s.steps
    assert s.accepted == sum(i * h for i, h in enumerate(s.acceptance_histogram))
    if name == "oracle":
        assert s.tau > 2.0, f"{name}: deep paths should be accepted (tau {s.tau:.2f})"


def test_tree_option_errors(models):
    with pytest.raises(ValueError, match="drafts chains only"):
        from table_drafter import TableDrafter

        generate(models.target, PROMPTS[1], TableDrafter(vocab=128), None, max_new_tokens=4, tree=8)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(models.target, PROMPTS[1], max_new_tokens=4, tree=8)


def test_node_depths():
    """A tree's depths are its ancestor mask's row sums less one (the root's is 0)."""
    parents = jnp.asarray([[-1, 0, 1, 0, 3, 2]])
    np.testing.assert_array_equal(tree_depths(ancestor_mask(parents)), [[0, 1, 2, 1, 2, 3]])


def random_trees(rng, batch, nodes, chain_bias=0.0):
    """[B, N] parents (-1 for in-pass index 0, else an earlier node): random trees, biased towards
    deep chains by `chain_bias` (the probability a node's parent is the node just before it)."""
    parents = np.full((batch, nodes), -1, np.int32)
    for b, i in itertools.product(range(batch), range(1, nodes)):
        parents[b, i] = i - 1 if rng.random() < chain_bias else rng.integers(0, i)
    return parents


def test_ancestor_mask_equals_the_walk_up_on_random_forests():
    """Pointer doubling against following each node's parents one generation at a time, on trees
    from flat to a single chain (the deepest path, N - 1 generations) and on forests (several -1s)."""
    rng = np.random.default_rng(0)
    for nodes, bias in [(1, 0.0), (2, 1.0), (5, 0.5), (17, 1.0), (33, 0.0), (33, 0.9), (64, 1.0)]:
        parents = random_trees(rng, 3, nodes, bias)
        parents[2, nodes // 2:] = np.where(rng.random(nodes - nodes // 2) < 0.3, -1, parents[2, nodes // 2:])
        expected = np.zeros((3, nodes, nodes), bool)
        for b, i in itertools.product(range(3), range(nodes)):
            j = i
            while j >= 0:
                expected[b, i, j] = True
                j = parents[b, j]
        np.testing.assert_array_equal(ancestor_mask(jnp.asarray(parents)), expected)
        np.testing.assert_array_equal(tree_depths(ancestor_mask(jnp.asarray(parents))), expected.sum(-1) - 1)


def reference_walk(drawn, tokens, parents, max_depth):
    """The greedy tree walk one depth at a time (numpy): from the root, move to the first child
    (index order) whose token is the current node's draw, up to max_depth times."""
    batch, nodes = tokens.shape
    num, nxt, path = np.zeros(batch, np.int32), np.zeros(batch, np.int32), np.zeros((batch, max_depth + 1), np.int32)
    for b in range(batch):
        cur = 0
        for d in range(1, max_depth + 1):
            child = next((i for i in range(1, nodes) if parents[b, i] == cur and tokens[b, i] == drawn[b, cur]), None)
            if child is None:
                break
            cur, num[b], path[b, d] = child, d, child
        nxt[b] = drawn[b, cur]
    return num, nxt, path


def test_greedy_tree_acceptance_equals_the_walk_on_random_trees():
    """The all-nodes-at-once acceptance against the walk, on random trees with few token values
    (siblings often share a token: lookup branches in front of a tree do), deep chains, and a
    max_depth that cuts some paths."""
    rng = np.random.default_rng(1)
    deepest = []
    for nodes, bias, values, max_depth in [(2, 1.0, 2, 1), (9, 0.5, 2, 3), (17, 0.8, 3, 16), (33, 0.3, 2, 15),
                                           (33, 0.95, 2, 6), (33, 0.0, 4, 2)]:
        parents = random_trees(rng, 8, nodes, bias)
        tokens = rng.integers(0, values, (8, nodes)).astype(np.int32)
        drawn = rng.integers(0, values, (8, nodes)).astype(np.int32)
        node = nodes - 1  # row 0 draws what leads to its last node (an earlier sibling may divert it)
        while node > 0:
            drawn[0, parents[0, node]], node = tokens[0, node], parents[0, node]
        probs = jax.nn.one_hot(drawn, values)  # greedy: each node's draw is its argmax
        n, nxt, path = accept_tree(jax.random.key(0), probs, jnp.asarray(tokens), jnp.asarray(parents), max_depth)
        ref_n, ref_nxt, ref_path = reference_walk(drawn, tokens, parents, max_depth)
        np.testing.assert_array_equal(n, ref_n)
        np.testing.assert_array_equal(nxt, ref_nxt)
        np.testing.assert_array_equal(path, ref_path)
        deepest.append(int(ref_n.max()))
    assert max(deepest) >= 8 and deepest[-1] == 2, f"deep walks and cut ones were exercised: {deepest}"


# ------------------------------------------------------------------ sampling end to end
@pytest.mark.parametrize("drafter_kind,temperature,top_k,top_p", [
    # dflash_lookup: lookup branches where t1 recurs in the prompt, DFlash's best-first tree elsewhere
    ("dflash_lookup", 0.7, 0, 1.0), ("draft_model", 1.0, 3, 0.8), ("eagle3", 0.7, 3, 1.0),
])
def test_tree_sampling_reproduces_target_joint_distribution(e2e, drafter_kind, temperature, top_k, top_p):
    """The first 3 tokens (prefill token + tree steps of depth <= 2, 6 nodes, widths >= 2) over
    3 seeds x 2048 rows against the exact warped joint (as test_sampling_stats does for chains)."""
    params, draft_params, logits = e2e
    k, budget = 2, 6
    if drafter_kind == "dflash_lookup":
        drafter = LookupFirstDrafter(DFlashDrafter(E2E_DFLASH_CFG, tree=budget), min_match=1, max_ngram=2)
        dparams = init_dflash_params(E2E_DFLASH_CFG, jax.random.key(12), scale=1.5)
    elif drafter_kind == "eagle3":
        drafter = Eagle3Drafter(E2E_EAGLE3_CFG, tree=budget)
        dparams = init_eagle3_params(E2E_EAGLE3_CFG, jax.random.key(13), scale=1.5)
        dparams["d2t"] = jnp.asarray(E2E_EAGLE3_TARGET_IDS - np.arange(6), jnp.int32)
    else:
        drafter, dparams = DraftModelDrafter(E2E_DRAFT_CFG, k, tree=budget), draft_params
    counts = np.zeros((V_E2E,) * 3)
    accepted = 0
    for seed in range(3):
        r = generate((E2E_CFG, params), [PROMPT] * 2048, drafter, dparams, max_new_tokens=3,
                     temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, capacity=32)
        ids = np.asarray(r.generated_ids)
        np.add.at(counts, tuple(ids.T), 1)
        accepted += r.stats.accepted
    assert accepted > 0
    chi_square_ok(counts, exact_joint(logits, temperature, top_k, top_p), f"{drafter_kind} tree joint")


# ------------------------------------------------------------------ streaming and the engine
def test_trees_stream_and_serve_like_generate(models, drafters, ar):
    """A tree drafter through `generate_stream` (chunks of 2 steps) and through the engine
    (requests arriving while others decode) gives plain decoding's tokens."""
    from spec_jax.decoding.engine import Engine
    from spec_jax.decoding.stream import generate_stream

    prompts = PROMPTS[3]
    drafter = LookupFirstDrafter(DFlashDrafter(TINY_DFLASH, 4, tree=8), min_match=1)
    params = drafters["dflash_lookup"][1]
    streamed = [[] for _ in prompts]
    for update in generate_stream(models.target, prompts, drafter, params, max_new_tokens=NEW, chunk_steps=2):
        for row, ids in enumerate(update.new_ids):
            streamed[row] += ids
    assert streamed == ar[3].generated_ids

    engine = Engine(models.target, NGramDrafter(k=4, tree=8), slots=2, max_model_len=64, chunk_steps=2)
    ids = [engine.submit(p, max_new_tokens=NEW) for p in prompts]  # 3 requests, 2 slots
    out = engine.run_all()
    assert [out[i].new_ids for i in ids] == ar[3].generated_ids
    assert all(out[i].stats.drafted == 8 * out[i].stats.steps for i in ids)


def test_default_tree_choice_follows_the_measured_table():
    """The tree rule reads the table's tree section like the drafter's: per backend and mode, the
    first entry covering the batch; an unmeasured backend or mode gets the fallback (the CLI's
    default spec carrying it: tests/test_cli.py::test_default_drafter_spec_follows_the_table)."""
    from spec_jax.checkpoints import shipped

    table = {"tree": {"backends": {"cpu": {"greedy": [{"up_to_batch": 1, "tree": 16, "why": "one"},
                                                      {"up_to_batch": None, "tree": 0, "why": "more"}]}},
                      "unmeasured": [{"up_to_batch": None, "tree": 0, "why": "fallback"}]}}
    assert shipped.default_tree_choice(1, 0.0, backend="cpu", table=table) == (16, "one")
    assert shipped.default_tree_choice(4, 0.0, backend="cpu", table=table) == (0, "more")
    assert shipped.default_tree_choice(1, 0.7, backend="cpu", table=table) == (0, "fallback")
    assert shipped.default_tree_choice(1, 0.0, backend="gpu", table=table) == (0, "fallback")


def test_the_two_stage_top_k_equals_lax_top_k_values_indices_and_ties():
    """tree.top_k takes a CPU vocabulary in two stages (chunk maxima, then the best chunks): the
    same values and indices as jax.lax.top_k, ties to the lower index, -inf rows included."""
    from spec_jax.drafters.tree import chunked_top_k, top_k

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4096)).astype(np.float32)
    tied = np.round(x * 2) / 2  # many exact ties, across and within chunks
    tied[1, 2] = -np.inf  # a fully masked row: every chunk maximum ties
    tied[0, 1, ::7] = tied[0, 1].max()  # the maximum many times over
    check = jax.jit(lambda v, k: (chunked_top_k(v, k), top_k(v, k), jax.lax.top_k(v, k)), static_argnums=1)
    for values in (x, tied):
        for k in (1, 8, 32):
            *got, want = check(jnp.asarray(values), k)
            for g in got:
                np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(want[0]))
                np.testing.assert_array_equal(np.asarray(g[1]), np.asarray(want[1]))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU compiler regression guard")
def test_tree_builders_keep_top_k_off_a_full_vocabulary_sort():
    """XLA:CPU folded the gathers that read best_first_tree's top-k into the sort top_k expands to,
    sorting the whole vocabulary every step (40-70 ms at 7 x 49k, slower than the DFlash pass);
    tree.top_k keeps it a top-k."""
    vocab = 4096
    logprobs = jnp.zeros((1, 7, vocab))
    for build in (lambda lp: best_first_tree(lp, 16), lambda lp: static_tree(lp, ((0,), (1,), (0, 0)))):
        hlo = jax.jit(build).lower(logprobs).compile().as_text()
        sorts = [line for line in hlo.splitlines() if " sort(" in line and str(vocab) in line]
        assert not sorts, sorts[0]


def launched_ops(fn, *args) -> int:
    """Operations fn's optimized (CPU) program launches: fusions, gathers, sorts... (a proxy for a
    GPU's kernels), not the instructions that only name or pack buffers."""
    from hlo_text import entry_computation, launched

    return launched(entry_computation(jax.jit(fn).lower(*args).compile().as_text()))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU compiler regression guard")
def test_a_trees_mask_and_walk_do_not_grow_a_round_per_node_or_depth():
    """The ancestor mask takes log2(N) rounds and the greedy acceptance none per depth: a tree of
    32 ran ~140 more small kernels a step than the chain on the H100 while they took a round per
    node (the mask, the depths) and per depth (the walk) (RESULTS.md, issue 46)."""
    def mask_ops(n):
        return launched_ops(ancestor_mask, jnp.zeros((1, n), jnp.int32))

    def walk_ops(n, depth):
        return launched_ops(lambda p, t, par: accept_tree(jax.random.key(0), p, t, par, depth),
                            jnp.zeros((1, n, 64)), jnp.zeros((1, n), jnp.int32), jnp.zeros((1, n), jnp.int32))

    assert mask_ops(129) - mask_ops(33) <= 6, "two more doublings, not 96 more rounds"
    assert walk_ops(33, 32) - walk_ops(33, 4) <= 2, "no round per depth"


def test_tree_step_ops_counts_each_programs_launched_ops(tmp_path):
    """benchmarks/tree_step_ops.py on random:tiny: each program's loop body counted by scope, and
    the backend's own cache attention back afterwards."""
    import tree_step_ops
    from spec_jax.models import attention

    chosen = dict(attention.LIVE_ATTENTION)
    out = tmp_path / "ops.json"
    assert tree_step_ops.main(["--trees", "0,8", "--block-size", "4", "--context", "16", "--new-tokens", "2",
                               "--repeats", "1", "--json", str(out)]) == 0
    assert attention.LIVE_ATTENTION == chosen
    programs = json.loads(out.read_text())["programs"]
    assert set(programs) == {"plain", "chain K=3", "tree 8"}
    for label, row in programs.items():
        assert row["launched"] == sum(row["by_scope"].values()) > 0 and "step_ms" in row
        assert row["by_scope"].get("verify", 0) > 0, label
    assert programs["tree 8"]["by_scope"].get("draft", 0) > 0 and programs["tree 8"]["by_scope"].get("accept", 0) > 0
    for row in programs.values():
        assert row["switches"] == len(row["switch_branches"])
        assert row["in_largest_branches"] == sum(max(b) for b in row["switch_branches"])


def test_switch_branches_are_counted_apart_from_the_loop_body():
    """`hlo_text.switch_branches_launched`: each switch (or cond) in the loop body, what each of
    its branches launches, in index order, a branch with more work counting more."""
    import hlo_text

    x = jnp.ones((8, 8))
    switch = jax.jit(lambda x, i: jax.lax.fori_loop(0, 3, lambda _, x: jax.lax.switch(
        i, [lambda x: x, lambda x: jnp.sin(x) @ x, lambda x: (jnp.exp(x) @ x.T) @ jnp.tanh(x)], x), x))
    (counts,) = hlo_text.switch_branches_launched(switch.lower(x, 1).compile().as_text())
    assert len(counts) == 3 and counts[0] < counts[1] < counts[2]
    cond = jax.jit(lambda x, p: jax.lax.fori_loop(0, 3, lambda _, x: jax.lax.cond(
        p, lambda x: jnp.sin(x) @ x, lambda x: x * 2, x), x))
    (counts,) = hlo_text.switch_branches_launched(cond.lower(x, True).compile().as_text())
    assert len(counts) == 2 and counts[0] < counts[1]  # index 0: the false branch


def test_tree_top_k_costs_time_both_top_ks_and_check_they_agree():
    """The GPU profile's top-k probe: XLA's top-k and the two-stage one over a vocabulary the
    two-stage one takes (a multiple of its chunk, at least k chunks), timed and compared."""
    from tree_step_ops import top_k_costs

    got = top_k_costs(rows=3, vocab=2048, k=8, calls=2)
    assert got["equal"] is True and {"lax.top_k_ms", "chunked_top_k_ms"} <= set(got)
    assert "chunked_top_k_ms" not in top_k_costs(rows=3, vocab=1000, k=8, calls=1)  # not a multiple of 128
