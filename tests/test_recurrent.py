"""Recurrent targets (issue 44): a target with a recurrent layer of its own, written only here.

`GatedRecurrentLM` is not Gated DeltaNet: layer 0 is a gated linear recurrence
h_t = a_t * h_parent + (1 - a_t) * u_t (a state per row, no keys/values), layer 1 is attention.
It meets the contract through `spec_jax.models.recurrent`'s helpers alone, so the contract is
general, not Qwen-specific:

- check_target passes (prefill + steps = one full forward, rollback after a partly accepted
  draft, a tree pass = the chain passes of its branches and a tree commit follows the path);
- greedy speculative decoding equals plain decoding with every drafter: n-gram, a draft model,
  a DFlash tree of 16, EAGLE-3 and Medusa at batch 4, n-gram, the draft model and DFlash chain at
  batch 1;
- an oracle drafter that hides the true continuation behind decoy siblings forces deep and
  shallow acceptances per row: after every commit each row's state equals plain decoding's state
  over the same tokens (1e-5, float32), and the output equals plain decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax
from spec_jax.decoding.loop import prefill, speculative_step
from spec_jax.drafters.tree import TreeDraft
from spec_jax.models import ForwardOutput, Target, init_params
from spec_jax.models.recurrent import last_committed_index, pass_parents, select_state
from spec_jax.sampling import SamplingParams
from spec_jax.testing import check_target
from conftest import make_prompts
from test_trees import OracleTreeDrafter as TreesOracle
from tiny_configs import TINY_DFLASH, TINY_DRAFT, VOCAB


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x, positions):
    half = x.shape[-1] // 2
    angle = positions[..., None].astype(jnp.float32) / 10000.0 ** (jnp.arange(half) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                            x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], axis=-1)


@dataclasses.dataclass(frozen=True)
class GatedRecurrentLM:
    """Layer 0: a gated linear recurrence (state [B, H] per row); layer 1: one-head attention
    with RoPE. Plain JAX, float32."""

    vocab_size: int = VOCAB
    hidden_size: int = 64
    num_layers: int = 2
    max_positions: int = 4096
    stop_ids: tuple[int, ...] = ()

    def init_params(self, key):
        names = ("gate", "input", "rec_out", "q", "k", "v", "attn_out")
        keys = jax.random.split(key, len(names) + 2)
        h = self.hidden_size
        params = {n: jax.random.normal(k, (h, h)) / np.sqrt(h) for n, k in zip(names, keys)}
        params["embed"] = jax.random.normal(keys[-2], (self.vocab_size, h))
        params["head"] = jax.random.normal(keys[-1], (h, self.vocab_size)) / np.sqrt(h) * 4
        return params

    def init_cache(self, batch, capacity):
        kv = jnp.zeros((batch, capacity, self.hidden_size))
        return {"state": jnp.zeros((batch, self.hidden_size)), "k": kv, "v": kv,
                "lengths": jnp.zeros((batch,), jnp.int32)}

    def cache_lengths(self, cache):
        return cache["lengths"]

    def recurrence(self, params, x, state, mask):
        """The state after each pass token [B, T, H]: each token continues its parent's state
        (the previous token in a chain, its tree parent in a tree)."""
        b, t, _ = x.shape
        gate = jax.nn.sigmoid(_rms(x) @ params["gate"])
        update = jnp.tanh(_rms(x) @ params["input"])
        parents = jnp.broadcast_to(pass_parents(mask, t), (b, t))
        rows = jnp.arange(b)

        def step(i, states):
            parent = parents[:, i]
            prev = jnp.where((parent >= 0)[:, None], states[rows, jnp.maximum(parent, 0)], state)
            return states.at[:, i].set(gate[:, i] * prev + (1 - gate[:, i]) * update[:, i])

        return jax.lax.fori_loop(0, t, step, jnp.zeros((b, t, self.hidden_size)))

    def forward(self, params, tokens, positions, cache, *, mask=None, capture=()):
        b, t = tokens.shape
        capacity = cache["k"].shape[1]
        x = params["embed"][tokens]
        states = self.recurrence(params, x, cache["state"], mask)
        x1 = x + states @ params["rec_out"]
        # Attention over the committed slots and the pass tokens the in-pass mask allows.
        h = _rms(x1)
        q, k, v = (h @ params[n] for n in ("q", "k", "v"))
        q, k = _rope(q, positions), _rope(k, positions)
        rows = jnp.arange(b)[:, None]
        slots = cache["lengths"][:, None] + jnp.arange(t)
        keys = cache["k"].at[rows, slots].set(k, mode="drop")
        values = cache["v"].at[rows, slots].set(v, mode="drop")
        in_pass = jnp.tril(jnp.ones((t, t), bool))[None] if mask is None else mask
        committed = jnp.arange(capacity)[None, None, :] < cache["lengths"][:, None, None]
        scores = jnp.concatenate([jnp.einsum("btd,bsd->bts", q, cache["k"]), jnp.einsum("btd,bsd->bts", q, k)], -1)
        visible = jnp.concatenate([jnp.broadcast_to(committed, (b, t, capacity)),
                                   jnp.broadcast_to(in_pass, (b, t, t))], -1)
        weights = jax.nn.softmax(jnp.where(visible, scores / 8.0, -1e30), axis=-1)
        attn = jnp.einsum("bts,bsd->btd", weights, jnp.concatenate([cache["v"], v], axis=1))
        x2 = x1 + attn @ params["attn_out"]
        layers = (x1, x2)
        captured = jnp.concatenate([layers[i] for i in capture], axis=-1) if capture else None
        # The pass record: the state after each pass token, for commit to choose from.
        new_cache = dict(cache, k=keys, v=values, pass_states=states)
        return ForwardOutput(_rms(x2), captured, new_cache)

    def logits(self, params, hidden):
        return (hidden @ params["head"]).astype(jnp.float32)

    def embed(self, params, tokens):
        return params["embed"][tokens]

    def commit(self, cache, lengths, path=None):
        state = cache["state"]
        if "pass_states" in cache:
            last = last_committed_index(cache["lengths"], lengths, path)
            state = select_state(state, cache["pass_states"], last)
        k, v = cache["k"], cache["v"]
        if path is not None:  # the kept nodes' keys/values to contiguous slots
            rows = jnp.arange(path.shape[0])[:, None]
            source = cache["lengths"][:, None] + path
            dest = cache["lengths"][:, None] + jnp.arange(path.shape[1])
            k = k.at[rows, dest].set(k[rows, source], mode="drop")
            v = v.at[rows, dest].set(v[rows, source], mode="drop")
        return {"state": state, "k": k, "v": v, "lengths": lengths.astype(jnp.int32)}

    def weight_specs(self):
        return None


@pytest.fixture(scope="module")
def recurrent_target():
    model = GatedRecurrentLM()
    return model, model.init_params(jax.random.key(0))


def test_check_target_passes_with_the_recurrent_checks(recurrent_target):
    passed = check_target(*recurrent_target, seq_len=8, capacity=16)
    assert "rollback after a partly accepted draft" in passed and "tree commit" in passed


def test_speculative_equals_plain_with_every_drafter(recurrent_target):
    """Every drafter kind at batch 4 (random drafters: rows reject at different depths in the same
    step); n-gram, the draft model and DFlash chain at batch 1."""
    model, params = recurrent_target
    prompts = make_prompts([5, 12, 3, 9], seed=3)
    draft_params = init_params(TINY_DRAFT, jax.random.key(1))
    dflash_params = spec_jax.init_dflash_params(TINY_DFLASH, jax.random.key(2))
    # EAGLE-3 reads both layers (aux ids 1, 2: the outputs of layers 0, 1), Medusa the last.
    eagle3 = spec_jax.Eagle3Config(layer=TINY_DRAFT, draft_vocab_size=VOCAB, aux_layer_ids=(1, 2),
                                   own_embedding=False, num_target_layers=model.num_layers)
    medusa = spec_jax.MedusaConfig(num_heads=3, hidden_size=model.hidden_size,
                                   num_target_layers=model.num_layers, vocab_size=VOCAB)
    ngram = (spec_jax.NGramDrafter(k=3), None)
    draft_model = (spec_jax.DraftModelDrafter(TINY_DRAFT, k=3), draft_params)
    cases = {
        "ngram": (ngram, 4), "draft model": (draft_model, 4),
        "dflash tree": ((spec_jax.DFlashDrafter(TINY_DFLASH, tree=16), dflash_params), 4),
        "eagle3": ((spec_jax.Eagle3Drafter(eagle3, k=3), spec_jax.init_eagle3_params(eagle3, jax.random.key(3), scale=3.0)), 4),
        "medusa": ((spec_jax.MedusaDrafter(medusa, k=3), spec_jax.init_medusa_params(medusa, jax.random.key(4), scale=3.0)), 4),
        "ngram b1": (ngram, 1), "draft model b1": (draft_model, 1),
        "dflash chain b1": ((spec_jax.DFlashDrafter(TINY_DFLASH), dflash_params), 1),
    }
    common = dict(max_new_tokens=16, capacity=64, ignore_eos=True)
    plain = spec_jax.generate((model, params), prompts, **common).generated_ids
    for name, ((drafter, drafter_params), batch) in cases.items():
        rows = slice(0, 4) if batch == 4 else slice(1, 2)
        out = spec_jax.generate((model, params), prompts[rows], drafter, drafter_params, **common)
        assert out.generated_ids == plain[rows], name
        assert out.stats.drafted > 0, name


def _decoy(token):
    return (token + 1) % VOCAB


def _wrong(token):
    return (token + 2) % VOCAB


@dataclasses.dataclass(frozen=True)
class DepthOracleDrafter(TreesOracle):
    """Knows the greedy continuation (its params: the plain run's token buffer [B, S]) and hides
    it behind a decoy first sibling at every depth; row b accepts depth (3 * lengths + b) % 4 per
    step (0 = none, 3 = all), each accepted node a later sibling. (The protocol's other members
    are test_trees' oracle's.)

    nodes 1..6: decoy(t1) <- root, t1 <- root, decoy(t2) <- 2, t2 <- 2, decoy(t3) <- 4, t3 <- 4
    (a token past the forced depth is replaced by a wrong one)."""

    k: int = 3
    tree: int = 6

    def propose_tree(self, params, target, state, tokens, lengths, key, sampling):
        batch, size = params.shape
        rows = jnp.arange(batch)
        depth = (3 * lengths + rows) % 4  # [B] the depth each row accepts this step
        truth = params[rows[:, None], jnp.minimum(lengths[:, None] + jnp.arange(3), size - 1)]  # [B, 3]
        true_or_wrong = jnp.where(jnp.arange(3) < depth[:, None], truth, _wrong(truth))
        nodes = jnp.stack([_decoy(truth), true_or_wrong], axis=2).reshape(batch, 6)
        parents = jnp.broadcast_to(jnp.asarray([0, 0, 2, 2, 4, 4], jnp.int32), (batch, 6))
        return TreeDraft(tokens=nodes.astype(jnp.int32), parents=parents), state

def test_oracle_tree_states_equal_plain_decoding_after_every_commit(recurrent_target):
    """Rows accept at depths 0..3 in the same step, through later siblings; after every step each
    row's recurrent state equals the state of a plain pass over its committed tokens (1e-5)."""
    model, params = recurrent_target
    prompts = make_prompts([5, 12, 3, 9], seed=4)
    capacity, new_tokens = 64, 14
    plain = spec_jax.generate((model, params), prompts, max_new_tokens=new_tokens, capacity=capacity,
                              ignore_eos=True).generated_ids
    truth = np.zeros((len(prompts), capacity), np.int32)
    for b, (p, g) in enumerate(zip(prompts, plain)):
        truth[b, : len(p) + len(g)] = p + g
    prompt_tokens, prompt_lengths = spec_jax.decoding.pad_prompts(prompts, 16)
    drafter, target = DepthOracleDrafter(), Target(params, model)
    stop_ids = jnp.asarray(spec_jax.decoding.stop_id_array([]))
    limit = jnp.int32(new_tokens)
    sampling = SamplingParams.create()
    state = jax.jit(prefill, static_argnames=("drafter", "capacity"))(
        target, drafter, jnp.asarray(truth), prompt_tokens, prompt_lengths, jax.random.key(0),
        sampling, limit, stop_ids, capacity=capacity)
    step = jax.jit(speculative_step, static_argnames="drafter")

    @jax.jit
    def plain_state(tokens, lengths):  # one pass over the committed tokens, committed per row
        positions = jnp.broadcast_to(jnp.arange(capacity), tokens.shape)
        out = model.forward(params, tokens, positions, model.init_cache(tokens.shape[0], capacity))
        return model.commit(out.cache, lengths)["state"]

    depths_seen = set()
    while not bool(jnp.all(state.done)):
        before = np.asarray(state.stats.accepted)
        state = step(state, target, drafter, jnp.asarray(truth), sampling, limit, stop_ids)
        depths_seen |= set((np.asarray(state.stats.accepted) - before).tolist())
        lengths = state.lengths - 1  # the cache holds all committed tokens but the last
        np.testing.assert_allclose(state.cache["state"], plain_state(state.tokens, lengths), atol=1e-5)
    assert depths_seen >= {0, 1, 2, 3}
    out_lengths = np.asarray(state.lengths)
    got = [np.asarray(state.tokens)[b, len(p): out_lengths[b]].tolist() for b, p in enumerate(prompts)]
    assert got == plain
